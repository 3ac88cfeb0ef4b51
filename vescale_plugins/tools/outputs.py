"""Where a tool's results go: a JSON record, and a plot beside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["pyplot", "write_json", "write_results"]


def write_json(path: str, record: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=2)


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(
    say: Callable[[str], None],
    record: dict[str, Any],
    json_path: str,
    plot_path: str = "",
    draw: Callable[[str], None] | None = None,
) -> None:
    """Write ``record`` to ``json_path`` and, unless ``plot_path`` is empty, ``draw(plot_path)``;
    ``say`` where each went."""
    write_json(json_path, record)
    say(f"wrote {json_path}")
    if plot_path and draw is not None:
        draw(plot_path)
        say(f"wrote {plot_path}")
