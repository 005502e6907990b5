"""The lab's layout: GPU scripts grouped by topic with one shared start, and no path that leads nowhere.

A reader looking for a measurement finds its script in ``lab/gpu/<topic>/``, named like the
``lab/results/<topic>/`` folder it writes, and every script starts the same way (``gpu_env.sh``,
in one place). A script or module that moves leaves no stale path behind in the docs, the lab, the
tests or the notebooks' cells (recorded outputs and results files keep the paths they were run with).
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "lab" / "gpu"
#: a repository path into the lab, as text names it; one followed by a template (<gpu>, *, {a,b}) is a pattern
LAB_PATH = re.compile(r"(?<![\w./-])(lab/[\w./-]*+)(?![<*{])")


def named_lab_paths(text: str) -> list[str]:
    """The lab paths ``text`` names (a sentence's full stop is not part of one)."""
    return [m.group(1).rstrip(".-") for m in LAB_PATH.finditer(text)]


def test_gpu_scripts_live_in_topic_folders_beside_one_shared_start():
    topics = {p.name for p in (ROOT / "lab" / "results").iterdir() if p.is_dir()}
    loose = sorted(p.name for p in GPU.iterdir() if p.name != "gpu_env.sh" and not p.name.startswith("__"))
    assert all((GPU / name).is_dir() for name in loose), f"scripts outside a topic folder: {loose}"
    assert set(loose) <= topics, f"lab/gpu/ folders not named like a lab/results/ topic: {sorted(set(loose) - topics)}"
    assert [p.relative_to(GPU) for p in GPU.rglob("gpu_env.sh")] == [Path("gpu_env.sh")], "one shared start"
    for script in sorted(GPU.glob("*/*.sh")):
        for line in script.read_text().splitlines():
            if re.match(r"\s*(source|\.)\s+\S*gpu_env\.sh", line):
                assert line.split()[1] in ('"$(dirname "$0")/../gpu_env.sh"', "lab/gpu/gpu_env.sh"), (script.name, line)


def _texts():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "lab" / "README.md"]:
        yield path, path.read_text()
    for path in sorted((ROOT / "lab").rglob("*")):
        if path.suffix in (".py", ".sh") and "results" not in path.relative_to(ROOT / "lab").parts[:1]:
            yield path, path.read_text()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name not in ("test_architecture.py", "test_layout.py"):  # their checks plant paths on purpose
            yield path, path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):  # the cells' sources, not their recorded outputs
        yield path, "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])


def test_every_lab_path_that_text_names_exists():
    # results files are left out: a script not yet run names the file it will write
    missing = sorted({f"{path.relative_to(ROOT)}: {name}" for path, text in _texts() for name in named_lab_paths(text)
                      if not name.startswith("lab/results/") and not (ROOT / name).exists()})
    assert not missing, "paths that lead nowhere (moved or renamed?):\n  " + "\n  ".join(missing)


def test_the_path_check_reads_patterns_and_sentences():
    text = "see lab/gpu/gpu_env.sh. Files lab/results/peers/peers_<gpu>.json and lab/results/x_*.json; lab/nope.py"
    assert named_lab_paths(text) == ["lab/gpu/gpu_env.sh", "lab/nope.py"]
