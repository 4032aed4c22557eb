"""memplan export --format gguf: gguf's own reader round-trips every tensor and key; an independent numpy forward
pass over the GGUF tensors, computed the way llama.cpp's graphs do (adjacent-pair RoPE for llama, NEOX RoPE on
the first dims for gptneox, learned positions for gpt2), reproduces the trainer's logits; and a plain BPE over
the GGUF vocabulary and merges, after GPT-2's split (the pre-tokenizer the file names), tokenizes text as the
run's tokenizer does.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from runs_helper import tiny_corpus, tiny_run
from trainer.loop import load_trained

TEXT = "Story 7. Once upon a time a fox walked to the river. It met an owl, and they talked!"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    corpus = tiny_corpus(root)
    return {
        "llama": tiny_run(root / "llama", corpus, arch="llama", steps=8),  # GQA: 4 heads, 2 kv heads; tied
        "llama-untied": tiny_run(root / "llama-untied", corpus, arch="llama", steps=8, tied=False),
        "qwen2": tiny_run(root / "qwen2", corpus, arch="llama", steps=8, qkv_bias=True, rope_theta=500.0),
        "gpt2": tiny_run(root / "gpt2", corpus, arch="gpt2", steps=8),
        "gpt_neox": tiny_run(root / "gpt_neox", corpus, arch="gpt_neox", steps=8, rotary_pct=0.25, tied=False,
                             rope_theta=500.0),  # a non-default base must reach the runtime
    }


def export(run, out, *extra):
    result = CliRunner().invoke(app, ["export", "--run", str(run), "--format", "gguf", "--out", str(out), "--json",
                                      *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def read(path):
    from gguf import GGUFReader, quants

    reader = GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return fields, tensors, types


# ---- an independent forward pass, as llama.cpp computes it ---------------------------------------

def _norm(x, w, b, eps, rms):
    if rms:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _rope(x, n_rot, base, neox):
    """x (T, heads, d): rotate the first n_rot dims; pairs (2i, 2i+1) (llama.cpp's normal mode) or (i, i + n_rot/2)
    (NEOX mode), angle pos · base^(−2i/n_rot)."""
    T = x.shape[0]
    half = n_rot // 2
    theta = np.arange(T)[:, None] * base ** (-2.0 * np.arange(half) / n_rot)[None, :]  # (T, half)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half], out[..., half:n_rot] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a * cos - b * sin, b * cos + a * sin
    return out


def _attention(q, k, v):
    """q (T, heads, d), k and v (T, kv_heads, d): causal softmax attention; query head h reads kv head h // groups."""
    T, heads, d = q.shape
    groups = heads // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = np.where(np.triu(np.ones((T, T), bool), 1)[None], -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(T, heads * d)


def gguf_forward(fields, W, ids):
    """Logits (T, vocab) of token ids (T,) from a GGUF file's keys and tensors alone."""
    arch = fields["general.architecture"]
    key = lambda name: fields.get(f"{arch}.{name}")  # noqa: E731
    L, heads, kv_heads = key("block_count"), key("attention.head_count"), key("attention.head_count_kv") or \
        key("attention.head_count")
    rms = key("attention.layer_norm_rms_epsilon") is not None
    eps = key("attention.layer_norm_rms_epsilon") if rms else key("attention.layer_norm_epsilon")
    H = key("embedding_length")
    d = H // heads
    get = lambda name: W.get(name)  # noqa: E731
    lin = lambda x, name: x @ W[name + ".weight"].T + (W[name + ".bias"] if name + ".bias" in W else 0)  # noqa: E731
    norm = lambda x, name: _norm(x, W[name + ".weight"], get(name + ".bias"), eps, rms)  # noqa: E731
    gelu = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))  # noqa: E731
    T = len(ids)
    x = W["token_embd.weight"][ids].astype(np.float64)
    if "position_embd.weight" in W:
        x = x + W["position_embd.weight"][:T]
    for i in range(L):
        p = f"blk.{i}."
        h = norm(x, p + "attn_norm")
        if arch in ("llama", "qwen2"):
            q, k, v = lin(h, p + "attn_q"), lin(h, p + "attn_k"), lin(h, p + "attn_v")
        else:
            q, k, v = np.split(lin(h, p + "attn_qkv"), [H, H + kv_heads * d], axis=-1)
        q, k, v = q.reshape(T, heads, d), k.reshape(T, kv_heads, d), v.reshape(T, kv_heads, d)
        if arch in ("llama", "qwen2", "gptneox"):
            neox = arch in ("qwen2", "gptneox")  # llama.cpp's rope type of each architecture
            q = _rope(q, key("rope.dimension_count"), key("rope.freq_base"), neox=neox)
            k = _rope(k, key("rope.dimension_count"), key("rope.freq_base"), neox=neox)
        a = lin(_attention(q, k, v), p + "attn_output")
        if arch == "gptneox" and key("use_parallel_residual"):
            h2 = norm(x, p + "ffn_norm")
            x = x + a + lin(gelu(lin(h2, p + "ffn_up")), p + "ffn_down")
            continue
        x = x + a
        h = norm(x, p + "ffn_norm")
        if arch in ("llama", "qwen2"):
            g = lin(h, p + "ffn_gate")
            x = x + lin(g / (1 + np.exp(-g)) * lin(h, p + "ffn_up"), p + "ffn_down")
        else:
            x = x + lin(gelu(lin(h, p + "ffn_up")), p + "ffn_down")
    x = norm(x, "output_norm")
    return x @ W.get("output.weight", W["token_embd.weight"]).T


@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("llama-untied", "llama"), ("qwen2", "qwen2"),
                                       ("gpt2", "gpt2"), ("gpt_neox", "gptneox")])
def test_a_numpy_forward_over_the_gguf_tensors_reproduces_the_trainers_logits(runs, name, arch, tmp_path):
    assert export(runs[name], tmp_path / "m.gguf")["arch"] == arch
    fields, W, _ = read(tmp_path / "m.gguf")
    assert fields["general.architecture"] == arch
    model, tok, _ = load_trained(runs[name])
    ids = tok.encode(TEXT)
    with torch.no_grad():
        want = model(torch.tensor([ids])).float()[0].numpy()
    got = gguf_forward(fields, W, np.array(ids))
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("dtype,ggml,file_type", [("float16", "F16", 1), ("bfloat16", "BF16", 32),
                                                  ("q8_0", "Q8_0", 7)])
def test_half_precision_and_q8_0_store_matrices_so_and_norms_in_f32_and_stay_close(runs, tmp_path, dtype, ggml,
                                                                              file_type):
    report = export(runs["llama"], tmp_path / "m.gguf", "--dtype", dtype)
    assert report["dtype"] == dtype
    fields, W, types = read(tmp_path / "m.gguf")
    assert fields["general.file_type"] == file_type  # MOSTLY_F16 / MOSTLY_BF16
    assert types["blk.0.attn_q.weight"] == ggml and types["token_embd.weight"] == ggml
    assert types["blk.0.attn_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    model, tok, _ = load_trained(runs["llama"])
    ids = tok.encode(TEXT)
    with torch.no_grad():
        want = model(torch.tensor([ids])).float()[0].numpy()
    err = np.abs(gguf_forward(fields, W, np.array(ids)) - want).max()
    # a weight keeps 11 significant bits in f16 (relative error ≤ 2^-11), 8 in bf16 (≤ 2^-8), Q8_0 ±127 steps
    # of its block's largest; measured here about 1.4e-4, 1.1e-3 and 4e-3 of the largest logit
    assert err < {"float16": 1e-3, "bfloat16": 1e-2, "q8_0": 1e-2}[dtype] * np.abs(want).max()


# ---- the reader round-trips every tensor and key ---------------------------------------------------

def test_the_reader_round_trips_every_tensor_and_key(runs, tmp_path):
    from trainer.export import load_run
    from trainer.export.gguf import gguf_tensors

    export(runs["llama"], tmp_path / "m.gguf")
    fields, W, _ = read(tmp_path / "m.gguf")
    run = load_run(runs["llama"])
    spec = run.spec
    written = gguf_tensors(run)
    assert set(W) == set(written)
    for name, array in written.items():
        np.testing.assert_array_equal(W[name], array, err_msg=name)
    # 9 tensors per llama block, the embedding and the final norm (tied: no output.weight)
    assert len(W) == 9 * spec.layers + 2 and "output.weight" not in W
    assert sum(a.size for a in W.values()) == spec.params
    tj = json.loads(run.tokenizer_json)
    expected = {
        "general.architecture": "llama", "general.file_type": 0,
        "llama.block_count": spec.layers, "llama.embedding_length": spec.hidden,
        "llama.feed_forward_length": spec.ffn, "llama.attention.head_count": spec.heads,
        "llama.attention.head_count_kv": spec.kv_heads, "llama.rope.dimension_count": spec.head_dim,
        "llama.context_length": run.ctx, "llama.vocab_size": spec.vocab,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": run.eot_id, "tokenizer.ggml.eos_token_id": run.eot_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.tokens": sorted(tj["model"]["vocab"], key=tj["model"]["vocab"].get),
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]],
    }
    for k, v in expected.items():
        assert fields[k] == v, k
    assert fields["llama.rope.freq_base"] == pytest.approx(spec.rope_theta)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(spec.norm_eps)
    assert fields["tokenizer.ggml.token_type"][run.eot_id] == 3  # CONTROL
    assert set(fields["tokenizer.ggml.token_type"]) == {1, 3}
    assert json.loads(fields["memplan_export.source"])["step"] == run.step


def test_the_gguf_vocabulary_tokenizes_text_as_the_run_does(runs, tmp_path):
    """GPT-2's split (llama.cpp's 'gpt-2' pre-tokenizer), bytes to GPT-2's printable characters, then the merges
    applied lowest rank first: the ids the run's tokenizer gives."""
    import regex

    export(runs["gpt2"], tmp_path / "m.gguf")
    fields, _, _ = read(tmp_path / "m.gguf")
    ids_of = {t: i for i, t in enumerate(fields["tokenizer.ggml.tokens"])}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(fields["tokenizer.ggml.merges"])}
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    byte_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_char[b] = chr(b)
        else:
            byte_char[b] = chr(256 + extra)
            extra += 1
    split = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(text):
        out = []
        for piece in split.findall(text):
            parts = [byte_char[b] for b in piece.encode("utf-8")]
            while len(parts) > 1:
                best = min(range(len(parts) - 1), key=lambda i: rank.get((parts[i], parts[i + 1]), math.inf))
                if (parts[best], parts[best + 1]) not in rank:
                    break
                parts[best:best + 2] = [parts[best] + parts[best + 1]]
            out += [ids_of[p] for p in parts]
        return out

    _, tok, _ = load_trained(runs["gpt2"])
    for text in (TEXT, "  Two  spaces,\nnew lines and 1234 numbers — ünïcödé!", "the fox's owl'll"):
        assert bpe(text) == tok.encode(text), text


# ---- what GGUF cannot carry ----------------------------------------------------------------------

def test_a_tokenizer_llama_cpp_would_split_differently_is_refused(runs):
    from memplan.errors import InputError
    from trainer.export import load_run
    from trainer.export.gguf import gguf_vocab

    run = load_run(runs["llama"])
    tj = json.loads(run.tokenizer_json)
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    with pytest.raises(InputError, match="pre-tokenizer"):
        gguf_vocab(dataclasses.replace(run, tokenizer_json=json.dumps(tj)))
    tj = json.loads(run.tokenizer_json)
    tj["normalizer"] = {"type": "NFKC"}
    with pytest.raises(InputError, match="normalizer NFKC"):
        gguf_vocab(dataclasses.replace(run, tokenizer_json=json.dumps(tj)))


def test_embedding_rows_beyond_the_tokenizer_are_unused_tokens(runs):
    from trainer.export import load_run
    from trainer.export.gguf import gguf_vocab

    run = load_run(runs["llama"])
    wider = dataclasses.replace(run, spec=dataclasses.replace(run.spec, vocab=run.spec.vocab + 3))
    tokens, types, _ = gguf_vocab(wider)
    assert len(tokens) == run.spec.vocab + 3
    assert tokens[-1] == f"[PAD{run.spec.vocab + 2}]" and types[-3:] == [5, 5, 5]  # UNUSED
