"""Calibration measures what transformers' model code (and peft's) keeps resident in a CPU training process
(trainer.calibrate.model_code_bytes), in a fresh process as calibration runs it: the figures the planner's
term (the transformers stack's ``model_code_bytes``, tests/unit/test_model_code.py) takes from the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


# ---- the measurement ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_calibration_measures_what_transformers_code_keeps_resident():
    """In a fresh process, after the runtime context as calibration measures it: transformers' model class and
    peft's adapters, built and stepped, add tens of MiB and some MiB (44.0 and 10.9 MiB on the build machine),
    and a second measurement in the same process cannot tell them apart (None)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    code = ("import json, sys\n"
            "from trainer import calibrate\n"
            "calibrate.process_baseline_bytes(['memplan.cli'])\n"
            "first = calibrate.model_code_bytes()\n"
            "print(json.dumps([first, calibrate.model_code_bytes(), 'transformers' in sys.modules]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    (transformers_bytes, peft_bytes), again, imported = json.loads(r.stdout.strip().splitlines()[-1])
    assert 20 * MiB < transformers_bytes < 120 * MiB
    assert 2 * MiB < peft_bytes < 40 * MiB
    assert again == [None, None] and imported
