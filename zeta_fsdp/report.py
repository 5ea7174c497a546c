"""Plain-text figures for people: byte sizes and fixed-width tables (no torch, no state).

Every printed report of the package (``WrapPlan.table``, ``MemoryReport.table``, the planner's
report, the demo's table) goes through these two functions, so sizes and columns read alike.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["format_bytes", "render_table"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """Bytes with a binary unit, two decimals above 1 KiB: ``1536 -> '1.50 KiB'``."""
    value = float(nbytes)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} {_UNITS[-1]}"


def render_table(
    rows: Sequence[Sequence[str]],
    *,
    align: Optional[str] = None,
    rules: Sequence[int] = (0,),
    max_width: Optional[int] = None,
) -> str:
    """Fixed-width columns, two spaces apart; ``align``: ``"l"``/``"r"`` per column (default: first left);
    a dashed rule after each row in ``rules`` (``-2``: above a total row); cells over ``max_width`` end in ``...``."""
    columns = len(rows[0])
    align = align or "l" + "r" * (columns - 1)
    if max_width is not None:
        rows = [[c if len(c) <= max_width else c[: max_width - 3] + "..." for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(columns)]
    after = {i % len(rows) for i in rules}
    lines = []
    for i, row in enumerate(rows):
        cells = [c.rjust(widths[j]) if align[j] == "r" else c.ljust(widths[j]) for j, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if i in after:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
