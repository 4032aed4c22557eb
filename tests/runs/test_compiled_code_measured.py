"""What torch.compile keeps resident in a CPU training process (trainer.calibrate.compiled_code_bytes), measured
in a fresh process with an empty inductor cache, as the constants of the planner's ``compiled_code`` term were
(memplan.memory.terms.compiled_code_resident_bytes; tests/unit/test_compiled_code.py). Compiles for real: slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.memory import COMPILE_GRAPH_BYTES, COMPILE_IMPORT_BYTES, COMPILE_LAYER_BYTES

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


@pytest.mark.slow
def test_compiling_keeps_inductor_s_modules_and_the_graph_s_code_resident(tmp_path):
    """After the runtime context: importing inductor, then a 1-block llama compiled and stepped, each add tens of
    MiB (43.7 and 45.2 MiB on the build machine, the term's C_import and C_graph + C_layer), and a second
    measurement in the same process cannot tell them apart (None)."""
    from trainer.compile_guard import compile_unavailable

    if compile_unavailable("cpu"):
        pytest.skip("no C++ compiler for inductor here")
    code = ("import json\n"
            "from trainer import calibrate\n"
            "calibrate.process_baseline_bytes(['memplan.cli'])\n"
            "print(json.dumps([calibrate.compiled_code_bytes(1), calibrate.compiled_code_bytes(1)]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert r.returncode == 0, r.stderr
    (imported, graph), again = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0.5 * COMPILE_IMPORT_BYTES < imported < 2 * COMPILE_IMPORT_BYTES
    assert 0.5 * (COMPILE_GRAPH_BYTES + COMPILE_LAYER_BYTES) < graph < 2 * (COMPILE_GRAPH_BYTES + COMPILE_LAYER_BYTES)
    assert again is None
