"""Export a trained run for other runtimes: what ``memplan export --format hf|gguf|onnx`` runs.

- ``hf`` (``trainer/export/hf.py``): a directory that ``transformers`` loads with no custom code
  (LlamaForCausalLM, GPT2LMHeadModel or GPTNeoXForCausalLM): model.safetensors, config.json,
  generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json.
- ``gguf`` (``trainer/export/gguf.py``): one .gguf file written with the ``gguf`` package's
  GGUFWriter, for llama.cpp and the apps built on it (LM Studio, Ollama).
- ``onnx`` (``trainer/export/onnx.py``): one .onnx file from ``torch.onnx.export`` with dynamic
  batch and sequence, for ONNX Runtime.

Every format reads the run's newest (or a given) checkpoint, verified against its meta.json, and
writes everything to a temporary sibling first, renamed into place at the end: an interrupted
export leaves nothing half-written, and an existing output is replaced only with ``force``, and
then only if it is a file or an earlier export (never an unrelated directory).

Which model families each format takes (``check_exportable``): the three trainer families in the
layout their runtimes define. A model whose pieces were mixed (say, a llama with LayerNorm) has no
such runtime class and is refused with a one-line error naming the supported families.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import InputError
from memplan.fsutil import full_disk_is_one_line
from memplan.model import ModelSpec
from trainer.export.common import (MARKER, LoadedRun, commit_dir, commit_files, family_of,  # noqa: F401
                                   temp_sibling, umask_mode)

FORMATS = ("hf", "gguf", "onnx")
DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0")  # auto: the run's weights' own; q8_0: GGUF only
SUPPORTED = ("llama (RMSNorm, RoPE, SwiGLU, no biases)", "qwen2 (llama with q/k/v biases)", "gpt2 (LayerNorm, learned positions, GELU, biases)",
             "gpt_neox (LayerNorm, RoPE, GELU, biases, parallel residual, no GQA)")

# the layout each family must have to be a transformers / llama.cpp model: (field, value) pairs
_FAMILY_LAYOUT = {
    "llama": {"norm": "rmsnorm", "pos": "rope", "mlp": "swiglu", "bias": False, "parallel_residual": False,
              "rotary_pct": 1.0},
    "gpt2": {"norm": "layernorm", "pos": "learned", "mlp": "gelu", "bias": True, "parallel_residual": False},
    "gpt_neox": {"norm": "layernorm", "pos": "rope", "mlp": "gelu", "bias": True, "parallel_residual": True},
}


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What an export wrote."""

    format: str  # hf | gguf | onnx
    path: Path  # the directory (hf) or file (gguf, onnx) written
    files: tuple[tuple[str, int], ...]  # (name, bytes) of every file written
    arch: str  # the runtime's name for the architecture (LlamaForCausalLM, llama, ...)
    params: int
    step: int  # the checkpoint's step
    dtype: str  # float32 | float16 | bfloat16 | q8_0 (of the matrices; norms stay float32 in GGUF)
    seconds: float
    notes: tuple[str, ...] = ()  # things the user should know (e.g. the pre-tokenizer named in GGUF)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.files)

    def to_json(self) -> dict:
        return {"format": self.format, "path": str(self.path), "arch": self.arch, "params": self.params,
                "step": self.step, "dtype": self.dtype, "bytes": self.bytes,
                "files": [{"name": n, "bytes": b} for n, b in self.files], "seconds": self.seconds,
                "notes": list(self.notes)}


def check_exportable(spec: ModelSpec, fmt: str) -> str:
    """The family (``family_of``) of ``spec`` if ``fmt`` can carry it, else an InputError naming the supported
    families."""
    if fmt not in FORMATS:
        raise InputError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    layout = _FAMILY_LAYOUT[spec.arch]
    off = [f"{k}={getattr(spec, k)!r}" for k, v in layout.items() if getattr(spec, k) != v]
    if spec.arch != "llama" and spec.kv_heads != spec.heads:
        off.append(f"kv_heads={spec.kv_heads} (heads {spec.heads})")
    if off:
        raise InputError(f"--format {fmt}: this {spec.arch} model has {', '.join(off)}, which no {fmt} runtime "
                         f"class takes; exportable families: {'; '.join(SUPPORTED)}")
    return family_of(spec)


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None) -> LoadedRun:
    """The newest (or the given) checkpoint of a run, verified (``rundir.trained_checkpoint``)."""
    from trainer import checkpoint_format as ckpt
    from trainer import rundir
    from trainer.rundir import TOKENIZER_FILE

    run_dir = Path(run_dir)
    trained = rundir.trained_checkpoint(run_dir, checkpoint)
    path, meta, plan = trained.path, trained.meta, trained.plan
    tensors = ckpt.read_weights(path / ckpt.MODEL_FILE)
    if plan.setup.lora_rank:  # a LoRA finetune holds base.weight, lora_a, lora_b: fold them, as load_trained does
        from trainer.loop import build_trained

        model, _, _ = build_trained(trained)
        tensors = {k: v.detach() for k, v in model.state_dict().items() if not (plan.model.tied and k == "head.weight")}
    tok = meta.get("tokenizer") or {}
    tokenizer_json = None
    if tok.get("kind") != "tiktoken":
        tok_path = path / TOKENIZER_FILE
        if not tok_path.is_file():
            raise InputError(f"{tok_path}: missing; the checkpoint is incomplete")
        tokenizer_json = tok_path.read_text(encoding="utf-8")
    return LoadedRun(run_dir=run_dir, checkpoint=path, meta=meta, spec=plan.model, ctx=plan.setup.ctx,
                     precision=plan.setup.precision, tensors=tensors, tokenizer_json=tokenizer_json,
                     eot_id=int(tok.get("eot_id", 0)), eot_token=str(tok.get("eot_token", "<|endoftext|>")))


def resolve_dtype(dtype: str, run: LoadedRun, fmt: str = "hf") -> str:
    """float32 | float16 | bfloat16 | q8_0 (GGUF only) from --dtype (auto: the weights' own; float32 for onnx)."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype == "q8_0" and fmt != "gguf":
        raise InputError(f"--dtype q8_0: llama.cpp's 8-bit blocks exist only in GGUF; for --format {fmt} use "
                         "float32, float16 or bfloat16")
    if dtype == "auto" and fmt == "onnx":
        return "float32"
    if dtype == "auto":
        first = run.tensors.get("embed.weight", next(iter(run.tensors.values()), None))
        return "bfloat16" if first is not None and str(first.dtype) == "torch.bfloat16" else "float32"
    return dtype


# ---- writing atomically ------------------------------------------------------------------------------

def check_out(out: Path, fmt: str, force: bool) -> None:
    """Refuse to overwrite without ``force``; refuse with it too when ``out`` is something an export
    did not write (a non-empty directory that is not an hf export, a directory where a file goes)."""
    from memplan.fsutil import check_target

    check_target(out, "--out", f"model.{fmt}" if fmt != "hf" else "my-model")  # its parent: exists, writable
    if fmt == "hf":
        if out.exists() and not out.is_dir():
            if not force:
                raise InputError(f"--out {out}: exists (a file); add --force to replace it")
        elif out.is_dir() and any(out.iterdir()):
            if not force:
                raise InputError(f"--out {out}: exists and is not empty; add --force to replace it, or choose "
                                 "another --out")
            if not _is_hf_export(out):
                raise InputError(f"--out {out}: is a directory that no memplan export wrote (no config.json marked "
                                 f"{MARKER}); refusing to replace it even with --force")
    else:
        if out.is_dir():
            raise InputError(f"--out {out}: is a directory; give a file path such as {out / ('model.' + fmt)}")
        if out.exists() and not force:
            raise InputError(f"--out {out}: exists; add --force to replace it")


def _is_hf_export(directory: Path) -> bool:
    try:
        return MARKER in json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def files_of(path: Path) -> tuple[tuple[str, int], ...]:
    if path.is_dir():
        return tuple((p.name, p.stat().st_size) for p in sorted(path.iterdir()))
    return ((path.name, path.stat().st_size),)


def export_run(run_dir: str | Path, fmt: str, out: str | Path, *, force: bool = False,
               checkpoint: str | Path | None = None, dtype: str = "auto") -> ExportResult:
    """Export the run's newest (or the given) checkpoint to ``out`` in ``fmt``; see the module docstring."""
    if fmt not in FORMATS:
        raise InputError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    out = Path(out)
    check_out(out, fmt, force)
    with export_lock(out):
        check_out(out, fmt, force)  # again, under the lock: an export that held it may have written out since
        run = load_run(run_dir, checkpoint)
        from trainer.export import hf_stack

        if hf_stack.is_stack_run(run):  # transformers' own model class trained (trainer.hf_model)
            hf_stack.check_format(run, fmt)
            resolved = resolve_dtype(dtype, run, fmt)
            t0 = time.perf_counter()
            with full_disk_is_one_line(out, "--out", f"the {fmt} export"):  # exit 1; out as it was, no temporary left
                arch, notes, params = hf_stack.write_hf_stack(run, out, resolved)
            return ExportResult(format=fmt, path=out, files=files_of(out), arch=arch, params=params, step=run.step,
                                dtype=resolved, seconds=time.perf_counter() - t0, notes=tuple(notes))
        check_exportable(run.spec, fmt)
        resolved = resolve_dtype(dtype, run, fmt)
        _check_packages(fmt)
        t0 = time.perf_counter()
        if fmt == "hf":
            from trainer.export.hf import write_hf as write
        elif fmt == "gguf":
            from trainer.export.gguf import write_gguf as write
        else:
            from trainer.export.onnx import write_onnx as write
        with full_disk_is_one_line(out, "--out", f"the {fmt} export"):  # exit 1; out as it was, no temporary left
            arch, notes = write(run, out, resolved)
    return ExportResult(format=fmt, path=out, files=files_of(out) if fmt == "hf" else _written_files(out),
                        arch=arch, params=run.spec.params, step=run.step, dtype=resolved,
                        seconds=time.perf_counter() - t0, notes=tuple(notes))


def export_lock(out: Path):
    """The lock ``.NAME.lock`` beside ``out`` (``memplan.fsutil.hold_lock``, as prepare and train take), held
    while an export writes ``out``: a second export to the same ``out`` is refused in one line naming the PID."""
    from memplan.fsutil import hold_lock

    return hold_lock(out.parent / f".{out.name}.lock",
                     f"--out {out}: another memplan process (PID {{pid}}) is exporting to it; wait for it to end, "
                     "or choose another --out")


def _check_packages(fmt: str) -> None:
    """A missing optional package is a one-line error naming what to install."""
    import importlib.util

    needed = {"gguf": ["gguf"], "onnx": ["onnxscript", "onnx"]}.get(fmt, [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(f"--format {fmt}: needs the {' and '.join(missing)} package(s); "
                         f"pip install {' '.join(missing)} (or pip install 'memplan[export]')")


def _written_files(out: Path) -> tuple[tuple[str, int], ...]:
    files = [(out.name, out.stat().st_size)]
    data = out.parent / f"{out.name}.data"  # ONNX external data of a model over 2 GiB
    if data.exists():
        files.append((data.name, data.stat().st_size))
    return tuple(files)
