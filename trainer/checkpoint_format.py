"""Atomic, verifiable training checkpoints in ``RUN/checkpoints/``.

One checkpoint is one directory named after its step, holding three files::

    RUN/checkpoints/step-00000120/
        model.safetensors   the weights (safetensors; tied weights stored once)
        state.pt            optimizer, grad scaler, lr schedule, data position, RNG states (torch.save)
        meta.json           step, tokens seen, the run's config and plan, the tokenizer's sha256,
                            and the byte size and sha256 of the two files above

Atomicity. Everything is written into a hidden sibling ``.tmp-step-…`` directory; each file is
fsync'd, then the directory, then it is renamed to ``step-…`` (one atomic rename) and the parent
directory is fsync'd. A process killed at any moment therefore leaves either the new checkpoint
complete or no trace of it beside the previous ones. Older checkpoints beyond ``keep`` are renamed
to ``.trash-…`` before they are deleted, so a half-deleted one is never taken for a checkpoint.

Finding the newest. Only complete checkpoints carry the ``step-NNNNNNNN`` name, so the newest is
the one with the largest step in its name: no timestamps, no guessing.

Verification. Loading checks every file's size and sha256 against ``meta.json`` before it
deserialises anything; a missing, truncated or corrupt file is an ``InputError`` naming it. The
manifest covers the whole checkpoint: a file it does not list (say a ``dcp/.metadata`` planted to be
unpickled by torch.distributed.checkpoint) or a symbolic link is refused, and whether a checkpoint is
loaded as shards is read from meta.json, never from which directories happen to exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file  # (imported with the trainer: a library mapped only at the
# first checkpoint can fail to map under a memory limit, `ulimit -v`, after training used the room)

from memplan.errors import InputError
from memplan.fsutil import fsync_path, inside_name, remove_entry

CHECKPOINT_FORMAT = "memplan-checkpoint"
CHECKPOINT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_NAME = re.compile(r"^step-(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint on disk: its directory and step (from the name)."""

    path: Path
    step: int


def list_checkpoints(directory: str | Path) -> list[CheckpointRef]:
    """Complete checkpoints in ``directory``, oldest first (empty if the directory does not exist)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append(CheckpointRef(p, int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(directory: str | Path) -> CheckpointRef | None:
    """The checkpoint with the largest step, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


# ---- RNG states ----------------------------------------------------------------------------------

def rng_state() -> dict:
    """Python, numpy, torch (CPU) and CUDA generator states, in a form ``torch.load(weights_only=True)`` reads."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured (CUDA states only where CUDA is present)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    """random.setstate wants tuples all the way down; a round trip may have made lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- saving --------------------------------------------------------------------------------------

def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _remove(path: Path) -> None:
    """Rename to .trash-… (atomic: never half a checkpoint under a step name), then delete."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    remove_entry(trash)  # a symlink planted as a checkpoint: the link, not a leftover .trash-… link


def clean_leftovers(directory: Path) -> None:
    """Remove what a process that died while saving or pruning left behind."""
    _clean_leftovers(Path(directory))


def _clean_leftovers(directory: Path) -> None:
    """Temporary and trash directories left by a process that died while saving or pruning."""
    for p in directory.iterdir():
        if p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            remove_entry(p)


# ---- weights under their canonical names ---------------------------------------------------------

_COMPILED = "_orig_mod."  # torch.compile's wrapper prefix
_CHECKPOINTED = re.compile(r"^blocks\.(\d+)\.block\.")  # trainer.model.Checkpointed wraps a block as .block


def canonical_name(name: str) -> str:
    """A parameter's name as the plain model (no torch.compile, no checkpointing wrapper) has it."""
    return _CHECKPOINTED.sub(r"blocks.\1.", name.replace(_COMPILED, ""))


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under canonical names, each shared tensor once (tied
    embeddings: the first name wins, as ``state_dict`` orders them), contiguous, on the CPU."""
    out, seen = {}, {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen[key] = name
        out[canonical_name(name)] = t.detach().contiguous().cpu()
    return out


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str = "weights") -> None:
    """Copy canonical-named ``tensors`` into ``model`` (any wrapper); tied aliases may be absent."""
    params = model.state_dict()
    by_canonical = {canonical_name(n): n for n in params}
    unexpected = sorted(set(tensors) - set(by_canonical))
    if unexpected:
        raise InputError(f"{where}: holds tensors this model does not have ({', '.join(unexpected[:3])}); "
                         "it was saved from another model shape")
    # a name may be missing only when it shares its tensor with a name present (tied weights)
    present = {}
    for name, t in params.items():
        present.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(canonical_name(name))
    for group in present.values():
        if not any(n in tensors for n in group):
            raise InputError(f"{where}: lacks {group[0]}; it was saved from another model shape")
    with torch.no_grad():
        for canonical, t in tensors.items():
            target = params[by_canonical[canonical]]
            if target.shape != t.shape:
                raise InputError(f"{where}: {canonical} has shape {tuple(t.shape)}, this model's is "
                                 f"{tuple(target.shape)}; it was saved from another model shape")
            target.copy_(t)


def temporary_dir(directory: str | Path, step: int) -> Path:
    """The hidden directory checkpoint ``step`` is written into before its rename."""
    return Path(directory) / f"{_TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}"


def save_checkpoint(directory: str | Path, step: int, model: torch.nn.Module | None, state: dict, meta: dict,
                    keep: int | None = None, extra_files: dict[str, bytes] | None = None,
                    weights: dict[str, torch.Tensor] | None = None, tmp: Path | None = None) -> Path:
    """Write checkpoint ``step`` atomically into ``directory`` and keep only the newest ``keep``.

    ``model``'s weights go to model.safetensors under canonical names (``weights_of``);
    ``state`` is what ``torch.save`` writes to state.pt; ``extra_files`` (name -> bytes, such as
    the tokenizer.json) are written beside them; ``meta`` is JSON-able and gains ``format``,
    ``version``, ``step`` and ``files`` (size and sha256 of every file). Returns the checkpoint's
    directory.

    A distributed run (trainer/distributed.py) passes the gathered ``weights`` instead of the model,
    and ``tmp``: the ``temporary_dir`` into which every rank has already written its shards of the
    model and optimizer (``torch.distributed.checkpoint``); those files are listed and hashed too.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    if tmp is None:
        _clean_leftovers(directory)
        tmp = temporary_dir(directory, step)
        tmp.mkdir()
    present = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    try:
        save_file(weights if weights is not None else weights_of(model), str(tmp / MODEL_FILE),
                  metadata={"format": "pt"})
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(state, f)
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)
        files = {}
        for name in (MODEL_FILE, STATE_FILE, *(extra_files or {}), *present):
            _fsync_file(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **meta, "step": int(step),
                "files": files}
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for sub in {(tmp / name).parent for name in present} - {tmp}:
            fsync_path(sub)
        fsync_path(tmp)
        if final.exists():  # the same step saved again (a resumed run reached it once more)
            _remove(final)
        os.rename(tmp, final)
        fsync_path(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
            _remove(old.path)
    return final


# ---- loading -------------------------------------------------------------------------------------

def read_meta(path: str | Path) -> dict:
    """meta.json of the checkpoint directory ``path``, checked for form; InputError naming the file."""
    path = Path(path)
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{meta_path}: missing; {path} is not a complete checkpoint{_older_hint(path)}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{meta_path}: not valid JSON ({e}); the checkpoint is corrupt{_older_hint(path)}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT or not isinstance(meta.get("files"), dict):
        raise InputError(f"{meta_path}: not a memplan checkpoint{_older_hint(path)}")
    if meta.get("version") != CHECKPOINT_VERSION:
        raise InputError(f"{meta_path}: checkpoint format version {meta.get('version')!r}; this memplan reads "
                         f"{CHECKPOINT_VERSION}")
    return meta


def _older_hint(path: Path) -> str:
    """'; move it away to resume from step-… instead' when an older checkpoint exists."""
    older = [c for c in list_checkpoints(path.parent) if c.path != path and _NAME.match(path.name)
             and c.step < int(_NAME.match(path.name).group(1))]
    if older:
        return f"; move {path.name} out of {path.parent} to resume from {older[-1].path.name} instead"
    return ""


def check_no_unlisted_files(path: Path, meta: dict) -> None:
    """Every file in the checkpoint must be listed (with its sha256) in meta.json, and no entry may be a
    symbolic link: a file planted beside the listed ones (a ``dcp/.metadata``, which
    torch.distributed.checkpoint unpickles) is refused before anything is read."""
    listed = set(meta["files"])
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink():
            raise InputError(f"{p}: a symbolic link inside the checkpoint; refusing to load it")
        if p.is_dir() or rel == META_FILE:
            continue
        if rel not in listed:
            raise InputError(f"{p}: not listed in {path / META_FILE}; a checkpoint holds only the files its "
                             "manifest lists and checksums, so it is refused (remove the file)")


def verify_checkpoint(path: str | Path, meta: dict | None = None) -> dict:
    """Check that the checkpoint holds exactly the files meta.json lists (``check_no_unlisted_files``),
    and every file's size and sha256; returns the meta."""
    path = Path(path)
    meta = meta if meta is not None else read_meta(path)
    for name in meta["files"]:
        if not inside_name(name):
            raise InputError(f"{path / META_FILE}: lists {name!r}, not a file inside the checkpoint; the checkpoint "
                             "is corrupt")
    check_no_unlisted_files(path, meta)
    for name in sorted({MODEL_FILE, STATE_FILE, *meta["files"]}):
        f = path / name
        expected = meta["files"].get(name)
        if not isinstance(expected, dict):
            raise InputError(f"{path / META_FILE}: lists no {name}; the checkpoint is corrupt{_older_hint(path)}")
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise InputError(f"{f}: missing; the checkpoint is incomplete{_older_hint(path)}") from None
        if size != expected.get("bytes"):
            raise InputError(f"{f}: {size} bytes, but {META_FILE} says {expected.get('bytes')}; the file is "
                             f"truncated or corrupt{_older_hint(path)}")
        if file_sha256(f) != expected.get("sha256"):
            raise InputError(f"{f}: sha256 differs from {META_FILE}'s; the file is corrupt{_older_hint(path)}")
    return meta


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a model.safetensors (canonical names); InputError naming the file if unreadable."""
    path = Path(path)
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except Exception as e:  # SafetensorError on a truncated or corrupt file
        raise InputError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); the checkpoint is corrupt") from None


def load_checkpoint(path: str | Path, model: torch.nn.Module | None = None, map_location="cpu",
                    verify: bool = True) -> tuple[dict, dict]:
    """(meta, state) of the checkpoint in ``path``; the weights go into ``model`` when given.

    Files are verified first (``verify_checkpoint``), so a bad file is reported by name before
    anything is loaded. ``model`` must have exactly the checkpoint's parameter names and shapes.
    """
    path = Path(path)
    meta = verify_checkpoint(path) if verify else read_meta(path)
    if model is not None:
        load_weights(model, read_weights(path / MODEL_FILE), str(path / MODEL_FILE))
    try:
        state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as e:
        raise InputError(f"{path / STATE_FILE}: cannot be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}); the checkpoint is corrupt{_older_hint(path)}") from None
    return meta, state
