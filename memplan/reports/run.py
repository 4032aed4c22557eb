"""The run report, RUN/report.html: what a run measured beside what memplan predicted for it.

Built from RUN/metrics.jsonl alone (so it can be rebuilt at any time, also while the run goes on:
``memplan train --out RUN --report``), rendered by ``memplan.reports.page``. The trainer renders it in a
process of its own, ``python -m memplan.reports.run RUN`` (``trainer.reporting``), so that the training
process never holds what plotly and the page allocate:

- loss: training loss per step (raw and smoothed) and held-out loss, overall and per source;
- memory over training time: the measured peak of every step, with the predicted peak as a line
  (and, where torch can tell, the measured live-tensor peak beside the predicted peak_allocated);
- throughput: tokens/s per step with the predicted rate as a line, and MFU;
- learning rate and gradient norm.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from memplan.reports.page import Page, style_figure, write_page
from memplan.units import format_bytes, format_count, format_seconds, measured

SMOOTHING = 0.9  # exponential moving average of the training loss (plotted beside the raw loss)


def _ema(values: list[float | None], alpha: float = SMOOTHING) -> list[float | None]:
    """Exponential moving average with Adam's bias correction (so the first points are not pulled to 0 or to
    the first value)."""
    out, avg, n = [], 0.0, 0
    for v in values:
        if v is None:
            out.append(None)
            continue
        n += 1
        avg = alpha * avg + (1 - alpha) * v
        out.append(avg / (1 - alpha**n))
    return out


def _unit(max_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def _predicted_segments(starts: list, ooms: list, key: str) -> list[tuple[float, float]]:
    """(from_time, predicted value) marks: the prediction changes at a start/resume or an OOM (records of
    ``trainer.records``: StartEvent, OomEvent)."""
    marks = sorted([(e.time, e.predicted[key]) for e in starts + ooms if e.predicted.get(key)], key=lambda m: m[0])
    return marks


def loss_figure(train: list, evals: list):
    """Training loss per step, raw and smoothed (``_ema``), and the held-out loss, overall and per source
    (``trainer.records`` TrainLine and EvalLine records, by step)."""
    import plotly.graph_objects as go

    steps = [l.step for l in train]
    fig = go.Figure()
    losses = [l.loss for l in train]
    fig.add_trace(go.Scatter(x=steps, y=losses, mode="lines", name="train loss", line=dict(width=1, color="#9fb3c8")))
    fig.add_trace(go.Scatter(x=steps, y=_ema(losses), mode="lines", name=f"train loss (EMA {SMOOTHING})",
                             line=dict(width=2, color="#1f77b4")))
    if evals:
        fig.add_trace(go.Scatter(x=[e.step for e in evals], y=[e.eval_loss for e in evals],
                                 mode="lines+markers", name="held-out loss (all sources)",
                                 line=dict(width=2, color="#d62728")))
        sources = sorted({s for e in evals for s in e.eval_loss_by_source})
        for s in sources:
            pts = [(e.step, e.eval_loss_by_source[s]) for e in evals if s in e.eval_loss_by_source]
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                     name=f"held-out: {s}", line=dict(dash="dash")))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="cross-entropy (nats/token)")
    return style_figure(fig, "Loss")


def memory_figure(train: list, starts: list, ooms: list, predicted: dict):
    """Memory over training time: the steps that were measured (a line repeating an earlier step's reading, as
    memory_step says, is not a measurement of its own; runs before memory_step measured every step), with the
    predicted peak (and live tensors) as a line that changes at each start, resume and out-of-memory step."""
    import plotly.graph_objects as go

    times_min = [l.time / 60 for l in train]
    measured = [l.memory_bytes if l.measured_here else None for l in train]
    allocated = [l.memory_allocated_bytes if l.measured_here else None for l in train]
    biggest = max([m for m in measured if m] + [predicted.get("peak_reserved") or 0] + [1])
    scale, unit = _unit(biggest)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=times_min, y=[m / scale if m else None for m in measured], mode="lines+markers",
                             marker=dict(size=3), name="measured peak (each measured step)", connectgaps=True))
    if any(a is not None for a in allocated):
        fig.add_trace(go.Scatter(x=times_min, y=[a / scale if a else None for a in allocated], mode="lines",
                                 name="measured live tensors (max_memory_allocated)", connectgaps=True))
    for key, label, dash in (("peak_reserved", "predicted peak (peak_reserved)", "dash"),
                             ("peak_allocated", "predicted live tensors (peak_allocated)", "dot")):
        if key == "peak_allocated" and not any(a is not None for a in allocated):
            continue
        marks = _predicted_segments(starts, ooms, key)
        if not marks or not times_min:
            continue
        xs, ys = [], []
        end = max(times_min)
        for i, (t0, v) in enumerate(marks):
            t1 = marks[i + 1][0] if i + 1 < len(marks) else end * 60
            xs += [t0 / 60, t1 / 60, None]
            ys += [v / scale, v / scale, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label, line=dict(dash=dash, width=2)))
    fig.update_xaxes(title="training time (minutes)")
    fig.update_yaxes(title=unit, rangemode="tozero")
    return style_figure(fig, "Memory over time: measured on a sample of steps, predicted as a line")


def throughput_figure(train: list, predicted: dict):
    """Tokens/s per step with the predicted rate as a line (MFU is tokens/s times a constant: it rides along in the
    hover, not as a second line); a log scale where the prediction is an order of magnitude away."""
    import plotly.graph_objects as go

    steps = [l.step for l in train]
    fig = go.Figure()
    tps = [l.tokens_per_second for l in train]
    fig.add_trace(go.Scatter(x=steps, y=tps, mode="lines", name="tokens/s (measured)", line=dict(width=1.5),
                             customdata=[(l.mfu or 0) * 100 for l in train],
                             hovertemplate="step %{x}<br>%{y:,.0f} tokens/s<br>MFU %{customdata:.2f}%<extra></extra>"))
    if predicted.get("tokens_per_second") and steps:
        fig.add_trace(go.Scatter(x=[steps[0], steps[-1]], y=[predicted["tokens_per_second"]] * 2, mode="lines",
                                 name="tokens/s (predicted)", line=dict(dash="dash", width=2)))
    fig.update_xaxes(title="step")
    measured_tps = [t for t in tps if t]
    far = predicted.get("tokens_per_second") and measured_tps and not (
        0.1 < predicted["tokens_per_second"] / statistics.median(measured_tps) < 10)
    if far:  # a prediction an order of magnitude away would flatten the measured line: log scale
        fig.update_yaxes(title="tokens/s (log scale)", type="log")
    else:
        fig.update_yaxes(title="tokens/s", rangemode="tozero")
    return style_figure(fig, "Throughput")


def lr_figure(train: list):
    """The learning rate and the gradient norm (before clipping) per step, on two axes."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = [l.step for l in train]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=steps, y=[l.lr for l in train], mode="lines", name="learning rate"),
                  secondary_y=False)
    fig.add_trace(go.Scatter(x=steps, y=[l.grad_norm for l in train], mode="lines",
                             name="gradient norm (before clipping)", line=dict(width=1)), secondary_y=True)
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="learning rate", secondary_y=False)
    fig.update_yaxes(title="gradient norm", secondary_y=True)
    return style_figure(fig, "Learning rate and gradient norm", height=360)


def run_summary(run_dir: Path, lines: list, train: list, evals: list, starts: list, ooms: list,
                predicted: dict) -> dict[str, str]:
    """The report's summary rows: the run, model and setup, progress, losses, memory and throughput against
    the prediction (steady steps: all but the first), and what happened (resumes, out-of-memory steps,
    non-finite losses, the stop)."""
    from trainer.records import NonfiniteEvent, StopEvent, steady_figures  # torch-free

    first = starts[0] if starts else None
    model = first.model if first else {}
    setup = starts[-1].setup if starts else {}
    summary: dict[str, str] = {"run": str(run_dir)}
    if model:
        summary["model"] = f"{model.get('describe', '')} ({model.get('params', 0):,} parameters)"
    if setup:
        summary["setup"] = (f"ctx {setup.get('ctx')}, micro-batch {setup.get('micro_batch')} × "
                            f"{setup.get('grad_accum')} accumulation, {setup.get('precision')}, "
                            f"{setup.get('attention')} attention, checkpointing {setup.get('checkpointing')}, "
                            f"{setup.get('optimizer')}" + (", compiled" if setup.get("compile") else ""))
    if train:
        last = train[-1]
        total = last.total_steps
        summary["progress"] = (f"step {last.step:,}" + (f" of {total:,}" if total else "")
                               + f", {format_count(last.tokens)} tokens, "
                               f"{format_seconds(last.time)} of training")
        finite = [l.loss for l in train[-20:] if l.loss is not None]
        if finite:
            summary["train loss"] = f"{statistics.mean(finite):.4f} (mean of the last {len(finite)} steps)"
    if evals:
        e = evals[-1]
        per = ", ".join(f"{k} {v:.4f}" for k, v in e.eval_loss_by_source.items() if v is not None)
        if e.eval_loss is not None:
            summary["held-out loss"] = (f"{e.eval_loss:.4f} (perplexity {measured(e.eval_ppl, ',.1f')}) at "
                                        f"step {e.step:,}, over {e.eval_tokens:,} held-out tokens"
                                        + (f"; {per}" if per else ""))
    steady = steady_figures(train)  # as `memplan train`'s summary prints them
    peak_pred = predicted.get("peak_reserved")
    if steady is not None and steady.peak_memory_bytes and peak_pred:
        m = steady.peak_memory_bytes
        summary["peak memory"] = (f"measured {format_bytes(m)} (largest step), predicted {format_bytes(peak_pred)} "
                                  f"({(peak_pred - m) / m:+.1%})")
        if first is not None and first.baseline_memory_bytes and first.torch_device.startswith("cpu"):
            summary["peak memory"] += (f"; the process held {format_bytes(first.baseline_memory_bytes)} before "
                                       "the model existed")
    if steady is not None and steady.peak_allocated_bytes and predicted.get("peak_allocated"):
        m, p = steady.peak_allocated_bytes, predicted["peak_allocated"]
        summary["live tensors"] = f"measured {format_bytes(m)}, predicted {format_bytes(p)} ({(p - m) / m:+.1%})"
    if steady is not None and steady.tokens_per_second:
        med = steady.tokens_per_second
        line = f"{med:,.0f} tokens/s (median)"
        if predicted.get("tokens_per_second"):
            line += f", predicted {predicted['tokens_per_second']:,.0f} ({(predicted['tokens_per_second'] - med) / med:+.0%})"
        if steady.mfu is not None:
            line += f"; MFU {steady.mfu:.1%} of the device's dense peak"
        summary["throughput"] = line
    happened = []
    if len(starts) > 1:
        happened.append(f"resumed {len(starts) - 1}×")
    if ooms:
        happened.append(f"{len(ooms)} out-of-memory step(s), micro-batch now {ooms[-1].micro_batch}")
    bad = [e for e in lines if isinstance(e, NonfiniteEvent)]
    if bad:
        happened.append(f"{len(bad)} non-finite loss(es), updates skipped")
    stop = next((e for e in reversed(lines) if isinstance(e, StopEvent)), None)
    if stop:
        happened.append(f"stopped at step {stop.step}: {stop.reason}")
    if happened:
        summary["events"] = "; ".join(happened)
    return summary


def run_notes(evals: list, first) -> list[str]:
    """The latest evaluation's samples, as generated (newlines kept: the note is shown with white-space:
    pre-wrap), and where the measured and the predicted figures come from (``first``: the run's StartEvent)."""
    notes = []
    if evals and evals[-1].samples:
        for s in evals[-1].samples:
            notes.append(f"Sample at step {evals[-1].step}: “{s['prompt']}” → “{s['text']}”")
    notes.append("Measured memory: " + (first.memory_source if first else "n/a") + ". Predicted figures: memplan's "
                 f"estimate for this model and setup on the {first.device if first else '?'} profile.")
    return notes


def build_run_page(run_dir: str | Path) -> Page:
    """The report's page for the run in ``run_dir`` (its metrics.jsonl): one function per figure, the summary
    and the notes, from the run's typed records (``trainer.rundir.metric_records``)."""
    from trainer.records import EvalLine, OomEvent, StartEvent, TrainLine  # torch-free
    from trainer.rundir import metric_records

    run_dir = Path(run_dir)
    lines = metric_records(run_dir, latest=True)
    train = sorted((l for l in lines if isinstance(l, TrainLine)), key=lambda l: l.step)
    evals = sorted((l for l in lines if isinstance(l, EvalLine)), key=lambda l: l.step)
    starts = [e for e in lines if isinstance(e, StartEvent)]
    ooms = [e for e in lines if isinstance(e, OomEvent)]
    # the prediction the run is measured against now: its latest out-of-memory step's, else its latest start's
    predicted = ooms[-1].predicted if ooms else (starts[-1].predicted if starts else {})
    first = starts[0] if starts else None
    figures = [loss_figure(train, evals), memory_figure(train, starts, ooms, predicted),
               throughput_figure(train, predicted), lr_figure(train)]
    device = f"{first.device} ({first.torch_device})" if first else "? (?)"
    return Page(title="Training run", model=(first.model if first else {}).get("describe", "model"), device=device,
                summary=run_summary(run_dir, lines, train, evals, starts, ooms, predicted),
                figures=figures, notes=run_notes(evals, first))


def write_run_report(run_dir: str | Path, flag: str | None = None) -> Path:
    """Write RUN/report.html (atomically) and return its path. With ``flag`` (the option that asked for
    it), a failed write is one line naming it (``memplan.reports.page.save_page``)."""
    from memplan.reports.page import save_page
    from trainer.rundir import REPORT_FILE  # torch-free

    run_dir = Path(run_dir)
    page = build_run_page(run_dir)
    return save_page(page, run_dir / REPORT_FILE, flag) if flag else write_page(page, run_dir / REPORT_FILE)


def main(argv: list[str] | None = None) -> int:
    """``python -m memplan.reports.run RUN [--background]``: write RUN/report.html. Exit 0 when written,
    3 when the disk was full (``trainer.reporting.NO_SPACE_EXIT``), 1 on any other failure, with its one
    line on stderr. ``--background``: at a lower priority than the training beside it (nice 10)."""
    import argparse
    import os
    import sys

    from memplan.fsutil import no_space

    ap = argparse.ArgumentParser(prog="python -m memplan.reports.run", description="write RUN/report.html")
    ap.add_argument("run_dir")
    ap.add_argument("--background", action="store_true")
    args = ap.parse_args(argv)
    if args.background and hasattr(os, "nice"):
        os.nice(10)
    try:
        write_run_report(args.run_dir)
    except OSError as e:
        print(f"{type(e).__name__}: {e}"[:300], file=sys.stderr)
        return 3 if no_space(e) is not None else 1
    except Exception as e:  # a report must never cost the run: the trainer logs this line
        print(f"{type(e).__name__}: {e}"[:300], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
