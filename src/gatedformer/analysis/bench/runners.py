"""The language models the bench times: built, initialised and stepped as the trainer does."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.analysis.bench.options import OPTIMIZERS, BenchOptions, BenchSize
from gatedformer.config import InitConfig, ModelConfig
from gatedformer.devices import resolve_device
from gatedformer.errors import ConfigError
from gatedformer.fused import fuse
from gatedformer.models import build_model
from gatedformer.nn.outputs import ModelOutput
from gatedformer.train.compiling import compile_model
from gatedformer.train.grouped_adam import GroupedAdam, groupable
from gatedformer.train.init import initialise


def initialise_weights(model: nn.Module, scheme: str) -> nn.Module:
    """The trainer's initialisation (:func:`gatedformer.train.init.initialise`): every Linear, Embedding and
    Conv1d weight by ``scheme``, biases zero; ``default`` keeps each library's own initialisation.

    It matters for speed on the CPU: PyTorch's default ``N(0, 1)`` embeddings times ``sqrt(d)`` give the first
    attention such peaked softmaxes that its backward pass runs on denormal floats, several times slower."""
    if scheme != "default":
        initialise(model, InitConfig(scheme=scheme))
    return model


def bench_model(cfg: ModelConfig, vocab: int, scheme: str) -> nn.Module:
    """The language model of ``cfg`` as training runs it: built, fused (:func:`gatedformer.fused.fuse`) and
    initialised by ``scheme`` (:func:`initialise_weights`)."""
    return initialise_weights(fuse(build_model(cfg, vocab)), scheme)


def _make_optimizer(model: nn.Module, kind: str, device: torch.device) -> torch.optim.Optimizer | None:
    if kind == "none":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw-grouped" and groupable(params):
        return GroupedAdam(params, lr=1e-4, decoupled_weight_decay=True)
    if kind in ("adamw-grouped", "adamw-fused"):
        try:
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
        except (RuntimeError, ValueError, TypeError):
            return torch.optim.AdamW(params, lr=1e-4)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    raise ConfigError(f"unknown optimizer {kind!r}; choose one of {', '.join(OPTIMIZERS)}")


def backward_and_step(model: nn.Module, loss: Tensor, optimizer: torch.optim.Optimizer | None) -> None:
    """The update every timed training step ends with: gradients cleared, ``loss.backward()``, the optimiser's step
    (without an optimiser, the backward pass alone)."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    loss.backward()
    if optimizer is not None:
        optimizer.step()


def _detach(state: Any) -> Any:
    if state is None:
        return None
    if isinstance(state, Tensor):
        return state.detach()
    return type(state)(_detach(item) for item in state)


class LMRunner:
    """Random tokens, the model (compiled if asked), its optimiser and the two steps the bench times."""

    def __init__(self, model: nn.Module, size: BenchSize, device: torch.device, options: BenchOptions,
                 memory_len: int = 0) -> None:
        generator = torch.Generator().manual_seed(options.seed)
        tokens = torch.randint(0, size.vocab, (size.batch, size.seq_len + 1), generator=generator)
        self.x = tokens[:, :-1].contiguous().to(device)
        self.y = tokens[:, 1:].contiguous().to(device)
        self.vocab = size.vocab
        self.device = device
        self.model = model.to(device)
        self.forward = compile_model(model) if options.compile else model
        self.optimizer = _make_optimizer(model, options.optimizer, device)
        self.bf16 = options.bf16
        # gatedformer's language models compute their loss with the (fused) output layer; the peers as usual
        self.takes_targets = "targets" in inspect.signature(model.forward).parameters
        self.state = None
        # Carried state (Transformer-XL memories) in its steady state: fill the memory up to memory_len.
        if memory_len > 0:
            with torch.no_grad():
                for _ in range(math.ceil(memory_len / size.seq_len)):
                    self.state = model.eval()(self.x, self.state).state
            self.state = _detach(self.state)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits_loss(self, forward: Callable[..., ModelOutput]) -> Tensor:
        if self.takes_targets:
            return forward(self.x, self.state, targets=self.y).loss
        logits = forward(self.x, self.state).logits
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), self.y.reshape(-1))

    def train_step(self, eager: bool = False) -> None:
        """One training step; ``eager=True`` bypasses ``torch.compile`` (for the memory probe)."""
        if not self.model.training:  # as a training loop, which does not walk every module each step
            self.model.train()
        with self._autocast():
            loss = self._logits_loss(self.model if eager else self.forward)
        backward_and_step(self.model, loss, self.optimizer)

    def eval_step(self) -> None:
        if self.model.training:
            self.model.eval()
        with torch.no_grad(), self._autocast():
            self._logits_loss(self.forward)


def training_step(size: BenchSize, backbone: str, options: BenchOptions, gates: str = "") -> Callable[[], None]:
    """One training step of the models table's model for ``backbone`` (with ``gates``) at ``size``, built, seeded,
    initialised and stepped as that table does (Transformer-XL with its memory full): for scripts that look inside
    the step (``benchmarks/xl_step.py``)."""
    device = resolve_device(options.device, "--device")
    torch.manual_seed(options.seed)
    model = bench_model(size.model_config(backbone, gates), size.vocab, options.init)
    runner = LMRunner(model, size, device, options, memory_len=size.memory if backbone == "transformer-xl" else 0)
    return runner.train_step


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def memory_step(runner: LMRunner, method: str) -> Callable[[], object]:
    """The training step the memory probe runs: eager under the CPU tensor tracker (a dispatch mode and
    compiled graphs do not mix), as timed otherwise."""
    return (lambda: runner.train_step(eager=True)) if method == "tensors" else runner.train_step
