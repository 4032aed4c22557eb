"""``memplan estimate``: the analytic prediction, as tables or JSON (docs/json.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.fit import print_described, print_fields
from memplan.cli.options import (CustomShardedLayersOpt, DeviceFlags, FsdpReshardOpt, JsonOpt, ModelFlags, PrecisionOpt, SetupFlags,
                                 print_json, with_groups, with_rates)
from memplan.errors import InputError
from memplan.units import format_bytes, format_count, format_flop, format_seconds, parse_count

TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", metavar="N", help="Tokens in one epoch (e.g. 2b): prints the time it takes.", show_default=False)]

ModeOpt = Annotated[str, typer.Option(
    "--mode", metavar="MODE", help="training: one training step (the default). inference: generation with a KV cache (weights, "
                   "cache, one forward over the prompt, decode), the largest context and batch, tokens/s.")]
WeightsDtypeOpt = Annotated[Optional[str], typer.Option(
    "--weights-dtype", metavar="DTYPE", help="Inference: fp32 | bf16 | fp16 | int8 (GGUF Q8_0) | int4 (GGUF Q4_0); default bf16 "
                            "where the device runs it natively, else fp32.", show_default=False)]
KvDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-dtype", metavar="DTYPE", help="Inference: the KV cache's dtype, fp32 | bf16 | fp16 | int8; default the activations' "
                       "(fp16 with int8/int4 weights, as llama.cpp).", show_default=False)]
PromptTokensOpt = Annotated[Optional[str], typer.Option(
    "--prompt-tokens", metavar="N", help="Inference: prompt tokens prefilled in one forward (default: --ctx, the worst case); "
                            "--ctx is what the cache holds, prompt plus new tokens.", show_default=False)]
LoraRankOpt = Annotated[str, typer.Option(
    "--lora-rank", metavar="N", help="Training: LoRA finetuning with rank-R adapters (frozen weights: no gradients or optimizer "
                        "state; adapters get both); 0 trains every weight.")]
LoraTargetsOpt = Annotated[str, typer.Option(
    "--lora-targets", metavar="LIST", help="Training with --lora-rank: the matrices with adapters (comma-separated subset "
                           "of qkv, q, k, v, proj, up, down, head; qkv is q,k,v).")]
StackOpt = Annotated[str, typer.Option(
    "--stack", metavar="STACK", help="Training: whose code runs the step the memory walk follows: memplan (its own trainer) | "
                    "transformers (Hugging Face transformers' model and Trainer step, peft for --lora-rank; "
                    "llama, gpt2, gpt_neox, and phi, gemma, stablelm, qwen3, which memplan's own trainer does not "
                    "build) | litgpt (its GPT, pretrain.py / finetune/lora.py) | torchtune (its Llama builders, "
                    "single-device recipes). No library is imported: the walk's hooks model what each saves.")]
LossDtypeOpt = Annotated[Optional[str], typer.Option(
    "--loss-dtype", metavar="DTYPE", help="Training: fp32 (cross-entropy over logits.float(), as transformers and memplan do; "
                         "the default) | logits (over the logits in their own dtype, as a plain PyTorch loop "
                         "calling F.cross_entropy under autocast does).", show_default=False)]
EstLoraDropoutOpt = Annotated[Optional[float], typer.Option(
    "--lora-dropout", metavar="P", help="--stack transformers|litgpt|torchtune with --lora-rank: the adapters' dropout "
                           "(default: the library's, peft's and torchtune's 0.0, litgpt's 0.05). "
                           "Above 0, each adapted module saves its dropout's mask and output.", show_default=False)]
SamplingOpt = Annotated[str, typer.Option("--sampling", metavar="SAMPLING", help="Inference: top-k | greedy (how each token is chosen).")]
MODES = ("training", "inference")

_TERM_HELP = {
    "weights": "parameters; autocast's bf16 copies",
    "gradients": "as many as the step has made",
    "optimizer": "AdamW moments / SGD momentum",
    "activations": "saved for backward; token ids",
    "logits": "LM head output, fp32 loss",
    "temporaries": "gradients in flight, scratch",
    "runtime": "context + allocator reserve (CPU: + C heap)",
}


_SHARDED_HELP = {  # per device, under --world-size N
    "ddp": {"gradients": "DDP's buckets, the whole step"},
    "fsdp": {"weights": "this rank's shards; gathered layers", "gradients": "unsharded in flight; shards",
             "optimizer": "this rank's shards", "temporaries": "all-gather/reduce-scatter buffers"},
}


def print_estimate(est, rates_note: str | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    spec, setup, device, mem, t = est.model, est.setup, est.device, est.memory, est.time
    print_fields(console, [
        ("Model", f"{spec.name or 'custom'}: {spec.describe()}  ({spec.params:,} parameters)"),
        *([("", f"shape from {spec.source}")] if spec.source else []),
        *([("", f"[dim]{escape(spec.size_note())}[/]")] if spec.size_note() else []),
        ("Setup", f"ctx {setup.ctx}, micro-batch {setup.micro_batch} × {setup.grad_accum} accumulation, "
                  f"{setup.precision}, {setup.attention} attention, checkpointing {setup.checkpointing}, "
                  f"{setup.optimizer}" + (f", {setup.world_size} × {setup.sharding}" if setup.world_size > 1 else "")
                  + (f", LoRA rank {setup.lora_rank} on {setup.lora_targets}" if setup.lora_rank else "")
                  + est.stack.describe() + est.stack.fsdp_words(spec, setup)),
        ("Device", f"{device.name} ({device.title}): {format_bytes(device.memory_bytes)}, "
                   f"{format_bytes(device.usable_bytes)} usable"),
    ])

    for note in t.notes:  # what the step-time model assumed (memplan/timing.py): e.g. an fp32 fallback
        console.print(f"[yellow]note[/]: {note}")
    helps = {**_TERM_HELP, **(_SHARDED_HELP.get(setup.sharding, {}))}
    verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"

    from memplan.memory.compiled import compiled_modelled

    why_not = compiled_modelled(spec, setup, est.stack)
    compiled_ok = why_not is None

    def memory_table(described: bool):
        compiled = "" if not setup.compile or compiled_ok else " of the eager step: torch.compile's peak is not modelled"
        table = Table(title=f"Memory at the peak ({mem.peak_moment}){compiled}", title_justify="left")
        table.add_column("term", no_wrap=True)
        table.add_column("bytes", justify="right", no_wrap=True)
        table.add_column("share", justify="right", no_wrap=True)
        table.add_column("what it holds" if described else "", style="dim", no_wrap=not described)
        code = mem.runtime_terms.get("model_code", 0)  # a CPU's process holds the library's model code
        code_what = _CODE_HELP.get(est.stack.library, _CODE_HELP["transformers"])
        for key in ("weights", "gradients", "optimizer", "activations", "logits", "temporaries", "runtime"):
            value = getattr(mem, key)
            table.add_row(key, format_bytes(value), f"{value / mem.peak_reserved:.0%}", helps[key] if described else "")
        if code:
            table.add_row("  of it, model code", format_bytes(code), f"{code / mem.peak_reserved:.0%}",
                          code_what if described else "")
        compiled_code = mem.runtime_terms.get("compiled_code", 0)  # a CPU's process holds inductor and the kernels
        if compiled_code:
            table.add_row("  of it, compiled code", format_bytes(compiled_code),
                          f"{compiled_code / mem.peak_reserved:.0%}", _COMPILED_CODE_HELP if described else "")
        table.add_section()
        table.add_row("peak allocated", format_bytes(mem.peak_allocated), "", "live tensors" if described else "")
        table.add_row("[bold]peak reserved[/]", f"[bold]{format_bytes(mem.peak_reserved)}[/]"
                      + (" [yellow](eager)[/]" if setup.compile and not compiled_ok else ""), "",
                      f"{verdict} in {format_bytes(device.usable_bytes)}")
        return table, [(k, helps[k]) for k in helps] + [("peak allocated", "live tensors")] + (
            [("model code", code_what)] if code else []) + (
            [("compiled code", _COMPILED_CODE_HELP)] if compiled_code else [])

    print_described(console, memory_table)
    if setup.compile and not compiled_ok:
        console.print(f"[yellow]note[/]: {COMPILE_MEMORY_NOTE} ({why_not})")
    elif setup.compile:
        console.print("[dim]note: --compile: the memory above is the compiled step's (what inductor's partitioner "
                      "saves; `memplan trace --compile` traces it)[/]")
    if est.max_micro_batch:
        console.print(f"Largest micro-batch that fits: [bold]{est.max_micro_batch}[/]")
    else:
        print_levers(console, est)

    from memplan.cli.time_table import print_time_table

    print_time_table(console, t, caption=not rates_note)
    if rates_note:  # this machine's calibration or the nominal figures: one line, in place of the caption
        console.print(f"[dim]{escape(rates_note)}[/]")
    line = (f"{format_flop(t.flops_per_step)} per step, {t.tokens_per_second:,.0f} tokens/s, "
            f"MFU {t.mfu:.0%}")
    c = t.communication
    if c is not None and c.link is not None:
        console.print(f"Communication per step: {format_seconds(c.total_seconds)} of collectives "
                      f"({format_bytes(c.bytes_per_step)} over {c.link.kind}), "
                      + (f"{format_seconds(c.exposed_seconds)} of it not hidden behind the compute"
                         if c.overlapped else "none hidden (collectives block the compute on this device)"))
    if t.epoch_seconds is not None:
        line += f"; {format_count(est.tokens)} tokens take [bold]{format_seconds(t.epoch_seconds)}[/]"
    console.print(line)


# benchmarks/compile_memory.py, on this project's CPU (2-layer llama, hidden 256, ctx 256, micro-batch 4)
COMPILE_MEMORY_NOTE = ("--compile: the memory above is the eager step's; torch.compile's peak is not modelled here. "
                       "Measured on a CPU (inductor), it moved from -26% to +8% of the eager peak by stack, "
                       "precision and checkpointing (benchmarks/compile_memory.py): check it with a real step.")


def print_levers(console, est) -> None:
    """No micro-batch fits: each lever not already pulled, alone, with the peak it gives (memplan.advice)."""
    from memplan.advice import levers

    one = est.memory.peak_reserved if est.setup.micro_batch == 1 else None
    head = "[red]No micro-batch fits[/]" + (f": even micro-batch 1 needs {format_bytes(one)}" if one else "")
    found = levers(est.model, est.setup, est.device, est.stack)
    if not found:
        console.print(head + "; no lever of the setup lowers it: a smaller model or a device with more memory.")
        return
    console.print(head + ". Each change alone, re-estimated at micro-batch 1:")
    for lever in found:
        verdict = (f"[green]fits[/] (largest micro-batch {lever.max_micro_batch})" if lever.fits else
                   f"[red]{format_bytes(lever.peak_reserved - est.device.usable_bytes)} over[/]")
        console.print(f"  {lever.change}: {format_bytes(lever.peak_reserved)}, {verdict} [dim]({lever.what})[/]")
    console.print("[dim]`memplan autotune` combines them.[/]")


_INFERENCE_HELP = {
    "weights": "parameters in the weights' dtype",
    "kv_cache": "K and V of every layer, whole context",
    "activations": "one forward's tensors, token ids",
    "logits": "last position's fp32 logits, sampling",
    "runtime": "context + allocator reserve",
}


def print_inference(est, rates_note: str | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    spec, s, device, mem, t = est.model, est.setup, est.device, est.memory, est.time
    print_fields(console, [
        ("Model", f"{spec.name or 'custom'}: {spec.describe()}  ({spec.params:,} parameters)"),
        *([("", f"[dim]{escape(spec.size_note())}[/]")] if spec.size_note() else []),
        ("Run", f"cache {s.ctx} tokens, prompt {s.prompt_tokens}, batch {s.batch}, weights {s.weights_dtype}, "
                f"KV cache {s.cache_dtype}, activations {s.activation_dtype}, {s.sampling}"),
        ("Device", f"{device.name} ({device.title}): {format_bytes(device.memory_bytes)}, "
                   f"{format_bytes(device.usable_bytes)} usable"),
        *([("Rates", f"[dim]{escape(rates_note.removeprefix('rates: '))}[/]")] if rates_note else []),
    ])
    verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"

    def memory_table(described: bool):
        table = Table(title=f"Memory at the peak ({mem.peak_moment})", title_justify="left")
        table.add_column("term", no_wrap=True)
        table.add_column("bytes", justify="right", no_wrap=True)
        table.add_column("share", justify="right", no_wrap=True)
        table.add_column("what it holds", style="dim", no_wrap=not described)
        for key in ("weights", "kv_cache", "activations", "logits", "runtime"):
            value = getattr(mem, key)
            table.add_row(key.replace("_", " "), format_bytes(value), f"{value / mem.peak_reserved:.0%}",
                          _INFERENCE_HELP[key] if described else "")
        table.add_section()
        table.add_row("prefill peak", format_bytes(mem.prefill_peak_allocated), "", f"live tensors, at {mem.prefill_moment}")
        table.add_row("decode peak", format_bytes(mem.decode_peak_allocated), "", f"live tensors, at {mem.decode_moment}")
        table.add_row("[bold]peak reserved[/]", f"[bold]{format_bytes(mem.peak_reserved)}[/]", "",
                      f"{verdict} in {format_bytes(device.usable_bytes)}")
        return table, [(k.replace("_", " "), v) for k, v in _INFERENCE_HELP.items()]

    print_described(console, memory_table)
    console.print(f"Largest context at batch {s.batch}: [bold]{est.max_ctx:,}[/] tokens; largest batch at context "
                  f"{s.ctx}: [bold]{est.max_batch:,}[/]")
    console.print(f"Prefill: {format_seconds(t.prefill_seconds)} for {s.batch * s.prompt_tokens:,} tokens "
                  f"({t.prefill_tokens_per_second:,.0f} tokens/s, compute)")
    # the headline is the step validate --mode inference compares with: the roofline and the host's dispatch
    decode = s.batch / t.decode_step_seconds_with_dispatch if t.decode_step_seconds_with_dispatch else \
        t.decode_tokens_per_second
    console.print(f"Decode: {decode:,.1f} tokens/s at the full context with the host's dispatch "
                  f"({format_seconds(t.decode_dispatch_seconds)} a token step); the device's roofline alone: "
                  f"{t.decode_tokens_per_second:,.1f} ({t.decode_tokens_per_second_start:,.1f} after the prompt), "
                  f"{t.decode_bound}-bound ({format_bytes(t.bandwidth_bytes_per_second)}/s)")
    if est.device.family == "cpu":
        console.print("[dim]note: an upper bound on a CPU: the sampling loop's own Python and the cache's "
                      "updates are not modelled (`memplan validate --mode inference` measures this machine)[/]")
    for note in est.notes:
        console.print(f"[yellow]note[/]: {note}")


PlanStackOpt = Annotated[str, typer.Option(
    "--stack", metavar="STACK", help="Whose code runs the step every candidate's memory walk follows: memplan (its own trainer) | "
                    "transformers (Hugging Face transformers' model and Trainer step; also phi, gemma, stablelm, "
                    "qwen3) | litgpt | torchtune. As `memplan estimate --stack`.")]


@dataclass(frozen=True)
class SearchStack:
    """A search's model and the walk's hooks for ``--stack`` (autotune, sweep)."""

    spec: object  # memplan.model.ModelSpec
    stack: object  # memplan.memory.stacks.Stack


# estimate's table: whose code the CPU plan's model_code term keeps resident (memplan.memory.terms), by library
_COMPILED_CODE_HELP = "inductor's modules and the compiled graph's code kept resident"
_CODE_HELP = {"transformers": "transformers' (peft's) code kept resident",
              "litgpt": "litgpt's and lightning's code kept resident",
              "torchtune": "torchtune's and torchao's code kept resident"}


def stack_for_search(stack: str, model_flags) -> SearchStack:
    """``--stack`` of autotune and sweep, checked as estimate checks it (``memplan.memory.stacks.check_stack``, then
    ``check_stack_builds`` for the model's family), with the model resolved as estimate resolves it (a
    config.json of phi, gemma, stablelm or qwen3 accepted, for --stack transformers; ``model_flags``: a
    ``memplan.cli.options.ModelFlags``)."""
    from memplan.memory.stacks import check_stack, check_stack_builds, stack_for

    check_stack(stack)
    spec = model_flags.spec(stack_families=True)
    check_stack_builds(stack, spec)
    return SearchStack(spec=spec, stack=stack_for(stack))



@dataclass(frozen=True)
class EstimateSetupFlags(SetupFlags):
    """SETUP as estimate takes it: a precision not given is the device's best
    (``memplan.hardware.Device.best_precision``), as train and autotune take it."""

    precision: PrecisionOpt = None


@app.command("estimate")
@with_groups
def estimate_command(
    model_flags: ModelFlags = None, setup_flags: EstimateSetupFlags = None, device_flags: DeviceFlags = None,
    tokens: TokensOpt = None, json: JsonOpt = False, mode: ModeOpt = "training",
    weights_dtype: WeightsDtypeOpt = None, kv_dtype: KvDtypeOpt = None, prompt_tokens: PromptTokensOpt = None,
    sampling: SamplingOpt = "top-k", lora_rank: LoraRankOpt = "0", lora_targets: LoraTargetsOpt = "qkv,proj,up,down",
    stack: StackOpt = "memplan", loss_dtype: LossDtypeOpt = None, lora_dropout: EstLoraDropoutOpt = None,
    custom_sharded_layers: CustomShardedLayersOpt = "auto", fsdp_reshard_after_forward: FsdpReshardOpt = True,
) -> None:
    """Predict memory (term by term), whether it fits, the largest micro-batch, and step and epoch time.

    With --mode inference: the memory of generation (weights, KV cache, prefill and decode peaks), the
    largest context and batch that fit, and prefill and decode tokens/s."""
    from memplan.estimate import estimate
    from memplan.model import MEMPLAN_ARCHS
    from memplan.units import choice_error

    from memplan.memory.stacks import check_loss_dtype, check_stack, shown, stack_from_flags, with_custom_sharded_layers

    if mode not in MODES:
        raise choice_error("--mode", mode, list(MODES))
    check_stack(stack)
    if loss_dtype is not None:
        check_loss_dtype(loss_dtype)
    for flag, value in (("--stack", shown(stack)), ("--loss-dtype", loss_dtype),
                        ("--lora-dropout", lora_dropout),
                        ("--custom-sharded-layers", None if custom_sharded_layers == "auto" else custom_sharded_layers),
                        ("--no-fsdp-reshard-after-forward", None if fsdp_reshard_after_forward else False)):
        if value is not None and mode == "inference":
            raise InputError(f"{flag} applies to --mode training only; accepted with --mode inference: none")
    spec = model_flags.spec(stack_families=True)
    if mode == "inference":
        if not spec.memplan_builds:
            raise InputError(f"--mode inference: the {spec.arch} family is planned for training under --stack "
                             f"transformers only (accepted with --mode inference: {', '.join(MEMPLAN_ARCHS)})")
        from memplan.inference import InferenceSetup, estimate_inference

        dev, rates_note = device_flags.local_profile()
        setup = InferenceSetup(
            ctx=parse_count(setup_flags.ctx, "--ctx", binary=True), batch=parse_count(setup_flags.batch, "--batch"),
            prompt=parse_count(prompt_tokens, "--prompt-tokens", binary=True) if prompt_tokens else None,
            weights_dtype=weights_dtype or ("bf16" if dev.supports("bf16") else "fp32"),
            kv_dtype=kv_dtype, sampling=sampling)
        est = estimate_inference(spec, setup, dev)
        if json:
            print_json(with_rates(est.to_json(), rates_note))
        else:
            print_inference(est, rates_note)
        return
    for flag, value in (("--weights-dtype", weights_dtype), ("--kv-dtype", kv_dtype),
                        ("--prompt-tokens", prompt_tokens)):
        if value is not None:
            raise InputError(f"{flag} applies to --mode inference only; accepted with --mode training: none")
    dev, rates_note = device_flags.local_profile()
    # not given: the device's best, as train and autotune take it (memory and time of the same precision)
    chosen = setup_flags.precision or dev.best_precision
    setup = setup_flags.setup(precision=chosen)
    rank = int(parse_count(lora_rank, "--lora-rank")) if lora_rank not in ("0", "") else 0
    if rank:
        setup = setup.replace(lora_rank=rank, lora_targets=lora_targets)
    walk = stack_from_flags(stack, loss_dtype, lora_dropout, spec, setup)
    if custom_sharded_layers != "auto" or not fsdp_reshard_after_forward:  # torchtune's FSDP2 layout, not the
        walk = with_custom_sharded_layers(walk, custom_sharded_layers, spec, setup,  # published configs' choice
                                          fsdp_reshard_after_forward)
    est = estimate(spec, setup, dev, parse_count(tokens, "--tokens") if tokens else None, stack=walk)
    if json:
        from memplan.advice import levers

        advice = [lever.to_json() for lever in levers(spec, setup, dev, walk)] if not est.max_micro_batch else []
        data = {**est.to_json(), "advice": advice}
        if setup.compile:  # the compiled step's figures, or why memory is the eager step's
            from memplan.memory.compiled import compile_memory_json

            eager = estimate(spec, setup.replace(compile=False), dev, stack=walk).memory.peak_allocated
            data["compile_memory"] = compile_memory_json(spec, setup, est.memory.peak_allocated, eager, walk)
        print_json(with_rates(data, rates_note))
    else:
        print_estimate(est, rates_note)
        from memplan.units import resolved

        from rich.console import Console

        units = resolved([("--tokens", tokens, est.tokens)])
        if units:  # 2b tokens is 2,000,000,000
            Console(highlight=False).print(f"[dim]note: {units}[/]")
        if setup_flags.precision is None:
            Console(highlight=False).print(f"[dim]note: precision {chosen}, {dev.name}'s best (--precision to "
                                           "choose)[/]")
