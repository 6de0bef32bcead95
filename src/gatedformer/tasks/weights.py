"""The weights a new run starts from (``train.init_from``): read from a finished run folder or a ``.safetensors``
file, checked against the model, and loaded whole or in part, every problem one line naming it and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from gatedformer.config import RunConfig
from gatedformer.errors import CheckpointError, ConfigError

__all__ = ["architecture_differences", "load_exactly", "load_matching", "read_start_weights", "recorded_config",
           "recorded_metadata", "start_weights_file"]

# Fields that change how a model trains, not the shape of its weights.
_NOT_ARCHITECTURE = {"dropout", "emb_dropout", "attn_dropout", "init_from_hf"}


def start_weights_file(source: str) -> Path:
    """The weights file ``train.init_from`` names: a run folder's ``model.safetensors``, or the file itself."""
    path = Path(source).expanduser()
    if path.is_dir():
        weights = path / "model.safetensors"
        if weights.is_file():
            return weights
        if (path / "config.json").is_file():
            raise ConfigError(f"train.init_from={source}: that run has not finished (no model.safetensors); finish it "
                              f"with `gatedformer train --resume --out {source} ...` first")
        raise ConfigError(f"train.init_from={source} is a folder but not a gatedformer run (no model.safetensors); "
                          "give a finished run folder or a .safetensors file")
    if path.is_file():
        return path
    raise ConfigError(f"train.init_from={source}: no such run folder or weights file; give a finished run folder or a "
                      ".safetensors file")


def recorded_metadata(path: Path) -> dict[str, str]:
    """The metadata of a weights file, read without its tensors or their check (empty if it cannot be read)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return {}


def recorded_config(path: Path) -> dict[str, Any] | None:
    """The config a weights file was saved with (``None`` if it records none or cannot be read)."""
    text = recorded_metadata(path).get("config")
    try:
        config = json.loads(text) if text else None
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def _recorded_model(path: Path) -> dict[str, Any] | None:
    model = (recorded_config(path) or {}).get("model")
    return model if isinstance(model, dict) else None


def architecture_differences(recorded: dict[str, Any] | None, config: RunConfig) -> list[str]:
    """The ``model.*`` fields in which the config a weights file records differs from ``config``'s, each as ``model.x
    (saved, now)``; none where the file records no config."""
    if recorded is None:
        return []
    current = config.to_dict()["model"]
    return [f"model.{key} ({recorded.get(key)!r} saved, {current.get(key)!r} now)"
            for key in sorted(set(recorded) | set(current))
            if key not in _NOT_ARCHITECTURE and key in recorded and recorded.get(key) != current.get(key)]


def read_start_weights(source: str, config: RunConfig, check: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of ``train.init_from`` and where they come from; with ``check``, weights recorded with another
    architecture than ``config.model`` are refused, naming the fields."""
    path = start_weights_file(source)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        raise CheckpointError(f"train.init_from: {path} is not a readable safetensors file ({reason}); give a "
                              "finished run folder or a .safetensors file gatedformer wrote") from None
    if check:
        differences = architecture_differences(_recorded_model(path), config)
        if differences:
            raise CheckpointError(f"train.init_from: {path} holds another architecture: {'; '.join(differences[:4])}; "
                                  "start from a run with the same model settings")
    return state, str(path)


def _shape_errors(model_state: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> list[str]:
    return [f"{key} {tuple(state[key].shape)} vs {tuple(model_state[key].shape)}"
            for key in state if key in model_state and state[key].shape != model_state[key].shape]


def load_exactly(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load ``state`` into ``model``: every tensor of the model, no other, each of its shape (a tied weight stored once
    counts for both)."""
    expected = model.state_dict()
    pointers = {}
    for key, tensor in expected.items():
        pointers.setdefault(tensor.data_ptr(), []).append(key)
    missing = [k for k in expected if k not in state and not any(o in state for o in pointers[expected[k].data_ptr()])]
    unexpected = [k for k in state if k not in expected]
    wrong = _shape_errors(expected, state)
    if missing or unexpected or wrong:
        detail = "; ".join(part for part in (
            f"missing {', '.join(missing[:3])}" if missing else "",
            f"unexpected {', '.join(unexpected[:3])}" if unexpected else "",
            f"shape {', '.join(wrong[:2])}" if wrong else "") if part)
        raise CheckpointError(f"train.init_from: {where} does not fit this model ({detail}); start from a run of the "
                              "same task and model settings")
    model.load_state_dict(state, strict=False)


def load_matching(model: nn.Module, state: dict[str, torch.Tensor], where: str, prefix: str) -> list[str]:
    """Load the tensors of ``state`` under ``prefix`` that ``model`` has (the same names, the same shapes) and keep
    the model's own for the rest; return the names the model kept. At least one tensor must load, and a tensor that
    both have must fit."""
    expected = model.state_dict()
    taken = {key: tensor for key, tensor in state.items() if key.startswith(prefix) and key in expected}
    if not taken:
        raise CheckpointError(f"train.init_from: {where} holds no weights under {prefix!r} for this model; start from "
                              "a run of the same model (e.g. a masked-LM pretraining run)")
    wrong = _shape_errors(expected, taken)
    if wrong:
        raise CheckpointError(f"train.init_from: {where} does not fit this model (shape {', '.join(wrong[:2])}); "
                              "start from a run with the same model settings")
    model.load_state_dict(taken, strict=False)
    return [key for key in expected if key not in taken]
