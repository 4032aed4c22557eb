"""``memplan finetune``: supervised finetuning of a trained run on JSONL instructions, fully or with LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli import app
from memplan.cli.fit import print_fields
from memplan.cli.options import (AttentionOpt, CheckpointingOpt, DeviceMemoryOpt, DeviceOpt, EvalBatchesOpt,
                                 EvalEveryOpt, KeepOpt, MaxMinutesOpt, MaxNonfiniteOpt, MaxStepsOpt, OptimizerOpt,
                                 LogOpt, PromptOpt, SampleTokensOpt, SaveEveryOpt, SeedOpt, ThreadsOpt, TokensOpt,
                                 VerifyDataOpt, device_from, run_control_from, seed_from, threads_from)
from memplan.errors import InputError

RunOpt = Annotated[Optional[str], typer.Option("--run", help="The trained run to start from (its newest checkpoint).",
                                                show_default=False)]
FromOpt = Annotated[Optional[str], typer.Option(
    "--from", help="Start from a Hugging Face checkpoint directory instead of a run: config.json (llama, mistral, "
                   "qwen2, gpt2, gpt_neox), model.safetensors or its shards, tokenizer.json; a Hub id is looked up "
                   "in the local Hugging Face cache only.", show_default=False)]
DataOpt = Annotated[str, typer.Option(
    "--data", help='JSONL, one example a line: {"prompt": ..., "response": ...} or {"messages": [{"role": '
                   '"system"|"user"|"assistant", "content": ...}, ...]}. The loss is on the responses only.')]
OutOpt = Annotated[str, typer.Option("--out", help="The finetune's run directory (checkpoints, metrics, report).")]
LoraRankOpt = Annotated[int, typer.Option("--lora-rank", help="LoRA rank; 0 finetunes every weight.")]
LoraAlphaOpt = Annotated[float, typer.Option("--lora-alpha", help="LoRA scale numerator: updates are B·A·alpha/rank.")]
LoraTargetsOpt = Annotated[str, typer.Option(
    "--lora-targets", help="The block matrices that get adapters: all, or a comma-separated subset of qkv, proj, "
                           "up, down.")]
TemplateOpt = Annotated[str, typer.Option(
    "--template", help="chat: '### User:\\n{prompt}\\n\\n### Assistant:\\n{response}' (prompt the finetuned model "
                       "the same way); plain: prompt and response as they are.")]
PackingOpt = Annotated[str, typer.Option(
    "--packing", help="packed: examples back to back in rows of --ctx tokens; padded: one example a row.")]
FtCtxOpt = Annotated[Optional[str], typer.Option("--ctx", help="Context of a row; default: the base run's.",
                                                 show_default=False)]
FtBatchOpt = Annotated[Optional[str], typer.Option(
    "--batch", help="Micro-batch; default: autotuned (with --grad-accum) for the device and the LoRA setup.",
    show_default=False)]
FtAccumOpt = Annotated[Optional[str], typer.Option("--grad-accum", help="Micro-batches per step (with --batch).",
                                                   show_default=False)]
FtPrecisionOpt = Annotated[Optional[str], typer.Option(
    "--precision", help="fp32 | tf32 | bf16-mixed | fp16-mixed | bf16; default: the base run's.", show_default=False)]
GlobalBatchOpt = Annotated[Optional[str], typer.Option(
    "--global-batch-tokens", help="Tokens per optimizer step for autotune; default 8 rows of --ctx.",
    show_default=False)]
BudgetOpt = Annotated[Optional[str], typer.Option("--budget", help="Memory budget for autotune (e.g. 6GiB).",
                                                  show_default=False)]
LrOpt = Annotated[Optional[float], typer.Option(
    "--lr", help="Peak learning rate; default 2e-4 with LoRA, 3e-5 for a full finetune.", show_default=False)]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the finetune in --out from its newest checkpoint.")]
FtNprocOpt = Annotated[Optional[str], typer.Option(
    "--nproc", help="Finetune in N processes (torchrun: one per GPU, else N CPU processes over gloo), with DDP for "
                    "--batch, else DDP or FSDP2 as autotune plans it: every rank builds the base weights and the "
                    "adapters, only the trainable weights' gradients are "
                    "reduced; each rank runs --batch × --grad-accum per step (autotuned: the same global batch as "
                    "one process).", show_default=False)]


@app.command("finetune")
def finetune_command(
    data: DataOpt, out: OutOpt, run: RunOpt = None, from_: FromOpt = None, lora_rank: LoraRankOpt = 0, lora_alpha: LoraAlphaOpt = 16.0,
    lora_targets: LoraTargetsOpt = "all", template: TemplateOpt = "chat", packing: PackingOpt = "packed",
    ctx: FtCtxOpt = None, batch: FtBatchOpt = None, grad_accum: FtAccumOpt = None, precision: FtPrecisionOpt = None,
    attention: AttentionOpt = "sdpa", checkpointing: CheckpointingOpt = "none", optimizer: OptimizerOpt = "adamw",
    global_batch_tokens: GlobalBatchOpt = None, budget: BudgetOpt = None, lr: LrOpt = None,
    max_steps: MaxStepsOpt = None, tokens: TokensOpt = None, max_minutes: MaxMinutesOpt = None,
    save_every: SaveEveryOpt = None, eval_every: EvalEveryOpt = None, keep: KeepOpt = None,
    eval_batches: EvalBatchesOpt = None, sample_tokens: SampleTokensOpt = None, prompt: PromptOpt = None,
    max_nonfinite: MaxNonfiniteOpt = None, verify_data: VerifyDataOpt = None, seed: SeedOpt = None,
    resume: ResumeOpt = False, device: DeviceOpt = None, device_memory: DeviceMemoryOpt = None,
    threads: ThreadsOpt = None, log: LogOpt = None, nproc: FtNprocOpt = None, click_ctx: typer.Context = None,
) -> None:
    """Finetune a trained run (--run) or a Hugging Face checkpoint (--from) on instructions (loss on the responses only), with LoRA or every weight; planned,
    checkpointed and resumable like `memplan train`."""
    from rich.console import Console

    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from memplan.units import format_bytes, parse_count, parse_size

    from trainer import distributed

    n = parse_count(nproc, "--nproc") if nproc is not None else 1
    rank, launched, _ = distributed.env_world()
    if n > 1 and launched > 1:
        raise InputError(f"--nproc {n}: this process is already one of {launched} started by torchrun; drop --nproc")
    if n > 1:
        return _launch(click_ctx, n)
    console = Console(quiet=rank != 0)  # one rank of several: rank 0 alone prints
    if launched > 1:  # one rank of a torchrun launch (`python -m trainer finetune`): join the group
        distributed.init()
        click_ctx.call_on_close(distributed.shutdown)
    if (run is None) == (from_ is None):
        raise InputError("give --run RUN (a memplan run) or --from DIR (a Hugging Face checkpoint directory), "
                         "exactly one")
    n_threads = threads_from(threads)
    from trainer.loggers import check_loggers

    check_loggers(log)  # a bad --log is refused before anything runs
    control = run_control_from(max_steps=max_steps, tokens=tokens, max_minutes=max_minutes, save_every=save_every,
                               eval_every=eval_every, keep=keep, eval_batches=eval_batches,
                               sample_tokens=sample_tokens, prompt=prompt, max_nonfinite=max_nonfinite,
                               verify_data=verify_data)
    seed_n = seed_from(seed)
    profile = device_from(device, device_memory)
    from memplan.local import means_this_machine

    if means_this_machine(device):  # the local device: its cached measured rates (memplan train's), if any
        from trainer.request import local_calibration

        profile, _ = local_calibration(profile, None, measure_now=False, threads=n_threads)
    from trainer.request import set_threads

    set_threads(n_threads, profile)
    out_dir = Path(out)
    if lora_rank < 0:
        raise InputError(f"--lora-rank: {lora_rank} must be 0 (full finetune) or a positive integer")
    from trainer import checkpoint as ckpt
    from trainer.finetune import base_of, base_of_hf, finetune_task, load_sft
    from trainer.lora import parse_targets
    from trainer.loop import CHECKPOINT_DIR, TrainConfig, Trainer

    targets = ",".join(parse_targets(lora_targets))
    if resume:
        ref = ckpt.latest_checkpoint(out_dir / CHECKPOINT_DIR)
        if ref is None:
            raise InputError(f"--resume: {out_dir / CHECKPOINT_DIR} holds no checkpoint to resume from")
        meta = ckpt.verify_checkpoint(ref.path)
        ft = meta.get("finetune")
        if not ft:
            raise InputError(f"--resume: {out_dir} is a training run, not a finetune; resume it with memplan train")
        plan = Plan.from_dict(meta["plan"], str(ref.path / ckpt.META_FILE))
        if run is not None:
            _, tokenizer, tok, _ = base_of(run)
        else:
            imported = base_of_hf(from_, weights=False)
            tokenizer, tok = imported.tokenizer, imported.tokenizer_record
        if tok.get("sha256") != meta.get("tokenizer_sha256"):
            raise InputError(f"{'--run' if run is not None else '--from'} {run or from_}: its tokenizer is not the "
                             f"one {out_dir} was finetuned with")
        sft = load_sft(data, tokenizer, tok, ctx=plan.setup.ctx, template=ft["template"], packing=ft["packing"],
                       base_checkpoint=Path(ft["base_checkpoint"]), base_run=Path(ft["base_run"]),
                       lora_alpha=float((ft.get("lora") or {}).get("alpha", lora_alpha)), base_hf=ft.get("base_hf"))
        if sft.sha256 != ft["data_sha256"]:
            raise InputError(f"--data {data}: not the file {out_dir} was finetuned on (sha256 differs); resume with "
                             "the same data")
        overrides = {**control, "seed": seed_n, "lr": lr}  # None: as the finetune has it
        trainer = Trainer.resume(out_dir, sft, profile, overrides=overrides, task=finetune_task(sft))
    else:
        if run is not None:
            base_plan, tokenizer, tok, base_ckpt = base_of(run)
            ctx_n = parse_count(ctx, "--ctx", binary=True) if ctx else base_plan.setup.ctx
            sft = load_sft(data, tokenizer, tok, ctx=ctx_n, template=template, packing=packing,
                           base_checkpoint=base_ckpt, base_run=Path(run), lora_alpha=lora_alpha)
            spec = base_plan.model
            prec = precision or base_plan.setup.precision
        else:
            from trainer.request import best_precision

            imported = base_of_hf(from_)
            ctx_n = parse_count(ctx, "--ctx", binary=True) if ctx else min(imported.max_ctx, 2048)
            if ctx_n > imported.max_ctx:
                raise InputError(f"--ctx {ctx_n}: {imported.path} computes as transformers does up to "
                                 f"{imported.max_ctx} positions; use --ctx {imported.max_ctx} or less")
            base_hf = {"path": str(imported.path.resolve()), "model_type": imported.model_type,
                       "dtype": imported.dtype}
            sft = load_sft(data, imported.tokenizer, imported.tokenizer_record, ctx=ctx_n, template=template,
                           packing=packing, base_checkpoint=imported.path, base_run=imported.path,
                           lora_alpha=lora_alpha, base_weights=imported.tensors, base_hf=base_hf)
            spec = imported.spec
            prec = precision or best_precision(profile)
            for note in imported.notes:
                console.print(f"[dim]--from: {note}[/dim]")
        if batch is not None:
            setup = TrainSetup(ctx=ctx_n, micro_batch=parse_count(batch, "--batch"),
                               grad_accum=parse_count(grad_accum, "--grad-accum") if grad_accum else 1,
                               precision=prec, attention=attention, checkpointing=checkpointing,
                               optimizer=optimizer, lora_rank=lora_rank, lora_targets=targets, world_size=launched,
                               sharding="ddp" if launched > 1 else "none")
        else:
            if grad_accum is not None:
                raise InputError("--grad-accum goes with --batch; without --batch autotune picks both")
            from memplan.autotune import autotune

            rows = 8 * ctx_n
            tokens_per_step = parse_count(global_batch_tokens, "--global-batch-tokens") if global_batch_tokens else rows
            result = autotune(spec, profile, ctx=ctx_n, global_batch_tokens=tokens_per_step,
                              budget_bytes=parse_size(budget, "--budget") if budget else None,
                              lora_rank=lora_rank, lora_targets=targets, precision=prec, world_size=launched)
            if result.plan is None:
                raise InputError(f"nothing fits {profile.name} for {spec.describe()} at ctx {ctx_n}"
                                 + (" with LoRA" if lora_rank else "") + "; try --lora-rank, a shorter --ctx or "
                                 "--checkpointing full")
            setup = result.plan.setup
        from memplan.prediction import predict

        predicted = predict(spec, setup, profile)
        plan = Plan(model=spec, setup=setup, device=profile.name, budget_bytes=profile.usable_bytes,
                    predicted=predicted.plan_table())
        config = TrainConfig(**{k: v for k, v in control.items() if v is not None},
                             lr=lr if lr is not None else (2e-4 if lora_rank else 3e-5),
                             weight_decay=0.0 if lora_rank else 0.1, seed=seed_n or 0)
        trainer = Trainer.start(out_dir, plan, sft, config, profile, task=finetune_task(sft))
        s = sft.stats
        what = (f"LoRA rank {lora_rank} (alpha {lora_alpha:g}) on {targets}" if lora_rank else "every weight")
        print_fields(console, [  # (memplan/cli/fit.py: wrapped lines indented under their text)
            ("Data", f"{s['examples']} examples ({s['train_examples']} train, {s['val_examples']} held out), "
                     f"{s['train_rows']} {sft.packing} rows of {ctx_n} tokens, {s['response_tokens']:,} response "
                     f"tokens trained" + (f"; {s['truncated']} cut to --ctx" if s["truncated"] else "")
                     + (f"; {s['dropped']} dropped (no response left)" if s["dropped"] else "")),
            ("Tuning", f"{what}; predicted peak {format_bytes(predicted.peak_reserved)} of "
                       f"{format_bytes(profile.usable_bytes)}"),
        ])
    from memplan.cli.train import run_trainer

    run_trainer(console, trainer, out_dir, what="finetuning", log=log)



def _launch(click_ctx, nproc: int) -> None:
    """``memplan finetune --nproc N ...``: this command without --nproc in N processes started by torchrun's
    launcher (``python -m trainer finetune`` in each, rank 0 printing)."""
    import logging
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from memplan.cli.train import LAUNCHED_BY_ENV, _argv_without

    parser = get_args_parser()
    parser.allow_abbrev = False  # finetune's --run is not an abbreviation of the launcher's --run-path
    args = parser.parse_args(["--standalone", "--nproc-per-node", str(nproc), "-m", "trainer", "finetune",
                              *_argv_without(click_ctx, ("nproc",))])
    for name in list(logging.root.manager.loggerDict):  # the launcher's own chatter: the ranks speak for the run
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_BY_ENV] = "memplan"  # the ranks' errors read as this command's
    try:
        run(args)
    except ChildFailedError as e:
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        code = codes.get(0, next(iter(codes.values()), 1))
        if 0 not in codes:  # rank 0 said nothing about it
            typer.echo(f"memplan: finetuning failed in rank(s) {', '.join(map(str, sorted(codes)))} "
                       f"(exit codes {', '.join(map(str, codes.values()))})", err=True)
        raise typer.Exit(code if code > 0 else 1)
