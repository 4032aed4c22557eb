"""What a training run plans before anything runs, torch-free: the quick start's model (``quickstart_model``), a plan
of MODEL and SETUP options as given or of a plan file (``plan_from_flags``), autotune's plan for a run
(``autotuned_plan``), a plan rescaled for N processes (``for_world``), and the checks of a plan against the
device and the data. ``trainer.train_run`` resolves a run with these; what needs torch reaches here as a callable:
``matmul_rate`` (a timed matmul on this machine) and ``check_setup`` (what the trainer runs of a stack's model
class, ``trainer.hf_model.check_stack_setup``). Lines for the user go to ``say``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memplan.errors import InputError
from memplan.memory.stacks import stack_class, stack_for

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
QUICKSTART_STEPS = 1500  # the quick start's step count, to the nearest power of two of sequences a step
QUICKSTART_LAYERS = (2, 3, 4, 6, 8, 10, 12)  # the model ladder: hidden = 64·layers (memplan's size rule)


def _silent(text: str, soft_wrap: bool = False) -> None:
    pass


def _any_setup(setup) -> None:
    pass


@dataclass(frozen=True)
class SetupAsked:
    """The SETUP options a run was given, parsed (counts as ints; None: not given, for the plan file, autotune
    or the checkpoint to choose)."""

    ctx: int | None = None
    batch: int | None = None
    grad_accum: int | None = None
    precision: str | None = None
    attention: str | None = None
    checkpointing: str | None = None
    optimizer: str | None = None
    compile: bool | None = None

    @property
    def given(self) -> bool:
        """Whether any option besides ``--ctx`` was given (a setup to train as given, not to autotune)."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self) if f.name != "ctx")


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


def plan_from_flags(plan_path, model_flags: dict | None, setup: SetupAsked | None, prepared, profile, *,
                    say: Callable = _silent, quiet: bool = False, spec=None, stack: str = "memplan",
                    check_setup: Callable = _any_setup):
    """The plan of --plan FILE, or of MODEL and SETUP options as given (no autotune; ``model_flags``: ``resolve``'s
    keyword arguments); vocab from the data (``spec``: this model, an imported checkpoint's, instead of MODEL
    options); ``check_setup`` refuses what the trainer does not run."""
    from memplan.plan import Plan
    from memplan.setup import setup_from_flags as setup_from
    from memplan.prediction import predict

    if plan_path:
        p = memplan_plan(plan_path)
        if p.model.vocab != prepared.vocab_size:
            if not quiet:
                say(f"[yellow]note[/]: the plan's model has vocab {p.model.vocab}; training with the data's "
                       f"{prepared.vocab_size} (predictions recomputed)")
            p = dataclasses.replace(p, model=p.model.replace(vocab=prepared.vocab_size), predicted={}, verified={})
    else:
        if spec is None:
            from memplan.model import resolve as model_from

            check_vocab(model_flags["vocab"], prepared)
            spec = model_from(**{**model_flags, "vocab": None}).replace(vocab=prepared.vocab_size)
        s = setup
        precision = s.precision or best_precision(profile)
        the_setup = setup_from(ctx=s.ctx or DEFAULT_CTX, batch=s.batch or 1, grad_accum=s.grad_accum or 1,
                               precision=precision, attention=s.attention or "sdpa",
                               checkpointing=s.checkpointing or "none", optimizer=s.optimizer or "adamw",
                               compile=bool(s.compile)).replace(stack=stack)
        check_setup(the_setup)
        if not s.precision and not quiet:
            say(f"precision {precision}: the best the {profile.name} profile runs natively "
                   "(--precision to choose)")
        p = Plan(model=spec, setup=the_setup, device=profile.name, budget_bytes=profile.usable_bytes)
    if not p.predicted:
        p = dataclasses.replace(p, device=p.device or profile.name, budget_bytes=p.budget_bytes or profile.usable_bytes,
                                predicted=predict(p.model, p.setup, profile).plan_table())
    return p


def quickstart_model(vocab: int, profile, minutes: float, ctx: int, matmul_rate: Callable[[], float]):
    """The quick start's model: the largest of the ladder (hidden = 64·layers) that memplan predicts
    trains on at least QUICKSTART_TOKENS_PER_PARAM × params tokens within ``minutes`` (tokens/s at
    micro-batch 8, with the local matmul rate: the profile's calibrated one, else one measured now by
    ``matmul_rate``, FLOP/s),
    else the ladder's smallest rung. Tokens/s are a free core's (``free_core``): the share of a core other
    processes left the run when it started moves its wall time, not the model or the global batch it trains
    (issue 28: 62% of a core probed halved the prediction, and with it the batch, to 256 tokens). Returns (spec,
    predicted tokens/s, matmul FLOP/s, whether a rung met the rule)."""
    from memplan.model import ModelSpec, _round_up
    from memplan.setup import TrainSetup
    from memplan.timing import step_time

    if profile.calibrated.get("matmul_tflops", {}).get("fp32"):
        rated, rate = profile, profile.calibrated["matmul_tflops"]["fp32"] * 1e12
    else:
        rate = matmul_rate()
        rated = profile.replace(calibrated={**profile.calibrated, "matmul_tflops": {
            **profile.calibrated.get("matmul_tflops", {}), "fp32": rate / 1e12}})
    rated = free_core(rated)  # the plan is this machine's, not the load's of the second it starts in
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


def free_core(profile):
    """``profile`` without the share of a core measured when the run started (``calibrated.cpu_share``, which
    ``memplan.timing.contention_seconds`` turns into the time others hold the core): an idle core's step time.
    A one-thread calibration by CPU time measures an idle core's rates whatever the load, so this is the figure
    a loaded machine does not move."""
    if "cpu_share" not in profile.calibrated:
        return profile
    return profile.replace(calibrated={k: v for k, v in profile.calibrated.items() if k != "cpu_share"})


def quickstart_global_batch(tps: float, minutes: float, ctx: int) -> int:
    """The quick start's global batch in tokens: ``ctx`` times the power of two of sequences nearest (geometrically)
    to the batch that makes QUICKSTART_STEPS steps at ``tps`` tokens/s (``quickstart_model``'s, a free core's) in
    ``minutes``; at least one sequence, at most 2^19 tokens. So the run takes between QUICKSTART_STEPS/√2 and
    QUICKSTART_STEPS·√2 steps (1,061 to 2,121), and a batch changes only where the prediction moves ±41% from the
    middle of its band: a rule of "the largest power of two leaving ≥ QUICKSTART_STEPS" put its edge (8,533
    tokens/s for 1,024 tokens at ctx 256 in 3 minutes) inside this 2-core machine's own spread of predictions
    (6.5K-9.6K), so the same command trained 512 or 1,024 tokens a step from one run to the next; its band for 1,024
    is now 6.0K-12.1K tokens/s."""
    sequences = tps * minutes * 60 / QUICKSTART_STEPS / ctx
    return max(ctx, min(1 << 19, ctx * 2 ** max(0, round(math.log2(max(1.0, sequences))))))


def quickstart_model_line(spec, tps: float, rate: float, met: bool, minutes: float,
                          share: float | None = None) -> str:
    """What the quick start says of its model choice: the rule it applied and the tokens predicted (``tps``, a free
    core's; ``share``: the share of the core the run was found to get, which its own prediction counts)."""
    from memplan.units import format_count

    tokens = tps * minutes * 60
    why = (f"the largest of memplan's ladder predicted to train on ≥ {QUICKSTART_TOKENS_PER_PARAM:g} tokens per "
           "parameter" if met else "the smallest of memplan's ladder (none is predicted to train on "
           f"{QUICKSTART_TOKENS_PER_PARAM:g} tokens per parameter in that time)")
    return (f"Model for a {minutes:g}-minute run: [bold]{spec.describe()}[/] — {why}: ~{format_count(tokens)} "
            f"tokens ({tokens / spec.params:.1f} per parameter) at ~{format_count(tps)} tokens/s predicted "
            + (f"on a free core, {share:.0%} of which is free now " if share and round(share, 2) < 1 else "")
            + f"(local matmul measured at {rate / 1e9:,.0f} GFLOP/s)")


def for_world(plan, world_size: int, sharding: str | None, profile, *, say: Callable = _silent,
              check_setup: Callable = _any_setup):
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
        say(f"[yellow]note[/]: the plan is for one process; each of the {world_size} ranks runs its "
               f"micro-batch {s.micro_batch} × {s.grad_accum} accumulation, so a step is {world_size}× "
               f"the plan's global batch ({chosen})")
    setup = s.replace(world_size=world_size, sharding=chosen)
    check_setup(setup)  # FSDP2 does not wrap transformers' model class here
    return Plan(model=plan.model, setup=setup, device=plan.device, budget_bytes=plan.budget_bytes,
                predicted=predict(plan.model, setup, profile).plan_table())


def autotuned_plan(spec, ctx, prepared, profile, *, minutes, global_batch_tokens, budget_bytes, margin,
                   world_size: int = 1, max_steps: int | None = None, max_tokens: int | None = None,
                   stack: str = "memplan", say: Callable = _silent, matmul_rate: Callable[[], float] | None = None):
    """autotune's plan for ``spec`` (None: the quick start's model, sized for ``minutes`` on this device, the
    local matmul rate measured by ``matmul_rate`` where the profile has none); a plan that compiles is weighed
    again against the tokens this run will train."""
    try:
        from memplan.autotune import autotune
    except ImportError:
        raise InputError("planning needs memplan.autotune, which this build of memplan lacks; give --plan FILE or "
                         "the setup yourself (e.g. --params 22m --batch 8 --ctx 256)") from None
    if spec is None:
        minutes = minutes or QUICKSTART_MINUTES  # with a step or token limit instead, size it for the default
        spec, tps, rate, met = quickstart_model(prepared.vocab_size, profile, minutes, ctx, matmul_rate)
        say(quickstart_model_line(spec, tps, rate, met, minutes, share=profile.calibrated.get("cpu_share")),
            soft_wrap=True)
        if global_batch_tokens is None:  # small steps: about QUICKSTART_STEPS of them on a free core
            global_batch_tokens = quickstart_global_batch(tps, minutes, ctx)
    kw = dict(ctx=ctx, global_batch_tokens=global_batch_tokens,
              budget_bytes=budget_bytes, margin=margin, world_size=world_size)
    if stack_class(stack).library:  # every candidate walked as transformers' model class runs (memplan.memory.stacks)
        kw["stack"] = stack_for(stack, own_loop=True)  # memplan's loop trains it
    result = autotune(spec, profile, tokens=None, **kw)
    if result.plan is not None and result.plan.setup.compile:
        # torch.compile's compile time is a one-off: weigh it against the tokens this run will train (its limit,
        # or what the fastest plan trains in its time), so a short run stays eager
        p = result.plan.predicted
        run = [t for t in (max_tokens, max_steps * result.plan.setup.tokens_per_step * world_size if max_steps else None,
                           int(p["tokens_per_second"] * minutes * 60) if minutes else None) if t]
        if run:
            result = autotune(spec, profile, tokens=min(run), **kw)
    if result.compile is not None and result.compile.considered:  # taken or not, and why (autotune's own note)
        say(result.compile.why, soft_wrap=True)
    if result.plan is None:
        advice = "; ".join(getattr(result, "advice", None) or ["try a smaller model or a shorter --ctx"])
        raise InputError(f"nothing fits {profile.name} for {spec.describe()} at ctx {ctx}: {advice}")
    if stack_class(stack).library:  # the plan trains that stack's model class, and is predicted as it runs
        from memplan.prediction import predict

        setup = result.plan.setup.replace(stack=stack, compile=False)
        return dataclasses.replace(result.plan, setup=setup, predicted=predict(spec, setup, profile).plan_table())
    return result.plan
