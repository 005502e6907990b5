"""The package's shape stays what docs/architecture.md says it is.

`lint-imports` (the contracts in pyproject.toml, run by the test command) forbids imports
against the layers; these tests keep the rest honest: the subpackages exist, no two modules import each other
(directly or round a longer loop, imports inside functions included), no module is over 600
lines, every module says why it exists, the public face is cheap to import, the wheel's
package list is the tree, the picture of the layers in docs/architecture.md is the import
graph as it is (regenerate it with `.venv/bin/python tests/test_architecture.py`) and that page
names every module. The lab (`lab/`) is held to the same cycle and size rules. The package's
strings and docstrings name no lab path and no GPU model: a user's install has no lab.
"""

import ast
import re
import subprocess
import sys
import tomllib
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qlora_nb_utils"
SUBPACKAGES = ("data", "models", "ops", "compile", "diagnostics", "training", "distributed", "bench")
#: no module is longer: past it, split it by concern (never at a line count)
LONG_MODULE = 600
#: the units the picture draws: each subpackage, and the top-level modules
UNITS = ("cli", "bench", "plots", "distributed", "training", "diagnostics", "compile", "ops", "models", "data",
         "env", "reversible", "notebook")
SOURCES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
LAB = ROOT / "lab"
LAB_SOURCES = sorted(p for p in LAB.rglob("*.py") if "__pycache__" not in p.parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in UNITS else None


def import_edges() -> set[tuple[str, str]]:
    """(importer, imported) between units, from the code's own imports (grimp, as lint-imports)."""
    import grimp

    graph = grimp.build_graph("qlora_nb_utils", exclude_type_checking_imports=True, cache_dir=None)
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
    assert not (ROOT / "tools").exists(), "the GPU scripts live in lab/gpu/"


def module_graph(package: str = "qlora_nb_utils") -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports: at the top, inside functions
    and under ``if TYPE_CHECKING`` alike (a lazy import that closes a loop is still a loop)."""
    import grimp

    graph = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)  # read afresh
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def _strongly_connected(succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module, or one that imports itself (iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in succ[v]:
                        found.append(sorted(comp))
    return found


def import_cycles(succ: dict[str, set[str]]) -> list[str]:
    """Each loop as a readable chain ``a -> b -> a``: within every strongly connected set of
    modules, the shortest loop through each of its members (one chain per distinct loop)."""
    chains = set()
    for comp in _strongly_connected(succ):
        members = set(comp)
        for start in comp:  # breadth-first from start back to itself, inside the component
            parent, queue, loop = {}, deque([start]), None
            while queue and loop is None:
                v = queue.popleft()
                for w in sorted(succ[v] & members):
                    if w == start:  # start -> ... -> v -> start, read back along the parents
                        loop = [v]
                        while loop[-1] != start:
                            loop.append(parent[loop[-1]])
                        loop.reverse()
                        break
                    if w not in parent:
                        parent[w] = v
                        queue.append(w)
            if loop:
                i = loop.index(min(loop))  # the same loop reads the same from any member
                loop = loop[i:] + loop[:i]
                short = [m.removeprefix("qlora_nb_utils.") for m in loop]
                chains.add(" -> ".join([*short, short[0]]))
    return sorted(chains)


@pytest.mark.parametrize("package", ["qlora_nb_utils", "lab"])
def test_no_module_imports_itself_round_a_loop(package):
    # two modules that import each other are one concern split by line count, or two concerns
    # tangled: merge them, or move what both need to a third module both import
    cycles = import_cycles(module_graph(package))
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in {package}:\n  " + "\n  ".join(cycles), pytrace=False)


def test_the_cycle_check_sees_a_cycle():
    # the check itself: a planted two-module loop, a three-module loop and a self-import are found
    succ = {"p.a": {"p.b"}, "p.b": {"p.a", "p.c"}, "p.c": set(), "p.x": {"p.y"}, "p.y": {"p.z"},
            "p.z": {"p.x"}, "p.s": {"p.s"}}
    assert import_cycles(succ) == ["p.a -> p.b -> p.a", "p.s -> p.s", "p.x -> p.y -> p.z -> p.x"]


def test_the_cycle_check_reads_imports_inside_functions(tmp_path, monkeypatch):
    # a package whose loop is closed only by an import inside a function, and one under TYPE_CHECKING
    pkg = tmp_path / "cycle_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A planted loop."""\n')
    (pkg / "a.py").write_text("from .b import B\n\n\ndef a():\n    return B\n")
    (pkg / "b.py").write_text("B = 1\n\n\ndef b():\n    from .a import a\n\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .d import D\nC = 1\n")
    (pkg / "d.py").write_text("from .c import C\n\nD = C\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(module_graph("cycle_probe")) == ["cycle_probe.a -> cycle_probe.b -> cycle_probe.a",
                                                          "cycle_probe.c -> cycle_probe.d -> cycle_probe.c"]


@pytest.mark.parametrize("path", SOURCES + LAB_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_why_and_none_is_too_long(path):
    lines = path.read_text().count("\n")
    assert lines <= LONG_MODULE, (f"{path.relative_to(ROOT)} has {lines} lines (over {LONG_MODULE}): it holds more "
                                  "than one concern; split it by concern, never at a line count")
    if path.name != "__main__.py":
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(ROOT)} has no module docstring"


#: what no string or docstring of the package may say: a path into the lab (a user's install has
#: none, so the reference is dead), a results file, or a GPU model (the product speaks of its users'
#: devices, not of the machines it was measured on)
NOT_PRODUCT_TEXT = re.compile(r"(?<![\w.-])lab/|(?<!\w)H[12]00(?!\d)")


def product_text_offenders(paths) -> list[str]:
    """Each string constant (docstrings, messages, help text, f-string parts) matching NOT_PRODUCT_TEXT."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for line in node.value.splitlines():
                    if NOT_PRODUCT_TEXT.search(line):
                        found.append(f"{path.relative_to(path.parents[1])}:{node.lineno}: {line.strip()[:120]}")
    return found


def test_the_product_speaks_of_the_product():
    offenders = product_text_offenders(SOURCES)
    if offenders:
        pytest.fail(f"{len(offenders)} package string(s) name the lab or a GPU model (say what the product does, "
                    "and leave figures and result files to the lab):\n  " + "\n  ".join(offenders), pytrace=False)


def test_the_product_text_check_sees_what_it_must(tmp_path):
    # the check itself: a docstring naming a results file, a help text naming a GPU, an f-string
    # part naming a lab script are found; words that merely contain the letters are not
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        '"""Why: see lab/results/x.json."""\n\n'
        'HELP = "auto: replicate (faster on 2 H200s)"\n'
        'def f(n):\n    """Fine: a collab/ folder, the H2000 or a lab.py file."""\n'
        '    return f"run lab/gpu/{n}.sh"\n')
    found = product_text_offenders([pkg / "m.py"])
    assert [f.split(":")[1] for f in found] == ["1", "3", "6"], found


def test_the_picture_of_the_layers_is_the_import_graph():
    actual, drawn = import_edges(), documented_edges()
    assert actual == drawn, (
        f"docs/architecture.md's Mermaid block is out of date: missing {sorted(actual - drawn)}, "
        f"not in the code {sorted(drawn - actual)}; regenerate with `.venv/bin/python tests/test_architecture.py`"
    )


def documented_modules(text: str) -> set[str]:
    """The module paths (relative to the package) that docs/architecture.md names.

    A backticked ``name.py`` names a module of the folder its section's heading names (the table
    under "`compile/patches/`" names ``compile/patches/<name>.py``); under a heading that names no
    folder (the top-level modules) it is the path as written.
    """
    named, folder = set(), ""
    for line in text.splitlines():
        if heading := re.match(r"#{2,4} (.*)", line):
            found = re.search(r"`([\w/]+/)`", heading.group(1))
            folder = found.group(1) if found else ""
            continue
        named |= {folder + name for name in re.findall(r"`([\w/]+\.py)`", line)}
    return named


def test_the_architecture_page_names_every_module():
    # a subpackage's __init__ is named by its section's heading; every other module needs a row
    modules = {str(p.relative_to(PKG)) for p in SOURCES if p.name != "__init__.py" or p.parent == PKG}
    missing = sorted(modules - documented_modules((ROOT / "docs" / "architecture.md").read_text()))
    assert not missing, f"docs/architecture.md has no row for {missing}: add one to its folder's table (why, entry points)"


def test_the_page_check_reads_modules_by_section():
    text = ("### Top-level modules\n| `env.py` | x |\n### `compile/`: y\n| `plan.py`, `options.py` | z |\n"
            "### `compile/patches/`: w\n| `lora_addmm.py` | v |\n")
    assert documented_modules(text) == {"env.py", "compile/plan.py", "compile/options.py",
                                        "compile/patches/lora_addmm.py"}


def test_the_product_never_imports_the_lab():
    # lint-imports checks this too; here the same rule is read off the code itself
    product = {"data", "models", "ops", "compile", "diagnostics", "training", "distributed", "env", "reversible",
               "plots"}
    assert not {(a, b) for a, b in import_edges() if a in product and b in {"bench", "cli"}}
    lab_imports = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            lab_imports += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "lab" or n.startswith("lab.")]
    assert not lab_imports, lab_imports


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
                         + ["lab.peers"])
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
