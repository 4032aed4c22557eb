"""``memplan estimate``: the analytic prediction, as tables or the contract's JSON."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memplan.cli import app
from memplan.cli.options import (ArchOpt, AttentionOpt, BatchOpt, CheckpointingOpt, CompileOpt, CtxOpt, DeviceMemoryOpt,
                                 DeviceOpt, FfnOpt, GradAccumOpt, HeadsOpt, HiddenOpt, JsonOpt, KvHeadsOpt, LayersOpt,
                                 ModelOpt, OptimizerOpt, ParamsOpt, PrecisionOpt, ShardingOpt, TiedOpt, VocabOpt,
                                 WorldSizeOpt, device_from, model_from, print_json, setup_from)
from memplan.units import format_bytes, format_count, format_seconds, parse_count

TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", help="Tokens in one epoch (e.g. 2b): prints the time it takes.", show_default=False)]

_TERM_HELP = {
    "weights": "parameters; autocast's bf16 copies",
    "gradients": "as many as the step has made",
    "optimizer": "AdamW moments / SGD momentum",
    "activations": "saved for backward; token ids",
    "logits": "LM head output, fp32 loss",
    "temporaries": "gradients in flight, scratch",
    "runtime": "context + allocator reserve",
}


def print_estimate(est) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    spec, setup, device, mem, t = est.model, est.setup, est.device, est.memory, est.time
    console.print(f"[bold]Model[/]  {spec.name or 'custom'}: {spec.describe()}  ({spec.params:,} parameters)")
    if spec.source:
        console.print(f"        shape from {spec.source}")
    console.print(f"[bold]Setup[/]  ctx {setup.ctx}, micro-batch {setup.micro_batch} × {setup.grad_accum} accumulation, "
                  f"{setup.precision}, {setup.attention} attention, checkpointing {setup.checkpointing}, "
                  f"{setup.optimizer}" + (f", {setup.world_size} × {setup.sharding}" if setup.world_size > 1 else ""))
    console.print(f"[bold]Device[/] {device.name} ({device.title}): {format_bytes(device.memory_bytes)}, "
                  f"{format_bytes(device.usable_bytes)} usable")

    for note in t.notes:  # what the step-time model assumed (memplan/timing.py): e.g. an fp32 fallback
        console.print(f"[yellow]note[/]: {note}")
    table = Table(title=f"Memory at the peak ({mem.peak_moment})", title_justify="left")
    table.add_column("term")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("what it holds", style="dim")
    for key in ("weights", "gradients", "optimizer", "activations", "logits", "temporaries", "runtime"):
        value = getattr(mem, key)
        table.add_row(key, format_bytes(value), f"{value / mem.peak_reserved:.0%}", _TERM_HELP[key])
    table.add_section()
    table.add_row("peak allocated", format_bytes(mem.peak_allocated), "", "live tensors")
    verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"
    table.add_row("[bold]peak reserved[/]", f"[bold]{format_bytes(mem.peak_reserved)}[/]", "",
                  f"{verdict} in {format_bytes(device.usable_bytes)}")
    console.print(table)
    if est.max_micro_batch:
        console.print(f"Largest micro-batch that fits: [bold]{est.max_micro_batch}[/]")
    else:
        console.print("[red]No micro-batch fits[/]: try checkpointing, a shorter context, or `memplan autotune`.")

    from memplan.cli.time_table import time_table

    console.print(time_table(t))
    line = (f"{format_count(t.flops_per_step)}FLOP per step, {t.tokens_per_second:,.0f} tokens/s, "
            f"MFU {t.mfu:.0%}")
    if t.epoch_seconds is not None:
        line += f"; {format_count(est.tokens)} tokens take [bold]{format_seconds(t.epoch_seconds)}[/]"
    console.print(line)


@app.command("estimate")
def estimate_command(
    params: ParamsOpt = None, model: ModelOpt = None, arch: ArchOpt = None, layers: LayersOpt = None,
    hidden: HiddenOpt = None, heads: HeadsOpt = None, kv_heads: KvHeadsOpt = None, ffn: FfnOpt = None,
    vocab: VocabOpt = None, tied: TiedOpt = None,
    ctx: CtxOpt = "1024", batch: BatchOpt = "1", grad_accum: GradAccumOpt = "1", precision: PrecisionOpt = "bf16-mixed",
    attention: AttentionOpt = "sdpa", checkpointing: CheckpointingOpt = "none", optimizer: OptimizerOpt = "adamw",
    world_size: WorldSizeOpt = "1", sharding: ShardingOpt = "none", compile: CompileOpt = False,
    device: DeviceOpt = None, device_memory: DeviceMemoryOpt = None,
    tokens: TokensOpt = None, json: JsonOpt = False,
) -> None:
    """Predict memory (term by term), whether it fits, the largest micro-batch, and step and epoch time."""
    from memplan.estimate import estimate

    spec = model_from(params, model, arch, layers, hidden, heads, kv_heads, ffn, vocab, tied)
    setup = setup_from(ctx, batch, grad_accum, precision, attention, checkpointing, optimizer, world_size, sharding,
                       compile)
    dev = device_from(device, device_memory)
    est = estimate(spec, setup, dev, parse_count(tokens, "--tokens") if tokens else None)
    if json:
        print_json(est.to_json())
    else:
        print_estimate(est)
