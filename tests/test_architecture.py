"""The package's shape stays what docs/architecture.md says it is.

`lint-imports` (the contracts in pyproject.toml, run by the test command) forbids imports
against the layers; these tests keep the rest honest: the subpackages exist, every module is
one sitting, every module says why it exists, the public face is cheap to import, the wheel's
package list is the tree, and the picture of the layers in docs/architecture.md is the import
graph as it is (regenerate it with `.venv/bin/python tests/test_architecture.py`).
"""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qlora_nb_utils"
SUBPACKAGES = ("data", "models", "ops", "compile", "diagnostics", "training", "distributed", "bench", "report")
MAX_LINES = 450
#: the units the picture draws: each subpackage, and the top-level modules
UNITS = ("cli", "bench", "report", "distributed", "training", "diagnostics", "compile", "ops", "models", "data",
         "env", "reversible", "notebook")
SOURCES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in UNITS else None


def import_edges() -> set[tuple[str, str]]:
    """(importer, imported) between units, from the code's own imports (grimp, as lint-imports)."""
    import grimp

    graph = grimp.build_graph("qlora_nb_utils", exclude_type_checking_imports=True)
    edges = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = _unit(module), _unit(imported)
            if a and b and a != b:
                edges.add((a, b))
    return edges


def mermaid(edges: set[tuple[str, str]]) -> str:
    """The Mermaid block of docs/architecture.md for these edges (units in layer order)."""
    order = {u: i for i, u in enumerate(UNITS)}
    lines = ["flowchart TD"] + [f"    {a} --> {b}" for a, b in sorted(edges, key=lambda e: (order[e[0]], order[e[1]]))]
    return "\n".join(lines)


def documented_edges() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```mermaid block"
    return set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", block.group(1), re.M))


def test_the_subpackages_exist_and_say_their_job():
    for name in SUBPACKAGES:
        init = PKG / name / "__init__.py"
        assert init.is_file(), f"qlora_nb_utils/{name}/ is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"qlora_nb_utils/{name}/__init__.py needs a docstring that says its job"
    assert not (ROOT / "tools").exists(), "the GPU scripts live in scripts/gpu/"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PKG)))
def test_every_module_is_one_sitting_and_says_why(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"
    if path.name != "__main__.py":
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(ROOT)} has no module docstring"


def test_the_picture_of_the_layers_is_the_import_graph():
    actual, drawn = import_edges(), documented_edges()
    assert actual == drawn, (
        f"docs/architecture.md's Mermaid block is out of date: missing {sorted(actual - drawn)}, "
        f"not in the code {sorted(drawn - actual)}; regenerate with `.venv/bin/python tests/test_architecture.py`"
    )


def test_the_product_never_imports_the_lab():
    # lint-imports checks this too; here the same rule is read off the graph the picture is drawn from
    product = {"data", "models", "ops", "compile", "diagnostics", "training", "distributed", "env", "reversible"}
    assert not {(a, b) for a, b in import_edges() if a in product and b in {"bench", "report", "cli"}}


def test_the_public_face_is_cheap_and_complete():
    code = ("import sys, qlora_nb_utils as q; heavy = {'torch', 'transformers', 'peft'} & set(sys.modules); "
            "assert not heavy, heavy; print(' '.join(q.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    assert {"load_model", "load_data", "train", "diagnose"} <= set(names)
    import qlora_nb_utils

    for name in names:
        assert callable(getattr(qlora_nb_utils, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qlora_nb_utils.nope  # noqa: B018


@pytest.mark.parametrize("package", ["qlora_nb_utils"] + [f"qlora_nb_utils.{n}" for n in SUBPACKAGES]
                         + ["qlora_nb_utils.bench.peers"])
def test_every_lazy_name_resolves(package):
    # a table entry naming a module or attribute that moved fails here, not in a user's hands
    import importlib

    module = importlib.import_module(package)
    assert "__getattr__" in vars(module), f"{package} names no lazy exports"
    broken = {}
    for name in dir(module):  # the lazy table's names, resolved or not yet
        try:
            getattr(module, name)
        except (ImportError, AttributeError) as err:
            broken[name] = repr(err)
    assert not broken, broken
    # a submodule named like a lazily exported name replaces it once imported (Python sets the
    # package attribute to the submodule): `bench.side_by_side` became a module that way
    folder = Path(module.__file__).parent
    shadowed = sorted(n for n in dir(module) if ((folder / f"{n}.py").is_file() or (folder / n).is_dir())
                      and _in_lazy_table(module, n))
    assert not shadowed, f"{package}: submodules shadow exported names {shadowed}; rename the module"


def _in_lazy_table(module, name: str) -> bool:
    try:
        module.__getattr__(name)  # the lazy table's lookup: AttributeError for a name it does not hold
    except AttributeError:
        return False
    return True


def test_the_wheel_lists_every_subpackage():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")}
    assert on_disk <= declared, f"add to [tool.setuptools] packages: {sorted(on_disk - declared)}"
    assert declared - on_disk == {"qlora_nb_utils.shipped_data"}


if __name__ == "__main__":
    print("```mermaid\n" + mermaid(import_edges()) + "\n```")
