"""Committed notebooks stay clean: numbered names, plain metadata (and their run's stamp), a parameters cell first."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_are_numbered_in_sequence():
    numbers = [int(re.match(r"(\d\d)_[a-z0-9_]+\.ipynb$", p.name).group(1)) for p in NOTEBOOKS]
    assert numbers == list(range(len(numbers)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_metadata_is_clean_and_parameters_come_first(path):
    nb = json.loads(path.read_text())
    # plus the stamp of the GPU run whose outputs it shows (tests/lab/test_colab_rehearsal.py checks it)
    assert set(nb["metadata"]) <= {"kernelspec", "language_info", "qlora_nb_run"}
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("metadata") for c in code), "cell metadata (tags, collapsed, ...) crept in"
    # the first code cell installs on Colab/Kaggle; the second picks the profile
    assert "QLORA_NB_REPO" in "".join(code[0]["source"])
    assert "pick_profile(PROFILES)" in "".join(code[1]["source"])
