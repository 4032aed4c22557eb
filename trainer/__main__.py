"""``python -m trainer``: train a plan in this process, or in each of the processes torchrun starts.

    torchrun --nproc-per-node 2 -m trainer --plan plan.toml --data DATA --out RUN --sharding fsdp
    python -m trainer --params 22m --ctx 256 --data DATA --out RUN --max-steps 100

Under torchrun each process trains on its own device (its GPU by local rank, or the CPU over
gloo) with DDP or FSDP2 (``--sharding``, or the plan's); only rank 0 prints and writes.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from memplan.cli.options import (ArchOpt, AttentionOpt, BatchOpt, CheckpointingOpt, CtxOpt, FfnOpt, GradAccumOpt,
                                 HeadsOpt, HiddenOpt, KvHeadsOpt, LayersOpt, ModelOpt, OptimizerOpt, ParamsOpt,
                                 PrecisionOpt, ShardingOpt, TiedOpt, VocabOpt)
from memplan.errors import InputError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})

PlanOpt = Annotated[Optional[str], typer.Option("--plan", help="A plan TOML (memplan autotune --out).",
                                                show_default=False)]
DataOpt = Annotated[str, typer.Option("--data", help="A prepared corpus (memplan prepare --out DIR).")]
OutOpt = Annotated[str, typer.Option("--out", help="The run directory.")]
MaxStepsOpt = Annotated[int, typer.Option("--max-steps", help="Optimizer steps to train (counted from the start).")]
SaveEveryOpt = Annotated[int, typer.Option("--save-every", help="Steps between checkpoints (0: at the end only).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the initialisation and the data order.")]
LrOpt = Annotated[float, typer.Option("--lr", help="Learning rate (constant).")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --out, at "
                                                          "this launch's world size (the global batch is kept).")]


@app.command()
def main(
    data: DataOpt, out: OutOpt, plan: PlanOpt = None, max_steps: MaxStepsOpt = 100, save_every: SaveEveryOpt = 0,
    seed: SeedOpt = 0, lr: LrOpt = 6e-4, resume: ResumeOpt = False,
    params: ParamsOpt = None, model: ModelOpt = None, arch: ArchOpt = None, layers: LayersOpt = None,
    hidden: HiddenOpt = None, heads: HeadsOpt = None, kv_heads: KvHeadsOpt = None, ffn: FfnOpt = None,
    vocab: VocabOpt = None, tied: TiedOpt = None,
    ctx: CtxOpt = "1024", batch: BatchOpt = "1", grad_accum: GradAccumOpt = "1", precision: PrecisionOpt = "bf16-mixed",
    attention: AttentionOpt = "sdpa", checkpointing: CheckpointingOpt = "none", optimizer: OptimizerOpt = "adamw",
    sharding: Optional[str] = typer.Option(None, "--sharding", help="ddp | fsdp (default: the plan's, else ddp)",
                                           show_default=False),
) -> None:
    """Train on a plan (or MODEL and SETUP options) with DDP or FSDP2 across the launched processes."""
    from memplan.cli.options import model_from, setup_from
    from memplan.plan import Plan
    from trainer.distributed import RunConfig, env_world, run

    _, world_size, _ = env_world()
    if plan:
        the_plan = Plan.load(plan)
    else:
        spec = model_from(params, model, arch, layers, hidden, heads, kv_heads, ffn, vocab or 256, tied)
        setup = setup_from(ctx, batch, grad_accum, precision, attention, checkpointing, optimizer)
        the_plan = Plan(model=spec, setup=setup)
    setup = the_plan.setup
    if sharding is not None and sharding not in ("ddp", "fsdp"):
        raise InputError(f"--sharding: {sharding!r} (accepted: ddp, fsdp)")
    if world_size > 1:
        chosen = sharding or (setup.sharding if setup.sharding != "none" else "ddp")
        setup = setup.replace(world_size=world_size, sharding=chosen) if setup.world_size != world_size else \
            setup.replace(sharding=chosen)
    elif setup.world_size > 1 and not resume:
        raise InputError(f"the plan is for --world-size {setup.world_size}: launch it with torchrun "
                         f"--nproc-per-node {setup.world_size} -m trainer ...")
    the_plan = Plan(model=the_plan.model, setup=setup, device=the_plan.device, budget_bytes=the_plan.budget_bytes,
                    predicted=the_plan.predicted)
    run(the_plan, RunConfig(data=data, out=out, max_steps=max_steps, save_every=save_every, seed=seed, lr=lr,
                            resume=resume, sharding=sharding))


def entry() -> None:
    """Bad input is one line on stderr (from rank 0 only) and exit code 2, as for memplan."""
    import os

    try:
        rv = app(standalone_mode=False)
    except InputError as e:
        message = str(e)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        if type(e).__module__.split(".")[0] not in ("click", "typer") or not hasattr(e, "format_message"):
            raise
        message = e.format_message()
    else:
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)
    if os.environ.get("RANK", "0") == "0":
        print("python -m trainer: error: " + " ".join(message.split()), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    entry()
