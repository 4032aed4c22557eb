"""``memplan validate``: every prediction of a matrix checked against a real measured training step here."""

from __future__ import annotations

import os
import statistics
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.memory.stacks import DEFAULT, shown, stack_class
from memplan.reports.validate import decode_step_words, inference_page, validation_page
from memplan.cli.options import DeviceFlags, JsonOpt, ThreadsOpt, print_json, threads_from, use_threads, with_groups

MatrixOpt = Annotated[Optional[str], typer.Option(
    "--matrix", metavar="NAME|FILE", help="A bundled matrix name or a matrix TOML file (default: default; with --world-size > 1: "
                     "distributed).", show_default=False)]
RanksOpt = Annotated[str, typer.Option(
    "--world-size", metavar="N", help="Measure each config's DDP/FSDP step in this many gloo processes here, every rank "
                         "against its own prediction (1: single-process steps).")]
QuickOpt = Annotated[bool, typer.Option("--quick", help="Only the matrix's representative subset (quick = true).")]
HtmlOpt = Annotated[Optional[str], typer.Option("--html", metavar="FILE", help="Write a self-contained HTML report to this file.",
                                                show_default=False)]
NoTraceOpt = Annotated[bool, typer.Option("--no-trace", help="Skip the FakeTensor trace of each config.")]
StacksOpt = Annotated[str, typer.Option(
    "--stack", metavar="STACK", help="Whose training code to measure, comma-separated for side by side: memplan (its own "
                    "trainer) | transformers (Hugging Face, peft for LoRA; `pip install 'memplan\\[stacks]'`) | "
                    "litgpt ('memplan\\[litgpt]') | torchtune ('memplan\\[torchtune]'), the last two each in its own "
                    "environment. Other stacks run in one process, on this machine's device.")]
ModeOpt = Annotated[str, typer.Option(
    "--mode", metavar="MODE", help="training: a real training step per config (the default). inference: real generation per "
                   "config, its prefill and decode peaks against `estimate --mode inference` (matrices in "
                   "memplan/matrices/inference/).")]


@app.command("validate")
@with_groups
def validate_command(
    matrix: MatrixOpt = None, quick: QuickOpt = False, json: JsonOpt = False, html: HtmlOpt = None,
    no_trace: NoTraceOpt = False, device: DeviceFlags = None,
    world_size: RanksOpt = "1", mode: ModeOpt = "training", threads: ThreadsOpt = None, stack: StacksOpt = "memplan",
) -> None:
    """Predict, trace and really measure each config of a matrix on this device; print the errors and the bars.

    With --world-size N (N > 1) every config runs as DDP or FSDP2 in N gloo processes on this
    machine's CPU; each rank measures its own peak with MemTracker and is checked against the
    prediction for that rank (no FakeTensor trace: the fake process group allocates as NCCL does,
    gloo's reduce-scatter does not)."""
    import sys

    from memplan.errors import InputError
    from memplan.units import choice_error

    if mode not in ("training", "inference"):
        raise choice_error("--mode", mode, ["training", "inference"])
    threads_from(threads)  # a bad value is refused before torch starts
    from trainer.validate import parse_stacks

    stacks = parse_stacks(stack)
    if any(stack_class(s).library for s in stacks) and (mode != "training" or world_size != "1"):
        raise InputError(f"--stack {stack}: other stacks are measured in one process, training "
                         "(accepted with them: --mode training --world-size 1)")
    if mode == "inference":
        use_threads(threads)
        if world_size != "1":
            raise InputError("--mode inference measures one process; accepted with it: --world-size 1")
        return validate_inference(matrix or "default", quick, json, html, device.device, device.device_memory)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from memplan.units import parse_count
    from memplan.validate import summarize, validation_json
    from trainer.validate import measure_validation, plan_validation

    ranks = parse_count(world_size, "--world-size")
    if ranks < 1:
        raise InputError(f"--world-size: {world_size!r} must be a positive integer")
    run = plan_validation(matrix, quick, ranks, stacks)
    if html:  # refused now, not after minutes of measuring
        from memplan.reports.page import check_report_path

        check_report_path(html, "--html", "validate.html")
    dev = device.profile()
    use_threads(threads)

    console = Console(stderr=json)
    if not console.is_terminal and not os.environ.get("COLUMNS"):  # COLUMNS set: that width
        console = Console(stderr=json, width=140)  # a log or a pipe: keep each row on one line
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        if ranks > 1:
            task = progress.add_task(f"measuring {len(run.configs)} configs in {ranks} gloo processes",
                                     total=len(run.configs))
        else:
            task = progress.add_task("validating", total=len(run.jobs))

        def started(config, which):
            progress.update(task, description=f"validating {config.name}"
                                              + (f" ({which})" if shown(which) else ""))

        rows = measure_validation(run, dev, trace=not no_trace, started=started,
                                  done=lambda n: progress.update(task, completed=n))
    summary = summarize(rows)
    if html:
        from memplan.reports.page import save_page

        save_page(validation_page(dev.name, rows, summary, ranks), html, "--html")
    if json:
        print_json(validation_json(dev.name, rows))
        return
    print_validation(console, run, rows, f"{dev.name}, each rank of {ranks} gloo processes" if ranks > 1 else dev.name)
    if html:
        console.print(f"report: {html}")
    sys.stdout.flush()


def print_validation(console, run, rows, where: str) -> None:
    """The tables of a validation run, what was not run and why, and each stack's errors against its bars."""
    from rich.markup import escape

    from memplan.validate import summarize

    print_validation_table(console, rows, where)
    print_reserve_table(console, rows, where)
    if run.skipped:
        console.print(f"not run: {len(run.skipped)} config(s) a stack cannot take ("
                      + "; ".join(sorted({f'{t}: {why}' for _, t, why in run.skipped})) + ")", soft_wrap=True)
    several = len(run.stacks) > 1
    if any(stack_class(s).library for s in run.stacks):
        _print_stacks_side_by_side(console, rows)
    for which in dict.fromkeys(r.stack for r in rows):
        part = summarize([r for r in rows if r.stack == which] if several else rows)
        if several:
            from memplan.memory.stacks import STACKS as WALKED

            walk = "the walk with its hooks" if which in WALKED else "memplan's own model's walk"
            console.print(f"[bold]{which}[/] ({walk} against the measured {which} step):")
        console.print(f"median |error| [bold]{part.median_abs_error:.2%}[/], worst [bold]{part.max_abs_error:.2%}[/] "
                      f"({escape(part.worst)})")
        for what, value, bar, met in part.bars():
            mark = "[green]met[/]" if met else "[red]MISSED[/]"
            console.print(f"  {what}: {value:.2%} (bar ≤ {bar:.0%}) {mark}")


def print_reserve_table(console, rows, where: str) -> None:
    """On a GPU: the reserve of each config, predicted against measured two ways. torch's allocator
    (``max_memory_reserved``) against the predicted reserve (peak_reserved less the runtime context),
    and the driver's figure at the peak (NVML, ROCm SMI: the reserve plus the context and whatever else
    the device holds) against the predicted peak_reserved. Nothing on a CPU, where there is no reserve."""
    gpu = [r for r in rows if r.reserved_error is not None]
    if not gpu:
        return
    from rich.table import Table

    from memplan.cli.fit import print_fitted
    from memplan.units import format_bytes

    def size(value):
        return format_bytes(value) if value is not None else "-"

    def error(value):
        return f"{value:+.2%}" if value is not None else "-"

    table = Table(title=f"Peak reserved: predicted vs measured on {where}", title_justify="left")
    for col, justify in (("config", "left"), ("reserve predicted", "right"), ("max_memory_reserved", "right"),
                         ("error", "right"), ("peak_reserved", "right"), ("driver peak", "right"), ("error", "right"),
                         ("context measured", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for r in gpu:
        context = r.driver_peak - r.measured_reserved if r.driver_peak is not None else None
        table.add_row(r.name, size(r.predicted_allocator_reserve), size(r.measured_reserved), error(r.reserved_error),
                      size(r.predicted_reserved), size(r.driver_peak), error(r.driver_error), size(context))
    print_fitted(console, table)
    sources = sorted({r.driver_source for r in gpu if r.driver_source})
    reserved = [abs(r.reserved_error) for r in gpu]
    driver = [abs(r.driver_error) for r in gpu if r.driver_error is not None]
    line = f"reserve: median |error| {statistics.median(reserved):.2%}, worst {max(reserved):.2%}"
    if driver:
        line += (f"; driver peak ({', '.join(sources)}): median |error| {statistics.median(driver):.2%}, "
                 f"worst {max(driver):.2%} (the runtime context predicted: {size(gpu[0].predicted_context)})")
    else:
        line += "; no driver figure (NVML / ROCm SMI did not answer, or Apple's Metal has none)"
    console.print(line, soft_wrap=True)


def _print_stacks_side_by_side(console, rows) -> None:
    """The measured peak of each config per stack, and each stack's against memplan's own, where both ran."""
    from rich.table import Table

    from memplan.units import format_bytes

    by_config: dict[str, dict[str, int]] = {}
    for r in rows:
        by_config.setdefault(r.name.removesuffix(f" ({r.stack})"), {})[r.stack] = r.measured_allocated
    stacks = list(dict.fromkeys(r.stack for r in rows))
    table = Table(title="Measured peak allocated per stack (the same config)", title_justify="left")
    table.add_column("config", no_wrap=True)
    for t in stacks:
        table.add_column(t, justify="right", no_wrap=True)
    for name, peaks in by_config.items():
        cells = []
        for t in stacks:
            if t not in peaks:
                cells.append("-")
            elif shown(t) and DEFAULT in peaks:
                cells.append(f"{format_bytes(peaks[t])} ({(peaks[DEFAULT] - peaks[t]) / peaks[t]:+.1%})")
            else:
                cells.append(format_bytes(peaks[t]))
        table.add_row(name, *cells)
    console.print(table)
    if DEFAULT in stacks:
        console.print("(in brackets: memplan's own peak against that stack's, (memplan − stack) / stack)")


def _validation_table(rows, where: str, moments: dict[str, str] | None = None):
    """Predicted against measured peak allocated per config; ``moments`` maps each peak moment to the short
    key the "peak at" column shows instead (with a legend under the table)."""
    from rich.table import Table

    from memplan.units import format_bytes

    table = Table(title=f"Peak allocated: predicted vs measured on {where}", title_justify="left")
    for col, justify in (("config", "left"), ("predicted", "right"), ("measured", "right"), ("error", "right"),
                         ("trace", "right"), ("peak at", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for r in rows:
        trace = f"{r.trace_error:+.2%}" if r.trace_error is not None else "-"
        table.add_row(r.name, format_bytes(r.predicted_allocated), format_bytes(r.measured_allocated),
                      f"{r.error:+.2%}", trace, moments[r.peak_moment] if moments else r.peak_moment)
    return table


def print_validation_table(console, rows, where: str) -> None:
    """The validation table, each config on one line: where the peak moments make it too wide for the
    terminal, "peak at" shows a letter per moment with the moments listed under the table."""
    from rich.table import Table

    from memplan.cli.fit import fits, print_fitted

    table = _validation_table(rows, where)
    if fits(console, table):
        console.print(table)
        return
    moments: dict[str, str] = {}
    for r in rows:
        if r.peak_moment not in moments:
            n = len(moments)
            moments[r.peak_moment] = chr(ord("a") + n) if n < 26 else str(n + 1)
    print_fitted(console, _validation_table(rows, where, moments))
    legend = Table.grid(padding=(0, 1))
    legend.add_column(no_wrap=True)
    legend.add_column()
    for moment, key in moments.items():
        legend.add_row(f"{key}:", moment or "-")
    console.print("peak at:")
    console.print(legend)


def print_inference_tables(console, rows, device_name: str) -> None:
    """The inference validation: one table where it fits the terminal, else the peaks and the decode step
    times in two, each config on one line."""
    from rich.table import Table

    from memplan.cli.fit import fits, print_fitted
    from memplan.units import format_bytes

    memory = ("prefill measured", "error", "decode measured", "error")
    timing = ("decode step", "predicted", "ratio", "roofline")

    def table_of(columns, title):
        table = Table(title=title, title_justify="left")
        table.add_column("config", no_wrap=True)
        for col in columns:
            table.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            cells = {"prefill measured": format_bytes(r.measured_prefill), "decode measured": format_bytes(r.measured_decode),
                     "decode step": f"{r.decode_step_seconds * 1e3:.1f} ms" if r.decode_step_seconds else "-",
                     "roofline": f"{r.roofline_step_seconds * 1e3:.2f} ms" if r.roofline_step_seconds else "-",
                     "predicted": f"{r.predicted_step_seconds * 1e3:.2f} ms" if r.predicted_step_seconds else "-",
                     "ratio": f"{r.step_ratio:.2f}" if r.step_ratio else "-"}
            errors = iter((f"{r.prefill_error:+.2%}", f"{r.decode_error:+.2%}"))
            table.add_row(r.name, *(next(errors) if col == "error" else cells[col] for col in columns))
        return table

    table = table_of(memory + timing, f"Generation peaks: predicted vs measured on {device_name}")
    if fits(console, table):
        console.print(table)
        return
    borderless = print_fitted(console, table_of(memory, f"Generation peaks: predicted vs measured on {device_name}"))
    print_fitted(console, table_of(timing, "Decode step: measured and predicted"), borderless)


def validate_inference(matrix: str, quick: bool, json: bool, html: str | None, device: str | None,
                       device_memory: str | None) -> None:
    """``validate --mode inference``: each config of an inference matrix generated for real here."""

    from rich.console import Console

    from memplan.cli.options import device_from
    from memplan.errors import InputError
    from memplan.validate import inference_bars, inference_validation_json, load_inference_matrix

    configs = load_inference_matrix(matrix)
    if quick:
        configs = [c for c in configs if c.quick]
        if not configs:
            raise InputError(f"--quick: matrix {matrix!r} has no config with quick = true")
    if html:  # refused now, not after generating every config
        from memplan.reports.page import check_report_path

        check_report_path(html, "--html", "validate.html")
    dev = device_from(device, device_memory)
    if dev.family != "cpu":
        raise InputError(f"--mode inference measures generation on the CPU (MemTracker); the device is {dev.name}; "
                         "accepted: --device cpu")

    from trainer.validate import run_inference_config

    console = Console(stderr=json)
    if not console.is_terminal and not os.environ.get("COLUMNS"):  # COLUMNS set: that width
        console = Console(stderr=json, width=140)
    rows = []
    with console.status("") as status:
        for config in configs:
            status.update(f"generating {config.name}")
            rows.append(run_inference_config(config, dev))
    if html:
        from memplan.reports.page import save_page

        save_page(inference_page(dev.name, rows), html, "--html")
    if json:
        print_json(inference_validation_json(dev.name, rows))
        return
    print_inference_tables(console, rows, dev.name)
    console.print(decode_step_words(rows), soft_wrap=False)
    for what, value, bar, met in inference_bars(rows):
        console.print(f"  {what}: {value:.2%} (bar ≤ {bar:.0%}) {'[green]met[/]' if met else '[red]MISSED[/]'}")
    if html:
        console.print(f"report: {html}")
