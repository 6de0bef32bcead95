"""File integrity and hostile input (issue 51): vocabulary and tokenizer files, token-id caches and built kernel
libraries are checked against the checksums recorded when they were written; a Hub endpoint that never answers, bytes
that are not UTF-8 and a hostile pickle are one line; and the messages of an export folder given as a run, of two
exports into one folder and of a file given as the data folder name the real cause."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import sets, tiny_overrides

import gatedformer
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.errors import CheckpointError, ConfigError
from gatedformer.io import FolderLock
from gatedformer.pretrained import EXPORT_LOCK

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "in", "sun"]


def _one_line_error(err: str, fragment: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "warning" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("gatedformer: error: ") and fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A corpus, a trained language-model run, its export and a trained masked-LM run, made once for the module
    (with the session's cache folder, as every test has it)."""
    root = tmp_path_factory.mktemp("files")
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(WORDS), (3000,), generator=generator).tolist()
    lines = [" ".join(WORDS[i] for i in picks[j: j + 8]) + "." for j in range(0, len(picks), 8)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = f"text:{root / 'corpus.txt'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GATEDFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        torch.set_num_threads(1)
        assert main(["train", "--recipe", "ptb-char-tiny", *sets(tiny_overrides(corpus, steps=4)),
                     "--out", str(root / "lm")]) == 0
        assert main(["export", "--run", str(root / "lm"), "--out", str(root / "export")]) == 0
        mlm = [f"data.corpus={corpus}", "data.seq_len=24", "data.batch_size=4", "data.eval_batch_size=8",
               "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.max_positions=32",
               "tokenizer.vocab_size=80", "train.steps=2", "train.eval_every=2", "train.eval_windows=2",
               "train.threads=1"]
        assert main(["train", "--recipe", "bert-mlm-tiny", *sets(mlm), "--out", str(root / "mlm")]) == 0
        (root / "mlm.overrides").write_text("\n".join(mlm), encoding="utf-8")
        yield root


# ---- vocabulary and tokenizer files -----------------------------------------------------------------------------

def test_a_changed_vocabulary_of_an_export_is_refused_naming_the_file(workspace: Path, tmp_path: Path) -> None:
    export = shutil.copytree(workspace / "export", tmp_path / "export")
    before = gatedformer.from_pretrained(export, device="cpu").generate("the ", max_tokens=20, seed=3)
    record = json.loads((export / "vocab.json").read_text(encoding="utf-8"))
    itos = record["vocab"]["itos"]
    a, c = itos.index("a"), itos.index("c")
    itos[a], itos[c] = itos[c], itos[a]  # two letters swapped: still a vocabulary, but of other text
    (export / "vocab.json").write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"vocab\.json does not match the checksum .*model\.safetensors"):
        gatedformer.from_pretrained(export, device="cpu")
    shutil.copy(workspace / "export" / "vocab.json", export / "vocab.json")  # the file as exported loads again
    assert gatedformer.from_pretrained(export, device="cpu").generate("the ", max_tokens=20, seed=3) == before


def test_an_export_whose_weights_record_no_vocabulary_checksums_is_refused(workspace: Path, tmp_path: Path) -> None:
    from gatedformer.data.verify import FILES_KEY
    from gatedformer.train.checkpoint import read_tensors, write_tensors

    export = shutil.copytree(workspace / "export", tmp_path / "export")
    weights = export / "model.safetensors"
    tensors, metadata = read_tensors(weights)
    assert "vocab.json" in json.loads(metadata.pop(FILES_KEY))
    write_tensors(tensors, weights, {k: v for k, v in metadata.items() if k != "weights_sha256"})  # still checks
    with pytest.raises(CheckpointError, match=r"records no checksum of vocab\.json"):
        gatedformer.from_pretrained(export, device="cpu")


def test_a_changed_tokenizer_of_a_run_is_one_line_naming_the_file(workspace: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = shutil.copytree(workspace / "mlm", tmp_path / "mlm")
    tokenizer = json.loads((run / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    first, second = [piece for piece in vocab if piece in WORDS][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (run / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    capsys.readouterr()
    assert main(["fill-mask", "--run", str(run), "--text", "the [MASK] sat", "--device", "cpu"]) == 2
    _one_line_error(capsys.readouterr().err, f"{run / 'tokenizer.json'} does not match the checksum")
    # nor does a run that starts from it take that tokenizer
    overrides = (workspace / "mlm.overrides").read_text(encoding="utf-8").split("\n")
    assert main(["train", "--recipe", "bert-mlm-tiny", *sets([*overrides, f"train.init_from={run}"]),
                 "--out", str(tmp_path / "again")]) == 2
    _one_line_error(capsys.readouterr().err, f"{run / 'tokenizer.json'} does not match the checksum")


# ---- the token-id caches ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("run", "folder"), [("lm", "tokens"), ("mlm", "wordpiece")])
def test_a_damaged_token_cache_entry_is_rebuilt_never_used(run: str, folder: str, workspace: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    args = ["eval", "--run", str(workspace / run), "--split", "valid", "--device", "cpu"]
    assert main(args) == 0  # builds the cache entry
    scored = json.loads(capsys.readouterr().out)
    [valid] = (tmp_path / "cache" / folder).glob("*.valid.npy")
    ids = np.load(valid)
    changed = ids.copy()
    changed[: len(ids) // 2] = ids[len(ids) // 2: 2 * (len(ids) // 2)]  # other ids, every one in the vocabulary
    assert not np.array_equal(changed, ids)
    np.save(valid, changed)
    with pytest.warns(UserWarning, match="does not match the checksum recorded when it was written") as said:
        assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == scored
    assert [str(w.message) for w in said if str(valid) in str(w.message)]
    assert np.array_equal(np.load(valid), ids)  # rebuilt


# ---- built kernel libraries -------------------------------------------------------------------------------------

def test_a_changed_kernel_library_is_rebuilt_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.kernels.build import NativeKernel, native_required

    cxx = (os.environ.get("CXX") or "c++").split()
    if shutil.which(cxx[0]) is None:
        if native_required():
            pytest.fail("no C++ compiler while GATEDFORMER_REQUIRE_NATIVE=1 is set")
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GATEDFORMER_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("GATEDFORMER_KERNEL_ISA", "baseline")  # one build is enough
    monkeypatch.delenv("GATEDFORMER_GATE_BACKEND", raising=False)

    def kernel() -> NativeKernel:
        return NativeKernel("gate", abi_version=4, env_var="GATEDFORMER_GATE_BACKEND", description="the gate kernel",
                            fallback="PyTorch")

    assert kernel().library() is not None
    [library] = (tmp_path / "cache" / "kernels").glob("*.so")
    record = library.with_name(library.name + ".sha256")
    built = library.read_bytes()
    assert record.read_text().strip() == hashlib.sha256(built).hexdigest()

    def changed() -> None:  # still loads, but is not what was built (a new file: the loaded one stays mapped)
        (tmp_path / "changed.so").write_bytes(built + b"\0" * 64)
        os.replace(tmp_path / "changed.so", library)

    for damage in (changed, record.unlink):  # and a library whose build recorded nothing
        damage()
        compiled: list[tuple] = []
        fresh = kernel()
        monkeypatch.setattr(fresh, "_compile", lambda *args, compile=fresh._compile, seen=compiled: (
            seen.append(args), compile(*args)))
        assert fresh.library() is not None and len(compiled) == 1
        assert record.read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()


# ---- a Hub endpoint that never answers --------------------------------------------------------------------------

def test_a_hub_that_never_answers_is_one_error_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_stay_silent() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept_and_stay_silent, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            gatedformer.from_pretrained("someone/silent-model", device="cpu")
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    started = time.monotonic()
    worker = threading.Thread(target=load, daemon=True)  # on a hang the test fails, it does not hang
    worker.start()
    worker.join(60)
    try:
        assert not worker.is_alive(), "from_pretrained still waits on a silent Hub after 60 s"
        assert time.monotonic() - started < 30 and held
        [err] = outcome
        assert isinstance(err, ConfigError), repr(err)
        assert "did not answer within 1 s" in str(err) and "HF_HUB_ETAG_TIMEOUT" in str(err)
        assert "\n" not in str(err)
    finally:
        stop.set()
        for connection in held:
            connection.close()
        server.close()


# ---- bytes that are not UTF-8, a hostile pickle -----------------------------------------------------------------

def test_text_that_is_not_utf8_is_one_line_naming_it(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # what Python makes of the byte 0xff on the command line (os.fsdecode: surrogate escapes)
    bad = os.fsdecode(b"the \xff ")
    assert main(["fill-mask", "--run", str(workspace / "mlm"), "--text", bad + "[MASK]", "--device", "cpu"]) == 2
    _one_line_error(capsys.readouterr().err, "the text is not valid UTF-8 text (byte 0xff at character 4)")
    assert main(["generate", "--run", str(workspace / "lm"), "--prompt", bad, "--tokens", "3",
                 "--device", "cpu"]) == 2
    _one_line_error(capsys.readouterr().err, "the prompt is not valid UTF-8 text (byte 0xff at character 4)")


class _Hostile:
    def __reduce__(self) -> tuple:
        return (os.getcwd, ())  # harmless here, but a global call is what weights_only refuses


def test_a_hostile_pickle_as_a_hugging_face_checkpoint_is_one_line(workspace: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    overrides = (workspace / "mlm.overrides").read_text(encoding="utf-8").split("\n")
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(workspace / "mlm" / "vocab.txt", folder / "vocab.txt")
    model = build_config(load_recipe("bert-mlm-tiny"), overrides).model
    vocab_size = len((folder / "vocab.txt").read_text(encoding="utf-8").splitlines())
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": model.d_model, "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "intermediate_size": model.d_ffn, "max_position_embeddings": model.max_positions,
        "type_vocab_size": model.type_vocab, "vocab_size": vocab_size, "hidden_act": "gelu"}), encoding="utf-8")
    torch.save(_Hostile(), folder / "pytorch_model.bin")
    assert main(["train", "--recipe", "bert-mlm-tiny", *sets([*overrides, f"model.init_from_hf={folder}"]),
                 "--out", str(tmp_path / "run")]) == 2
    _one_line_error(capsys.readouterr().err, f"refused to load {folder / 'pytorch_model.bin'}")


# ---- messages that name the real cause --------------------------------------------------------------------------

def test_an_export_given_as_a_run_is_named_an_export(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    export = workspace / "export"
    assert main(["eval", "--run", str(export), "--device", "cpu"]) == 2
    line = _one_line_error(capsys.readouterr().err, f"{export} is an exported model")
    assert "pass --run the run folder it was exported from" in line and "from_pretrained" in line
    assert "unknown config key" not in line


def test_two_exports_into_one_folder_at_once_are_refused(workspace: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "export"
    out.mkdir()
    other = FolderLock(out / EXPORT_LOCK, "export")  # another export writing the folder now
    assert other.acquire()
    try:
        assert main(["export", "--run", str(workspace / "lm"), "--out", str(out)]) == 2
        _one_line_error(capsys.readouterr().err, f"{out} is being written by process {os.getpid()}")
        assert os.listdir(out) == [EXPORT_LOCK]
    finally:
        other.release()
    assert main(["export", "--run", str(workspace / "lm"), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "vocab.json"]


def test_a_file_as_the_data_folder_is_named_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine\n", encoding="utf-8")
    assert main(["data", "fetch", "ptb-char", "--data-dir", str(file)]) == 2
    _one_line_error(capsys.readouterr().err, f"{file} is a file, not a folder")
    assert main(["data", "fetch", "ptb-char", "--data-dir", str(file / "corpora")]) == 2
    _one_line_error(capsys.readouterr().err, f"lies under {file}, which is a file")
    assert file.read_text(encoding="utf-8") == "mine\n"
