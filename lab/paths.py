"""Where the lab, its results and the repository are on disk, said once.

Why a module of its own: the index (``python -m lab.index``) and the pages made from it
(:mod:`lab.pages`), and the scripts that read committed results, all need these folders; kept in
the index, they made the pages import the index that imports the pages. The lab runs from a
checkout, so every path is found from this file, never from the working directory.
"""

from __future__ import annotations

from pathlib import Path

LAB = Path(__file__).resolve().parent
ROOT = LAB.parent
RESULTS = LAB / "results"
