"""The trainer's hot path and the planner's speed choices (issue 18): what a step pays beyond the step itself
(memory readings sampled, metrics flushed in batches, the live line redrawn without a thread), and torch.compile
measured by calibration, modelled by memplan.timing (its compile time a one-off in the epoch) and taken by
autotune only where the calibrated numbers say it pays. Mechanisms, not timings: the machine is shared."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from memplan.autotune import autotune
from memplan.hardware import load_profile
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup
from memplan.timing import (DEFAULT_COMPILE_SECONDS_PER_OP, compile_fusion, compile_seconds, compiled_graph_ops,
                            step_time)
from trainer import loop, rundir
from trainer.data import PreparedData
from trainer.loop import TrainConfig, Trainer
from trainer.rundir import read_metrics


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from runs_helper import pydoc_corpus

    return pydoc_corpus(tmp_path_factory.mktemp("corpus"))


def _trainer(run_dir: Path, corpus: Path) -> Trainer:
    prepared = PreparedData(corpus)
    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=prepared.vocab_size,
                     tied=True)
    plan = Plan(model=spec, setup=TrainSetup(ctx=32, micro_batch=2, precision="fp32"), device="cpu")
    config = TrainConfig(max_steps=1000, eval_every=1000, save_every=1000, sample_tokens=0, verify_data=False,
                         warmup_steps=0)
    return Trainer.start(run_dir, plan, prepared, config, load_profile("cpu"))


class _Counting:
    """Wraps the trainer's memory monitor, counting resets and reads."""

    def __init__(self, monitor):
        self.monitor, self.resets, self.reads = monitor, 0, 0
        self.source = monitor.source

    def reset(self):
        self.resets += 1
        self.monitor.reset()

    def read(self):
        self.reads += 1
        return self.monitor.read()

    def close(self):
        self.monitor.close()


# ---- the hot path ------------------------------------------------------------------------------------

def test_memory_is_read_on_a_sample_of_steps_and_every_line_says_which_step_it_measured(tmp_path, corpus,
                                                                                          monkeypatch):
    monkeypatch.setattr(loop, "MEMORY_SAMPLE_SECONDS", 1e9)  # never due again after the first step
    trainer = _trainer(tmp_path / "run", corpus)
    counting = trainer.monitor = _Counting(trainer.monitor)
    trainer.open()
    lines = [trainer.advance() for _ in range(12)]
    trainer.close()
    assert counting.resets == counting.reads == 2  # the first two steps only: no /proc read on the other 10
    assert [l.memory_step for l in lines] == [1] + [2] * 11  # advance() returns the step's TrainLine
    assert all(l.memory_bytes == lines[1].memory_bytes > 0 for l in lines[1:])
    on_disk = [l for l in read_metrics(tmp_path / "run") if l["kind"] == "train"]
    assert [l["memory_step"] for l in on_disk] == [1] + [2] * 11


def test_memory_is_measured_again_once_the_sample_interval_of_training_time_has_passed(tmp_path, corpus,
                                                                                      monkeypatch):
    monkeypatch.setattr(loop, "MEMORY_SAMPLE_SECONDS", 0.0)  # due at every step
    trainer = _trainer(tmp_path / "run", corpus)
    counting = trainer.monitor = _Counting(trainer.monitor)
    trainer.open()
    lines = [trainer.advance() for _ in range(4)]
    trainer.close()
    assert counting.reads == 4 and [l.memory_step for l in lines] == [1, 2, 3, 4]


def test_train_lines_are_flushed_in_batches_and_all_reach_the_file(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(rundir, "METRICS_FLUSH_SECONDS", 1e9)
    flushes = []
    real = rundir.MetricsWriter.flush
    monkeypatch.setattr(rundir.MetricsWriter, "flush", lambda self: (flushes.append(1), real(self))[1])
    trainer = _trainer(tmp_path / "run", corpus)
    trainer.open()
    after_start = len(flushes)  # the start event is flushed at once
    for _ in range(10):
        trainer.advance()
    assert len(flushes) == after_start  # no flush per train line
    trainer.log.flush()
    assert [l["step"] for l in read_metrics(tmp_path / "run") if l["kind"] == "train"] == list(range(1, 11))
    trainer.close()


def test_the_live_line_needs_no_refresh_thread_and_shows_the_metrics_lines_figures(tmp_path, corpus):
    from memplan.cli.train import _ProgressView
    from memplan.units import format_bytes, format_count

    trainer = _trainer(tmp_path / "run", corpus)
    view = _ProgressView(Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None), trainer)
    trainer.on_event(view.update)
    with view:
        assert not view.progress.live.auto_refresh  # no thread redrawing the line 10 times a second
        trainer.open()
        for _ in range(3):
            trainer.advance()
            out = io.StringIO()
            Console(file=out, width=200, color_system=None).print(view.progress.get_renderable())
            shown = out.getvalue()
    trainer.close()
    last = [l for l in read_metrics(tmp_path / "run") if l["kind"] == "train"][-1]
    assert f"loss {last['loss']:.4f}" in shown
    assert f"{format_count(last['tokens_per_second'])} tok/s" in shown
    assert f"MFU {last['mfu']:.1%}" in shown
    assert f"mem {format_bytes(last['memory_bytes'])}" in shown


# ---- torch.compile: calibrated, modelled, chosen where it pays -------------------------------------------

REFERENCE = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 704, "vocab": 4096, "ctx": 256, "micro_batch": 4}


def _calibrated_cpu(eager: float, compiled: float, compile_s: float):
    cpu = load_profile("cpu")
    return cpu.replace(calibrated={**cpu.calibrated, "compile_speedup": eager / compiled, "compile_seconds": compile_s,
                                   "compile_reference": {**REFERENCE, "eager_seconds": eager,
                                                         "compiled_seconds": compiled, "compile_seconds": compile_s}})


SPEC = ModelSpec(arch="llama", layers=6, hidden=384, heads=6, kv_heads=6, ffn=1024, vocab=4096, tied=True)


def test_a_compiled_step_is_modelled_from_the_reference_and_the_epoch_includes_the_compile_time():
    fast = _calibrated_cpu(eager=1.0, compiled=0.8, compile_s=30.0)
    assert compile_fusion(fast) > 1
    eager_setup = TrainSetup(ctx=256, micro_batch=8, precision="fp32")
    eager = step_time(SPEC, eager_setup, fast, epoch_tokens=2048 * 100)
    compiled = step_time(SPEC, eager_setup.replace(compile=True), fast, epoch_tokens=2048 * 100)
    assert compiled.step_seconds < eager.step_seconds
    assert compiled.fusible_seconds < eager.fusible_seconds
    assert compiled.terms["forward"].seconds < eager.terms["forward"].seconds  # its elementwise kernels
    one_off = compile_seconds(SPEC, fast, eager_setup)
    ref_ops = compiled_graph_ops(ModelSpec(arch="llama", layers=2, hidden=256, heads=4, kv_heads=4, ffn=704, vocab=4096,
                                           tied=True), eager_setup)  # the reference's measured 30 s, plus the ops added
    assert one_off == pytest.approx(  # each graph compiled once (no recompile after the first step)
        30.0 + (compiled_graph_ops(SPEC, eager_setup) - ref_ops) * DEFAULT_COMPILE_SECONDS_PER_OP)
    assert compiled.compile_seconds == one_off and eager.compile_seconds == 0
    assert compiled.epoch_seconds == pytest.approx(2048 * 100 / compiled.tokens_per_second + one_off)
    # a reference whose compiled step was slower: the fusible work is modelled slower, never faster
    slow = _calibrated_cpu(eager=1.0, compiled=1.1, compile_s=30.0)
    assert compile_fusion(slow) < 1
    assert step_time(SPEC, eager_setup.replace(compile=True), slow).step_seconds > eager.step_seconds


def test_autotune_compiles_only_where_the_calibrated_speedup_pays_back_the_compile_time_over_the_run():
    device = _calibrated_cpu(eager=1.0, compiled=0.8, compile_s=30.0)
    kw = dict(ctx=256, global_batch=8, precision="fp32")
    long_run = autotune(SPEC, device, tokens=2048 * 100_000, **kw)
    assert long_run.plan.setup.compile
    assert any(n.startswith("torch.compile taken: steps") and "the run is 100,000 steps" in n for n in long_run.notes)
    short_run = autotune(SPEC, device, tokens=2048 * 3, **kw)  # three steps cannot pay for ~70 s of compiling
    assert not short_run.plan.setup.compile
    assert any("is not paid back within the run's 3 steps" in n for n in short_run.notes)
    chosen = long_run.candidates[0].predicted
    assert chosen["epoch_seconds"] == pytest.approx(2048 * 100_000 / chosen["tokens_per_second"]
                                                    + compile_seconds(SPEC, device, long_run.plan.setup))
    # a reference where compiling was slower: never compiled, however long the run
    slow = _calibrated_cpu(eager=1.0, compiled=1.25, compile_s=30.0)
    assert not autotune(SPEC, slow, tokens=2048 * 100_000, **kw).plan.setup.compile


def test_calibrate_measures_compile_on_the_reference_step_and_the_profile_models_it(monkeypatch):
    from memplan.compat import tomllib
    from memplan.hardware import device_from_toml
    from trainer import calibrate as cal_mod

    small = {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 128, "ctx": 16, "micro_batch": 2}
    monkeypatch.setattr(cal_mod, "COMPILE_REFERENCE", small)
    compiled_models = []
    monkeypatch.setattr(torch, "compile", lambda model: (compiled_models.append(model), model)[1])  # no inductor
    cal = cal_mod.Calibration(family="cpu", title="test", threads=1, memory_total_bytes=2**30,
                              memory_usable_bytes=2**29, bandwidth_bytes_per_second=1e10)
    clock = cal_mod._Clock(torch.device("cpu"), deadline=float("inf"))
    cal_mod.measure_compile(clock, cal, steps=3)
    assert len(compiled_models) == 1
    assert {k: cal.compile[k] for k in small} == small
    assert cal.compile["eager_seconds"] > 0 and cal.compile["compiled_seconds"] > 0
    assert cal.compile["compile_seconds"] >= 0
    text = cal_mod.profile_toml(cal_mod.profile_data(cal, "test", None))
    device = device_from_toml(tomllib.loads(text), "test.toml")
    assert device.calibrated["compile_speedup"] == pytest.approx(
        cal.compile["eager_seconds"] / cal.compile["compiled_seconds"], rel=1e-3)
    assert compile_fusion(device) is not None  # timing models compile from what was written


def test_a_failed_compile_is_recorded_as_skipped_and_leaves_no_compile_figures(monkeypatch):
    from trainer import calibrate as cal_mod

    monkeypatch.setattr(cal_mod, "COMPILE_REFERENCE",
                        {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 128, "ctx": 16, "micro_batch": 2})

    def broken(model):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    cal = cal_mod.Calibration(family="cpu", title="test", threads=1)
    cal_mod.measure_compile(cal_mod._Clock(torch.device("cpu"), deadline=float("inf")), cal, steps=2)
    assert cal.compile == {} and any("torch.compile" in s and "no C++ compiler" in s for s in cal.skipped)
    assert "compile_reference" not in cal_mod.profile_data(cal, "test", None)["calibrated"]


def test_memplan_train_weighs_the_compile_time_against_the_run_it_plans():
    from memplan.planning import autotuned_plan

    device = _calibrated_cpu(eager=1.0, compiled=0.8, compile_s=30.0)

    def plan(**limits):
        return autotuned_plan(SPEC, 256, None, device, global_batch_tokens=2048,
                              budget_bytes=None, margin=0.1, **{"minutes": None, **limits}).setup.compile

    assert plan()  # no limit to weigh it against: the fastest step
    assert not plan(max_steps=3) and not plan(max_tokens=2048 * 3) and not plan(minutes=0.5)
    assert plan(max_steps=100_000) and plan(minutes=600)
