"""Standard language-model batching: contiguous columns read in fixed-length windows."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import DataError

# The config fields that size each split's windows: evaluation reads its own (data.eval_seq_len 0 means seq_len).
_FIELDS = {"train": ("data.batch_size", "data.seq_len"), "valid": ("data.eval_batch_size", "data.eval_seq_len"),
           "test": ("data.eval_batch_size", "data.eval_seq_len")}


def _too_short(split: str, n: int, batch_size: int, seq_len: int, world: int, fields: tuple[str, str] | None) -> str:
    """Why ``n`` tokens hold no full window, naming the fields that size this split's windows and values that fit."""
    batch_field, len_field = fields or ("batch_size", "seq_len")
    fits = []
    # the most columns of seq_len + 1 tokens that fit, a multiple of the processes (each takes its share)
    batch = n // (seq_len + 1) // world * world
    if batch >= 1:
        fits.append(f"{batch_field}={batch}")
    longest = n // batch_size - 1  # the longest window that batch_size columns leave room for
    if longest >= 1:
        fits.append(f"{len_field}={longest}")
    if fits:
        fix = f"set {' or '.join(fits)}"
    elif n >= 2 * world:
        fix = f"set {batch_field}={world} and {len_field}={n // world - 1}"
    else:
        fix = "use a longer text"
    return (f"{split} split has {n} tokens, too few for {batch_field}={batch_size} windows of {len_field}={seq_len} "
            f"tokens (one full window needs {batch_size * (seq_len + 1)}); {fix}")


class LMStream:
    """Batches of (input, target) windows over one token stream.

    The stream is trimmed to a multiple of ``batch_size`` and laid out as ``batch_size`` contiguous
    columns (row ``b`` of the ``(batch_size, T)`` layout is the ``b``-th chunk). Window ``k`` is
    ``x = cols[:, kL : kL + L]`` with ``y`` the same shifted by one token; the last window may be shorter
    so that every token after the first of each column is scored exactly once per pass.

    ``shard=(rank, world)`` keeps a contiguous block of ``batch_size // world`` columns, so that the
    global batch of a DDP run equals the single-process batch. ``fields`` names the config fields that gave
    ``batch_size`` and ``seq_len`` (by default those of the ``split``: ``data.eval_*`` for ``valid`` and ``test``), so
    a split too short for one window says which to change, and to what.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        shard: tuple[int, int] = (0, 1),
        *,
        split: str = "token",
        fields: tuple[str, str] | None = None,
    ) -> None:
        if tokens.dim() != 1:
            raise DataError(f"{split} stream must be 1-D, got shape {tuple(tokens.shape)}; flatten it first")
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1 (got {batch_size}, {seq_len}); raise them")
        rank, world = shard
        if world < 1 or not 0 <= rank < world:
            raise DataError(f"bad shard {shard}: need 0 <= rank < world; check the launcher's rank and world")
        if batch_size % world:
            raise DataError(
                f"batch_size {batch_size} is not divisible by world size {world}; "
                f"use a batch_size that is a multiple of {world}"
            )
        n = len(tokens)
        T = n // batch_size
        if seq_len > T - 1:
            raise DataError(_too_short(split, n, batch_size, seq_len, world, fields or _FIELDS.get(split)))
        local = batch_size // world
        cols = tokens[: batch_size * T].to(torch.int64).reshape(batch_size, T)
        self.cols = cols[rank * local : (rank + 1) * local].contiguous()
        self.batch_size = batch_size
        self.local_batch_size = local
        self.seq_len = seq_len
        self.shard = (rank, world)
        self.split = split
        self._steps = T - 1  # positions with a next token to predict

    def __len__(self) -> int:
        return -(-self._steps // self.seq_len)

    @property
    def n_tokens(self) -> int:
        """Tokens scored by this shard in one full pass (every window, the short last one included)."""
        return self.local_batch_size * self._steps

    def window(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``k`` as ``(x, y)``, each ``(local_batch_size, L)`` int64 with ``L <= seq_len``."""
        if not 0 <= k < len(self):
            raise IndexError(f"window {k} out of range for {len(self)} windows")
        start = k * self.seq_len
        end = min(start + self.seq_len, self._steps)
        return self.cols[:, start:end].contiguous(), self.cols[:, start + 1 : end + 1].contiguous()

    def iter_from(self, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Windows ``start, start+1, ...`` (to resume mid-epoch)."""
        for k in range(start, len(self)):
            yield self.window(k)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)
