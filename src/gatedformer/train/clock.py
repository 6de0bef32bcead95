"""Where a run's time goes: its steady training steps, the one-off first step, and the whole run."""

from __future__ import annotations

import time
from typing import Any


class TrainingClock:
    """Times a run's training steps apart from the first step after each start.

    The first step after a start (fresh or resumed) builds the package's kernels on first use, compiles
    the model under ``--compile`` and warms the allocator. Those are one-off costs, and between the
    variants of a comparison they differ by which kernels an earlier run had already built. So that
    step counts as *setup*, and the time per step, the tokens per second and the curves' time axis come
    from the steady steps. The whole run, evaluations and checkpoints included, is the *wall* time.
    Every figure carries over a resume through :meth:`state`.
    """

    def __init__(self, state: dict[str, Any] | None = None, steps: int = 0, tokens: int = 0) -> None:
        state = state or {}
        self.step_seconds = float(state.get("train_seconds", 0.0))
        # Checkpoints from before the clock timed every step, the first included.
        self.timed_steps = int(state.get("timed_steps", steps))
        self.timed_tokens = int(state.get("timed_tokens", tokens))
        self.setup_seconds = float(state.get("setup_seconds", 0.0))
        self._wall_before = float(state.get("wall_seconds", self.step_seconds))
        self._started = time.perf_counter()
        self._warm = False

    def add_step(self, seconds: float, tokens: int) -> None:
        """Count one training step of ``seconds`` over ``tokens`` target tokens."""
        if not self._warm:
            self._warm = True
            self.setup_seconds += seconds
            return
        self.step_seconds += seconds
        self.timed_steps += 1
        self.timed_tokens += tokens

    @property
    def wall_seconds(self) -> float:
        return self._wall_before + time.perf_counter() - self._started

    def seconds_per_step(self, steps: int) -> float:
        """Mean steady step; a run of one step per start has only setup steps to offer."""
        if self.timed_steps:
            return self.step_seconds / self.timed_steps
        return self.setup_seconds / max(steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.timed_tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so a resumed run goes on counting."""
        return {"train_seconds": self.step_seconds, "timed_steps": self.timed_steps,
                "timed_tokens": self.timed_tokens, "setup_seconds": self.setup_seconds,
                "wall_seconds": self.wall_seconds}
