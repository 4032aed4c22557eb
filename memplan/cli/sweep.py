"""``memplan sweep``: the estimate over a grid of settings, as terminal tables, the grid's JSON and an HTML page.

The numbers come from ``memplan.sweep.sweep``; this module maps the flags and prints the tables; the page is
``memplan.reports.sweep.sweep_page``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.estimate import PlanStackOpt
from memplan.cli.options import with_rates  # noqa: I001
from memplan.cli.options import (CompileOpt, DeviceFlags, GradAccumOpt, JsonOpt, ModelFlags, OptimizerOpt,
                                 ShardingOpt, WorldSizeOpt, print_json, with_groups)
from memplan.reports.sweep import (CHECKPOINTING_WORDS, fixed_words, format_ctx, gib_text, setup_words,  # noqa: F401
                                   sweep_page, variant_label, variant_words)
from memplan.units import format_bytes, format_count, format_seconds, parse_count

_S = "Setup"
CtxListOpt = Annotated[str, typer.Option(
    "--ctx", metavar="N", help="Context lengths, comma-separated (1k,2k,4k,8k; k = 1024).", rich_help_panel=_S,
    show_default=False)]
BatchListOpt = Annotated[str, typer.Option(
    "--batch", metavar="N", help="Micro-batches, comma-separated (1,2,4,8).", rich_help_panel=_S)]
AttentionListOpt = Annotated[str, typer.Option(
    "--attention", metavar="ATTENTION", help="Attention kernels, comma-separated: eager, sdpa.", rich_help_panel=_S)]
CheckpointingListOpt = Annotated[str, typer.Option(
    "--checkpointing", metavar="CHECKPOINTING", help="Activation checkpointing, comma-separated: none, selective, full.", rich_help_panel=_S)]
PrecisionListOpt = Annotated[str, typer.Option(
    "--precision", metavar="PRECISION", help="Precisions, comma-separated: fp32, tf32, bf16-mixed, fp16-mixed, bf16.", rich_help_panel=_S)]
TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", metavar="N", help="Tokens in one epoch (e.g. 2b): adds the time per epoch.", show_default=False)]
HtmlOpt = Annotated[Optional[Path], typer.Option(
    "--html", metavar="FILE", help="Write the HTML report here (self-contained; opens offline).", show_default=False,
    dir_okay=False)]


# ---- terminal ------------------------------------------------------------------------------

def print_sweep(sw, rates_note: str | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from memplan.cli.fit import fits, print_fields

    console = Console()
    spec, dev = sw.model, sw.device
    print_fields(console, [
        ("Model", f"{spec.name or 'custom'}: {spec.describe()}  ({spec.params:,} parameters)"),
        *([("", f"[dim]{escape(spec.size_note())}[/]")] if spec.size_note() else []),
        ("Device", f"{dev.name} ({dev.title}): {format_bytes(dev.memory_bytes)}, {format_bytes(dev.usable_bytes)} usable"),
        *([("Rates", f"[dim]{escape(rates_note.removeprefix('rates: '))}[/]")] if rates_note else []),
        ("Setup", f"{fixed_words(sw)}; {sw.axes.cells} settings, {len(sw.fitting)} fit"),
    ])
    per_row = len(sw.axes.micro_batch)  # cells are in rows of micro-batches, rows in order of context
    per_variant = len(sw.axes.ctx) * per_row

    def grid(v: int, columns: range, last: bool):
        """Variant v's table over the micro-batches at ``columns`` (the max-batch column with the last part)."""
        table = Table()
        table.add_column("ctx", justify="right", no_wrap=True)
        for j in columns:
            table.add_column(f"batch {sw.axes.micro_batch[j]}", justify="right", no_wrap=True)
        if last:
            table.add_column("max\nbatch", justify="right", no_wrap=True)
        for first in range(v * per_variant, (v + 1) * per_variant, per_row):
            texts = []
            for i in (first + j for j in columns):
                est = sw.cells[i]
                mem = gib_text(est.memory.peak_reserved)
                if not est.fits:
                    lines = [f"[red]✗ {mem}[/]"]
                else:
                    lines = [f"★ [bold]{mem}[/]" if i in sw.pareto else mem]
                lines.append(f"[dim]{format_count(est.time.tokens_per_second)}[/]")
                if sw.tokens is not None and est.fits:
                    lines.append(f"[dim]{format_seconds(est.time.epoch_seconds)}[/]")
                texts.append("\n".join(lines))
            row = sw.cells[first]
            table.add_row(format_ctx(row.setup.ctx), *texts, *([str(row.max_micro_batch)] if last else []))
        return table

    for v, (attention, checkpointing, precision) in enumerate(sw.axes.variants):
        # as many micro-batch columns per table as the terminal's width holds: a wide grid splits in parts
        for n in range(1, per_row + 1):  # the fewest parts that fit, of even sizes
            size = -(-per_row // n)
            parts = [range(a, min(a + size, per_row)) for a in range(0, per_row, size)]
            tables = [grid(v, cols, cols.stop == per_row) for cols in parts]
            if size == 1 or all(fits(console, t) for t in tables):
                break
        console.print(Text(variant_words(attention, checkpointing, precision), style="table.title"))
        for table in tables:
            console.print(table)
    console.print("Each cell: peak reserved memory in GiB, tokens/s (K = 10³)"
                  + (f", time for {format_count(sw.tokens)} tokens" if sw.tokens is not None else "")
                  + f". [red]✗[/] does not fit in {format_bytes(dev.usable_bytes)} usable on {dev.name}; "
                  "★ on the Pareto front (no setup that fits uses less memory and runs faster).")
    best = sw.best
    if best is None:
        from memplan.cli.estimate import print_levers

        lightest = min(sw.cells, key=lambda e: e.memory.peak_reserved)
        console.print(f"[red]Nothing in this grid fits[/]; its lightest cell is {setup_words(lightest.setup)}.")
        print_levers(console, lightest)
    else:
        est = sw.cells[best]
        line = (f"Fastest that fits: [bold]{setup_words(est.setup)}[/]: "
                f"{est.time.tokens_per_second:,.0f} tokens/s, {format_bytes(est.memory.peak_reserved)}")
        if sw.tokens is not None:
            line += f"; {format_count(sw.tokens)} tokens take {format_seconds(est.time.epoch_seconds)}"
        console.print(line)



# ---- the command ---------------------------------------------------------------------------

@app.command("sweep")
@with_groups
def sweep_command(
    model_flags: ModelFlags = None,
    ctx: CtxListOpt = ..., batch: BatchListOpt = "1", attention: AttentionListOpt = "sdpa",
    checkpointing: CheckpointingListOpt = "none", precision: PrecisionListOpt = "bf16-mixed",
    grad_accum: GradAccumOpt = "1", optimizer: OptimizerOpt = "adamw", world_size: WorldSizeOpt = "1",
    sharding: ShardingOpt = "none", compile: CompileOpt = False, device_flags: DeviceFlags = None,
    tokens: TokensOpt = None, html: HtmlOpt = None, json: JsonOpt = False, stack: PlanStackOpt = "memplan",
) -> None:
    """Estimate a grid of settings (lists of contexts, micro-batches, attention, checkpointing, precision):
    a table of peak memory and tokens/s, the grid's JSON, or an HTML page of plots."""
    from memplan.setup import ATTENTIONS, CHECKPOINTINGS, PRECISIONS
    from memplan.sweep import SweepAxes, parse_choices, parse_counts, sweep

    axes = SweepAxes(
        ctx=parse_counts(ctx, "--ctx", binary=True, example="1k,2k,4k"),
        micro_batch=parse_counts(batch, "--batch", example="1,2,4,8"),
        attention=parse_choices(attention, "--attention", ATTENTIONS),
        checkpointing=parse_choices(checkpointing, "--checkpointing", CHECKPOINTINGS),
        precision=parse_choices(precision, "--precision", PRECISIONS),
    )
    from memplan.cli.estimate import stack_for_search
    from memplan.memory.stacks import shown, stack_from_flags
    from memplan.setup import setup_from_flags

    walk = stack_for_search(stack, model_flags)
    spec = walk.spec
    base = setup_from_flags(axes.ctx[0], axes.micro_batch[0], grad_accum, axes.precision[0], axes.attention[0],
                            axes.checkpointing[0], optimizer, world_size, sharding, compile)
    for checkpointing in axes.checkpointing:  # every cell's setting, checked as estimate checks it
        stack_from_flags(stack, None, None, spec, base.replace(checkpointing=checkpointing))
    dev, rates_note = device_flags.local_profile()
    n_tokens = parse_count(tokens, "--tokens") if tokens else None
    if html is not None:  # before the sweep and before anything is printed
        from memplan.reports.page import check_report_path

        check_report_path(html, "--html", "sweep.html")
    sw = sweep(spec, base, dev, axes, n_tokens, stack=walk.stack)
    if json:
        data = sw.to_json()
        if shown(stack):  # memplan's own step: the JSON as it always was
            data["stack"] = stack
        print_json(with_rates(data, rates_note))
    else:
        print_sweep(sw, rates_note)
    if html is not None:
        from memplan.reports.page import save_page

        path = save_page(sweep_page(sw), html, "--html")  # a full disk: one line, exit 1, nothing left
        print(f"wrote {path}", file=sys.stderr if json else sys.stdout)
