"""torch.compile's one-off compile time: F + ops · c, the ops counted from the model's spec and setup, F and c
from this machine's calibration (``[calibrated] compile_cost``) or the documented defaults. The benchmark that
checks the figures against real compiles is benchmarks/compile_time.py."""

from __future__ import annotations

import pytest

from memplan.autotune import autotune
from memplan.hardware import load_profile
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.timing import (DEFAULT_COMPILE_FIXED_SECONDS, DEFAULT_COMPILE_SECONDS_PER_OP, compile_cost,
                            compile_graph_seconds, compile_seconds, compiled_graph_ops, layer_dispatches, step_time,
                            trainer_recompiles)

SETUP = TrainSetup(ctx=256, micro_batch=4, precision="fp32", attention="sdpa", compile=True)
COST = {"fixed_seconds": 20.0, "seconds_per_op": 0.01}


def llama(layers: int) -> ModelSpec:
    return ModelSpec(arch="llama", layers=layers, hidden=384, heads=6, kv_heads=6, ffn=1024, vocab=4096, tied=True)


def test_the_compiled_graph_grows_by_one_block_of_ops_per_layer_and_not_with_grad_accum():
    per_layer = layer_dispatches(llama(1), SETUP)
    assert compiled_graph_ops(llama(10), SETUP) - compiled_graph_ops(llama(6), SETUP) == 4 * per_layer
    assert compiled_graph_ops(llama(6), SETUP.replace(grad_accum=8)) == compiled_graph_ops(llama(6), SETUP)
    # the recomputed forward is in the backward graph; autocast's casts are ops of the graph
    assert compiled_graph_ops(llama(6), SETUP.replace(checkpointing="full")) > compiled_graph_ops(llama(6), SETUP)
    assert compiled_graph_ops(llama(6), SETUP.replace(precision="bf16-mixed")) > compiled_graph_ops(llama(6), SETUP)


def test_the_compile_time_is_the_calibrated_fixed_part_plus_the_calibrated_cost_of_each_op():
    cpu = load_profile("cpu")
    calibrated = cpu.replace(calibrated={"compile_cost": COST})
    assert compile_cost(calibrated) == (20.0, 0.01, "calibrated")
    ops = compiled_graph_ops(llama(6), SETUP)
    # compiled once, rotary or not: the rotary tables are computed in the graph, not registered by the first
    # forward (which failed a guard at the second step); tests/runs/test_compile_recompiles.py measures it
    gpt2 = ModelSpec(arch="gpt2", layers=2, hidden=64, heads=2, kv_heads=2, ffn=256, vocab=64, tied=True)
    for spec in (llama(6), gpt2):
        assert trainer_recompiles(spec, SETUP) == 0
        assert trainer_recompiles(spec, SETUP.replace(grad_accum=4, checkpointing="full")) == 0
    assert compile_seconds(llama(6), calibrated, SETUP) == pytest.approx(20.0 + 0.01 * ops)
    assert compile_seconds(llama(6), calibrated, SETUP, recompiles=2) == pytest.approx(20.0 + 3 * 0.01 * ops)
    assert compile_graph_seconds(100, 0.01, 1) == pytest.approx(2.0)
    # uncalibrated: the documented defaults, not zero
    assert compile_cost(cpu) == (DEFAULT_COMPILE_FIXED_SECONDS, DEFAULT_COMPILE_SECONDS_PER_OP, "default")
    assert compile_seconds(llama(6), cpu, SETUP) == pytest.approx(
        DEFAULT_COMPILE_FIXED_SECONDS + DEFAULT_COMPILE_SECONDS_PER_OP * ops)
    # a bad calibrated entry is not used
    assert compile_cost(cpu.replace(calibrated={"compile_cost": {"fixed_seconds": "x"}}))[2] == "default"


def test_an_older_calibration_s_reference_compile_anchors_the_fixed_part():
    ref = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 704, "vocab": 4096, "ctx": 256, "micro_batch": 4,
           "eager_seconds": 1.0, "compiled_seconds": 0.8, "compile_seconds": 40.0}
    device = load_profile("cpu").replace(calibrated={"compile_reference": ref, "compile_speedup": 1.25})
    ref_spec = ModelSpec(arch="llama", layers=2, hidden=256, heads=4, kv_heads=4, ffn=704, vocab=4096, tied=True)
    ref_setup = TrainSetup(ctx=256, micro_batch=4, precision="fp32", attention="sdpa")
    assert compile_seconds(ref_spec, device, ref_setup) == pytest.approx(40.0)  # its own measurement comes out
    deeper = compile_seconds(llama(10), device, SETUP) - compile_seconds(llama(6), device, SETUP)
    assert deeper == pytest.approx(4 * layer_dispatches(llama(1), SETUP) * DEFAULT_COMPILE_SECONDS_PER_OP)


def test_estimate_and_autotune_use_the_graph_s_compile_time_and_say_why_compile_pays_or_not():
    cpu = load_profile("cpu")
    ref = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 704, "vocab": 4096, "ctx": 256, "micro_batch": 4,
           "eager_seconds": 1.0, "compiled_seconds": 0.8, "compile_seconds": 30.0}
    device = cpu.replace(calibrated={**cpu.calibrated, "compile_speedup": 1.25, "compile_reference": ref,
                                     "compile_cost": COST})
    expected = compile_seconds(llama(6), device, SETUP)
    t = step_time(llama(6), SETUP, device, epoch_tokens=1024 * 100)
    assert t.compile_seconds == pytest.approx(expected)
    assert t.epoch_seconds == pytest.approx(1024 * 100 / t.tokens_per_second + expected)
    ops = compiled_graph_ops(llama(6), SETUP)
    assert any(f"20 s + {ops:,} ops × 10.0 ms, calibrated" in n for n in t.notes)
    kw = dict(ctx=256, global_batch=8, precision="fp32")
    long_run = autotune(llama(6), device, tokens=2048 * 100_000, **kw)
    short_run = autotune(llama(6), device, tokens=2048 * 3, **kw)
    assert long_run.plan.setup.compile and not short_run.plan.setup.compile
    note = next(n for n in short_run.notes if n.startswith("torch.compile not taken"))
    assert f"s compile (20 s + {ops:,} ops × 10.0 ms, calibrated) is not paid back within the run's 3 steps" in note


def test_calibration_fits_the_fixed_part_and_the_cost_per_op_and_writes_them_into_the_profile(monkeypatch):
    import torch

    from memplan.compat import tomllib
    from memplan.hardware import device_from_toml
    from trainer import calibrate as cal_mod

    # two processes' one-offs: 10 s fixed, 200 and 600 ops compiled twice at 2 ms per op
    fit = cal_mod.fit_compile_cost(10.0 + 2 * 200 * 0.002, 10.0 + 2 * 600 * 0.002, (200, 600), compiles=2)
    assert fit["seconds_per_op"] == pytest.approx(0.002) and fit["fixed_seconds"] == pytest.approx(10.0)

    monkeypatch.setattr(cal_mod, "COMPILE_COST_MODELS", ({"layers": 1, "hidden": 32, "heads": 2, "ffn": 64},
                                                         {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64}))
    monkeypatch.setattr(cal_mod, "COMPILE_COST_SHAPE", {"vocab": 64, "ctx": 8, "micro_batch": 1})
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: (compiled.append(model), model)[1])  # no inductor here
    cal = cal_mod.Calibration(family="cpu", title="test", threads=1, memory_total_bytes=2**30,
                              memory_usable_bytes=2**29, bandwidth_bytes_per_second=1e10)
    cal_mod.measure_compile_cost(cal, fresh_processes=False)
    assert len(compiled) == 2
    assert cal.compile_cost["clock"] == "cpu" and len(cal.compile_cost["seconds"]) == 2
    assert cal.compile_cost["fixed_seconds"] >= 0 and cal.compile_cost["seconds_per_op"] >= 0
    text = cal_mod.profile_toml(cal_mod.profile_data(cal, "test", None))
    device = device_from_toml(tomllib.loads(text), "test.toml")
    fixed, per_op, source = compile_cost(device)
    assert source == "calibrated"
    assert (fixed, per_op) == pytest.approx((cal.compile_cost["fixed_seconds"], cal.compile_cost["seconds_per_op"]),
                                            rel=1e-3, abs=1e-9)  # written to 4 digits
    # the fit and the prediction count the same compiles (one each, no recompile): F + ops · c gives the two
    # measured one-offs back, where the per-op part came out above 0
    fit = cal_mod.fit_compile_cost(10.0 + 200 * 0.002, 10.0 + 600 * 0.002, (200, 600),
                                   compiles=1 + trainer_recompiles(llama(3), SETUP))
    assert fit["seconds_per_op"] == pytest.approx(0.002) and fit["fixed_seconds"] == pytest.approx(10.0)
    if cal.compile_cost["seconds_per_op"] > 0 and cal.compile_cost["fixed_seconds"] > 0:
        specs, setup = cal_mod._compile_cost_specs()
        exact = device.replace(calibrated={"compile_cost": cal.compile_cost})
        assert [compile_seconds(spec, exact, setup) for spec in specs] == pytest.approx(cal.compile_cost["seconds"],
                                                                                        abs=2e-3)


def test_a_compile_that_fails_in_the_cost_calibration_is_recorded_as_skipped(monkeypatch):
    import torch

    from trainer import calibrate as cal_mod

    monkeypatch.setattr(cal_mod, "COMPILE_COST_SHAPE", {"vocab": 64, "ctx": 8, "micro_batch": 1})

    def broken(model):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    cal = cal_mod.Calibration(family="cpu", title="test", threads=1)
    cal_mod.measure_compile_cost(cal, fresh_processes=False)
    assert cal.compile_cost == {} and any("no C++ compiler" in s for s in cal.skipped)
    assert "compile_cost" not in cal_mod.profile_data(cal, "test", None)["calibrated"]
