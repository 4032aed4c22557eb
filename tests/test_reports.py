"""memplan/reports: one module per page, importable without torch, each page built from its command's own data.
(The browser layout checks are in tests/test_browser.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_report_pages_import_without_torch():
    code = ("import sys; import memplan.reports.page, memplan.reports.run, memplan.reports.validate, "
            "memplan.reports.step_time; print('torch' in sys.modules, 'plotly' in sys.modules)")
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
