"""The sweep report (``memplan sweep --html``): one figure per function over ``memplan.sweep.sweep``'s grid.

Four kinds of figure: peak memory against context for each setup with the device's usable memory drawn
across and the out-of-memory region shaded (``memory_figure``); that memory by term as stacked bars
(``breakdown_figure``); tokens/s against memory with the Pareto front (``speed_figure``); and, with
``--tokens``, the time of one epoch against context (``epoch_figure``). The labels are shared with the
terminal tables (``memplan/cli/sweep.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.units import GiB, format_bytes, format_count, format_seconds

TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries", "runtime")
TERM_COLORS = {  # one colour per memory term, the same in every figure
    "weights": "#3b6fb6", "gradients": "#7aa6dc", "optimizer": "#8e6bbf", "activations": "#e08a2c",
    "logits": "#d4b93c", "temporaries": "#9aa5b1", "runtime": "#52606d",
}
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#393b79", "#637939", "#843c39", "#7b4173", "#3182bd", "#e6550d")
OOM_FILL = "rgba(214, 39, 40, 0.09)"
OOM_LINE = "#d62728"
CHECKPOINTING_WORDS = {"none": "no checkpointing", "selective": "selective checkpointing",
                       "full": "full checkpointing"}


# ---- labels --------------------------------------------------------------------------------

def format_ctx(ctx: int) -> str:
    """``2k`` for 2048 (contexts are written in binary k), ``1500`` otherwise."""
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def variant_words(attention: str, checkpointing: str, precision: str) -> str:
    return f"{attention} attention · {CHECKPOINTING_WORDS[checkpointing]} · {precision}"


def _varying(sw) -> list[str]:
    """The variant axes (attention, checkpointing, precision) that take more than one value."""
    return [a for a in ("attention", "checkpointing", "precision") if len(getattr(sw.axes, a)) > 1]


def variant_label(sw, setup) -> str:
    """A setup's variant named by the axes that vary only (``eager, full ckpt``)."""
    words = {"attention": setup.attention,
             "checkpointing": {"none": "no ckpt"}.get(setup.checkpointing, f"{setup.checkpointing} ckpt"),
             "precision": setup.precision}
    varying = _varying(sw)
    return ", ".join(words[a] for a in varying) if varying else variant_words(
        setup.attention, setup.checkpointing, setup.precision)


def setup_words(setup) -> str:
    return (f"ctx {format_ctx(setup.ctx)}, batch {setup.micro_batch}, "
            f"{variant_words(setup.attention, setup.checkpointing, setup.precision)}")


def fixed_words(sw) -> str:
    b = sw.base
    words = [f"grad accum {b.grad_accum}", b.optimizer]
    if b.world_size > 1:
        words.append(f"{b.world_size} × {b.sharding}")
    if b.compile:
        words.append("torch.compile")
    return ", ".join(words)


def gib_text(n_bytes: float) -> str:
    """GiB with three significant figures at most (``3.32``, ``27.3``, ``431``): table cells stay narrow."""
    gib = n_bytes / GiB
    return f"{gib:.0f}" if gib >= 100 else f"{gib:.1f}" if gib >= 10 else f"{gib:.2f}"


# ---- HTML ----------------------------------------------------------------------------------

def _gib(n: float) -> float:
    return n / GiB


def _memory_axis_top(sw) -> float:
    """The top of memory axes in GiB: the usable line always shows, with room above it for the
    out-of-memory region; values far above it are clipped (and labelled at the edge) rather than
    squashing the rest."""
    usable = _gib(sw.device.usable_bytes)
    largest = max(_gib(c.memory.peak_reserved) for c in sw.cells)
    return max(usable * 1.2, min(largest, usable * 3) * 1.06)


def _variant(est) -> tuple[str, str, str]:
    return est.setup.attention, est.setup.checkpointing, est.setup.precision


@dataclass(frozen=True)
class _Line:
    facet: int | None  # the micro-batch of its subplot, or None without subplots
    color: str
    label: str
    cells: tuple  # Estimates in x order


def _lines(sw) -> tuple[str, bool, list[_Line]]:
    """The lines of the per-setup figures: (x field, whether there is one subplot per micro-batch, lines).

    x is the context, unless only one context was swept: then the micro-batch. With several variants,
    each gets a colour and each micro-batch its own subplot; with one variant, each micro-batch a colour.
    """
    variants = sw.axes.variants
    x = "ctx" if len(sw.axes.ctx) > 1 or len(sw.axes.micro_batch) == 1 else "micro_batch"
    if x == "micro_batch":
        return x, False, [
            _Line(None, PALETTE[v % len(PALETTE)], variant_label(sw, cells[0].setup) if len(variants) > 1
                  else f"context {format_ctx(sw.axes.ctx[0])}", tuple(cells))
            for v, key in enumerate(variants) for cells in [[c for c in sw.cells if _variant(c) == key]]]
    facet = len(variants) > 1 and len(sw.axes.micro_batch) > 1
    lines = []
    for v, key in enumerate(variants):
        for b_index, b in enumerate(sw.axes.micro_batch):
            cells = tuple(c for c in sw.cells if _variant(c) == key and c.setup.micro_batch == b)
            if len(variants) > 1:
                label, color = variant_label(sw, cells[0].setup), PALETTE[v % len(PALETTE)]
            else:
                label, color = f"micro-batch {b}", PALETTE[b_index % len(PALETTE)]
            lines.append(_Line(b if facet else None, color, label, cells))
    return x, facet, lines


def _facets(sw, facet: bool):
    """A figure with one subplot per micro-batch (three to a row), or a single plot."""
    from plotly.subplots import make_subplots

    if not facet:
        return make_subplots(rows=1, cols=1), 1, lambda b: (1, 1)
    batches = list(sw.axes.micro_batch)
    cols = min(3, len(batches))
    nrows = -(-len(batches) // cols)
    fig = make_subplots(rows=nrows, cols=cols, shared_xaxes="all", shared_yaxes="all",
                        subplot_titles=[f"micro-batch {b}" for b in batches],
                        horizontal_spacing=0.04, vertical_spacing=0.16 if nrows > 1 else 0.1)
    return fig, nrows, lambda b: (batches.index(b) // cols + 1, batches.index(b) % cols + 1)


def _x_axis(fig, sw, x: str, nrows: int) -> None:
    """Context (or micro-batch) on a log axis ticked at the swept values, titled under the bottom row."""
    values = list(getattr(sw.axes, x))
    text = [format_ctx(v) for v in values] if x == "ctx" else [str(v) for v in values]
    # No explicit range: with one, plotly 7 stops autoranging the y axes of matched log x axes.
    fig.update_xaxes(type="log", tickvals=values, ticktext=text)
    fig.update_xaxes(title_text="context length (tokens)" if x == "ctx" else "micro-batch (sequences)", row=nrows)


def _cell_hover(sw, est) -> str:
    verdict = "fits" if est.fits else "does NOT fit"
    text = (f"{setup_words(est.setup)}<br>peak reserved {format_bytes(est.memory.peak_reserved)} ({verdict})<br>"
            f"{est.time.tokens_per_second:,.0f} tokens/s, step {format_seconds(est.time.step_seconds)}")
    if sw.tokens is not None:
        text += f"<br>epoch {format_seconds(est.time.epoch_seconds)}"
    return text


def _oom_label(sw) -> str:
    return f"usable {_gib(sw.device.usable_bytes):.1f} GiB on {sw.device.name}: above it, out of memory"


def memory_figure(sw):
    """Peak reserved memory against context, one line per setup, with the usable line and the OOM region."""
    import plotly.graph_objects as go
    from memplan.reports.page import style_figure

    x, facet, lines = _lines(sw)
    fig, nrows, where = _facets(sw, facet)
    top = _memory_axis_top(sw)
    usable = _gib(sw.device.usable_bytes)
    shown = set()
    for line in lines:
        row, col = where(line.facet)
        xs = [getattr(c.setup, x) for c in line.cells]
        fig.add_trace(go.Scatter(
            x=xs, y=[_gib(c.memory.peak_reserved) for c in line.cells],
            mode="lines+markers", name=line.label, legendgroup=line.label, showlegend=line.label not in shown,
            line=dict(color=line.color, width=2),
            marker=dict(color=line.color, size=[8 if c.fits else 11 for c in line.cells],
                        symbol=["circle" if c.fits else "x" for c in line.cells]),
            hovertext=[_cell_hover(sw, c) for c in line.cells], hoverinfo="text",
        ), row=row, col=col)
        shown.add(line.label)
        clipped = [(xv, c) for xv, c in zip(xs, line.cells) if _gib(c.memory.peak_reserved) > top]
        if clipped:  # off the top of the axis: a marker at the edge that says how far
            fig.add_trace(go.Scatter(
                x=[xv for xv, _ in clipped], y=[top] * len(clipped), mode="markers+text", showlegend=False,
                legendgroup=line.label, cliponaxis=False, marker=dict(color=line.color, symbol="triangle-up", size=10),
                text=[f"{_gib(c.memory.peak_reserved):.0f}" for _, c in clipped], textposition="middle right",
                textfont=dict(color=line.color, size=11),
                hovertext=[_cell_hover(sw, c) for _, c in clipped], hoverinfo="text",
            ), row=row, col=col)
    fig.add_hrect(y0=usable, y1=top, fillcolor=OOM_FILL, line_width=0, layer="below", row="all", col="all")
    fig.add_hline(y=usable, line=dict(color=OOM_LINE, width=2, dash="dash"), row="all", col="all")
    fig.add_annotation(xref="x domain", yref="y", x=0.01, y=usable, xanchor="left", yanchor="bottom",
                       showarrow=False, text=_oom_label(sw), font=dict(color=OOM_LINE, size=12),
                       bgcolor="rgba(255,255,255,0.7)")
    _x_axis(fig, sw, x, nrows)
    fig.update_yaxes(range=[0, top])
    fig.update_yaxes(title_text="peak reserved memory (GiB)", col=1)
    against = "context" if x == "ctx" else "micro-batch"
    title = f"Peak memory against {against}: ✗ does not fit, ▲ off the scale (GiB)"
    return style_figure(fig, title=title, height=300 + 270 * nrows if facet else 480)


def breakdown_figure(sw):
    """Stacked bars of the memory terms of each setup at one context (buttons pick the context)."""
    import plotly.graph_objects as go
    from memplan.reports.page import style_figure

    variants = sw.axes.variants
    many = len(variants) > 1
    top = _memory_axis_top(sw)
    fig = go.Figure()
    per_ctx = []  # trace indices per context
    ctxs = list(sw.axes.ctx)
    for ctx in ctxs:
        cells = [c for c in sw.cells if c.setup.ctx == ctx]
        if many:
            x = [[f"micro-batch {c.setup.micro_batch}" for c in cells],
                 [variant_label(sw, c.setup).replace(", ", "<br>") for c in cells]]
        else:
            x = [f"micro-batch {c.setup.micro_batch}" for c in cells]
        first = len(fig.data)
        for term in TERMS:
            fig.add_trace(go.Bar(
                x=x, y=[_gib(getattr(c.memory, term)) for c in cells], name=term, legendgroup=term,
                marker_color=TERM_COLORS[term], showlegend=True,  # one context shows at a time: its entries
                hovertemplate=f"{term}: %{{y:.2f}} GiB<extra></extra>",
            ))
        totals = [_gib(c.memory.peak_reserved) for c in cells]
        fig.add_trace(go.Scatter(
            x=x, y=[min(t, top) for t in totals], mode="markers+text", name="does not fit",
            showlegend=False, cliponaxis=False,
            text=["" if c.fits else (f"✗ {t:.0f}▲" if t > top else "✗") for c, t in zip(cells, totals)],
            textposition="top center", textfont=dict(color=OOM_LINE, size=13),
            marker=dict(size=1, color="rgba(0,0,0,0)"),
            hovertext=[_cell_hover(sw, c) for c in cells], hoverinfo="text",
        ))
        per_ctx.append(range(first, len(fig.data)))
    start = _default_ctx_index(sw)
    for i, trace in enumerate(fig.data):
        trace.visible = i in per_ctx[start]
    usable = _gib(sw.device.usable_bytes)
    fig.add_hrect(y0=usable, y1=top, fillcolor=OOM_FILL, line_width=0, layer="below")
    fig.add_hline(y=usable, line=dict(color=OOM_LINE, width=2, dash="dash"))
    fig.add_annotation(xref="paper", yref="y", x=0.005, y=usable, xanchor="left", yanchor="bottom", showarrow=False,
                       text=_oom_label(sw), font=dict(color=OOM_LINE, size=12), bgcolor="rgba(255,255,255,0.7)")
    fig.update_layout(barmode="stack", bargap=0.25)
    fig.update_xaxes(tickangle=0)
    fig.update_yaxes(title_text="memory at the peak (GiB)", range=[0, top])
    if len(ctxs) > 1:
        buttons = [dict(method="update", label=f"context {format_ctx(ctx)}",
                        args=[{"visible": [i in per_ctx[k] for i in range(len(fig.data))]},
                              {"title.text": _breakdown_title(ctx)}])
                   for k, ctx in enumerate(ctxs)]
        fig.update_layout(updatemenus=[dict(type="buttons", direction="right", active=start, buttons=buttons,
                                            x=0, xanchor="left", y=1.02, yanchor="bottom", showactive=True,
                                            pad=dict(t=0, b=0, l=0, r=0), font=dict(size=12))])
    fig = style_figure(fig, title=_breakdown_title(ctxs[start]), height=520)
    fig.update_layout(showlegend=True)
    if len(ctxs) > 1:
        fig.update_layout(margin=dict(t=110))
    return fig


def _breakdown_title(ctx: int) -> str:
    return f"Memory at the peak by term, context {format_ctx(ctx)} (GiB)"


def _default_ctx_index(sw) -> int:
    """The breakdown opens at the longest context where something fits (else the shortest)."""
    fitting = [k for k, ctx in enumerate(sw.axes.ctx) if any(c.fits for c in sw.cells if c.setup.ctx == ctx)]
    return fitting[-1] if fitting else 0


PARETO_LABEL_ROOM = 0.08  # a front label goes right of its point within this share of the memory axis from 0


def speed_figure(sw):
    """Tokens/s against peak memory for every cell, with the Pareto front of the setups that fit."""
    import plotly.graph_objects as go
    from memplan.reports.page import style_figure

    fig = go.Figure()
    variants = sw.axes.variants
    top = _memory_axis_top(sw)
    for v, key in enumerate(variants):
        cells = [c for c in sw.cells if _variant(c) == key]
        color = PALETTE[v % len(PALETTE)]
        fig.add_trace(go.Scatter(
            x=[min(_gib(c.memory.peak_reserved), top) for c in cells], y=[c.time.tokens_per_second for c in cells],
            mode="markers", name=variant_label(sw, cells[0].setup) if len(variants) > 1 else "setups",
            cliponaxis=False,
            marker=dict(color=color, size=9, opacity=0.85,
                        symbol=["circle" if c.fits else ("x" if _gib(c.memory.peak_reserved) <= top else
                                                         "triangle-right") for c in cells]),
            hovertext=[_cell_hover(sw, c) for c in cells], hoverinfo="text",
        ))
    front = sorted(sw.pareto, key=lambda i: (sw.cells[i].memory.peak_reserved, i))
    if front:
        pts = [sw.cells[i] for i in front]
        fig.add_trace(go.Scatter(
            x=[_gib(c.memory.peak_reserved) for c in pts], y=[c.time.tokens_per_second for c in pts],
            mode="lines+markers+text" if len(pts) <= 12 else "lines+markers", name="Pareto front",
            line=dict(color="#111827", width=2, shape="hv"),
            marker=dict(size=15, symbol="circle-open", color="#111827", line=dict(width=2)),
            text=[f"{format_ctx(c.setup.ctx)}×{c.setup.micro_batch}" for c in pts], cliponaxis=False,
            # left of each point, except near the y axis, where a label would run into the tick labels
            textposition=["top right" if _gib(c.memory.peak_reserved) < PARETO_LABEL_ROOM * top else "top left"
                          for c in pts],
            hovertext=[_cell_hover(sw, c) for c in pts], hoverinfo="text",
        ))
    else:
        fig.add_annotation(xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font=dict(size=15),
                           text=f"No setup in this grid fits in {_gib(sw.device.usable_bytes):.1f} GiB")
    usable = _gib(sw.device.usable_bytes)
    fig.add_vrect(x0=usable, x1=top, fillcolor=OOM_FILL, line_width=0, layer="below")
    fig.add_vline(x=usable, line=dict(color=OOM_LINE, width=2, dash="dash"),
                  annotation_text=f"usable {usable:.1f} GiB", annotation_position="top right",
                  annotation_font_color=OOM_LINE)
    fig.update_xaxes(title_text="peak reserved memory (GiB)", range=[0, top])
    fig.update_yaxes(title_text="throughput (tokens/s)", rangemode="tozero")
    return style_figure(fig, title="Speed against memory: the Pareto front of what fits "
                                   "(labels: context × micro-batch; ▶ off the scale)", height=500)


def epoch_figure(sw):
    """Time of one epoch of ``--tokens`` against context, for the setups that fit."""
    import plotly.graph_objects as go
    from memplan.reports.page import style_figure

    seconds = sorted(c.time.epoch_seconds for c in sw.cells if c.fits)
    unit, scale = _time_unit(seconds[len(seconds) // 2] if seconds else 3600.0)
    x, facet, lines = _lines(sw)
    fig, nrows, where = _facets(sw, facet)
    shown = set()
    for line in lines:
        row, col = where(line.facet)
        fig.add_trace(go.Scatter(
            x=[getattr(c.setup, x) for c in line.cells],
            y=[c.time.epoch_seconds / scale if c.fits else None for c in line.cells],
            mode="lines+markers", name=line.label, legendgroup=line.label, showlegend=line.label not in shown,
            connectgaps=False, line=dict(color=line.color, width=2), marker=dict(color=line.color, size=8),
            hovertext=[_cell_hover(sw, c) for c in line.cells], hoverinfo="text",
        ), row=row, col=col)
        shown.add(line.label)
    if not seconds:
        fig.add_annotation(xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font=dict(size=15),
                           text="No setup in this grid fits, so none has an epoch time")
    _x_axis(fig, sw, x, nrows)
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(title_text=f"time per epoch ({unit})", col=1)
    return style_figure(fig, title=f"Time for one epoch of {format_count(sw.tokens)} tokens, setups that fit "
                                   f"({unit})", height=300 + 270 * nrows if facet else 480)


def _time_unit(typical_seconds: float) -> tuple[str, float]:
    for unit, scale in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if typical_seconds >= 2 * scale:
            return unit, scale
    return "seconds", 1.0


def sweep_page(sw):
    """The sweep as a report page (``memplan.reports.page.Page``)."""
    from memplan.reports.page import Page

    spec, dev, axes = sw.model, sw.device, sw.axes
    summary = {
        "model": f"{spec.name or 'custom'}: {spec.describe()} ({spec.params:,} parameters)",
        "device": f"{dev.name} ({dev.title}): {format_bytes(dev.memory_bytes)}, "
                  f"{format_bytes(dev.usable_bytes)} usable",
        "grid": (f"context {', '.join(format_ctx(c) for c in axes.ctx)} × micro-batch "
                 f"{', '.join(map(str, axes.micro_batch))} × attention {', '.join(axes.attention)} × checkpointing "
                 f"{', '.join(axes.checkpointing)} × precision {', '.join(axes.precision)}"),
        "every cell": fixed_words(sw),
        "fits": f"{len(sw.fitting)} of {axes.cells} settings",
    }
    best = sw.best
    if best is not None:
        est = sw.cells[best]
        summary["fastest that fits"] = (f"{setup_words(est.setup)}: {est.time.tokens_per_second:,.0f} tokens/s, "
                                        f"{format_bytes(est.memory.peak_reserved)}")
        if sw.tokens is not None:
            summary["fastest that fits"] += f", {format_count(sw.tokens)} tokens in {format_seconds(est.time.epoch_seconds)}"
    else:
        summary["fastest that fits"] = "nothing in this grid fits"
    figures = [memory_figure(sw), breakdown_figure(sw), speed_figure(sw)]
    if sw.tokens is not None:
        figures.append(epoch_figure(sw))
    notes = [
        "Memory is peak_reserved: what the device's own monitor (nvidia-smi, rocm-smi, the OS) would show at the "
        "peak of a steady-state training step, live tensors plus the allocator's reserve and the runtime context. "
        "A setup fits when it is at most the device's usable memory (the dashed line); the shaded region is out "
        "of memory. Values far above the line are clipped; hover over a point for its numbers.",
        "The Pareto front joins the setups that fit and that no other fitting setup beats on both memory and "
        "tokens/s: with a memory budget, the best choice is the front's last point left of it.",
        "Every number is memplan's analytic estimate (memplan estimate gives the same for one cell); "
        "memplan validate measures how close such estimates come to real PyTorch runs.",
    ]
    return Page(title="Memory sweep", model=f"{spec.name or 'custom'} ({format_count(spec.params)} parameters)",
                device=f"{dev.name} ({format_bytes(dev.usable_bytes)} usable)", summary=summary, figures=figures,
                notes=notes)
