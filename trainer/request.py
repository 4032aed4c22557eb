"""What ``memplan train`` will run, resolved from what it was asked: a ``TrainRequest`` (every flag as a
value) becomes a ``ResolvedTrain`` (the plan, the prepared data, the device profile, the run directory, the
weights it starts from) in ``resolve_train``. The quick start's model and corpus, the local calibration, the
plan of a checkpoint (``--from``), autotune, and the rescaling for N processes all happen here; the command
line only maps flags to the request and renders what this module says through a ``TrainUI``.

``memplan train --nproc N`` resolves its request here once, in the launching process (``nproc``: the plan is made
for N processes), and hands the run to its N ranks as a file: ``LaunchSpec``, written into RUN/launch.json
(``write_launch``) before torchrun starts them. Each rank (``python -m trainer RUN``) reads it back
(``read_launch``, checked as any input is) and builds its trainer from it (``resolve_launch``, ``start_trainer``):
no rank parses a command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

from memplan.errors import InputError
from memplan.memory.stacks import stack_class

QUICKSTART_MINUTES = 3.0  # `memplan train` alone trains this long
QUICKSTART_CTX = 256  # the embedded corpus's documents are short; 256 tokens hold most of one
# (ctx 128 trained to the same held-out loss in 1-minute trials; the quick start is not compiled: its model's
# first compiled step took 22 s, for steps 2.6% faster after, on a 2-core CPU)
# 1-minute trials of the quick start's model: 6e-3 ended far above 3e-3, 2e-3 beat 3e-3 (bpe:4096), and
# 1e-3..3e-3 were within the trials' noise at bpe:8192 (benchmarks/quickstart.py; 6e-4 is tuned for 125M)
QUICKSTART_LR = 2e-3
DEFAULT_CTX = 1024  # with MODEL flags, as the other commands
TOKENS_PER_PARAM = 20  # compute-optimal tokens per parameter (Hoffmann et al. 2022, Chinchilla)
# The quick start's rung: the largest of the ladder predicted to train on Chinchilla's tokens per parameter in
# its minutes, else the smallest rung. On a CPU no rung gets there (3 minutes buy ~1-2M tokens, 20 per parameter
# for a 50-100k-parameter model), so it is the smallest, 2 layers × 128: in 1-minute trials on a 2-core CPU
# 2×192 was within noise of it and 2×256, 4×128, 4×256 trained too few tokens and ended higher. The line printed
# says which case applied and the tokens per parameter predicted.
QUICKSTART_TOKENS_PER_PARAM = TOKENS_PER_PARAM
# The quick start's global batch is sized for at least this many steps: in 1-minute trials of its model the
# held-out loss fell steadily from 16k-token steps down to 512-token ones (2 sequences of 256) on a 2-core CPU.
QUICKSTART_MIN_STEPS = 1500
QUICKSTART_LAYERS = (2, 3, 4, 6, 8, 10, 12)  # the model ladder: hidden = 64·layers (memplan's size rule)
QUICKSTART_CALIBRATE_SECONDS = 15.0  # the quick start's first calibration of this machine (then cached)
MATMUL_PROBE = 1024  # side of the square fp32 matmul timed to rate the local device for the quick start
FROM_LR = 1e-4  # continued pretraining's default peak: well below a from-scratch run's 6e-4, as it starts trained
CALIBRATE_ATTEMPTS = 2  # the quick start measures again once when the first calibration is too noisy to keep


class TrainUI:
    """How resolving a run speaks: lines of text (rich markup allowed) and two progress displays, the local
    calibration's and the embedded corpus's preparation. This base says nothing and shows nothing (a library
    caller's); ``memplan train`` renders them with rich (``memplan.cli.train.RichUI``)."""

    def say(self, text: str, soft_wrap: bool = False) -> None:
        pass

    @contextlib.contextmanager
    def calibrating(self, what: str):
        """A progress display for a calibration: yields ``update(stage, done)``, done in [0, 1]."""
        yield lambda stage, done: None

    @contextlib.contextmanager
    def preparing(self):
        """A progress display for ``trainer.data.prepare``: yields its ``progress(stage, done, total)``."""
        yield lambda stage, done, total: None


@dataclass(frozen=True, kw_only=True)
class TrainRequest:
    """What ``memplan train`` was asked, flag by flag. ``model`` and ``setup`` hold MODEL and SETUP flags as
    typed (text, or None when not given: ``memplan.model.resolve`` / ``memplan.setup.setup_from_flags`` parse them);
    ``control`` and ``hyper`` are parsed already (``run_control_from``; lr, warmup_steps, min_lr_ratio,
    weight_decay, clip, seed)."""

    plan: str | None = None  # --plan FILE
    data: str | None = None
    out: str | None = None
    from_: str | None = None  # --from: a Hugging Face checkpoint (continued pretraining)
    resume: bool = False
    model: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    control: dict = field(default_factory=dict)
    hyper: dict = field(default_factory=dict)
    device: str | None = None
    device_memory: str | None = None
    threads: int | None = None
    sharding: str | None = None
    global_batch_tokens: int | None = None
    budget: str | None = None
    margin: float | None = None
    nproc: int = 1  # --nproc: resolved for this many processes (which this process will launch)
    stack: str | None = None  # --stack: whose model class trains (None: memplan's where it builds the family)


@dataclass
class ResolvedTrain:
    """The run ``resolve_train`` found: a new one (``plan``) or one to resume (``resume``, with the plan asked
    for if any), what it trains on and where, and what the command line is to say of its rates."""

    run_dir: Path
    prepared: object  # trainer.data.PreparedData
    profile: object  # memplan.hardware.Device, with this machine's calibration where it has one
    plan: object | None = None  # memplan.plan.Plan of a new run
    resume: bool = False
    resume_plan: object | None = None  # a resume's --plan / MODEL / SETUP, checked against the run's
    overrides: dict = field(default_factory=dict)  # run control
    hyper: dict = field(default_factory=dict)
    rates_note: str | None = None
    starting: object | None = None  # trainer.task.StartingWeights (--from)
    sharding: str | None = None
    config: object | None = None  # trainer.loop.TrainConfig of a new run, where already made (a rank's)


def train_config(run: ResolvedTrain):
    """The ``trainer.loop.TrainConfig`` a new run trains with: the run control and hyper-parameters asked for,
    and the plan's [training] settings where the request gives none (a plan reproduces its run)."""
    from memplan.plan import TRAINING_KEYS
    from trainer.loop import TrainConfig

    if run.config is not None:
        return run.config
    from_plan = {k: v for k, v in run.plan.training.items() if k in TRAINING_KEYS and run.hyper.get(k) is None}
    return TrainConfig(**{k: v for k, v in {**run.overrides, **run.hyper, **from_plan}.items() if v is not None})


def start_trainer(run: ResolvedTrain):
    """The ``trainer.loop.Trainer`` of the resolved run: a new one (``Trainer.start``) or one resumed."""
    from trainer.loop import Trainer

    if not run.resume:
        return Trainer.start(run.run_dir, run.plan, run.prepared, train_config(run), run.profile,
                             starting=run.starting)
    return Trainer.resume(run.run_dir, run.prepared, run.profile, plan=run.resume_plan,
                          overrides={**run.overrides, **run.hyper}, sharding=run.sharding)


def profile_for(device: str | None, device_memory: str | None, threads: int | None, ui: TrainUI,
                measure_now: bool) -> tuple[object, str | None]:
    """The device profile a run plans and measures against, and the line saying where its rates come from:
    ``--device`` (else this machine's), with this machine's calibration where it means the local device
    (``local_calibration``; ``measure_now``: the quick start measures it when none is cached); torch's threads
    set for it (``set_threads``)."""
    from memplan.hardware import device_from_flags
    from memplan.local import means_this_machine

    profile = device_from_flags(device, device_memory)
    rates_note = None
    if means_this_machine(device):  # the local device: plan with what it measured, where memplan has it
        profile, rates_note = local_calibration(profile, ui, measure_now=measure_now, threads=threads)
    set_threads(threads, profile)
    return profile, rates_note


def resolve_train(req: TrainRequest, ui: TrainUI) -> ResolvedTrain:
    """The run ``req`` asks for, every option checked before anything is written: an InputError otherwise."""
    from memplan.model import resolve as model_from
    from memplan.units import parse_count
    from trainer import distributed
    from trainer.data import PreparedData

    _, launched, _ = distributed.env_world()
    if req.nproc > 1:  # resolved here for the processes this one will launch
        launched = req.nproc
    plan, data, out, from_, resume = req.plan, req.data, req.out, req.from_, req.resume
    model_flags = {k: req.model.get(k) for k in MODEL_FLAGS}
    setup_flags = {k: req.setup.get(k) for k in SETUP_FLAGS}
    ctx, vocab = setup_flags["ctx"], model_flags["vocab"]
    given_model = any(v is not None for v in model_flags.values())
    given_setup = any(v is not None for k, v in setup_flags.items() if k != "ctx")
    if plan and (given_model or given_setup or ctx is not None):
        raise InputError("give --plan FILE or MODEL/SETUP options, not both")
    if plan:  # a plan for another stack's code: refused before any data is prepared
        memplan_plan(plan)
    if from_ is not None:
        if plan or given_model:
            raise InputError("--from: the checkpoint is the model; give --from or --plan / model options "
                             "(--params, --model, --layers, ...), not both")
        if resume:
            raise InputError("--from starts a run; --resume continues RUN from its own checkpoint (or, before the "
                             "first one, from the weights it recorded), so drop --from")
        if not data:
            raise InputError(f"--from {from_}: give --data DIR, a corpus prepared with the checkpoint's own "
                             f"tokenizer (`memplan prepare --input FILE --tokenizer {from_} --out DIR`)")
    overrides, hyper = dict(req.control), dict(req.hyper)
    quickstart = not plan and not given_model and not given_setup and not resume and from_ is None

    profile, rates_note = profile_for(req.device, req.device_memory, req.threads, ui, measure_now=quickstart)
    if plan and not resume:
        check_plan_device(plan, profile, req.device)
    if resume:
        if not out:
            raise InputError("--resume: name the run to continue with --out RUN")
        run_dir = Path(out)
        from trainer import rundir

        # the run its newest checkpoint, else its run.json, records (from step 0); else an InputError
        data_dir = Path(data) if data else rundir.recorded_data_path(run_dir)
        if not data and not (data_dir / "manifest.json").is_file():
            raise InputError(f"--resume: the run's prepared data {data_dir} is gone; give it with --data DIR")
        prepared = PreparedData(data_dir)
        asked = None
        if plan or given_model or given_setup or ctx is not None:
            asked = plan_from_flags(plan, model_flags, setup_flags, prepared, profile, ui, quiet=True)
        return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, resume=True, resume_plan=asked,
                             overrides=overrides, hyper=hyper, rates_note=rates_note, sharding=req.sharding)

    if from_ is not None:  # continued pretraining of a Hugging Face checkpoint: the checkpoint first, then the data
        from trainer.finetune import base_of_hf

        # spec and tokenizer now; the weights when the model is built
        imported = base_of_hf(from_, weights=False, stack=req.stack)
        return _resolve_from(ui, from_, imported, PreparedData(Path(data)), profile, setup_flags=setup_flags,
                             given_setup=given_setup, overrides=overrides, hyper=hyper, out=out, launched=launched,
                             sharding=req.sharding, global_batch_tokens=req.global_batch_tokens, budget=req.budget,
                             margin=req.margin, rates_note=rates_note)
    prepared = PreparedData(Path(data) if data else embedded_data_once(ui))
    minutes = overrides["max_minutes"]
    if quickstart and overrides["max_steps"] is None and overrides["max_tokens"] is None and minutes is None:
        minutes = overrides["max_minutes"] = QUICKSTART_MINUTES
    if quickstart and hyper["lr"] is None:
        hyper["lr"] = QUICKSTART_LR
    if given_model:
        check_vocab(vocab, prepared)
    spec = (model_from(**{**model_flags, "vocab": None}, stack_families=True).replace(vocab=prepared.vocab_size)
            if given_model else None)
    stack = _stack_for(req.stack, spec, plan, ui)
    if plan or given_setup:
        the_plan = plan_from_flags(plan, model_flags, setup_flags, prepared, profile, ui, spec=spec, stack=stack)
    else:
        ctx_n = parse_count(ctx, "--ctx", binary=True) if ctx is not None else (
            DEFAULT_CTX if given_model else QUICKSTART_CTX)
        the_plan = autotuned_plan(spec, ctx_n, prepared, profile, ui, minutes=minutes,
                                  max_steps=overrides["max_steps"], max_tokens=overrides["max_tokens"],
                                  global_batch_tokens=req.global_batch_tokens, budget=req.budget, margin=req.margin,
                                  world_size=launched, stack=stack)
    if launched > 1:  # every rank trains rank 0's plan (the quick start's is chosen on a timed matmul)
        the_plan = distributed.from_rank0(for_world(the_plan, launched, req.sharding, profile, ui))
    run_dir = Path(out) if out else distributed.from_rank0(Path("runs") / time.strftime("train-%Y%m%d-%H%M%S"))
    return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, plan=the_plan, overrides=overrides,
                         hyper=hyper, rates_note=rates_note)


def _stack_for(asked: str | None, spec, plan_path, ui) -> str:
    """The stack whose model class a new run trains (``trainer.hf_model.choose_stack``): ``--stack``, else memplan's
    own model where it builds the family, else transformers' (said in one line); a plan file's own."""
    from trainer.hf_model import choose_stack

    if plan_path:
        if asked is not None:
            raise InputError("--stack: a plan file names its stack in [setup]; give --plan FILE or --stack, not both")
        return "memplan"
    if spec is None:  # the quick start's model, or MODEL flags' defaults: memplan's llama family
        from memplan.setup import TRAIN_STACKS

        if asked is not None and asked not in TRAIN_STACKS:
            raise InputError(f"--stack: {asked!r} does not train here (accepted: {', '.join(TRAIN_STACKS)})")
        return asked or "memplan"
    stack, note = choose_stack(asked, spec)
    if note:
        ui.say(f"[dim]note: {note}[/dim]")
    return stack


MODEL_FLAGS = ("params", "model", "arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied",
               "dropout")
SETUP_FLAGS = ("ctx", "batch", "grad_accum", "precision", "attention", "checkpointing", "optimizer", "compile")


# ---- --from: a Hugging Face checkpoint -----------------------------------------------------------------

def _resolve_from(ui, from_: str, imported, prepared, profile, *, setup_flags, given_setup, overrides, hyper, out,
                  launched, sharding, global_batch_tokens, budget, margin, rates_note) -> "ResolvedTrain":
    """``memplan train --from CHECKPOINT``: the checkpoint's model (``imported``, read without its weights),
    planned (autotuned unless the setup is given) and trained on ``prepared`` from its weights; the corpus must
    have been prepared with its tokenizer."""
    from memplan.units import parse_count
    from trainer import distributed
    from trainer.task import starting_from_hf

    want, got = imported.tokenizer_record, prepared.manifest["tokenizer"]
    if (got.get("sha256"), got.get("eot_id"), prepared.vocab_size) != (want["sha256"], want["eot_id"],
                                                                        imported.spec.vocab):
        raise InputError(f"--data {prepared.path}: prepared with another tokenizer than {from_}'s own (or without "
                         f"its end-of-text id {want['eot_id']} and vocabulary of {imported.spec.vocab}); prepare "
                         f"it with `memplan prepare --input FILE --tokenizer {from_} --out DIR`")
    for note in imported.notes:
        ui.say(f"[dim]--from: {note}[/dim]")
    spec = imported.spec
    stack = "memplan" if imported.hf_config is None else "transformers"
    ctx = setup_flags["ctx"]
    ctx_n = parse_count(ctx, "--ctx", binary=True) if ctx is not None else min(imported.max_ctx, DEFAULT_CTX)
    if ctx_n > imported.max_ctx:
        raise InputError(f"--ctx {ctx_n}: {imported.path} computes as transformers does up to {imported.max_ctx} "
                         f"positions; use --ctx {imported.max_ctx} or less")
    if given_setup:
        the_plan = plan_from_flags(None, None, {**setup_flags, "ctx": str(ctx_n)}, prepared, profile, ui,
                                   spec=spec, stack=stack)
    else:
        the_plan = autotuned_plan(spec, ctx_n, prepared, profile, ui, minutes=overrides["max_minutes"],
                                  global_batch_tokens=global_batch_tokens, budget=budget, margin=margin,
                                  world_size=launched, max_steps=overrides["max_steps"],
                                  max_tokens=overrides["max_tokens"], stack=stack)
    if launched > 1:
        the_plan = distributed.from_rank0(for_world(the_plan, launched, sharding, profile, ui))
    if not stack_class(stack).trains_hf_model:
        starting = starting_from_hf(imported.path, spec, model_type=imported.model_type)
    else:  # transformers' model class: its tensors checked against the model config.json describes
        from trainer.task import starting_from_hf_stack

        starting = starting_from_hf_stack(imported.path, spec, the_plan.setup, imported.hf_config,
                                             model_type=imported.model_type)
    if hyper["lr"] is None:
        hyper["lr"] = FROM_LR
    run_dir = Path(out) if out else distributed.from_rank0(Path("runs") / time.strftime("train-%Y%m%d-%H%M%S"))
    return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, plan=the_plan, overrides=overrides,
                         hyper=hyper, rates_note=rates_note, starting=starting)


# ---- the plan ---------------------------------------------------------------------------------------------

def check_vocab(vocab: int | None, prepared) -> None:
    if vocab is not None and vocab != prepared.vocab_size:
        raise InputError(f"--vocab {vocab} conflicts with the prepared data's tokenizer ({prepared.vocab_size} tokens, "
                         f"{prepared.path}); for train the vocabulary comes from the data, so drop --vocab")


def best_precision(profile) -> str:
    """``Device.best_precision``: bf16-mixed where bf16 is native, else fp16-mixed, else fp32."""
    return profile.best_precision


def check_plan_device(plan_path: str, profile, device_arg: str | None) -> None:
    """A plan made for another device is refused: its micro-batch, precision and predictions were chosen for
    that device's memory and rates (a 4090's micro-batch 128 in bf16 takes half an hour a step on a CPU).
    ``--device`` naming the plan's own device trains it anyway, predicted against that profile."""
    from memplan.autotune import device_ref
    from memplan.plan import Plan

    made_for = Plan.load(plan_path).device
    if not made_for or made_for in (profile.name, device_ref(profile)):
        return
    if Path(made_for).is_file():  # a profile file (`memplan calibrate --out`): the device it describes
        from memplan.hardware import resolve_device

        try:
            if resolve_device(made_for).name == profile.name:
                return
        except InputError:
            pass
    here = profile.name if device_arg is None else f"--device {device_arg} ({profile.name})"
    raise InputError(f"--plan {plan_path} was made for {made_for}, not for {here}: re-plan with `memplan autotune "
                     f"MODEL --ctx N --out {plan_path}`" + (" (no --device: this machine)" if device_arg is None else
                                                          f" --device {device_arg}")
                     + f", or train this plan as it is with --device {made_for}")


def memplan_plan(plan_path):
    """The plan of ``--plan FILE``, or an InputError for one made for another stack's code (``autotune --stack
    transformers|litgpt|torchtune --out``), which that library trains."""
    from memplan.plan import Plan

    p = Plan.load(plan_path)
    if stack_class(p.stack).library:
        raise InputError(f"--plan {plan_path}: a plan for --stack {p.stack}, whose own code trains it (`memplan "
                         f"autotune --stack {p.stack} --emit DIR` writes its config); memplan train takes plans "
                         "for its own trainer (accepted: a plan of `memplan autotune --stack memplan --out FILE`)")
    return p


def plan_from_flags(plan_path, model_flags, setup_flags, prepared, profile, ui, quiet: bool = False,
                     spec=None, stack: str = "memplan"):
    """The plan of --plan FILE, or of MODEL and SETUP flags as given (no autotune); vocab from the data (``spec``:
    this model, an imported checkpoint's, instead of MODEL flags)."""
    from memplan.plan import Plan
    from memplan.setup import setup_from_flags as setup_from
    from memplan.prediction import predict

    if plan_path:
        p = memplan_plan(plan_path)
        if p.model.vocab != prepared.vocab_size:
            if not quiet:
                ui.say(f"[yellow]note[/]: the plan's model has vocab {p.model.vocab}; training with the data's "
                       f"{prepared.vocab_size} (predictions recomputed)")
            p = dataclasses.replace(p, model=p.model.replace(vocab=prepared.vocab_size), predicted={}, verified={})
    else:
        if spec is None:
            from memplan.model import resolve as model_from

            check_vocab(model_flags["vocab"], prepared)
            spec = model_from(**{**model_flags, "vocab": None}).replace(vocab=prepared.vocab_size)
        s = setup_flags
        precision = s["precision"] or best_precision(profile)
        setup = setup_from(ctx=s["ctx"] or str(DEFAULT_CTX), batch=s["batch"] or "1", grad_accum=s["grad_accum"] or "1",
                           precision=precision, attention=s["attention"] or "sdpa",
                           checkpointing=s["checkpointing"] or "none", optimizer=s["optimizer"] or "adamw",
                           compile=bool(s["compile"])).replace(stack=stack)
        from trainer.hf_model import check_stack_setup

        check_stack_setup(setup)
        if not s["precision"] and not quiet:
            ui.say(f"precision {precision}: the best the {profile.name} profile runs natively "
                   "(--precision to choose)")
        p = Plan(model=spec, setup=setup, device=profile.name, budget_bytes=profile.usable_bytes)
    if not p.predicted:
        p = dataclasses.replace(p, device=p.device or profile.name, budget_bytes=p.budget_bytes or profile.usable_bytes,
                                predicted=predict(p.model, p.setup, profile).plan_table())
    return p




def local_calibration(profile, ui: "TrainUI | None", measure_now: bool, threads: int | None = None):
    """``_local_calibration``, and where its rates are a one-thread CPU calibration timed by CPU time,
    its share of the core measured again now (``memplan.local.core_share_now``): the contention of the
    run about to start, not of the calibration's minute."""
    from memplan import local

    profile, note = _local_calibration(profile, ui, measure_now, threads)
    share = profile.calibrated.get("cpu_share") if profile.family == "cpu" else None
    if share and note and "nominal" not in note:
        profile, said = local.with_share_probes(profile, local.core_share_probes())
        note = f"{note}; {said}"
    return profile, note


def _local_calibration(profile, ui: "TrainUI | None", measure_now: bool, threads: int | None = None):
    """The local ``profile`` with what this machine measured (rates and runtime context): its cached
    calibration (``memplan.local``) with ``threads`` torch threads (default: the count calibration
    found fastest) if there is a trusted one; else, with ``measure_now`` (the quick start), a short
    calibration (QUICKSTART_CALIBRATE_SECONDS) run now in a process of its own, and cached if its
    timings are steady enough to trust (measured again once if not; a noisy one is used for this run
    only, its spread printed); else the profile as it is. Returns the profile and a line saying
    where its rates come from (printed once the run's options are all accepted, so that an error
    stays one line)."""
    from memplan import local

    if profile.calibrated:
        return profile, None
    family = profile.family
    cached = local.find_calibration(family, threads)
    if cached is not None:
        return cached.applied(profile), cached.note()
    noisy = local.find_noisy_calibration(family, threads)
    if not measure_now and noisy is not None:
        return local.context_only(profile, noisy)
    if not measure_now:
        return profile, ("[dim]rates: the profile's nominal figures; `memplan train` measures this machine once "
                         "(predictions of time are far closer afterwards)[/]")
    local.require_cache("the quick start keeps this machine's calibration there")  # before measuring, not after
    measured = []  # each in a temporary file, removed below
    started = time.perf_counter()  # the whole of it: start-up, the thread trial, the measurements, a second attempt
    try:
        for attempt in range(CALIBRATE_ATTEMPTS):
            try:
                measured.append(calibrate_in_child(profile.name, threads, ui or TrainUI(), again=attempt > 0))
            except RuntimeError as e:
                if measured:
                    break
                return profile, f"[yellow]rates: the profile's nominal figures[/] ({e})"
            if measured[-1].trusted:
                break
        best = min(measured, key=lambda c: c.noise)
        took = calibration_took(time.perf_counter() - started, len(measured))
        title = local.local_title(family)
        version = local.torch_version()
        path = local.calibration_path(family, title, best.threads, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        from memplan.fsutil import write_atomic as write_atomically  # the old file survives any failure

        if threads is None:  # the thread count it found fastest (steps interleaved) is this machine's default
            seconds = best.calibrated.get("thread_seconds", {})
            write_atomically(local.threads_path(family, title, version),
                             "# the torch thread count `memplan train` measured fastest here\n"
                             f"threads = {best.threads}\n"
                             + "".join(f"seconds_{n}t = {v:.6g}\n" for n, v in seconds.items()))
        if not best.trusted:  # kept apart, for its runtime memory only: never as this machine's rates
            write_atomically(local.noisy_path(path), best.path.read_text())
            return best.applied(profile), (
                f"{best.note()} — [yellow]too noisy to keep[/] (other processes competed for the CPU): time "
                f"predictions are uncertain by about ±{best.noise:.0%}; the next run measures again ({took})")
        write_atomically(path, best.path.read_text())
        local.noisy_path(path).unlink(missing_ok=True)
    finally:
        for cal in measured:
            cal.path.unlink(missing_ok=True)
    kept = local.read_calibration(path)
    return kept.applied(profile), f"{kept.note()} ({took}; kept)"


def calibration_took(seconds: float, attempts: int) -> str:
    """How long measuring this machine took, all of it (the README's 15 s are the measurements alone)."""
    return (f"measured now in {seconds:.0f} s: {QUICKSTART_CALIBRATE_SECONDS:g} s of measurements"
            + (f" × {attempts} attempts" if attempts > 1 else "") + ", the thread trial and torch's start-up")


def set_threads(threads: int | None, profile) -> int:
    """torch's CPU threads for this run: --threads, else those the profile's rates were measured with,
    else the count this machine's calibration chose, else torch's default."""
    import torch

    from memplan.local import chosen_threads

    n = threads or int(profile.calibrated.get("threads", 0) or 0) or chosen_threads("cpu")
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def calibrate_in_child(name: str, threads: int | None, ui: "TrainUI", again: bool = False):
    """A calibration of QUICKSTART_CALIBRATE_SECONDS in a fresh process (``python -m trainer.calibrate``) that
    loads the modules of memplan this process has loaded (for its runtime context), with a progress bar; returns it as a ``memplan.local.LocalCalibration`` read from a temporary file."""
    import json
    import subprocess
    import tempfile

    from memplan import local

    tmp = Path(tempfile.mkstemp(prefix="memplan-calibration-", suffix=".toml")[1])
    # the baseline is measured in a process that loaded what this one (the training process) has of memplan:
    # its command line when `memplan train` runs it
    loaded = sorted(m for m in sys.modules if m == "memplan" or m.startswith("memplan."))
    args = [sys.executable, "-m", "trainer.calibrate", str(QUICKSTART_CALIBRATE_SECONDS), str(tmp), name,
            str(threads or ""), ",".join(loaded)]
    what = "measuring this machine" + (" again" if again else "")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # this checkout importable in the child, as in this process
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with ui.calibrating(what) as progress:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "stage" in msg:
                progress(msg["stage"], msg["done"])
        err = proc.stderr.read()
        proc.wait()
    cal = local.read_calibration(tmp) if proc.returncode == 0 else None
    if cal is None:
        tmp.unlink(missing_ok=True)
        tail = [ln for ln in err.strip().splitlines() if ln.strip()]
        raise RuntimeError(f"calibrating this machine failed (exit {proc.returncode})"
                           + (f": {tail[-1][:300]}" if tail else ""))
    return cal


def measured_matmul_rate(seconds: float = 0.5) -> float:
    """FLOP/s of a square fp32 matmul on the local torch device (a quick rate for the quick start's model choice)."""
    import torch

    from trainer.device import torch_device_for

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
    """The quick start's model: the largest of the ladder (hidden = 64·layers) that memplan predicts
    trains on at least QUICKSTART_TOKENS_PER_PARAM × params tokens within ``minutes`` (tokens/s at
    micro-batch 8, with the local matmul rate: the profile's calibrated one, else one measured now),
    else the ladder's smallest rung. Returns (spec, predicted tokens/s, matmul FLOP/s, whether a rung
    met the rule)."""
    from memplan.model import ModelSpec, _round_up
    from memplan.setup import TrainSetup
    from memplan.timing import step_time

    if profile.calibrated.get("matmul_tflops", {}).get("fp32"):
        rated, rate = profile, profile.calibrated["matmul_tflops"]["fp32"] * 1e12
    else:
        rate = measured_matmul_rate()
        rated = profile.replace(calibrated={**profile.calibrated, "matmul_tflops": {
            **profile.calibrated.get("matmul_tflops", {}), "fp32": rate / 1e12}})
    chosen, met = None, False
    for layers in QUICKSTART_LAYERS:
        hidden = 64 * layers
        spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=hidden // 64,
                         ffn=_round_up(8 * hidden / 3, 256), vocab=vocab, tied=True,
                         name=f"quickstart-{layers}x{hidden}",
                         source="memplan's rule: hidden = 64·layers, ffn = 8/3·hidden")
        setup = TrainSetup(ctx=ctx, micro_batch=8, precision=best_precision(profile))
        tps = step_time(spec, setup, rated).tokens_per_second
        meets = tps * minutes * 60 >= QUICKSTART_TOKENS_PER_PARAM * spec.params
        if chosen is None or meets:
            chosen, met = (spec, tps), meets
    return chosen[0], chosen[1], rate, met


def quickstart_model_line(spec, tps: float, rate: float, met: bool, minutes: float) -> str:
    """What the quick start says of its model choice: the rule it applied and the tokens predicted."""
    from memplan.units import format_count

    tokens = tps * minutes * 60
    why = (f"the largest of memplan's ladder predicted to train on ≥ {QUICKSTART_TOKENS_PER_PARAM:g} tokens per "
           "parameter" if met else "the smallest of memplan's ladder (none is predicted to train on "
           f"{QUICKSTART_TOKENS_PER_PARAM:g} tokens per parameter in that time)")
    return (f"Model for a {minutes:g}-minute run: [bold]{spec.describe()}[/] — {why}: ~{format_count(tokens)} "
            f"tokens ({tokens / spec.params:.1f} per parameter) at ~{format_count(tps)} tokens/s predicted "
            f"(local matmul measured at {rate / 1e9:,.0f} GFLOP/s)")


def for_world(plan, world_size: int, sharding: str | None, profile, ui: "TrainUI"):
    """``plan`` as trained by ``world_size`` processes: a plan for one process runs its micro-batch and
    accumulation in every rank (a global batch ``world_size`` times larger); ``sharding`` (else the
    plan's, else ddp) chooses DDP or FSDP2. Predictions are recomputed for what changed."""
    from memplan.plan import Plan
    from memplan.prediction import predict

    s = plan.setup
    if s.world_size not in (1, world_size):
        raise InputError(f"the plan is for --world-size {s.world_size} but {world_size} processes were launched; "
                         f"launch it with `memplan train --nproc {s.world_size}`")
    chosen = sharding or (s.sharding if s.sharding != "none" else "ddp")
    if s.world_size == world_size and s.sharding == chosen:
        return plan
    if s.world_size == 1:
        ui.say(f"[yellow]note[/]: the plan is for one process; each of the {world_size} ranks runs its "
               f"micro-batch {s.micro_batch} × {s.grad_accum} accumulation, so a step is {world_size}× "
               f"the plan's global batch ({chosen})")
    setup = s.replace(world_size=world_size, sharding=chosen)
    from trainer.hf_model import check_stack_setup

    check_stack_setup(setup)  # FSDP2 does not wrap transformers' model class here
    return Plan(model=plan.model, setup=setup, device=plan.device, budget_bytes=plan.budget_bytes,
                predicted=predict(plan.model, setup, profile).plan_table())


def autotuned_plan(spec, ctx, prepared, profile, ui: "TrainUI", *, minutes, global_batch_tokens, budget, margin,
                   world_size: int = 1, max_steps: int | None = None, max_tokens: int | None = None,
                   stack: str = "memplan"):
    """autotune's plan for ``spec`` (None: the quick start's model, sized for ``minutes`` on this device);
    a plan that compiles is weighed again against the tokens this run will train."""
    from memplan.units import parse_size

    try:
        from memplan.autotune import autotune
    except ImportError:
        raise InputError("planning needs memplan.autotune, which this build of memplan lacks; give --plan FILE or "
                         "the setup yourself (e.g. --params 22m --batch 8 --ctx 256)") from None
    if spec is None:
        minutes = minutes or QUICKSTART_MINUTES  # with a step or token limit instead, size it for the default
        spec, tps, rate, met = quickstart_model(prepared.vocab_size, profile, minutes, ctx)
        ui.say(quickstart_model_line(spec, tps, rate, met, minutes), soft_wrap=True)
        if global_batch_tokens is None:  # small steps, so the run gets QUICKSTART_MIN_STEPS or more
            steps_tokens = tps * minutes * 60 / QUICKSTART_MIN_STEPS
            global_batch_tokens = max(ctx, min(1 << 19, ctx * 2 ** max(0, int(math.log2(max(1, steps_tokens / ctx))))))
    kw = dict(ctx=ctx, global_batch_tokens=global_batch_tokens,
              budget_bytes=parse_size(budget, "--budget") if budget else None, margin=margin, world_size=world_size)
    if stack_class(stack).library:  # every candidate walked as transformers' model class runs (memplan.memory.stacks)
        from memplan.memory.stacks import stack_for

        kw["stack"] = stack_for(stack)
    result = autotune(spec, profile, tokens=None, **kw)
    if result.plan is not None and result.plan.setup.compile:
        # torch.compile's compile time is a one-off: weigh it against the tokens this run will train (its limit,
        # or what the fastest plan trains in its time), so a short run stays eager
        p = result.plan.predicted
        run = [t for t in (max_tokens, max_steps * result.plan.setup.tokens_per_step * world_size if max_steps else None,
                           int(p["tokens_per_second"] * minutes * 60) if minutes else None) if t]
        if run:
            result = autotune(spec, profile, tokens=min(run), **kw)
    if result.plan is None:
        advice = "; ".join(getattr(result, "advice", None) or ["try a smaller model or a shorter --ctx"])
        raise InputError(f"nothing fits {profile.name} for {spec.describe()} at ctx {ctx}: {advice}")
    if stack_class(stack).library:  # the plan trains that stack's model class, and is predicted as it runs
        from memplan.prediction import predict

        setup = result.plan.setup.replace(stack=stack, compile=False)
        return dataclasses.replace(result.plan, setup=setup, predicted=predict(spec, setup, profile).plan_table())
    return result.plan


# ---- the embedded corpus -------------------------------------------------------------------------------------

def embedded_data_dir() -> Path:
    """Where the embedded corpus is prepared: per Python version (its docstrings are the corpus)."""
    from trainer.data import DEFAULT_TOKENIZER_EMBEDDED

    version = ".".join(map(str, sys.version_info[:3]))
    from memplan.local import cache_dir

    return cache_dir() / "data" / f"embedded-py{version}-{DEFAULT_TOKENIZER_EMBEDDED.replace(':', '')}"


def embedded_data_once(ui: "TrainUI") -> Path:
    """The embedded corpus; under torchrun rank 0 prepares it while the others wait."""
    from trainer import distributed

    rank, world_size, _ = distributed.env_world()
    if world_size == 1:
        return ensure_embedded_data(ui)
    out = ensure_embedded_data(ui) if rank == 0 else embedded_data_dir()
    distributed.barrier()
    return out


def ensure_embedded_data(ui: "TrainUI | None" = None) -> Path:
    """The embedded corpus, prepared into the cache on first use (as `memplan prepare` with no --input)."""
    from trainer import data

    out = embedded_data_dir()
    if data.is_prepared(out):
        return out
    from memplan.local import require_cache

    require_cache("the quick start prepares its corpus there")
    ui = ui or TrainUI()
    ui.say(f"Preparing the embedded corpus (CPython's documentation) into {out} — once")
    config = data.PrepareConfig(tokenizer=data.DEFAULT_TOKENIZER_EMBEDDED)
    with ui.preparing() as progress:
        data.prepare(data.embedded_sources(), out, config, progress=progress)
    return out


# ---- memplan train --nproc: the run, resolved once, handed to each rank ------------------------------------

LAUNCH_FORMAT = "memplan-launch"
LAUNCH_VERSION = 1
MAX_LAUNCH_BYTES = 4 << 20  # a plan, its settings and a few prompts: KiB; anything near this is not ours


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """RUN/launch.json: what ``memplan train --nproc N`` resolved, for each of its ranks to build its trainer
    from (docs/run-directory.md). A new run carries its plan (made for N processes) and its whole
    ``TrainConfig``; a resume carries what the command line asked of the run (a plan to check against it, the
    settings it replaces), the run itself being in RUN. The device profile is named as it was asked
    (``device``, ``device_memory``): each rank derives it again as the launcher did, reading the calibration
    the launcher measured or found (``profile_for``)."""

    resume: bool
    data: str  # the prepared corpus
    plan: dict | None  # Plan.to_dict(): a new run's plan; a resume's --plan / MODEL / SETUP, or None
    config: dict | None  # a new run's TrainConfig.to_dict(); None for a resume
    overrides: dict  # a resume: run control and hyper-parameters given (None: not given); {} for a new run
    sharding: str | None  # ddp | fsdp, or None (the plan's, else the run's, else ddp)
    device: str | None  # --device as given (None: this machine)
    device_memory: str | None
    threads: int | None
    starting: dict | None  # --from: {path, model_type, weights_sha256} of the checkpoint the run starts from
    log: list  # --log: the loggers besides metrics.jsonl
    nproc: int  # the processes it was resolved for
    rates_note: str | None = None  # where the profile's rates came from, as the launcher found them

    def to_json(self) -> dict:
        return {"format": LAUNCH_FORMAT, "version": LAUNCH_VERSION, "kind": "train",
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_json(cls, obj, where: str) -> "LaunchSpec":
        """The spec of a parsed launch.json, every field checked (its type here; the plan, the settings and the
        loggers by what builds them, in ``resolve_launch``); an InputError naming ``where`` otherwise."""
        from trainer.records import check_value, field_values

        if not isinstance(obj, dict) or obj.get("format") != LAUNCH_FORMAT:
            raise InputError(f"{where}: not a memplan launch file (format {LAUNCH_FORMAT!r})")
        if obj.get("version") != LAUNCH_VERSION:
            raise InputError(f"{where}: launch file version {obj.get('version')!r}; this memplan reads "
                             f"{LAUNCH_VERSION}")
        if obj.get("kind") != "train":
            raise InputError(f"{where}: kind {obj.get('kind')!r}; accepted: train, finetune")
        spec = cls(**field_values(cls, obj, lambda name: f"{where}: {name!r}",
                                  lambda name: f"{where}: no {name!r}; write it again with `memplan train --nproc N`"))
        if spec.sharding not in (None, "ddp", "fsdp"):
            raise InputError(f"{where}: 'sharding' is {spec.sharding!r}; accepted: ddp, fsdp or null")
        if spec.nproc < 1 or (spec.threads is not None and spec.threads < 1):
            raise InputError(f"{where}: 'nproc' and 'threads' must be 1 or more")
        if spec.resume != (spec.config is None):
            raise InputError(f"{where}: a new run carries its 'config', a resume none")
        if not spec.resume and spec.plan is None:
            raise InputError(f"{where}: a new run without its 'plan'")
        for name in spec.log:
            check_value(name, str, f"{where}: 'log'")
        if spec.starting is not None:
            for key in ("path", "model_type", "weights_sha256"):
                check_value(spec.starting.get(key), str, f"{where}: 'starting'[{key!r}]")
        return spec


def launch_spec(run: ResolvedTrain, req: TrainRequest, log: list[str]) -> LaunchSpec:
    """The ``LaunchSpec`` of ``run``, resolved from ``req`` for ``req.nproc`` processes."""
    if run.resume:
        plan, config, overrides = (run.resume_plan.to_dict() if run.resume_plan is not None else None), None, \
            _jsonable({**run.overrides, **run.hyper})
    else:
        plan, config, overrides = run.plan.to_dict(), train_config(run).to_dict(), {}
    return LaunchSpec(resume=run.resume, data=str(Path(run.prepared.path).resolve()), plan=plan, config=config,
                      overrides=overrides, sharding=req.sharding, device=req.device, device_memory=req.device_memory,
                      threads=req.threads, starting=run.starting.record if run.starting is not None else None,
                      log=list(log), nproc=req.nproc, rates_note=run.rates_note)


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def check_launch_target(req: TrainRequest) -> None:
    """Before anything is resolved or said: the run directory ``req`` names is free for a new run (a launch file
    of a launch that never began aside), or holds a run to resume; an InputError otherwise. (``write_launch``
    checks again, holding the run's lock.)"""
    from trainer import rundir
    from trainer.checkpoint_policy import check_run_dir_free

    if req.out is None:
        return
    if req.resume:
        rundir.resume_source(req.out)
    else:
        check_run_dir_free(Path(req.out))


def write_launch(run_dir: Path, spec: LaunchSpec) -> Path:
    """RUN/launch.json for the ranks, written atomically (an exclusive temporary file beside it, renamed) while
    this process holds the run's lock, after the run directory was checked: free for a new run (a launch file
    of an earlier launch that never started aside), holding a run for a resume. An InputError otherwise, and
    nothing written."""
    import json

    from memplan.fsutil import write_atomic
    from trainer import rundir
    from trainer.checkpoint_policy import check_run_dir_free

    lock = rundir.lock_run(run_dir)
    try:
        if spec.resume:
            rundir.resume_source(run_dir)
        else:
            check_run_dir_free(run_dir)
        path = run_dir / rundir.LAUNCH_FILE
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise InputError(f"--out {run_dir}: its {rundir.LAUNCH_FILE} is not a regular file; refusing to "
                             "write through it")
        try:
            write_atomic(path, json.dumps(spec.to_json(), indent=1, allow_nan=False) + "\n", fsync=True)
        except OSError as e:
            raise InputError(f"--out {run_dir}: cannot write {rundir.LAUNCH_FILE} ({e.strerror or e})") from None
    finally:
        lock.release()
    return path


def read_launch(run_dir: str | Path) -> LaunchSpec:
    """RUN/launch.json of ``memplan train --nproc``, checked; an InputError naming the file and what is wrong
    with it."""
    obj, path = read_launch_object(run_dir)
    return LaunchSpec.from_json(obj, str(path))


def read_launch_object(run_dir: str | Path) -> tuple[object, Path]:
    """RUN/launch.json parsed (at most MAX_LAUNCH_BYTES, no NaN), and its path; what it holds is checked by the
    reader of its kind (``LaunchSpec``, ``trainer.finetune_request.FinetuneLaunch``)."""
    import json

    from trainer import rundir

    run_dir = Path(run_dir)
    path = run_dir / rundir.LAUNCH_FILE
    if not run_dir.is_dir():
        raise InputError(f"python -m trainer {run_dir}: no such run directory; `memplan train --nproc N --out "
                         f"{run_dir} ...` prepares and launches one")
    if path.is_symlink() or not path.is_file():
        raise InputError(f"{path}: missing (or not a regular file); `memplan train --nproc N --out {run_dir} ...` "
                         "writes it and launches the ranks")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_LAUNCH_BYTES + 1)
    except OSError as e:
        raise InputError(f"{path}: unreadable ({e.strerror or e})") from None
    if len(raw) > MAX_LAUNCH_BYTES:
        raise InputError(f"{path}: larger than {MAX_LAUNCH_BYTES >> 20} MiB; not a launch file memplan wrote")

    def refuse(text):
        raise ValueError(f"{text} is not a number JSON holds")

    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=refuse,
                         parse_float=lambda t: float(t) if math.isfinite(float(t)) else refuse(t))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:120]}); not a launch file memplan "
                         "wrote") from None
    return obj, path


def resolve_launch(spec: LaunchSpec, run_dir: str | Path, ui: TrainUI) -> ResolvedTrain:
    """The run a rank trains: ``spec`` (read from RUN/launch.json) with its profile derived again, its data
    opened, its plan and settings checked by what builds them. Nothing here measures, autotunes or parses a
    command line: the launcher did that."""
    from memplan.plan import Plan
    from trainer import rundir
    from trainer.data import PreparedData
    from trainer.loggers import check_loggers
    from trainer.loop import TrainConfig
    from trainer.task import starting_from_hf

    run_dir = Path(run_dir)
    where = str(run_dir / rundir.LAUNCH_FILE)
    check_loggers(spec.log, run_dir)
    profile, _ = profile_for(spec.device, spec.device_memory, spec.threads, ui, measure_now=False)
    data = Path(spec.data)
    if not (data / "manifest.json").is_file():
        raise InputError(f"{where}: the prepared data {data} is gone; launch the run again with --data DIR")
    prepared = PreparedData(data)
    try:
        plan = Plan.from_dict(spec.plan, f"{where}: plan") if spec.plan is not None else None
    except InputError as e:  # named by the file, also where the plan's own check names the flag it mirrors
        raise (e if str(e).startswith(where) else InputError(f"{where}: plan: {e}")) from None
    if spec.resume:
        overrides = _checked_settings(spec.overrides, where, "overrides", partial=True)
        return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, resume=True, resume_plan=plan,
                             overrides=overrides, rates_note=spec.rates_note, sharding=spec.sharding)
    config = TrainConfig(**_checked_settings(spec.config, where, "config"))
    starting = None
    if spec.starting is not None and stack_class(plan.setup.stack).trains_hf_model:  # transformers' class
        from trainer import hf_model
        from trainer.task import starting_from_hf_stack

        starting = starting_from_hf_stack(Path(spec.starting["path"]), plan.model, plan.setup,
                                             hf_model.check_config(spec.starting.get("config"), f"{where}: 'starting'"),
                                             model_type=spec.starting["model_type"],
                                             recorded_sha256=spec.starting["weights_sha256"])
    elif spec.starting is not None:
        starting = starting_from_hf(Path(spec.starting["path"]), plan.model, model_type=spec.starting["model_type"],
                                    recorded_sha256=spec.starting["weights_sha256"])
    return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, plan=plan, rates_note=spec.rates_note,
                         starting=starting, sharding=spec.sharding, config=config)


def _checked_settings(settings: dict, where: str, key: str, partial: bool = False) -> dict:
    """``settings`` (TrainConfig fields by name) with each value's type checked against the field's, and the whole
    checked by TrainConfig's own rules; ``partial``: None means not given. An InputError naming ``where``."""
    from trainer.loop import TrainConfig
    from trainer.records import check_value

    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for name, value in settings.items():
        if name not in hints:
            raise InputError(f"{where}: {key} {name!r} is not a training setting")
        if value is None and partial:
            out[name] = None
            continue
        if name == "prompts":
            check_value(value, list, f"{where}: {key} 'prompts'")
            for prompt in value:
                check_value(prompt, str, f"{where}: {key} 'prompts'")
            value = tuple(value)
        else:
            check_value(value, hints[name], f"{where}: {key} {name!r}")
        out[name] = value
    try:
        TrainConfig(**{k: v for k, v in out.items() if v is not None})
    except InputError as e:
        raise InputError(f"{where}: {key}: {e}") from None
    return out
