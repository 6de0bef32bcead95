"""Optimisers, learning-rate schedules and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from gatedformer.config import OptimConfig
from gatedformer.train.grouped_adam import FUSED_DTYPES, GroupedAdam, groupable


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD, Adam or AdamW over the model's trainable parameters.

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
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    betas = (cfg.beta1, cfg.beta2)
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
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    d_model: int = 512) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg, d_model))


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
