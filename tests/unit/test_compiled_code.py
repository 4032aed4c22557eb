"""What torch.compile keeps resident in a CPU training process beyond the runtime context (which is calibrated in
an eager process): the planner's named runtime term ``compiled_code`` (memplan.memory.terms
.compiled_code_resident_bytes: inductor's modules, the compiled graph's fixed part and its share per block), added
under --compile where the device's memory is the process's (a CPU), never eager or on a GPU, and shown in the
estimate's breakdown. trainer.calibrate.compiled_code_bytes measures it (a real compile: benchmarks, not here)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memplan.cli import app
from memplan.estimate import estimate
from memplan.hardware import load_profile
from memplan.memory import (COMPILE_GRAPH_BYTES, COMPILE_IMPORT_BYTES, COMPILE_LAYER_BYTES,
                            compiled_code_resident_bytes)
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

SETUP = TrainSetup(ctx=256, micro_batch=4, precision="fp32", compile=True)
ESTIMATE = ["estimate", "--arch", "llama", "--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768",
            "--vocab", "4096", "--ctx", "256", "--batch", "4", "--precision", "fp32", "--device", "cpu"]


def llama(layers: int) -> ModelSpec:
    return ModelSpec(arch="llama", layers=layers, hidden=256, heads=4, kv_heads=4, ffn=768, vocab=4096, tied=True)


def test_the_term_is_inductor_s_modules_the_graph_and_a_share_per_block():
    assert min(COMPILE_IMPORT_BYTES, COMPILE_GRAPH_BYTES, COMPILE_LAYER_BYTES) > 0
    assert compiled_code_resident_bytes(1) == COMPILE_IMPORT_BYTES + COMPILE_GRAPH_BYTES + COMPILE_LAYER_BYTES
    assert compiled_code_resident_bytes(6) - compiled_code_resident_bytes(2) == 4 * COMPILE_LAYER_BYTES


def test_counted_under_compile_on_a_cpu_only_and_the_runtime_is_its_named_terms():
    cpu, gpu = load_profile("cpu"), load_profile("rtx-4090")
    compiled = estimate(llama(4), SETUP, cpu).memory
    eager = estimate(llama(4), SETUP.replace(compile=False), cpu).memory
    assert compiled.runtime_terms["compiled_code"] == compiled_code_resident_bytes(4)
    assert eager.runtime_terms["compiled_code"] == 0
    assert compiled.runtime == sum(compiled.runtime_terms.values())
    assert compiled.peak_reserved == compiled.peak_allocated + compiled.runtime
    assert "compiled_code" not in estimate(llama(4), SETUP, gpu).memory.runtime_terms  # a GPU's process is not it


def test_the_estimate_shows_it_term_by_term():
    runner = CliRunner()
    r = runner.invoke(app, [*ESTIMATE, "--compile", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["memory"]["runtime_terms"]["compiled_code"] == compiled_code_resident_bytes(4)
    table = runner.invoke(app, [*ESTIMATE, "--compile"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "of it, compiled code" in table.output
    assert "of it, compiled code" not in runner.invoke(app, ESTIMATE, env={"COLUMNS": "200"}).output
