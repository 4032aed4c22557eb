"""A regular install is a working install: what ships in the wheel, and what it answers from outside the checkout.

The checkout's tests import memplan from the source tree, where every data file sits beside the code
whether or not it ships. These tests build the real wheel (``pip wheel . --no-deps``) and use only it:
its contents, an install of it into a throwaway venv run from a directory outside the checkout, and a
zip import of it on every Python from 3.10 to 3.13 found on this machine.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # builds a wheel (~15 s) and a venv


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # Build from a copy of the tracked files, so that neither the checkout's build/ nor *.egg-info is
    # touched nor read (what ships must come from pyproject.toml alone).
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            dst = build / name.decode()
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(build), "--no-deps", "-q", "-w", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    (path,) = out.glob("memplan-*.whl")
    return path


def _tracked(pattern: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)}


def test_wheel_holds_every_profile_matrix_and_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    profiles = _tracked("memplan/profiles/*.toml")
    matrices = _tracked("memplan/matrices/**/*.toml")
    modules = _tracked("memplan/**/*.py") | _tracked("trainer/**/*.py")
    assert len(profiles) >= 15 and {"memplan/matrices/default.toml", "memplan/matrices/inference/default.toml"} <= matrices
    assert profiles - names == set(), "profiles missing from the wheel"
    assert matrices - names == set(), "matrices missing from the wheel"
    assert modules - names == set(), "modules missing from the wheel"
    presets = _tracked("memplan/presets/*.json")  # the config.json presets (memplan.model.CONFIG_PRESETS)
    assert "memplan/presets/llama-3.2-1b.json" in presets and presets - names == set(), "presets missing from the wheel"
    assert not any(n.startswith(("memplan_profiles", "memplan_matrices", "tests/", "benchmarks/")) for n in names)


def _site_packages(venv: Path) -> Path:
    rel = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / rel


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel pip-installed into a throwaway venv. Its dependencies (torch and the rest, already
    installed for these tests) come from this interpreter's site-packages through a .pth line, which
    adds the directory alone: its .pth files, the editable install's among them, are not run."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    deps = Path(sysconfig.get_path("purelib"))
    (_site_packages(venv) / "_memplan_test_deps.pth").write_text(f"{deps}\n")
    return venv


def _run_installed(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / "memplan"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_installed_estimate_runs_outside_the_checkout(installed, tmp_path):
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import memplan; print(memplan.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout  # the wheel's copy, not the checkout's

    result = _run_installed(installed, tmp_path, "estimate", "--params", "1b", "--ctx", "8192", "--device", "strix-halo",
                            "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["device"]["name"] == "strix-halo"
    assert out["model"]["params"] > 0.9e9 and out["setup"]["ctx"] == 8192
    assert out["memory"]["peak_reserved"] > out["memory"]["peak_allocated"] > 0

    listed = _run_installed(installed, tmp_path, "profiles", "--json")
    assert listed.returncode == 0, listed.stderr
    names = {row["name"] for row in json.loads(listed.stdout)}
    assert names == {p.stem for p in (ROOT / "memplan" / "profiles").glob("*.toml")}

    bad = _run_installed(installed, tmp_path, "estimate", "--params", "1b", "--device", "no-such-gpu")
    assert bad.returncode == 2 and "strix-halo" in bad.stderr and "Traceback" not in bad.stderr


_LOAD_RESOURCES = """
import sys
from memplan.hardware import load_profile, profile_names
from memplan.validate import load_inference_matrix, load_matrix, matrix_names
names = profile_names()
devices = [load_profile(n) for n in names if n != "cpu"]
print(len(names), len(devices), devices[-1].name, matrix_names(), len(load_matrix("default")) > 0,
      len(load_inference_matrix("default")) > 0)
"""


def _pythons() -> list[str]:
    """One interpreter per Python from 3.10 to 3.13 found on PATH or among pyenv's versions."""
    found = []
    for version in ("3.10", "3.11", "3.12", "3.13"):
        pyenv = sorted(Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")).glob(f"versions/{version}.*/bin/python{version}"))
        for exe in [shutil.which(f"python{version}"), *map(str, pyenv)]:
            if exe and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
                found.append(exe)
                break
    return found


@pytest.mark.parametrize("python", _pythons() or [pytest.param(None, marks=pytest.mark.skip("no python3.1x found"))])
def test_bundled_resources_load_from_a_zip_import(wheel, python, tmp_path):
    """Imported straight from the wheel (zipimport), where a resource is a zip member and has no path
    at all: the profiles and matrices load as Traversables on this Python."""
    import tomli  # on 3.10 memplan reads TOML with tomli (memplan/compat.py); it is pure Python

    path = os.pathsep.join([str(wheel), str(Path(tomli.__file__).parents[1])])
    result = subprocess.run([python, "-c", _LOAD_RESOURCES], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={"PATH": os.environ["PATH"], "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    count, loaded, last, matrices, *rest = result.stdout.split(maxsplit=3)
    expected = sorted(p.stem for p in (ROOT / "memplan" / "profiles").glob("*.toml"))
    assert int(count) == len(expected) and int(loaded) == len(expected) - 1 and last == expected[-1]
    assert "default" in result.stdout and "distributed" in result.stdout and result.stdout.strip().endswith("True True")
