"""memplan/reports: one module per page, importable without torch, each page built from its command's own data.
(The browser layout checks are in tests/runs/test_browser.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_report_pages_import_without_torch():
    code = ("import sys; import memplan.reports.page, memplan.reports.run, memplan.reports.validate, "
            "memplan.reports.step_time, memplan.reports.sweep; print('torch' in sys.modules, 'plotly' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]  # plotly too is imported only when a page is drawn


def _step_time_result() -> dict:
    rows = [{"name": f"llama {i}", "params": 1e6 * (i + 1), "measured_seconds": 0.01 * (i + 1),
             "predicted_seconds": 0.011 * (i + 1), "static_predicted_seconds": 0.02 * (i + 1), "error": 0.1,
             "static_error": 1.0, "mfu_calibrated_peak": 0.4, "pass_medians": [0.01, 0.011],
             "breakdown": {"forward": 0.004 * (i + 1), "backward": 0.006 * (i + 1), "optimizer": 0.001}}
            for i in range(3)]
    noise = {"reference_probe_max_over_min": 1.1, "median_step_spread": 0.02, "median_pass_to_pass": 1.05,
             "calibration_fp32_max_over_min": 1.2, "median_wall_over_clock": 1.0, "max_wall_over_clock": 1.1}
    return {"rows": rows, "noise": noise, "device": "cpu", "threads": 1, "clock": "cpu", "torch": "2.x",
            "median_abs_error": 0.1, "max_abs_error": 0.1, "static_median_abs_error": 1.0,
            "static_max_abs_error": 1.0, "start_calibration_median_abs_error": 0.12,
            "start_calibration_max_abs_error": 0.15, "passed": True}


def test_the_step_time_page_has_its_five_figures_and_the_bars_it_is_given(tmp_path):
    pytest.importorskip("plotly")
    from memplan.reports.page import write_page
    from memplan.reports.step_time import step_time_page

    page = step_time_page(_step_time_result(), median_bar=0.15, worst_bar=0.35)
    assert len(page.figures) == 5
    assert page.summary["calibrated: median |error|"] == "10.0% (bar 15%)"
    html = write_page(page, tmp_path / "step.html").read_text()
    assert "Where the predicted time goes" in html and "llama 2" in html


def test_the_run_reports_memory_plot_shows_only_the_steps_that_were_measured(tmp_path):
    """metrics.jsonl repeats the latest memory reading on the lines between measured steps (memory_step names
    the step measured): the memory figure draws the measured steps only, not flat copies of a reading."""
    pytest.importorskip("plotly")
    import json

    from memplan.reports.run import build_run_page

    # whole lines, as the trainer writes them (metrics.jsonl's lines are checked when read: trainer/records.py)
    lines = [{"kind": "event", "event": "start", "step": 0, "tokens": 0, "time": 0.0, "unix_time": 0.0,
              "model": {}, "setup": {}, "device": "cpu", "torch_device": "cpu", "torch": "2", "schedule": {},
              "predicted": {"peak_reserved": 1 << 30, "tokens_per_second": 1000.0}, "eval_every": 5,
              "save_every": 5, "tokens_per_step": 100, "train_tokens": 10_000, "memory_source": "rss",
              "mfu_peak_flops_per_second": 1e12, "data": "data", "config": {}}]
    measured_at = {1: 1, 2: 2, 3: 2, 4: 2, 5: 5}
    for step, at in measured_at.items():
        lines.append({"kind": "train", "step": step, "loss": 5.0 - step / 10, "time": float(step),
                      "tokens_per_second": 1000.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100 * step,
                      "step_seconds": 1.0, "mfu": 0.1, "micro_batch": 1, "grad_accum": 1, "skipped": False,
                      "eta_seconds": 1.0, "total_steps": 5, "memory_bytes": (500 + at) << 20, "memory_step": at})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    page = build_run_page(tmp_path)
    memory = next(f for f in page.figures if "Memory over time" in (f.layout.title.text or ""))
    drawn = [y for y in memory.data[0].y]
    assert [y is not None for y in drawn] == [True, True, False, False, True]


def test_each_figure_of_the_run_page_is_a_function_of_the_records():
    """The run page as memplan/reports' other pages: one function per figure (loss, memory, throughput, lr) and
    one for the summary, each drawn from typed records alone (no run directory): here the memory figure's
    predicted line steps down where an out-of-memory step re-planned the run, and the summary says so."""
    pytest.importorskip("plotly")
    from memplan.reports.run import loss_figure, lr_figure, memory_figure, run_summary, throughput_figure
    from trainer.records import EvalLine, OomEvent, StartEvent, TrainLine

    before, after = {"peak_reserved": 2 << 30, "tokens_per_second": 900.0}, {"peak_reserved": 1 << 30,
                                                                                "tokens_per_second": 800.0}
    start = StartEvent(event="start", step=0, tokens=0, time=0.0, unix_time=0.0, model={"describe": "m"}, setup={},
                       device="cpu", torch_device="cpu", torch="2", predicted=before, schedule={}, eval_every=2,
                       save_every=2, tokens_per_step=100, train_tokens=1000, memory_source="rss",
                       mfu_peak_flops_per_second=1e12, data="d", config={})
    oom = OomEvent(step=2, time=120.0, message="out of memory", micro_batch=1, grad_accum=2,
                   previous={"micro_batch": 2, "grad_accum": 1}, predicted=after)
    train = [TrainLine(step=s, loss=4.0 - s / 10, tokens_per_second=850.0, lr=1e-3 * s, grad_norm=1.0,
                       tokens=100 * s, step_seconds=60.0, time=60.0 * s, mfu=0.1, memory_bytes=(3 - (s > 2)) << 29,
                       memory_step=s, micro_batch=1, grad_accum=2, skipped=False, eta_seconds=0.0, total_steps=4)
             for s in (1, 2, 3, 4)]
    evals = [EvalLine(step=4, eval_loss=3.5, eval_ppl=33.1, eval_tokens=64, eval_loss_by_source={"a": 3.4, "b": 3.6},
                      eval_ppl_by_source={}, eval_tokens_by_source={}, samples=[], eval_seconds=1.0, tokens=400)]

    loss = loss_figure(train, evals)
    assert [t.name for t in loss.data][2:] == ["held-out loss (all sources)", "held-out: a", "held-out: b"]
    memory = memory_figure(train, [start], [oom], after)
    predicted = next(t for t in memory.data if t.name == "predicted peak (peak_reserved)")
    assert [y for y in predicted.y if y is not None] == [2.0, 2.0, 1.0, 1.0]  # GiB: 2 until the OOM, then 1
    assert [x for x in predicted.x if x is not None] == [0.0, 2.0, 2.0, 4.0]  # minutes
    rate = next(t for t in throughput_figure(train, after).data if t.name == "tokens/s (predicted)")
    assert list(rate.y) == [800.0, 800.0]
    assert [t.name for t in lr_figure(train).data] == ["learning rate", "gradient norm (before clipping)"]
    summary = run_summary("RUN", [start, *train, oom, *evals], train, evals, [start], [oom], after)
    assert summary["events"] == "1 out-of-memory step(s), micro-batch now 1"
    assert summary["peak memory"].startswith("measured 1.50 GiB (largest step), predicted 1.00 GiB")
