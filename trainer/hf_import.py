"""Hugging Face import: a local checkpoint directory as memplan's canonical weights, spec and tokenizer.

The inverse of ``trainer/export/hf.py``'s ``hf_tensors``. A directory holds ``config.json`` (read by
``memplan.model.from_hf_config``), ``model.safetensors`` or shards named in
``model.safetensors.index.json``, and ``tokenizer.json``. Families: llama, mistral (a llama), qwen2
(a llama with q/k/v biases), gpt2 and gpt_neox. Layouts, HF -> trainer:

llama    self_attn.{q,k,v}_proj rows concatenated [q; k; v] -> attn.qkv; mlp.{gate,up}_proj rows
         concatenated [gate; up] -> mlp.up (the trainer splits h.chunk(2) as gate, up).
gpt2     Conv1D weights are stored (in, out): c_attn, c_proj, c_fc transposed back to nn.Linear's (out, in).
gpt_neox query_key_value rows are per head [q_h; k_h; v_h]: regrouped as [q (all heads); k; v].

Every tensor is checked by name and shape before any is used: a missing one, one memplan does not know, or
a wrong shape is a one-line ``InputError`` naming it. A tied model may omit its LM head (if present it is
ignored, as transformers ties it to the embedding). Buffers older transformers saved (``attn.bias``,
``attn.masked_bias``, ``rotary_emb.inv_freq``) are recomputed and skipped. Files are read with the
``safetensors`` library only (no pickle): a ``pytorch_model.bin`` checkpoint is refused.

RoPE scaling (``rope_parameters`` or ``rope_scaling``) of type llama3, linear, dynamic or yarn is the spec's
``rope_scaling``, computed as transformers does (``trainer.model.rope_frequencies``). Configuration the trainer
cannot compute is refused, naming the key: another RoPE type (longrope, ...), any scaling on gpt_neox, a
non-SiLU llama activation, GPT-2's ``scale_attn_by_inverse_layer_idx``, a GPT-NeoX without
attention biases. A sliding window caps the context (``ImportedModel.max_ctx``). An exact (erf) GELU runs as
the trainer's tanh approximation (at most ~5e-4 apart per activation), said in ``notes``.

A Hub id (``org/name``) is looked up in the Hugging Face cache (``huggingface_hub.constants.HF_HUB_CACHE``)
and, when no snapshot of it is there, fetched into it with ``huggingface_hub.snapshot_download`` (config,
tokenizer and safetensors only) unless ``HF_HUB_OFFLINE`` is set; offline, the error names the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from memplan.errors import InputError
from memplan.model import ModelSpec, from_hf_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the trainer's GELU, the tanh approximation
SKIPPED_BUFFERS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                   ".rotary_emb.inv_freq")  # non-persistent buffers older transformers wrote
BASE_PREFIX = {"llama": "model.", "gpt2": "transformer.", "gpt_neox": "gpt_neox."}


@dataclass(frozen=True)
class ImportedModel:
    """A Hugging Face checkpoint as memplan starts from it."""

    path: Path  # the checkpoint directory
    model_type: str  # llama | mistral | qwen2 | gpt2 | gpt_neox
    spec: ModelSpec
    tensors: dict  # canonical name -> tensor (the stored dtype), tied LM head absent
    tokenizer: object  # trainer.tokenizer.Tokenizer
    tokenizer_record: dict  # as a prepared corpus's manifest records it
    dtype: str  # the stored dtype of the weights
    max_ctx: int  # the longest context the trainer computes as transformers does
    notes: tuple[str, ...] = ()
    hf_config: dict | None = None  # transformers' model class trains it (trainer.hf_model): its config.json


# ---- where the checkpoint is -------------------------------------------------------------------------

def hub_cache() -> Path:
    """The Hugging Face hub cache directory (huggingface_hub's own setting, else its documented default)."""
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except ImportError:
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        return Path(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))


def cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    """The cached snapshot of ``repo_id`` with a config.json: the one refs/main names, else the newest."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        named = snaps / ref.read_text(encoding="utf-8").strip()
        if (named / CONFIG_FILE).is_file():
            return named
    found = [p.parent for p in snaps.glob(f"*/{CONFIG_FILE}")] if snaps.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


FETCHED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "*.safetensors", INDEX_FILE)  # what a Hub fetch downloads: never pickle


def hub_offline() -> bool:
    """Whether the user forbade the network to huggingface_hub (``HF_HUB_OFFLINE``, its own switch)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)  # read when huggingface_hub was imported


def fetch_from_hub(repo_id: str, cache: Path, flag: str = "--from") -> Path:
    """``repo_id``'s config, safetensors weights and tokenizer fetched with ``huggingface_hub.snapshot_download``
    into the Hugging Face cache ``cache``, and the snapshot directory; pickle weights are never fetched. Offline
    (``HF_HUB_OFFLINE``, no network, no such repository) an InputError naming the cache it looked in."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise InputError(f"{flag} {repo_id}: not in the Hugging Face cache {cache}, and fetching it needs "
                         "huggingface_hub (pip install huggingface_hub)") from None
    if hub_offline():
        raise InputError(f"{flag} {repo_id}: no snapshot of it in the Hugging Face cache {cache}, and HF_HUB_OFFLINE "
                         f"forbids fetching it; fetch it where the network allows (`hf download {repo_id}`) or give "
                         "a local checkpoint directory")
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=list(FETCHED), cache_dir=str(cache)))
    except Exception as e:  # huggingface_hub's own errors: offline, unknown repository, gated, HTTP failures
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise InputError(f"{flag} {repo_id}: no snapshot of it in the Hugging Face cache {cache}, and fetching it "
                         f"failed ({type(e).__name__}: {first[:160]}); give a local checkpoint directory, or fetch "
                         f"it where the network allows (`hf download {repo_id}`)") from None
    if not (path / CONFIG_FILE).is_file():
        raise InputError(f"{flag} {repo_id}: the Hub repository has no {CONFIG_FILE}; it is not a transformers "
                         "checkpoint")
    return path


def resolve_checkpoint(text: str, flag: str = "--from") -> Path:
    """The checkpoint directory ``flag`` names: a local directory; or a Hub id's snapshot in the HF cache,
    fetched into it first when it is not there (``fetch_from_hub``)."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise InputError(f"{flag} {text}: no {CONFIG_FILE} in the directory; a Hugging Face checkpoint "
                             f"directory holds {CONFIG_FILE}, {WEIGHTS_FILE} (or shards) and {TOKENIZER_FILE}")
        return path
    if path.exists():
        raise InputError(f"{flag} {text}: not a directory; give a Hugging Face checkpoint directory "
                         f"({CONFIG_FILE}, {WEIGHTS_FILE} or shards, {TOKENIZER_FILE})")
    cache = hub_cache()
    if not is_hub_id(text):  # a path, not an org/name id
        raise InputError(f"{flag} {text}: no such directory; give a Hugging Face checkpoint directory "
                         f"({CONFIG_FILE}, {WEIGHTS_FILE} or shards, {TOKENIZER_FILE}) or a Hub id (org/name)")
    snap = cached_snapshot(text, cache)
    if snap is not None:
        return snap
    return fetch_from_hub(text, cache, flag)


def is_hub_id(text: str) -> bool:
    """``name`` or ``org/name`` as the Hub spells repository ids (letters, digits, ``-_.``), not a path."""
    import re

    return re.fullmatch(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*", text) is not None \
        and ".." not in text and not text.endswith(".")


def weights_sha256(directory: Path) -> str:
    """One sha256 over a checkpoint's weight files (the index, if any, and each .safetensors in name order):
    what a run started from it records, so that it can tell later that the files are still the same."""
    import hashlib

    from trainer.tokenizer import file_sha256

    h = hashlib.sha256()
    names = sorted(p.name for p in directory.iterdir() if p.name == INDEX_FILE or p.name.endswith(".safetensors"))
    for name in names:
        h.update(name.encode() + b"\0" + file_sha256(directory / name).encode() + b"\n")
    return h.hexdigest()


# ---- the configuration -------------------------------------------------------------------------------

def _check_rope(cfg: dict, where: str, flag: str = "--from") -> None:
    """gpt_neox: a RoPE scaling other than the default is refused. (The llama family's, llama3, linear, dynamic
    and yarn, is read by ``memplan.model.from_hf_config`` into ``ModelSpec.rope_scaling`` and computed by
    the trainer as transformers does; any other type is refused there.)"""
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InputError(f"{flag} {where}: {key} must be an object, got {value!r:.40}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise InputError(f"{flag} {where}: {key} has rope_type {kind!r:.40}; memplan's gpt_neox computes "
                             "the default RoPE only (accepted: default; llama3, linear, dynamic and yarn for the "
                             "llama, mistral and qwen2 families)")


def read_spec(directory: Path, flag: str = "--from") -> tuple[str, ModelSpec, dict, int, list[str]]:
    """(model_type, spec, config, max_ctx, notes) of a checkpoint directory's config.json."""
    path = directory / CONFIG_FILE
    spec = from_hf_config(path)  # checks every shape value and the model type
    cfg = json.loads(path.read_text(encoding="utf-8"))
    model_type, where = cfg["model_type"], str(directory)
    notes: list[str] = []
    if model_type == "gpt_neox":
        _check_rope(cfg, where, flag)
    spec = dataclasses.replace(spec, name=cfg.get("_name_or_path") or directory.name, source=str(directory))
    act_key = "activation_function" if model_type == "gpt2" else "hidden_act"
    act = cfg.get(act_key, "gelu_new" if model_type == "gpt2" else ("gelu" if model_type == "gpt_neox" else "silu"))
    if spec.mlp == "swiglu":
        if act not in ("silu", "swish"):
            raise InputError(f"{flag} {where}: {act_key} {act!r:.40}; memplan's llama family computes SwiGLU "
                             "(accepted: silu)")
    elif act == "gelu":
        notes.append(f"{act_key} 'gelu' (exact erf) runs as the tanh approximation (at most ~5e-4 apart per "
                     "activation); an export writes gelu_pytorch_tanh")
    elif act not in TANH_GELUS:
        raise InputError(f"{flag} {where}: {act_key} {act!r:.40}; accepted: gelu, {', '.join(TANH_GELUS)}")
    if model_type == "gpt2":
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise InputError(f"{flag} {where}: scale_attn_by_inverse_layer_idx is true; memplan's trainer scales "
                             "attention by 1/sqrt(head_dim) only (accepted: false)")
        if cfg.get("scale_attn_weights", True) is not True:
            raise InputError(f"{flag} {where}: scale_attn_weights is false; accepted: true")
    if model_type == "gpt_neox" and cfg.get("attention_bias", True) is not True:
        raise InputError(f"{flag} {where}: attention_bias is false; memplan's gpt_neox has attention biases "
                         "(accepted: true)")
    max_ctx = spec.max_positions
    window = cfg.get("sliding_window")
    windowed = model_type == "mistral" or (model_type == "qwen2" and cfg.get("use_sliding_window"))
    if windowed and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        max_ctx = min(max_ctx, window)
        notes.append(f"sliding_window {window}: attention is full within it, so --ctx is at most {window}")
    return model_type, spec, cfg, max_ctx, notes


# ---- the weights ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    target: str  # canonical name
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, shape) in order
    combine: str  # cat | T (transpose) | neox | neox_bias | copy


def _layout(spec: ModelSpec) -> list[_Entry]:
    """Every canonical tensor of ``spec`` and the HF tensors (names, shapes) it is made of."""
    H, kv, F, V = spec.hidden, spec.kv_dim, spec.ffn, spec.vocab
    out: list[_Entry] = []

    def one(target, name, shape, how="copy"):
        out.append(_Entry(target, ((name, tuple(shape)),), how))

    if spec.arch == "llama":
        one("embed.weight", "model.embed_tokens.weight", (V, H))
        for i in range(spec.layers):
            p, b = f"model.layers.{i}.", f"blocks.{i}."
            a = p + "self_attn."
            out.append(_Entry(b + "attn.qkv.weight", ((a + "q_proj.weight", (H, H)), (a + "k_proj.weight", (kv, H)),
                                                      (a + "v_proj.weight", (kv, H))), "cat"))
            if spec.bias or spec.qkv_bias:
                out.append(_Entry(b + "attn.qkv.bias", ((a + "q_proj.bias", (H,)), (a + "k_proj.bias", (kv,)),
                                                        (a + "v_proj.bias", (kv,))), "cat"))
            one(b + "attn.proj.weight", a + "o_proj.weight", (H, H))
            m = p + "mlp."
            out.append(_Entry(b + "mlp.up.weight", ((m + "gate_proj.weight", (F, H)), (m + "up_proj.weight", (F, H))),
                              "cat"))
            one(b + "mlp.down.weight", m + "down_proj.weight", (H, F))
            if spec.bias:
                one(b + "attn.proj.bias", a + "o_proj.bias", (H,))
                out.append(_Entry(b + "mlp.up.bias", ((m + "gate_proj.bias", (F,)), (m + "up_proj.bias", (F,))), "cat"))
                one(b + "mlp.down.bias", m + "down_proj.bias", (H,))
            one(b + "norm1.weight", p + "input_layernorm.weight", (H,))
            one(b + "norm2.weight", p + "post_attention_layernorm.weight", (H,))
        one("norm.weight", "model.norm.weight", (H,))
    elif spec.arch == "gpt2":
        one("embed.weight", "transformer.wte.weight", (V, H))
        one("pos.weight", "transformer.wpe.weight", (spec.max_positions, H))
        for i in range(spec.layers):
            p, b = f"transformer.h.{i}.", f"blocks.{i}."
            for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
                one(b + ours + ".weight", p + theirs + ".weight", (H,))
                one(b + ours + ".bias", p + theirs + ".bias", (H,))
            one(b + "attn.qkv.weight", p + "attn.c_attn.weight", (H, H + 2 * kv), "T")  # Conv1D: (in, out)
            one(b + "attn.qkv.bias", p + "attn.c_attn.bias", (H + 2 * kv,))
            one(b + "attn.proj.weight", p + "attn.c_proj.weight", (H, H), "T")
            one(b + "attn.proj.bias", p + "attn.c_proj.bias", (H,))
            one(b + "mlp.up.weight", p + "mlp.c_fc.weight", (H, F), "T")
            one(b + "mlp.up.bias", p + "mlp.c_fc.bias", (F,))
            one(b + "mlp.down.weight", p + "mlp.c_proj.weight", (F, H), "T")
            one(b + "mlp.down.bias", p + "mlp.c_proj.bias", (H,))
        one("norm.weight", "transformer.ln_f.weight", (H,))
        one("norm.bias", "transformer.ln_f.bias", (H,))
    else:  # gpt_neox
        one("embed.weight", "gpt_neox.embed_in.weight", (V, H))
        for i in range(spec.layers):
            p, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
            one(b + "attn.qkv.weight", p + "attention.query_key_value.weight", (3 * H, H), "neox")
            one(b + "attn.qkv.bias", p + "attention.query_key_value.bias", (3 * H,), "neox_bias")
            for ours, theirs, shape in (("attn.proj", "attention.dense", (H, H)), ("mlp.up", "mlp.dense_h_to_4h", (F, H)),
                                        ("mlp.down", "mlp.dense_4h_to_h", (H, F))):
                one(b + ours + ".weight", p + theirs + ".weight", shape)
                one(b + ours + ".bias", p + theirs + ".bias", shape[:1])
            for ours, theirs in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")):
                one(b + ours + ".weight", p + theirs + ".weight", (H,))
                one(b + ours + ".bias", p + theirs + ".bias", (H,))
        one("norm.weight", "gpt_neox.final_layer_norm.weight", (H,))
        one("norm.bias", "gpt_neox.final_layer_norm.bias", (H,))
    return out


def head_name(spec: ModelSpec) -> str:
    return "embed_out.weight" if spec.arch == "gpt_neox" else "lm_head.weight"


def _combine(entry: _Entry, parts: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    if entry.combine == "cat":
        return torch.cat(parts, dim=0)
    t = parts[0]
    if entry.combine == "T":
        return t.T.contiguous()
    heads, hd, H = spec.heads, spec.head_dim, spec.hidden
    if entry.combine == "neox":  # rows [q_0; k_0; v_0; q_1; ...] -> [q (all heads); k; v]
        return t.view(heads, 3, hd, H).transpose(0, 1).reshape(3 * H, H).contiguous()
    if entry.combine == "neox_bias":
        return t.view(heads, 3, hd).transpose(0, 1).reshape(3 * H).contiguous()
    return t


class _Files:
    """The safetensors files of a checkpoint: which file holds each tensor, and its shape (no data read)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        index, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = sorted(set(weight_map.values()))
                assert all(isinstance(f, str) and "/" not in f and f.endswith(".safetensors") for f in files)
            except Exception:
                raise InputError(f"--from {directory}: {INDEX_FILE} is not a safetensors index (a JSON object "
                                 "whose weight_map maps each tensor to a .safetensors file beside it)") from None
        elif single.is_file():
            weight_map, files = None, [WEIGHTS_FILE]
        else:
            other = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
            raise InputError(f"--from {directory}: no {WEIGHTS_FILE} or {INDEX_FILE}"
                             + (f" (found {other[0]}: memplan reads safetensors only, never pickle; convert it with "
                                "transformers' save_pretrained(safe_serialization=True))" if other else ""))
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: set[str] = set()
        for name in files:
            path = directory / name
            if not path.is_file():
                raise InputError(f"--from {directory}: {INDEX_FILE} names {name}, which is missing")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if key in self.where:
                            raise InputError(f"--from {directory}: tensor {key} is in both {self.where[key]} "
                                             f"and {name}")
                        sl = f.get_slice(key)
                        self.where[key], self.shapes[key] = name, tuple(sl.get_shape())
                        self.dtypes.add(str(sl.get_dtype()))
            except InputError:
                raise
            except Exception as e:  # SafetensorError on a truncated or corrupt file
                raise InputError(f"--from {directory}: {name} is not a readable safetensors file "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.where.get(key) != name:
                    raise InputError(f"--from {directory}: {INDEX_FILE} puts tensor {key} in {name}, which does "
                                     "not hold it")

    def read(self, names) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out, by_file = {}, {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for file, keys in by_file.items():
            with safe_open(str(self.directory / file), framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out


def read_weights(directory: Path, spec: ModelSpec, notes: list | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The canonical tensors of a checkpoint, every name, shape, dtype and value checked first
    (``trainer.weights_guard``); and their dtype."""
    from trainer import weights_guard

    files, expected, rename, head = check_weights(directory, spec)
    raw = weights_guard.checked(files.read([rename.get(k, k) for k in expected]), directory, notes)
    hf = {k: raw[rename.get(k, k)] for k in expected}
    tensors = {e.target: _combine(e, [hf[n] for n, _ in e.sources], spec) for e in _layout(spec)}
    if not spec.tied:
        tensors["head.weight"] = hf[head]
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    return tensors, (dtypes.pop() if len(dtypes) == 1 else "mixed")


def check_weights(directory: Path, spec: ModelSpec):
    """Every tensor of the checkpoint's safetensors headers checked by name and shape against ``spec``, no
    data read: (files, expected HF names and shapes, renames of a prefix-less base model, the head's name);
    a missing, extra or misshapen tensor is an InputError naming it."""
    from trainer import weights_guard

    files = _Files(directory)
    weights_guard.check_dtypes(files, directory)  # floats only, by the headers (no data read)
    layout = _layout(spec)
    expected = {name: shape for e in layout for name, shape in e.sources}
    prefix = BASE_PREFIX[spec.arch]
    present = dict(files.shapes)
    rename = {}
    if not any(k.startswith(prefix) for k in present):  # a base model saved without its prefix (gpt2's own files)
        rename = {prefix + k: k for k in present if prefix + k in expected}
        present = {**{k: v for k, v in present.items() if k not in rename.values()},
                   **{new: present[old] for new, old in rename.items()}}
    head = head_name(spec)
    if spec.tied:
        if head in present and present[head] != (spec.vocab, spec.hidden):
            raise InputError(f"--from {directory}: tensor {head} has shape {list(present[head])}, expected "
                             f"{[spec.vocab, spec.hidden]} (vocab_size, hidden)")
        present.pop(head, None)  # tied: transformers ties it to the embedding
    else:
        expected[head] = (spec.vocab, spec.hidden)
    check_names_and_shapes(f"--from {directory}", {k: v for k, v in present.items() if not k.endswith(SKIPPED_BUFFERS)},
                           expected, f"a {spec.layers}-layer {spec.arch} with "
                                     f"tie_word_embeddings={str(spec.tied).lower()}")
    return files, expected, rename, head


def check_names_and_shapes(where: str, present: dict, expected: dict, described: str) -> None:
    """A checkpoint's tensors (``present``: name -> shape, buffers left out) against those of the model its
    config.json describes (``expected``, less any the model ties): the first missing, unknown or misshapen tensor
    is a one-line InputError naming it."""
    missing = [k for k in expected if k not in present]
    if missing:
        raise InputError(f"{where}: tensor {missing[0]} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + f"; config.json describes {described}")
    extra = sorted(k for k in present if k not in expected)
    if extra:
        raise InputError(f"{where}: tensor {extra[0]} is not part of the model config.json describes"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "") + "; refusing a partial load")
    for name, shape in expected.items():
        if present[name] != shape:
            raise InputError(f"{where}: tensor {name} has shape {list(present[name])}, config.json makes it "
                             f"{list(shape)}")


# ---- the tokenizer ---------------------------------------------------------------------------------------

def _token_id(value):
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_tokenizer(directory: Path, cfg: dict, spec: ModelSpec, flag: str = "--from"):
    """The checkpoint's own tokenizer.json, its end-of-text the config's eos_token_id."""
    from tokenizers import Tokenizer as HFTokenizer

    from trainer.tokenizer import EOT_CANDIDATES, Tokenizer

    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise InputError(f"{flag} {directory}: no {TOKENIZER_FILE}; memplan finetunes with the checkpoint's own "
                         "fast tokenizer (a tokenizer.json beside config.json)")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:
        raise InputError(f"{flag} {directory}: {TOKENIZER_FILE} is not readable "
                         f"({str(e).splitlines()[0][:160] if str(e) else type(e).__name__})") from None
    vocab = hf.get_vocab(with_added_tokens=True)
    largest = max(vocab.values()) if vocab else -1
    if largest >= spec.vocab:
        raise InputError(f"{flag} {directory}: {TOKENIZER_FILE} has token id {largest}, beyond the model's "
                         f"vocab_size {spec.vocab}")
    eos = _token_id(cfg.get("eos_token_id"))
    gen = directory / "generation_config.json"
    if eos is None and gen.is_file():
        try:
            eos = _token_id(json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id"))
        except (ValueError, AttributeError):
            eos = None
    token = hf.id_to_token(eos) if eos is not None else None
    if token is None:
        token = next((t for t in EOT_CANDIDATES if t in vocab), None)
        if token is None:
            raise InputError(f"{flag} {directory}: config.json's eos_token_id {cfg.get('eos_token_id')!r:.20} is not "
                             f"a token of {TOKENIZER_FILE}, and it has none of {', '.join(EOT_CANDIDATES)}")
        eos = vocab[token]
    hf.encode_special_tokens = True  # as the trainer: the end-of-text string inside text is text
    tok = Tokenizer(hf, kind="file", eot_id=eos, eot_token=token, vocab_size=spec.vocab)
    return tok, tok.manifest_entry(str(path))


def import_hf(text: str | Path) -> ImportedModel:
    """The checkpoint ``--from`` names: spec, canonical weights and tokenizer, every piece checked."""
    directory = resolve_checkpoint(str(text))
    model_type, spec, cfg, max_ctx, notes = read_spec(directory)
    tokenizer, record = read_tokenizer(directory, cfg, spec)
    tensors, dtype = read_weights(directory, spec, notes)
    return ImportedModel(path=directory, model_type=model_type, spec=spec, tensors=tensors, tokenizer=tokenizer,
                         tokenizer_record=record, dtype=dtype, max_ctx=max_ctx, notes=tuple(notes))
