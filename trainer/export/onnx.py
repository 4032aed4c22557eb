"""ONNX export: ``torch.onnx.export`` (the torch.export-based exporter) of the trainer's own model, with
dynamic batch and sequence, for ONNX Runtime.

Input ``input_ids`` (batch, sequence) int64; output ``logits`` (batch, sequence, vocab) float32. The graph
is the trainer's forward with eager attention (explicit causal mask and softmax: every ONNX runtime has
those ops) on a freshly built model, so the rotary tables are computed in the graph for whatever
sequence length comes in. The sequence may be up to the model's max_positions (a learned position
table's rows; for RoPE, or the context it trained at if longer). A model over 2 GiB (protobuf's limit) keeps its weights in ``OUT.data`` beside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import warnings
from pathlib import Path

import torch

from memplan.errors import InputError
from trainer.export.common import MARKER, LoadedRun, commit_files, temp_sibling

PROTOBUF_LIMIT_BYTES = 2 * 2**30  # an ONNX protobuf cannot exceed 2 GiB; larger weights go to external data
OPSET = 18


class _Logits(torch.nn.Module):
    """input_ids -> logits, fp32."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).float()


def write_onnx(run: LoadedRun, out: Path, dtype: str) -> tuple[str, list[str]]:
    from trainer import checkpoint_format as ckpt
    from trainer.model import build_model

    if dtype != "float32":
        raise InputError(f"--dtype {dtype}: onnx export writes float32 (convert afterwards with onnxruntime's tools "
                         "for float16); use --dtype auto or float32")
    spec = run.spec
    if spec.rope_type == "dynamic" and run.ctx > spec.max_positions:  # checked before anything is written
        raise InputError(f"--format onnx: dynamic NTK RoPE recomputes its frequencies for sequences beyond "
                         f"max_position_embeddings {spec.max_positions}, which one traced graph cannot (the run "
                         f"trained at {run.ctx}); accepted: --format hf, or a run trained at --ctx up to "
                         f"{spec.max_positions}")
    model = build_model(spec, "eager", "none", torch.float32, device="cpu")
    ckpt.load_weights(model, {k: v.float() for k, v in run.tensors.items()}, str(run.checkpoint))
    model.eval()
    wrapped = _Logits(model)
    example = torch.zeros((2, min(16, spec.max_positions)), dtype=torch.long)
    batch = torch.export.Dim("batch", min=1)
    longest = spec.max_positions if spec.pos == "learned" else max(spec.max_positions, run.ctx)
    sequence = torch.export.Dim("sequence", min=1, max=longest)
    external = spec.params * 4 > PROTOBUF_LIMIT_BYTES * 0.9
    tmp = temp_sibling(out)
    try:
        quiet = logging.getLogger("torch.onnx")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
                warnings.simplefilter("ignore")
                program = torch.onnx.export(wrapped, (example,), dynamo=True, verbose=False,
                                            input_names=["input_ids"], output_names=["logits"], opset_version=OPSET,
                                            optimize=False,  # ONNX Runtime optimizes the graph when it loads it
                                            dynamic_shapes={"input_ids": {0: batch, 1: sequence}})
        finally:
            quiet.setLevel(level)
        if program is None:
            raise RuntimeError("torch.onnx.export returned no program")
        program.model.metadata_props[MARKER] = json.dumps(
            {"run": str(run.run_dir), "checkpoint": str(run.checkpoint), "step": run.step, "spec": spec.to_dict(),
             "eot_id": run.eot_id})
        program.save(str(tmp / out.name), external_data=external)
        names = [out.name] + [p.name for p in tmp.iterdir() if p.name != out.name]
        commit_files(tmp, out, names)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return f"onnx opset {OPSET}", []
