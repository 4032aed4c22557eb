"""``memplan train``: train on a plan (given, autotuned, or from explicit MODEL SETUP flags) and measure it.

``memplan train`` with no arguments is the quick start: it prepares the embedded corpus (once, into
the cache), picks a model that the local device can train well in a few minutes, autotunes its
setup, trains it with live progress, and ends with a sample and the run report.

The work is ``trainer.loop.Trainer``; this module resolves the options, prints the plan, renders
progress with rich, and prints the summary. torch is imported only inside the command.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli import app
from memplan.cli.options import (ArchOpt, AttentionOpt, BatchOpt, CheckpointingOpt, CtxOpt, DeviceMemoryOpt, DeviceOpt,
                                 FfnOpt, GradAccumOpt, HeadsOpt, HiddenOpt, KvHeadsOpt, LayersOpt, ModelOpt,
                                 OptimizerOpt, ParamsOpt, PrecisionOpt, TiedOpt, VocabOpt, device_from, model_from)
from memplan.errors import InputError

QUICKSTART_MINUTES = 3.0  # `memplan train` alone trains this long
QUICKSTART_CTX = 256  # the embedded corpus's documents are short; 256 tokens hold most of one
QUICKSTART_LR = 3e-3  # models of a few million parameters train fastest at a few 1e-3 (6e-4 is tuned for 125M)
DEFAULT_CTX = 1024  # with MODEL flags, as the other commands
TOKENS_PER_PARAM = 20  # compute-optimal tokens per parameter (Hoffmann et al. 2022, Chinchilla)
QUICKSTART_MIN_STEPS = 200  # the quick start's global batch is sized for at least this many steps
QUICKSTART_LAYERS = (2, 3, 4, 6, 8, 10, 12)  # the model ladder: hidden = 64·layers (memplan's size rule)
QUICKSTART_CALIBRATE_SECONDS = 15.0  # the quick start's first calibration of this machine (then cached)
MATMUL_PROBE = 1024  # side of the square fp32 matmul timed to rate the local device for the quick start

LAUNCHED_BY_ENV = "MEMPLAN_LAUNCHED_BY"  # set by `memplan train --nproc` for the ranks it starts

_R = "Run"
PlanOpt = Annotated[Optional[str], typer.Option("--plan", help="A plan TOML (from `memplan autotune --out`) to "
                                                "train on, as given.", show_default=False, rich_help_panel=_R)]
DataOpt = Annotated[Optional[str], typer.Option(
    "--data", help="A prepared corpus (`memplan prepare --out DIR`). Default: the embedded corpus, prepared once "
                   "into the cache ($MEMPLAN_CACHE, else ~/.cache/memplan).", show_default=False, rich_help_panel=_R)]
OutOpt = Annotated[Optional[str], typer.Option(
    "--out", "-o", help="The run directory (metrics.jsonl, plan.toml, checkpoints/, report.html). Default: "
                        "runs/train-DATE-TIME.", show_default=False, rich_help_panel=_R)]
MaxStepsOpt = Annotated[Optional[str], typer.Option("--max-steps", help="Stop after this many optimizer steps.",
                                                    show_default=False, rich_help_panel=_R)]
TokensOpt = Annotated[Optional[str], typer.Option("--tokens", help="Stop after this many training tokens (e.g. 50m).",
                                                  show_default=False, rich_help_panel=_R)]
MaxMinutesOpt = Annotated[Optional[str], typer.Option(
    "--max-minutes", help="Stop after this many minutes; alone, it also sets the schedule's length (from timed "
                          "steps). Default without any limit: one epoch (the quick start: 3 minutes).",
    show_default=False, rich_help_panel=_R)]
SaveEveryOpt = Annotated[Optional[str], typer.Option("--save-every", help="Steps between checkpoints "
                                                     "(default: as --eval-every).", show_default=False,
                                                     rich_help_panel=_R)]
EvalEveryOpt = Annotated[Optional[str], typer.Option(
    "--eval-every", help="Steps between held-out evaluations (default: 5 per run, at least every 1000 steps).",
    show_default=False, rich_help_panel=_R)]
SeedOpt = Annotated[Optional[str], typer.Option("--seed", help="Seed of the initialisation and the data order "
                                                "(default 0).", show_default=False, rich_help_panel=_R)]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its newest checkpoint.",
                                         rich_help_panel=_R)]
ReportOpt = Annotated[bool, typer.Option("--report", help="Only (re)write RUN/report.html from RUN/metrics.jsonl "
                                         "(also while the run is going) and exit.", rich_help_panel=_R)]
CompileOpt = Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="torch.compile the model.",
                                                    show_default=False, rich_help_panel="Setup")]
NprocOpt = Annotated[Optional[str], typer.Option(
    "--nproc", help="Train in N processes (torchrun: one per GPU, else N CPU processes over gloo) with DDP or "
                    "FSDP2; each rank runs --batch × --grad-accum per step (the plan's, for --plan).",
    show_default=False, rich_help_panel="Setup")]
TrainShardingOpt = Annotated[Optional[str], typer.Option(
    "--sharding", help="With --nproc: ddp | fsdp (default: the plan's, else ddp).", show_default=False,
    rich_help_panel="Setup")]

_H = "Hyper-parameters"
LrOpt = Annotated[Optional[str], typer.Option("--lr", help="Peak learning rate (default 6e-4).", show_default=False,
                                              rich_help_panel=_H)]
WarmupOpt = Annotated[Optional[str], typer.Option("--warmup", help="Warmup steps (default: 5% of the steps, at "
                                                  "most 100).", show_default=False, rich_help_panel=_H)]
MinLrOpt = Annotated[Optional[str], typer.Option("--min-lr-ratio", help="Cosine decay ends at this share of the "
                                                 "peak (default 0.1).", show_default=False, rich_help_panel=_H)]
WeightDecayOpt = Annotated[Optional[str], typer.Option("--weight-decay", help="AdamW weight decay (default 0.1).",
                                                       show_default=False, rich_help_panel=_H)]
ClipOpt = Annotated[Optional[str], typer.Option("--clip", help="Gradient-norm clipping, 0 = off (default 1.0).",
                                                show_default=False, rich_help_panel=_H)]
KeepOpt = Annotated[Optional[str], typer.Option("--keep", help="Checkpoints to keep (default 3).", show_default=False,
                                                rich_help_panel=_R)]
EvalBatchesOpt = Annotated[Optional[str], typer.Option("--eval-batches", help="Held-out batches per source in an "
                                                       "evaluation (default 4).", show_default=False,
                                                       rich_help_panel=_R)]
SampleTokensOpt = Annotated[Optional[str], typer.Option("--sample-tokens", help="Tokens per evaluation sample, "
                                                        "0 = none (default 32).", show_default=False,
                                                        rich_help_panel=_R)]
PromptOpt = Annotated[Optional[list[str]], typer.Option(
    "--prompt", help="A sample prompt (repeat for several). Default: the start of each source's first held-out "
                     "document.", show_default=False, rich_help_panel=_R)]
MaxNonfiniteOpt = Annotated[Optional[str], typer.Option("--max-nonfinite", help="Stop after this many non-finite "
                                                        "losses in a row (default 5).", show_default=False,
                                                        rich_help_panel=_R)]
VerifyDataOpt = Annotated[Optional[bool], typer.Option(
    "--verify-data/--no-verify-data", help="Check every shard's sha256 before training (default: on).",
    show_default=False, rich_help_panel=_R)]
_A = "Autotune (without --plan or --batch)"
GlobalBatchTokensOpt = Annotated[Optional[str], typer.Option(
    "--global-batch-tokens", help="Tokens per optimizer step for autotune to keep.", show_default=False,
    rich_help_panel=_A)]
BudgetOpt = Annotated[Optional[str], typer.Option("--budget", help="Memory budget for autotune (e.g. 6GiB); "
                                                  "default: the device's usable memory.", show_default=False,
                                                  rich_help_panel=_A)]
MarginOpt = Annotated[str, typer.Option("--margin", help="Share of the budget autotune leaves free.",
                                        rich_help_panel=_A)]


@app.command("train")
def train_command(
    plan: PlanOpt = None, data: DataOpt = None, out: OutOpt = None,
    max_steps: MaxStepsOpt = None, tokens: TokensOpt = None, max_minutes: MaxMinutesOpt = None,
    save_every: SaveEveryOpt = None, eval_every: EvalEveryOpt = None, seed: SeedOpt = None,
    resume: ResumeOpt = False, report: ReportOpt = False,
    params: ParamsOpt = None, model: ModelOpt = None, arch: ArchOpt = None, layers: LayersOpt = None,
    hidden: HiddenOpt = None, heads: HeadsOpt = None, kv_heads: KvHeadsOpt = None, ffn: FfnOpt = None,
    vocab: VocabOpt = None, tied: TiedOpt = None,
    ctx: Annotated[Optional[str], CtxOpt.__metadata__[0]] = None,
    batch: Annotated[Optional[str], BatchOpt.__metadata__[0]] = None,
    grad_accum: Annotated[Optional[str], GradAccumOpt.__metadata__[0]] = None,
    precision: Annotated[Optional[str], PrecisionOpt.__metadata__[0]] = None,
    attention: Annotated[Optional[str], AttentionOpt.__metadata__[0]] = None,
    checkpointing: Annotated[Optional[str], CheckpointingOpt.__metadata__[0]] = None,
    optimizer: Annotated[Optional[str], OptimizerOpt.__metadata__[0]] = None,
    compile: CompileOpt = None,
    device: DeviceOpt = None, device_memory: DeviceMemoryOpt = None,
    lr: LrOpt = None, warmup: WarmupOpt = None, min_lr_ratio: MinLrOpt = None, weight_decay: WeightDecayOpt = None,
    clip: ClipOpt = None, keep: KeepOpt = None, eval_batches: EvalBatchesOpt = None,
    sample_tokens: SampleTokensOpt = None, prompt: PromptOpt = None, max_nonfinite: MaxNonfiniteOpt = None,
    verify_data: VerifyDataOpt = None,
    global_batch_tokens: GlobalBatchTokensOpt = None, budget: BudgetOpt = None, margin: MarginOpt = "0.1",
    nproc: NprocOpt = None, sharding: TrainShardingOpt = None, click_ctx: typer.Context = None,
) -> None:
    """Train a model on a plan and measure it against memplan's predictions; alone, a short run on the embedded corpus."""
    from rich.console import Console

    from memplan.units import parse_count

    console = Console(stderr=True, highlight=False)
    if report:
        return _report_only(out, console)
    if sharding is not None and sharding not in ("ddp", "fsdp"):
        raise InputError(f"--sharding: {sharding!r} (accepted: ddp, fsdp; training in one process shards nothing)")
    n = parse_count(nproc, "--nproc") if nproc is not None else 1
    from trainer import distributed

    rank, launched, _ = distributed.env_world()
    if n > 1 and launched > 1:
        raise InputError(f"--nproc {n}: this process is already one of {launched} started by torchrun; drop --nproc")
    if n > 1:
        return _launch(click_ctx, n, data, out, resume, console)
    if sharding is not None and launched == 1:
        raise InputError(f"--sharding {sharding}: needs several processes; add --nproc N")
    if launched > 1:  # one rank of a torchrun launch: join the group; rank 0 alone prints
        distributed.init()
        console = Console(stderr=True, highlight=False, quiet=rank != 0)
    try:
        _train_command(console, plan=plan, data=data, out=out, max_steps=max_steps, tokens=tokens,
                       max_minutes=max_minutes, save_every=save_every, eval_every=eval_every, seed=seed,
                       resume=resume, params=params, model=model, arch=arch, layers=layers, hidden=hidden,
                       heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, tied=tied, ctx=ctx, batch=batch,
                       grad_accum=grad_accum, precision=precision, attention=attention,
                       checkpointing=checkpointing, optimizer=optimizer, compile=compile, device=device,
                       device_memory=device_memory, lr=lr, warmup=warmup, min_lr_ratio=min_lr_ratio,
                       weight_decay=weight_decay, clip=clip, keep=keep, eval_batches=eval_batches,
                       sample_tokens=sample_tokens, prompt=prompt, max_nonfinite=max_nonfinite,
                       verify_data=verify_data, global_batch_tokens=global_batch_tokens, budget=budget,
                       margin=margin, sharding=sharding)
    finally:
        distributed.shutdown()


def _train_command(console, *, plan, data, out, max_steps, tokens, max_minutes, save_every, eval_every, seed, resume,
                   params, model, arch, layers, hidden, heads, kv_heads, ffn, vocab, tied, ctx, batch, grad_accum,
                   precision, attention, checkpointing, optimizer, compile, device, device_memory, lr, warmup,
                   min_lr_ratio, weight_decay, clip, keep, eval_batches, sample_tokens, prompt, max_nonfinite,
                   verify_data, global_batch_tokens, budget, margin, sharding) -> None:
    from memplan.units import parse_count
    from trainer import distributed
    from trainer.data import PreparedData

    _, launched, _ = distributed.env_world()

    model_flags = dict(params=params, model=model, arch=arch, layers=layers, hidden=hidden, heads=heads,
                       kv_heads=kv_heads, ffn=ffn, vocab=vocab, tied=tied)
    setup_flags = dict(ctx=ctx, batch=batch, grad_accum=grad_accum, precision=precision, attention=attention,
                       checkpointing=checkpointing, optimizer=optimizer, compile=compile)
    given_model = any(v is not None for v in model_flags.values())
    given_setup = any(v is not None for k, v in setup_flags.items() if k != "ctx")
    if plan and (given_model or given_setup or setup_flags["ctx"] is not None):
        raise InputError("give --plan FILE or MODEL/SETUP options, not both")

    def count(value, what, minimum=1):
        return None if value is None else parse_count(value, what, minimum=minimum)

    overrides = dict(
        max_steps=count(max_steps, "--max-steps"), max_tokens=count(tokens, "--tokens"),
        max_minutes=_number(max_minutes, "--max-minutes", positive=True),
        save_every=count(save_every, "--save-every"), eval_every=count(eval_every, "--eval-every"),
        eval_batches=count(eval_batches, "--eval-batches"), keep=count(keep, "--keep"),
        sample_tokens=count(sample_tokens, "--sample-tokens", minimum=0),
        prompts=tuple(prompt) if prompt else None, verify_data=verify_data,
        max_nonfinite=count(max_nonfinite, "--max-nonfinite"),
    )
    hyper = dict(lr=_number(lr, "--lr", positive=True), warmup_steps=count(warmup, "--warmup", minimum=0),
                 min_lr_ratio=_number(min_lr_ratio, "--min-lr-ratio"),
                 weight_decay=_number(weight_decay, "--weight-decay"), clip=_number(clip, "--clip"),
                 seed=count(seed, "--seed", minimum=0))
    quickstart = not plan and not given_model and not given_setup and not resume

    profile = device_from(device, device_memory)
    if device is None:  # the local device: plan with its measured rates where memplan has them
        profile, rates_note = local_calibration(profile, console, measure_now=quickstart)
    else:
        rates_note = None
    if resume:
        if not out:
            raise InputError("--resume: name the run to continue with --out RUN")
        run_dir = Path(out)
        from trainer import checkpoint as ckpt
        from trainer.loop import CHECKPOINT_DIR

        ref = ckpt.latest_checkpoint(run_dir / CHECKPOINT_DIR)
        if ref is not None:
            meta = ckpt.read_meta(ref.path)
            data_dir = Path(data) if data else Path(meta.get("data", {}).get("path", ""))
            if not data and not (data_dir / "manifest.json").is_file():
                raise InputError(f"--resume: the run's prepared data {data_dir} is gone; give it with --data DIR")
            prepared = PreparedData(data_dir)
            asked = None
            if plan or given_model or given_setup or ctx is not None:
                asked = _plan_from_flags(plan, model_flags, setup_flags, prepared, profile, console, quiet=True)
            return _train(console, run_dir, prepared, profile, resume_plan=asked, overrides=overrides, hyper=hyper,
                          rates_note=rates_note, sharding=sharding)
        console.print(f"[yellow]note[/]: {run_dir} has no checkpoint yet; starting the run from step 0")

    prepared = PreparedData(Path(data) if data else _embedded_data_once(console))
    minutes = overrides["max_minutes"]
    if quickstart and overrides["max_steps"] is None and overrides["max_tokens"] is None and minutes is None:
        minutes = overrides["max_minutes"] = QUICKSTART_MINUTES
    if quickstart and hyper["lr"] is None:
        hyper["lr"] = QUICKSTART_LR
    if plan or given_setup:
        the_plan = _plan_from_flags(plan, model_flags, setup_flags, prepared, profile, console)
    else:
        spec = (model_from(**{**model_flags, "vocab": None}).replace(vocab=prepared.vocab_size) if given_model
                else None)
        if given_model:
            _check_vocab(vocab, prepared)
        ctx_n = parse_count(ctx, "--ctx", binary=True) if ctx is not None else (
            DEFAULT_CTX if given_model else QUICKSTART_CTX)
        the_plan = _autotuned_plan(spec, ctx_n, prepared, profile, console, minutes=minutes,
                                   global_batch_tokens=count(global_batch_tokens, "--global-batch-tokens"),
                                   budget=budget, margin=_number(margin, "--margin"), world_size=launched)
    if launched > 1:  # every rank trains rank 0's plan (the quick start's is chosen on a timed matmul)
        the_plan = distributed.from_rank0(for_world(the_plan, launched, sharding, profile, console))
    run_dir = Path(out) if out else distributed.from_rank0(Path("runs") / time.strftime("train-%Y%m%d-%H%M%S"))
    _train(console, run_dir, prepared, profile, plan=the_plan, overrides=overrides, hyper=hyper,
           allow_existing=resume, rates_note=rates_note)


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


def _check_vocab(vocab: int | None, prepared) -> None:
    if vocab is not None and vocab != prepared.vocab_size:
        raise InputError(f"--vocab {vocab} conflicts with the prepared data's tokenizer ({prepared.vocab_size} tokens, "
                         f"{prepared.path}); for train the vocabulary comes from the data, so drop --vocab")


def best_precision(profile) -> str:
    """bf16-mixed where bf16 is native, else fp16-mixed where fp16 is, else fp32 (a CPU emulates half types)."""
    if profile.supports("bf16"):
        return "bf16-mixed"
    if profile.supports("fp16"):
        return "fp16-mixed"
    return "fp32"


def _plan_from_flags(plan_path, model_flags, setup_flags, prepared, profile, console, quiet: bool = False):
    """The plan of --plan FILE, or of MODEL and SETUP flags as given (no autotune); vocab from the data."""
    from memplan.cli.options import setup_from
    from memplan.plan import Plan
    from trainer.loop import predicted_for

    if plan_path:
        p = Plan.load(plan_path)
        if p.model.vocab != prepared.vocab_size:
            if not quiet:
                console.print(f"[yellow]note[/]: the plan's model has vocab {p.model.vocab}; training with the data's "
                              f"{prepared.vocab_size} (predictions recomputed)")
            p = Plan(model=p.model.replace(vocab=prepared.vocab_size), setup=p.setup, device=p.device,
                     budget_bytes=p.budget_bytes, predicted={})
    else:
        _check_vocab(model_flags["vocab"], prepared)
        spec = model_from(**{**model_flags, "vocab": None}).replace(vocab=prepared.vocab_size)
        s = setup_flags
        precision = s["precision"] or best_precision(profile)
        setup = setup_from(ctx=s["ctx"] or str(DEFAULT_CTX), batch=s["batch"] or "1", grad_accum=s["grad_accum"] or "1",
                           precision=precision, attention=s["attention"] or "sdpa",
                           checkpointing=s["checkpointing"] or "none", optimizer=s["optimizer"] or "adamw",
                           compile=bool(s["compile"]))
        if not s["precision"] and not quiet:
            console.print(f"precision {precision}: the best the {profile.name} profile runs natively "
                          "(--precision to choose)")
        p = Plan(model=spec, setup=setup, device=profile.name, budget_bytes=profile.usable_bytes)
    if not p.predicted:
        pred = predicted_for(p, profile)
        p = Plan(model=p.model, setup=p.setup, device=p.device or profile.name,
                 budget_bytes=p.budget_bytes or profile.usable_bytes,
                 predicted={"peak_reserved": pred["peak_reserved"], "step_seconds": pred["step_seconds"],
                            "tokens_per_second": pred["tokens_per_second"], "epoch_seconds": None})
    return p


def calibration_cache(family: str, title: str, threads: int, torch_version: str) -> Path:
    """Where the local device's calibration is kept: one TOML per device, torch threads and torch version."""
    from memplan.cli.calibrate import _slug

    return cache_dir() / "calibrated" / f"{family}-{_slug(title)}-{threads}t-torch{_slug(torch_version)}.toml"


def local_calibration(profile, console, measure_now: bool):
    """The local ``profile`` with rates this machine measured: a cached ``memplan calibrate``-style
    calibration if there is one; else, with ``measure_now`` (the quick start), a short calibration
    (QUICKSTART_CALIBRATE_SECONDS) run now and cached; else the profile as it is. Returns the profile
    and a line saying where its rates come from (printed once the run's options are all accepted, so
    that an error stays one line)."""
    from memplan.compat import tomllib

    import torch

    from memplan.cli.calibrate import write_atomically
    from memplan.hardware import device_from_toml
    from trainer import calibrate as cal_mod

    if profile.calibrated:
        return profile, None
    from memplan.cli.calibrate import NOISY

    family = cal_mod.local_family()
    path = calibration_cache(family, cal_mod.device_title(family), torch.get_num_threads(), torch.__version__)
    cached = None
    if path.is_file():
        try:
            cached = device_from_toml(tomllib.loads(path.read_text()), str(path))
        except (InputError, tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
            cached = None  # measured again below, or the nominal rates
    # A calibration taken while other processes competed for the device (repeated timings spread by
    # more than NOISY) is used, but the quick start measures again and keeps the steadier of the two.
    if cached is not None and (not measure_now or cached.calibrated.get("noise", 0) <= NOISY):
        return profile.replace(calibrated=cached.calibrated), _rates_note(cached.calibrated, f"({path})")
    if not measure_now:
        return profile, ("[dim]rates: the profile's nominal figures; `memplan calibrate` measures this machine "
                         "(predictions of time are far closer afterwards)[/]")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]measuring this machine[/] {task.description:<18}"), BarColumn(),
               TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=1.0)
        cal = cal_mod.calibrate(QUICKSTART_CALIBRATE_SECONDS,
                                progress=lambda stage, done: progress.update(task, description=stage, completed=done))
    text = cal_mod.profile_toml(cal_mod.profile_data(cal, profile.name, None))
    measured = device_from_toml(tomllib.loads(text), str(path))
    if cached is not None and cached.calibrated.get("noise", 0) <= measured.calibrated.get("noise", 0):
        return profile.replace(calibrated=cached.calibrated), _rates_note(cached.calibrated, f"({path})")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text)
    return profile.replace(calibrated=measured.calibrated), _rates_note(
        measured.calibrated, f"in {cal.seconds:.0f} s (kept in {path}; `memplan calibrate` measures longer)")


def _rates_note(calibrated: dict, where: str) -> str:
    from memplan.cli.calibrate import NOISY

    note = f"rates: measured on this machine {where}"
    if calibrated.get("noise", 0) > NOISY:
        note += (f"; [yellow]taken while the machine was busy[/] (timings spread {calibrated['noise']:.0%}), so "
                 "time predictions are rough: `memplan calibrate` when it is idle")
    return note


def measured_matmul_rate(seconds: float = 0.5) -> float:
    """FLOP/s of a square fp32 matmul on the local torch device (a quick rate for the quick start's model choice)."""
    import torch

    from trainer.loop import torch_device_for

    dev = torch_device_for()
    a = torch.randn(MATMUL_PROBE, MATMUL_PROBE, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    (a @ a).sum().item()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    sync()
    return 2 * MATMUL_PROBE**3 * n / (time.perf_counter() - t0)


def quickstart_model(vocab: int, profile, minutes: float, ctx: int):
    """The largest model of the ladder (hidden = 64·layers) that trains on its compute-optimal
    TOKENS_PER_PARAM × params tokens within ``minutes``, at the step time memplan predicts with the
    local matmul rate measured now (the profile's figure is nominal until `memplan calibrate` runs)."""
    from memplan.model import ModelSpec, _round_up
    from memplan.setup import TrainSetup
    from memplan.timing import step_time

    if profile.calibrated.get("matmul_tflops", {}).get("fp32"):
        rated, rate = profile, profile.calibrated["matmul_tflops"]["fp32"] * 1e12
    else:
        rate = measured_matmul_rate()
        rated = profile.replace(calibrated={**profile.calibrated, "matmul_tflops": {
            **profile.calibrated.get("matmul_tflops", {}), "fp32": rate / 1e12}})
    chosen = None
    for layers in QUICKSTART_LAYERS:
        hidden = 64 * layers
        spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=hidden // 64,
                         ffn=_round_up(8 * hidden / 3, 256), vocab=vocab, tied=True,
                         name=f"quickstart-{layers}x{hidden}",
                         source="memplan's rule: hidden = 64·layers, ffn = 8/3·hidden")
        setup = TrainSetup(ctx=ctx, micro_batch=8, precision=best_precision(profile))
        tps = step_time(spec, setup, rated).tokens_per_second
        if chosen is None or tps * minutes * 60 >= TOKENS_PER_PARAM * spec.params:
            chosen = (spec, tps)
    return chosen[0], chosen[1], rate


def for_world(plan, world_size: int, sharding: str | None, profile, console):
    """``plan`` as trained by ``world_size`` processes: a plan for one process runs its micro-batch and
    accumulation in every rank (a global batch ``world_size`` times larger); ``sharding`` (else the
    plan's, else ddp) chooses DDP or FSDP2. Predictions are recomputed for what changed."""
    from memplan.plan import Plan
    from trainer.loop import predicted_for

    s = plan.setup
    if s.world_size not in (1, world_size):
        raise InputError(f"the plan is for --world-size {s.world_size} but {world_size} processes were launched; "
                         f"launch it with `memplan train --nproc {s.world_size}`")
    chosen = sharding or (s.sharding if s.sharding != "none" else "ddp")
    if s.world_size == world_size and s.sharding == chosen:
        return plan
    if s.world_size == 1:
        console.print(f"[yellow]note[/]: the plan is for one process; each of the {world_size} ranks runs its "
                      f"micro-batch {s.micro_batch} × {s.grad_accum} accumulation, so a step is {world_size}× "
                      f"the plan's global batch ({chosen})")
    setup = s.replace(world_size=world_size, sharding=chosen)
    p = Plan(model=plan.model, setup=setup, device=plan.device, budget_bytes=plan.budget_bytes, predicted={})
    pred = predicted_for(p, profile)
    return Plan(model=p.model, setup=setup, device=p.device, budget_bytes=p.budget_bytes,
                predicted={"peak_reserved": pred["peak_reserved"], "step_seconds": pred["step_seconds"],
                           "tokens_per_second": pred["tokens_per_second"], "epoch_seconds": None})


def _autotuned_plan(spec, ctx, prepared, profile, console, *, minutes, global_batch_tokens, budget, margin,
                    world_size: int = 1):
    from memplan.units import format_count, parse_size

    try:
        from memplan.autotune import autotune
    except ImportError:
        raise InputError("planning needs memplan.autotune, which this build of memplan lacks; give --plan FILE or "
                         "the setup yourself (e.g. --params 22m --batch 8 --ctx 256)") from None
    if spec is None:
        minutes = minutes or QUICKSTART_MINUTES  # with a step or token limit instead, size it for the default
        spec, tps, rate = quickstart_model(prepared.vocab_size, profile, minutes, ctx)
        console.print(f"Model for a {minutes:g}-minute run: [bold]{spec.describe()}[/] — about "
                      f"{TOKENS_PER_PARAM} tokens per parameter at ~{format_count(tps)} tokens/s predicted "
                      f"(local matmul measured at {rate / 1e9:,.0f} GFLOP/s)")
        if global_batch_tokens is None:  # small steps, so the run gets a few hundred of them
            steps_tokens = tps * minutes * 60 / QUICKSTART_MIN_STEPS
            global_batch_tokens = max(ctx, min(1 << 19, ctx * 2 ** max(0, int(math.log2(max(1, steps_tokens / ctx))))))
    result = autotune(spec, profile, ctx=ctx, global_batch_tokens=global_batch_tokens,
                      budget_bytes=parse_size(budget, "--budget") if budget else None, margin=margin,
                      tokens=None, world_size=world_size)
    if result.plan is None:
        advice = "; ".join(getattr(result, "advice", None) or ["try a smaller model or a shorter --ctx"])
        raise InputError(f"nothing fits {profile.name} for {spec.describe()} at ctx {ctx}: {advice}")
    return result.plan


# =================================================================================================
# Data
# =================================================================================================

def cache_dir() -> Path:
    """$MEMPLAN_CACHE, else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan."""
    if os.environ.get("MEMPLAN_CACHE"):
        return Path(os.environ["MEMPLAN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "memplan"


def embedded_data_dir() -> Path:
    """Where the embedded corpus is prepared: per Python version (its docstrings are the corpus)."""
    from trainer.data import DEFAULT_TOKENIZER_EMBEDDED

    version = ".".join(map(str, sys.version_info[:3]))
    return cache_dir() / "data" / f"embedded-py{version}-{DEFAULT_TOKENIZER_EMBEDDED.replace(':', '')}"


def _embedded_data_once(console) -> Path:
    """The embedded corpus; under torchrun rank 0 prepares it while the others wait."""
    from trainer import distributed

    rank, world_size, _ = distributed.env_world()
    if world_size == 1:
        return ensure_embedded_data(console)
    out = ensure_embedded_data(console) if rank == 0 else embedded_data_dir()
    distributed.barrier()
    return out


def ensure_embedded_data(console) -> Path:
    """The embedded corpus, prepared into the cache on first use (as `memplan prepare` with no --input)."""
    from memplan.cli.prepare import _ProgressBars
    from trainer import data

    out = embedded_data_dir()
    if data.is_prepared(out):
        return out
    console.print(f"Preparing the embedded corpus (CPython's documentation) into {out} — once")
    config = data.PrepareConfig(tokenizer=data.DEFAULT_TOKENIZER_EMBEDDED)
    with _ProgressBars(console) as bars:
        data.prepare(data.embedded_sources(), out, config, progress=bars.update)
    return out


# =================================================================================================
# Training, with progress
# =================================================================================================

def _train(console, run_dir: Path, prepared, profile, *, plan=None, resume_plan=None, overrides, hyper,
           allow_existing: bool = False, rates_note: str | None = None, sharding: str | None = None) -> None:
    from trainer.loop import Trainer, TrainConfig

    if plan is not None:  # a new run
        fields = {k: v for k, v in {**overrides, **hyper}.items() if v is not None}
        config = TrainConfig(**fields)
        trainer = Trainer.start(run_dir, plan, prepared, config, profile, allow_existing=allow_existing)
    else:
        trainer = Trainer.resume(run_dir, prepared, profile, plan=resume_plan, overrides={**overrides, **hyper},
                                 sharding=sharding)
    run_trainer(console, trainer, run_dir, rates_note=rates_note)


def run_trainer(console, trainer, run_dir: Path, *, what: str = "training", rates_note: str | None = None) -> None:
    """Print the plan, run ``trainer`` under the live progress view, then print the summary and a
    sample; exit 1 when the run stopped on an error, 128 + N when signal N ended it (train, finetune)."""
    from trainer.loop import TrainingStopped

    _print_plan(trainer, console)
    if rates_note:
        console.print(f"  {rates_note}", soft_wrap=True)
    view = _ProgressView(console, trainer)
    trainer.on_event(view.update)
    try:
        with view:
            summary = trainer.run()
    except TrainingStopped as e:
        console.print(f"[red]memplan: {what} stopped[/]: {e}", soft_wrap=True)
        console.print(f"Report: {run_dir / 'report.html'}")
        raise typer.Exit(1)
    sample = _final_sample(trainer)  # in every rank: an FSDP2 model's forward needs them all
    if trainer.is_main:
        _print_summary(trainer, summary, sample)
    if trainer.stop_signal is not None:  # the shell's convention for a process ended by a signal
        raise typer.Exit(128 + trainer.stop_signal)


def _print_plan(trainer, console) -> None:
    from memplan.units import format_bytes, format_count

    p, s = trainer.plan, trainer.plan.setup
    pred = trainer.predicted
    what = "Resuming" if trainer.step else "Training"
    console.print(f"[bold]{what}[/] {trainer.run_dir}: {p.model.describe()} ({p.model.params:,} parameters)")
    if p.model.size_note():  # the data's vocabulary changes the count a size name such as 22m gives
        console.print(f"  [dim]{p.model.size_note()}[/]")
    ranks = f" × {s.world_size} ranks ({s.sharding.upper()})" if s.world_size > 1 else ""
    console.print(f"  setup: ctx {s.ctx}, micro-batch {s.micro_batch} × {s.grad_accum} accumulation{ranks} "
                  f"({s.tokens_per_step:,} tokens/step), {s.precision}, {s.attention} attention, checkpointing "
                  f"{s.checkpointing}, {s.optimizer}" + (", compiled" if s.compile else ""))
    console.print(f"  data: {trainer.data.path} ({format_count(trainer.data.train_tokens)} train tokens, sources "
                  f"{', '.join(trainer.data.source_names)}); device {trainer.device} ({trainer.profile.name} profile)")
    console.print(f"  predicted: peak {format_bytes(pred['peak_reserved'])} ({format_bytes(pred['peak_allocated'])} "
                  f"live tensors), {pred['tokens_per_second']:,.0f} tokens/s, MFU {pred['mfu']:.1%}")
    if trainer.step:
        console.print(f"  from step {trainer.step:,} ({format_count(trainer.tokens)} tokens seen)")
    family = {"cuda": ("cuda", "rocm"), "mps": ("mps",), "cpu": ("cpu",)}.get(trainer.device.type, ())
    if trainer.profile.family not in family:
        console.print(f"[yellow]note[/]: training runs on {trainer.device} but the predictions are for the "
                      f"{trainer.profile.name} profile ({trainer.profile.family}); measured and predicted will differ")


class _ProgressView:
    """Live rich progress on a terminal; on a pipe, a status line at each evaluation and every 10% of the run."""

    def __init__(self, console, trainer):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

        self.console, self.trainer = console, trainer
        self.live = console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=24),
                                 TextColumn("{task.fields[status]}"), console=console, transient=False,
                                 disable=not self.live)
        self.task = None
        self._last_print = -1

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def _print(self, text: str) -> None:
        (self.progress.console if self.live else self.console).print(text, soft_wrap=True)

    def update(self, line: dict) -> None:
        from memplan.units import format_bytes, format_count, format_seconds

        kind = line.get("kind")
        if kind == "train":
            total = line.get("total_steps")
            pred = self.trainer.predicted["peak_reserved"]
            mem = line.get("memory_bytes")
            loss = "n/a" if line.get("loss") is None else f"{line['loss']:.4f}"
            status = (f"loss {loss} | {format_count(line['tokens_per_second'])} tok/s | MFU {line['mfu']:.1%} | "
                      f"mem {format_bytes(mem) if mem else '?'} (pred {format_bytes(pred)}) | "
                      f"ETA {format_seconds(line.get('eta_seconds'))}")
            if self.task is None:
                self.task = self.progress.add_task("train", total=total, completed=line["step"], status=status)
            self.progress.update(self.task, total=total, completed=line["step"], status=status)
            if not self.live and total:
                decile = line["step"] * 10 // total
                if decile != self._last_print:
                    self._last_print = decile
                    self._print(f"step {line['step']}/{total} {status}")
        elif kind == "eval":
            per = ", ".join(f"{k} {v:.3f}" for k, v in line.get("eval_loss_by_source", {}).items() if v is not None)
            ppl = line.get("eval_ppl")
            self._print(f"[bold]eval[/] step {line['step']}: held-out loss {line.get('eval_loss'):.4f}"
                        + (f" (perplexity {ppl:,.1f})" if ppl else "") + (f" — {per}" if per else ""))
            for s in line.get("samples", [])[:2]:
                self._print(f"  [dim]{s['prompt']!r} →[/] {s['text'][:160]!r}")
        elif kind == "event":
            ev = line.get("event")
            if ev == "oom":
                self._print(f"[yellow]out of memory[/] at step {line['step']}: micro-batch "
                            f"{line['previous']['micro_batch']} → {line['micro_batch']}, accumulation "
                            f"{line['previous']['grad_accum']} → {line['grad_accum']} (same global batch); "
                            "redoing the step")
            elif ev == "nonfinite":
                self._print(f"[yellow]non-finite loss[/] at step {line['step']} ({line['loss']}): update skipped "
                            f"({line['in_a_row']} in a row)")
            elif ev == "checkpoint":
                self._print(f"[dim]checkpoint {line['path']} ({line['seconds']:.1f} s)[/]")
            elif ev == "stop" and line.get("reason") == "interrupted":
                self._print("[yellow]interrupted[/]: checkpoint saved; continue with --resume")


def _final_sample(trainer) -> tuple[str, str] | None:
    """(prompt, continuation) of the trained model for the summary, or None without a prompt."""
    from trainer.sample import sample_text

    prompts = trainer.sample_prompts()
    if not prompts:
        return None
    return prompts[0], sample_text(trainer.model, trainer.tokenizer, prompts[0], 96, ctx=trainer.setup.ctx,
                                   seed=trainer.config.seed, precision=trainer.setup.precision)


def _print_summary(trainer, summary, sample) -> None:
    from rich.console import Console

    from memplan.units import format_bytes, format_count, format_seconds
    from trainer.loop import read_metrics

    lines = read_metrics(trainer.run_dir, latest=True)
    train = [l for l in lines if l.get("kind") == "train"]
    steady = train[1:] or train
    out = Console(highlight=False)
    reasons = {"max_steps": "reached --max-steps", "max_tokens": "reached --tokens", "max_minutes": "time limit",
               "epoch": "one epoch done", "interrupted": "interrupted"}
    out.print(f"[bold]Done[/]: {summary.step:,} steps, {format_count(summary.tokens)} tokens in "
              f"{format_seconds(summary.train_seconds)} ({reasons.get(summary.stop_reason, summary.stop_reason)})")
    if summary.last_eval:
        e = summary.last_eval
        per = ", ".join(f"{k} {v:.3f}" for k, v in e.get("eval_loss_by_source", {}).items() if v is not None)
        out.print(f"  held-out loss {e['eval_loss']:.4f}, perplexity {e['eval_ppl']:,.1f}" + (f" ({per})" if per else ""))
    if steady:
        import statistics

        meas = max((l["memory_bytes"] for l in steady if l.get("memory_bytes")), default=None)
        pred = trainer.predicted
        tps = statistics.median(l["tokens_per_second"] for l in steady)
        mfu = statistics.median(l["mfu"] for l in steady)
        if meas:
            out.print(f"  memory: measured peak {format_bytes(meas)}, predicted {format_bytes(pred['peak_reserved'])} "
                      f"({(pred['peak_reserved'] - meas) / meas:+.1%}); measured by {trainer.monitor.source}")
            if trainer.device.type == "cpu" and trainer.baseline_bytes:
                context = trainer.profile.runtime_context_bytes
                out.print(f"    (this process held {format_bytes(trainer.baseline_bytes)} before the model existed; "
                          f"the {trainer.profile.name} profile's runtime context is {format_bytes(context)})")
        out.print(f"  throughput: {tps:,.0f} tokens/s (median), predicted {pred['tokens_per_second']:,.0f}; "
                  f"MFU {mfu:.1%}")
    if summary.checkpoint:
        out.print(f"  checkpoint: {summary.checkpoint}")
    if summary.report:
        out.print(f"  report: {summary.report}")
    if sample is not None:
        out.print("[bold]Sample[/] (top-k 40, temperature 0.8):")
        out.print(printable(f"{sample[0]}{sample[1]}"), markup=False)


def _launch(click_ctx, nproc: int, data: str | None, out: str | None, resume: bool, console) -> None:
    """``memplan train --nproc N ...``: this command without --nproc in N processes started by
    torchrun's launcher (``python -m trainer`` in each, rank 0 printing). The embedded corpus is
    prepared and the run directory named here first, so every rank agrees on both."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = _argv_without(click_ctx, ("nproc", "data", "out"))
    plan = click_ctx.params.get("plan")
    if plan:  # refused here, before N processes start, rather than by each of them
        from memplan.plan import Plan

        world_size = Plan.load(plan).setup.world_size
        if world_size not in (1, nproc):
            raise InputError(f"the plan is for --world-size {world_size}; launch it with `memplan train --nproc "
                             f"{world_size}`")
    if not data and not resume:
        data = str(ensure_embedded_data(console))
    params = click_ctx.params
    if params.get("device") is None and not resume:  # calibrated here, alone, once: the ranks read the cache
        flags = [k for k in ("params", "model", "arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                             "tied", "batch", "grad_accum", "precision", "attention", "checkpointing",
                             "optimizer", "compile") if params.get(k) is not None]
        local_calibration(device_from(None, params.get("device_memory")), console,
                          measure_now=not params.get("plan") and not flags)
    if not out and not resume:
        out = str(Path("runs") / time.strftime("train-%Y%m%d-%H%M%S"))
    argv += [*(["--data", data] if data else []), *(["--out", out] if out else [])]
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "-m", "trainer", *argv])
    for name in list(logging.root.manager.loggerDict):  # the launcher's own chatter: the ranks speak for the run
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_BY_ENV] = "memplan"  # the ranks' errors read as this command's
    try:
        run(args)
    except ChildFailedError as e:
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        code = codes.get(0, next(iter(codes.values()), 1))
        if 0 not in codes:  # rank 0 said nothing about it
            console.print(f"memplan: training failed in rank(s) {', '.join(map(str, sorted(codes)))} "
                          f"(exit codes {', '.join(map(str, codes.values()))})", soft_wrap=True)
        raise typer.Exit(code if code > 0 else 1)


def _argv_without(click_ctx, names: tuple[str, ...]) -> list[str]:
    """The options this command was given on its command line (or environment), minus ``names``."""
    argv = []
    for p in click_ctx.command.params:
        if p.name in names or not getattr(p, "opts", None):
            continue
        source = click_ctx.get_parameter_source(p.name)
        if source is None or source.name not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value = click_ctx.params[p.name]
        if p.is_flag:
            if value:
                argv.append(p.opts[0])
            elif p.secondary_opts:
                argv.append(p.secondary_opts[0])
        elif p.multiple:
            for v in value:
                argv += [p.opts[0], str(v)]
        else:
            argv += [p.opts[0], str(value)]
    return argv


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab shown as U+FFFD (an undertrained model
    emits stray bytes; a terminal must not interpret them)."""
    import unicodedata

    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) != "Cc" else "\ufffd" for ch in text)


def _report_only(out: str | None, console) -> None:
    from trainer.loop import METRICS_FILE
    from trainer.run_report import write_run_report

    if not out:
        raise InputError("--report: name the run with --out RUN")
    if not (Path(out) / METRICS_FILE).is_file():
        raise InputError(f"--report: {out} has no {METRICS_FILE}; not a training run")
    path = write_run_report(out)
    print(path)
