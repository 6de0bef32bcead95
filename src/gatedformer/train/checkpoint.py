"""Checkpoints that survive a crash at any moment and never execute code when loaded.

Layout inside a run directory::

    ckpt/step-00001200/model.safetensors   weights (safetensors: tensors only, no code)
    ckpt/step-00001200/carry.safetensors   the state a recurrent model carries between windows
    ckpt/step-00001200/trainer.pt          optimiser, scheduler, RNG states (loaded weights_only)
    ckpt/step-00001200/meta.json           step, counters, config, package version
    ckpt/LATEST                            name of the newest complete checkpoint

A checkpoint folder is complete before ``LATEST`` is atomically switched to it, so a process killed
mid-write leaves the previous checkpoint in charge. The folder ``LATEST`` names is never rewritten in place.

Every weights file records the run's config (safetensors metadata ``config``, and ``meta.json``), so
weights are never loaded into a model built from another architecture: :func:`check_architecture`
names the fields that differ.

Every safetensors file gatedformer writes records a SHA-256 of its tensors and metadata (metadata
``weights_sha256``), checked whenever it is loaded, and ``meta.json`` records the one of ``trainer.pt`` and of its
own contents (``meta_sha256``), and must name its folder's step: flipped bytes or an edited step are a clear error,
never weights that silently compute NaN or a resume that skips steps; a file that records no checksum was not
written by gatedformer (or rewritten since) and is refused too. The metadata is written in a fixed order, so the
same weights and config give the same bytes, and a file's hash identifies a run's weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import stat
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file
from torch import nn

from gatedformer.config import RunConfig, config_from_dict
from gatedformer.data.verify import FILES_KEY, check_files, sha256_file
from gatedformer.errors import CheckpointError, ConfigError, OutputError
from gatedformer.io import _fsync_dir, atomic_write, atomic_write_text, cannot_write, make_folder, read_limited
from gatedformer.tasks.weights import recorded_config, recorded_metadata
from gatedformer.version import __version__

CHECKPOINT_DIR = "ckpt"
FORMAT_VERSION = 1
# Config fields that change what is computed while training but not the shape of the weights.
NOT_ARCHITECTURE = {"model.dropout", "model.emb_dropout", "model.attn_dropout"}
EXPORT_FORMAT = "gatedformer-pretrained"
"""An exported model's ``config.json`` ``format`` (see :mod:`gatedformer.pretrained`): a folder that is not a run."""
CHECKSUM_KEY = "weights_sha256"
"""Safetensors metadata: the SHA-256 of the file's tensors and other metadata (:func:`tensors_checksum`)."""
META_CHECKSUM_KEY = "meta_sha256"
"""``meta.json``: the SHA-256 of its other fields (:func:`meta_checksum`)."""
CHECKPOINT_NAME = re.compile(r"step-\d{8,}")
"""The name of a complete checkpoint folder; ``LATEST`` names nothing else."""
JSON_BYTES = 1 << 26
"""The largest ``meta.json`` or ``config.json`` read (they are kilobytes; a bound keeps a damaged or replaced file
from being read until memory runs out)."""


@dataclass
class Checkpoint:
    """What a loaded checkpoint gives back."""

    path: Path
    meta: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    trainer_state: dict[str, Any] | None
    carry: Any


# ---------------------------------------------------------------------------------------------
# The recurrent state is a nest of tensors (None, a tensor, or lists/tuples of them).


def _flatten(carry: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if carry is None:
        return None
    if isinstance(carry, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = carry.detach().contiguous().cpu()
        return key
    if isinstance(carry, list | tuple):
        return {"seq": [_flatten(item, tensors) for item in carry], "tuple": isinstance(carry, tuple)}
    raise TypeError(f"cannot checkpoint a recurrent state of type {type(carry).__name__}")


def _unflatten(layout: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if layout is None:
        return None
    if isinstance(layout, str):
        return tensors[layout]
    items = [_unflatten(item, tensors) for item in layout["seq"]]
    return tuple(items) if layout["tuple"] else items


def model_state_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights with tied parameters stored once, each in storage of its own (safetensors refuses shared storage, and
    parameters may be views into one buffer)."""
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        ident = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if ident in seen and tensor.numel():
            continue
        seen.add(ident)
        tensor = tensor.detach().cpu()
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        state[name] = tensor
    return state


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:120]


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def tensors_checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """SHA-256 over the tensors (name, dtype, shape and bytes, by name) and the metadata (but its own key): what a
    safetensors file records as ``weights_sha256`` and is checked against when loaded."""
    digest = hashlib.sha256()
    for key in sorted(k for k in (metadata or {}) if k != CHECKSUM_KEY):
        digest.update(json.dumps(["metadata", key, metadata[key]]).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(json.dumps(["tensor", name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def meta_checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's meta (but its own key), as ``meta.json`` records it under ``meta_sha256``: the step,
    the counters and the config are what a resume trusts."""
    fields = {key: value for key, value in meta.items() if key != META_CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _fix_header_order(path: Path) -> None:
    """Rewrite the header of the safetensors file ``path`` with its metadata in sorted order (safetensors writes
    it in a per-process hash order), so equal contents give equal bytes."""
    with open(path, "r+b") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        metadata = header.pop("__metadata__", None)
        ordered = ({"__metadata__": dict(sorted(metadata.items()))} if metadata else {}) | header
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # safetensors itself pads the header with spaces to keep the data aligned
            handle.seek(8)
            handle.write(text.ljust(size, b" "))
            return
        body = handle.read()
    padded = text.ljust(-(-(8 + len(text)) // 8) * 8 - 8, b" ")
    with open(path, "wb") as handle:
        handle.write(len(padded).to_bytes(8, "little") + padded + body)


def write_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors``' ``save_file`` with the checksum recorded and the header in a fixed order (same tensors and
    metadata, same bytes), failing as an :class:`OSError` (a full disk, say) like any other write."""
    metadata = dict(metadata or {})
    metadata[CHECKSUM_KEY] = tensors_checksum(tensors, metadata)
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        raise OSError(_first_line(err)) from None
    _fix_header_order(path)


def save_tensors_atomically(tensors: dict[str, torch.Tensor], path: Path,
                            metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` as safetensors, atomically; a failed write is one :class:`OutputError`."""
    atomic_write(path, lambda tmp: write_tensors(tensors, tmp, metadata))


def save_model_weights(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    save_tensors_atomically(model_state_for_saving(model), path, metadata)


def weights_metadata(config: dict[str, Any] | None, files: dict[str, str] | None = None) -> dict[str, str]:
    """Safetensors metadata for a weights file: the package version, the run's config and the checksums of the
    vocabulary files kept beside it (``files``, from :func:`~gatedformer.data.verify.files_checksums`; checked
    when the weights are loaded)."""
    metadata = {"gatedformer": __version__}
    if config is not None:
        metadata["config"] = json.dumps(config, sort_keys=True)
    if files:
        metadata[FILES_KEY] = json.dumps(files, sort_keys=True)
    return metadata


def recorded_run_config(run_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The config a run's weights record, and where: its final ``model.safetensors`` (when its checksum holds),
    else its latest checkpoint's ``meta.json``; ``None`` where neither records one."""
    final = run_dir / "model.safetensors"
    with contextlib.suppress(SafetensorError, OSError, ValueError, RuntimeError):
        if final.is_file():
            text = read_tensors(final)[1].get("config")
            config = json.loads(text) if text else None
            if isinstance(config, dict):
                return config, final
    with contextlib.suppress(CheckpointError, OSError, ValueError):
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is not None:
            config = json.loads(read_limited(checkpoint / "meta.json", JSON_BYTES)).get("config")
            if isinstance(config, dict):
                return config, checkpoint / "meta.json"
    return None


def check_architecture(saved: dict[str, Any] | None, current: dict[str, Any], where: str) -> None:
    """Refuse weights recorded with another model config than ``current``, naming the differing fields."""
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return  # written before configs were recorded: the key and shape check still applies
    differences = config_mismatch({"model": saved["model"]}, {"model": current.get("model", {})}, NOT_ARCHITECTURE)
    if differences:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
        raise CheckpointError(
            f"{where} was trained as another architecture than the config asks for: {shown}; "
            "load it with the config it was trained with (restore the run's config.json)"
        )


def load_model_weights(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load ``state`` into ``model``, naming what does not fit."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not _is_tied_copy(model, k, state)]
    unexpected = [k for k in state if k not in expected]
    wrong_shape = [
        f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"
        for k in state if k in expected and state[k].shape != expected[k].shape
    ]
    if missing or unexpected or wrong_shape:
        detail = "; ".join(
            part for part in (
                f"missing {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}" if missing else "",
                f"unexpected {', '.join(unexpected[:4])}{' …' if len(unexpected) > 4 else ''}" if unexpected else "",
                f"shape {', '.join(wrong_shape[:3])}" if wrong_shape else "",
            ) if part
        )
        raise CheckpointError(
            f"checkpoint {where} does not fit this model ({detail}); load it with the config it was trained with"
        )
    model.load_state_dict(state, strict=False)


def _is_tied_copy(model: nn.Module, key: str, state: dict[str, torch.Tensor]) -> bool:
    # A tied output weight is stored once under the embedding's name.
    target = model.state_dict()[key]
    for other, tensor in model.state_dict().items():
        if other != key and other in state and tensor.data_ptr() == target.data_ptr():
            return True
    return False


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, trainer_state: dict[str, Any],
                    meta: dict[str, Any], carry: Any = None, keep: int = 1) -> Path:
    """Write a complete checkpoint for ``step`` and make it the latest, atomically."""
    root = make_folder(Path(run_dir) / CHECKPOINT_DIR, "checkpoint folder")
    name = f"step-{step:08d}"
    final = root / name
    check_slot(final)
    if final.is_dir() and _pointer_name(root) == name:
        # Already the latest checkpoint (same step, same state). Rewriting it in place would leave LATEST
        # naming a deleted folder for a moment, and a crash then would lose the run.
        return final
    staging = root / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        write_tensors(model_state_for_saving(model), staging / "model.safetensors",
                      weights_metadata(meta.get("config")))
        carried: dict[str, torch.Tensor] = {}
        layout = _flatten(carry, carried)
        write_tensors(carried, staging / "carry.safetensors")
        torch.save(trainer_state, staging / "trainer.pt")
        full_meta = {**meta, "step": step, "format": FORMAT_VERSION, "version": __version__, "carry": layout,
                     "trainer_sha256": sha256_file(staging / "trainer.pt")}
        full_meta[META_CHECKSUM_KEY] = meta_checksum(full_meta)
        (staging / "meta.json").write_text(json.dumps(full_meta, indent=2, sort_keys=True), encoding="utf-8")
        for file in staging.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as a RuntimeError
        shutil.rmtree(staging, ignore_errors=True)
        raise cannot_write(final, err if isinstance(err, OSError) else OSError(_first_line(err))) from None
    _fsync_dir(staging)
    shutil.rmtree(final, ignore_errors=True)  # a stale folder of this step that LATEST does not name
    os.replace(staging, final)
    _fsync_dir(root)
    atomic_write_text(root / "LATEST", name + "\n")
    _prune(root, keep_names={name}, keep=keep)
    return final


def check_slot(path: Path) -> None:
    """One :class:`OutputError` where the checkpoint folder ``path`` is something the run did not write there (a
    symbolic link, a file): replacing it would fail halfway, or write or delete through the link."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise OutputError(f"cannot read {path} ({err.strerror or err}); make it readable or move it out") from None
    if stat.S_ISDIR(mode):
        return
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "not a folder"
    raise OutputError(f"{path} is {kind}, not a checkpoint folder the run wrote; move it out of {path.parent} "
                      "and run the command again")


def check_slots(run_dir: Path) -> None:
    """:func:`check_slot` for every checkpoint name in ``run_dir``'s checkpoint folder: before a run trains on, not
    at the checkpoint its steps would be lost at."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if CHECKPOINT_NAME.fullmatch(path.name):
            check_slot(path)


def _prune(root: Path, keep_names: set[str], keep: int) -> None:
    complete = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.is_symlink())
    for old in complete[:-keep] if keep > 0 else complete:
        if old.name not in keep_names:
            shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob(".step-*.partial"):
        shutil.rmtree(partial, ignore_errors=True)


def _pointer_name(root: Path) -> str | None:
    try:
        return read_limited(root / "LATEST", 4096).decode("utf-8").strip()
    except (OSError, ValueError):
        return None


def _inside(root: Path, path: Path) -> bool:
    """Whether ``path`` is a folder of ``root`` itself (no link leading elsewhere)."""
    try:
        return path.is_dir() and path.resolve().parent == root.resolve()
    except OSError:
        return False


def _newest_complete(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("step-*")
                      if CHECKPOINT_NAME.fullmatch(p.name) and _inside(root, p) and (p / "meta.json").is_file())
    return complete[-1] if complete else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or ``None`` if it has none.

    ``ckpt/LATEST`` names it. Without that file, the newest ``step-*`` folder is the one: a folder gets
    its name only once complete, and LATEST is written after it, so a lost pointer loses no checkpoint.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    pointer = root / "LATEST"
    if not pointer.exists():
        return _newest_complete(root)
    try:
        name = read_limited(pointer, 4096).decode("utf-8").strip()
    except (OSError, ValueError) as err:  # UnicodeDecodeError and "over N bytes" are ValueErrors
        reason = err.strerror if isinstance(err, OSError) and err.strerror else _first_line(err)
        raise CheckpointError(f"{pointer} cannot be read ({reason}); delete it and resume: the newest "
                              "complete checkpoint is then used") from None
    path = root / name
    if CHECKPOINT_NAME.fullmatch(name) and _inside(root, path):
        return path
    newest = _newest_complete(root)
    problem = (f"names a checkpoint {name[:80]!r} that does not exist" if CHECKPOINT_NAME.fullmatch(name)
               else f"names {name[:80]!r}, which is not a checkpoint folder of this run")
    if newest is not None:
        raise CheckpointError(f"{pointer} {problem}; delete {pointer} and run the command again (--resume to "
                              f"train on): the newest complete checkpoint ({newest.name}) is then used")
    raise CheckpointError(f"{pointer} {problem}, and the run has no complete checkpoint left; delete {root} and "
                          "train the run again")


def damaged_advice(checkpoint: Path) -> str:
    """What to do about the damaged checkpoint folder ``checkpoint``, in steps that work when followed as written:
    resume from an earlier one where the run keeps one (``LATEST`` goes too, as it names the damaged one), else
    start the run over in its folder."""
    root = checkpoint.parent
    earlier = sorted(p.name for p in root.glob("step-*") if CHECKPOINT_NAME.fullmatch(p.name) and p.name <
                     checkpoint.name and _inside(root, p) and (p / "meta.json").is_file()) if root.is_dir() else []
    if earlier:
        return (f"delete {checkpoint} and {root / 'LATEST'}, then run the command again (--resume to train on): the "
                f"run's previous checkpoint ({earlier[-1]}) is then used")
    return (f"the run keeps no earlier checkpoint: delete {root} and run the same train command again (the run "
            "starts over in its folder)")


def _safe_torch_load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain data, which could "
            f"run code ({_first_line(err)}); only load checkpoints gatedformer wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(err)}); {damaged_advice(path.parent)}"
                              ) from None


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, the tensors checked against the checksum the file records
    (a :class:`ValueError` where they differ, or where it records none: every file gatedformer writes has one)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    recorded = metadata.get(CHECKSUM_KEY)
    if recorded is None:
        raise ValueError(f"it records no checksum ({CHECKSUM_KEY}), so it was not written by gatedformer or was "
                         "rewritten since")
    if tensors_checksum(tensors, metadata) != recorded:
        raise ValueError("its contents do not match the checksum recorded when it was written: bytes were changed "
                         "since")
    return tensors, metadata


def _safe_load_tensors(path: Path, fix: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``path``, a file of a checkpoint folder unless ``fix`` says what to do about it instead."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete: {fix or damaged_advice(path.parent)}")
    try:
        return read_tensors(path)[0]
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(err)}); "
                              f"{fix or damaged_advice(path.parent)}") from None


@contextlib.contextmanager
def restoring(path: Path) -> Iterator[None]:
    """Around a trainer's restore from checkpoint ``path``: state that loaded but does not fit (a key missing,
    a value of the wrong type) is one :class:`CheckpointError` rather than a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(
            f"{path} is damaged ({type(err).__name__}: {_first_line(err)}); {damaged_advice(path)}") from None


def read_run_config(run_dir: Path) -> RunConfig:
    """The config a run directory was trained with (its ``config.json``; where that is damaged, the config its
    weights record, with a warning); one clear error if it has none or none can be read."""
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{run_dir} is not a gatedformer run (no config.json); pass the --out of a train run")
    try:
        saved = json.loads(read_limited(config_file, JSON_BYTES))
        if isinstance(saved, dict) and saved.get("format") == EXPORT_FORMAT:
            raise ConfigError(f"{run_dir} is an exported model (written by gatedformer export or save_pretrained), "
                              "not a run folder; pass --run the run folder it was exported from, or load the export "
                              f"in Python with gatedformer.from_pretrained({str(run_dir)!r})")
        return config_from_dict(saved, where=str(config_file), check=True)
    except (OSError, ValueError) as err:
        reason = _first_line(err)
    recorded = recorded_run_config(run_dir)
    if recorded is None:
        raise CheckpointError(f"{config_file} is damaged ({reason}) and no weights of the run record its config; "
                              "restore config.json from a copy of the run") from None
    warnings.warn(f"gatedformer: {config_file} is damaged ({reason}); using the config recorded in {recorded[1]}",
                  stacklevel=2)
    return config_from_dict(recorded[0], where=str(recorded[1]), check=True)


def load_run_weights(model: nn.Module, run_dir: Path, config: dict[str, Any]) -> None:
    """Load a run's final weights (``model.safetensors``), else its latest checkpoint's, into ``model``. Weights
    recorded with another architecture than ``config`` asks for are refused, naming the differing fields."""
    final = run_dir / "model.safetensors"
    if final.is_file():
        fix = (f"delete it to use the run's latest checkpoint ({run_dir / CHECKPOINT_DIR}) instead"
               if latest_checkpoint(run_dir) is not None else "train the run again")
        state, where, recorded = _safe_load_tensors(final, fix), str(final), recorded_config(final)
        files = recorded_metadata(final).get(FILES_KEY)
    else:
        loaded = load_latest_checkpoint(run_dir)
        if loaded is None:
            raise CheckpointError(f"{run_dir} has no weights yet (no model.safetensors, no checkpoint)")
        checkpoint = loaded.path
        state, where, recorded = loaded.model_state, str(checkpoint), loaded.meta.get("config")
        files = loaded.meta.get(FILES_KEY)
    check_architecture(recorded, config, where)
    check_files(run_dir, files, where, "restore it from a copy of the run")
    load_model_weights(model, state, where)


SNAPSHOT_TRIES = 5
"""How often a checkpoint that a newer one replaced while it was read is read again (the newer one): a run that
trains checkpoints at most every few seconds, so one retry nearly always does."""


def load_latest_checkpoint(run_dir: Path, with_trainer: bool = False) -> Checkpoint | None:
    """The newest checkpoint of ``run_dir``, read whole even while the run trains on: a checkpoint the trainer
    replaced between two reads (its files deleted after ``LATEST`` moved on) is not damage; the newer one is read
    instead. ``None`` where the run has no checkpoint."""
    for _ in range(SNAPSHOT_TRIES):
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            return None
        try:
            return load_checkpoint(checkpoint, with_trainer)
        except CheckpointError:
            if latest_checkpoint(run_dir) == checkpoint:
                raise  # still the newest: the damage is real
    raise CheckpointError(f"{run_dir} wrote {SNAPSHOT_TRIES} checkpoints while one was being read; the run is "
                          "healthy: read it again (or once it has finished)")


def load_checkpoint(path: Path, with_trainer: bool = True) -> Checkpoint:
    """Read a checkpoint folder, refusing anything truncated, corrupt or code-carrying."""
    path = Path(path)
    meta_file = path / "meta.json"
    try:
        meta = json.loads(read_limited(meta_file, JSON_BYTES))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file} is missing or corrupt ({_first_line(err)}); {damaged_advice(path)}"
                              ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file} is not a gatedformer checkpoint of format {FORMAT_VERSION}")
    damaged = f"; {damaged_advice(path)}"
    # What a trainer resumes from; counts kept only by later versions are checked where present.
    counts = [("step", True)] + ([("tokens_seen", True), ("loss_count", False), ("skipped", False),
                                  ("timed_steps", False), ("timed_tokens", False)] if with_trainer else [])
    for key, required in counts:
        if (required or key in meta) and (isinstance(meta.get(key), bool) or not isinstance(meta.get(key), int)
                                          or meta[key] < 0):
            raise CheckpointError(f"{meta_file} is damaged: {key!r} is {repr(meta.get(key))[:40]}, not a "
                                  f"count{damaged}")
    folder_step = int(path.name.removeprefix("step-")) if CHECKPOINT_NAME.fullmatch(path.name) else None
    if folder_step is not None and meta["step"] != folder_step:
        raise CheckpointError(f"{meta_file} is damaged: its step ({meta['step']}) is not its folder's "
                              f"({folder_step}){damaged}")
    numbers = ("loss_sum", "train_seconds", "setup_seconds", "wall_seconds") if with_trainer else ()
    for key in numbers:
        value = meta.get(key)
        if key in meta and (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
            raise CheckpointError(f"{meta_file} is damaged: {key!r} is {repr(value)[:40]}, not a finite "
                                  f"number{damaged}")
    recorded = meta.get(META_CHECKSUM_KEY)
    if recorded != meta_checksum(meta):
        problem = (f"it records no checksum ({META_CHECKSUM_KEY}), so gatedformer did not write it or it was rewritten "
                   "since" if recorded is None else "it does not match the checksum it recorded when it was written "
                   "(its step, counters or config were changed since)")
        raise CheckpointError(f"{meta_file} is damaged: {problem}{damaged}")
    model_state = _safe_load_tensors(path / "model.safetensors")
    try:
        carry = _unflatten(meta.get("carry"), _safe_load_tensors(path / "carry.safetensors"))
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(
            f"{meta_file} does not describe its carried state ({_first_line(err)}){damaged}") from None
    trainer_state = _safe_torch_load(path / "trainer.pt") if with_trainer else None  # refuses code, however hashed
    if with_trainer:
        missing = [k for k in ("optimizer", "scheduler")
                   if not isinstance(trainer_state, dict) or not isinstance(trainer_state.get(k), dict)]
        if missing:
            raise CheckpointError(f"{path / 'trainer.pt'} is damaged: no {' or '.join(missing)} state{damaged}")
        # Bytes changed since it was written may still load (an optimiser moment, say): the checksum tells.
        if isinstance(meta.get("trainer_sha256"), str) and sha256_file(path / "trainer.pt") != meta["trainer_sha256"]:
            raise CheckpointError(f"{path / 'trainer.pt'} is damaged: it does not match the checksum meta.json "
                                  f"recorded when it was written{damaged}")
    return Checkpoint(path, meta, model_state, trainer_state, carry)


def config_mismatch(saved: dict[str, Any], current: dict[str, Any], ignore: set[str]) -> list[str]:
    """``section.field`` names whose values differ between two config dicts. A field the saved config lacks (one
    added to gatedformer since it was saved) counts as its default, which is what that run had."""
    defaults = RunConfig().to_dict()
    fields = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            name = f"{section}.{key}"
            before = a[key] if key in a else defaults.get(section, {}).get(key)
            if name not in ignore and before != b.get(key):
                fields.append(f"{name} ({before!r} saved, {b.get(key)!r} now)")
    return fields
