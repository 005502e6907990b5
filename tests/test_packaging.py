"""The package installs from a wheel, as on Colab/Kaggle, and the notebooks' install cell finds it.

A notebook uploaded alone installs the package in its first cell: from a wheel uploaded beside
it (``qlora_nb_utils-*.whl`` in the working folder, or the path in ``QLORA_NB_WHEEL``) when
there is one, else from the git URL. The first test builds the real wheel and installs it into
a fresh venv, where the public face imports and ``qlora-nb --help`` runs; the others run the
install cell itself with pip replaced by a recorder.
"""

import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def install_cell(path: Path) -> str:
    code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return "".join(code[0]["source"])


def test_the_wheel_installs_into_a_fresh_venv_with_its_data_and_cli(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True)
    (wheel,) = dist.glob("qlora_nb_utils-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lab_files = [n for n in names if n.startswith(("lab/", "qlora_nb_utils/bench/peers/", "qlora_nb_utils/report/"))
                 or Path(n).name.startswith("peer")]
    assert not lab_files, f"the wheel ships lab code: {lab_files[:5]}"
    assert "qlora_nb_utils/compile/fast_path.py" in names and "qlora_nb_utils/plots.py" in names
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    # the fresh venv gets its dependencies (torch, datasets, ...) from this one, after its own site-packages
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = next(p for p in sys.path if p.endswith("site-packages"))
    Path(site, "deps_of_the_test_venv.pth").write_text(deps + "\n")
    check = (
        "import qlora_nb_utils as q, pathlib, sys\n"
        f"assert pathlib.Path(q.__file__).is_relative_to({str(env_dir)!r}), q.__file__\n"
        "from qlora_nb_utils import load_model, load_data, prepare_for_compile, TrainConfig, train, diagnose\n"
        "ds = load_data(limit=3)\n"  # the shipped data travels in the wheel
        "assert len(ds) == 3 and set(ds.column_names) >= {'prompt', 'response'}, ds\n"
        "import qlora_nb_utils.bench.main_job, qlora_nb_utils.distributed.fsdp_train, qlora_nb_utils.compile.patches\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('lab') is None, 'the lab must not be installed'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    cli = subprocess.run([str(env_dir / "bin" / "qlora-nb"), "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert cli.returncode == 0, cli.stderr
    assert all(word in cli.stdout for word in ("bench", "diagnose", "report"))


def test_the_version_is_the_same_in_the_package_and_its_metadata():
    import tomllib

    import qlora_nb_utils

    assert qlora_nb_utils.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_every_notebook_has_the_same_install_cell():
    assert len({install_cell(p) for p in NOTEBOOKS}) == 1


def _run_install_cell(tmp_path, monkeypatch, env: dict[str, str]) -> list[str]:
    """Run the install cell in tmp_path as if nothing were installed; return pip's first command."""
    import importlib.util

    calls = []
    monkeypatch.chdir(tmp_path)
    for key in ("QLORA_NB_WHEEL", "QLORA_NB_REPO", "QLORA_NB_REF", "QLORA_NB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, *a, **k: calls.append(cmd) or 0)
    exec(compile(install_cell(NOTEBOOKS[0]), "install-cell", "exec"), {})
    assert calls[0][:5] == [sys.executable, "-m", "pip", "install", "-q"]
    return calls[0]


def test_install_cell_prefers_a_wheel_beside_the_notebook(tmp_path, monkeypatch):
    old, new = tmp_path / "qlora_nb_utils-0.1.0-py3-none-any.whl", tmp_path / "qlora_nb_utils-0.2.0-py3-none-any.whl"
    old.write_bytes(b"")
    new.write_bytes(b"")
    os.utime(old, (1, 1))
    cmd = _run_install_cell(tmp_path, monkeypatch, {})
    assert cmd[5] == f"qlora-nb-utils[quant,smollm2,trl] @ {new.resolve().as_uri()}"


def test_install_cell_takes_the_wheel_named_by_the_environment(tmp_path, monkeypatch):
    wheel = tmp_path / "elsewhere" / "qlora_nb_utils-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    (tmp_path / "qlora_nb_utils-9.0.0-py3-none-any.whl").write_bytes(b"")
    cmd = _run_install_cell(tmp_path, monkeypatch, {"QLORA_NB_WHEEL": str(wheel)})
    assert cmd[5].endswith(wheel.resolve().as_uri())
    with pytest.raises(FileNotFoundError, match="QLORA_NB_WHEEL"):
        _run_install_cell(tmp_path, monkeypatch, {"QLORA_NB_WHEEL": str(tmp_path / "missing.whl")})


def test_install_cell_falls_back_to_the_git_url_at_the_branch_the_badges_open(tmp_path, monkeypatch):
    # the default ref exists before any release: the branch the Colab badge opened the notebook
    # from, so the notebook and the package it installs are the same snapshot; a tag pins a release
    from lab import pages

    cmd = _run_install_cell(tmp_path, monkeypatch, {"QLORA_NB_REPO": "https://example.org/fork"})
    assert cmd[5] == f"qlora-nb-utils[quant,smollm2,trl] @ git+https://example.org/fork@{pages.BRANCH}"
    assert f"/blob/{pages.BRANCH}/notebooks/" in pages.colab_url(NOTEBOOKS[0].name)
    cmd = _run_install_cell(tmp_path, monkeypatch, {"QLORA_NB_REF": "v1.2.3"})
    assert cmd[5].endswith("/qlora-compile@v1.2.3")


def test_install_cell_installs_from_the_repository_the_colab_badges_open():
    from lab import pages

    cmd_url = re.search(r'REPO = os\.environ\.get\("QLORA_NB_REPO", "([^"]+)"\)', install_cell(NOTEBOOKS[0]))
    assert cmd_url and cmd_url.group(1) == f"https://github.com/{pages.REPOSITORY}"
    assert f"/github/{pages.REPOSITORY}/" in pages.colab_url(NOTEBOOKS[0].name)
