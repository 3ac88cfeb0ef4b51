"""Argument types the benchmark's subcommands share: refused with a message that says why."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["count", "reshard_choice"]


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be at least {minimum}")
        return value

    return parse


def reshard_choice(text: str) -> bool | int | None:
    """``reshard_after_forward``: true / false / default (FSDP2's: every unit but the root), or
    a number of ranks."""
    choices = {"true": True, "false": False, "default": None}
    if text.lower() in choices:
        return choices[text.lower()]
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false, default or a number of ranks") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: a number of ranks is at least 1")
    return value
