"""The README's commands and code stay true to the repository (its tables: tests/lab/test_index.py)."""

import re
from pathlib import Path

from qlora_nb_utils import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_the_product_report_reads_the_committed_main_job_file(capsys, monkeypatch):
    """`qlora-nb report` prints the main job's table from its own results file (the lab's kinds: python -m lab.report)."""
    monkeypatch.chdir(REPO)
    assert cli.main(["report", "lab/results/bench/bench_cpu.json"]) == 0
    out = capsys.readouterr().out
    assert "hf-eager" in out and "fast" in out


def test_the_own_code_example_trains_with_the_public_face():
    """The README's "Compiled training in your own code" block, run on the tiny model for 2 steps."""
    import math

    block = re.search(r"## Compiled training in your own code\n\n```python\n(.*?)```", README, re.S)
    assert block, "README lacks the own-code example"
    code = block.group(1)
    assert "from qlora_nb_utils import " in code  # the public face, not module paths
    small = code.replace('"smollm2-135m"', '"tiny"').replace("steps=100", "steps=2")
    assert small.count('"tiny"') == 1 and small.count("steps=2") == 3, "the example changed: update this test"
    scope: dict = {}
    exec(compile(small, "README.md", "exec"), scope)
    history, opt = scope["history"], scope["opt"]
    assert len(history) == 2 and all(math.isfinite(x) for x in history["loss"])
    assert opt.counter.to_dict()["compilations"] == 1 and opt.description.startswith("optimize: ")
