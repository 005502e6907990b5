"""Markdown table headers for the reports (`qlora-nb report`, the README table).

Four reports (bench, matrix, peers, FSDP2) print Markdown tables; the separator row must have
one cell per column, which a hand-counted ``"---|" * n`` beside a hand-written header let drift.
Here the separator is derived from the column names.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["table_header"]


def table_header(columns: Sequence[str]) -> list[str]:
    """The header row and separator row of a Markdown table with these column names."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
