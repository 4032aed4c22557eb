"""Hugging Face export: a directory ``transformers`` loads as LlamaForCausalLM, Qwen2ForCausalLM,
GPT2LMHeadModel or GPTNeoXForCausalLM with no custom code (``AutoModelForCausalLM.from_pretrained(DIR)``).

Weight names and layouts, from the trainer's canonical names (``trainer/model.py``):

llama   (and qwen2, the same with q/k/v biases)
        embed -> model.embed_tokens; blocks.i.attn.qkv (rows [q; k; v]) -> self_attn.{q,k,v}_proj;
        attn.proj -> o_proj; mlp.up (rows [gate; up]) -> mlp.{gate,up}_proj; mlp.down -> down_proj;
        norm1/norm2 -> input_layernorm/post_attention_layernorm; norm -> model.norm; head -> lm_head.
        Rotary needs no permutation: the trainer rotates in HF Llama's half-split layout (rotate_half).
gpt2    transformer.{wte,wpe,h.i.*,ln_f}; GPT-2's Conv1D stores (in, out), the transpose of nn.Linear,
        so c_attn / c_proj / c_fc weights are transposed; c_attn's columns are [q | k | v] as ours.
gpt_neox gpt_neox.{embed_in,layers.i.*,final_layer_norm}, embed_out; query_key_value interleaves per
        head ([q_h; k_h; v_h] for each head h, HF's view(..., heads, 3·head_dim)), so our [q; k; v]
        rows are regrouped by head.

RoPE scaling (llama3, linear, dynamic, yarn: ``ModelSpec.rope_scaling``) is written as config.json's
``rope_scaling``, which transformers 4.45 on reads as such and transformers 5 standardizes into its
``rope_parameters``; ``max_position_embeddings`` is then the model's own (dynamic NTK scales from it), not the
context trained at.

GELU is written as ``gelu_pytorch_tanh`` (the tanh approximation the trainer uses), so transformers
computes exactly what the trainer does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.export.common import MARKER, LoadedRun, commit_dir, family_of, temp_sibling

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CLASS_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel",
               "gpt_neox": "GPTNeoXForCausalLM"}


def hf_tensors(run: LoadedRun) -> dict[str, torch.Tensor]:
    """The run's weights under the transformers class's names and layouts (fp32 or the stored dtype)."""
    spec, t = run.spec, run.tensor
    H, kv, F = spec.hidden, spec.kv_dim, spec.ffn
    out = {}
    if spec.arch == "llama":
        out["model.embed_tokens.weight"] = t("embed.weight")
        for i in range(spec.layers):
            p, b = f"model.layers.{i}.", f"blocks.{i}."
            q, k, v = t(b + "attn.qkv.weight").split([H, kv, kv], dim=0)
            out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
            out[p + "self_attn.v_proj.weight"] = v
            if spec.qkv_bias:  # qwen2
                qb, kb, vb = t(b + "attn.qkv.bias").split([H, kv, kv], dim=0)
                out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"] = qb, kb
                out[p + "self_attn.v_proj.bias"] = vb
            out[p + "self_attn.o_proj.weight"] = t(b + "attn.proj.weight")
            gate, up = t(b + "mlp.up.weight").split([F, F], dim=0)  # trainer: gate, up = h.chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = t(b + "mlp.down.weight")
            out[p + "input_layernorm.weight"] = t(b + "norm1.weight")
            out[p + "post_attention_layernorm.weight"] = t(b + "norm2.weight")
        out["model.norm.weight"] = t("norm.weight")
        if not spec.tied:
            out["lm_head.weight"] = t("head.weight")
    elif spec.arch == "gpt2":
        out["transformer.wte.weight"] = t("embed.weight")
        out["transformer.wpe.weight"] = t("pos.weight")
        for i in range(spec.layers):
            p, b = f"transformer.h.{i}.", f"blocks.{i}."
            out[p + "ln_1.weight"], out[p + "ln_1.bias"] = t(b + "norm1.weight"), t(b + "norm1.bias")
            out[p + "attn.c_attn.weight"] = t(b + "attn.qkv.weight").T  # Conv1D: (in, out)
            out[p + "attn.c_attn.bias"] = t(b + "attn.qkv.bias")
            out[p + "attn.c_proj.weight"] = t(b + "attn.proj.weight").T
            out[p + "attn.c_proj.bias"] = t(b + "attn.proj.bias")
            out[p + "ln_2.weight"], out[p + "ln_2.bias"] = t(b + "norm2.weight"), t(b + "norm2.bias")
            out[p + "mlp.c_fc.weight"] = t(b + "mlp.up.weight").T
            out[p + "mlp.c_fc.bias"] = t(b + "mlp.up.bias")
            out[p + "mlp.c_proj.weight"] = t(b + "mlp.down.weight").T
            out[p + "mlp.c_proj.bias"] = t(b + "mlp.down.bias")
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = t("norm.weight"), t("norm.bias")
        if not spec.tied:
            out["lm_head.weight"] = t("head.weight")
    else:  # gpt_neox
        heads, hd = spec.heads, spec.head_dim
        out["gpt_neox.embed_in.weight"] = t("embed.weight")
        for i in range(spec.layers):
            p, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
            w = t(b + "attn.qkv.weight")  # rows [q (heads·hd); k; v]
            out[p + "attention.query_key_value.weight"] = (
                w.view(3, heads, hd, H).transpose(0, 1).reshape(3 * H, H))  # rows [q_0; k_0; v_0; q_1; ...]
            out[p + "attention.query_key_value.bias"] = (
                t(b + "attn.qkv.bias").view(3, heads, hd).transpose(0, 1).reshape(3 * H))
            out[p + "attention.dense.weight"], out[p + "attention.dense.bias"] = (
                t(b + "attn.proj.weight"), t(b + "attn.proj.bias"))
            out[p + "mlp.dense_h_to_4h.weight"], out[p + "mlp.dense_h_to_4h.bias"] = (
                t(b + "mlp.up.weight"), t(b + "mlp.up.bias"))
            out[p + "mlp.dense_4h_to_h.weight"], out[p + "mlp.dense_4h_to_h.bias"] = (
                t(b + "mlp.down.weight"), t(b + "mlp.down.bias"))
            out[p + "input_layernorm.weight"], out[p + "input_layernorm.bias"] = (
                t(b + "norm1.weight"), t(b + "norm1.bias"))
            out[p + "post_attention_layernorm.weight"], out[p + "post_attention_layernorm.bias"] = (
                t(b + "norm2.weight"), t(b + "norm2.bias"))
        out["gpt_neox.final_layer_norm.weight"] = t("norm.weight")
        out["gpt_neox.final_layer_norm.bias"] = t("norm.bias")
        if not spec.tied:
            out["embed_out.weight"] = t("head.weight")
    return out


def hf_config(run: LoadedRun, dtype: str) -> dict:
    """config.json: the class's own keys (transformers 4.45 through 5 read them)."""
    spec = run.spec
    # RoPE extrapolates poorly beyond what it trained at: advertise that; a learned table has its rows. A scaled
    # RoPE keeps the model's own max_positions: dynamic NTK (and a yarn without its factor) computes from it.
    context = spec.max_positions if spec.pos == "learned" or spec.rope_scaling else run.ctx
    cfg = {**spec_config(spec, context, dtype, rope_scaling=True), "bos_token_id": run.eot_id, "eos_token_id": run.eot_id}
    cfg[MARKER] = {"run": str(run.run_dir), "checkpoint": str(run.checkpoint), "step": run.step,
                   "tokens": run.meta.get("tokens"), "spec": spec.to_dict()}
    return cfg


def spec_config(spec, context: int, dtype: str = "float32", rope_scaling: bool = False) -> dict:
    """The transformers config (as config.json's dict) of the model ``spec`` describes, ``context``
    positions long: the family's class and its own keys, the spec's dropout in the family's fields
    (``memplan.model.DROPOUT_KEYS``: a llama has attention dropout only), no token ids. ``rope_scaling``: with the
    spec's RoPE scaling (what an export writes); without it (``--stack transformers``' trace and measurement)
    RoPE is plain, which moves no tensor, and transformers' dynamic NTK update, a branch on a tensor's value,
    cannot run on fake tensors."""
    family = family_of(spec)
    common = {"architectures": [CLASS_NAMES[family]], "vocab_size": spec.vocab,
              "tie_word_embeddings": spec.tied, "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
              "initializer_range": 0.02}
    if spec.arch == "llama":
        cfg = {"model_type": "llama", "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
               "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
               "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
               "max_position_embeddings": context, "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta,
               "rope_scaling": None, "attention_bias": False, "attention_dropout": spec.attn_dropout, "mlp_bias": False,
               "pretraining_tp": 1}
        if rope_scaling and spec.rope_scaling:  # dynamic NTK scales from the model's own max_position_embeddings
            cfg.update(rope_scaling=dict(spec.rope_scaling), max_position_embeddings=spec.max_positions)
        if family == "qwen2":
            cfg = {**{k: v for k, v in cfg.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")},
                   "model_type": "qwen2", "use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": spec.layers}
    elif spec.arch == "gpt2":
        cfg = {"model_type": "gpt2", "n_embd": spec.hidden, "n_layer": spec.layers, "n_head": spec.heads,
               "n_inner": spec.ffn, "n_positions": spec.max_positions, "n_ctx": spec.max_positions,
               "activation_function": "gelu_new" if spec.act == "gelu_new" else "gelu_pytorch_tanh", "layer_norm_epsilon": spec.norm_eps,
               "resid_pdrop": spec.resid_dropout, "embd_pdrop": spec.embd_dropout, "attn_pdrop": spec.attn_dropout, "scale_attn_weights": True}
    else:
        cfg = {"model_type": "gpt_neox", "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
               "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "hidden_act": "gelu_pytorch_tanh",
               "max_position_embeddings": context, "rotary_pct": spec.rotary_pct,
               "partial_rotary_factor": spec.rotary_pct, "rotary_emb_base": spec.rope_theta,
               "rope_theta": spec.rope_theta, "layer_norm_eps": spec.norm_eps, "use_parallel_residual": True,
               "attention_bias": True, "attention_dropout": spec.attn_dropout,
               "hidden_dropout": spec.resid_dropout}
    return {**common, **cfg}


def tokenizer_files(run: LoadedRun, context: int) -> dict[str, str]:
    """tokenizer.json as trained, plus the config that makes AutoTokenizer load it as a fast tokenizer."""
    if run.tokenizer_json is None:
        return {}
    eot = run.eot_token
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "split_special_tokens": True, **special}  # as the trainer: "<|endoftext|>" in text is text
    return {"tokenizer.json": run.tokenizer_json,
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def write_hf_dir(run: LoadedRun, out: Path, tensors: dict, config: dict, context: int) -> None:
    """``out`` as ``save_pretrained`` lays it out: model.safetensors, config.json, generation_config.json and the
    tokenizer's files (``context`` positions long), written into a temporary sibling and moved into place whole
    (a failure leaves ``out`` as it was and no temporary behind)."""
    from safetensors.torch import save_file

    generation = {"bos_token_id": run.eot_id, "eos_token_id": run.eot_id, "pad_token_id": run.eot_id}
    tmp = temp_sibling(out)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
        for name, text in tokenizer_files(run, context).items():
            (tmp / name).write_text(text, encoding="utf-8")
        commit_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_hf(run: LoadedRun, out: Path, dtype: str) -> tuple[str, list[str]]:
    tensors = {k: v.to(TORCH_DTYPES[dtype]).contiguous() for k, v in hf_tensors(run).items()}
    config = hf_config(run, dtype)
    write_hf_dir(run, out, tensors, config, config.get("max_position_embeddings", config.get("n_positions")))
    notes = [] if run.tokenizer_json is not None else [
        "the run used tiktoken's gpt2 encoding: no tokenizer files written; load the `gpt2` tokenizer from "
        "transformers (the same vocabulary)"]
    return CLASS_NAMES[family_of(run.spec)], notes
