"""The options (docs/cli.md), each declared once here, and their groups (MODEL, SETUP, DEVICE, RUN), shared by
every command that takes them.

An option is one ``Annotated`` type (its flag, metavar, help and panel). A group is a frozen dataclass of
options (``ModelFlags``, ``SetupFlags``, ...): a command takes a group as one parameter annotated with its
class, and ``@with_groups`` spreads the group's fields into the signature typer reads (in their order) and
calls the command with one group object per group. A command turns a group into what it plans with
(``ModelFlags.spec``, ``SetupFlags.setup``, ``DeviceFlags.profile``): values are parsed here (``8k``,
``4GiB``) and validated by the dataclasses, so every bad value surfaces as one ``InputError`` line.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
import typing
from typing import Annotated, Optional

import typer

from memplan.errors import InputError
from memplan.run_control import SEED_MAX  # the range the trainer checks too
from memplan.units import parse_count, parse_size

_M, _S, _D = "Model", "Setup", "Device"

# ---- MODEL ---------------------------------------------------------------------------------
ParamsOpt = Annotated[Optional[str], typer.Option(
    "--params", metavar="SIZE", help="Model size: 22m, 124m, 350m, 1b, 1.1b, 3b, 7b, 13b, 34b, 70b, or any size up to 10t such as "
                     "50m (a documented Llama-style shape).", rich_help_panel=_M)]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", metavar="NAME|PATH", help="A preset name (gpt2, tinyllama-1.1b, llama-3.2-1b, ...) or a Hugging Face config.json.",
    rich_help_panel=_M)]
ArchOpt = Annotated[Optional[str], typer.Option(
    "--arch", metavar="ARCH", help="llama | gpt2 | gpt_neox; qwen3 | gemma | phi | stablelm where transformers' code runs (--stack "
                   "transformers; train chooses it for them).", rich_help_panel=_M)]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", metavar="N", help="Transformer blocks.", rich_help_panel=_M)]
HiddenOpt = Annotated[Optional[int], typer.Option("--hidden", metavar="N", help="Model width.", rich_help_panel=_M)]
HeadsOpt = Annotated[Optional[int], typer.Option("--heads", metavar="N", help="Query heads.", rich_help_panel=_M)]
KvHeadsOpt = Annotated[Optional[int], typer.Option("--kv-heads", metavar="N", help="Key/value heads (GQA).", rich_help_panel=_M)]
FfnOpt = Annotated[Optional[int], typer.Option("--ffn", metavar="N", help="MLP inner width.", rich_help_panel=_M)]
VocabOpt = Annotated[Optional[int], typer.Option("--vocab", metavar="N", help="Vocabulary size.", rich_help_panel=_M)]
TiedOpt = Annotated[Optional[bool], typer.Option("--tied/--untied", help="Tie the LM head to the embedding.",
                                                 rich_help_panel=_M, show_default=False)]
DropoutOpt = Annotated[Optional[float], typer.Option(
    "--dropout", metavar="P", help="Model dropout P in [0, 1): on the attention probabilities, after each attention and MLP "
                      "output projection, and after the embedding, as GPT-2 places them (default: a config.json's "
                      "own dropout fields, else 0). Training only: evaluation and generation run without it.",
    rich_help_panel=_M, show_default=False)]

# ---- SETUP ---------------------------------------------------------------------------------
CtxOpt = Annotated[str, typer.Option("--ctx", metavar="N", help="Context length in tokens (8192 or 8k).", rich_help_panel=_S)]
BatchOpt = Annotated[str, typer.Option("--batch", metavar="N", help="Micro-batch (sequences per forward).", rich_help_panel=_S)]
GradAccumOpt = Annotated[str, typer.Option("--grad-accum", metavar="N", help="Micro-batches per optimizer step.",
                                           rich_help_panel=_S)]
PrecisionOpt = Annotated[str, typer.Option("--precision", metavar="PRECISION", help="fp32 | tf32 | bf16-mixed | fp16-mixed | bf16",
                                           rich_help_panel=_S)]
AttentionOpt = Annotated[str, typer.Option("--attention", metavar="ATTENTION", help="eager | sdpa", rich_help_panel=_S)]
CheckpointingOpt = Annotated[str, typer.Option("--checkpointing", metavar="CHECKPOINTING", help="none | selective | full",
                                               rich_help_panel=_S)]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", metavar="OPTIMIZER", help="adamw | adamw-fused | sgd | adamw8bit",
                                           rich_help_panel=_S)]
WorldSizeOpt = Annotated[str, typer.Option("--world-size", metavar="N", help="Data-parallel processes.", rich_help_panel=_S)]
ShardingOpt = Annotated[str, typer.Option("--sharding", metavar="SHARDING", help="none | ddp | fsdp", rich_help_panel=_S)]
CustomShardedLayersOpt = Annotated[str, typer.Option(
    "--custom-sharded-layers", metavar="LAYERS", help="--stack torchtune --sharding fsdp: torchtune's "
    "custom_sharded_layers, FSDP2 groups of their own: auto (the published configs': tok_embeddings,output for an "
    "untied full finetune, unset for LoRA and tied heads) | none | tok_embeddings,output. fsdp_cpu_offload is not "
    "planned.", rich_help_panel=_S)]
FsdpReshardOpt = Annotated[bool, typer.Option(
    "--fsdp-reshard-after-forward/--no-fsdp-reshard-after-forward", help="--stack torchtune --sharding fsdp: "
    "torchtune's fsdp_reshard_after_forward (default: true, the recipes'); false keeps every group's parameters "
    "unsharded from forward to backward (with --custom-sharded-layers none).", rich_help_panel=_S)]
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile the model.",
                                          rich_help_panel=_S)]

# ---- DEVICE --------------------------------------------------------------------------------
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", metavar="NAME|PATH", help="A profile name (see `memplan profiles`) or a profile TOML; default: the local device.",
    rich_help_panel=_D)]
DeviceMemoryOpt = Annotated[Optional[str], typer.Option(
    "--device-memory", metavar="SIZE", help="Override the device's memory size (a 64GiB Mac, a Strix Halo's GTT), e.g. 96GiB.",
    rich_help_panel=_D)]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (keys documented in docs/json.md) instead of tables.")]

# ---- RUNTIME (every command that runs torch) -----------------------------------------------
TrainStackOpt = Annotated[Optional[str], typer.Option(
    "--stack", metavar="STACK", help="train/finetune: whose model class trains, in memplan's loop: memplan (its own) | transformers "
                    "(AutoModelForCausalLM.from_config, peft's LoRA; planned as `estimate --stack transformers`). "
                    "Default: memplan's own where it builds the family (llama, mistral, qwen2, gpt2, gpt_neox), "
                    "else transformers' (qwen3, gemma, phi, stablelm).", show_default=False,
    rich_help_panel="Setup")]
ThreadsOpt = Annotated[Optional[str], typer.Option(
    "--threads", metavar="N", help="torch CPU threads. Default: the count this machine's calibration measured fastest (one "
                      "thread beats all cores on a small or busy machine), else torch's default.",
    show_default=False)]


# ---- RUN CONTROL (train, finetune): when a run stops, how often it evaluates and saves ------------------
_R = "Run"
MaxStepsOpt = Annotated[Optional[str], typer.Option(
    "--max-steps", metavar="N", help="Stop after this many optimizer steps (counted from the run's start).", show_default=False,
    rich_help_panel=_R)]
TokensOpt = Annotated[Optional[str], typer.Option("--tokens", metavar="N", help="Stop after this many training tokens (e.g. 50m).",
                                                  show_default=False, rich_help_panel=_R)]
MaxMinutesOpt = Annotated[Optional[str], typer.Option(
    "--max-minutes", metavar="MIN", help="Stop after this many minutes of this command's training (a resume counts from its own "
                          "start); alone, it also sets the schedule's length (from timed steps). Default without "
                          "any limit: one epoch (`memplan train` alone: 3 minutes). On --resume, limits given "
                          "replace the run's; without any, its own stay.", show_default=False, rich_help_panel=_R)]
SaveEveryOpt = Annotated[Optional[str], typer.Option("--save-every", metavar="N", help="Steps between checkpoints "
                                                     "(default: as --eval-every).", show_default=False,
                                                     rich_help_panel=_R)]
EvalEveryOpt = Annotated[Optional[str], typer.Option(
    "--eval-every", metavar="N", help="Steps between held-out evaluations (default: 5 per run, at least every 1000 steps).",
    show_default=False, rich_help_panel=_R)]
KeepOpt = Annotated[Optional[str], typer.Option("--keep", metavar="N", help="Checkpoints to keep (default 3).", show_default=False,
                                                rich_help_panel=_R)]
EvalBatchesOpt = Annotated[Optional[str], typer.Option("--eval-batches", metavar="N", help="Held-out batches per source in an "
                                                       "evaluation (default 4).", show_default=False,
                                                       rich_help_panel=_R)]
SampleTokensOpt = Annotated[Optional[str], typer.Option("--sample-tokens", metavar="N", help="Tokens per evaluation sample, "
                                                        "0 = none (default 32).", show_default=False,
                                                        rich_help_panel=_R)]
PromptOpt = Annotated[Optional[list[str]], typer.Option(
    "--prompt", metavar="TEXT", help="A sample prompt (repeat for several). Default: the start of each source's first held-out "
                     "document (a finetune: its first held-out prompts).", show_default=False, rich_help_panel=_R)]
MaxNonfiniteOpt = Annotated[Optional[str], typer.Option("--max-nonfinite", metavar="N", help="Stop after this many non-finite "
                                                        "losses in a row (default 5).", show_default=False,
                                                        rich_help_panel=_R)]
VerifyDataOpt = Annotated[Optional[bool], typer.Option(
    "--verify-data/--no-verify-data", help="Check the data (every shard's sha256; a finetune's JSONL) before "
                                           "training (default: on).", show_default=False, rich_help_panel=_R)]
SeedOpt = Annotated[Optional[str], typer.Option(
    "--seed", metavar="N", help="Seed of the initialisation and the data order, 0 to 4294967295 (default 0).",
    show_default=False, rich_help_panel=_R)]

LogOpt = Annotated[Optional[list[str]], typer.Option(
    "--log", metavar="LOGGER", help="Also log to: tensorboard (RUN/tensorboard/) | wandb (RUN/wandb/, offline unless logged in); "
                  "repeatable. metrics.jsonl is always written. Needs `pip install 'memplan\\[logging]'`.",
    show_default=False, rich_help_panel=_R)]


# ---- groups ----------------------------------------------------------------------------------

class Flags:
    """A group of options: a frozen dataclass whose fields are annotated with the options above (in the order
    ``--help`` lists them). ``@with_groups`` spreads it into a command's signature."""

    def values(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def given(self) -> bool:
        """Whether any option of the group was given (its default None means not given)."""
        return any(v is not None for v in self.values().values())


@dataclasses.dataclass(frozen=True)
class ModelFlags(Flags):
    """MODEL: a preset, a config.json, a size or an explicit shape (``memplan.model.resolve``)."""

    params: ParamsOpt = None
    model: ModelOpt = None
    arch: ArchOpt = None
    layers: LayersOpt = None
    hidden: HiddenOpt = None
    heads: HeadsOpt = None
    kv_heads: KvHeadsOpt = None
    ffn: FfnOpt = None
    vocab: VocabOpt = None
    tied: TiedOpt = None
    dropout: DropoutOpt = None

    def spec(self, **kw):
        """The ``ModelSpec`` these options describe (``kw``: ``resolve``'s other arguments, or options replaced)."""
        from memplan.model import resolve

        return resolve(**{**self.values(), **kw})


@dataclasses.dataclass(frozen=True)
class SetupFlags(Flags):
    """SETUP of a command that plans one step as given (estimate, trace): every option with its default."""

    ctx: CtxOpt = "1024"
    batch: BatchOpt = "1"
    grad_accum: GradAccumOpt = "1"
    precision: PrecisionOpt = "bf16-mixed"
    attention: AttentionOpt = "sdpa"
    checkpointing: CheckpointingOpt = "none"
    optimizer: OptimizerOpt = "adamw"
    world_size: WorldSizeOpt = "1"
    sharding: ShardingOpt = "none"
    compile: CompileOpt = False

    def setup(self, **kw):
        """The ``TrainSetup`` these options describe (``kw``: options replaced, e.g. a precision chosen)."""
        from memplan.setup import setup_from_flags

        return setup_from_flags(**{**self.values(), **kw})


@dataclasses.dataclass(frozen=True)
class PlanSetupFlags(Flags):
    """SETUP of a command that plans what is not given (train: autotune, a plan file or a checkpoint chooses the
    rest): None where not given."""

    ctx: CtxOpt = None
    batch: BatchOpt = None
    grad_accum: GradAccumOpt = None
    precision: PrecisionOpt = None
    attention: AttentionOpt = None
    checkpointing: CheckpointingOpt = None
    optimizer: OptimizerOpt = None
    compile: CompileOpt = None

    def asked(self):
        """The options given, parsed (``memplan.planning.SetupAsked``: counts as ints)."""
        from memplan.planning import SetupAsked

        def count(value, what, binary=False):
            return None if value is None else parse_count(value, what, binary=binary)

        return SetupAsked(ctx=count(self.ctx, "--ctx", binary=True), batch=count(self.batch, "--batch"),
                          grad_accum=count(self.grad_accum, "--grad-accum"), precision=self.precision,
                          attention=self.attention, checkpointing=self.checkpointing, optimizer=self.optimizer,
                          compile=self.compile)


@dataclasses.dataclass(frozen=True)
class DeviceFlags(Flags):
    """DEVICE: a profile (name or TOML; None: this machine) and its memory, as given."""

    device: DeviceOpt = None
    device_memory: DeviceMemoryOpt = None

    def profile(self):
        """The ``Device`` as named (``device_from``), without this machine's calibration."""
        return device_from(self.device, self.device_memory)

    def local_profile(self, threads: int | None = None):
        """``local_device_from``: (device, the line saying where its rates come from, or None)."""
        return local_device_from(self.device, self.device_memory, threads)


@dataclasses.dataclass(frozen=True)
class LimitFlags(Flags):
    """RUN (train, finetune): when a run stops, and how often it evaluates and saves."""

    max_steps: MaxStepsOpt = None
    tokens: TokensOpt = None
    max_minutes: MaxMinutesOpt = None
    save_every: SaveEveryOpt = None
    eval_every: EvalEveryOpt = None


@dataclasses.dataclass(frozen=True)
class CheckFlags(Flags):
    """RUN (train, finetune): what an evaluation holds, the checkpoints kept, the checks of losses and data."""

    keep: KeepOpt = None
    eval_batches: EvalBatchesOpt = None
    sample_tokens: SampleTokensOpt = None
    prompt: PromptOpt = None
    max_nonfinite: MaxNonfiniteOpt = None
    verify_data: VerifyDataOpt = None


def with_groups(command):
    """``command`` as typer reads it: each parameter annotated with a ``Flags`` class is replaced, in its place,
    by that group's options (keyword parameters, with their defaults), and the command is called with one group
    object per group. A name taken twice (two groups, or a group and a parameter) is refused here."""
    hints = typing.get_type_hints(command, include_extras=True)
    params, groups, seen = [], {}, set()
    for name, p in inspect.signature(command).parameters.items():
        ann = hints.get(name, p.annotation)
        if isinstance(ann, type) and issubclass(ann, Flags):
            fields = dataclasses.fields(ann)
            groups[name] = (ann, [f.name for f in fields])
            group_hints = typing.get_type_hints(ann, include_extras=True)
            spread = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                        annotation=group_hints[f.name]) for f in fields]
        else:
            spread = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=ann)]
        for q in spread:
            if q.name in seen:
                raise TypeError(f"{command.__name__}: the option parameter {q.name!r} is taken twice")
            seen.add(q.name)
        params += spread

    @functools.wraps(command)
    def run(**kw):
        taken = {name: cls(**{n: kw.pop(n) for n in names}) for name, (cls, names) in groups.items()}
        return command(**kw, **taken)

    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {q.name: q.annotation for q in params}
    return run


# ---- a trained run (eval, export, generate) --------------------------------------------------
RunDirOpt = Annotated[str, typer.Option("--run", metavar="RUN", help="The run directory (what `memplan train --out` wrote).",
                                        show_default=False)]
CheckpointOpt = Annotated[Optional[str], typer.Option(
    "--checkpoint", metavar="DIR", help="A checkpoint directory of the run (default: its newest).", show_default=False)]


def seed_from(text: str | None) -> int | None:
    """``--seed N`` parsed (None when not given): a whole number from 0 to SEED_MAX, else one InputError line."""
    if text is None:
        return None
    try:
        n = int(str(text).strip())
    except ValueError:
        raise InputError(f"--seed: {text!r} is not a whole number; accepted: 0 to {SEED_MAX}") from None
    if not 0 <= n <= SEED_MAX:
        raise InputError(f"--seed: {text} is out of range; accepted: 0 to {SEED_MAX}")
    return n


def minutes_from(text: str | None, what: str = "--max-minutes") -> float | None:
    """A positive, finite number of minutes (None when not given)."""
    import math

    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{what}: {text!r} is not a number; accepted: a positive number of minutes, e.g. 3 or "
                         "0.5") from None
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{what}: {text!r} must be a positive number of minutes, e.g. 3 or 0.5")
    return value


def run_control_from(limits: LimitFlags, checks: CheckFlags) -> dict:
    """The run-control options as ``TrainConfig`` fields (None where not given), parsed the same way for
    ``train`` and ``finetune``; a resume replaces the run's settings with those that are not None."""
    def count(value, what, minimum=1):
        return None if value is None else parse_count(value, what, minimum=minimum)

    return dict(
        max_steps=count(limits.max_steps, "--max-steps"), max_tokens=count(limits.tokens, "--tokens"),
        max_minutes=minutes_from(limits.max_minutes),
        save_every=count(limits.save_every, "--save-every"), eval_every=count(limits.eval_every, "--eval-every"),
        eval_batches=count(checks.eval_batches, "--eval-batches"), keep=count(checks.keep, "--keep"),
        sample_tokens=count(checks.sample_tokens, "--sample-tokens", minimum=0),
        prompts=tuple(checks.prompt) if checks.prompt else None, verify_data=checks.verify_data,
        max_nonfinite=count(checks.max_nonfinite, "--max-nonfinite"),
    )


def device_from(device=None, device_memory=None):
    from memplan.hardware import device_from_flags

    return device_from_flags(device, device_memory)


def threads_from(text: str | None) -> int | None:
    """``--threads N`` parsed (None when not given); a bad value is one InputError line."""
    if text is None:
        return None
    try:
        n = int(str(text).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise InputError(f"--threads: {text!r} is not a positive whole number; accepted: 1 up to this machine's "
                         f"cores, e.g. 1 or {os.cpu_count() or 1}")
    return n


def use_threads(text: str | None) -> int:
    """Set torch's CPU threads for this process: ``--threads`` if given, else the count this machine's CPU
    calibration chose (``memplan.local.chosen_threads``), else torch's default. Returns the count in use."""
    n = threads_from(text)
    if n is None:
        from memplan.local import chosen_threads

        n = chosen_threads("cpu")
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def with_rates(data: dict, note: str | None) -> dict:
    """A command's JSON with ``rates``: the one line saying where the local device's rates come from (this
    machine's calibration, or the profile's nominal figures); absent for a named profile of another device."""
    return {**data, "rates": note} if note else data


def local_device_from(device=None, device_memory=None, threads: int | None = None):
    """``device_from`` with this machine's cached calibration applied where the device is this machine
    (``memplan.local.local_profile``): (device, one line saying where its rates come from, or None)."""
    from memplan.local import local_profile

    return local_profile(device, parse_size(device_memory, "--device-memory") if device_memory else None, threads)


def print_json(data) -> None:
    """The JSON document on stdout. A stdout that cannot take it (a full disk behind ``> file``,
    /dev/full) is one line, exit 1 (``EnvironmentFailure``), not a traceback."""
    try:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        sys.stdout.flush()
    except OSError as e:
        import os

        from memplan.errors import EnvironmentFailure

        try:  # what stayed in the buffer goes nowhere at exit, instead of failing again there
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        if isinstance(e, BrokenPipeError):  # the reader stopped reading (`| head`): as SIGPIPE ends a tool
            raise SystemExit(141) from None
        raise EnvironmentFailure(f"--json: cannot write the document to standard output: {e.strerror or e}") from None
