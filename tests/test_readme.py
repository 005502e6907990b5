"""The README's commands and results table stay true to the repository."""

import re
from pathlib import Path

from qlora_nb_utils import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_results_table_is_the_report_of_the_committed_files(capsys, monkeypatch):
    block = re.search(r"<!-- report:start -->\n(.*?)<!-- report:end -->", README, re.S)
    assert block, "README lacks the report markers"
    files = re.search(r"`qlora-nb report ([^`]+)`", README).group(1).split()
    assert all((REPO / f).is_file() for f in files), files
    monkeypatch.chdir(REPO)
    assert cli.main(["report", *files]) == 0
    assert block.group(1) == capsys.readouterr().out


def test_every_results_file_names_its_device_versions_command_and_date():
    import json

    for path in sorted((REPO / "results").glob("*.json")):
        res = json.loads(path.read_text())
        assert {"device", "versions", "command", "date"} <= set(res), path.name
        assert res["device"]["name"] and res["versions"]["torch"], path.name


def test_readme_images_exist():
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README):
        assert (REPO / target).is_file(), target


def test_the_own_code_example_trains_with_the_public_face():
    """The README's "Compiled training in your own code" block, run on the tiny model for 2 steps."""
    import math

    block = re.search(r"## Compiled training in your own code\n\n```python\n(.*?)```", README, re.S)
    assert block, "README lacks the own-code example"
    code = block.group(1)
    assert "from qlora_nb_utils import " in code  # the public face, not module paths
    small = code.replace('"smollm2-135m"', '"tiny"').replace("steps=100", "steps=2")
    assert small.count('"tiny"') == 1 and small.count("steps=2") == 2, "the example changed: update this test"
    scope: dict = {}
    exec(compile(small, "README.md", "exec"), scope)
    history, opt = scope["history"], scope["opt"]
    assert len(history) == 2 and all(math.isfinite(x) for x in history["loss"])
    assert opt.counter.to_dict()["compilations"] == 1 and opt.description.startswith("optimize: ")
