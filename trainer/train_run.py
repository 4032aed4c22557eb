"""Resolving a ``memplan train`` run, and its launch file: a ``TrainRequest`` (every option as a typed value)
becomes a ``ResolvedTrain`` (the plan, the prepared data, the device profile, the run directory, the weights it
starts from) in ``resolve_train``, one path per kind of run (a resume, ``--from``, a new run). The planning is
``memplan.planning``'s and the calibration cache ``memplan.local_calibration``'s; this module adds what needs
torch or the trainer (the timed matmul, the calibration's child process, the embedded corpus, the checkpoint
``--from`` names). The command line only builds the request and renders what this module says through a
``TrainUI``.

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

from memplan.planning import (DEFAULT_CTX, QUICKSTART_CTX, QUICKSTART_LR, QUICKSTART_MINUTES, SetupAsked,
                              autotuned_plan, check_plan_device, check_vocab, for_world, memplan_plan,
                              plan_from_flags)

MATMUL_PROBE = 1024  # side of the square fp32 matmul timed to rate the local device for the quick start
FROM_LR = 1e-4  # continued pretraining's default peak: well below a from-scratch run's 6e-4, as it starts trained


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
    """What ``memplan train`` was asked, option by option, typed: ``model`` holds the MODEL options as
    ``memplan.model.resolve`` takes them (None: not given), ``setup`` the SETUP options parsed
    (``memplan.planning.SetupAsked``), ``control`` the run control as ``TrainConfig`` fields
    (``memplan.cli.options.run_control_from``) and ``hyper`` the hyper-parameters (lr, warmup_steps,
    min_lr_ratio, weight_decay, clip, seed); None where not given."""

    plan: str | None = None  # --plan FILE
    data: str | None = None
    out: str | None = None
    from_: str | None = None  # --from: a Hugging Face checkpoint (continued pretraining)
    resume: bool = False
    model: dict = field(default_factory=dict)
    setup: SetupAsked = SetupAsked()
    control: dict = field(default_factory=dict)
    hyper: dict = field(default_factory=dict)
    device: str | None = None  # --device as given (a profile name or TOML; None: this machine)
    device_memory: str | None = None  # as given: parsed where the profile is made, here and in each rank
    threads: int | None = None
    sharding: str | None = None
    global_batch_tokens: int | None = None
    budget_bytes: int | None = None  # --budget
    margin: float | None = None
    nproc: int = 1  # --nproc: resolved for this many processes (which this process will launch)
    stack: str | None = None  # --stack: whose model class trains (None: memplan's where it builds the family)

    @property
    def model_given(self) -> bool:
        return any(v is not None for v in self.model.values())


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
    """The run ``req`` asks for, every option checked before anything is written: an InputError otherwise.
    A resume, a continued pretraining (``--from``) or a new run, each resolved by its own function."""
    check_request(req)
    quickstart = is_quickstart(req)
    profile, rates_note = profile_for(req.device, req.device_memory, req.threads, ui, measure_now=quickstart)
    if req.plan and not req.resume:
        check_plan_device(req.plan, profile, req.device)
    if req.resume:
        return _resolve_resume(req, profile, rates_note, ui)
    if req.from_ is not None:
        return _resolve_from(req, profile, rates_note, ui)
    return _resolve_new(req, profile, rates_note, ui, quickstart)


def check_request(req: TrainRequest) -> None:
    """The refusals of options that do not go together, before any device, data or model is looked at."""
    if req.plan and (req.model_given or req.setup.given or req.setup.ctx is not None):
        raise InputError("give --plan FILE or MODEL/SETUP options, not both")
    if req.plan:  # a plan for another stack's code: refused before any data is prepared
        memplan_plan(req.plan)
    if req.from_ is not None:
        if req.plan or req.model_given:
            raise InputError("--from: the checkpoint is the model; give --from or --plan / model options "
                             "(--params, --model, --layers, ...), not both")
        if req.resume:
            raise InputError("--from starts a run; --resume continues RUN from its own checkpoint (or, before the "
                             "first one, from the weights it recorded), so drop --from")
        if not req.data:
            raise InputError(f"--from {req.from_}: give --data DIR, a corpus prepared with the checkpoint's own "
                             f"tokenizer (`memplan prepare --input FILE --tokenizer {req.from_} --out DIR`)")


def is_quickstart(req: TrainRequest) -> bool:
    """`memplan train` with nothing to say what to train: the quick start's model, corpus, minutes."""
    return (not req.plan and not req.model_given and not req.setup.given and not req.resume
            and req.from_ is None)


def _launched(req: TrainRequest) -> int:
    """The processes the run trains in: ``--nproc`` (resolved here for those this one will launch), else
    torchrun's."""
    from trainer import distributed

    return req.nproc if req.nproc > 1 else distributed.env_world()[1]


def _resolve_resume(req: TrainRequest, profile, rates_note, ui: TrainUI) -> ResolvedTrain:
    """``--resume``: the run in --out, on its recorded data (or --data), with the plan asked for if any (checked
    against the run's when it resumes)."""
    from trainer import rundir
    from trainer.data import PreparedData
    from trainer.hf_model import check_stack_setup

    if not req.out:
        raise InputError("--resume: name the run to continue with --out RUN")
    run_dir = Path(req.out)
    # the run its newest checkpoint, else its run.json, records (from step 0); else an InputError
    data_dir = Path(req.data) if req.data else rundir.recorded_data_path(run_dir)
    if not req.data and not (data_dir / "manifest.json").is_file():
        raise InputError(f"--resume: the run's prepared data {data_dir} is gone; give it with --data DIR")
    prepared = PreparedData(data_dir)
    asked = None
    if req.plan or req.model_given or req.setup.given or req.setup.ctx is not None:
        asked = plan_from_flags(req.plan, req.model, req.setup, prepared, profile, say=ui.say, quiet=True,
                                check_setup=check_stack_setup)
    return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, resume=True, resume_plan=asked,
                         overrides=dict(req.control), hyper=dict(req.hyper), rates_note=rates_note,
                         sharding=req.sharding)


def _resolve_new(req: TrainRequest, profile, rates_note, ui: TrainUI, quickstart: bool) -> ResolvedTrain:
    """A new run of --plan, of MODEL and SETUP options, or autotuned (the quick start: its model, its minutes,
    its learning rate, the embedded corpus)."""
    from trainer.data import PreparedData
    from trainer.hf_model import check_stack_setup

    overrides, hyper = dict(req.control), dict(req.hyper)
    prepared = PreparedData(Path(req.data) if req.data else embedded_data_once(ui))
    minutes = overrides["max_minutes"]
    if quickstart and overrides["max_steps"] is None and overrides["max_tokens"] is None and minutes is None:
        minutes = overrides["max_minutes"] = QUICKSTART_MINUTES
    if quickstart and hyper["lr"] is None:
        hyper["lr"] = QUICKSTART_LR
    spec = None
    if req.model_given:
        from memplan.model import resolve as model_from

        check_vocab(req.model.get("vocab"), prepared)
        spec = model_from(**{**req.model, "vocab": None}, stack_families=True).replace(vocab=prepared.vocab_size)
    stack = _stack_for(req.stack, spec, req.plan, ui)
    if req.plan or req.setup.given:
        the_plan = plan_from_flags(req.plan, req.model, req.setup, prepared, profile, say=ui.say, spec=spec,
                                   stack=stack, check_setup=check_stack_setup)
    else:
        ctx = req.setup.ctx if req.setup.ctx is not None else (DEFAULT_CTX if req.model_given else QUICKSTART_CTX)
        the_plan = _autotuned(req, spec, ctx, prepared, profile, ui, minutes=minutes, stack=stack)
    return _new_run(req, _for_launched(req, the_plan, profile, ui), prepared, profile, overrides, hyper,
                    rates_note)


def _autotuned(req: TrainRequest, spec, ctx: int, prepared, profile, ui: TrainUI, *, minutes, stack: str):
    """``memplan.planning.autotuned_plan`` for the request, on the processes it trains in."""
    return autotuned_plan(spec, ctx, prepared, profile, minutes=minutes, max_steps=req.control["max_steps"],
                          max_tokens=req.control["max_tokens"], global_batch_tokens=req.global_batch_tokens,
                          budget_bytes=req.budget_bytes, margin=req.margin, world_size=_launched(req), stack=stack,
                          say=ui.say, matmul_rate=measured_matmul_rate)


def _for_launched(req: TrainRequest, plan, profile, ui: TrainUI):
    """``plan`` made for the processes the run trains in (every rank trains rank 0's plan: the quick start's is
    chosen on a timed matmul)."""
    from trainer import distributed
    from trainer.hf_model import check_stack_setup

    launched = _launched(req)
    if launched == 1:
        return plan
    return distributed.from_rank0(for_world(plan, launched, req.sharding, profile, say=ui.say,
                                            check_setup=check_stack_setup))


def _new_run(req: TrainRequest, plan, prepared, profile, overrides: dict, hyper: dict, rates_note,
             starting=None) -> ResolvedTrain:
    """A new run of ``plan`` (made for the processes it trains in), in --out, else runs/train-DATE-TIME."""
    from trainer import distributed

    run_dir = (Path(req.out) if req.out else
               distributed.from_rank0(Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")))
    return ResolvedTrain(run_dir=run_dir, prepared=prepared, profile=profile, plan=plan, overrides=overrides,
                         hyper=hyper, rates_note=rates_note, starting=starting)


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


# ---- --from: a Hugging Face checkpoint -----------------------------------------------------------------

def _resolve_from(req: TrainRequest, profile, rates_note, ui: TrainUI) -> ResolvedTrain:
    """``memplan train --from CHECKPOINT``: the checkpoint's model (read without its weights), planned
    (autotuned unless the setup is given) and trained on --data from its weights; the corpus must have been
    prepared with its tokenizer."""
    from trainer.data import PreparedData
    from trainer.finetune import base_of_hf
    from trainer.hf_model import check_stack_setup
    from trainer.task import starting_from_hf

    imported = base_of_hf(req.from_, weights=False, stack=req.stack)  # spec and tokenizer now; weights when built
    prepared = PreparedData(Path(req.data))
    want, got = imported.tokenizer_record, prepared.manifest["tokenizer"]
    if (got.get("sha256"), got.get("eot_id"), prepared.vocab_size) != (want["sha256"], want["eot_id"],
                                                                        imported.spec.vocab):
        raise InputError(f"--data {prepared.path}: prepared with another tokenizer than {req.from_}'s own (or "
                         f"without its end-of-text id {want['eot_id']} and vocabulary of {imported.spec.vocab}); "
                         f"prepare it with `memplan prepare --input FILE --tokenizer {req.from_} --out DIR`")
    for note in imported.notes:
        ui.say(f"[dim]--from: {note}[/dim]")
    spec = imported.spec
    stack = "memplan" if imported.hf_config is None else "transformers"
    ctx = req.setup.ctx if req.setup.ctx is not None else min(imported.max_ctx, DEFAULT_CTX)
    if ctx > imported.max_ctx:
        raise InputError(f"--ctx {ctx}: {imported.path} computes as transformers does up to {imported.max_ctx} "
                         f"positions; use --ctx {imported.max_ctx} or less")
    overrides, hyper = dict(req.control), dict(req.hyper)
    if req.setup.given:
        the_plan = plan_from_flags(None, None, dataclasses.replace(req.setup, ctx=ctx), prepared, profile,
                                   say=ui.say, spec=spec, stack=stack, check_setup=check_stack_setup)
    else:
        the_plan = _autotuned(req, spec, ctx, prepared, profile, ui, minutes=overrides["max_minutes"], stack=stack)
    the_plan = _for_launched(req, the_plan, profile, ui)
    if not stack_class(stack).trains_hf_model:
        starting = starting_from_hf(imported.path, spec, model_type=imported.model_type)
    else:  # transformers' model class: its tensors checked against the model config.json describes
        from trainer.task import starting_from_hf_stack

        starting = starting_from_hf_stack(imported.path, spec, the_plan.setup, imported.hf_config,
                                          model_type=imported.model_type)
    if hyper["lr"] is None:
        hyper["lr"] = FROM_LR
    return _new_run(req, the_plan, prepared, profile, overrides, hyper, rates_note, starting=starting)


# ---- the local device ---------------------------------------------------------------------------------------------

def local_calibration(profile, ui: TrainUI | None, measure_now: bool, threads: int | None = None):
    """``memplan.local_calibration.local_calibration`` of the local ``profile``, measuring (``measure_now``) in a
    child process with ``ui``'s progress bar (``calibrate_in_child``)."""
    from memplan import local_calibration as calibration

    return calibration.local_calibration(
        profile, measure_now, threads,
        measure=lambda again: calibrate_in_child(profile.name, threads, ui or TrainUI(), again=again))




















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
    """A calibration of ``memplan.local_calibration.QUICKSTART_CALIBRATE_SECONDS`` in a fresh process
    (``python -m trainer.calibrate``) that
    loads the modules of memplan this process has loaded (for its runtime context), with a progress bar; returns it as a ``memplan.local.LocalCalibration`` read from a temporary file."""
    import json
    import subprocess
    import tempfile

    from memplan import local
    from memplan import local_calibration as calibration

    tmp = Path(tempfile.mkstemp(prefix="memplan-calibration-", suffix=".toml")[1])
    # the baseline is measured in a process that loaded what this one (the training process) has of memplan:
    # its command line when `memplan train` runs it
    loaded = sorted(m for m in sys.modules if m == "memplan" or m.startswith("memplan."))
    args = [sys.executable, "-m", "trainer.calibrate", str(calibration.QUICKSTART_CALIBRATE_SECONDS), str(tmp), name,
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
    reader of its kind (``LaunchSpec``, ``trainer.finetune_run.FinetuneLaunch``)."""
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
