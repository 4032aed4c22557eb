"""``memplan export --run RUN --format hf|gguf|onnx --out PATH``: a trained run for transformers, llama.cpp or
ONNX Runtime."""

from __future__ import annotations

from typing import Annotated

import typer

from memplan.cli.app import app
from memplan.cli.options import CheckpointOpt, JsonOpt, RunDirOpt

FormatOpt = Annotated[str, typer.Option(
    "--format", metavar="FORMAT", help="hf (a transformers directory) | gguf (llama.cpp, LM Studio, Ollama) | onnx (ONNX Runtime).",
    show_default=False)]
OutOpt = Annotated[str, typer.Option("--out", metavar="PATH", help="Where to write: a directory for hf, a file for gguf and onnx.",
                                     show_default=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output (a file, or an earlier export).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", metavar="DTYPE", help="auto (the weights' own) | float32 | float16 | bfloat16 | q8_0 (GGUF only: llama.cpp's 8-bit "
                    "blocks); GGUF keeps norms in float32; onnx writes float32.")]


@app.command("export")
def export_command(run: RunDirOpt, format: FormatOpt, out: OutOpt, force: ForceOpt = False,
                   checkpoint: CheckpointOpt = None, dtype: DtypeOpt = "auto", json: JsonOpt = False) -> None:
    """Export a trained run: hf (transformers, no custom code), gguf (llama.cpp) or onnx (ONNX Runtime)."""
    from memplan.units import format_count

    from trainer.export import export_run

    result = export_run(run, format, out, force=force, checkpoint=checkpoint, dtype=dtype)
    if json:
        from memplan.cli.options import print_json

        print_json(result.to_json())
        return
    from rich.console import Console

    console = Console(highlight=False)
    size = result.bytes / 2**20
    console.print(f"wrote {result.path} ({result.format}, {result.arch}, {format_count(result.params)} parameters, "
                  f"{result.dtype}, step {result.step}): {len(result.files)} file(s), {size:,.1f} MiB in "
                  f"{result.seconds:.1f} s", soft_wrap=True)
    for note in result.notes:
        console.print(f"note: {note}", soft_wrap=True)
