"""What a training run shows while it trains: a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws one line in place, which only a terminal shows; written to a file, a pipe or a notebook's captured
stream it is either disabled (tqdm's default off a terminal) or a heap of carriage returns. Off a terminal the run
therefore prints a line when it starts, then at most one every :data:`EVERY_SECONDS` (step, loss, pace, time left),
one after every evaluation and one at the end, so a run started from a script or a job scheduler is never silent for
long.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["EVERY_SECONDS", "PlainProgress", "duration", "progress_bar"]

EVERY_SECONDS = 30.0
"""The longest a run off a terminal goes between two progress lines (an evaluation may take longer)."""


def duration(seconds: float) -> str:
    """A time span as people say it: seconds up to a minute and a half, minutes up to an hour and a half, then hours."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class PlainProgress:
    """The progress bar's interface (``update``, ``set_postfix``, ``close``) as plain lines on ``stream``."""

    def __init__(self, total: int, initial: int, name: str, stream: TextIO | None = None,
                 every: float = EVERY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.step, self.name = total, initial, name
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.clock = clock
        self.started = self.last = clock()
        self.first_step = initial
        self.postfix: dict[str, str] = {}
        self.closed = False
        where = f", resuming at step {initial}" if initial else ""
        self._say(f"{name}: training {total} steps{where}")

    def _say(self, line: str) -> None:
        # a closed or broken stream: the run goes on without its progress lines
        with contextlib.suppress(OSError, ValueError):
            print(line, file=self.stream, flush=True)

    def _line(self) -> None:
        now = self.clock()
        self.last = now
        parts = [f"{self.name}: step {self.step}/{self.total} ({100 * self.step / max(self.total, 1):.0f}%)"]
        parts += [f"{key} {value}" for key, value in self.postfix.items()]
        done = self.step - self.first_step
        if done > 0:
            pace = (now - self.started) / done
            parts.append(f"{pace:.3g} s/step")
            if self.step < self.total:
                parts.append(f"about {duration(pace * (self.total - self.step))} left")
        self._say(", ".join(parts))

    def update(self, n: int = 1) -> None:
        self.step += n
        if self.clock() - self.last >= self.every:
            self._line()

    def set_postfix(self, **values: Any) -> None:
        self.postfix.update({key: str(value) for key, value in values.items()})
        if "valid" in values:  # an evaluation just ended: worth its own line
            self._line()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()


def progress_bar(enabled: bool, total: int, initial: int, name: str) -> Any:
    """A tqdm bar where stderr is a terminal, :class:`PlainProgress` lines where it is not, nothing when not
    ``enabled``."""
    from tqdm.auto import tqdm

    if enabled and not _is_terminal(sys.stderr):
        return PlainProgress(total, initial, name)
    return tqdm(total=total, initial=initial, desc=name, disable=not enabled or None, leave=False,
                dynamic_ncols=True, unit="step")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
