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
