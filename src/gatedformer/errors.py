"""User-facing errors.

Every problem a user can cause (a missing corpus, a bad config value, a corrupt checkpoint) is raised
as a :class:`GatedformerError` whose message is one line naming the problem and the fix. The CLI
prints that line and exits non-zero; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class GatedformerError(Exception):
    """A problem with the user's input; ``str(err)`` names the problem and how to fix it."""

    exit_code = 2

    def __str__(self) -> str:
        # Always one line, even when the message quotes a path or value with a line break in it.
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


class ConfigError(GatedformerError):
    """A recipe, override or placement spec that does not describe a valid run."""


class DataError(GatedformerError):
    """A corpus that is missing, corrupt, empty or unreadable."""


class CheckpointError(GatedformerError):
    """A checkpoint that is truncated, corrupt, unsafe or built for another model."""


class OutputError(GatedformerError, OSError):
    """An output path (run folder, report, figure) that cannot be created or written. It is an ``OSError`` too,
    so code that tolerates an unwritable cache by catching ``OSError`` still does."""


class InUseError(GatedformerError):
    """A folder another process holds (a run being trained, a corpus being fetched); the message names it."""
