"""The lab's one table and the pages made from it stay true to the committed results files."""

import json
import re
from pathlib import Path

import pytest

from lab import index, pages

ROOT = Path(__file__).resolve().parents[2]
#: this project's own bookkeeping numbers never reach what a user reads (upstream ids are fine)
BOOKKEEPING = re.compile(r"\b[Ss]ession [0-9]{1,2}\b|\b[Ii]ssue [0-9]{1,2}\b")


@pytest.fixture(scope="module")
def rows():
    return index.build_index()


def test_the_committed_index_is_what_the_results_files_give(rows):
    assert index.INDEX.read_text() == index.index_csv(rows), "stale: run python -m lab.index"
    assert index.read_index() == rows


def test_results_md_and_the_readme_blocks_are_generated_from_the_index(rows):
    assert pages.RESULTS_MD.read_text() == pages.results_md(rows), "stale lab/RESULTS.md: run python -m lab.index"
    readme = pages.README.read_text()
    assert readme == pages.readme_with_headline(readme, rows), "stale README blocks: run python -m lab.index"


def test_every_headline_row_names_its_file_device_and_date(rows):
    table = pages.headline_table(rows)
    body = table.splitlines()[2:]
    assert 1 <= len(body) <= 10  # a front door: a screenful
    for line, (_, source, configuration, metric, _) in zip(body, pages.HEADLINE):
        row = next(r for r in rows if r["source"] == f"lab/results/{source}" and r["configuration"] == configuration
                   and r["metric"] == metric)
        assert row["device"] and re.fullmatch(r"\d{4}-\d\d-\d\d", row["date"]) and row["versions"], row
        assert source in line and row["device"] in line and row["date"] in line


def test_a_longest_length_whose_edge_was_not_found_reads_as_a_lower_bound(tmp_path):
    budget = {"label": "40 GB card, cap 38.5 GiB", "ours_max_seq_len": 262144, "ours_edge_found": False,
              "unsloth_max_seq_len": 122880, "unsloth_edge_found": True}
    (tmp_path / "lc").mkdir()
    (tmp_path / "lc" / "x.json").write_text(json.dumps({"budgets": [budget]}))
    where = ("lc/x.json", "budgets/40 GB card, cap 38.5 GiB")
    assert pages.lower_bound(*where, "ours_max_seq_len", results=tmp_path) is True
    assert pages.lower_bound(*where, "unsloth_max_seq_len", results=tmp_path) is False
    assert pages.lower_bound(*where, "unsloth_edge_found", results=tmp_path) is False  # not a length
    assert pages.lower_bound("lc/x.json", "budgets/no such budget", "ours_max_seq_len", results=tmp_path) is False


def test_the_headline_marks_each_lower_bound_it_shows(rows):
    table = pages.headline_table(rows).splitlines()[2:]
    for line, (_, source, configuration, metric, _) in zip(table, pages.HEADLINE):
        assert ("| ≥ " in line) == pages.lower_bound(source, configuration, metric), line


def test_a_missing_headline_row_is_an_error_not_a_blank(rows):
    with pytest.raises(KeyError, match="no row"):
        pages._find(rows, "step/fast_path_h200.json", "calls/4x512", "no_such_metric")


def test_every_results_file_names_its_device_versions_command_and_date():
    files = sorted((ROOT / "lab" / "results").glob("*/*.json"))
    assert files and not list((ROOT / "lab" / "results").glob("*.json")), "results go under results/<topic>/"
    for path in files:
        res = json.loads(path.read_text())
        assert {"device", "versions", "command", "date"} <= set(res), path.name
        assert res["versions"]["torch"], path.name


def _rows_of_record(record: dict, tmp_path: Path) -> list[dict]:
    """The index rows of ``record`` written as a results file of the topic ``step`` under ``tmp_path``."""
    topic = tmp_path / "lab" / "results" / "step"
    topic.mkdir(parents=True)
    (topic / "x.json").write_text(json.dumps(record))
    old_root = index.ROOT
    try:
        index.ROOT = tmp_path
        return index.rows_of(topic / "x.json")
    finally:
        index.ROOT = old_root


def test_rows_are_tidy_one_number_each(rows, tmp_path):
    record = {"device": {"name": "GPU X", "count": 2}, "date": "2026-01-02T03:04", "command": "c",
              "versions": {"torch": "2.11", "peft": "0.1"}, "commit": "abcdef1234",
              "runs": [{"name": "ours", "batch_size": 4, "seq_len": 512, "median_step_ms": 40.5, "seed": 3,
                        "history": [{"loss": 1.0}]},
                       {"name": "hf-eager", "batch_size": 4, "seq_len": 512, "median_step_ms": 180.0}],
              "speedup": 4.4}
    got = _rows_of_record(record, tmp_path)
    assert [(r["configuration"], r["metric"], r["value"]) for r in got] == [
        ("runs/ours b4 s512", "median_step_ms", "40.5"), ("runs/hf-eager b4 s512", "median_step_ms", "180"),
        ("", "speedup", "4.4")]  # seeds are configuration, per-step histories stay in the file
    assert {r["device"] for r in got} == {"2 x GPU X"} and {r["date"] for r in got} == {"2026-01-02"}
    assert {r["commit"] for r in got} == {"abcdef1"} and {r["topic"] for r in got} == {"step"}
    assert len({(r["source"], r["configuration"], r["metric"]) for r in rows}) == len(rows), "a row is not unique"


def test_the_readme_is_a_front_door():
    readme = pages.README.read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert target.startswith("http") or (ROOT / target).is_file(), target
    for target in re.findall(r"\]\(((?:docs|lab|notebooks)/[^)#]+)\)", readme):
        assert (ROOT / target).exists(), target


def test_the_badges_and_the_install_cells_name_the_same_repository():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert f"https://github.com/{pages.REPOSITORY}" in "".join(first["source"]), path.name


def _user_facing():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "notebooks").glob("*.ipynb"))
    yield from sorted((ROOT / "qlora_nb_utils").rglob("*.py"))


def test_no_bookkeeping_numbers_where_users_read():
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _user_facing() for m in BOOKKEEPING.finditer(p.read_text())]
    assert not found, found[:20]


def test_every_notebook_opens_with_its_own_colab_badge():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        first = json.loads(path.read_text())["cells"][0]
        assert first["cell_type"] == "markdown", path.name
        assert pages.colab_url(path.name) in "".join(first["source"]), path.name


def test_a_row_merged_from_an_earlier_call_keeps_that_calls_date(tmp_path):
    record = {"device": {"name": "GPU X"}, "date": "2026-03-04T00:00", "command": "c", "versions": {"torch": "2.11"},
              "comparisons": [{"case": "old", "call_date": "2026-01-02T03:04", "speedup": 1.5},
                              {"case": "own", "call_date": "2026-01-02T03:04", "date": "2026-02-03", "speedup": 2.0},
                              {"case": "new", "speedup": 3.0}]}
    got = {r["configuration"]: r["date"] for r in _rows_of_record(record, tmp_path)}
    assert got == {"comparisons/old": "2026-01-02", "comparisons/own": "2026-02-03", "comparisons/new": "2026-03-04"}
