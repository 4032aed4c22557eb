"""``memplan trace``: the exact live-tensor peak of two real training steps, on fake tensors: of memplan's
own model, or (``--stack``) of the model and step of the library the user trains with (trainer/stacks)."""

from __future__ import annotations

from typing import Annotated

import typer

from memplan.cli.app import app
from memplan.cli.fit import print_labelled
from memplan.cli.estimate import EstimateSetupFlags, LoraRankOpt, LoraTargetsOpt, TokensOpt
from memplan.cli.options import DeviceFlags, JsonOpt, ModelFlags, print_json, with_groups
from memplan.errors import InputError
from memplan.memory.stacks import STACKS as STACKS_WALKED, stack_class
from memplan.units import format_bytes, parse_count

TRACE_CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


StackOpt = Annotated[str, typer.Option(
    "--stack", metavar="STACK", help="Whose training code to trace: memplan (its own trainer) | transformers (Hugging Face "
                    "transformers, with peft for --lora-rank) | litgpt (litgpt's GPT, pretrain.py's step or "
                    "finetune/lora.py's with --lora-rank) | torchtune (its Llama builders and single-device "
                    "recipes' step). transformers needs `pip install 'memplan\\[stacks]'`, litgpt 'memplan\\[litgpt]', "
                    "torchtune 'memplan\\[torchtune]' (each of the last two in its own environment).")]
LoraDropoutOpt = Annotated[float | None, typer.Option(
    "--lora-dropout", metavar="P", help="--stack transformers|litgpt|torchtune with --lora-rank: the adapters' dropout "
                           "(default: the library's own: peft's 0.0, litgpt finetune_lora's 0.05, torchtune's "
                           "configs' 0.0). Above 0, each adapter saves its dropout's mask and output.")]


def traced_memory(traced, device) -> dict:
    """The ``memory`` object of ``trace --json`` from a trace: its categories (MemTracker's "other" counted with
    the weights), and the device's runtime on top of the traced peak for ``peak_reserved``."""
    from memplan.memory import runtime_bytes

    runtime = runtime_bytes(traced.peak_allocated, device.runtime_context_bytes, device.allocator_overhead)
    memory = {k: int(traced.breakdown.get(k, 0)) for k in TRACE_CATEGORIES}
    memory["weights"] += int(traced.breakdown.get("other", 0))
    memory.update(runtime=runtime, peak_allocated=traced.peak_allocated, peak_reserved=traced.peak_allocated + runtime)
    return memory


def traced_json(est, traced) -> dict:
    """The JSON of ``memplan estimate`` (docs/json.md) with the memory object replaced by the trace.

    The tracer sorts tensors by when they were made (MemTracker: forward → activations, backward
    → temporaries, ``.grad`` → gradients, optimizer step → optimizer), so its split differs
    from the planner's; peak_allocated is the exact figure. ``fits`` follows the traced peak;
    ``max_micro_batch`` and ``time`` stay analytic.
    """
    device = est.device
    memory = {**traced_memory(traced, device), "peak_phase": est.memory.peak_phase}
    data = est.to_json()
    data["memory"] = memory
    data["fits"] = memory["peak_reserved"] <= device.usable_bytes
    data["trace"] = {"method": traced.method, "analytic_peak_allocated": est.memory.peak_allocated,
                     "analytic_error": (est.memory.peak_allocated - traced.peak_allocated) / traced.peak_allocated}
    return data


def read_hf_config(path: str) -> dict | None:
    """The contents of ``path`` when it is a Hugging Face config.json (a JSON object with a
    ``model_type``), else None (a size or preset name); a file that is not one is an InputError."""
    from pathlib import Path

    from memplan.model import read_config

    if not (path.endswith(".json") or Path(path).is_file() or Path(path).is_dir()):
        return None
    cfg = read_config(Path(path))
    if not isinstance(cfg.get("model_type"), str):
        raise InputError(f"--model: {path!r} has no model_type; accepted: a Hugging Face config.json")
    return cfg


def stack_json(stack: str, cfg: dict, setup, dev, traced, params: int | None) -> dict:
    """``trace --json`` for a model memplan's analytic walk does not cover (a config.json of another
    family, traced through its library): the trace alone, with the setup and the device."""
    memory = traced_memory(traced, dev)
    return {"stack": stack, "model": {"model_type": cfg.get("model_type"), "params": params},
            "setup": setup.to_json(),
            "device": dev.name, "memory": memory, "fits": memory["peak_reserved"] <= dev.usable_bytes,
            "trace": {"method": traced.method, "stack": stack}}


@app.command("trace")
@with_groups
def trace_command(
    model_flags: ModelFlags = None, setup_flags: EstimateSetupFlags = None, device_flags: DeviceFlags = None,
    tokens: TokensOpt = None, json: JsonOpt = False, stack: StackOpt = "memplan",
    lora_rank: LoraRankOpt = "0", lora_targets: LoraTargetsOpt = "qkv,proj,up,down",
    lora_dropout: LoraDropoutOpt = None,
) -> None:
    """Trace two training steps on fake tensors (nothing is allocated) and report the exact peak.

    --stack memplan traces memplan's own model and step; --stack transformers builds transformers'
    model for the shape (or for --model config.json, any family transformers builds) and takes its
    step as transformers' Trainer does, with peft's LoRA for --lora-rank; --stack litgpt and
    --stack torchtune build that library's model for the shape and take its scripts' step, with
    its own LoRA and checkpointing. With --world-size N
    --sharding fsdp (--stack memplan|litgpt|torchtune): rank 0 of the stack's own FSDP step, the other ranks
    stood in for by a fake process group (collectives as NCCL runs them)."""
    from trainer.stacks import check_stack

    check_stack(stack)
    # not given: the device's best, as estimate takes it (the trace and the walk it is compared with are one step)
    setup = setup_flags.setup(precision=setup_flags.precision or device_flags.profile().best_precision)
    rank = parse_count(lora_rank, "--lora-rank") if lora_rank not in ("0", "") else 0
    if rank:
        setup = setup.replace(lora_rank=rank, lora_targets=lora_targets)
    if lora_dropout is not None and (not stack_class(stack).has_lora_dropout or not rank
                                     or not 0.0 <= lora_dropout < 1.0):
        raise InputError(f"--lora-dropout {lora_dropout}: a probability in [0, 1) for --stack "
                         "transformers|litgpt|torchtune with --lora-rank (memplan's own adapters have no dropout)")
    if stack_class(stack).library:
        return _trace_stack(stack, setup, model_flags, device_flags, tokens, json, lora_dropout)
    from memplan.estimate import estimate
    from memplan.memory.stacks import check_stack_builds, check_stack_setup

    spec = model_flags.spec()
    check_stack_builds(stack, spec)  # llama, gpt2, gpt_neox: the others are traced with --stack transformers
    check_stack_setup(stack, spec, setup)  # what memplan's trainer does not run (as estimate refuses it)
    if setup.sharding == "ddp":
        raise InputError("trace --sharding ddp: DDP's C++ reducer cannot run on fake tensors; a DDP rank holds the "
                         "single-process step plus its gradient buckets (`memplan estimate`), measured for real by "
                         "`memplan validate --world-size N`; trace follows --sharding fsdp or one process")
    if setup.optimizer == "adamw8bit":
        raise InputError("trace cannot run bitsandbytes' 8-bit optimizer on fake tensors; accepted: adamw, "
                         "adamw-fused, sgd")
    dev = device_flags.profile()
    est = estimate(spec, setup, dev, parse_count(tokens, "--tokens") if tokens else None)

    import dataclasses

    import torch

    from trainer.measure import check_trace_time, trace_step

    fake_device = "cuda" if dev.family in ("cuda", "rocm") and torch.cuda.is_available() else "cpu"
    if setup.compile and setup.world_size > 1:
        raise InputError("trace --compile: one process only (--world-size 1); a sharded step is traced eager")
    accelerator = dev.family in ("cuda", "rocm") and fake_device == "cpu"
    if setup.world_size > 1:  # rank 0 of an FSDP2 step, the other ranks a fake process group
        from memplan.memory import peak_memory, sdpa_gqa_repeats
        from trainer.distributed import trace_rank_step

        check_trace_time(spec, setup, lambda s, st: trace_rank_step(s, st, 0, fake_device))
        traced = trace_rank_step(spec, setup, 0, fake_device)
        # the fake process group allocates as NCCL does: compare with that prediction
        repeat = sdpa_gqa_repeats(spec, setup, dev.flash_attention, dev.family)
        est = dataclasses.replace(est, memory=peak_memory(spec, setup, dev.runtime_context_bytes,
                                                          dev.allocator_overhead, repeat, collectives="nccl"))
    elif setup.compile:  # inductor's partitioner on fake tensors (trainer.compiled_trace)
        from trainer.compiled_trace import trace_compiled_step

        traced = trace_compiled_step(spec, setup, fake_device)
    else:
        check_trace_time(spec, setup, lambda s, st: trace_step(s, st, fake_device, accelerator=accelerator))
        traced = trace_step(spec, setup, fake_device, accelerator=accelerator)
    data = traced_json(est, traced)
    data["stack"] = stack
    if setup.compile:
        data["trace"]["compiled"] = {k: traced.terms.get(k, 0) for k in ("forward_saved", "forward_nodes",
                                                                         "backward_nodes")}
    if json:
        print_json(data)
        return
    _print_trace(spec.describe(), setup, traced, data, est, dev, stack)


def _trace_stack(stack, setup, model_flags, device_flags, tokens, json, lora_dropout) -> None:
    """``trace --stack S`` for another library's code (trainer/stacks)."""
    import torch

    from memplan.estimate import estimate
    from trainer.stacks import StackModel, trace_stack

    if setup.compile:
        raise InputError(f"trace --stack {stack} --compile: the compiled step is traced for memplan's own trainer "
                         "(--stack memplan); accepted for other stacks: their eager step (no --compile)")
    if setup.world_size > 1:
        _check_rank_trace(stack, setup)
    dev = device_flags.profile()
    fake_device = "cuda" if dev.family in ("cuda", "rocm") and torch.cuda.is_available() else "cpu"
    accelerator = dev.family in ("cuda", "rocm") and fake_device == "cpu"  # dropout as CUDA's kernels run it
    model = model_flags.model
    cfg = read_hf_config(model) if model else None
    spec = None
    if cfg is not None and any(v is not None for k, v in model_flags.values().items() if k not in ("params", "model")):
        raise InputError(f"--model {model}: with --stack {stack} the config.json is the model; edit it rather than "
                         "passing shape flags (--arch, --layers, ...)")
    try:
        spec = model_flags.spec()
    except InputError:
        if cfg is None:
            raise  # not a config file: the shape itself is wrong
    if setup.world_size > 1:
        return _trace_stack_rank(stack, spec, cfg, setup, dev, fake_device, accelerator, tokens, json, lora_dropout)
    if cfg is None:
        from trainer.measure import check_trace_time

        check_trace_time(spec, setup, lambda s, st: trace_stack(stack, StackModel(spec=s, hf_config=None), st,
                                                                fake_device, lora_dropout=lora_dropout))
    traced = trace_stack(stack, StackModel(spec=None if cfg is not None else spec, hf_config=cfg), setup,
                         fake_device, lora_dropout=lora_dropout, accelerator=accelerator)
    from memplan.memory.stacks import check_stack_builds, check_stack_setup, stack_for

    if spec is not None:
        try:  # the walk of the same stack (estimate --stack S), where it covers the step
            check_stack_builds(stack, spec, STACKS_WALKED)
            check_stack_setup(stack, spec, setup)
        except InputError:
            spec, cfg = None, cfg or {"model_type": spec.arch}
    if spec is None:  # a family or a step memplan's analytic walk does not cover: the trace alone
        data = stack_json(stack, cfg, setup, dev, traced, traced.params)
        if json:
            print_json(data)
            return
        _print_trace(f"{cfg.get('model_type')} from {model} ({traced.params:,} parameters)", setup, traced, data,
                     None, dev, stack)
        return
    walked = stack_for(stack, lora_dropout=lora_dropout)  # the walk of the same stack (estimate --stack S)
    est = estimate(spec, setup, dev, parse_count(tokens, "--tokens") if tokens else None, stack=walked)
    data = traced_json(est, traced)
    data["stack"] = stack
    data["trace"]["stack"] = stack
    data["trace"]["analytic_stack"] = stack
    if json:
        print_json(data)
        return
    _print_trace(spec.describe(), setup, traced, data, est, dev, stack)


def _check_rank_trace(stack: str, setup) -> None:
    """The one-line InputError for a sharded step of ``stack`` that ``trace`` does not take: rank 0 of litgpt's and
    torchtune's own FSDP step is traced (``trainer.stacks.ranks.trace_stack_rank``); DDP's reducer cannot run on fake
    tensors; transformers' Trainer over several ranks is not run here."""
    if stack == "transformers":
        raise InputError("trace --stack transformers: one process only (--world-size 1); sharded steps are traced "
                         "for --stack memplan|litgpt|torchtune with --sharding fsdp")
    if setup.sharding == "ddp" and stack == "litgpt":  # (torchtune has none: the walk's check names it)
        raise InputError(f"trace --stack {stack} --sharding ddp: DDP's C++ reducer cannot run on fake tensors; "
                         f"`memplan estimate --stack {stack} --sharding ddp` walks it; trace follows --sharding fsdp "
                         "or one process")


def _trace_stack_rank(stack, spec, cfg, setup, dev, fake_device, accelerator, tokens, json, lora_dropout) -> None:
    """``trace --stack litgpt|torchtune --world-size N --sharding fsdp``: rank 0 of the library's own sharded step
    (its ``wrap_ranks``, the walk's default layout) under a fake process group, against the walk of that rank with
    collectives as NCCL runs them (the fake group's allocate nothing, as NCCL's; gloo's reduce-scatter copies)."""
    import dataclasses

    from memplan.estimate import estimate
    from memplan.memory import sdpa_gqa_repeats
    from memplan.memory.peak import peak_memory_of_rank
    from memplan.memory.stacks import check_stack_setup, stack_for, walked_for
    from trainer.measure import check_trace_time
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import trace_stack_rank

    if cfg is not None:
        raise InputError(f"--model {cfg.get('model_type')} config.json: a sharded step of --stack {stack} is traced "
                         "for a shape memplan walks (--arch, --layers, ...)")
    check_stack_setup(stack, spec, setup)  # what the walk of the stack's sharded step takes (as estimate refuses it)
    check_trace_time(spec, setup, lambda s, st: trace_stack_rank(stack, StackModel(spec=s), st, fake_device,
                                                                 lora_dropout=lora_dropout, accelerator=accelerator))
    traced = trace_stack_rank(stack, StackModel(spec=spec), setup, fake_device, lora_dropout=lora_dropout,
                              accelerator=accelerator)
    walked = stack_for(stack, lora_dropout=lora_dropout)  # the walk of the same stack (estimate --stack S)
    est = estimate(spec, setup, dev, parse_count(tokens, "--tokens") if tokens else None, stack=walked)
    on = walked_for(walked, setup).on_cpu(dev.family == "cpu")  # as memplan.estimate.memory_on takes it
    repeat = sdpa_gqa_repeats(spec, setup, dev.flash_attention, dev.family) and on.walks_sdpa_gqa_repeat
    est = dataclasses.replace(est, memory=peak_memory_of_rank(spec, setup, 0, dev.runtime_context_bytes,
                                                              dev.allocator_overhead, repeat, collectives="nccl",
                                                              stack=on))
    data = traced_json(est, traced)
    data["stack"] = stack
    data["trace"].update(stack=stack, analytic_stack=stack, rank=0)
    if json:
        print_json(data)
        return
    _print_trace(spec.describe(), setup, traced, data, est, dev, stack)


def _print_trace(described: str, setup, traced, data: dict, est, dev, stack: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from memplan.cli.fit import print_fields

    console = Console()
    lora = f", LoRA rank {setup.lora_rank} on {setup.lora_targets}" if setup.lora_rank else ""
    print_fields(console, [("Stack", stack), ("Model", described),
                           ("Setup", f"ctx {setup.ctx}, batch {setup.micro_batch}, {setup.precision}, {setup.attention}, "
                                     f"checkpointing {setup.checkpointing}, {setup.optimizer}{lora}")])
    table = Table(title=f"Traced peak ({traced.method})", title_justify="left")
    table.add_column("category (by when a tensor was made)")
    table.add_column("bytes", justify="right")
    for key in (*TRACE_CATEGORIES, "runtime"):
        if data["memory"][key]:
            table.add_row(key, format_bytes(data["memory"][key]))
    table.add_section()
    table.add_row("peak allocated", format_bytes(traced.peak_allocated))
    table.add_row("peak reserved", format_bytes(data["memory"]["peak_reserved"]))
    console.print(table)
    fits = f"{'fits' if data['fits'] else 'does not fit'} in {format_bytes(dev.usable_bytes)} on {dev.name}"
    if est is None:
        print_labelled(console, f"{fits}; memplan's analytic walk does not cover this family (the trace is exact "
                                "for it)")
    elif not stack_class(stack).library:
        print_labelled(console, f"analytic estimate: {format_bytes(est.memory.peak_allocated)} "
                                f"({data['trace']['analytic_error']:+.2%} against the trace); {fits}")
    else:
        print_labelled(console, f"estimate --stack {stack}: {format_bytes(est.memory.peak_allocated)} "
                                f"({data['trace']['analytic_error']:+.2%} against the {stack} trace); {fits}")
