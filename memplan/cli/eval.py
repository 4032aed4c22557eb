"""``memplan eval``: held-out loss and perplexity of a trained run, per source and overall."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.options import CheckpointOpt, JsonOpt, RunDirOpt, ThreadsOpt, threads_from, use_threads

DataOpt = Annotated[Optional[str], typer.Option(
    "--data", metavar="DIR", help="A prepared corpus with the run's tokenizer (default: the one the run trained on).",
    show_default=False)]
CtxOpt = Annotated[Optional[str], typer.Option("--ctx", metavar="N", help="Tokens per evaluation window (default: the run's "
                                               "context; 8192 or 8k).", show_default=False)]
BatchOpt = Annotated[Optional[str], typer.Option("--batch", metavar="N", help="Windows per forward (default: the run's "
                                                 "micro-batch).", show_default=False)]
MaxBatchesOpt = Annotated[Optional[str], typer.Option(
    "--max-batches", metavar="N", help="Batches per source, evenly spaced over its held-out split (default: every window; "
                          "the run's eval_batches reproduces the loss the trainer logged).", show_default=False)]


@app.command("eval")
def eval_command(run: RunDirOpt, data: DataOpt = None, checkpoint: CheckpointOpt = None, ctx: CtxOpt = None,
                 batch: BatchOpt = None, max_batches: MaxBatchesOpt = None, json: JsonOpt = False,
                 threads: ThreadsOpt = None) -> None:
    """Held-out loss and perplexity of a run, per source and overall, on its own split or another corpus."""
    from memplan.units import parse_count

    from trainer.eval_command import EvalConfig

    config = EvalConfig(ctx=parse_count(ctx, "--ctx", binary=True) if ctx else None,
                        batch=parse_count(batch, "--batch") if batch else None,
                        max_batches=parse_count(max_batches, "--max-batches") if max_batches else None)
    threads_from(threads)  # a bad value is refused before torch starts

    from trainer.eval_command import evaluate_run
    from trainer.device import torch_device_for

    use_threads(threads)
    result = evaluate_run(run, data, config, checkpoint=checkpoint, device=torch_device_for())
    if json:
        from memplan.cli.options import print_json

        print_json(result.to_json())
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"{result.run} step {result.step} on {result.data}"
                  + ("" if result.own_data else " (not the run's own data)"), soft_wrap=True)
    table = Table()
    table.add_column("source")
    table.add_column("tokens", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("perplexity", justify="right")
    for s in result.sources:
        if s.loss is None:
            table.add_row(s.name, "0", "-", f"(split of {s.val_tokens} tokens < one window)")
        else:
            table.add_row(s.name, f"{s.tokens:,}", f"{s.loss:.4f}", f"{s.ppl:,.2f}")
    table.add_section()
    table.add_row("overall", f"{result.tokens:,}", f"{result.loss:.4f}", f"{result.ppl:,.2f}", style="bold")
    console.print(table)
    console.print(f"ctx {result.ctx}, batch {result.batch}, {result.precision}, {result.device}; "
                  f"{result.tokens:,} tokens in {result.seconds:.1f} s", soft_wrap=True)
