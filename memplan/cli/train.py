"""``memplan train``: train on a plan (given, autotuned, or from explicit MODEL SETUP flags) and measure it.

``memplan train`` with no arguments is the quick start: it prepares the embedded corpus (once, into
the cache), picks a model that the local device can train well in a few minutes, autotunes its
setup, trains it with live progress, and ends with a sample and the run report.

The work is ``trainer.loop.Trainer``; this module resolves the options, prints the plan, renders
progress with rich, and prints the summary. torch is imported only inside the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.fit import print_hanging, print_labelled
from memplan.cli.options import (CheckFlags, DeviceFlags, Flags, LimitFlags, LogOpt, ModelFlags, PlanSetupFlags,
                                 SeedOpt, ThreadsOpt, TrainStackOpt, run_control_from, seed_from, threads_from,
                                 with_groups)
from memplan.errors import InputError
from memplan.run_control import LIMITS

_R = "Run"
PlanOpt = Annotated[Optional[str], typer.Option("--plan", metavar="FILE", help="A plan TOML (from `memplan autotune --out`) to "
                                                "train on, as given.", show_default=False, rich_help_panel=_R)]
DataOpt = Annotated[Optional[str], typer.Option(
    "--data", metavar="DIR", help="A prepared corpus (`memplan prepare --out DIR`). Default: the embedded corpus, prepared once "
                   "into the cache ($MEMPLAN_CACHE, else ~/.cache/memplan).", show_default=False, rich_help_panel=_R)]
OutOpt = Annotated[Optional[str], typer.Option(
    "--out", "-o", metavar="PATH", help="The run directory (metrics.jsonl, plan.toml, checkpoints/, report.html). Default: "
                        "runs/train-DATE-TIME.", show_default=False, rich_help_panel=_R)]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its newest checkpoint.",
                                         rich_help_panel=_R)]
ReportOpt = Annotated[bool, typer.Option("--report", help="Only (re)write RUN/report.html from RUN/metrics.jsonl "
                                         "(also while the run is going) and exit.", rich_help_panel=_R)]
FromOpt = Annotated[Optional[str], typer.Option(
    "--from", metavar="PATH", help="Continue pretraining a Hugging Face checkpoint: a directory with config.json (llama, mistral, "
                   "qwen2, gpt2, gpt_neox; qwen3, gemma, phi, stablelm in transformers' model class), model.safetensors or its shards and tokenizer.json, or a Hub id (the "
                   "local Hugging Face cache, else fetched). --data must be prepared with its tokenizer "
                   "(`memplan prepare --tokenizer SAME`); the learning rate defaults to 1e-4.", show_default=False,
    rich_help_panel=_R)]
NprocOpt = Annotated[Optional[str], typer.Option(
    "--nproc", metavar="N", help="Train in N processes (torchrun: one per GPU, else N CPU processes over gloo) with DDP or "
                    "FSDP2; each rank runs --batch × --grad-accum per step (the plan's, for --plan).",
    show_default=False, rich_help_panel="Setup")]
TrainShardingOpt = Annotated[Optional[str], typer.Option(
    "--sharding", metavar="SHARDING", help="With --nproc: ddp | fsdp (default: the plan's, else ddp).", show_default=False,
    rich_help_panel="Setup")]

_H = "Hyper-parameters"
LrOpt = Annotated[Optional[str], typer.Option("--lr", metavar="X", help="Peak learning rate (default 6e-4).", show_default=False,
                                              rich_help_panel=_H)]
WarmupOpt = Annotated[Optional[str], typer.Option("--warmup", metavar="N", help="Warmup steps (default: 5% of the steps, at "
                                                  "most 100).", show_default=False, rich_help_panel=_H)]
MinLrOpt = Annotated[Optional[str], typer.Option("--min-lr-ratio", metavar="F", help="Cosine decay ends at this share of the "
                                                 "peak (default 0.1).", show_default=False, rich_help_panel=_H)]
WeightDecayOpt = Annotated[Optional[str], typer.Option("--weight-decay", metavar="X", help="AdamW weight decay (default 0.1).",
                                                       show_default=False, rich_help_panel=_H)]
ClipOpt = Annotated[Optional[str], typer.Option("--clip", metavar="X", help="Gradient-norm clipping, 0 = off (default 1.0).",
                                                show_default=False, rich_help_panel=_H)]
_A = "Autotune (without --plan or --batch)"
GlobalBatchTokensOpt = Annotated[Optional[str], typer.Option(
    "--global-batch-tokens", metavar="N", help="Tokens per optimizer step for autotune to keep.", show_default=False,
    rich_help_panel=_A)]
BudgetOpt = Annotated[Optional[str], typer.Option("--budget", metavar="SIZE", help="Memory budget for autotune (e.g. 6GiB); "
                                                  "default: the device's usable memory.", show_default=False,
                                                  rich_help_panel=_A)]
MarginOpt = Annotated[str, typer.Option("--margin", metavar="F", help="Share of the budget autotune leaves free.",
                                        rich_help_panel=_A)]


@dataclasses.dataclass(frozen=True)
class HyperFlags(Flags):
    """train's hyper-parameters (None: the plan's [training], else TrainConfig's defaults)."""

    lr: LrOpt = None
    warmup: WarmupOpt = None
    min_lr_ratio: MinLrOpt = None
    weight_decay: WeightDecayOpt = None
    clip: ClipOpt = None

    def parsed(self, seed: str | None) -> dict:
        """As ``TrainConfig`` fields (with ``--seed``), each checked: one InputError line naming the option."""
        from memplan.units import parse_count

        return dict(lr=_number(self.lr, "--lr", positive=True),
                    warmup_steps=None if self.warmup is None else parse_count(self.warmup, "--warmup", minimum=0),
                    min_lr_ratio=_number(self.min_lr_ratio, "--min-lr-ratio"),
                    weight_decay=_number(self.weight_decay, "--weight-decay"), clip=_number(self.clip, "--clip"),
                    seed=seed_from(seed))


@dataclasses.dataclass(frozen=True)
class AutotuneFlags(Flags):
    """What train's autotune keeps (without --plan or a setup): the global batch, the budget and its margin."""

    global_batch_tokens: GlobalBatchTokensOpt = None
    budget: BudgetOpt = None
    margin: MarginOpt = "0.1"


@app.command("train")
@with_groups
def train_command(
    plan: PlanOpt = None, data: DataOpt = None, out: OutOpt = None, from_: FromOpt = None, limits: LimitFlags = None,
    seed: SeedOpt = None, resume: ResumeOpt = False, report: ReportOpt = False, model: ModelFlags = None,
    setup: PlanSetupFlags = None, device: DeviceFlags = None, hyper: HyperFlags = None, checks: CheckFlags = None,
    autotune: AutotuneFlags = None, nproc: NprocOpt = None, sharding: TrainShardingOpt = None,
    threads: ThreadsOpt = None, log: LogOpt = None, stack: TrainStackOpt = None,
) -> None:
    """Train a model on a plan and measure it against memplan's predictions; alone, a short run on the embedded corpus."""
    from rich.console import Console

    from memplan.units import parse_count

    console = Console(stderr=True, highlight=False)
    if report:
        return _report_only(out, console)
    n_threads = threads_from(threads)
    from trainer.loggers import check_loggers

    check_loggers(log, out)  # a bad --log is refused before anything runs (or is created)
    if sharding is not None and sharding not in ("ddp", "fsdp"):
        raise InputError(f"--sharding: {sharding!r} (accepted: ddp, fsdp; training in one process shards nothing)")
    n = parse_count(nproc, "--nproc") if nproc is not None else 1
    from trainer import distributed

    _, launched, _ = distributed.env_world()
    if n > 1 and launched > 1:
        raise InputError(f"--nproc {n}: this process is already one of {launched} started by torchrun; drop --nproc")
    if launched > 1:  # a rank reads its run from RUN/launch.json, never flags
        raise InputError(f"this process is one of {launched} started by torchrun: `memplan train --nproc N` starts "
                         "its ranks itself, each `python -m trainer RUN` reading the run it resolved")
    if n == 1 and sharding is not None:
        raise InputError(f"--sharding {sharding}: needs several processes; add --nproc N")
    from memplan.units import parse_size
    from trainer.train_run import TrainRequest, resolve_train

    request = TrainRequest(
        plan=plan, data=data, out=out, from_=from_, resume=resume, model=model.values(), setup=setup.asked(),
        control=run_control_from(limits, checks), hyper=hyper.parsed(seed), device=device.device,
        device_memory=device.device_memory, threads=n_threads, sharding=sharding,
        global_batch_tokens=(None if autotune.global_batch_tokens is None else
                             parse_count(autotune.global_batch_tokens, "--global-batch-tokens")),
        budget_bytes=parse_size(autotune.budget, "--budget") if autotune.budget else None,
        margin=_number(autotune.margin, "--margin"), nproc=n, stack=stack)
    if n > 1:
        return _launch(request, check_loggers(log), console)
    _train(console, resolve_train(request, RichUI(console)), log=log)


class RichUI:
    """``trainer.train_run.TrainUI`` rendered with rich on ``console``: lines, the calibration's progress bar,
    the embedded corpus's preparation bars."""

    def __init__(self, console):
        self.console = console

    def say(self, text: str, soft_wrap: bool = False) -> None:
        """A line; ``soft_wrap``: a long one carrying its label (the quick start's "Model for a 3-minute run: ..."),
        wrapped at the width under what follows the label."""
        if soft_wrap:
            print_labelled(self.console, text)
        else:
            self.console.print(text)

    @contextlib.contextmanager
    def calibrating(self, what: str):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn(f"[bold]{what}[/] {{task.description:<18}}"), BarColumn(),
                   TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            task = progress.add_task("starting", total=1.0)
            yield lambda stage, done: progress.update(task, description=stage, completed=done)

    @contextlib.contextmanager
    def preparing(self):
        from memplan.cli.prepare import _ProgressBars

        with _ProgressBars(self.console) as bars:
            yield bars.update




# =================================================================================================
# Resolving the plan
# =================================================================================================

def _number(text: str | None, what: str, positive: bool = False) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise InputError(f"{what}: {text!r} must be {'positive' if positive else 'a number ≥ 0'}")
    return value





# =================================================================================================
# Training, with progress
# =================================================================================================

def _train(console, run, log: list[str] | None = None) -> None:
    """Train the resolved run (``trainer.train_run.ResolvedTrain``): a new one, or one resumed."""
    from trainer.train_run import start_trainer

    run_trainer(console, start_trainer(run), run.run_dir, rates_note=run.rates_note, log=log)


def run_trainer(console, trainer, run_dir: Path, *, what: str = "training", rates_note: str | None = None,
                log: list[str] | None = None) -> None:
    """Print the plan, run ``trainer`` under the live progress view (and the ``--log`` loggers), then print the
    summary and a sample; exit 1 when the run stopped on an error, 128 + N when signal N ended it (train, finetune)."""
    code = trained(console, trainer, run_dir, what=what, rates_note=rates_note, log=log)
    if code:
        raise typer.Exit(code)


def trained(console, trainer, run_dir: Path, *, what: str = "training", rates_note: str | None = None,
            log: list[str] | None = None) -> int:
    """``run_trainer``'s work, its exit code returned (0, 1 when the run stopped on an error, 128 + N when signal
    N ended it): what a rank of ``memplan train --nproc`` runs (``python -m trainer RUN``)."""
    from rich.markup import escape

    from trainer import loggers, rundir
    from trainer.stopping import DiskFull, TrainingStopped
    from trainer.sample import final_sample

    attached = loggers.attach(trainer, loggers.check_loggers(log))
    _print_plan(trainer, console)
    if rates_note:
        print_labelled(console, rates_note, indent="  ")  # rates: ..., wrapped under its label
    view = _ProgressView(console, trainer)
    trainer.on_event(view.update)
    try:
        with view:
            try:
                summary = trainer.run()
            finally:
                loggers.close_all(attached)  # every line the run wrote has reached them
    except DiskFull as e:  # one line: the report could not be written either
        _error_line(console, f"memplan: {what} stopped: {e}")
        return 1
    except TrainingStopped as e:  # on stderr (finetune's console is stdout); text, not markup: torch's hold [brackets]
        _stderr(console).print(f"[red]memplan: {what} stopped[/]: {escape(str(e))}", soft_wrap=True)
        console.print(f"Report: {run_dir / rundir.REPORT_FILE}")
        return 1
    sample = final_sample(trainer)  # in every rank: an FSDP2 model's forward needs them all
    if trainer.is_main:
        _print_summary(trainer, summary, sample)
    if trainer.stop_signal is not None:  # the shell's convention for a process ended by a signal
        return 128 + trainer.stop_signal
    return 0


def _stderr(console):
    """``console`` when it prints to stderr (train's), else a console that does (finetune prints to stdout), as
    quiet as ``console`` (a rank other than 0)."""
    if console.stderr:
        return console
    from rich.console import Console

    return Console(stderr=True, highlight=False, quiet=console.quiet)


def _error_line(console, text: str) -> None:
    """``text`` as one line on stderr, never wrapped, markup not read."""
    _stderr(console).print(" ".join(text.split()), soft_wrap=True, markup=False, style="red")


def _print_plan(trainer, console) -> None:
    from memplan.units import format_bytes, format_count

    p, s = trainer.plan, trainer.plan.setup
    pred = trainer.predicted
    what = "Resuming" if trainer.step else "Training"
    print_hanging(console, f"[bold]{what}[/] ", f"{trainer.run_dir}: {p.model.describe()} ({p.model.params:,} parameters)")
    if p.model.size_note():  # the data's vocabulary changes the count a size name such as 22m gives
        print_hanging(console, "  ", f"[dim]{p.model.size_note()}[/]")
    ranks = f" × {s.world_size} ranks ({s.sharding.upper()})" if s.world_size > 1 else ""
    print_hanging(console, "  setup: ", f"ctx {s.ctx}, micro-batch {s.micro_batch} × {s.grad_accum} accumulation{ranks} "
                  f"({s.tokens_per_step:,} tokens/step), {s.precision}, {s.attention} attention, checkpointing "
                  f"{s.checkpointing}, {s.optimizer}" + (", compiled" if s.compile else ""))
    print_hanging(console, "  data: ", f"{trainer.data.path} ({format_count(trainer.data.train_tokens)} train tokens, "
                  f"sources {', '.join(trainer.data.source_names)}); device {trainer.device} "
                  f"({trainer.profile.name} profile)")
    print_hanging(console, "  predicted: ", f"peak {format_bytes(pred.peak_reserved)} "
                  f"({format_bytes(pred.peak_allocated)} live tensors), {pred.tokens_per_second:,.0f} tokens/s, "
                  f"{_step_clock(pred.step_seconds)} a step, MFU {pred.mfu:.1%}")
    print_hanging(console, "  ETA: ", predicted_eta_text(trainer))
    if trainer.base_hf:  # memplan train --from: where the weights came from
        b = trainer.base_hf
        print_hanging(console, "  weights: ", ("started from " if trainer.step else "from ")
                      + f"{b.get('path')} ({b.get('model_type')} checkpoint, sha256 "
                        f"{str(b.get('weights_sha256'))[:12]})")
    if trainer.step:
        console.print(f"  from step {trainer.step:,} ({format_count(trainer.tokens)} tokens seen)")
    limits = limits_text({k: getattr(trainer.config, k) for k in LIMITS})
    if trainer.replaced_limits is not None:
        limits += f"; given now, replacing the run's {limits_text(trainer.replaced_limits, clock=False)}"
    elif trainer.step:
        limits += "; the run's own"
    print_hanging(console, "  limits: ", limits)
    family = {"cuda": ("cuda", "rocm"), "mps": ("mps",), "cpu": ("cpu",)}.get(trainer.device.type, ())
    if trainer.profile.family not in family:
        console.print(f"[yellow]note[/]: training runs on {trainer.device} but the predictions are for the "
                      f"{trainer.profile.name} profile ({trainer.profile.family}); measured and predicted will differ")


def held_out_count(eval_tokens: int, val_tokens: int, eval_batches: int, run_dir) -> str:
    """How many tokens a held-out loss is over, and the command that gives the same figure: the trainer
    evaluates ``eval_batches`` batches a source (evenly spaced windows), a sample of a larger split, while
    ``memplan eval`` reads the whole split unless told ``--max-batches``."""
    same = f"`memplan eval --run {run_dir} --max-batches {eval_batches}` gives the same"
    if eval_tokens >= val_tokens * 0.9:  # every window (a window's last token and a partial window are left out)
        return f"over all {eval_tokens:,} tokens of the held-out split ({same})"
    return (f"over {eval_tokens:,} of the held-out split's {val_tokens:,} tokens ({same}; "
            "without --max-batches it reads them all)")


def predicted_eta_text(trainer) -> str:
    """What the run is predicted to take, before its first step (from the predicted step time): the steps its
    step or token limit leaves, else one epoch of the data; a time limit caps it. A step predicted to take
    longer than the time limit is said so."""
    import math as _math

    from memplan.units import format_count

    c, s = trainer.config, trainer.plan.setup
    step_seconds = trainer.predicted.step_seconds
    left = []
    if c.max_steps is not None:
        left.append((max(0, c.max_steps - trainer.step), f"--max-steps {c.max_steps:,}"))
    if c.max_tokens is not None:
        left.append((max(0, _math.ceil((c.max_tokens - trainer.tokens) / s.tokens_per_step)),
                     f"--max-tokens {format_count(c.max_tokens)}"))
    if not left and c.max_minutes is None:
        left.append((max(1, trainer.data.train_tokens // s.tokens_per_step), "one epoch"))
    limit = None if c.max_minutes is None else c.max_minutes * 60.0
    if left:
        steps, why = min(left)
        seconds = steps * step_seconds
        if limit is None or seconds <= limit:
            return f"{_clock(seconds)} for {steps:,} step{'s' if steps != 1 else ''} ({why}) at the predicted step time"
    if step_seconds > limit:
        return (f"{_clock(limit)} (--max-minutes {c.max_minutes:g}); one step is predicted to take "
                f"{_step_clock(step_seconds)}, longer than the time limit")
    return f"{_clock(limit)} (--max-minutes {c.max_minutes:g}): about {int(limit // step_seconds):,} steps at the " \
           "predicted step time"


def limits_text(limits: dict, clock: bool = True) -> str:
    """The stop limits, as the options that set them: ``--max-steps 200, --max-minutes 5 (from this command's
    start)`` (``clock``: saying where the time limit counts from)."""
    from memplan.units import format_count

    parts = []
    if limits.get("max_steps") is not None:
        parts.append(f"--max-steps {limits['max_steps']:,}")
    if limits.get("max_tokens") is not None:
        parts.append(f"--tokens {format_count(limits['max_tokens'])}")
    if limits.get("max_minutes") is not None:
        parts.append(f"--max-minutes {limits['max_minutes']:g}" + (" (from this command's start)" if clock else ""))
    return ", ".join(parts) if parts else "none: to the schedule's end (one epoch)"


def repeat_warning(line) -> str | None:
    """The one-line warning for a run planned to pass over its training tokens more than REPEAT_WARN_PASSES
    times (from its start line, a ``trainer.records.StartEvent``), else None."""
    from trainer.loop import REPEAT_WARN_PASSES

    passes, steps = line.data_passes, line.planned_steps
    if passes is None or steps is None or passes <= REPEAT_WARN_PASSES:
        return None
    config, schedule = line.config, line.schedule
    estimated = (config.get("max_steps") is None and config.get("max_tokens") is None
                 and schedule.get("kind") == "wsd" and schedule.get("decay_start") is None)
    return (f"warning: {'about ' if estimated else ''}{steps:,} steps of {line.tokens_per_step:,} tokens are "
            f"{passes:,.0f} passes over the {line.train_tokens:,} training tokens: the model will see each "
            f"token ~{passes:,.0f} times and learn them by heart; give more data or fewer steps (--max-steps, "
            "--tokens, --max-minutes)")


def _clock(seconds: float) -> str:
    """``1:05`` (minutes:seconds) or ``2:03:05`` (hours:minutes:seconds): elapsed and limit in the live line."""
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _step_clock(seconds: float) -> str:
    """A step's time, as the header and the live line give it, in one form whatever its length: ``210 ms`` and
    ``4.2 s`` under a minute, then the clock the ETA and the limit use, ``30:31`` (issue 28: the step time read
    "30.5 min" beside an ETA of "30:31", and the line during a step "predicted 0:00 a step" for 210 ms)."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return _clock(seconds)


def progress_count(step: int, total: int | None, total_fixed: bool, elapsed: float | None = None,
                   limit: float | None = None) -> str:
    """The live line's step count: ``step 210/264`` while the total is final and not passed; ``step 178`` when
    it is only an estimate (a time-limited run before its decay is fixed), never N/M with N > M; a
    time-limited run adds its clock, ``1:23/3:00`` (elapsed / limit)."""
    text = f"step {step:,}/{total:,}" if total and total_fixed and step <= total else f"step {step:,}"
    if limit is not None and elapsed is not None:
        text += f" {_clock(min(elapsed, limit))}/{_clock(limit)}"
    return text


def progress_fraction(step: int, total: int | None, total_fixed: bool, elapsed: float | None = None,
                      limit: float | None = None) -> float | None:
    """How far the run is, 0 to 1, for the bar: steps of a final total, or time of a time limit (the
    further of the two); None when neither is known."""
    parts = []
    if total and total_fixed:
        parts.append(step / total)
    if limit:
        parts.append((elapsed or 0.0) / limit)
    return min(1.0, max(parts)) if parts else None


# The live line's status fields in the order shown, and the order they give way in when the terminal is
# narrow (the first goes first). The step count is never dropped.
STATUS_FIELDS = ("loss", "tokens/s", "mfu", "memory", "eta")
STATUS_DROP_ORDER = ("prediction", "mfu", "memory", "tokens/s", "loss", "eta")
LIVE_BAR_WIDTHS = (24, 12)
LIVE_REFRESH_SECONDS = 0.5  # the live line is redrawn at most this often (on a step's metrics line)
STEP_TICK_SECONDS = 1.0  # a step (or its evaluation) longer than this: the live line counts its time each second
PIPE_STEP_TICK_SECONDS = 60.0  # ... and on a pipe, a line this often


def fit_live_line(width: int, count: str, fields: dict[str, str], prediction: str = "") -> tuple[str, int]:
    """The status text and the bar width that fit ``count``, a bar and the status into ``width`` columns.

    ``fields`` maps STATUS_FIELDS names to their text; ``prediction`` is appended to the memory field
    (``(pred 1.2 GiB)``). Fields give way in STATUS_DROP_ORDER, after the bar has shrunk to its narrower
    width; the bar goes (width 0) only when the step count and the ETA alone do not fit beside it.
    The live view lays out spinner, count, bar and status with one space between each."""
    width -= 1  # a line as wide as the terminal wraps on some terminals

    def status(dropped) -> str:
        shown = []
        for name in STATUS_FIELDS:
            if name in dropped or not fields.get(name):
                continue
            text = fields[name]
            if name == "memory" and prediction and "prediction" not in dropped:
                text += f" {prediction}"
            shown.append(text)
        return " | ".join(shown)

    def used(text: str, bar: int) -> int:  # spinner, count, bar, status, and the gaps between them
        return 1 + 1 + len(count) + (1 + bar if bar else 0) + (1 + len(text) if text else 0)

    dropped: list[str] = []
    for name in (None,) + STATUS_DROP_ORDER:
        if name is not None:
            dropped.append(name)
        text = status(dropped)
        for bar in LIVE_BAR_WIDTHS:
            if used(text, bar) <= width:
                return text, bar
        if name == "loss":  # only the ETA is left: keep it, without the bar
            if used(text, 0) <= width:
                return text, 0
    return "", 0


class _ProgressView:
    """Live rich progress on a terminal, fitted to its width; on a pipe, a status line at each evaluation
    and every 10% of the run."""

    def __init__(self, console, trainer):
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

        self.console, self.trainer = console, trainer
        self.live = console.is_terminal
        self.bar = BarColumn(bar_width=LIVE_BAR_WIDTHS[0])
        self.columns = (SpinnerColumn(), TextColumn("{task.fields[count]}"), self.bar,
                        TextColumn("{task.fields[status]}"))
        # no refresh thread (rich's redraws the line 10 times a second, ~1% of a core beside the training): the
        # line is redrawn when a step's metrics line arrives, at most every LIVE_REFRESH_SECONDS
        self.progress = Progress(*self.columns, console=console, transient=False, disable=not self.live,
                                 auto_refresh=False)
        self.task = None
        self._last_print = -1
        self._refreshed = -math.inf
        self._line_at = self._pipe_said = time.perf_counter()  # the last step's line; the last tick printed
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self):
        self.progress.__enter__()
        self._line_at = self._pipe_said = time.perf_counter()
        self._ticker = threading.Thread(target=self._tick_loop, name="memplan-live-line", daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        return self.progress.__exit__(*exc)

    def _tick_loop(self) -> None:
        """Between steps' lines (a long step: a plan for a slower device, a loaded machine), the time spent in the
        step under way, each STEP_TICK_SECONDS, so that the line never sits still for the length of a step."""
        while not self._stop.wait(STEP_TICK_SECONDS):
            self.tick()

    def tick(self) -> None:
        """The step under way and how long it has run, against its predicted time (a thread calls it)."""
        now = time.perf_counter()
        waited = now - self._line_at
        if waited < STEP_TICK_SECONDS:
            return
        step = self.trainer.step + 1
        text = (f"step {step:,} running for {_step_clock(waited)} (predicted "
                f"{_step_clock(self.trainer.predicted.step_seconds)} a step)")
        if self.live:
            if self.task is None:
                self.task = self.progress.add_task("train", total=None, count=f"step {step:,}", status=text)
            self.progress.update(self.task, count=f"step {step:,}", status=text)
            self.progress.refresh()
        elif now - self._pipe_said >= PIPE_STEP_TICK_SECONDS:
            self._pipe_said = now
            self._print(f"[dim]{text}[/]")

    def _print(self, text: str) -> None:  # on a terminal, wrapped at its width; on a pipe, one line each
        (self.progress.console if self.live else self.console).print(text, soft_wrap=not self.live)

    def _warn(self, text: str) -> None:
        """One line on stderr (this view's console when that is stderr, as train's; finetune's is stdout)."""
        if self.console.stderr:
            self._print(f"[yellow]{text}[/]")
        else:
            _stderr(self.console).print(f"[yellow]{text}[/]", soft_wrap=True)

    def _clock(self) -> tuple[float | None, float | None]:
        """(elapsed, limit) in seconds for a time-limited run; (None, None) otherwise."""
        minutes = getattr(self.trainer.config, "max_minutes", None)
        if minutes is None:
            return None, None
        return self.trainer.elapsed_seconds, minutes * 60.0

    def update(self, line) -> None:
        """Show one metrics line (a ``trainer.records`` record, as ``Trainer.on_event`` passes it)."""
        from memplan.units import format_bytes, format_count
        from trainer import records

        if isinstance(line, records.TrainLine):
            self._line_at = time.perf_counter()
            total = line.total_steps
            fixed = self.trainer.schedule.fixed
            elapsed, limit = self._clock()
            count = progress_count(line.step, total, fixed, elapsed, limit)
            fraction = progress_fraction(line.step, total, fixed, elapsed, limit)
            pred = self.trainer.predicted.peak_reserved
            mem = line.memory_bytes
            loss = "n/a" if line.loss is None else f"{line.loss:.4f}"
            fields = {"loss": f"loss {loss}", "tokens/s": f"{format_count(line.tokens_per_second)} tok/s",
                      "mfu": f"MFU {line.mfu:.1%}", "memory": f"mem {format_bytes(mem) if mem else '?'}",
                      "eta": f"ETA {_clock(line.eta_seconds)}"}  # one unit as it counts down: 2:06, 1:48
            prediction = f"(pred {format_bytes(pred)})"
            if self.live:
                status, bar = fit_live_line(self.progress.console.width, count, fields, prediction)
                self.bar.bar_width = bar or None
                self.progress.columns = self.columns if bar else tuple(c for c in self.columns if c is not self.bar)
            else:
                status = " | ".join(f + (f" {prediction}" if k == "memory" else "") for k, f in fields.items())
            done = None if fraction is None else round(fraction * 1000)
            if self.task is None:
                self.task = self.progress.add_task("train", total=None if done is None else 1000, completed=done or 0,
                                                   count=count, status=status)
            self.progress.update(self.task, total=None if done is None else 1000, completed=done or 0,
                                 count=count, status=status)
            if self.live and time.perf_counter() - self._refreshed >= LIVE_REFRESH_SECONDS:
                self._refreshed = time.perf_counter()
                self.progress.refresh()
            if not self.live and fraction is not None:
                decile = int(fraction * 10)
                if decile != self._last_print:
                    self._last_print = decile
                    self._print(f"{count} {status}")
        elif isinstance(line, records.EvalLine):
            per = ", ".join(f"{k} {v:.3f}" for k, v in line.eval_loss_by_source.items() if v is not None)
            ppl = line.eval_ppl
            loss = "n/a" if line.eval_loss is None else f"{line.eval_loss:.4f}"
            self._print(f"[bold]eval[/] step {line.step}: held-out loss {loss} over {line.eval_tokens:,} tokens"
                        + (f" (perplexity {ppl:,.1f})" if ppl else "") + (f" — {per}" if per else ""))
            for s in line.samples[:2]:
                self._print(f"  [dim]{s['prompt']!r} →[/] {s['text'][:160]!r}")
        elif isinstance(line, records.StartEvent):
            if warning := repeat_warning(line):
                self._warn(warning)
        elif isinstance(line, records.OomEvent):
            self._print(f"[yellow]out of memory[/] at step {line.step}: micro-batch "
                        f"{line.previous['micro_batch']} → {line.micro_batch}, accumulation "
                        f"{line.previous['grad_accum']} → {line.grad_accum} (same global batch); "
                        "redoing the step")
        elif isinstance(line, records.NonfiniteEvent):
            self._print(f"[yellow]non-finite loss[/] at step {line.step} ({line.loss}): update skipped "
                        f"({line.in_a_row} in a row)")
        elif isinstance(line, records.CheckpointEvent):
            self._print(f"[dim]checkpoint {line.path} ({line.seconds:.1f} s)[/]")
        elif isinstance(line, records.SignalEvent):
            if line.now:
                self._print(f"[yellow]{line.signal} again[/]: stopping now, without a checkpoint of step "
                            f"{line.step + 1} (--resume continues from the last checkpoint, if there is one)")
            else:
                self._print(f"[yellow]{line.signal}[/]: stopping after this step (step {line.step + 1}), then "
                            "a checkpoint and the report; send it again to stop now")
        elif isinstance(line, records.StopEvent) and line.reason == "interrupted":
            self._print("[yellow]interrupted[/]: checkpoint saved; continue with --resume")


def _print_summary(trainer, summary, sample) -> None:
    from rich.console import Console

    from memplan.units import format_bytes, format_count, format_seconds, measured
    from trainer.records import steady_figures
    from trainer.rundir import metric_records

    figures = steady_figures(metric_records(trainer.run_dir, latest=True))  # as the run report shows them
    out = Console(highlight=False)
    reasons = {"max_steps": "reached --max-steps", "max_tokens": "reached --tokens", "max_minutes": "time limit",
               "epoch": "one epoch done", "interrupted": "interrupted"}
    reason = reasons.get(summary.stop_reason, summary.stop_reason)
    if summary.first_step:  # a resume: what this command did, and its own time (what --max-minutes counted)
        out.print(f"[bold]Done[/]: {summary.step:,} steps, {format_count(summary.tokens)} tokens in "
                  f"{format_seconds(summary.train_seconds)} of training in all; this resume: "
                  f"{summary.step - summary.first_step:,} steps in {format_seconds(summary.wall_seconds)} ({reason})",
                  soft_wrap=True)
    else:
        out.print(f"[bold]Done[/]: {summary.step:,} steps, {format_count(summary.tokens)} tokens in "
                  f"{format_seconds(summary.train_seconds)} ({reason})")
    if summary.last_eval:
        e = summary.last_eval
        per = ", ".join(f"{k} {v:.3f}" for k, v in e.eval_loss_by_source.items() if v is not None)
        print_hanging(out, "  ", f"held-out loss {measured(e.eval_loss, '.4f')}, "
                      f"perplexity {measured(e.eval_ppl, ',.1f')}"
                      + (f" ({per})" if per else "") + (
                          "; " + held_out_count(e.eval_tokens, trainer.data.val_tokens, trainer.config.eval_batches,
                                                trainer.run_dir) if trainer.task.kind == "train" else
                          f"; over {e.eval_tokens:,} held-out tokens"))
    if figures is not None:
        meas = figures.peak_memory_bytes
        pred = trainer.predicted
        if meas:
            print_hanging(out, "  memory: ", f"measured peak {format_bytes(meas)}, predicted "
                          f"{format_bytes(pred.peak_reserved)} ({(pred.peak_reserved - meas) / meas:+.1%}); "
                          f"measured by {trainer.monitor.source}")
            if trainer.device.type == "cpu" and trainer.baseline_bytes:
                context = trainer.profile.runtime_context_bytes
                whose = ("this machine's calibration measured a warmed-up process holding"
                         if trainer.profile.calibrated else f"the {trainer.profile.name} profile's runtime context is")
                print_hanging(out, "    ", f"(this process held {format_bytes(trainer.baseline_bytes)} before the "
                              f"model existed; {whose} {format_bytes(context)})")
        if figures.tokens_per_second is not None and pred.clock == "cpu" and figures.cpu_tokens_per_second:
            # the load was too unsteady to predict wall time: CPU time against CPU time (memplan.local)
            print_hanging(out, "  throughput: ", f"{figures.tokens_per_second:,.0f} tokens/s (median); per second of "
                          f"CPU time {figures.cpu_tokens_per_second:,.0f}, predicted {pred.tokens_per_second:,.0f} "
                          f"({(pred.tokens_per_second - figures.cpu_tokens_per_second) / figures.cpu_tokens_per_second:+.1%}"
                          f"; the load was too unsteady to predict wall time); MFU {figures.mfu or 0.0:.1%}")
        elif figures.tokens_per_second is not None:
            print_hanging(out, "  throughput: ", f"{figures.tokens_per_second:,.0f} tokens/s (median), predicted "
                          f"{measured(pred.tokens_per_second, ',.0f')}; MFU {measured(figures.mfu, '.1%')}")
    if summary.checkpoint:
        print_hanging(out, "  checkpoint: ", str(summary.checkpoint))
    if summary.report:
        print_hanging(out, "  report: ", str(summary.report))
    if sample is not None:
        from trainer.sample import FINAL_SAMPLE_TEMPERATURE, FINAL_SAMPLE_TOP_K

        out.print(f"[bold]Sample[/] (top-k {FINAL_SAMPLE_TOP_K}, temperature {FINAL_SAMPLE_TEMPERATURE:g}):")
        out.print(printable(f"{sample[0]}{sample[1]}"), markup=False)


def _launch(request, log: list[str], console) -> None:
    """``memplan train --nproc N ...``: the run resolved once, here, for N processes and written into
    RUN/launch.json (``trainer.launch.prepare_train``), then N ranks started (``start_ranks``), each ``python -m
    trainer RUN`` reading that file (rank 0 printing); the exit code is theirs. No rank parses these flags."""
    from trainer.launch import prepare_train, start_ranks

    run_dir, created = prepare_train(request, RichUI(console), log)
    code = start_ranks(run_dir, request.nproc, resume=request.resume, created=created, what="training",
                       say=lambda text: console.print(text, soft_wrap=True))
    if code:
        raise typer.Exit(code)


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab shown as U+FFFD (an undertrained model
    emits stray bytes; a terminal must not interpret them)."""
    import unicodedata

    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) != "Cc" else "\ufffd" for ch in text)


def _report_only(out: str | None, console) -> None:
    from memplan.reports.run import write_run_report
    from trainer.rundir import METRICS_FILE, REPORT_FILE  # torch-free: a report alone starts no torch

    if not out:
        raise InputError("--report: name the run with --out RUN")
    if not (Path(out) / METRICS_FILE).is_file():
        raise InputError(f"--report: {out} has no {METRICS_FILE}; not a training run")
    from memplan.fsutil import no_space
    from memplan.reports.page import check_report_path

    check_report_path(Path(out) / REPORT_FILE, "--report", REPORT_FILE)
    try:
        path = write_run_report(out, flag="--report")
    except OSError as e:
        if no_space(e) is None:
            raise
        _error_line(console, f"memplan: error: {Path(out) / REPORT_FILE}: no space left on device; free space, then "
                             "run this again")
        raise typer.Exit(1)
    print(path)
