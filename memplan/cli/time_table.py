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


def time_table(t, title: str = "Time per step", caption: bool = True):
    """A rich Table of a TimeBreakdown: every term that takes time, its share of the step, what bounds it
    (compute, memory bandwidth or op dispatch) and the FLOPs and bytes it moves; ``caption``: where the
    rates come from, under it (off where the caller prints that line itself)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=f"rates: {t.rate_source}" if caption else None,
                  caption_justify="left")
    table.add_column("term")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    table.add_column("bound")
    table.add_column("FLOPs", justify="right")
    table.add_column("bytes moved", justify="right")
    table.add_column("what it counts", style="dim")
    for name, term in t.terms.items():
        if term.seconds <= 0:
            continue
        bound = BOUND_LABEL.get(term.bound, term.bound)
        if term.compute_seconds > 0 and term.memory_seconds > 0:  # a mix: say how much of each
            bound += f" ({min(term.compute_seconds, term.memory_seconds) / term.seconds:.0%} " \
                     f"{'bandwidth' if term.compute_seconds >= term.memory_seconds else 'compute'})"
        table.add_row(name, format_term_seconds(term.seconds), f"{term.seconds / t.step_seconds:.0%}", bound,
                      format_count(term.flops) if term.flops else "", format_bytes(term.bytes) if term.bytes else "",
                      TERM_HELP.get(name, ""))
    table.add_section()
    table.add_row("[bold]step[/]", f"[bold]{format_term_seconds(t.step_seconds)}[/]", "100%", "",
                  format_count(t.flops_per_step), "", f"{t.dispatches:,} aten ops dispatched" if t.dispatches else "")
    return table
