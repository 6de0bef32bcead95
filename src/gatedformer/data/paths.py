"""Where corpora and caches live."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataError
from .registry import CorpusSpec, get_spec

ENV_DATA = "GATEDFORMER_DATA"
ENV_CACHE = "GATEDFORMER_CACHE"
ENV_MIRROR = "GATEDFORMER_MIRROR"

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


def missing_error(spec: CorpusSpec, searched: list[Path]) -> DataError:
    """The one-line error for a corpus found in none of ``searched``."""
    # Name the exact missing file in the most promising root: the first one holding part of the corpus.
    partial = next((r for r in searched if any(find_file(r, f.candidates) for f in spec.files)), None)
    if partial is not None:
        absent = next(f for f in spec.files if find_file(partial, f.candidates) is None)
        where = str(partial / absent.path)
    else:
        where = " / ".join(f.path for f in spec.files)
    dirs = ", ".join(str(p) for p in searched) or "(none)"
    return DataError(
        f"corpus {spec.name!r} not found: missing {where} (data dirs searched: {dirs}); "
        + FIX_HINT.format(name=spec.name)
    )


def resolve_data_dir(explicit: str | Path | None = None, corpus: str | None = None) -> Path:
    """The data root to read from.

    With ``corpus``: the first candidate holding all of its files. Without: the first existing candidate.
    """
    candidates = data_dir_candidates(explicit)
    if corpus is not None:
        spec = get_spec(corpus)
        for root in candidates:
            if holds(root, spec):
                return root
        raise missing_error(spec, candidates)
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
