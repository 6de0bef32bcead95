"""Where corpora and caches live."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import DataError
from .registry import CorpusSpec, get_spec

ENV_DATA = "GATEDFORMER_DATA"
ENV_CACHE = "GATEDFORMER_CACHE"
ENV_MIRROR = "GATEDFORMER_MIRROR"
ENV_OFFLINE = "GATEDFORMER_OFFLINE"
HF_OFFLINE = "HF_HUB_OFFLINE"
"""Hugging Face's own switch, honoured where ``GATEDFORMER_OFFLINE`` is unset: a machine set up to stay off the
network for the Hub stays off it for corpora too."""
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")

FIX_HINT = "pass --data-dir, set GATEDFORMER_DATA, or run `gatedformer data fetch {name}`"


def cache_root() -> Path:
    """``$GATEDFORMER_CACHE`` or ``~/.cache/gatedformer``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gatedformer"


def user_data_dir() -> Path:
    return cache_root() / "data"


def _checkout_default() -> Path | None:
    # Only meaningful for a source checkout / editable install: <root>/src/gatedformer/data/paths.py.
    here = Path(__file__).resolve()
    if len(here.parents) > 3 and here.parents[2].name == "src":
        return here.parents[3].parent / "shared" / "data"
    return None


def project_default_dirs() -> list[Path]:
    """The built-in fallbacks, in search order (after ``--data-dir`` and ``$GATEDFORMER_DATA``)."""
    dirs = [Path.cwd().parent / "shared" / "data"]
    checkout = _checkout_default()
    if checkout is not None:
        dirs.append(checkout)
    dirs.append(user_data_dir())
    return dirs


def data_dir_candidates(explicit: str | Path | None = None) -> list[Path]:
    """Data roots in search order, whether or not they exist.

    A root the user named (``--data-dir``, else ``$GATEDFORMER_DATA``) is the only one searched, so a
    run never silently reads a different copy than the one asked for; otherwise the project defaults.
    """
    if explicit is not None and str(explicit) != "":
        return [Path(os.path.abspath(Path(explicit).expanduser()))]
    env = os.environ.get(ENV_DATA)
    if env:
        return [Path(os.path.abspath(Path(env).expanduser()))]
    out: list[Path] = []
    seen: set[str] = set()
    for p in project_default_dirs():
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append(Path(os.path.abspath(p)))
    return out


def find_file(root: Path, candidates: tuple[str, ...]) -> Path | None:
    for rel in candidates:
        p = root / rel
        if p.is_file():
            return p
    return None


def holds(root: Path, spec: CorpusSpec) -> bool:
    return all(find_file(root, f.candidates) is not None for f in spec.files)


def offline_switch() -> str | None:
    """The variable that keeps corpora from being fetched on first use (``GATEDFORMER_OFFLINE=1``, else
    ``HF_HUB_OFFLINE=1``), as ``NAME=value``; ``None`` where fetching is allowed.

    The values are huggingface_hub's: ``1``, ``true``, ``yes``, ``on`` (any case) turn it on, ``0``, ``false``,
    ``no``, ``off`` and empty off, so ``GATEDFORMER_OFFLINE=0`` fetches even under ``HF_HUB_OFFLINE=1``. Any other
    value is refused rather than guessed at."""
    for name in (ENV_OFFLINE, HF_OFFLINE):
        value = os.environ.get(name)
        if value is None:
            continue
        word = value.strip().lower()
        if word in _ON:
            return f"{name}={value}"
        if word in _OFF:
            return None
        raise DataError(f"{name}={value!r} is neither on nor off; set it to 1 (no downloads) or 0 (fetch a missing "
                        "corpus on first use)")
    return None


def missing_error(spec: CorpusSpec, searched: list[Path], switch: str | None = None) -> DataError:
    """The one-line error for a corpus found in none of ``searched`` (``switch``: the offline setting that kept it
    from being fetched)."""
    # Name the exact missing file in the most promising root: the first one holding part of the corpus.
    partial = next((r for r in searched if any(find_file(r, f.candidates) for f in spec.files)), None)
    if partial is not None:
        absent = next(f for f in spec.files if find_file(partial, f.candidates) is None)
        where = str(partial / absent.path)
    else:
        where = " / ".join(f.path for f in spec.files)
    dirs = ", ".join(str(p) for p in searched) or "(none)"
    fix = FIX_HINT.format(name=spec.name)
    if switch is not None:
        fix = (f"{switch} keeps it from being fetched on first use: run `gatedformer data fetch {spec.name}` where "
               "there is a network, pass --data-dir, or set GATEDFORMER_DATA")
    return DataError(f"corpus {spec.name!r} not found: missing {where} (data dirs searched: {dirs}); {fix}")


def locate(spec: CorpusSpec, data_dir: str | Path | None = None, fetch_as: str | None = None) -> Path:
    """The first data root holding every file of ``spec``; where none does, the corpus is fetched on first use
    (``fetch_as``: the name ``data fetch`` knows it by, default ``spec.name``) into the folder ``data fetch``
    writes to, unless :func:`offline_switch` says not to."""
    candidates = data_dir_candidates(data_dir)
    for root in candidates:
        if holds(root, spec):
            return root
    switch = offline_switch()
    if switch is not None:
        raise missing_error(spec, candidates, switch)
    root = fetch_missing(fetch_as or spec.name, data_dir, candidates)
    if root is not None and holds(root, spec):
        return root
    raise missing_error(spec, candidates)


FirstUseFetch = Callable[[str, "str | Path | None", list[Path]], Path]
_first_use_fetch: list[FirstUseFetch] = []
"""How a missing corpus is fetched on first use: :func:`gatedformer.data.fetch.fetch_on_first_use`, which registers
itself here when ``gatedformer.data`` imports it (the fetch reads these paths and the loaders that call
:func:`locate`, so neither may import it)."""


def register_first_use_fetch(fetch: FirstUseFetch) -> None:
    _first_use_fetch[:] = [fetch]


def fetch_missing(name: str, data_dir: str | Path | None, searched: list[Path]) -> Path | None:
    """Fetch the corpus ``name``, missing from every folder of ``searched``, into the folder ``data fetch`` writes
    to; the data root it went to (``None`` where no fetch is registered)."""
    return _first_use_fetch[0](name, data_dir, searched) if _first_use_fetch else None


def resolve_data_dir(explicit: str | Path | None = None, corpus: str | None = None) -> Path:
    """The data root to read from.

    With ``corpus``: the first candidate holding all of its files (fetched on first use, see :func:`locate`).
    Without: the first existing candidate.
    """
    candidates = data_dir_candidates(explicit)
    if corpus is not None:
        return locate(get_spec(corpus), explicit)
    for root in candidates:
        if root.is_dir():
            return root
    dirs = ", ".join(str(p) for p in candidates)
    raise DataError(
        f"no data directory exists (searched: {dirs}); pass --data-dir, set GATEDFORMER_DATA, "
        "or run `gatedformer data fetch NAME`"
    )


def fetch_target_dir(explicit: str | Path | None = None) -> Path:
    """Where ``fetch`` writes: ``--data-dir``, else ``$GATEDFORMER_DATA``, else the user cache. A file where that
    folder (or one above it) would be is one :class:`DataError` naming it, not the "File exists" of a ``mkdir``."""
    if explicit is not None and str(explicit) != "":
        return _folder_or_error(Path(explicit).expanduser().absolute(), f"--data-dir {explicit}")
    env = os.environ.get(ENV_DATA)
    if env:
        return _folder_or_error(Path(env).expanduser().absolute(), f"{ENV_DATA}={env}")
    return _folder_or_error(user_data_dir().absolute(), "the user data folder")


def _folder_or_error(path: Path, named: str) -> Path:
    for at in (path, *path.parents):
        if at.exists() or at.is_symlink():
            if at.is_dir():
                return path
            where = "is a file" if at == path else f"lies under {at}, which is a file"
            raise DataError(f"{named}: {path} {where}, not a folder; pass a folder for the corpora (it is made if "
                            "missing)")
    return path
