"""``memplan trace``: the exact live-tensor peak of two real training steps of the reference model, on fake tensors."""

from __future__ import annotations

from memplan.cli import app
from memplan.cli.estimate import TokensOpt
from memplan.cli.options import (ArchOpt, AttentionOpt, BatchOpt, CheckpointingOpt, CompileOpt, CtxOpt, DeviceMemoryOpt,
                                 DeviceOpt, FfnOpt, GradAccumOpt, HeadsOpt, HiddenOpt, JsonOpt, KvHeadsOpt, LayersOpt,
                                 ModelOpt, OptimizerOpt, ParamsOpt, PrecisionOpt, ShardingOpt, TiedOpt, VocabOpt,
                                 WorldSizeOpt, device_from, model_from, print_json, setup_from)
from memplan.units import format_bytes, parse_count

TRACE_CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


def traced_json(est, traced) -> dict:
    """The JSON of ``memplan estimate`` (docs/json.md) with the memory object replaced by the trace.

    The tracer sorts tensors by when they were made (MemTracker: forward → activations, backward
    → temporaries, ``.grad`` → gradients, optimizer step → optimizer), so its split differs
    from the planner's; peak_allocated is the exact figure. ``fits`` follows the traced peak;
    ``max_micro_batch`` and ``time`` stay analytic.
    """
    from memplan.memory import runtime_bytes

    device = est.device
    runtime = runtime_bytes(traced.peak_allocated, device.runtime_context_bytes, device.allocator_overhead)
    memory = {k: int(traced.breakdown.get(k, 0)) for k in TRACE_CATEGORIES}
    memory["weights"] += int(traced.breakdown.get("other", 0))
    memory.update(runtime=runtime, peak_allocated=traced.peak_allocated, peak_reserved=traced.peak_allocated + runtime,
                  peak_phase=est.memory.peak_phase)
    data = est.to_json()
    data["memory"] = memory
    data["fits"] = memory["peak_reserved"] <= device.usable_bytes
    data["trace"] = {"method": traced.method, "analytic_peak_allocated": est.memory.peak_allocated,
                     "analytic_error": (est.memory.peak_allocated - traced.peak_allocated) / traced.peak_allocated}
    return data


@app.command("trace")
def trace_command(
    params: ParamsOpt = None, model: ModelOpt = None, arch: ArchOpt = None, layers: LayersOpt = None,
    hidden: HiddenOpt = None, heads: HeadsOpt = None, kv_heads: KvHeadsOpt = None, ffn: FfnOpt = None,
    vocab: VocabOpt = None, tied: TiedOpt = None,
    ctx: CtxOpt = "1024", batch: BatchOpt = "1", grad_accum: GradAccumOpt = "1", precision: PrecisionOpt = "bf16-mixed",
    attention: AttentionOpt = "sdpa", checkpointing: CheckpointingOpt = "none", optimizer: OptimizerOpt = "adamw",
    world_size: WorldSizeOpt = "1", sharding: ShardingOpt = "none", compile: CompileOpt = False,
    device: DeviceOpt = None, device_memory: DeviceMemoryOpt = None,
    tokens: TokensOpt = None, json: JsonOpt = False,
) -> None:
    """Trace two training steps of the reference model on fake tensors (nothing is allocated) and report the exact peak.

    With --world-size N --sharding fsdp: rank 0 of an FSDP2 step, the other ranks stood in for by a
    fake process group (collectives as NCCL runs them)."""
    from memplan.errors import InputError
    from memplan.estimate import estimate

    spec = model_from(params, model, arch, layers, hidden, heads, kv_heads, ffn, vocab, tied)
    setup = setup_from(ctx, batch, grad_accum, precision, attention, checkpointing, optimizer, world_size, sharding,
                       compile)
    if setup.sharding == "ddp":
        raise InputError("trace --sharding ddp: DDP's C++ reducer cannot run on fake tensors; a DDP rank holds the "
                         "single-process step plus its gradient buckets (`memplan estimate`), measured for real by "
                         "`memplan validate --world-size N`; trace follows --sharding fsdp or one process")
    if setup.optimizer == "adamw8bit":
        raise InputError("trace cannot run bitsandbytes' 8-bit optimizer on fake tensors; accepted: adamw, "
                         "adamw-fused, sgd")
    dev = device_from(device, device_memory)
    est = estimate(spec, setup, dev, parse_count(tokens, "--tokens") if tokens else None)

    import dataclasses

    import torch

    from trainer.measure import trace_step

    fake_device = "cuda" if dev.family in ("cuda", "rocm") and torch.cuda.is_available() else "cpu"
    if setup.world_size > 1:  # rank 0 of an FSDP2 step, the other ranks a fake process group
        from memplan.memory import peak_memory, sdpa_gqa_repeats
        from trainer.distributed import trace_rank_step

        traced = trace_rank_step(spec, setup, 0, fake_device)
        # the fake process group allocates as NCCL does: compare with that prediction
        repeat = sdpa_gqa_repeats(spec, setup, dev.flash_attention, dev.family)
        est = dataclasses.replace(est, memory=peak_memory(spec, setup, dev.runtime_context_bytes,
                                                          dev.allocator_overhead, repeat, collectives="nccl"))
    else:
        traced = trace_step(spec, setup, fake_device)
    data = traced_json(est, traced)
    if json:
        print_json(data)
        return
    from rich.console import Console
    from rich.table import Table

    from memplan.cli.fit import print_fields

    console = Console()
    print_fields(console, [("Model", spec.describe()),
                           ("Setup", f"ctx {setup.ctx}, batch {setup.micro_batch}, {setup.precision}, {setup.attention}, "
                                     f"checkpointing {setup.checkpointing}, {setup.optimizer}")])
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
    console.print(f"analytic estimate: {format_bytes(est.memory.peak_allocated)} "
                  f"({data['trace']['analytic_error']:+.2%} against the trace); "
                  f"{'fits' if data['fits'] else 'does not fit'} in {format_bytes(dev.usable_bytes)} on {dev.name}")
