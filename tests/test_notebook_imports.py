"""The notebooks import only the product: no ``lab``, no peers, no report of peers.

A notebook is uploaded alone (Colab, Kaggle) with the package installed from a wheel; the lab
(``lab/``, the peer benchmarks and their reports) does not travel with it. So no notebook's code
may import it, whether as ``from lab ...``, ``import lab`` or the old in-package paths of the
peers (``qlora_nb_utils.bench.peers``, ``qlora_nb_utils.report.peers``).
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
FORBIDDEN = {
    "from lab": re.compile(r"^\s*from\s+lab(\.|\s)", re.M),
    "import lab": re.compile(r"^\s*import\s+lab(\.|\s|,|$)", re.M),
    "qlora_nb_utils.bench.peers": re.compile(r"qlora_nb_utils\.bench\.peers\b"),
    "qlora_nb_utils.report.peers": re.compile(r"qlora_nb_utils\.report\.peers"),
}


def code_of(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_the_patterns_catch_what_they_name():
    bad = "import os\nfrom lab.peers import run\n  import lab\nimport lab.report as r\n" \
          "from qlora_nb_utils.bench.peers.compute import compare\nimport qlora_nb_utils.report.peers_compute\n"
    assert all(p.search(bad) for p in FORBIDDEN.values())
    good = "from qlora_nb_utils import labels\nimport laboratory\nfrom qlora_nb_utils.bench.main_job import run_bench\n" \
           "x = 'lab'  # from lab in a comment mid-line\n"
    assert not any(p.search(good) for p in FORBIDDEN.values())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_notebook_imports_the_lab(path):
    code = code_of(path)
    found = [name for name, pattern in FORBIDDEN.items() if pattern.search(code)]
    assert not found, f"{path.name} imports {found}: the lab does not travel with a notebook"
