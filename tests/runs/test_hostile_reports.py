"""Hostile places to write a report (issue 14, items 11 and 18): a full disk, a read-only or missing
directory, for ``sweep --html``, ``validate --html`` (training and inference, with and without
``--json``) and ``train --report``.

Each is one line on stderr and no traceback: exit 2 where the path the user named cannot be written
(bad input), exit 1 where the disk is full (the machine failed). A path that cannot be written is
refused BEFORE the sweep or any measurement runs; and nothing half-written is left behind (no
temporary file, an older page at the path still whole).

The measurements of ``validate`` are replaced here by rows made from memplan's own predictions
(``fake_rows``), or by a function that fails the test if it is ever called: these tests are about
where the page goes, not about what was measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import fill_disk, tmpfs
from memplan.cli import app
from runs_helper import one_line_error, tiny_corpus, tiny_run

SWEEP = ["sweep", "--params", "22m", "--device", "cpu", "--ctx", "1k,2k", "--batch", "1,2"]
VALIDATE = ["validate", "--quick", "--no-trace", "--device", "cpu"]
VALIDATE_JSON = [*VALIDATE, "--json"]
VALIDATE_INFERENCE = ["validate", "--mode", "inference", "--quick", "--device", "cpu"]


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_failure(result, code: int, *needles: str) -> str:
    """Failed with ``code``, one line on stderr holding every needle, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def leftovers(directory: Path) -> list[str]:
    """Files in ``directory`` other than the filler and what the test put there."""
    return sorted(p.name for p in directory.iterdir() if p.name not in ("filler", "old.html", "run", "keep"))


# ---- what validate would measure: rows from the predictions, or nothing at all --------------------

def fake_rows(config, device, trace=True):
    from memplan.estimate import memory_on
    from memplan.validate import ValidationRow

    mem = memory_on(config.spec, config.setup, device)
    terms = {"weights": mem.weights, "gradients": mem.gradients, "optimizer": mem.optimizer,
             "forward_saved": mem.activations}
    return ValidationRow(name=config.name, spec=config.spec, setup=config.setup,
                         predicted_allocated=mem.peak_allocated, measured_allocated=mem.peak_allocated,
                         predicted_terms=terms, measured_terms=terms)


@pytest.fixture
def measured(monkeypatch):
    """The calls validate makes to measure (training and inference), recorded; each answers from
    ``fake_rows`` (an inference config fails the test: no hostile case here should reach it)."""
    import trainer.validate

    calls: list[str] = []

    def run_config(config, device, trace=True):
        calls.append(config.name)
        return fake_rows(config, device, trace)

    def run_inference_config(config, device):
        calls.append(config.name)
        raise AssertionError("an inference config was measured although the report could not be written")

    monkeypatch.setattr(trainer.validate, "run_config", run_config)
    monkeypatch.setattr(trainer.validate, "run_inference_config", run_inference_config)
    return calls


# ---- a path that cannot be written: refused before any work, exit 2 ----------------------------

COMMANDS = {"sweep": SWEEP, "validate": VALIDATE, "validate-json": VALIDATE_JSON,
            "validate-inference": VALIDATE_INFERENCE}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_missing_output_directory_is_refused_before_any_work(command, measured, tmp_path):
    target = tmp_path / "no-such-dir" / "report.html"
    result = cli(*COMMANDS[command], "--html", str(target))
    one_line_error(result, "--html", "no-such-dir", "does not exist")
    assert measured == [], f"measured {measured} before refusing the path"
    assert result.stdout == "", "the sweep's table was printed before the path was refused"
    assert not (tmp_path / "no-such-dir").exists()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_read_only_output_directory_is_refused_before_any_work(command, measured, read_only_dir):
    result = cli(*COMMANDS[command], "--html", str(read_only_dir / "report.html"))
    one_line_error(result, "--html", "cannot write", str(read_only_dir))
    assert measured == []
    assert result.stdout == ""
    assert list(read_only_dir.iterdir()) == []


def test_a_file_in_the_way_of_the_directory_is_refused_before_the_sweep(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = cli(*SWEEP, "--html", str(blocker / "sweep.html"))
    one_line_error(result, "--html: cannot write", "is not a directory")
    assert result.stdout == "" and blocker.read_text() == "not a directory"


# ---- a full disk: exit 1, one line, nothing half-written, an older page kept whole ----------------

@pytest.mark.parametrize("command", ["sweep", "validate", "validate-json"])
def test_a_full_disk_is_refused_before_any_work(command, measured, small_disk):
    (small_disk / "old.html").write_text("the previous report")
    fill_disk(small_disk)
    result = cli(*COMMANDS[command], "--html", str(small_disk / "old.html"))
    one_line_failure(result, 1, "--html", "free", "a report takes at least")
    assert measured == []
    assert result.stdout == ""
    assert (small_disk / "old.html").read_text() == "the previous report"
    assert leftovers(small_disk) == []


def test_a_disk_that_fills_while_validate_measures_leaves_no_half_page(monkeypatch, measured, tmp_path):
    """The space was there when validate started; the disk fills during the measurements (here: on
    a tmpfs just big enough for the check, filled by the second measurement)."""
    import trainer.validate

    import memplan.reports.page

    size = memplan.reports.page.page_bytes_at_least() + (1 << 20)
    with tmpfs(tmp_path / "disk", size) as mount:
        (mount / "old.html").write_text("the previous report")
        answer = trainer.validate.run_config

        def filling(config, device, trace=True):
            if len(measured) == 1:
                fill_disk(mount, leave=64 << 10)  # someone else's download lands meanwhile
            return answer(config, device, trace)

        monkeypatch.setattr(trainer.validate, "run_config", filling)
        result = cli(*VALIDATE, "--html", str(mount / "old.html"))
        one_line_failure(result, 1, "--html: cannot write", "No space left on device", "nothing was written")
        assert len(measured) > 1  # it did measure: the disk filled afterwards
        assert (mount / "old.html").read_text() == "the previous report"
        assert leftovers(mount) == []


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real tiny run's directory (4 steps), to rebuild its report elsewhere."""
    import torch

    root = tmp_path_factory.mktemp("report-run")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_run(root / "run", tiny_corpus(root), steps=4)
    finally:
        torch.set_num_threads(previous)


def copy_run(run: Path, where: Path) -> Path:
    """The run's records (not its checkpoints) under ``where``: what ``train --report`` reads."""
    dest = where / "run"
    dest.mkdir()
    for f in run.iterdir():
        if f.is_file() and f.name != "report.html":
            shutil.copy2(f, dest / f.name)
    (dest / "report.html").write_text("the previous report")
    return dest


def test_train_report_on_a_full_disk_is_one_line_and_keeps_the_old_report(finished_run, small_disk):
    run = copy_run(finished_run, small_disk)
    fill_disk(small_disk)
    before = sorted(p.name for p in run.iterdir())
    result = cli("train", "--out", str(run), "--report")
    one_line_failure(result, 1, "--report", "free", "a report takes at least")
    assert (run / "report.html").read_text() == "the previous report"
    assert sorted(p.name for p in run.iterdir()) == before


def test_train_report_whose_write_fails_midway_leaves_no_half_page(finished_run, small_disk, monkeypatch):
    """The free-space check passed (here: told a page needs nothing) but the page does not fit."""
    import memplan.reports.page

    run = copy_run(finished_run, small_disk)
    fill_disk(small_disk, leave=128 << 10)
    monkeypatch.setattr(memplan.reports.page, "page_bytes_at_least", lambda: 0)
    before = sorted(p.name for p in run.iterdir())
    result = cli("train", "--out", str(run), "--report")
    one_line_failure(result, 1, "--report: cannot write", "No space left on device", "nothing was written")
    assert (run / "report.html").read_text() == "the previous report"
    assert sorted(p.name for p in run.iterdir()) == before


def test_train_report_into_a_read_only_run_is_exit_2(finished_run, small_disk):
    run = copy_run(finished_run, small_disk)
    if os.geteuid() == 0:
        assert subprocess.run(["mount", "-o", "remount,ro", str(small_disk)]).returncode == 0
    else:
        run.chmod(0o555)
    result = cli("train", "--out", str(run), "--report")
    one_line_error(result, "--report: cannot write", "report.html")
    assert (run / "report.html").read_text() == "the previous report"


# ---- validate's progress counts the distributed configs (it showed 0/None) -------------------------

def test_distributed_validate_progress_has_a_total_and_reaches_it(monkeypatch):
    import rich.progress
    import trainer.validate

    seen: dict[str, list] = {"total": [], "completed": []}
    add_task, update = rich.progress.Progress.add_task, rich.progress.Progress.update

    def recording_add(self, description, *a, total=100.0, **kw):
        seen["total"].append(total)
        return add_task(self, description, *a, total=total, **kw)

    def recording_update(self, task_id, *a, **kw):
        if "completed" in kw:
            seen["completed"].append(kw["completed"])
        return update(self, task_id, *a, **kw)

    def run_distributed(configs, device, world_size, progress=None):
        rows = []
        for i, config in enumerate(configs):
            rows.append(fake_rows(config, device))
            if progress is not None:
                progress(i + 1)
        return rows

    monkeypatch.setattr(rich.progress.Progress, "add_task", recording_add)
    monkeypatch.setattr(rich.progress.Progress, "update", recording_update)
    monkeypatch.setattr(trainer.validate, "run_distributed", run_distributed)
    result = cli("validate", "--world-size", "2", "--quick", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    from memplan.validate import DISTRIBUTED_MATRIX, load_matrix

    n = len([c for c in load_matrix(DISTRIBUTED_MATRIX) if c.quick])
    assert seen["total"] == [n], seen
    assert seen["completed"][-1] == n, seen


# ---- the decode step's missing term (item 10): the host's dispatch, counted and said in words ---------

@pytest.mark.parametrize("arch,dtype", [("llama", "fp32"), ("llama", "bf16"), ("gpt2", "fp32"), ("gpt_neox", "bf16")])
def test_decode_dispatches_are_what_a_real_decode_step_dispatches(arch, dtype):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memplan.inference import InferenceSetup, decode_dispatches
    from memplan.model import ModelSpec
    from trainer.generate import KVCache, forward_cached
    from trainer.model import build_model

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    spec = ModelSpec(arch=arch, layers=3, hidden=64, heads=4, kv_heads=2 if arch == "llama" else 4, ffn=128,
                     vocab=300, tied=True, max_positions=128)
    setup = InferenceSetup(ctx=48, prompt=16, weights_dtype=dtype, sampling="greedy")
    model = build_model(spec, "sdpa", "none", getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])).eval()
    cache = KVCache(model, 1, 48)
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        forward_cached(model, ids, cache, 0)
        with Count() as count:
            forward_cached(model, ids[:, -1:], cache, cache.length)
    assert decode_dispatches(spec, setup) == pytest.approx(count.n, abs=2)  # the RoPE table's growth: ±1


def test_validate_inference_predicts_the_decode_step_with_its_dispatch_and_says_what_it_leaves_out(monkeypatch):
    """The decode step was shown against a bare bandwidth roofline 40-1000× below it, without a word."""
    import trainer.validate

    from memplan.hardware import load_profile
    from memplan.inference import decode_bytes_per_step, decode_dispatch_seconds
    from memplan.validate import load_inference_matrix

    def measure_generation(spec, setup, seed=0):
        return {"prefill_peak_allocated": 1 << 20, "decode_peak_allocated": 1 << 20,
                "decode_step_seconds": 5e-4, "decode_steps": 16}

    monkeypatch.setattr(trainer.validate, "measure_generation", measure_generation)
    monkeypatch.setenv("COLUMNS", "200")
    result = cli(*VALIDATE_INFERENCE)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "predicted = roofline" in flat and "the host's dispatch" in flat and "Not covered" in flat, flat
    cpu = load_profile("cpu")
    config = next(c for c in load_inference_matrix("default") if c.quick)
    roofline = decode_bytes_per_step(config.spec, config.setup) / cpu.bandwidth_bytes_per_second
    predicted = roofline + decode_dispatch_seconds(config.spec, config.setup, cpu)
    assert predicted > 10 * roofline  # a small model's step is its dispatch
    row = next(line for line in result.output.splitlines() if config.name in line and " ms" in line)
    assert f"{predicted * 1e3:.2f} ms" in row, row
    assert f"{5e-4 / predicted:.2f}" in row, row


# ---- a benchmark whose bar fails exits non-zero and says which bar and by how much (item 10) ------------

def _benchmark(name: str, monkeypatch):
    import importlib.util

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _step_time_result(errors: list[float]) -> dict:
    rows = [{"name": f"config {i}", "error": e, "start_calibration_error": e, "static_error": e}
            for i, e in enumerate(errors)]
    return {"rows": rows, "median_abs_error": sorted(abs(e) for e in errors)[len(errors) // 2],
            "max_abs_error": max(abs(e) for e in errors), "start_calibration_median_abs_error": 0.1,
            "start_calibration_max_abs_error": 0.4, "static_median_abs_error": 0.5, "static_max_abs_error": 0.9,
            "noise": {"reference_probe_max_over_min": 1.1, "median_step_spread": 0.02, "median_wall_over_clock": 1.5,
                      "max_wall_over_clock": 2.0}, "seconds": 1.0}


@pytest.mark.parametrize("errors,code", [([0.05, -0.10, 0.423, 0.08, -0.02, 0.12], 1),
                                         ([0.05, -0.10, 0.30, 0.08, -0.02, 0.12], 0)])
def test_step_time_exits_1_naming_the_missed_bar_and_by_how_much(errors, code, monkeypatch, capsys):
    step_time = _benchmark("step_time", monkeypatch)
    monkeypatch.setattr(step_time, "run", lambda args: _step_time_result(errors))
    assert step_time.main(["--quick"]) == code
    out = capsys.readouterr().out
    if code:
        assert "calibrated step time: worst |error| (config 2) 42.3% (bar ≤ 35.0%): MISSED by 7.3 points" in out, out
        assert "FAIL: 1 of 2 bars missed" in out
    else:
        assert "PASS: all 2 bars met" in out and "MISSED" not in out


def test_a_subset_of_step_time_says_its_bars_are_not_judged(monkeypatch, capsys):
    step_time = _benchmark("step_time", monkeypatch)
    monkeypatch.setattr(step_time, "run", lambda args: _step_time_result([0.9]))
    assert step_time.main(["--only", "300k", "--steps", "3"]) == 0
    assert "bars not judged: --only" in capsys.readouterr().out


@pytest.mark.parametrize("value,limit,at_most,unit,line", [
    (0.604, 0.5, True, "s", "startup 0.604 s (bar ≤ 0.500 s): MISSED by 0.104 s"),
    (0.70, 0.75, False, "", "ratio 0.70 (bar ≥ 0.75): MISSED by 0.05"),
    (0.0009, 0.005, True, "ms", "estimate 0.9 ms (bar ≤ 5.0 ms): met"),
])
def test_a_bar_says_met_or_missed_by_how_much(value, limit, at_most, unit, line, monkeypatch, capsys):
    bars = _benchmark("bars", monkeypatch)
    what = line.split(" ")[0]
    bar = bars.Bar(what, value, limit, at_most=at_most, unit=unit)
    assert bars.judge([bar]) == (0 if "met" == line.rsplit(" ", 1)[-1] else 1)
    assert capsys.readouterr().out.splitlines()[0] == line


@pytest.mark.parametrize("args", [["sweep", "--params", "22m", "--ctx", "1k", "--device", "cpu", "--json"],
                                  ["estimate", "--params", "22m", "--ctx", "1k", "--device", "cpu", "--json"]])
def test_json_into_a_full_disk_is_one_line_exit_1(args):
    """``memplan ... --json > file`` on a full disk (here /dev/full): one line, exit 1, no traceback."""
    import memplan

    env = {**os.environ, "PYTHONPATH": str(Path(memplan.__file__).resolve().parents[1])}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "memplan", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--json: cannot write" in lines[0] and "No space left on device" in lines[0], lines[0]


@pytest.mark.slow
def test_measure_ranks_reports_each_config_as_rank_0_finishes_it():
    """The real gloo processes (two ranks, two tiny configs): the progress callback sees the count rise to
    the number of configs, never past it (the CLI's counter reads it)."""
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.distributed import measure_ranks

    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=128, tied=True)
    configs = [(spec, TrainSetup(ctx=16, micro_batch=b, precision="fp32", world_size=2, sharding="ddp"))
               for b in (1, 2)]
    seen: list[int] = []
    measured = measure_ranks(configs, 2, progress=seen.append)
    assert len(measured) == 2 and all(len(ranks) == 2 for ranks in measured)
    assert seen and seen[-1] == 2 and max(seen) == 2 and seen == sorted(seen), seen
