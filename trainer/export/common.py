"""What every exporter shares: the run as loaded for export, the family of a model, the marker each export
records, and writing atomically (a temporary sibling, committed by rename).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from memplan.fsutil import fsync_path, remove_entry
from memplan.model import ModelSpec

MARKER = "memplan_export"  # the key every export records (config.json, GGUF metadata, ONNX metadata)


@dataclass(frozen=True)
class LoadedRun:
    """A run's checkpoint, as the exporters need it."""

    run_dir: Path
    checkpoint: Path
    meta: dict
    spec: ModelSpec
    ctx: int  # the context it trained at
    precision: str
    tensors: dict  # canonical name -> torch tensor (CPU), tied aliases absent
    tokenizer_json: str | None  # the tokenizer.json text (None for a tiktoken encoding)
    eot_id: int
    eot_token: str

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def tensor(self, name: str):
        """A weight by canonical name; the LM head of a tied model is the embedding."""
        if name == "head.weight" and name not in self.tensors and self.spec.tied:
            return self.tensors["embed.weight"]
        return self.tensors[name]


def family_of(spec: ModelSpec) -> str:
    """llama | qwen2 (a llama with biases on q, k and v only) | gpt2 | gpt_neox."""
    return "qwen2" if spec.arch == "llama" and spec.qkv_bias else spec.arch


def temp_sibling(out: Path) -> Path:
    """A fresh temporary directory beside ``out`` (same filesystem, so the final rename is atomic).

    Leftovers of an export of the same ``out`` that was killed (``.NAME.tmp-PID-…``, ``.NAME.old-PID-…``
    whose process is gone) are removed first.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in out.parent.glob(f".{out.name}.*-*-*"):
        kind, _, rest = p.name[len(out.name) + 2:].partition("-")
        pid = rest.split("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and not _alive(int(pid)):
            remove_entry(p)
    from memplan.fsutil import temp_dir_beside

    return temp_dir_beside(out, f"tmp-{os.getpid()}")  # .NAME.tmp-PID-XXXXXXXX, created exclusively


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def umask_mode(path: Path) -> None:
    """Give a written file the mode a plain ``open()`` would: 0o666 less the umask (safetensors'
    writer creates its file 0o600, readable by its owner only, unlike every other export file)."""
    mask = os.umask(0)
    os.umask(mask)
    if path.is_file():
        os.chmod(path, 0o666 & ~mask)


def commit_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory ``tmp`` to ``out``, replacing what ``check_out`` allowed."""
    for f in tmp.iterdir():
        umask_mode(f)
        fsync_path(f)
    fsync_path(tmp)
    trash = None
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        trash = out.parent / f".{out.name}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(out, trash)
    elif out.is_dir():
        out.rmdir()
    os.rename(tmp, out)
    fsync_path(out.parent)
    if trash is not None:
        remove_entry(trash)  # an earlier output that was a symlink: the link goes, not a .NAME.old-… link


def commit_files(tmp: Path, out: Path, names: list[str]) -> None:
    """Move files ``names`` from ``tmp`` next to ``out`` (the first becomes ``out``, the others keep their
    names), each with an atomic replace, then remove ``tmp``."""
    for i, name in enumerate(names):
        target = out if i == 0 else out.parent / name
        umask_mode(tmp / name)
        fsync_path(tmp / name)
        os.replace(tmp / name, target)
    fsync_path(out.parent)
    shutil.rmtree(tmp, ignore_errors=True)
