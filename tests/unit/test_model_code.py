"""What transformers' model code (and peft's) keeps resident in a CPU training process: the planner's named
term (memplan.memory.terms.model_code_resident_bytes) is added for transformers' model class where the
device's memory is the process's (a CPU), never for memplan's own model or on a GPU; calibration measures it
(trainer.calibrate.model_code_bytes) and records it, and a calibration from before it did still loads, the
term then taking its measured default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan import local
from memplan.cli import app
from memplan.compat import tomllib
from memplan.estimate import estimate
from memplan.hardware import detect_local, load_profile
from memplan.memory import LIBRARY_CODE_BYTES, PEFT_CODE_BYTES, TRANSFORMERS_CODE_BYTES, model_code_resident_bytes
from memplan.memory.stacks import stack_for
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
SPEC = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=384, vocab=4096, tied=True)
QWEN3 = ModelSpec(arch="qwen3", layers=2, hidden=128, heads=4, kv_heads=2, ffn=384, vocab=4096, tied=True)
SETUP = TrainSetup(ctx=256, micro_batch=4, precision="fp32")
ESTIMATE = ["estimate", "--arch", "llama", "--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "384",
            "--vocab", "4096", "--ctx", "256", "--batch", "4", "--precision", "fp32", "--json"]


def memory(spec, setup, device):
    return estimate(spec, setup, device).memory


# ---- the term -----------------------------------------------------------------------------------------

def test_the_term_is_transformers_code_and_peft_for_lora_and_nothing_for_memplans_model():
    assert model_code_resident_bytes(lora=False) == TRANSFORMERS_CODE_BYTES
    assert model_code_resident_bytes(lora=True) == TRANSFORMERS_CODE_BYTES + PEFT_CODE_BYTES
    assert model_code_resident_bytes(lora=True, transformers_bytes=30 * MiB, peft_bytes=5 * MiB) == 35 * MiB
    assert model_code_resident_bytes(lora=False, transformers_bytes=0) == 0  # measured: nothing
    lora = SETUP.replace(lora_rank=4)
    # memplan's loop training transformers' model class (memplan train --stack transformers: walked_for)
    assert stack_for("transformers", own_loop=True).model_code_bytes(lora, 30 * MiB, 5 * MiB) == 35 * MiB
    assert stack_for("memplan").model_code_bytes(lora, 30 * MiB, 5 * MiB) == 0  # memplan's code: in the context
    for name in ("litgpt", "torchtune"):  # their own library's code (library_code_resident_bytes), not transformers'
        assert stack_for(name).model_code_bytes(lora, 30 * MiB, 5 * MiB) == LIBRARY_CODE_BYTES[name] > 0


@pytest.mark.parametrize("spec", [SPEC, QWEN3], ids=["llama", "qwen3"])
def test_added_for_transformers_class_on_the_cpu_profile_only(spec):
    cpu = load_profile("cpu")
    hf = memory(spec, SETUP.replace(stack="transformers"), cpu)
    assert hf.runtime_terms["model_code"] == TRANSFORMERS_CODE_BYTES
    assert hf.runtime == sum(hf.runtime_terms.values())  # the runtime is its named terms, no more
    assert hf.peak_reserved == hf.peak_allocated + hf.runtime
    lora = memory(spec, SETUP.replace(stack="transformers", lora_rank=8), cpu)
    assert lora.runtime_terms["model_code"] == TRANSFORMERS_CODE_BYTES + PEFT_CODE_BYTES
    gpu = memory(spec, SETUP.replace(stack="transformers"), load_profile("rtx-4090"))
    assert "model_code" not in gpu.runtime_terms  # the import lives in host memory, not the GPU's
    assert gpu.runtime == sum(gpu.runtime_terms.values())
    if spec.memplan_builds:
        own = memory(spec, SETUP, cpu)
        assert own.runtime_terms["model_code"] == 0
        assert hf.runtime - own.runtime == TRANSFORMERS_CODE_BYTES + (hf.runtime_terms["allocator_reserve"]
                                                                      - own.runtime_terms["allocator_reserve"])


@pytest.mark.parametrize("installed", [False, True], ids=["without-datasets", "with-datasets"])
def test_transformers_own_trainer_adds_what_datasets_keeps_resident_where_it_is_installed(installed, monkeypatch):
    """transformers.trainer imports datasets (and pandas, pyarrow) whenever it is installed: autotune --stack
    transformers --verify of the Trainer measured 1.14x its plan with datasets installed and without the term
    (tests/runs/test_verify_stacks_run.py); memplan's own loop training the model class imports no Trainer."""
    import memplan.memory.stacks.transformers as hf_stack
    from memplan.memory import DATASETS_CODE_BYTES
    from memplan.memory.stacks import walked_for

    monkeypatch.setattr(hf_stack, "datasets_installed", lambda: installed)
    extra = DATASETS_CODE_BYTES if installed else 0
    assert 80 * MiB < DATASETS_CODE_BYTES < 90 * MiB
    trainer = stack_for("transformers")  # estimate/autotune --stack transformers: the library's own Trainer step
    assert not trainer.own_loop and trainer.model_code_bytes(SETUP) == TRANSFORMERS_CODE_BYTES + extra
    # memplan train --stack transformers: memplan's loop (walked_for), and its autotune search (own_loop)
    own = walked_for(stack_for("memplan"), SETUP.replace(stack="transformers"))
    assert own.own_loop and own.model_code_bytes(SETUP) == TRANSFORMERS_CODE_BYTES
    cpu = load_profile("cpu")
    planned = estimate(SPEC, SETUP, cpu, stack=trainer).memory
    assert planned.runtime_terms["model_code"] == TRANSFORMERS_CODE_BYTES + extra
    assert memory(SPEC, SETUP.replace(stack="transformers"), cpu).runtime_terms["model_code"] == TRANSFORMERS_CODE_BYTES
    assert "model_code" not in estimate(SPEC, SETUP, load_profile("rtx-4090"), stack=trainer).memory.runtime_terms


def test_the_devices_measured_figures_replace_the_default():
    measured = load_profile("cpu").replace(transformers_code_bytes=30 * MiB, peft_code_bytes=5 * MiB)
    assert memory(SPEC, SETUP.replace(stack="transformers"), measured).runtime_terms["model_code"] == 30 * MiB
    assert memory(SPEC, SETUP.replace(stack="transformers", lora_rank=4), measured
                  ).runtime_terms["model_code"] == 35 * MiB


def test_estimate_shows_the_term_in_its_json_and_its_table(tmp_path, monkeypatch):
    import memplan.memory.stacks.transformers as hf_stack

    monkeypatch.setattr(hf_stack, "datasets_installed", lambda: False)  # the Trainer's datasets: the test above
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    own = json.loads(runner.invoke(app, [*ESTIMATE, "--device", "cpu"]).stdout)["memory"]
    hf = json.loads(runner.invoke(app, [*ESTIMATE, "--device", "cpu", "--stack", "transformers"]).stdout)["memory"]
    assert own["runtime_terms"]["model_code"] == 0 and hf["runtime_terms"]["model_code"] == TRANSFORMERS_CODE_BYTES
    assert hf["runtime"] == sum(hf["runtime_terms"].values())
    table = runner.invoke(app, [*ESTIMATE[:-1], "--device", "cpu", "--stack", "transformers"])
    assert table.exit_code == 0, table.output
    assert "model code" in table.stdout and "44.00 MiB" in table.stdout
    assert "model code" not in runner.invoke(app, [*ESTIMATE[:-1], "--device", "cpu"]).stdout


# ---- the calibration records it; an old one loads ------------------------------------------------------

def calibration_text(code: tuple[int | None, int | None]) -> str:
    """A calibrated CPU profile as `python -m trainer.calibrate` writes it (made-up figures); ``code``: the
    model code it measured, (None, None) as a calibration from before it measured any writes it."""
    from trainer.calibrate import Calibration, profile_data, profile_toml

    c = Calibration(family="cpu", title=local.cpu_title(), threads=1, started="2026-02-03T04:05:06",
                    torch_version=local.torch_version(), seconds=15.0, memory_total_bytes=16 * 2**30,
                    memory_usable_bytes=8 * 2**30, runtime_context_bytes=300 * MiB, noise=0.04,
                    transformers_code_bytes=code[0], peft_code_bytes=code[1])
    c.bandwidth_bytes_per_second, c.launch_overhead_seconds = 1e10, 1e-5
    c.matmul = {"fp32": [[512, 384, 1024, 0.05, 0.05]]}
    return profile_toml(profile_data(c, "cpu", None))


def test_a_calibration_records_the_model_code_in_its_runtime_table(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(calibration_text((30 * MiB, 5 * MiB)))
    runtime = tomllib.loads(path.read_text())["runtime"]
    assert runtime["transformers_code_bytes"] == 30 * MiB and runtime["peft_code_bytes"] == 5 * MiB
    cal = local.read_calibration(path)
    assert (cal.transformers_code_bytes, cal.peft_code_bytes) == (30 * MiB, 5 * MiB)
    applied = cal.applied(load_profile("cpu"))
    assert (applied.transformers_code_bytes, applied.peft_code_bytes) == (30 * MiB, 5 * MiB)
    # a noisy calibration's memory is used (timing does not change it): the model code with the context
    context_only, _ = local.context_only(load_profile("cpu"), cal)
    assert (context_only.runtime_context_bytes, context_only.transformers_code_bytes) == (300 * MiB, 30 * MiB)


def test_an_old_calibration_without_the_model_code_loads_and_the_default_applies(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(calibration_text((None, None)))
    assert "code_bytes" not in path.read_text()  # written as calibrations were before they measured it
    cal = local.read_calibration(path)
    assert cal is not None and cal.runtime_context_bytes == 300 * MiB
    assert (cal.transformers_code_bytes, cal.peft_code_bytes) == (None, None)
    device = cal.applied(load_profile("cpu"))
    assert memory(SPEC, SETUP.replace(stack="transformers", lora_rank=4), device
                  ).runtime_terms["model_code"] == TRANSFORMERS_CODE_BYTES + PEFT_CODE_BYTES


def test_a_cached_calibration_sets_the_local_estimates_model_code(tmp_path, monkeypatch):
    if detect_local().family != "cpu":
        pytest.skip("the local device is a GPU: its calibration records no model code")
    import memplan.memory.stacks.transformers as hf_stack

    monkeypatch.setattr(hf_stack, "datasets_installed", lambda: False)  # the Trainer's datasets: tested above
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "cache"))
    title, version = local.cpu_title(), local.torch_version()
    path = local.calibration_path("cpu", title, 1, version)
    path.parent.mkdir(parents=True)
    local.threads_path("cpu", title, version).write_text("threads = 1\n")
    runner = CliRunner()
    for code, expected in (((30 * MiB, 5 * MiB), 30 * MiB), ((None, None), TRANSFORMERS_CODE_BYTES)):
        path.write_text(calibration_text(code))
        r = runner.invoke(app, [*ESTIMATE, "--stack", "transformers"])
        assert r.exit_code == 0, r.output
        mem = json.loads(r.stdout)["memory"]
        assert mem["runtime_terms"]["context"] == 300 * MiB  # the calibration was used
        assert mem["runtime_terms"]["model_code"] == expected


def test_merged_calibrations_take_the_median_model_code():
    from trainer.calibrate import Calibration, merge_calibrations

    cals = [Calibration(family="cpu", title="x", threads=1, transformers_code_bytes=t, peft_code_bytes=None)
            for t in (40 * MiB, 44 * MiB, 50 * MiB)]
    merged = merge_calibrations(cals)
    assert (merged.transformers_code_bytes, merged.peft_code_bytes) == (44 * MiB, None)
