"""``memplan finetune``: supervised finetuning of a trained run on JSONL instructions, fully or with LoRA."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.fit import print_fields
from memplan.cli.options import (AttentionOpt, CheckFlags, CheckpointingOpt, DeviceFlags, Flags, LimitFlags, LogOpt,
                                 OptimizerOpt, SeedOpt, ThreadsOpt, TrainStackOpt, run_control_from, seed_from,
                                 threads_from, with_groups)
from memplan.errors import InputError

RunOpt = Annotated[Optional[str], typer.Option("--run", metavar="RUN", help="The trained run to start from (its newest checkpoint).",
                                                show_default=False)]
FromOpt = Annotated[Optional[str], typer.Option(
    "--from", metavar="PATH", help="Start from a Hugging Face checkpoint directory instead of a run: config.json (llama, mistral, "
                   "qwen2, gpt2, gpt_neox; qwen3, gemma, phi, stablelm in transformers' model class), model.safetensors or its shards, tokenizer.json; a Hub id is looked up "
                   "in the local Hugging Face cache only.", show_default=False)]
DataOpt = Annotated[str, typer.Option(
    "--data", metavar="DIR", help='JSONL, one example a line: {"prompt": ..., "response": ...} or {"messages": [{"role": '
                   '"system"|"user"|"assistant", "content": ...}, ...]}. The loss is on the responses only.')]
OutOpt = Annotated[str, typer.Option("--out", metavar="PATH", help="The finetune's run directory (checkpoints, metrics, report).")]
LoraRankOpt = Annotated[int, typer.Option("--lora-rank", metavar="N", help="LoRA rank; 0 finetunes every weight.")]
LoraAlphaOpt = Annotated[float, typer.Option("--lora-alpha", metavar="X", help="LoRA scale numerator: updates are B·A·alpha/rank.")]
LoraTargetsOpt = Annotated[str, typer.Option(
    "--lora-targets", metavar="LIST", help="The matrices that get adapters: all (qkv, proj, up, down), or a comma-separated "
                           "subset of qkv, q, k, v, proj, up, down, head (qkv is q,k,v).")]
TemplateOpt = Annotated[str, typer.Option(
    "--template", metavar="NAME|FILE", help="chat: '### User:\\n{prompt}\\n\\n### Assistant:\\n{response}' (prompt the finetuned model "
                       "the same way); plain: prompt and response as they are.")]
PackingOpt = Annotated[str, typer.Option(
    "--packing", metavar="PACKING", help="packed: examples back to back in rows of --ctx tokens; padded: one example a row.")]
FtCtxOpt = Annotated[Optional[str], typer.Option("--ctx", metavar="N", help="Context of a row; default: the base run's.",
                                                 show_default=False)]
FtBatchOpt = Annotated[Optional[str], typer.Option(
    "--batch", metavar="N", help="Micro-batch; default: autotuned (with --grad-accum) for the device and the LoRA setup.",
    show_default=False)]
FtAccumOpt = Annotated[Optional[str], typer.Option("--grad-accum", metavar="N", help="Micro-batches per step (with --batch).",
                                                   show_default=False)]
FtPrecisionOpt = Annotated[Optional[str], typer.Option(
    "--precision", metavar="PRECISION", help="fp32 | tf32 | bf16-mixed | fp16-mixed | bf16; default: the base run's.", show_default=False)]
GlobalBatchOpt = Annotated[Optional[str], typer.Option(
    "--global-batch-tokens", metavar="N", help="Tokens per optimizer step for autotune; default 8 rows of --ctx.",
    show_default=False)]
BudgetOpt = Annotated[Optional[str], typer.Option("--budget", metavar="SIZE", help="Memory budget for autotune (e.g. 6GiB).",
                                                  show_default=False)]
LrOpt = Annotated[Optional[float], typer.Option(
    "--lr", metavar="X", help="Peak learning rate; default 2e-4 with LoRA, 3e-5 for a full finetune.", show_default=False)]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the finetune in --out from its newest checkpoint.")]
FtNprocOpt = Annotated[Optional[str], typer.Option(
    "--nproc", metavar="N", help="Finetune in N processes (torchrun: one per GPU, else N CPU processes over gloo), with DDP for "
                    "--batch, else DDP or FSDP2 as autotune plans it: every rank builds the base weights and the "
                    "adapters, only the trainable weights' gradients are "
                    "reduced; each rank runs --batch × --grad-accum per step (autotuned: the same global batch as "
                    "one process).", show_default=False)]


@dataclasses.dataclass(frozen=True)
class LoraFlags(Flags):
    """finetune's adapters: rank (0: every weight), scale, the matrices that get them."""

    lora_rank: LoraRankOpt = 0
    lora_alpha: LoraAlphaOpt = 16.0
    lora_targets: LoraTargetsOpt = "all"


@dataclasses.dataclass(frozen=True)
class FinetuneSetupFlags(Flags):
    """finetune's SETUP: a row's context, the micro-batch and accumulation (None: autotuned), the precision
    (None: the base run's); attention, checkpointing and optimizer as every command takes them."""

    ctx: FtCtxOpt = None
    batch: FtBatchOpt = None
    grad_accum: FtAccumOpt = None
    precision: FtPrecisionOpt = None
    attention: AttentionOpt = "sdpa"
    checkpointing: CheckpointingOpt = "none"
    optimizer: OptimizerOpt = "adamw"


@dataclasses.dataclass(frozen=True)
class FinetuneAutotuneFlags(Flags):
    """What finetune's autotune keeps (without --batch): the global batch and the budget."""

    global_batch_tokens: GlobalBatchOpt = None
    budget: BudgetOpt = None


@app.command("finetune")
@with_groups
def finetune_command(
    data: DataOpt, out: OutOpt, run: RunOpt = None, from_: FromOpt = None, lora: LoraFlags = None,
    template: TemplateOpt = "chat", packing: PackingOpt = "packed", setup: FinetuneSetupFlags = None,
    autotune: FinetuneAutotuneFlags = None, lr: LrOpt = None,
    limits: LimitFlags = None, checks: CheckFlags = None, seed: SeedOpt = None, resume: ResumeOpt = False,
    device: DeviceFlags = None, threads: ThreadsOpt = None, log: LogOpt = None, nproc: FtNprocOpt = None, stack: TrainStackOpt = None,
) -> None:
    """Finetune a trained run (--run) or a Hugging Face checkpoint (--from) on instructions (loss on the responses only), with LoRA or every weight; planned,
    checkpointed and resumable like `memplan train`."""
    from rich.console import Console

    from memplan.units import parse_count, parse_size
    from trainer import distributed
    from trainer.finetune_run import FinetuneRequest, resolve_finetune, start_finetune
    from trainer.lora import parse_targets
    from trainer.loggers import check_loggers

    check_loggers(log, out)  # a bad --log is refused before anything runs (or is created)
    n = parse_count(nproc, "--nproc") if nproc is not None else 1
    _, launched, _ = distributed.env_world()
    if n > 1 and launched > 1:
        raise InputError(f"--nproc {n}: this process is already one of {launched} started by torchrun; drop --nproc")
    request = FinetuneRequest(
        data=data, out=out, run=run, from_=from_, lora_rank=lora.lora_rank, lora_alpha=lora.lora_alpha,
        lora_targets=",".join(parse_targets(lora.lora_targets)), template=template, packing=packing,
        ctx=parse_count(setup.ctx, "--ctx", binary=True) if setup.ctx else None,
        batch=parse_count(setup.batch, "--batch") if setup.batch is not None else None,
        grad_accum=parse_count(setup.grad_accum, "--grad-accum") if setup.grad_accum else None,
        precision=setup.precision, attention=setup.attention, checkpointing=setup.checkpointing,
        optimizer=setup.optimizer,
        global_batch_tokens=(parse_count(autotune.global_batch_tokens, "--global-batch-tokens")
                             if autotune.global_batch_tokens else None),
        budget_bytes=parse_size(autotune.budget, "--budget") if autotune.budget else None, lr=lr,
        control=run_control_from(limits, checks),
        seed=seed_from(seed), resume=resume, device=device.device, device_memory=device.device_memory,
        threads=threads_from(threads), log=list(log or []), nproc=n, stack=stack)
    if launched > 1:  # a rank reads its finetune from RUN/launch.json, never flags
        raise InputError(f"this process is one of {launched} started by torchrun: `memplan finetune --nproc N` "
                         "starts its ranks itself, each `python -m trainer RUN` reading the finetune it resolved")
    console = Console()
    if n > 1:
        return _launch(request, console)
    resolved = resolve_finetune(request, say=lambda text: console.print(f"[dim]{text}[/dim]"))
    trainer = start_finetune(resolved)
    if resolved.fields:
        print_fields(console, resolved.fields)  # (memplan/cli/fit.py: wrapped lines indented under their text)
    from memplan.cli.train import run_trainer

    run_trainer(console, trainer, Path(out), what="finetuning", log=log)


def _launch(request, console) -> None:
    """``memplan finetune --nproc N ...``: the finetune resolved once, here, for N processes (its plan made for
    them) and written into RUN/launch.json with kind ``finetune`` (``trainer.launch.prepare_finetune``), then N
    ranks started (``start_ranks``), each ``python -m trainer RUN`` reading that file (rank 0 printing); the exit
    code is theirs. No rank parses these flags."""
    from trainer.launch import prepare_finetune, start_ranks

    run_dir, created = prepare_finetune(request, say=lambda text: console.print(f"[dim]{text}[/dim]"))
    code = start_ranks(run_dir, request.nproc, resume=request.resume, created=created, what="finetuning",
                       say=lambda text: typer.echo(text, err=True))
    if code:
        raise typer.Exit(code)
