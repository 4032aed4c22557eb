"""What an imported checkpoint's weights must be before any is used: floats, and finite.

A Hugging Face checkpoint is hostile input (``trainer.hf_import``). Its safetensors headers give each tensor's
dtype without reading data; ``check_dtypes`` refuses, in one line naming the tensor and its dtype, what no
float model computes with: integers, bool, float8 (a scaled format whose scales transformers keeps elsewhere)
and complex. ``checked`` then takes the tensors as read: each must be finite (a NaN or inf weight is refused,
naming the tensor: it would make every logit NaN and every sample fail), and a float of another width than
``config.json``'s ``dtype`` (``torch_dtype`` before transformers 5) is converted to it, said in a note.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memplan.errors import InputError

FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
CONFIG_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}  # computed in
FINITE_CHUNK = 1 << 24  # elements checked at a time: isfinite's bool copy of a vocab x hidden embedding is bounded


def check_dtypes(files, directory: Path, flag: str = "--from") -> None:
    """Each tensor of ``files`` (``trainer.hf_import._Files``: which file holds each) is a float by its header;
    else an InputError naming the tensor, its dtype and the accepted ones. No data is read."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in files.where.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(str(Path(directory) / file), framework="pt") as f:
            for name in sorted(names):
                dtype = str(f.get_slice(name).get_dtype())
                if dtype not in FLOAT_DTYPES:
                    raise InputError(f"{flag} {directory}: tensor {name} is stored as {dtype}; memplan imports "
                                     f"float weights only (accepted: {', '.join(FLOAT_DTYPES)}): a quantized or "
                                     "integer checkpoint needs dequantizing to floats first")


def config_dtype(directory: Path) -> torch.dtype | None:
    """The dtype ``config.json`` says the weights are (``dtype``, else ``torch_dtype``), when it is one the
    trainer computes in; None when it names none."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = cfg.get("dtype", cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    return CONFIG_DTYPES.get(value) if isinstance(value, str) else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, checked ``FINITE_CHUNK`` elements at a time."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_CHUNK]).all()) for i in range(0, flat.numel(), FINITE_CHUNK))


def checked(tensors: dict[str, torch.Tensor], directory: Path, notes: list[str] | None = None,
            flag: str = "--from") -> dict[str, torch.Tensor]:
    """``tensors`` (checkpoint names) after: a float dtype each (``check_dtypes``), every element finite
    (else an InputError naming the tensor and how many are not), and floats of another width than the config's
    dtype (float32 when it names none of float32, float16, bfloat16, or the widths are mixed) converted to it,
    with a note appended to ``notes``."""
    for name, t in tensors.items():
        if not t.is_floating_point() or t.dtype not in FLOAT_DTYPES.values():
            raise InputError(f"{flag} {directory}: tensor {name} is stored as {str(t.dtype).removeprefix('torch.')}; "
                             f"memplan imports float weights only (accepted: {', '.join(FLOAT_DTYPES)})")
        if not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise InputError(f"{flag} {directory}: tensor {name} holds {bad:,} non-finite value"
                             f"{'s' if bad != 1 else ''} (NaN or inf) of {t.numel():,}; the checkpoint is corrupt "
                             "or diverged, refusing to start from it")
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    said = config_dtype(directory)
    target = said or (torch.float32 if len(stored) > 1 or stored == ["float64"] else None)
    if target is None:
        return tensors
    name = str(target).removeprefix("torch.")
    if stored and stored != [name]:
        if notes is not None:
            notes.append(f"weights stored as {', '.join(stored)}, config.json says "
                         f"{name if said else 'no float32, float16 or bfloat16 dtype'}: converted to {name}")
        tensors = {k: t.to(target) for k, t in tensors.items()}
    return tensors
