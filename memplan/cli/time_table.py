"""The step-time breakdown as a rich table (``memplan estimate``; reusable by any command that prints a
``memplan.timing.TimeBreakdown``)."""

from __future__ import annotations

from memplan.units import format_bytes, format_count

# What each term of memplan.timing.TERMS counts, for the table's last column.
TERM_HELP = {
    "forward": "linears, norms, rotary, MLP, adds, casts",
    "backward": "their gradients (2 matmuls per linear)",
    "recompute": "forward re-run by checkpointing",
    "attention": "SDPA or eager core, fwd + bwd",
    "loss": "fp32 log-softmax and its gradient",
    "optimizer": "clip, optimizer step, zero_grad",
    "data": "token ids to the device",
    "communication": "all-reduce (DDP) / gathers (FSDP)",
    "launch": "dispatching each aten op (host)",
    "contention": "other processes holding the core (calibrated share)",
}

# The JSON says "memory" for a term limited by memory traffic; a person reads "bandwidth".
BOUND_LABEL = {"compute": "compute", "memory": "bandwidth", "launch": "launch", "contention": "other processes",
               "none": ""}


def format_term_seconds(s: float) -> str:
    """``1.24 s``, ``12.3 ms``, ``85 µs``: three significant figures down to microseconds."""
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


# The narrow table's bound labels (with a legend under it): "bandwidth" is the widest word of the wide one.
SHORT_BOUND_LABEL = {"compute": "compute", "memory": "mem", "launch": "launch", "contention": "others", "none": ""}


def _bound_text(term, labels: dict) -> str:
    bound = labels.get(term.bound, term.bound)
    if term.compute_seconds > 0 and term.memory_seconds > 0:  # a mix: say how much of each
        other = labels["memory"] if term.compute_seconds >= term.memory_seconds else labels["compute"]
        bound += f" ({min(term.compute_seconds, term.memory_seconds) / term.seconds:.0%} {other})"
    return bound


def time_table(t, title: str = "Time per step", *, narrow: bool = False, caption: bool = True):
    """A rich Table of a TimeBreakdown: every term that takes time, its share of the step, what bounds it
    (compute, memory bandwidth or op dispatch) and the FLOPs and bytes it moves.

    ``narrow`` (for an 80-column terminal): no "what it counts" column and "mem" for memory bandwidth;
    print ``time_table_legend(t)`` under it. ``caption``: where the rates come from, under it (off where the
    caller prints that line itself)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=f"rates: {t.rate_source}" if caption and not narrow else None,
                  caption_justify="left")
    table.add_column("term", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    table.add_column("bound", no_wrap=True)
    table.add_column("FLOPs", justify="right", no_wrap=True)
    table.add_column("bytes moved", justify="right", no_wrap=True)
    if not narrow:
        table.add_column("what it counts", style="dim")
    labels = SHORT_BOUND_LABEL if narrow else BOUND_LABEL
    for name, term in t.terms.items():
        if term.seconds <= 0:
            continue
        table.add_row(name, format_term_seconds(term.seconds), f"{term.seconds / t.step_seconds:.0%}",
                      _bound_text(term, labels), format_count(term.flops) if term.flops else "",
                      format_bytes(term.bytes) if term.bytes else "", *([] if narrow else [TERM_HELP.get(name, "")]))
    table.add_section()
    table.add_row("[bold]step[/]", f"[bold]{format_term_seconds(t.step_seconds)}[/]", "100%", "",
                  format_count(t.flops_per_step), "",
                  *([] if narrow else [f"{t.dispatches:,} aten ops dispatched" if t.dispatches else ""]))
    return table


def time_table_legend(t, rates: bool = True):
    """What the narrow table leaves out, under it: each term's meaning, "mem", the op count and (``rates``)
    where the rates come from."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(style="dim")
    for name, term in t.terms.items():
        if term.seconds > 0:
            grid.add_row(name, TERM_HELP.get(name, ""))
    grid.add_row("mem", "memory bandwidth; (N% mem): the other bound's share of the time")
    if t.dispatches:
        grid.add_row("step", f"{t.dispatches:,} aten ops dispatched")
    if rates:
        grid.add_row("rates", t.rate_source)
    return grid


def print_time_table(console, t, title: str = "Time per step", caption: bool = True) -> None:
    """The time table at the console's width: wide with its "what it counts" column where that fits on one
    line per row, else narrow with the legend under it."""
    from memplan.cli.fit import fits

    table = time_table(t, title, caption=caption)
    if fits(console, table):
        console.print(table)
    else:
        console.print(time_table(t, title, narrow=True))
        console.print(time_table_legend(t, rates=caption))
