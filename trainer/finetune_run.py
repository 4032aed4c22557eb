"""``memplan finetune`` as a request resolved in the library, as ``trainer.train_run`` does for ``memplan train``.

A ``FinetuneRequest`` holds what the command line asked, already parsed. ``resolve_finetune`` turns it into
the run that will train: the base (a memplan run or a Hugging Face checkpoint), the instruction data, the
device profile, the plan (given, or autotuned for the processes that run it) and the settings; for
``--resume``, the finetune's own newest checkpoint. ``start_finetune`` builds the ``Trainer`` from it.

``memplan finetune --nproc N`` resolves once, writes RUN/launch.json with ``kind`` ``finetune`` (the request
and the plan made for N processes; docs/run-directory.md) and starts ``torchrun -m trainer RUN``. Each rank
reads that file (``read_finetune_launch``) and resolves it with the plan it carries: no rank parses a command
line or autotunes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from memplan.errors import InputError
from memplan.memory.stacks import stack_class

FULL_FINETUNE_LR, LORA_LR = 3e-5, 2e-4  # --lr's defaults: every weight, adapters only


@dataclass(frozen=True)
class FinetuneRequest:
    """What ``memplan finetune`` was asked, each value parsed and checked where it is a plain value; the
    rest (the base, the data, the plan) is checked by what reads it, in ``resolve_finetune``."""

    data: str
    out: str
    run: str | None = None  # a memplan run to start from
    from_: str | None = None  # or a Hugging Face checkpoint (a directory or a Hub id)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "qkv,proj,up,down"  # parsed (trainer.lora.parse_targets)
    template: str = "chat"
    packing: str = "packed"
    ctx: int | None = None
    batch: int | None = None
    grad_accum: int | None = None
    precision: str | None = None
    attention: str = "sdpa"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    global_batch_tokens: int | None = None
    budget_bytes: int | None = None
    lr: float | None = None
    control: dict = field(default_factory=dict)  # run control (max_steps, ...): None where not given
    seed: int | None = None
    resume: bool = False
    device: str | None = None
    device_memory: str | None = None
    threads: int | None = None
    log: list = field(default_factory=list)
    nproc: int = 1
    stack: str | None = None  # --stack: whose model class trains (None: memplan's where it builds the family)

    def to_json(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, obj, where: str) -> "FinetuneRequest":
        """The request of a launch file, every field of its JSON type; an InputError naming ``where`` otherwise."""
        from trainer.records import check_value, field_values

        if not isinstance(obj, dict):
            raise InputError(f"{where}: 'request' is not an object")
        req = cls(**field_values(
            cls, obj, lambda name: f"{where}: 'request'[{name!r}]",
            lambda name: f"{where}: 'request' has no {name!r}; write it again with `memplan finetune --nproc N`",
            defaults=False))
        if (req.run is None) == (req.from_ is None):
            raise InputError(f"{where}: the request names neither or both of 'run' and 'from_'")
        if req.lora_rank < 0 or req.nproc < 1 or (req.threads is not None and req.threads < 1):
            raise InputError(f"{where}: 'lora_rank' must be 0 or more, 'nproc' and 'threads' 1 or more")
        for name in req.log:
            check_value(name, str, f"{where}: 'log'")
        return req


@dataclass
class ResolvedFinetune:
    """The finetune that will train: a new one (``plan``, ``config``) or a resume (``overrides``)."""

    request: FinetuneRequest
    sft: object  # trainer.finetune.SFTData
    profile: object  # memplan.hardware.Device
    plan: object  # memplan.plan.Plan: the new run's, or the resumed checkpoint's
    config: object | None = None  # trainer.loop.TrainConfig of a new run
    overrides: dict | None = None  # a resume: what the command line replaces
    fields: list[tuple[str, str]] = field(default_factory=list)  # what the command prints of it
    predicted_peak: int = 0


def resolve_finetune(req: FinetuneRequest, *, world_size: int = 1, plan=None,
                     say: Callable[[str], None] = lambda text: None) -> ResolvedFinetune:
    """The finetune ``req`` asks for, for ``world_size`` processes: with ``plan`` (a rank's, from its launch
    file) that plan as it is, else the one given by --batch, else autotuned. ``say`` hears the base's notes."""
    if (req.run is None) == (req.from_ is None):
        raise InputError("give --run RUN (a memplan run) or --from DIR (a Hugging Face checkpoint directory), "
                         "exactly one")
    if req.lora_rank < 0:
        raise InputError(f"--lora-rank: {req.lora_rank} must be 0 (full finetune) or a positive integer")
    from trainer.train_run import profile_for

    profile, _ = profile_for(req.device, req.device_memory, req.threads, None, measure_now=False)
    if req.resume:
        return _resolve_resume(req, profile)
    sft, spec, precision, stack = _base_and_data(req, profile, say)
    plan = plan if plan is not None else _plan(req, spec, sft, profile, precision, world_size, stack)
    from trainer.loop import TrainConfig

    config = TrainConfig(**{k: v for k, v in req.control.items() if v is not None},
                         lr=req.lr if req.lr is not None else (LORA_LR if plan.setup.lora_rank else FULL_FINETUNE_LR),
                         weight_decay=0.0 if plan.setup.lora_rank else 0.1, seed=req.seed or 0)
    return ResolvedFinetune(request=req, sft=sft, profile=profile, plan=plan, config=config,
                            fields=_fields(req, sft, plan, profile), predicted_peak=plan.predicted["peak_reserved"])


def _resolve_resume(req: FinetuneRequest, profile) -> ResolvedFinetune:
    from memplan.plan import Plan
    from trainer import checkpoint_format as ckpt
    from trainer.finetune import base_of, base_of_hf, load_sft
    from trainer.rundir import CHECKPOINT_DIR

    out_dir = Path(req.out)
    ref = ckpt.latest_checkpoint(out_dir / CHECKPOINT_DIR)
    if ref is None:
        raise InputError(f"--resume: {out_dir / CHECKPOINT_DIR} holds no checkpoint to resume from")
    meta = ckpt.verify_checkpoint(ref.path)
    ft = meta.get("finetune")
    if not ft:
        raise InputError(f"--resume: {out_dir} is a training run, not a finetune; resume it with memplan train")
    _check_same_base(req, ft, out_dir)
    plan = Plan.from_dict(meta["plan"], str(ref.path / ckpt.META_FILE))
    if req.run is not None:
        _, tokenizer, tok, _ = base_of(req.run)
    else:
        imported = base_of_hf(req.from_, weights=False, stack=plan.setup.stack)
        tokenizer, tok = imported.tokenizer, imported.tokenizer_record
    if tok.get("sha256") != meta.get("tokenizer_sha256"):
        raise InputError(f"{'--run' if req.run is not None else '--from'} {req.run or req.from_}: its tokenizer is "
                         f"not the one {out_dir} was finetuned with")
    sft = load_sft(req.data, tokenizer, tok, ctx=plan.setup.ctx, template=ft["template"], packing=ft["packing"],
                   base_checkpoint=Path(ft["base_checkpoint"]), base_run=Path(ft["base_run"]),
                   lora_alpha=float((ft.get("lora") or {}).get("alpha", req.lora_alpha)), base_hf=ft.get("base_hf"))
    if stack_class(plan.setup.stack).trains_hf_model:  # transformers' model class, of the config.json recorded
        from trainer import hf_model

        sft.hf_config = hf_model.run_config(meta, str(ref.path / ckpt.META_FILE))
    if sft.sha256 != ft["data_sha256"]:
        raise InputError(f"--data {req.data}: not the file {out_dir} was finetuned on (sha256 differs); resume with "
                         "the same data")
    overrides = {**req.control, "seed": req.seed, "lr": req.lr}  # None: as the finetune has it
    return ResolvedFinetune(request=req, sft=sft, profile=profile, plan=plan, overrides=overrides)


def _check_same_base(req: FinetuneRequest, ft: dict, out_dir: Path) -> None:
    """A resume names the base the finetune started from (its checkpoint's ``finetune.base_run``, resolved), by
    the same flag: another run or checkpoint directory is refused in one line naming the one to give."""
    flag, given = ("--run", req.run) if req.run is not None else ("--from", req.from_)
    recorded_flag = "--from" if ft.get("base_hf") else "--run"
    recorded = {str(ft.get("base_run")), str((ft.get("base_hf") or {}).get("path"))}
    if flag != recorded_flag or str(Path(given).resolve()) not in recorded:
        raise InputError(f"{flag} {given}: {out_dir} was finetuned from {recorded_flag} {ft.get('base_run')}; "
                         f"resume it with {recorded_flag} {ft.get('base_run')}")


def check_one_row_fits(spec, ctx: int, precision: str, profile, lora_rank: int = 0) -> None:
    """Refuse a --ctx at which even the leanest step (one row, full checkpointing, with LoRA if asked) is
    predicted not to fit the device, before the data is cut into rows of ctx + 1 tokens (an int64 and a bool
    tensor each: --ctx 1000000000 allocated 9 GB for them before any check)."""
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from memplan.units import format_bytes
    from trainer.checkpoint_policy import predicted_for

    spec.check_context(ctx)
    lean = TrainSetup(ctx=ctx, micro_batch=1, precision=precision, checkpointing="full", lora_rank=lora_rank)
    peak = predicted_for(Plan(model=spec, setup=lean, device=profile.name), profile).peak_reserved
    if peak > profile.usable_bytes:
        raise InputError(f"--ctx {ctx:,}: even one row of {ctx:,} tokens is predicted to need {format_bytes(peak)} "
                         f"(micro-batch 1, --checkpointing full) but {profile.name} has "
                         f"{format_bytes(profile.usable_bytes)} usable; use a shorter --ctx")


def _base_and_data(req: FinetuneRequest, profile, say):
    """The instruction data tokenized for the base, the base's model spec and the precision to train it in."""
    from trainer.finetune import base_of, base_of_hf, load_sft

    if req.run is not None:
        base_plan, tokenizer, tok, base_ckpt = base_of(req.run)
        stack = base_plan.setup.stack
        if req.stack is not None and req.stack != stack:
            raise InputError(f"--stack {req.stack}: {req.run} trained {stack}'s model class, which its weights "
                             f"are named for (accepted: {stack}, or export it and finetune with --from)")
        ctx = req.ctx or base_plan.setup.ctx
        check_one_row_fits(base_plan.model, ctx, req.precision or base_plan.setup.precision, profile, req.lora_rank)
        sft = load_sft(req.data, tokenizer, tok, ctx=ctx, template=req.template, packing=req.packing,
                       base_checkpoint=base_ckpt, base_run=Path(req.run), lora_alpha=req.lora_alpha)
        if stack_class(stack).trains_hf_model:
            from trainer import checkpoint_format as ckpt
            from trainer import hf_model

            sft.hf_config = hf_model.run_config(ckpt.verify_checkpoint(base_ckpt), str(base_ckpt))
        return sft, base_plan.model, req.precision or base_plan.setup.precision, stack
    from memplan.planning import best_precision

    imported = base_of_hf(req.from_, stack=req.stack)
    ctx = req.ctx or min(imported.max_ctx, 2048)
    if ctx > imported.max_ctx:
        raise InputError(f"--ctx {ctx}: {imported.path} computes as transformers does up to "
                         f"{imported.max_ctx} positions; use --ctx {imported.max_ctx} or less")
    base_hf = {"path": str(imported.path.resolve()), "model_type": imported.model_type, "dtype": imported.dtype}
    sft = load_sft(req.data, imported.tokenizer, imported.tokenizer_record, ctx=ctx, template=req.template,
                   packing=req.packing, base_checkpoint=imported.path, base_run=imported.path,
                   lora_alpha=req.lora_alpha, base_weights=imported.tensors, base_hf=base_hf)
    sft.hf_config = imported.hf_config
    for note in imported.notes:
        say(f"--from: {note}")
    return sft, imported.spec, req.precision or best_precision(profile), \
        "memplan" if imported.hf_config is None else "transformers"


def _plan(req: FinetuneRequest, spec, sft, profile, precision: str, world_size: int, stack: str = "memplan"):
    """The plan: --batch as given (DDP over ``world_size`` processes), else autotune's for ``world_size``."""
    from memplan.plan import Plan
    from memplan.prediction import predict
    from memplan.setup import TrainSetup

    ctx = sft.ctx
    if req.batch is not None:
        setup = TrainSetup(ctx=ctx, micro_batch=req.batch, grad_accum=req.grad_accum or 1, precision=precision,
                           attention=req.attention, checkpointing=req.checkpointing, optimizer=req.optimizer,
                           lora_rank=req.lora_rank, lora_targets=req.lora_targets, world_size=world_size,
                           sharding="ddp" if world_size > 1 else "none", stack=stack)
    else:
        if req.grad_accum is not None:
            raise InputError("--grad-accum goes with --batch; without --batch autotune picks both")
        from memplan.autotune import autotune
        from memplan.memory.stacks import stack_for

        result = autotune(spec, profile, ctx=ctx, global_batch_tokens=req.global_batch_tokens or 8 * ctx,
                          budget_bytes=req.budget_bytes, lora_rank=req.lora_rank, lora_targets=req.lora_targets,
                          precision=precision, world_size=world_size, stack=stack_for(stack, own_loop=True))
        if result.plan is None:
            raise InputError(f"nothing fits {profile.name} for {spec.describe()} at ctx {ctx}"
                             + (" with LoRA" if req.lora_rank else "") + "; try --lora-rank, a shorter --ctx or "
                             "--checkpointing full")
        setup = result.plan.setup.replace(stack=stack)
        if not stack_class(stack).compiles:  # memplan's compile is planned for its own model only
            setup = setup.replace(compile=False)
    from memplan.memory.stacks import check_lora_targets
    from trainer.hf_model import check_stack_setup

    check_lora_targets(stack, spec, setup)  # what the stack's code adapts (a tied head, q/k/v under selective)
    check_stack_setup(setup)  # what memplan's trainer adapts (a tied head, q/k/v under selective)
    predicted = predict(spec, setup, profile)
    return Plan(model=spec, setup=setup, device=profile.name, budget_bytes=profile.usable_bytes,
                predicted=predicted.plan_table())


def _fields(req: FinetuneRequest, sft, plan, profile) -> list[tuple[str, str]]:
    """What ``memplan finetune`` prints of a new finetune: its data and what it tunes."""
    from memplan.units import format_bytes

    s, setup = sft.stats, plan.setup
    what = (f"LoRA rank {setup.lora_rank} (alpha {req.lora_alpha:g}) on {setup.lora_targets}" if setup.lora_rank
            else "every weight")
    return [
        ("Data", f"{s['examples']} examples ({s['train_examples']} train, {s['val_examples']} held out), "
                 f"{s['train_rows']} {sft.packing} rows of {setup.ctx} tokens, {s['response_tokens']:,} response "
                 f"tokens trained" + (f"; {s['truncated']} cut to --ctx" if s["truncated"] else "")
                 + (f"; {s['dropped']} dropped (no response left)" if s["dropped"] else "")),
        ("Tuning", f"{what}; predicted peak {format_bytes(plan.predicted['peak_reserved'])} of "
                   f"{format_bytes(profile.usable_bytes)}"),
    ]


def start_finetune(run: ResolvedFinetune):
    """The ``Trainer`` of ``run``: started in its output directory, or resumed from its newest checkpoint."""
    from trainer.finetune import finetune_task
    from trainer.loop import Trainer

    out_dir = Path(run.request.out)
    if run.request.resume:
        return Trainer.resume(out_dir, run.sft, run.profile, overrides=run.overrides, task=finetune_task(run.sft))
    return Trainer.start(out_dir, run.plan, run.sft, run.config, run.profile, task=finetune_task(run.sft))


# ---- --nproc: the launch file ------------------------------------------------------------------------------

@dataclass(frozen=True)
class FinetuneLaunch:
    """RUN/launch.json of ``memplan finetune --nproc N``: the request, and the plan made for N processes (None
    for a resume: the checkpoint's). ``resume`` is the request's, for ``trainer.train_run.write_launch``."""

    request: FinetuneRequest
    plan: dict | None

    @property
    def resume(self) -> bool:
        return self.request.resume

    def to_json(self) -> dict:
        from trainer.train_run import LAUNCH_FORMAT, LAUNCH_VERSION

        return {"format": LAUNCH_FORMAT, "version": LAUNCH_VERSION, "kind": "finetune",
                "request": self.request.to_json(), "plan": self.plan}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "FinetuneLaunch":
        from trainer.records import check_value

        request = FinetuneRequest.from_json(obj.get("request"), where)
        plan = check_value(obj.get("plan"), dict | None, f"{where}: 'plan'")
        if request.resume != (plan is None):
            raise InputError(f"{where}: a new finetune carries its 'plan', a resume none")
        return cls(request=request, plan=plan)


def resolve_finetune_launch(launch: FinetuneLaunch, where: str, world_size: int) -> ResolvedFinetune:
    """A rank's finetune: the launch file's request with its plan, which must be for this many processes."""
    from memplan.plan import Plan

    plan = Plan.from_dict(launch.plan, where) if launch.plan is not None else None
    if plan is not None and plan.setup.world_size != world_size:
        raise InputError(f"the plan is for --world-size {plan.setup.world_size} but {world_size} process(es) run "
                         f"it; launch it with `memplan finetune --nproc {plan.setup.world_size}` (torchrun)")
    return resolve_finetune(launch.request, world_size=world_size, plan=plan)


def read_launch_file(run_dir: str | Path):
    """RUN/launch.json as its kind reads it: a ``FinetuneLaunch`` (kind ``finetune``) or a
    ``trainer.train_run.LaunchSpec`` (``memplan train --nproc``'s); an InputError naming the file otherwise."""
    from trainer.train_run import LAUNCH_FORMAT, LAUNCH_VERSION, LaunchSpec, read_launch_object

    obj, path = read_launch_object(run_dir)
    if isinstance(obj, dict) and obj.get("format") == LAUNCH_FORMAT and obj.get("version") == LAUNCH_VERSION \
            and obj.get("kind") == "finetune":
        return FinetuneLaunch.from_json(obj, str(path))
    return LaunchSpec.from_json(obj, str(path))
