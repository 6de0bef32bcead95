"""CUDA: every model, gate and command that runs on the CPU runs on a GPU and computes the same function.

Skipped where no CUDA device is present. Matrix products are held to float32 here (no TF32) so that the
GPU's results can be compared with the CPU's at float32 tolerances.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import for_backbone, tiny_overrides

from gatedformer import SRU
from gatedformer.analysis.bench import BenchOptions, BenchSize, RNNSize, run_bench
from gatedformer.config import ModelConfig, RunConfig, apply_overrides, validate
from gatedformer.errors import ConfigError
from gatedformer.models import backbone_names, build_model
from gatedformer.ops.sru import sru_recurrence, sru_recurrence_reference
from gatedformer.runs import evaluate_run
from gatedformer.train.loop import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
GATES = ("", "+σ SDU", "+tanh SDU", "+highway gate", "+gated MHDPA", "+EAU+GRC")


@pytest.fixture(autouse=True)
def _full_float32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.detach().double().cpu()
    return ((ours.detach().double().cpu() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def _model_config(backbone: str, gates: str) -> RunConfig:
    return validate(apply_overrides(RunConfig(), for_backbone(backbone, [
        "model.d_model=32", "model.n_heads=4", "model.d_ffn=64", "model.n_layers=2",
        "model.dropout=0", "model.rnn_window=3", "model.mem_len=6", f"model.gates={gates}"])))


def _pairs() -> list[tuple[str, str]]:
    pairs = []
    for backbone in sorted(backbone_names()):
        for gates in GATES:
            try:
                _model_config(backbone, gates)
                build_model(_model_config(backbone, gates).model, 7)
            except ConfigError:  # that gate has no place in that backbone
                continue
            pairs.append((backbone, gates))
    return pairs


@pytest.mark.parametrize(("backbone", "gates"), _pairs())
def test_each_backbone_and_gate_computes_the_same_on_cuda(backbone: str, gates: str) -> None:
    torch.manual_seed(0)
    cpu_model = build_model(_model_config(backbone, gates).model, 23)
    cuda_model = copy.deepcopy(cpu_model).to(CUDA)
    tokens = torch.randint(0, 23, (3, 12))
    targets = torch.randint(0, 23, (3, 12))
    losses = []
    for model, device in ((cpu_model, "cpu"), (cuda_model, CUDA)):
        state = None
        total = 0.0
        for _ in range(2):  # the second window reads the first's memory (Transformer-XL, SRU)
            out = model(tokens.to(device), state, targets=targets.to(device))
            loss, state = out.loss, out.state
            total = total + loss
        total.backward()
        losses.append(total)
    assert losses[1].device.type == "cuda"
    assert _relative_error(losses[1], losses[0]) < 1e-5
    for (name, ours), (_, reference) in zip(cuda_model.named_parameters(), cpu_model.named_parameters(),
                                             strict=True):
        assert ours.grad is not None, name
        assert _relative_error(ours.grad, reference.grad) < 1e-4, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sru_recurrence_on_cuda_matches_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    L, B, D, K, H = 9, 3, 2, 4, 5
    inputs = [torch.randn(L, B, D, K, H), None, torch.rand(D, H) - 0.5, torch.rand(D, H) - 0.5,
              torch.randn(D, H), torch.randn(D, H), torch.randn(B, D, H)]
    leaves = [t.detach().to(CUDA, dtype).requires_grad_() if t is not None else None for t in inputs]
    references = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    h, c = sru_recurrence(*leaves, alpha=1.7)
    h_ref, c_ref = sru_recurrence_reference(*references, alpha=1.7)
    assert h.dtype == dtype and h.device.type == "cuda"
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert _relative_error(h, h_ref) < tolerance and _relative_error(c, c_ref) < tolerance
    (h.float().sum() + c.float().square().sum()).backward()
    (h_ref.sum() + c_ref.square().sum()).backward()
    for ours, reference in zip(leaves, references, strict=True):
        if ours is not None:
            assert _relative_error(ours.grad, reference.grad) < 10 * tolerance


def test_bidirectional_projected_sru_on_cuda_matches_cpu() -> None:
    torch.manual_seed(0)
    cpu = SRU(16, 12, num_layers=2, bidirectional=True, projection_size=6, layer_norm=True, highway_bias=-1.0)
    gpu = copy.deepcopy(cpu).to(CUDA)
    x = torch.randn(20, 4, 16)
    h_cpu, c_cpu = cpu(x)
    h_gpu, c_gpu = gpu(x.to(CUDA))
    assert _relative_error(h_gpu, h_cpu) < 1e-5 and _relative_error(c_gpu, c_cpu) < 1e-5
    h_cpu.square().sum().backward()
    h_gpu.square().sum().backward()
    for ours, reference in zip(gpu.parameters(), cpu.parameters(), strict=True):
        assert _relative_error(ours.grad, reference.grad) < 1e-4


def _train_config(corpus: str, *extra: str) -> RunConfig:
    return validate(apply_overrides(RunConfig(), tiny_overrides(corpus, 12) + ["train.device=cuda", *extra]))


@pytest.mark.parametrize("extra", [(), ("train.precision=bf16",), ("model.backbone=transformer-xl",
                                                                     "model.mem_len=8", "model.gates=+tanh SDU")])
def test_training_on_cuda_learns_and_loads_anywhere(text_corpus: str, tmp_path: Path, extra: tuple[str, ...]) -> None:
    result = train(_train_config(text_corpus, *extra), tmp_path / "run", progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in log if "train_loss" in r]
    assert len(losses) == 12 and all(loss == loss for loss in losses)
    assert losses[-1] < losses[0]
    on_cpu = evaluate_run(tmp_path / "run", "test", device="cpu")
    on_gpu = evaluate_run(tmp_path / "run", "test", device="cuda")
    tolerance = 2e-2 if "train.precision=bf16" in extra else 1e-4
    assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=tolerance)
    assert result.test_loss == pytest.approx(on_gpu["loss"], rel=tolerance)


def test_cuda_run_resumes_where_it_stopped(text_corpus: str, tmp_path: Path) -> None:
    whole = train(_train_config(text_corpus), tmp_path / "whole", progress=False)
    assert train(_train_config(text_corpus), tmp_path / "split", progress=False, stop_after=5) is None
    resumed = train(_train_config(text_corpus), tmp_path / "split", resume=True, progress=False)
    # Index-add backward (the embedding) sums in a varying order on a GPU: equal to rounding, not bit for bit.
    assert resumed.test_loss == pytest.approx(whole.test_loss, rel=1e-4)


def test_compiled_training_on_cuda_matches_eager(text_corpus: str, tmp_path: Path) -> None:
    # No dropout: compiled code draws its masks from another random stream than eager code does.
    same = ("model.gates=+σ SDU", "model.dropout=0")
    eager = train(_train_config(text_corpus, *same), tmp_path / "eager", progress=False)
    compiled = train(_train_config(text_corpus, *same, "train.compile=true"), tmp_path / "compiled", progress=False)
    assert compiled.test_loss == pytest.approx(eager.test_loss, rel=1e-3)


def test_bench_runs_on_cuda_with_its_memory_and_peers() -> None:
    size = BenchSize(d_model=32, n_layers=2, n_heads=4, seq_len=32, batch=4, vocab=40)
    report = run_bench(size, BenchOptions(repeats=2, warmup=1, device="cuda"),
                       sections=("models", "transformer-peers", "rnn-peers", "memory"),
                       backbones=("transformer", "transformer-xl", "sru"), variants=("baseline", "+σ SDU"),
                       rnn=RNNSize(hidden=32, length=16, batch=4, layers=1), mem_lens=(0, 16), windows=(1, 3))
    assert report.meta["device"].startswith("cuda") and report.meta["device_name"] == torch.cuda.get_device_name()
    for section in ("models", "transformer-peers", "rnn-peers", "memory"):
        rows = report.section(section)
        ours = [row for row in rows if section in ("models", "memory") or row["name"].startswith("gatedformer")]
        assert ours and all(row.get("status", "ok") == "ok" for row in ours)
    sru = next(row for row in report.section("rnn-peers") if row["name"] == "gatedformer SRU")
    lstm = next(row for row in report.section("rnn-peers") if row["name"] == "torch.nn.LSTM")
    assert sru["fwd_bwd_ms"] > 0 and lstm["fwd_bwd_ms"] > 0
    for row in report.section("models"):
        assert row["train_ms"] > 0 and 0 < row["train_mfu"] < 1
        assert row["mem_method"] == "cuda" and row["peak_mem_mb"] > 0
    sizes = [row["train_peak_mb"] for row in report.section("memory") if row["knob"] == "mem_len"]
    assert sizes[1] > sizes[0]


@pytest.mark.parametrize("backbone", ["sru", "sru-transformer", "rtransformer"])
def test_a_compiled_recurrent_step_on_cuda_equals_the_eager_one(backbone: str) -> None:
    # the SRU's Triton kernels as the compiled graph's operators; the LocalRNN's steps traced
    cfg = ModelConfig(backbone=backbone, d_model=32, n_layers=2, n_heads=2, d_ffn=64, dropout=0.0, rnn_window=3)
    torch.manual_seed(0)
    model = build_model(cfg, 20).cuda().train()
    tokens = torch.randint(0, 20, (3, 12), device="cuda")
    results = []
    for forward in (model, torch.compile(model, fullgraph=True)):
        loss = forward(tokens[:, :-1], None, targets=tokens[:, 1:]).loss
        results.append((loss, *torch.autograd.grad(loss, list(model.parameters()))))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-4)


def test_fp16_training_on_cuda_scales_its_loss_and_resumes(text_corpus: str, tmp_path: Path) -> None:
    from gatedformer.train.checkpoint import latest_checkpoint, load_checkpoint

    config = _train_config(text_corpus, "train.precision=fp16")
    whole = train(config, tmp_path / "whole", progress=False)
    assert train(config, tmp_path / "split", progress=False, stop_after=5) is None
    saved = load_checkpoint(latest_checkpoint(tmp_path / "split")).trainer_state["scaler"]
    assert saved["scale"] > 0 and saved["_growth_tracker"] == 5  # five steps without an overflow
    resumed = train(config, tmp_path / "split", resume=True, progress=False)
    log = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in log if "train_loss" in r]
    assert len(losses) == 12 and losses[-1] < losses[0]
    # The same steps and the same scale from the checkpoint: the same weights, to the GPU's summation order (the
    # embedding's backward adds in a varying order, as in the fp32 test above).
    assert resumed.test_loss == pytest.approx(whole.test_loss, rel=1e-3)
    resumed_log = [json.loads(line) for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in resumed_log if "train_loss" in r] == pytest.approx(losses, rel=1e-3)
