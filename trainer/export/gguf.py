"""GGUF export for llama.cpp and the apps built on it (LM Studio, Ollama, ...), written with the ``gguf``
package's GGUFWriter in the layout llama.cpp's own converter (``convert_hf_to_gguf.py``) produces.

Architectures and tensors (GGUF names; shapes as numpy/torch (out, in), GGUF stores them reversed):

llama    token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
         ffn_down}, output_norm, output (absent when tied: llama.cpp then uses token_embd).
         llama.cpp's llama graph applies RoPE to adjacent pairs (dims 2i, 2i+1), the trainer (like HF
         Llama) to halves (dims i, i + d/2); so the rows of each head of attn_q and attn_k are
         permuted as the converter's ``LlamaModel.permute`` does: (heads, 2, d/2, H) -> (heads, d/2, 2, H).
qwen2    as llama plus blk.N.attn_{q,k,v}.bias; llama.cpp's qwen2 graph uses NEOX RoPE (halves), so no
         permutation.
gpt2     token_embd, position_embd, blk.N.{attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down}
         with .weight and .bias, output_norm, output (written even when tied).
gptneox  token_embd, blk.N.{attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down} (+ biases),
         output_norm, output; attn_qkv rows are [q; k; v] (the converter undoes HF's per-head
         interleave to get the same); RoPE is llama.cpp's NEOX mode (halves) on the first
         rope.dimension_count dims, so no permutation.

RoPE scaling as llama.cpp's converter writes it: linear and yarn as ``{arch}.rope.scaling.*`` metadata, llama3
as the ``rope_freqs`` tensor of per-frequency divisors; dynamic NTK (which llama.cpp lacks) is refused in one
line (``gguf_rope_scaling``).

Norm weights and biases stay float32 whatever --dtype says (llama.cpp reads them as float32). ``q8_0``
stores each matrix in llama.cpp's Q8_0 blocks (32 weights, one f16 scale: 8.5 bits a weight), quantized by
``gguf.quants``; a matrix whose rows are not a multiple of 32 falls back to float16, as llama.cpp's
converter does.

Vocabulary (``tokenizer.ggml.*``): model ``gpt2`` (byte-level BPE): every token string in id order,
its type (CONTROL for special tokens such as <|endoftext|>, NORMAL otherwise, UNUSED for embedding rows
beyond the tokenizer), and the merges in rank order as "left right". The pre-tokenizer is named
``gpt-2``: ``memplan prepare --tokenizer bpe:N`` trains a ByteLevel BPE with GPT-2's split regex and no
prefix space, which is exactly llama.cpp's ``gpt-2`` pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_GPT2). A
tokenizer.json with another normalizer or pre-tokenizer is refused rather than mislabelled: llama.cpp
would split text differently from training. <|endoftext|> is BOS, EOS and EOT; no BOS is added to a
prompt (training data reads ``EOT doc EOT doc``, and memplan generate does not add one either).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from memplan.errors import InputError
from trainer.export.common import MARKER, LoadedRun, commit_files, family_of, temp_sibling

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "gpt2": "gpt2", "gpt_neox": "gptneox"}
PRE_TOKENIZER = "gpt-2"
Q8_BLOCK = 32  # weights per Q8_0 block (each block: 32 int8 and one f16 scale)


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from half-split to adjacent-pair order: (heads, 2, d/2, ...) -> (heads, d/2, 2, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(run: LoadedRun) -> dict[str, np.ndarray]:
    """The run's weights under llama.cpp's names and layouts, float32 numpy, in writing order."""
    spec = run.spec

    def t(name: str) -> np.ndarray:
        return run.tensor(name).float().numpy()

    H, kv, F = spec.hidden, spec.kv_dim, spec.ffn
    out = {"token_embd.weight": t("embed.weight")}
    if spec.arch == "gpt2":
        out["position_embd.weight"] = t("pos.weight")
    for i in range(spec.layers):
        b, g = f"blocks.{i}.", f"blk.{i}."
        names = {"attn_norm": "norm1", "attn_output": "attn.proj", "ffn_norm": "norm2", "ffn_down": "mlp.down"}
        if spec.arch == "llama":
            q, k, v = np.split(t(b + "attn.qkv.weight"), [H, H + kv], axis=0)
            if spec.qkv_bias:  # qwen2: llama.cpp's qwen2 graph rotates halves (NEOX mode), as the trainer
                out[g + "attn_q.weight"], out[g + "attn_k.weight"], out[g + "attn_v.weight"] = q, k, v
                qb, kb, vb = np.split(t(b + "attn.qkv.bias"), [H, H + kv])
                out[g + "attn_q.bias"], out[g + "attn_k.bias"], out[g + "attn_v.bias"] = qb, kb, vb
            else:
                out[g + "attn_q.weight"] = permute_rotary(q, spec.heads)
                out[g + "attn_k.weight"] = permute_rotary(k, spec.kv_heads)
                out[g + "attn_v.weight"] = v
            gate, up = np.split(t(b + "mlp.up.weight"), [F], axis=0)
            out[g + "ffn_gate.weight"], out[g + "ffn_up.weight"] = gate, up
        else:
            names.update({"attn_qkv": "attn.qkv", "ffn_up": "mlp.up"})
        for gguf_name, ours in names.items():
            out[g + gguf_name + ".weight"] = t(b + ours + ".weight")
            if spec.bias:
                out[g + gguf_name + ".bias"] = t(b + ours + ".bias")
    if spec.rope_type == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(spec)
    out["output_norm.weight"] = t("norm.weight")
    if spec.norm == "layernorm":
        out["output_norm.bias"] = t("norm.bias")
    if not spec.tied or spec.arch != "llama":
        out["output.weight"] = t("head.weight")
    return dict(sorted(out.items(), key=lambda kv_: _order(kv_[0])))


def gguf_rope_scaling(spec) -> dict:
    """The RoPE scaling metadata llama.cpp reads (``gguf.Keys.Rope``), as its converter writes it: linear as
    type and factor; yarn as type, factor, original context and the betas it sets (llama.cpp's own yarn takes
    the attention factor as 0.1·ln(factor) + 1, transformers' default); llama3 as no metadata but the
    ``rope_freqs`` tensor (``llama3_rope_factors``). What llama.cpp cannot compute is an InputError: dynamic NTK
    (no such scaling in llama.cpp), and a yarn with its own attention_factor, mscale or truncate false."""
    import gguf

    kind, p = spec.rope_type, dict(spec.rope_scaling)
    if kind in ("default", "llama3"):
        return {}
    if kind == "linear":
        return {gguf.Keys.Rope.SCALING_TYPE: gguf.RopeScalingType.LINEAR.value,
                gguf.Keys.Rope.SCALING_FACTOR: p["factor"]}
    own = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if p.get(k)]
    if kind == "yarn" and not own and p.get("truncate", True):
        out = {gguf.Keys.Rope.SCALING_TYPE: gguf.RopeScalingType.YARN.value, gguf.Keys.Rope.SCALING_FACTOR: p["factor"],
               gguf.Keys.Rope.SCALING_ORIG_CTX_LEN: p["original_max_position_embeddings"]}
        if p.get("beta_fast"):
            out[gguf.Keys.Rope.SCALING_YARN_BETA_FAST] = p["beta_fast"]
        if p.get("beta_slow"):
            out[gguf.Keys.Rope.SCALING_YARN_BETA_SLOW] = p["beta_slow"]
        return out
    why = ("llama.cpp has no dynamic NTK scaling" if kind == "dynamic" else
           f"llama.cpp's yarn cannot take its {', '.join(own) or 'truncate false'}")
    raise InputError(f"--format gguf: the model's rope_type {kind!r} cannot be written ({why}); accepted for GGUF: "
                     "default, linear, llama3, yarn (without attention_factor, mscale, truncate false); "
                     "--format hf writes every scaling")


def write_rope_scaling(w, spec) -> None:
    """``gguf_rope_scaling``'s keys into the writer ``w``, with the writer's own typed adders."""
    import gguf

    adders = {gguf.Keys.Rope.SCALING_TYPE: w.add_rope_scaling_type,
              gguf.Keys.Rope.SCALING_FACTOR: w.add_rope_scaling_factor,
              gguf.Keys.Rope.SCALING_ORIG_CTX_LEN: w.add_rope_scaling_orig_ctx_len,
              gguf.Keys.Rope.SCALING_YARN_BETA_FAST: w.add_rope_scaling_yarn_beta_fast,
              gguf.Keys.Rope.SCALING_YARN_BETA_SLOW: w.add_rope_scaling_yarn_beta_slow}
    for key, value in gguf_rope_scaling(spec).items():
        adders[key](gguf.RopeScalingType(value) if key == gguf.Keys.Rope.SCALING_TYPE else value)


def llama3_rope_factors(spec) -> np.ndarray:
    """llama3 RoPE as llama.cpp takes it: ``rope_freqs``, one divisor per frequency (rotary_dim/2, float32), as
    its converter computes them (LlamaModel.generate_extra_tensors): 1 for wavelengths below
    original/high_freq_factor, factor beyond original/low_freq_factor, 1/((1 − s)/factor + s) between, s the
    smooth factor of transformers' ``_compute_llama3_parameters``."""
    import math

    p, dim = dict(spec.rope_scaling), spec.rotary_dim
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    freqs = 1.0 / (spec.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _order(name: str) -> tuple:
    """Writing order: embeddings, then blocks by number, then the output (as llama.cpp's converter)."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith(("token_embd", "position_embd", "rope_freqs")) else 2, 0, name)


def gguf_vocab(run: LoadedRun) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) from the run's tokenizer.json; InputError for one llama.cpp would misread."""
    from gguf import TokenType

    if run.tokenizer_json is None:
        raise InputError("--format gguf: the run used tiktoken's gpt2 encoding, which the checkpoint does not carry; "
                         "export a run trained with --tokenizer bpe:N (or a tokenizer.json)")
    tj = json.loads(run.tokenizer_json)
    model, pre = tj.get("model") or {}, tj.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    byte_level_gpt2 = (model.get("type") == "BPE" and tj.get("normalizer") is None and pre.get("type") == "ByteLevel"
                       and pre.get("use_regex", True) and not pre.get("add_prefix_space", False))
    if not byte_level_gpt2:
        raise InputError(f"--format gguf: the run's tokenizer ({model.get('type')} model, {pre.get('type')} "
                         f"pre-tokenizer, normalizer {(tj.get('normalizer') or {}).get('type')}) is not one whose "
                         "llama.cpp pre-tokenizer memplan can name; GGUF export takes the byte-level BPE with GPT-2's "
                         "split that `memplan prepare --tokenizer bpe:N` trains")
    by_id: dict[int, tuple[str, int]] = {i: (tok, TokenType.NORMAL) for tok, i in model["vocab"].items()}
    for added in tj.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], TokenType.CONTROL if added.get("special")
                                   else TokenType.USER_DEFINED)
    if max(by_id) >= run.spec.vocab:
        raise InputError(f"--format gguf: the tokenizer has ids up to {max(by_id)}, the model's vocabulary is "
                         f"{run.spec.vocab}")
    tokens, types = [], []
    for i in range(run.spec.vocab):
        tok, kind = by_id.get(i, (f"[PAD{i}]", TokenType.UNUSED))  # embedding rows no token uses
        tokens.append(tok)
        types.append(int(kind))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return tokens, types, merges


def write_gguf(run: LoadedRun, out: Path, dtype: str) -> tuple[str, list[str]]:
    import gguf

    spec = run.spec
    arch = GGUF_ARCH[family_of(spec)]
    gguf_rope_scaling(spec)  # a RoPE scaling llama.cpp cannot compute is refused before anything is written
    tokens, types, merges = gguf_vocab(run)
    tensors = gguf_tensors(run)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    tmp = temp_sibling(out)
    try:
        w = gguf.GGUFWriter(str(tmp / out.name), arch)
        w.add_name(run.run_dir.resolve().name or "memplan")
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_string(f"{MARKER}.source", json.dumps({"run": str(run.run_dir), "checkpoint": str(run.checkpoint),
                                                     "step": run.step, "spec": spec.to_dict()}))
        # RoPE extrapolates poorly beyond the context it trained at; a learned table has its rows
        w.add_context_length(spec.max_positions if spec.pos == "learned" else run.ctx)
        w.add_embedding_length(spec.hidden)
        w.add_block_count(spec.layers)
        w.add_feed_forward_length(spec.ffn)
        w.add_head_count(spec.heads)
        w.add_head_count_kv(spec.kv_heads)
        w.add_vocab_size(spec.vocab)
        if spec.norm == "rmsnorm":
            w.add_layer_norm_rms_eps(spec.norm_eps)
        else:
            w.add_layer_norm_eps(spec.norm_eps)
        if spec.pos == "rope":
            w.add_rope_dimension_count(spec.rotary_dim)
            w.add_rope_freq_base(spec.rope_theta)
            write_rope_scaling(w, spec)
        if spec.arch == "gpt_neox":
            w.add_parallel_residual(True)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(PRE_TOKENIZER)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for add in (w.add_bos_token_id, w.add_eos_token_id, w.add_eot_token_id):
            add(run.eot_id)
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        for name, array in tensors.items():
            if array.ndim == 1 or dtype == "float32":  # norms and biases stay float32
                w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
            elif dtype == "float16" or (dtype == "q8_0" and array.shape[-1] % Q8_BLOCK):
                w.add_tensor(name, array.astype(np.float16))
            else:
                qtype = gguf.GGMLQuantizationType.BF16 if dtype == "bfloat16" else gguf.GGMLQuantizationType.Q8_0
                packed = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
                w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        commit_files(tmp, out, [out.name])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return arch, [f"tokenizer.ggml.pre = {PRE_TOKENIZER!r}: the byte-level BPE with GPT-2's split that the run "
                  "trained with"]
