"""The validation report (``memplan validate --html``): predicted against measured memory, one figure per
function, for training (``validation_page``) and for inference (``inference_page``)."""

from __future__ import annotations

from memplan.reports.page import GIB, style_figure


def scatter_figure(rows):
    """Predicted against measured peak allocated, per config, on log axes with y = x (the walk, and the trace)."""
    import plotly.graph_objects as go

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
    return scatter


def error_figure(rows):
    """The error of each config's prediction (the walk's, and the trace's where it ran), in percent."""
    import plotly.graph_objects as go

    names = [r.name for r in rows]
    traced = [r for r in rows if r.trace_allocated]
    errors = go.Figure(go.Bar(x=names, y=[100 * r.error for r in rows], name="analytic",
                              hovertemplate="%{x}<br>%{y:+.2f}%"))
    if traced:
        errors.add_trace(go.Bar(x=names, y=[100 * (r.trace_error or 0) for r in rows], name="trace"))
    errors.update_yaxes(title="error (%) = (predicted − measured) / measured")
    errors.update_xaxes(tickangle=-45)
    style_figure(errors, "Error per config", height=520)
    return errors


def term_figure(rows):
    """The error of each memory term (weights, gradients, optimizer, forward saved) per config."""
    import plotly.graph_objects as go

    names = [r.name for r in rows]
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
    return per_term


def reserve_figure(rows):
    """On a GPU (CUDA, ROCm, MPS): the reserve's error against torch's allocator and against the driver; None on
    a CPU, which has no reserve to compare."""
    import plotly.graph_objects as go

    gpu = [r for r in rows if r.reserved_error is not None]
    if gpu:
        reserve = go.Figure(go.Bar(x=[r.name for r in gpu], y=[100 * r.reserved_error for r in gpu],
                                   name="reserve vs max_memory_reserved", hovertemplate="%{x}<br>%{y:+.2f}%"))
        if any(r.driver_error is not None for r in gpu):
            reserve.add_trace(go.Bar(x=[r.name for r in gpu], y=[100 * (r.driver_error or 0) for r in gpu],
                                     name="peak_reserved vs the driver's peak", hovertemplate="%{x}<br>%{y:+.2f}%"))
        reserve.update_yaxes(title="error (%) = (predicted − measured) / measured")
        reserve.update_xaxes(tickangle=-45)
        style_figure(reserve, "Reserve per config: torch's allocator and the driver (NVML / ROCm SMI)", height=520)
        return reserve
    return None


def validation_page(device_name: str, rows, summary, ranks: int = 1):
    """The HTML report: predicted against measured with y = x, error per config, error per memory term (and the
    reserve, on a GPU)."""
    from memplan.reports.page import Page

    figures = [scatter_figure(rows), error_figure(rows), term_figure(rows)]
    reserve = reserve_figure(rows)
    if reserve is not None:
        figures.append(reserve)
    bars = "; ".join(f"{what} {value:.2%} (bar {bar:.0%}: {'met' if met else 'MISSED'})"
                     for what, value, bar, met in summary.bars())
    return Page(title="Memory validation", model=f"{len(rows)} configs", device=device_name,
                summary={"median |error|": f"{summary.median_abs_error:.2%}",
                         "worst |error|": f"{summary.max_abs_error:.2%} ({summary.worst})",
                         "bars": bars},
                figures=figures,
                notes=[f"Measured: a real steady-state DDP or FSDP2 training step (after two warm-up steps) of "
                       f"memplan's reference model in each of {ranks} gloo processes on this machine's CPU; every "
                       "rank's MemTracker peak is checked against the prediction for that rank (one row per rank)."
                       if ranks > 1 else
                       "Measured: a real steady-state training step (the second of two, so optimizer state "
                       "exists) of memplan's reference model on this device. On the CPU, MemTracker counts the "
                       "live tensor bytes; on CUDA/ROCm it is torch.cuda.max_memory_allocated, and the reserve is "
                       "max_memory_reserved (against peak_reserved less the runtime context) and the driver's "
                       "figure at the peak (NVML / ROCm SMI, against peak_reserved)."])


def decode_step_words(rows) -> str:
    """What the decode-step columns are, and what they leave out, in words."""
    threads = sorted({r.threads for r in rows if r.threads})
    ratios = [r.step_ratio for r in rows if r.step_ratio]
    span = f"measured ÷ predicted {min(ratios):.2f}-{max(ratios):.2f}. " if ratios else ""
    return ("decode step: the median wall time of up to 16 single-token steps "
            f"({'/'.join(map(str, threads)) or '?'} torch thread(s)); predicted = roofline (every weight and the "
            "cache read once at the device's bandwidth) + the host's dispatch (aten ops per step × the per-op "
            f"launch cost without autograd). {span}Not covered: other processes' load on the cores, the sampling "
            "step, and the first steps' warm-up; a memory check, not a speed bar.")


def inference_page(device_name: str, rows):
    """The HTML report of ``validate --mode inference``: predicted against measured, per phase."""
    import plotly.graph_objects as go

    from memplan.reports.page import Page, style_figure
    from memplan.validate import inference_bars

    names = [r.name for r in rows]
    peaks = go.Figure()
    for phase in ("prefill", "decode"):
        peaks.add_trace(go.Bar(x=names, y=[getattr(r, f"measured_{phase}") / 2**20 for r in rows],
                               name=f"{phase} measured"))
        peaks.add_trace(go.Bar(x=names, y=[getattr(r, f"predicted_{phase}") / 2**20 for r in rows],
                               name=f"{phase} predicted"))
    peaks.update_layout(barmode="group")
    peaks.update_yaxes(title="peak live tensors (MiB)")
    peaks.update_xaxes(tickangle=-45)
    style_figure(peaks, "Prefill and decode peaks: predicted and measured", height=520)
    errors = go.Figure()
    for phase in ("prefill", "decode"):
        errors.add_trace(go.Bar(x=names, y=[100 * getattr(r, f"{phase}_error") for r in rows], name=phase,
                                hovertemplate="%{x}<br>%{y:+.3f}%"))
    errors.update_yaxes(title="error (%) = (predicted − measured) / measured")
    errors.update_xaxes(tickangle=-45)
    style_figure(errors, "Error per config and phase", height=520)
    bars = "; ".join(f"{what} {value:.2%} (bar {bar:.0%}: {'met' if met else 'MISSED'})"
                     for what, value, bar, met in inference_bars(rows))
    return Page(title="Inference memory validation", model=f"{len(rows)} configs", device=device_name,
                summary={"bars": bars}, figures=[peaks, errors],
                notes=["Measured: trainer/generate.py's cached forward and token choice on real tensors, "
                       "MemTracker's live tensor bytes: the prompt's forward (prefill) and the last decode step "
                       "with the cache full (decode).",
                       *([decode_step_words(rows)] if any(r.decode_step_seconds for r in rows) else [])])


