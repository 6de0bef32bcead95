"""Standard language-model batching: contiguous columns read in fixed-length windows."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import DataError


class LMStream:
    """Batches of (input, target) windows over one token stream.

    The stream is trimmed to a multiple of ``batch_size`` and laid out as ``batch_size`` contiguous
    columns (row ``b`` of the ``(batch_size, T)`` layout is the ``b``-th chunk). Window ``k`` is
    ``x = cols[:, kL : kL + L]`` with ``y`` the same shifted by one token; the last window may be shorter
    so that every token after the first of each column is scored exactly once per pass.

    ``shard=(rank, world)`` keeps a contiguous block of ``batch_size // world`` columns, so that the
    global batch of a DDP run equals the single-process batch.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        shard: tuple[int, int] = (0, 1),
        *,
        split: str = "token",
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
            raise DataError(
                f"{split} split has {n} tokens, too few for batch_size={batch_size} x seq_len={seq_len} "
                f"(one full window needs {batch_size * (seq_len + 1)}); lower seq_len or batch_size"
            )
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
