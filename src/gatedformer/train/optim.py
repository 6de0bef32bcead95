"""Optimisers, learning-rate schedules and gradient clipping.

The schedule (:class:`Schedule`) multiplies ``optim.lr`` by a factor of the step (:func:`lr_factor`: constant,
linear, cosine, Noam, each after an optional linear warm-up) and, with ``optim.schedule=plateau``, by what the
validation losses decided: the loop reports every evaluation's loss (:meth:`Schedule.observe`), and when it has not
improved on the best for ``optim.plateau_patience`` evaluations in a row the rate is multiplied by
``optim.plateau_factor``, never below ``optim.lr * optim.min_lr_ratio`` (ConvS2S's annealing: Nesterov SGD whose
rate is divided by ten whenever the validation perplexity stops improving). The plateau's state is part of the
schedule's state dict, so a checkpoint resumes it exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gatedformer.config import OptimConfig
from gatedformer.train.grouped_adam import FUSED_DTYPES, GroupedAdam, groupable


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD, Adam, AdamW or Adamax over the model's trainable parameters.

    Weight decay is not applied to biases, LayerNorm weights and embeddings' biases (1-D tensors),
    as is usual for Transformers. Adam and AdamW are :class:`~gatedformer.train.grouped_adam.GroupedAdam` (one fused
    kernel call and one step counter per group) where the parameters allow it, else PyTorch's own.
    """
    decayed, plain = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decayed if parameter.dim() >= 2 else plain).append(parameter)
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamax":  # DrQA's and the SRU paper's reader: Adam's infinity-norm variant, L2 weight decay
        return torch.optim.Adamax(groups, lr=cfg.lr, betas=betas)
    if all(groupable(group["params"]) for group in groups):
        return GroupedAdam(groups, lr=cfg.lr, betas=betas, decoupled_weight_decay=cfg.name == "adamw")
    optimizer = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES for g in groups for p in g["params"])
    return optimizer(groups, lr=cfg.lr, betas=betas, fused=fused or None)


def clip_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the model's gradients to the global L2 norm ``max_norm`` (``inf``: measure only) and return the norm
    before clipping, as ``torch.nn.utils.clip_grad_norm_`` (by the optimiser's own multi-tensor calls where it is a
    :class:`~gatedformer.train.grouped_adam.GroupedAdam` over the model's parameters)."""
    if isinstance(optimizer, GroupedAdam):
        trained = {id(p) for p in model.parameters() if p.requires_grad}
        if trained == {id(p) for group in optimizer.param_groups for p in group["params"]}:
            return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig, d_model: int = 512) -> float:
    """Multiplier of ``cfg.lr`` at optimisation step ``step`` (0-based)."""
    warmup = cfg.warmup_steps
    if cfg.schedule == "noam":
        # Vaswani et al.: d^-0.5 * min(s^-0.5, s * w^-1.5), rescaled so the peak (at s = w) is 1.
        s = step + 1
        return min(s ** -0.5, s * warmup ** -1.5) * warmup ** 0.5
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.schedule in ("constant", "plateau"):  # the plateau's factor comes from the validation losses
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """``optim.lr`` times :func:`lr_factor` of the step times the plateau factor (1 unless ``schedule=plateau``).

    :meth:`observe` takes each evaluation's validation loss. Its state (``plateau_scale``, ``plateau_best``,
    ``plateau_bad``) is saved with the rest of the scheduler's by :meth:`state_dict`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                 d_model: int = 512) -> None:
        self.plateau_scale = 1.0
        """The product of the annealings so far."""
        self.plateau_best = math.inf
        """The lowest validation loss seen."""
        self.plateau_bad = 0
        """Evaluations in a row since the last improvement (or annealing)."""
        # The config stays in the closures, out of the state dict (which checkpoints load weights-only).
        self._plateau = (cfg.schedule == "plateau", cfg.plateau_factor, cfg.plateau_patience, cfg.min_lr_ratio)
        super().__init__(optimizer, lambda step: lr_factor(step, total_steps, cfg, d_model) * self.plateau_scale)

    def observe(self, valid_loss: float) -> bool:
        """Take one evaluation's validation loss; return whether the rate was annealed (it then applies from the
        next step on). A no-op unless ``optim.schedule=plateau``."""
        on, factor, patience, floor = self._plateau
        if not on:
            return False
        if valid_loss < self.plateau_best:  # a non-finite loss is never an improvement
            self.plateau_best, self.plateau_bad = valid_loss, 0
            return False
        self.plateau_bad += 1
        if self.plateau_bad < patience or self.plateau_scale <= floor:
            return False
        self.plateau_scale = max(self.plateau_scale * factor, floor)
        self.plateau_bad = 0
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        return True

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_plateau", None)  # the config's, not the run's: it comes from the config on resume
        return state


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    d_model: int = 512) -> Schedule:
    return Schedule(optimizer, cfg, total_steps, d_model)


def follow_changed_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                      lr: float) -> None:
    """After a resume with another ``optim.lr``: the restored schedule continues from ``lr`` instead.

    The optimiser's and scheduler's saved states carry the learning rate the run started with; every
    group's rate (base, initial and current) is scaled by the ratio, so the schedule keeps its shape.
    """
    saved = scheduler.base_lrs[0]
    if saved == lr or saved <= 0:
        return
    ratio = lr / saved
    scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
