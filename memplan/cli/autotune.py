"""``memplan autotune``: the fastest setup that fits, from the analytic model; ``--verify`` runs it for real."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.fit import fits, print_fields
from memplan.cli.options import (CtxOpt, DeviceFlags, JsonOpt, ModelFlags, ThreadsOpt, print_json, threads_from,
                                 with_groups, with_rates)
from memplan.cli.estimate import PlanStackOpt, stack_for_search
from memplan.errors import EXIT_NOTHING_FITS, InputError
from memplan.memory.stacks import shown
from memplan.units import (GiB, at_least, format_bytes, format_count, format_seconds, parse_count, parse_float,
                           parse_size, possessive)

_A = "Autotune"
GlobalBatchTokensOpt = Annotated[Optional[str], typer.Option(
    "--global-batch-tokens", metavar="N", help="Tokens per optimizer step over all processes (e.g. 524288 or 0.5m); kept exactly "
                                  "when it is a whole number of sequences. Default: by model size (131,072 below "
                                  "100M parameters, 524,288 below 1B, 1,048,576 from 1B).",
    rich_help_panel=_A, show_default=False)]
GlobalBatchOpt = Annotated[Optional[str], typer.Option(
    "--global-batch", metavar="N", help="Sequences per optimizer step over all processes (instead of --global-batch-tokens).",
    rich_help_panel=_A, show_default=False)]
BudgetOpt = Annotated[Optional[str], typer.Option(
    "--budget", metavar="SIZE", help="Memory budget, e.g. 3GiB or 24GB (default: the device's usable memory).", rich_help_panel=_A,
    show_default=False)]
MarginOpt = Annotated[str, typer.Option(
    "--margin", metavar="F", help="Share of the budget kept free: the predicted peak must fit budget × (1 − margin).",
    rich_help_panel=_A)]
TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", metavar="N", help="Tokens in one epoch (e.g. 2b): prints the time it takes.", rich_help_panel=_A,
    show_default=False)]
RunStepsOpt = Annotated[Optional[str], typer.Option(
    "--max-steps", metavar="N", help="The run's length in optimizer steps (instead of --tokens): torch.compile's "
                                     "one-off compile time is weighed against it.", rich_help_panel=_A,
    show_default=False)]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", help="Run a few real steps of the chosen plan on this machine, in the --stack's own code; step down "
                     "while the measured peak exceeds the budget or runs out of memory.", rich_help_panel=_A)]
VerifyStepsOpt = Annotated[int, typer.Option(
    "--verify-steps", metavar="N", help="Real steps per trial under --verify (the first is a warm-up); 2 or more.",
    rich_help_panel=_A, callback=at_least(2))]
OutOpt = Annotated[Optional[str], typer.Option(
    "--out", metavar="PATH", help="Write the chosen plan as TOML (what `memplan train --plan` takes).", rich_help_panel=_A,
    show_default=False)]
EmitOpt = Annotated[Optional[str], typer.Option(
    "--emit", metavar="DIR", help="Write the chosen plan as the --stack library's own config into this directory (made if absent): "
                   "training_args.json, lora_config.json (LoRA) and train.py for transformers, litgpt.yaml for "
                   "litgpt, torchtune.yaml for torchtune.", rich_help_panel=_A, show_default=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace files --emit would write that already exist.",
                                        rich_help_panel=_A)]
WorldSizeOpt = Annotated[str, typer.Option(
    "--world-size", metavar="N", help="Devices like --device sharing the global batch, one process each: DDP and FSDP are "
                         "both tried (--sharding: one); --verify runs the plan on that many ranks here.",
    rich_help_panel=_A)]
AutoShardingOpt = Annotated[Optional[str], typer.Option(
    "--sharding", metavar="SHARDING", help="With --world-size N: search this sharding only (ddp | fsdp, as the "
    "--stack's walk covers it); default: both.", rich_help_panel=_A, show_default=False)]
AutoCheckpointingOpt = Annotated[Optional[str], typer.Option(
    "--checkpointing", metavar="CHECKPOINTING", help="Search this checkpointing only (none | selective | full, as the "
    "--stack's code offers it); default: every one the stack has.", rich_help_panel=_A, show_default=False)]
AutoPrecisionOpt = Annotated[Optional[str], typer.Option(
    "--precision", metavar="PRECISION", help="Search this precision only (fp32 | tf32 | bf16-mixed | fp16-mixed | "
    "bf16, as the --stack's code trains it); default: the device's fast and full precisions.", rich_help_panel=_A,
    show_default=False)]
TopOpt = Annotated[int, typer.Option("--top", metavar="N", help="Rows of each table (fitting candidates, rejected ones); 1 or more.",
                                     rich_help_panel=_A, callback=at_least(1))]


def _parse_margin(text: str) -> float:
    return parse_float(text, "--margin", low=0, high=1, high_open=True, example="0.1 (a fraction of the budget)")


_OPT_SHORT = {"adamw-fused": "fused", "adamw": "foreach"}
_OPT_WORDS = {**_OPT_SHORT, "adamw8bit": "8-bit"}  # the Searched line's names


def _merged(candidates):
    """Candidates whose only difference is fused or foreach AdamW, with equal predictions, as one row."""
    rows, seen = [], {}
    for c in candidates:
        s = c.setup
        key = (s.replace(optimizer="adamw"), round(c.tokens_per_second, 6), c.peak_reserved, c.fits)
        if key in seen and s.optimizer in _OPT_SHORT:
            seen[key][1].append(_OPT_SHORT[s.optimizer])
            continue
        seen[key] = (c, [_OPT_SHORT.get(s.optimizer, s.optimizer)])
        rows.append(seen[key])
    return rows


def _table(title: str, columns: list[tuple[str, str]]):
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 0, 0, 1), collapse_padding=True)
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    return table


def _cells(c, opts: list[str]) -> list[str]:
    s = c.setup
    return [f"{s.micro_batch}×{s.grad_accum}", s.checkpointing + (f" {s.sharding}" if s.world_size > 1 else ""),
            s.attention, s.precision, ("either" if len(opts) > 1 else opts[0]) + (" +compile" if s.compile else "")]


def print_result(result, top: int, rates_note: str | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    spec, device = result.model, result.device
    exact = "" if result.exact_global_batch else f" [yellow](asked {result.requested_global_batch_tokens:,})[/]"
    print_fields(console, [
        ("Model", f"{escape(spec.name or 'custom')}: {escape(spec.describe())}  ({spec.params:,} parameters)"),
        *([("", f"[dim]{escape(spec.size_note())}[/]")] if spec.size_note() else []),
        ("Device", f"{escape(device.name)} ({escape(device.title)}): {format_bytes(device.usable_bytes)} usable"),
        *([("Stack", f"{result._evaluator.stack.name}: every candidate's memory walked as that library's step "
                      "runs it (memplan estimate --stack)")]
          if result._evaluator.stack.library else []),
        *([("Rates", f"[dim]{escape(rates_note.removeprefix('rates: '))}[/]")] if rates_note else []),
        ("Budget", f"{format_bytes(result.budget_bytes)}: the predicted peak must stay under "
                   f"{format_bytes(result.limit_bytes)} (margin {result.margin:.0%})"),
        ("Global batch", f"{result.global_batch_tokens:,} tokens = {result.global_batch_sequences} sequences of "
                         f"{result.ctx}" + (f" over {result.world_size} processes" if result.world_size > 1 else "")
                         + exact),
    ])
    space = result.space
    console.print(f"[dim]Searched micro-batches {_short(space['micro_batch'])} × checkpointing "
                  f"{'/'.join(space['checkpointing'])} × attention {'/'.join(space['attention'])} × precision "
                  f"{'/'.join(space['precision'])} × AdamW {'/'.join(_OPT_WORDS.get(o, o) for o in space['optimizer'])} × compile "
                  f"{'/'.join('yes' if c else 'no' for c in space['compile'])}: {result.evaluated} memory walks in "
                  f"{format_seconds(result.search_seconds)}[/]")

    fitting = _merged([c for c in result.candidates if c.fits])
    rejected = _merged([c for c in result.candidates if not c.fits])
    tables = _result_tables(result, fitting, rejected, top, compact=False)
    if not all(fits(console, t) for t in tables):  # a narrow terminal: the bytes as plain GiB numbers
        tables = _result_tables(result, fitting, rejected, top, compact=True)
    for table in tables:
        console.print(table)

    chosen = result.chosen
    if chosen is not None:
        s, p = chosen.setup, chosen.predicted
        console.print(f"[bold green]Plan[/]: micro-batch {s.micro_batch} × {s.grad_accum} accumulation, "
                      f"checkpointing {s.checkpointing}, {s.attention} attention, {s.precision}, {s.optimizer}"
                      + (", torch.compile" if s.compile else "")
                      + (f", {s.sharding.upper()} over {s.world_size} devices" if s.world_size > 1 else ""))
        line = (f"  predicted peak {format_bytes(p['peak_reserved'])} of {format_bytes(result.limit_bytes)}, "
                f"{p['tokens_per_second']:,.0f} tokens/s, {format_seconds(p['step_seconds'])} per step")
        if p.get("epoch_seconds") is not None:
            line += (f"; {format_count(result.tokens)} tokens ({result.run_steps:,} steps) take "
                     f"[bold]{format_seconds(p['epoch_seconds'])}[/]")
        console.print(line)
        console.print(f"  [dim]{escape(chosen.why)}[/]")
    elif result.advice:
        console.print(f"[bold red]Nothing fits[/]: {escape(result.advice[0].removeprefix('nothing fits: '))}")
        console.print("What would:")
        for line in result.advice[1:]:
            console.print(f"  • {escape(line)}")
    for note in result.notes:
        console.print(f"[dim]note: {escape(note)}[/]")


def _result_tables(result, fitting, rejected, top: int, compact: bool) -> list:
    """The fitting and the rejected configurations' tables; ``compact`` (for a narrow terminal) prints the
    peak and the excess as numbers of GiB under a "GiB" header instead of with their unit in every cell, and
    two-line headers."""
    def size(n: float) -> str:
        return f"{n / GiB:.2f}" if compact else format_bytes(n)

    peak, over, versus = ("peak\nGiB", "over\nGiB", "vs\nplan") if compact else ("peak", "over", "vs plan")
    tables = []
    if fitting:
        table = _table("Fastest fitting micro-batch of each configuration",
                       [("", "right"), ("batch", "right"), ("ckpt", "left"), ("attn", "left"), ("precision", "left"),
                        ("adamw", "left"), (peak, "right"), ("tokens/s", "right"), (versus, "right")])
        best = fitting[0][0].tokens_per_second
        for i, (c, opts) in enumerate(fitting[:top]):
            table.add_row("[green]→[/]" if i == 0 else str(i + 1), *_cells(c, opts), size(c.peak_reserved),
                          f"{c.tokens_per_second:,.0f}",
                          "plan" if i == 0 else f"{c.tokens_per_second / best - 1:+.1%}")
        if len(fitting) > top:
            table.caption = f"{len(fitting) - top} more fit (--top N, or --json for all)"
        tables.append(table)
    if rejected:
        table = _table("Rejected: the next micro-batch up of each configuration does not fit",
                       [("batch", "right"), ("ckpt", "left"), ("attn", "left"), ("precision", "left"),
                        ("adamw", "left"), (peak, "right"), (over, "right"), ("tokens/s", "right")])
        for c, opts in rejected[:top]:
            table.add_row(*_cells(c, opts), size(c.peak_reserved),
                          f"[red]+{size(c.peak_reserved - result.limit_bytes)}[/]",
                          f"{c.tokens_per_second:,.0f}")
        if len(rejected) > top:
            table.caption = f"{len(rejected) - top} more (--top N, or --json for all)"
        tables.append(table)
    return tables


def _short(values: list[int]) -> str:
    return ", ".join(map(str, values)) if len(values) <= 8 else ", ".join(map(str, values[:4])) + f", … {values[-1]}"


def print_attempt(attempt) -> None:
    from rich.console import Console
    from rich.markup import escape

    t, p = attempt.trial, attempt.plan.predicted
    measured = format_bytes(t.peak_bytes) if t.peak_bytes is not None else "-"
    speed = f"{t.tokens_per_second:,.0f}" if t.tokens_per_second else "-"
    color = {"fits": "green", "over budget": "yellow"}.get(attempt.outcome, "red")
    Console().print(f"  trial: micro-batch {attempt.plan.setup.micro_batch} × {attempt.plan.setup.grad_accum}, "
                    f"checkpointing {attempt.plan.setup.checkpointing}, {attempt.plan.setup.attention}, "
                    f"{attempt.plan.setup.optimizer}: peak {measured} (predicted {format_bytes(p['peak_reserved'])}), "
                    f"{speed} tokens/s (predicted {attempt.predicted_trial_tokens_per_second:,.0f}), "
                    f"{t.steps_run} steps → [{color}]{attempt.outcome}[/]"
                    + (f" [dim]{escape(t.error)}[/]" if t.error else ""))
    s = attempt.plan.setup
    predicted_step = (s.micro_batch * s.ctx * t.micro_batches * s.world_size / attempt.predicted_trial_tokens_per_second
                      if attempt.predicted_trial_tokens_per_second else None)
    for r in t.ranks:  # a trial on several ranks: each against the walk's per-rank prediction
        timed = list(r.get("step_seconds") or ())[1:] or list(r.get("step_seconds") or ())  # after the warm-up
        median = f"median step {format_seconds(statistics.median(timed))}" if timed else "no step"
        Console().print(f"    rank {r['rank']}: peak {format_bytes(r['peak_bytes'])} (predicted "
                        f"{format_bytes(p['peak_reserved'])}), {median}"
                        + (f" (predicted {format_seconds(predicted_step)})" if predicted_step else ""))


def print_verification(v) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if v.plan is not None:
        s = v.plan.setup
        console.print(f"[bold green]Verified[/]: micro-batch {s.micro_batch} × {s.grad_accum}, checkpointing "
                      f"{s.checkpointing}, {s.attention}, {s.precision}, {s.optimizer}: measured peak "
                      f"{format_bytes(v.peak_measured)} ≤ budget {format_bytes(v.budget_bytes)}, "
                      f"{v.tokens_per_second:,.0f} tokens/s; {v.trials} trial steps over {len(v.attempts)} plan(s)")
    else:
        console.print(f"[bold red]Not verified[/]: {escape('; '.join(v.notes) or 'no plan was tried')} "
                      f"({v.trials} trial steps over {len(v.attempts)} plan(s), {v.skipped} skipped)")
    if v.method:
        console.print(f"[dim]measured: {escape(v.method)}[/]")


@app.command("autotune")
@with_groups
def autotune_command(
    model_flags: ModelFlags = None, device_flags: DeviceFlags = None,
    ctx: CtxOpt = "1024", global_batch_tokens: GlobalBatchTokensOpt = None, global_batch: GlobalBatchOpt = None,
    budget: BudgetOpt = None, margin: MarginOpt = "0.1", tokens: TokensOpt = None, max_steps: RunStepsOpt = None,
    world_size: WorldSizeOpt = "1", verify: VerifyOpt = False, verify_steps: VerifyStepsOpt = 3, out: OutOpt = None, top: TopOpt = 8,
    json: JsonOpt = False, threads: ThreadsOpt = None, stack: PlanStackOpt = "memplan", emit: EmitOpt = None,
    force: ForceOpt = False, checkpointing: AutoCheckpointingOpt = None, precision: AutoPrecisionOpt = None,
    sharding: AutoShardingOpt = None,
) -> None:
    """Pick micro-batch, accumulation, checkpointing, attention, precision and optimizer: the fastest predicted
    plan that fits the memory budget at the global batch asked; --verify runs it for real."""
    from memplan.autotune import autotune

    if global_batch_tokens is not None and global_batch is not None:
        raise InputError("give --global-batch-tokens N or --global-batch N (sequences), not both")
    n_threads = threads_from(threads)
    if out:  # refused before any work: a plan computed (or verified) for nothing is lost time
        _check_out(out)
    walk = stack_for_search(stack, model_flags)
    spec = walk.spec
    if walk.stack.library and verify:  # the trials run that library's code: installed, or one line naming its extra
        from trainer.stacks import require_installed

        require_installed(stack)
    emitted_sharding = None  # --emit: the one sharding the library's config can ask for (litgpt: its FSDP)
    if emit:  # the stack has a writer, DIR can be written, no file of it is replaced without --force
        from memplan.emit import check_emit, writer_for

        check_emit(emit, stack, lora=False, force=force)
        emitted_sharding = writer_for(stack).emitted_sharding(parse_count(world_size, "--world-size"))
        if sharding and emitted_sharding and sharding != emitted_sharding:
            raise InputError(f"--sharding {sharding} with --emit: {possessive(stack)} config runs --world-size "
                             f"{world_size} with its own {emitted_sharding.upper()} (accepted with --emit: "
                             f"--sharding {emitted_sharding})")
    dev, rates_note = device_flags.local_profile(n_threads)
    result = autotune(
        spec, dev, ctx=parse_count(ctx, "--ctx", binary=True),
        global_batch_tokens=parse_count(global_batch_tokens, "--global-batch-tokens") if global_batch_tokens else None,
        global_batch=parse_count(global_batch, "--global-batch") if global_batch else None,
        budget_bytes=parse_size(budget, "--budget") if budget else None, margin=_parse_margin(margin),
        tokens=parse_count(tokens, "--tokens") if tokens else None,
        steps=parse_count(max_steps, "--max-steps") if max_steps else None,
        world_size=parse_count(world_size, "--world-size"), stack=walk.stack, checkpointing=checkpointing,
        precision=precision, sharding=sharding or emitted_sharding)
    if not json:
        print_result(result, top, rates_note)
        _print_units(result, global_batch_tokens, tokens)

    verification = _verify_here(result, dev, n_threads, verify_steps, json) if verify else None
    final = verification.plan if verification is not None else result.plan
    if final is not None and shown(stack):
        final = dataclasses.replace(final, stack=stack)  # the plan records whose code it is for
    files = _render_emit(final, stack) if emit else None  # a setting the stack cannot express: nothing written
    if out:
        _write_out(out, final, result, verification, json)
    emitted = _write_emit(emit, final, stack, files, force, json) if emit else None
    if json:
        data = result.to_json(verification)
        if shown(stack):  # memplan's own step: the JSON as it always was
            data["stack"] = stack
        if emit:
            data["emitted"] = emitted
        print_json(with_rates(data, rates_note))
    if final is None:  # answered, but there is nothing to train: a script must not go on
        raise typer.Exit(EXIT_NOTHING_FITS)


PLAN_BYTES_AT_MOST = 16 << 10  # a plan's TOML: about 1 KiB (the model, the setup, the device, the predictions)


def _render_emit(final, stack: str) -> dict[str, str] | None:
    """--emit's files for the plan chosen (None when nothing fits), rendered before anything is written."""
    if final is None:
        return None
    from memplan.emit import render

    return render(final, stack)


def _write_emit(emit: str, final, stack: str, files, force: bool, json: bool) -> list[str]:
    """--emit: the stack's config written into ``emit``; nothing when nothing fits (said on stderr)."""
    if final is None:
        print(f"memplan: --emit skipped: nothing fits, so no {stack} config was written", file=sys.stderr)
        return []
    from memplan.emit import emit as write

    paths = [str(p) for p in write(final, stack, emit, force=force, files=files)]
    if not json:
        print(f"Wrote {', '.join(paths)} (the plan as {stack} takes it)")
    return paths


def _check_out(out: str) -> None:
    """--out refused in one line before any work: a directory, or a path that cannot be written."""
    from memplan.fsutil import check_room, check_target

    if Path(out).is_dir():
        raise InputError(f"--out: {out!r} is a directory; give a file name such as {Path(out) / 'plan.toml'}")
    check_target(out, "--out", "plan.toml")
    check_room(out, PLAN_BYTES_AT_MOST, "--out", "a plan")  # (before a --verify's minutes of measuring)


def _print_units(result, global_batch_tokens: str | None, tokens: str | None) -> None:
    """One dim note of how suffixed counts were read (256k tokens is 256,000, not 262,144)."""
    from rich.console import Console

    from memplan.units import resolved

    units = resolved([("--global-batch-tokens", global_batch_tokens, result.requested_global_batch_tokens),
                      ("--tokens", tokens, result.tokens)])
    if units:
        Console(highlight=False).print(f"[dim]note: {units}[/]")


def _verify_here(result, dev, n_threads: int | None, steps: int, json: bool):
    """--verify: the plan's trials run on this machine (None when nothing fits: there is nothing to run)."""
    if result.plan is None:
        print(f"memplan: --verify skipped: nothing fits, so there is no plan to run (exit {EXIT_NOTHING_FITS})",
              file=sys.stderr)
        return None
    from memplan.local import chosen_threads

    # the trials run with the threads the rates were measured with (else the count calibration chose)
    n = n_threads or int(dev.calibrated.get("threads", 0) or 0) or chosen_threads("cpu")
    if not json and result.world_size > 1:
        from trainer.verify_ranks import rank_threads

        per = rank_threads(n, result.world_size)
        print(f"Verifying on {result.world_size} ranks of this machine ({steps} steps per trial; on a CPU, "
              f"{per} thread{'s' if per != 1 else ''} each)...", flush=True)
    elif not json:
        print(f"Verifying on this machine ({steps} steps per trial"
              + (f", {n} thread{'s' if n != 1 else ''}" if n else "") + ")...", flush=True)
    started = time.perf_counter()
    if result.world_size > 1:  # each trial on that many ranks here
        from trainer.verify_ranks import verify_on_ranks as run
    else:
        from trainer.verify import verify_here as run
    verification = run(result, steps=steps, threads=n, on_attempt=None if json else print_attempt)
    if not json:
        print_verification(verification)
        print(f"verify took {format_seconds(time.perf_counter() - started)}")
    return verification


def _write_out(out: str, final, result, verification, json: bool) -> None:
    """--out: the plan chosen (and verified), or a file saying that nothing fits, never an older plan; a full disk
    is one line, exit 1, the earlier file intact."""
    from memplan.fsutil import full_disk_is_one_line

    if final is None:
        with full_disk_is_one_line(out, "--out", "the plan"):
            _save_no_plan(out, result, verification)
        print(f"memplan: no plan: wrote {out} saying that nothing fits (`memplan train --plan` refuses it)",
              file=sys.stderr)
        return
    with full_disk_is_one_line(out, "--out", "the plan"):
        final.save(out)
    if not json:
        print(f"Wrote {out}")


def _save_no_plan(out: str, result, verification) -> None:
    """--out when there is no plan: a file that says so (memplan.plan.save_no_plan), never the old one."""
    from memplan.autotune import device_ref
    from memplan.plan import save_no_plan

    if verification is not None:
        reason = "--verify: no plan's measured peak fit the budget" + (
            f" ({'; '.join(verification.notes)})" if verification.notes else "")
        advice = []
    else:
        reason = (result.advice[0] if result.advice else "nothing fits").removeprefix("nothing fits: ")
        advice = result.advice[1:]
    save_no_plan(out, model=result.model, device=device_ref(result.device), budget_bytes=result.budget_bytes,
                 reason=reason, advice=advice)
