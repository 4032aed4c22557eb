"""``memplan validate``: every prediction of a matrix checked against a real measured training step here."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memplan.cli import app
from memplan.cli.options import DeviceMemoryOpt, DeviceOpt, JsonOpt, print_json

MatrixOpt = Annotated[str, typer.Option("--matrix", help="A bundled matrix name (default) or a matrix TOML file.")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="Only the matrix's representative subset (quick = true).")]
HtmlOpt = Annotated[Optional[str], typer.Option("--html", help="Write a self-contained HTML report to this file.",
                                                show_default=False)]
NoTraceOpt = Annotated[bool, typer.Option("--no-trace", help="Skip the FakeTensor trace of each config.")]


def validation_page(device_name: str, rows, summary):
    """The HTML report: predicted against measured with y = x, error per config, error per memory term."""
    import plotly.graph_objects as go

    from memplan.report import GIB, Page, style_figure

    names = [r.name for r in rows]
    measured = [r.measured_allocated / GIB for r in rows]
    predicted = [r.predicted_allocated / GIB for r in rows]
    top = max(measured + predicted) * 1.05
    scatter = go.Figure()
    scatter.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="y = x", line=dict(dash="dash", color="#9aa5b1")))
    scatter.add_trace(go.Scatter(x=measured, y=predicted, mode="markers", name="analytic", text=names,
                                 hovertemplate="%{text}<br>measured %{x:.3f} GiB<br>predicted %{y:.3f} GiB"))
    traced = [(r.measured_allocated / GIB, r.trace_allocated / GIB, r.name) for r in rows if r.trace_allocated]
    if traced:
        scatter.add_trace(go.Scatter(x=[t[0] for t in traced], y=[t[1] for t in traced], mode="markers", name="trace",
                                     marker=dict(symbol="x", size=8), text=[t[2] for t in traced]))
    scatter.update_xaxes(title="measured peak allocated (GiB)", type="log", dtick=1)  # decades only
    scatter.update_yaxes(title="predicted peak allocated (GiB)", type="log", dtick=1)
    style_figure(scatter, "Predicted against measured peak allocated")

    errors = go.Figure(go.Bar(x=names, y=[100 * r.error for r in rows], name="analytic",
                              hovertemplate="%{x}<br>%{y:+.2f}%"))
    if traced:
        errors.add_trace(go.Bar(x=names, y=[100 * (r.trace_error or 0) for r in rows], name="trace"))
    errors.update_yaxes(title="error (%) = (predicted − measured) / measured")
    errors.update_xaxes(tickangle=-45)
    style_figure(errors, "Error per config", height=520)

    terms = ("weights", "gradients", "optimizer", "forward_saved")
    per_term = go.Figure()
    for term in terms:
        values = [100 * (r.predicted_terms[term] - r.measured_terms[term]) / r.measured_terms[term]
                  if r.measured_terms.get(term) else None for r in rows]
        per_term.add_trace(go.Bar(x=names, y=values, name=term.replace("_", " ")))
    per_term.update_layout(barmode="group")
    per_term.update_yaxes(title="error (%) of the term")
    per_term.update_xaxes(tickangle=-45)
    style_figure(per_term, "Error per memory term (forward saved = what the forward leaves alive for backward)",
                 height=520)

    bars = "; ".join(f"{what} {value:.2%} (bar {bar:.0%}: {'met' if met else 'MISSED'})"
                     for what, value, bar, met in summary.bars())
    return Page(title="Memory validation", model=f"{len(rows)} configs", device=device_name,
                summary={"median |error|": f"{summary.median_abs_error:.2%}",
                         "worst |error|": f"{summary.max_abs_error:.2%} ({summary.worst})",
                         "bars": bars},
                figures=[scatter, errors, per_term],
                notes=["Measured: a real steady-state training step (the second of two, so optimizer state "
                       "exists) of memplan's reference model on this device. On the CPU, MemTracker counts the "
                       "live tensor bytes; on CUDA/ROCm it is torch.cuda.max_memory_allocated."])


@app.command("validate")
def validate_command(
    matrix: MatrixOpt = "default", quick: QuickOpt = False, json: JsonOpt = False, html: HtmlOpt = None,
    no_trace: NoTraceOpt = False, device: DeviceOpt = None, device_memory: DeviceMemoryOpt = None,
) -> None:
    """Predict, trace and really measure each config of a matrix on this device; print the errors and the bars."""
    import sys
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from memplan.cli.options import device_from
    from memplan.errors import InputError
    from memplan.units import format_bytes
    from memplan.validate import load_matrix, summarize, validation_json

    configs = load_matrix(matrix)
    if quick:
        configs = [c for c in configs if c.quick]
        if not configs:
            raise InputError(f"--quick: matrix {matrix!r} has no config with quick = true")
    if html and Path(html).is_dir():
        raise InputError(f"--html: {html!r} is a directory; give a file name such as validate.html")
    dev = device_from(device, device_memory)

    from trainer.validate import run_config

    console = Console(stderr=json)
    if not console.is_terminal:
        console = Console(stderr=json, width=140)  # a log or a pipe: keep each row on one line
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("validating", total=len(configs))
        for config in configs:
            progress.update(task, description=f"validating {config.name}")
            rows.append(run_config(config, dev, trace=not no_trace))
            progress.advance(task)
    summary = summarize(rows)
    if html:
        from memplan.report import write_page

        write_page(validation_page(dev.name, rows, summary), html)
    if json:
        print_json(validation_json(dev.name, rows))
        return
    table = Table(title=f"Peak allocated: predicted vs measured on {dev.name}", title_justify="left")
    for col, justify in (("config", "left"), ("predicted", "right"), ("measured", "right"), ("error", "right"),
                         ("trace", "right"), ("peak at", "left")):
        table.add_column(col, justify=justify)
    for r in rows:
        trace = f"{r.trace_error:+.2%}" if r.trace_error is not None else "-"
        table.add_row(r.name, format_bytes(r.predicted_allocated), format_bytes(r.measured_allocated),
                      f"{r.error:+.2%}", trace, r.peak_moment)
    console.print(table)
    console.print(f"median |error| [bold]{summary.median_abs_error:.2%}[/], worst [bold]{summary.max_abs_error:.2%}[/] "
                  f"({summary.worst})")
    for what, value, bar, met in summary.bars():
        mark = "[green]met[/]" if met else "[red]MISSED[/]"
        console.print(f"  {what}: {value:.2%} (bar ≤ {bar:.0%}) {mark}")
    if html:
        console.print(f"report: {html}")
    sys.stdout.flush()
