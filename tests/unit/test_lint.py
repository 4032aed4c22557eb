"""The code passes ruff's pyflakes rules (pyproject.toml's [tool.ruff]): no unused or undefined names, no
redefinitions, no syntax errors, in the package, the trainer, the benchmarks and the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")  # the test extra installs it
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "--output-format", "concise", "memplan", "trainer", "benchmarks",
                             "tests", ".ci"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
