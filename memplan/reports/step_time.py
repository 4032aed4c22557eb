"""The step-time report (``benchmarks/step_time.py --html``): predicted against measured seconds per step,
calibrated and static, where the predicted time goes, and MFU; one figure per function."""

from __future__ import annotations

from memplan.reports.page import Page, style_figure


TABLE_HEADER_PX, TABLE_ROW_PX = 60, 28  # three lines of 13 px labels; one line of cells
TABLE_TOP_PX, TABLE_BOTTOM_PX = 70, 20


def table_height(rows: int) -> int:
    """The per-config table's figure height: title margin, header, rows (with a sixth of a row spare
    each, for a config name that wraps), bottom margin."""
    return TABLE_TOP_PX + TABLE_HEADER_PX + rows * TABLE_ROW_PX * 7 // 6 + TABLE_BOTTOM_PX + 10


def scatter_figure(result: dict):
    """Predicted against measured seconds per step (log-log), calibrated and static, with ±15% and ±35% bands."""
    import plotly.graph_objects as go

    rows = result["rows"]
    names = [r["name"] for r in rows]
    measured = [r["measured_seconds"] for r in rows]
    lo, hi = min(measured + [r["static_predicted_seconds"] for r in rows]) / 1.5, \
        max(measured + [r["predicted_seconds"] for r in rows]) * 1.5
    scatter = go.Figure()
    scatter.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x", line=dict(color="#9aa5b1",
                                                                                               dash="dash")))
    for x, y, label in ((0.85, 1.15, "±15%"), (0.65, 1.35, "±35%")):
        scatter.add_trace(go.Scatter(x=[lo, hi, hi, lo], y=[lo * y, hi * y, hi * x, lo * x], fill="toself",
                                     mode="none", name=label, opacity=0.12, hoverinfo="skip"))
    scatter.add_trace(go.Scatter(x=measured, y=[r["predicted_seconds"] for r in rows], mode="markers",
                                 name=f"calibrated (median |error| {result['median_abs_error']:.1%})", text=names,
                                 marker=dict(size=10, color="#2563eb")))
    scatter.add_trace(go.Scatter(x=measured, y=[r["static_predicted_seconds"] for r in rows], mode="markers",
                                 name=f"static cpu profile (median |error| {result['static_median_abs_error']:.0%})",
                                 text=names, marker=dict(size=9, color="#dc2626", symbol="x")))
    scatter.update_xaxes(type="log", title="measured seconds per step")
    scatter.update_yaxes(type="log", title="predicted seconds per step")
    style_figure(scatter, "Predicted vs measured step time (log-log)", height=560)
    return scatter


def error_figure(rows: list[dict]):
    """Each config's error, calibrated and static, in percent."""
    import plotly.graph_objects as go

    names = [r["name"] for r in rows]
    errors = go.Figure()
    errors.add_trace(go.Bar(x=names, y=[r["error"] * 100 for r in rows], name="calibrated", marker_color="#2563eb"))
    errors.add_trace(go.Bar(x=names, y=[r["static_error"] * 100 for r in rows], name="static cpu profile",
                            marker_color="#dc2626", opacity=0.6))
    errors.update_yaxes(title="(predicted − measured) / measured, %", type="linear")
    errors.update_layout(barmode="group")
    style_figure(errors, "Error per config", height=520)
    errors.update_yaxes(range=[-100, 100])
    return errors


def terms_figure(rows: list[dict]):
    """Where the predicted time goes, term by term, as a share of the prediction, with the measured step."""
    import plotly.graph_objects as go

    names = [r["name"] for r in rows]
    terms = [t for t in ("forward", "backward", "recompute", "attention", "loss", "optimizer", "launch")
             if any(r["breakdown"].get(t, 0) > 0 for r in rows)]
    stack = go.Figure()
    for t in terms:
        stack.add_trace(go.Bar(x=names, y=[r["breakdown"].get(t, 0) / r["predicted_seconds"] * 100 for r in rows],
                               name=t))
    stack.add_trace(go.Scatter(x=names, y=[r["measured_seconds"] / r["predicted_seconds"] * 100 for r in rows],
                               mode="markers", name="measured", marker=dict(color="black", size=9, symbol="diamond")))
    stack.update_layout(barmode="stack")
    stack.update_yaxes(title="% of the predicted step")
    style_figure(stack, "Where the predicted time goes (measured as a share of the prediction)", height=520)
    return stack


def mfu_figure(rows: list[dict]):
    """MFU of each config against the calibrated matmul peak of its compute dtype."""
    import plotly.graph_objects as go

    names = [r["name"] for r in rows]
    mfu = go.Figure(go.Bar(x=names, y=[r["mfu_calibrated_peak"] * 100 for r in rows], marker_color="#059669"))
    mfu.update_yaxes(title="model FLOPs/s ÷ calibrated matmul peak, %")
    style_figure(mfu, "MFU against the calibrated matmul peak of the config's compute dtype", height=440)
    return mfu


def table_figure(rows: list[dict]):
    """The per-config table: measured, predicted (calibrated and static), errors, MFU, the largest term."""
    import plotly.graph_objects as go

    names = [r["name"] for r in rows]

    def ms(x: float) -> str:
        return f"{x * 1e3:,.1f}"

    top = [max(r["breakdown"], key=r["breakdown"].get) for r in rows]
    table = go.Figure(go.Table(
        header=dict(values=["config", "measured ms", "calibrated ms", "error", "static ms", "static error",
                            "MFU (calibrated peak)", "largest term", "pass medians ms"], align="left",
                    height=TABLE_HEADER_PX),
        cells=dict(values=[names, [ms(r["measured_seconds"]) for r in rows],
                           [ms(r["predicted_seconds"]) for r in rows], [f"{r['error']:+.1%}" for r in rows],
                           [ms(r["static_predicted_seconds"]) for r in rows],
                           [f"{r['static_error']:+.0%}" for r in rows],
                           [f"{r['mfu_calibrated_peak']:.0%}" for r in rows],
                           [f"{t} ({r['breakdown'][t] / r['predicted_seconds']:.0%})" for t, r in zip(top, rows)],
                           [" / ".join(f"{x * 1e3:.0f}" for x in r["pass_medians"]) for r in rows]], align="left",
                   height=TABLE_ROW_PX),
        columnwidth=[3.2, 1, 1.1, 0.8, 0.9, 0.9, 1.1, 1.5, 1.5]))
    # Plotly scrolls a table that does not fit its figure, hiding the last rows: the figure holds the
    # header at three lines (its labels wrap in a 1200 px window) and every row with room to spare.
    style_figure(table, "Per config", height=table_height(len(rows)))
    table.update_layout(margin=dict(l=20, r=20, t=TABLE_TOP_PX, b=TABLE_BOTTOM_PX))
    return table


def step_time_page(result: dict, *, median_bar: float, worst_bar: float) -> Page:
    """The page of ``benchmarks/step_time.py``'s result (its JSON), held to its bars."""
    rows = result["rows"]
    n = result["noise"]
    return Page(
        title="Step time", model=f"{len(rows)} configs, {min(r['params'] for r in rows) / 1e6:.2f}M-"
                                 f"{max(r['params'] for r in rows) / 1e6:.0f}M parameters",
        device=f"{result['device']} ({result['threads']} thread(s), clock {result['clock']})",
        summary={
            "calibrated: median |error|": f"{result['median_abs_error']:.1%} (bar {median_bar:.0%})",
            "calibrated: worst |error|": f"{result['max_abs_error']:.1%} (bar {worst_bar:.0%})",
            "calibrated once, at the start: median / worst |error|":
                f"{result['start_calibration_median_abs_error']:.1%} / {result['start_calibration_max_abs_error']:.1%}",
            "static cpu profile: median |error|": f"{result['static_median_abs_error']:.0%}",
            "static cpu profile: worst |error|": f"{result['static_max_abs_error']:.0%}",
            "bars met": "yes" if result["passed"] else "no",
            "noise: reference matmul max/min over the run": f"{n['reference_probe_max_over_min']:.2f}",
            "noise: median step spread (IQR/median)": f"{n['median_step_spread']:.1%}",
            "noise: a config's pass-to-pass max/min (median)": f"{n['median_pass_to_pass']:.2f}",
            "noise: fp32 matmul rate across calibrations, max/min":
                f"{n['calibration_fp32_max_over_min']:.2f}" if n.get("calibration_fp32_max_over_min") else "n/a",
            "noise: wall / clock time (median, max)": f"{n['median_wall_over_clock']:.2f}, "
                                                     f"{n['max_wall_over_clock']:.2f}",
            "torch": result["torch"],
        },
        figures=[table_figure(rows), scatter_figure(result), error_figure(rows), terms_figure(rows), mfu_figure(rows)],
        notes=["Each config: the median of all measured steps (over the passes, each after warm-up) of "
               "trainer.step.train_step on the reference model; the calibrated prediction uses the median of the "
               "calibrations taken before, between and after the passes, with the same threads and clock. "
               "The static prediction uses memplan/profiles/cpu.toml (a nominal 8-core AVX2 "
               "desktop, no bf16: it times bf16 matmuls at its fp32 rate and knows nothing of first-touch page "
               "faults or dispatch cost on this machine).",
               "The prediction excludes the data-loading term (the benchmark feeds prepared batches)."],
    )
