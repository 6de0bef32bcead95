"""Argument checks shared by the gate units (the gates stay leaves: nothing outside ``gates`` is used)."""

from __future__ import annotations


def check_size(name: str, value: int, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
