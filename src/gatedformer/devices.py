"""Which device a run, an evaluation or a benchmark uses (``auto``: CUDA when present, else the CPU; ``cpu`` or
``cuda[:N]``), and at which precision. Everything gatedformer runs works on the CPU and uses CUDA when it is there."""

from __future__ import annotations

import contextlib

import torch

from gatedformer.errors import ConfigError

__all__ = ["autocast", "resolve_device"]


def resolve_device(name: str, option: str = "device") -> torch.device:
    """The device ``name`` stands for; ``option`` is how the user wrote the choice (``train.device``, ``--device``),
    so that an error names it. A name that is not ``auto``, ``cpu`` or ``cuda[:N]``, or CUDA where there is none,
    is a :class:`ConfigError`."""
    shown = f"{option} {name}" if option.startswith("-") else f"{option}={name}"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{shown} is not a device gatedformer runs on; use auto, cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{shown} but no CUDA device is available; use cpu or auto")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{shown} but this machine has {count} CUDA device(s); use cuda:0 to cuda:{count - 1}")
    return device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context of ``train.precision`` (``bf16``: bfloat16 autocast on ``device``; ``fp16``: float16
    autocast, on CUDA only, see :func:`check_precision`; ``fp32``: none)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp16" and device.type == "cuda":  # elsewhere an fp16 run is evaluated in fp32
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def check_precision(device: torch.device, precision: str) -> None:
    """A :class:`ConfigError` where ``precision`` cannot train on ``device``: float16 needs a CUDA GPU (its narrow
    range is what the gradient scaler is for; CPUs have no fast float16 arithmetic and bf16 serves them)."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"train.precision=fp16 (float16 autocast with a gradient scaler) needs a CUDA GPU, and this "
                          f"run is on {device}; use train.precision=bf16 (--bf16) or fp32 here")
