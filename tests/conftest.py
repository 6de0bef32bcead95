"""Shared fixtures: small corpora written on the fly, and the shared real-data folder."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GATEDFORMER_DATA", REPO.parent / "shared" / "data"))

torch.set_num_threads(min(2, torch.get_num_threads()))
# Built kernels are shared by every test and subprocess of a session (tests that give a run its own data cache
# included), and kept for the next session in this checkout: they are named by a hash of their sources and flags.
os.environ.setdefault("GATEDFORMER_KERNEL_CACHE", str(REPO / ".pytest_cache" / "gatedformer-kernels"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Token caches and verification stamps go to a per-session folder, never the user's home.
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    # A corpus a test hides is missing on purpose: never fetched on first use (tests/test_first_use_fetch.py turns
    # fetching back on against a local server).
    monkeypatch.setenv("GATEDFORMER_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _loss_plot_only_where_asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # train() draws loss.png at the end of every run, a matplotlib figure each (about 0.3 s), and the suite trains
    # hundreds of runs; the tests that check the figure ask for it with @pytest.mark.loss_plot.
    if request.node.get_closest_marker("loss_plot") is None:
        monkeypatch.setattr("gatedformer.train.loop.write_loss_curve", lambda *args, **kwargs: None)


def _single_thread() -> Iterator[None]:
    # The models in the tests are tiny: on a shared 2-core machine a second thread only waits for the first (and
    # the subprocesses some tests compare against run with OMP_NUM_THREADS=1, bit for bit).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


one_thread = pytest.fixture(_single_thread, name="one_thread")
"""One intra-op thread for a test: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
one_thread_module = pytest.fixture(_single_thread, name="one_thread_module", scope="module")
"""One intra-op thread for a whole module, its module-scoped fixtures (e.g. trained runs) included."""


@pytest.fixture
def kernel_build(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """``use(kernel, isa)`` loads that instruction set's build of a compiled kernel in place of the one this CPU
    picks, for the rest of the test (and skips the test where the CPU or compiler lacks it; a build that fails
    under ``GATEDFORMER_REQUIRE_NATIVE=1`` fails the test instead)."""
    def use(kernel, isa: str):  # noqa: ANN001, ANN202
        from gatedformer.kernels.build import KernelUnavailable

        try:
            lib = kernel.library_for(isa)
        except KernelUnavailable:
            raise
        except RuntimeError as err:
            pytest.skip(str(err))
        monkeypatch.setattr(kernel, "_lib", lib)
        return lib

    return use


@pytest.fixture
def text_corpus(tmp_path: Path) -> str:
    """A ``text:`` corpus of a few thousand characters with learnable structure."""
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "in", "sun"]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(words), (3000,), generator=generator).tolist()
    lines = [" ".join(words[i] for i in picks[j : j + 8]) + "." for j in range(0, len(picks), 8)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"text:{path}"


def sets(overrides: list[str]) -> list[str]:
    """``--set`` arguments for the command line, one pair per override."""
    return [arg for o in overrides for arg in ("--set", o)]


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    """The one line a refused command printed on stderr: ``gatedformer: error: ...``, no traceback."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("gatedformer: error: ") and "Traceback" not in lines[0]
    return lines[0]


def tiny_overrides(corpus: str, steps: int = 12) -> list[str]:
    """A model and loop small enough that a run takes a second or two."""
    return [
        f"data.corpus={corpus}", "data.batch_size=4", "data.seq_len=16", "data.eval_batch_size=4",
        "data.eval_seq_len=16", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ffn=32",
        f"train.steps={steps}", "train.eval_every=4", "train.log_every=1", "train.eval_windows=3",
        "optim.lr=0.01", "optim.schedule=linear",
    ]


def for_backbone(backbone: str, overrides: list[str], task: str = "lm") -> list[str]:
    """``model.backbone=backbone`` and ``overrides`` less the ``[model]`` fields that backbone never reads (validation
    refuses them): one list of sizes for every backbone."""
    from gatedformer.config import get_backbone

    reads = get_backbone(backbone, task).fields
    return [f"model.backbone={backbone}",
            *(o for o in overrides if not o.startswith("model.") or o[len("model."):].partition("=")[0] in reads)]


def needs_shared(*relative: str) -> pytest.MarkDecorator:
    missing = [r for r in relative if not (SHARED_DATA / r).is_file()]
    return pytest.mark.skipif(bool(missing), reason=f"real corpus files not found under {SHARED_DATA}: {missing}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder served over HTTP on localhost, and its address."""
    root = tmp_path / "served"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
