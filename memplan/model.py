"""ModelSpec: the shape of a decoder-only transformer, its exact parameter count, and where shapes come from.

Three sources of a shape, all returning the same frozen ``ModelSpec``:

- ``from_size("350m")``: a documented table of Llama-style shapes (``SIZE_TABLE``), and for any
  other size a rule (``shape_for_params``) that picks depth and width the way small-model
  recipes do.
- ``preset("tinyllama-1.1b")``: named published models, each row citing the config it copies; some
  (``CONFIG_PRESETS``: smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, qwen3-0.6b, gemma-2b, phi-2) ship as that config.json itself.
- ``from_hf_config(path)``: a Hugging Face ``config.json`` of the llama, mistral, qwen2, gpt2,
  gpt_neox, phi, gemma, stablelm or qwen3 families.

The last four (``STACK_ARCHS``) are families memplan's own trainer does not build: their shapes
are counted exactly and walked as transformers runs them (``estimate --stack transformers``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import InputError
from memplan.units import choice_error, format_count, parse_count

ARCHS = ("llama", "gpt2", "gpt_neox", "phi", "gemma", "stablelm", "qwen3")
MEMPLAN_ARCHS = ("llama", "gpt2", "gpt_neox")  # the families memplan's own trainer (trainer/model.py) builds
STACK_ARCHS = ("phi", "gemma", "stablelm", "qwen3")  # counted and walked as transformers runs them only
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
MLPS = ("swiglu", "gelu")  # swiglu: a gated MLP, down(act(gate(x))·up(x)), its act SiLU or (gemma) GELU
ACTS = ("silu", "gelu", "gelu_tanh", "gelu_new")  # gelu_new: transformers' NewGELUActivation, in Python ops
MAX_DIM = 2**31 - 1  # the largest count a shape field takes (a 32-bit count; far beyond any real model)

# Defaults of each family, applied where a field is left as None.
_FAMILY_DEFAULTS = {
    #            norm         pos        mlp       bias   parallel_residual  act
    "llama": ("rmsnorm", "rope", "swiglu", False, False, "silu"),
    "gpt2": ("layernorm", "learned", "gelu", True, False, "gelu_tanh"),
    "gpt_neox": ("layernorm", "rope", "gelu", True, True, "gelu"),
    # PhiDecoderLayer: one LayerNorm feeds attention and MLP (parallel), every linear with a bias
    "phi": ("layernorm", "rope", "gelu", True, True, "gelu_new"),
    # GemmaDecoderLayer: RMSNorm with (1 + w), GeGLU (gelu_pytorch_tanh on the gate)
    "gemma": ("rmsnorm", "rope", "swiglu", False, False, "gelu_tanh"),
    # StableLmDecoderLayer: LayerNorm, SwiGLU, q/k/v bias per use_qkv_bias, parallel per use_parallel_residual
    "stablelm": ("layernorm", "rope", "swiglu", False, False, "silu"),
    # Qwen3DecoderLayer: llama's with an RMSNorm on each head of q and of k (q_norm, k_norm)
    "qwen3": ("rmsnorm", "rope", "swiglu", False, False, "silu"),
}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shape of a decoder-only transformer. Frozen; derived values are properties."""

    arch: str  # family: llama (RMSNorm, RoPE, SwiGLU), gpt2 (LayerNorm, learned positions, GELU), gpt_neox
    layers: int  # number of transformer blocks
    hidden: int  # residual-stream width d_model
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when < heads)
    ffn: int  # MLP inner width (per matrix for SwiGLU's gate and up)
    vocab: int  # vocabulary size, rows of the embedding and of the LM head
    tied: bool  # LM head shares the embedding matrix
    norm: str | None = None  # rmsnorm | layernorm; None = the family's
    pos: str | None = None  # rope | learned; None = the family's
    mlp: str | None = None  # swiglu | gelu; None = the family's
    bias: bool | None = None  # biases on every linear layer except the LM head (gpt2, gpt_neox)
    qkv_bias: bool = False  # biases on the q, k and v projections only (qwen2)
    parallel_residual: bool | None = None  # attention and MLP read the same input (gpt_neox)
    rotary_pct: float = 1.0  # share of each head's dims that rotate (gpt_neox uses 0.25)
    act: str | None = None  # the MLP's activation (ACTS); None = the family's
    head_size: int | None = None  # each head's width where it is not hidden / heads (gemma, qwen3); None: hidden / heads
    max_positions: int = 2048  # rows of the learned position table; RoPE's nominal context
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # RoPE scaling (ROPE_SCALINGS), as transformers' rope_parameters: (key, value) pairs sorted by key, rope_type
    # among them; () is plain RoPE. A tuple so the spec stays hashable; a dict is taken and made one.
    rope_scaling: tuple = ()
    # model dropout, as GPT-2 places it (--dropout P sets all three; a config.json's own fields: DROPOUT_KEYS)
    attn_dropout: float = 0.0  # on the attention probabilities (SDPA's dropout_p)
    resid_dropout: float = 0.0  # after each attention and MLP output projection
    embd_dropout: float = 0.0  # after the embedding (token + positions)
    name: str = ""  # where the shape came from: a size, a preset or a file
    source: str = ""  # citation for a published shape

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise choice_error("--arch", self.arch, list(ARCHS))
        norm, pos, mlp, bias, parallel, act = _FAMILY_DEFAULTS[self.arch]
        for field, default in (("norm", norm), ("pos", pos), ("mlp", mlp), ("bias", bias),
                               ("parallel_residual", parallel), ("act", act)):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_positions"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
                raise InputError(f"--{field.replace('_', '-')}: {value!r} must be a positive integer, at most "
                                 f"{MAX_DIM:,}")
        if self.head_size is not None and (not isinstance(self.head_size, int) or isinstance(self.head_size, bool)
                                           or not 1 <= self.head_size <= MAX_DIM):
            raise InputError(f"head_dim: {self.head_size!r} must be a positive integer, at most {MAX_DIM:,}")
        if self.head_size is None and self.hidden % self.heads:
            divisors = [h for h in range(1, min(self.hidden, 128) + 1) if self.hidden % h == 0]
            raise InputError(
                f"--heads {self.heads} does not divide --hidden {self.hidden}; "
                f"head counts that do: {', '.join(map(str, divisors[-8:]))}"
            )
        if self.heads % self.kv_heads:
            divisors = [k for k in range(1, self.heads + 1) if self.heads % k == 0]
            raise InputError(
                f"--kv-heads {self.kv_heads} does not divide --heads {self.heads}; "
                f"accepted: {', '.join(map(str, divisors))}"
            )
        if self.norm not in NORMS:
            raise choice_error("norm", self.norm, list(NORMS))
        if self.pos not in POSITIONS:
            raise choice_error("pos", self.pos, list(POSITIONS))
        if self.mlp not in MLPS:
            raise choice_error("mlp", self.mlp, list(MLPS))
        if self.act not in ACTS:
            raise choice_error("act", self.act, list(ACTS))
        if not 0 < self.rotary_pct <= 1:
            raise InputError(f"rotary_pct: {self.rotary_pct} must be in (0, 1]")
        object.__setattr__(self, "rope_scaling", rope_scaling_pairs(self.rope_scaling, "rope_scaling"))
        if self.rope_scaling and self.pos != "rope":
            raise InputError(f"rope_scaling: {self.arch} with {self.pos} positions has no RoPE to scale "
                             "(accepted: rope_scaling with rotary positions only)")
        for field in ("attn_dropout", "resid_dropout", "embd_dropout"):
            check_dropout(getattr(self, field), f"--dropout ({field})")

    # ---- derived shape ---------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Each head's width: hidden / heads, or the config's own head_dim (gemma: 256 at hidden 2048, 8 heads)."""
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of q and of attention's output: heads · head_dim (hidden, unless head_dim is the config's own)."""
        return self.heads * self.head_dim

    @property
    def shared_norm(self) -> bool:
        """One norm per block feeds both attention and the MLP: phi's ``input_layernorm`` (PhiDecoderLayer),
        stablelm's with ``use_parallel_residual`` (no ``post_attention_layernorm``). gpt_neox's parallel
        block keeps two norms of the same input."""
        return self.arch == "phi" or (self.arch == "stablelm" and bool(self.parallel_residual))

    @property
    def norms_per_layer(self) -> int:
        return 1 if self.shared_norm else 2

    @property
    def qk_norm(self) -> bool:
        """qwen3's RMSNorm over each head of q and of k (``q_norm``, ``k_norm``, weights of width head_dim)."""
        return self.arch == "qwen3"

    @property
    def head_bias(self) -> bool:
        """phi's LM head has a bias (``nn.Linear(hidden_size, vocab_size, bias=True)``, PhiForCausalLM)."""
        return self.arch == "phi"

    @property
    def memplan_builds(self) -> bool:
        """Whether memplan's own trainer (trainer/model.py) builds this model."""
        return self.arch in MEMPLAN_ARCHS

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads · head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    # ---- parameter counts by group ---------------------------------------------------------
    @property
    def norm_params(self) -> int:
        """One norm: a scale (RMSNorm) or a scale and a shift (LayerNorm) of width hidden."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def attention_params(self) -> int:
        """Per layer: W_q (H×q), W_k and W_v (H×kv_dim each), W_o (q×H), q = heads·head_dim (H unless the
        config sets head_dim), plus biases, plus qwen3's q_norm and k_norm (head_dim each)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        if self.bias:
            n += q + 2 * kv + h
        elif self.qkv_bias:
            n += q + 2 * kv
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def mlp_params(self) -> int:
        """Per layer: SwiGLU's gate, up and down (3·H·F) or GELU's up and down (2·H·F), plus biases."""
        h, f = self.hidden, self.ffn
        if self.mlp == "swiglu":
            return 3 * h * f + (2 * f + h if self.bias else 0)
        return 2 * h * f + (f + h if self.bias else 0)

    @property
    def layer_params(self) -> int:
        """One block: attention, MLP and its norms (two; one where it is shared, phi)."""
        return self.attention_params + self.mlp_params + self.norms_per_layer * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding (V×H) plus the learned position table (max_positions×H) if any."""
        n = self.vocab * self.hidden
        if self.pos == "learned":
            n += self.max_positions * self.hidden
        return n

    @property
    def head_params(self) -> int:
        """The LM head (V×H) when untied, 0 when it shares the embedding; plus phi's head bias (V)."""
        return (0 if self.tied else self.vocab * self.hidden) + (self.vocab if self.head_bias else 0)

    @property
    def params(self) -> int:
        """Exact parameter count: embeddings, blocks, final norm and LM head."""
        return self.embedding_params + self.layers * self.layer_params + self.norm_params + self.head_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (what 6·N counts): blocks' weight
        matrices and the LM head (the embedding lookup and the norms do no matmul)."""
        per_layer = 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim
        per_layer += (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn
        return self.layers * per_layer + self.vocab * self.hidden

    @property
    def n_tensors(self) -> int:
        """Parameter tensors of memplan's reference model (the optimizer keeps per-tensor state
        such as AdamW's ``step``): per block the fused qkv, out-projection, MLP up (SwiGLU's gate
        and up fused) and down matrices, their biases, and two norms; then the final norm, the
        embedding, the position table and the untied head. The families memplan does not build
        (``STACK_ARCHS``) count transformers' tensors: q, k and v separate, a gated MLP's gate and up
        separate, one norm where it is shared, qwen3's q_norm and k_norm, phi's head bias."""
        if not self.memplan_builds:
            norm = 2 if self.norm == "layernorm" else 1
            mlp = 3 if self.mlp == "swiglu" else 2
            per_layer = 4 + mlp + self.norms_per_layer * norm + (2 if self.qk_norm else 0)
            per_layer += (3 + 1 + mlp) if self.bias else (3 if self.qkv_bias else 0)
            return self.layers * per_layer + norm + 1 + (0 if self.tied else 1) + (1 if self.head_bias else 0)
        per_layer = 4 + 2 * (2 if self.norm == "layernorm" else 1)
        if self.bias:
            per_layer += 4
        elif self.qkv_bias:
            per_layer += 1
        n = self.layers * per_layer + (2 if self.norm == "layernorm" else 1) + 1
        n += 0 if self.tied else 1
        n += 1 if self.pos == "learned" else 0
        return n

    def check_context(self, ctx: int) -> None:
        """A learned position table has max_positions rows: a longer context cannot be trained."""
        if self.pos == "learned" and ctx > self.max_positions:
            raise InputError(f"--ctx {ctx} exceeds the {self.max_positions} learned positions of this {self.arch} "
                             f"model; accepted: --ctx up to {self.max_positions}")

    def describe(self) -> str:
        """One line: ``llama 22.9M: 6 layers, hidden 384, 6 heads (6 kv), ffn 1024, vocab 32000, tied``."""
        kv = f"{self.kv_heads} kv" if self.kv_heads != self.heads else "MHA"
        return (
            f"{self.arch} {format_count(self.params)}: {self.layers} layers, hidden {self.hidden}, "
            f"{self.heads} heads{f' × {self.head_size}' if self.head_size is not None else ''} ({kv}), "
            f"ffn {self.ffn}, vocab {self.vocab}, "
            f"{'tied' if self.tied else 'untied'}"
        )

    def to_json(self) -> dict:
        """The ``model`` object of the --json output (docs/json.md)."""
        return {
            "params": self.params, "arch": self.arch, "layers": self.layers, "hidden": self.hidden,
            "heads": self.heads, "kv_heads": self.kv_heads, "ffn": self.ffn, "vocab": self.vocab,
            "tied": self.tied,
        }

    @property
    def rope_type(self) -> str:
        """The RoPE scaling's type (ROPE_SCALINGS), ``default`` where there is none."""
        return dict(self.rope_scaling).get("rope_type", "default")

    def to_dict(self) -> dict:
        """Every field, for plan files and checkpoints (``ModelSpec(**d)`` rebuilds it); ``rope_scaling`` as a
        JSON/TOML object, and only where there is one (a plain model's dict is what it was before the field)."""
        d = dataclasses.asdict(self)
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        else:
            del d["rope_scaling"]
        return d

    def size_note(self) -> str:
        """When the model is named after a size or preset (``22m``, ``tinyllama-1.1b``) but its count
        differs from what that name has, which part the name fixes and what this model really has:
        ``--params 22m`` is 22.9M at vocab 32,000; its blocks stay when the vocabulary (the data's
        tokenizer, or --vocab) changes, its embedding does not. "" when the count is the named one."""
        named = (self.name or "").split(",")[0].strip()
        try:
            base = preset(named) if named in PRESETS or named in CONFIG_PRESETS else from_size(named) if named else None
        except InputError:
            base = None
        if base is None or base.params == self.params:
            return ""
        blocks = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "bias", "qkv_bias", "norm", "mlp")
        if all(getattr(self, f) == getattr(base, f) for f in blocks):
            changed = [f"vocab {self.vocab:,}" if self.vocab != base.vocab else "",
                       ("tied" if self.tied else "untied") if self.tied != base.tied else ""]
            return (f"{named} is {base.params:,} parameters at vocab {base.vocab:,}"
                    f"{', ' + ('tied' if base.tied else 'untied') if self.tied != base.tied else ''}; the name fixes "
                    f"the {self.layers} blocks (hidden {self.hidden}, ffn {self.ffn}, "
                    f"{self.layer_params * self.layers:,} parameters), and with "
                    f"{' and '.join(c for c in changed if c)} this model has {self.params:,}")
        return f"{named} is {base.params:,} parameters as named; this shape, changed from it, has {self.params:,}"

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    @property
    def dropouts(self) -> bool:
        """Whether any dropout of the model is on (each costs a mask and an output in training)."""
        return bool(self.attn_dropout or self.resid_dropout or self.embd_dropout)


def check_dropout(p, flag: str = "--dropout") -> float:
    """A dropout probability in [0, 1), else the one-line InputError."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 <= p < 1:
        raise InputError(f"{flag}: {p!r} is not a dropout probability (accepted: a number in [0, 1), e.g. 0.1)")
    return float(p)


# each family's config.json dropout keys (transformers' names) → ModelSpec's fields, with the config
# class's default where the key is absent (GPT2Config: 0.1 each; the others 0.0)
DROPOUT_KEYS = {
    "gpt2": (("attn_pdrop", "attn_dropout", 0.1), ("resid_pdrop", "resid_dropout", 0.1),
             ("embd_pdrop", "embd_dropout", 0.1)),
    "gpt_neox": (("attention_dropout", "attn_dropout", 0.0), ("hidden_dropout", "resid_dropout", 0.0),
                 ("hidden_dropout", "embd_dropout", 0.0)),
    "phi": (("attention_dropout", "attn_dropout", 0.0), ("resid_pdrop", "resid_dropout", 0.0),
            ("embd_pdrop", "embd_dropout", 0.0)),
    "stablelm": (("attention_dropout", "attn_dropout", 0.0), ("hidden_dropout", "resid_dropout", 0.0)),
}
_ATTENTION_ONLY = (("attention_dropout", "attn_dropout", 0.0),)  # llama, mistral, qwen2, qwen3, gemma


def _config_dropouts(c, model_type: str) -> dict:
    """ModelSpec's dropout fields from a config.json's own keys (``DROPOUT_KEYS``), each a probability in [0, 1)."""
    out = {}
    for key, field, default in DROPOUT_KEYS.get(model_type, _ATTENTION_ONLY):
        value = c.cfg.get(key, default)
        out[field] = check_dropout(default if value is None else value, f"--model: {str(c.path)!r}: {key}")
    return out


# ---- sizes ---------------------------------------------------------------------------------

DEFAULT_VOCAB = 32000  # the Llama / TinyLlama SentencePiece vocabulary


def _llama(layers, hidden, heads, kv_heads, ffn, vocab=DEFAULT_VOCAB, tied=True, **kw) -> dict:
    return dict(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                vocab=vocab, tied=tied, **kw)


# Llama-style shapes for the sizes people ask about. Head width 64 throughout (128 at 7b), FFN
# about 8/3·hidden rounded to 256 (SwiGLU keeps the MLP's parameter count of a 4·H GELU),
# tied embeddings below 1B, grouped-query attention from 1B up.
SIZE_TABLE: dict[str, dict] = {
    "22m": _llama(6, 384, 6, 6, 1024, source="memplan: 6×384, like TinyStories-scale Llamas"),
    "124m": _llama(12, 768, 12, 12, 2048, vocab=50257,
                   source="memplan: GPT-2 small's depth, width and vocabulary in Llama form"),
    "350m": _llama(24, 1024, 16, 16, 2816, source="memplan: GPT-2 medium's depth and width in Llama form"),
    "1b": _llama(16, 2048, 32, 8, 8192,
                 source="Llama-3.2-1B's blocks (meta-llama/Llama-3.2-1B config.json) with a 32k vocabulary"),
    "1.1b": _llama(22, 2048, 32, 4, 5632, tied=False,
                   source="TinyLlama-1.1B (TinyLlama/TinyLlama_v1.1 config.json)"),
    "3b": _llama(28, 3072, 24, 8, 8192,
                 source="Llama-3.2-3B's blocks (meta-llama/Llama-3.2-3B config.json) with a 32k vocabulary"),
    "7b": _llama(32, 4096, 32, 32, 11008, tied=False, source="Llama-2-7B (meta-llama/Llama-2-7b-hf config.json)"),
    "13b": _llama(40, 5120, 40, 40, 13824, tied=False,
                  source="Llama-2-13B (meta-llama/Llama-2-13b-hf config.json)"),
    "34b": _llama(48, 8192, 64, 8, 22016, tied=False, rope_theta=1000000.0,
                  source="Code Llama 34B (codellama/CodeLlama-34b-hf config.json; Llama 2 34B was never released)"),
    "70b": _llama(80, 8192, 64, 8, 28672, tied=False,
                  source="Llama-2-70B (meta-llama/Llama-2-70b-hf config.json)"),
}


def _round_up(x: float, multiple: int) -> int:
    return max(multiple, int(-(-x // multiple) * multiple))


MAX_PARAMS = 10**13  # the largest --params planned (10T): the rule's depth search is linear in depth (~590 at 10T)


def shape_for_params(target: int, vocab: int = DEFAULT_VOCAB) -> dict:
    """The rule for a size not in SIZE_TABLE.

    Width follows depth with the aspect ratio of small Llamas, hidden = 64·layers (nanochat's
    "depth × 64"), with 64-wide heads, FFN = 8/3·hidden rounded up to 256, embeddings tied
    below 1B and 4 query heads per KV head from 1B up. Of the depths from 2 up, the one whose
    exact parameter count is closest to the target wins (the count grows with depth, so the
    search stops at the first depth at or above the target: any size up to ``MAX_PARAMS``).
    """
    if target > MAX_PARAMS:
        raise InputError(f"--params: {format_count(target)} is beyond the largest size planned, "
                         f"{format_count(MAX_PARAMS)}; give a size up to it")
    large = target >= 10**9
    best = None
    for layers in range(2, 1 << 20):
        hidden = 64 * layers
        heads = hidden // 64
        kv_heads = heads // 4 if large and heads % 4 == 0 else heads
        shape = _llama(layers, hidden, heads, kv_heads, _round_up(8 * hidden / 3, 256), vocab=vocab,
                       tied=not large)
        n = ModelSpec(**shape).params
        if best is None or abs(n - target) < abs(best[0] - target):
            best = (n, shape)
        if n >= target:
            break
    shape = dict(best[1])
    shape["source"] = "memplan's rule: hidden = 64·layers, ffn = 8/3·hidden, depth closest to the size"
    return shape


def from_size(text: str) -> ModelSpec:
    """A ModelSpec for ``--params SIZE``: a row of SIZE_TABLE or, for other sizes, shape_for_params."""
    key = str(text).strip().lower()
    if key in SIZE_TABLE:
        return ModelSpec(name=key, **SIZE_TABLE[key])
    try:
        target = parse_count(key, "--params")
    except InputError:
        raise InputError(
            f"--params: {text!r} is not a size; use one of {', '.join(SIZE_TABLE)} or a count such as 50m or 2.5b"
        ) from None
    if target < 100_000:
        raise InputError(f"--params: {text!r} is too small; the smallest size planned is 100k")
    return ModelSpec(name=key, **shape_for_params(target))


# ---- presets -------------------------------------------------------------------------------

_HF = "https://huggingface.co/{}/blob/main/config.json"

# Llama 3.1 / 3.2's RoPE scaling (their config.json's rope_scaling)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Published models, each copied from the config it cites (and, below, CONFIG_PRESETS: the config itself).
PRESETS: dict[str, dict] = {
    "gpt2": dict(arch="gpt2", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, tied=True,
                 max_positions=1024, source=_HF.format("openai-community/gpt2")),
    "gpt2-medium": dict(arch="gpt2", layers=24, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=50257,
                        tied=True, max_positions=1024, source=_HF.format("openai-community/gpt2-medium")),
    "gpt2-large": dict(arch="gpt2", layers=36, hidden=1280, heads=20, kv_heads=20, ffn=5120, vocab=50257,
                       tied=True, max_positions=1024, source=_HF.format("openai-community/gpt2-large")),
    "gpt2-xl": dict(arch="gpt2", layers=48, hidden=1600, heads=25, kv_heads=25, ffn=6400, vocab=50257,
                    tied=True, max_positions=1024, source=_HF.format("openai-community/gpt2-xl")),
    "tinyllama-1.1b": _llama(22, 2048, 32, 4, 5632, tied=False, norm_eps=1e-5,
                             source=_HF.format("TinyLlama/TinyLlama_v1.1")),
    "llama-3.2-3b": _llama(28, 3072, 24, 8, 8192, vocab=128256, tied=True, rope_theta=500000.0,
                           max_positions=131072, rope_scaling=_LLAMA3_ROPE, source=_HF.format("meta-llama/Llama-3.2-3B")),
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, tied=False, max_positions=4096,
                         source=_HF.format("meta-llama/Llama-2-7b-hf")),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, tied=False, rope_theta=1000000.0, max_positions=32768,
                         source=_HF.format("mistralai/Mistral-7B-v0.3")),
    "smollm2-360m": _llama(32, 960, 15, 5, 2560, vocab=49152, tied=True, rope_theta=100000.0,
                           source=_HF.format("HuggingFaceTB/SmolLM2-360M")),
    "pythia-70m": dict(arch="gpt_neox", layers=6, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=50304,
                       tied=False, rotary_pct=0.25, source=_HF.format("EleutherAI/pythia-70m")),
    "pythia-160m": dict(arch="gpt_neox", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50304,
                        tied=False, rotary_pct=0.25, source=_HF.format("EleutherAI/pythia-160m")),
    "pythia-410m": dict(arch="gpt_neox", layers=24, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=50304,
                        tied=False, rotary_pct=0.25, source=_HF.format("EleutherAI/pythia-410m")),
}


# ---- presets shipped as their config.json ------------------------------------------------------------
# Each is its model's config.json as published on the Hub (the repository cited here), copied unedited into
# memplan/presets/NAME.json (package data) and read as any --model config.json is (``from_hf_config``), so
# ``--model NAME`` is exactly ``--model that/config.json``, RoPE scaling included. The weights are not shipped
# and could not be fetched where these were written: the presets plan the real shape, and train from a
# checkpoint of the same family (``memplan train|finetune --from DIR``). The llama architectures train in
# memplan's own model; qwen3, gemma and phi in transformers' own model class (``--stack transformers``).
CONFIG_PRESETS: dict[str, str] = {  # preset name -> the Hub repository whose config.json it is
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M",  # llama: 30 × 576, 9 heads (3 kv), tied, rope_theta 1e5
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",  # qwen2: 24 × 896, 14 heads (2 kv), q/k/v biases, tied, rope_theta 1e6
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",  # llama: 16 × 2048, 32 heads (8 kv), tied, llama3 RoPE ×32
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",  # qwen3: 28 × 1024, 16 heads (8 kv), head_dim 128, q/k norms, tied
    "gemma-2b": "google/gemma-2b",  # gemma: 18 × 2048, 8 heads (1 kv), head_dim 256, GeGLU, tied
    "phi-2": "microsoft/phi-2",  # phi: 32 × 2560, 32 heads, partial rotary 0.4, parallel attention and MLP
}
PRESETS_DIR = Path(__file__).parent / "presets"


def config_preset_path(name: str) -> Path:
    """The config.json a ``CONFIG_PRESETS`` entry ships as."""
    return PRESETS_DIR / f"{name}.json"


def preset(name: str) -> ModelSpec:
    """A named published model; a misspelt name suggests the closest ones."""
    key = name.strip().lower()
    if key in CONFIG_PRESETS:
        spec = from_hf_config(config_preset_path(key), stack_families=True)
        return spec.replace(name=key, source=_HF.format(CONFIG_PRESETS[key]))
    if key not in PRESETS:
        raise choice_error("--model", name, sorted([*PRESETS, *CONFIG_PRESETS]))
    return ModelSpec(name=key, **PRESETS[key])


# ---- Hugging Face config.json --------------------------------------------------------------

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")  # memplan's own trainer builds these
STACK_MODEL_TYPES = STACK_ARCHS  # counted and walked for --stack transformers only (estimate, autotune, sweep)


# Directory names that say nothing about the model in them (``path/to/config.json`` is not a model "to").
GENERIC_DIRS = {"", ".", "..", "to", "path", "config", "configs", "model", "models", "tmp", "temp", "hf", "out",
                "output", "outputs", "export", "exports", "checkpoint", "checkpoints", "snapshots", "main", "data"}


def config_name(path: Path, cfg: dict) -> str:
    """The model's name for a Hugging Face config: its ``_name_or_path`` (a hub id such as
    ``TinyLlama/TinyLlama-1.1B``, or a local directory's last part); a file other than config.json
    by its stem; a hub cache snapshot by its repository (``models--ORG--NAME``); the parent directory
    when its name says something (not ``to``, ``models``, ``tmp``, a commit hash ...); else the
    config's ``model_type`` with ``config``."""
    given = str(cfg.get("_name_or_path") or "").strip().rstrip("/\\")
    if re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", given):  # a hub id, ORG/NAME or NAME
        return given
    if given and Path(given).name not in ("", ".", ".."):  # a local directory: its last part
        return Path(given).name
    if path.name != "config.json":
        return path.stem
    for part in reversed(path.resolve().parent.parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    parent = path.parent.name
    if parent.lower() not in GENERIC_DIRS and not re.fullmatch(r"[0-9a-f]{40}", parent):
        return parent
    return f"{cfg.get('model_type', 'hf')} config"


CONFIG_MAX_BYTES = 1 << 20  # a config.json is a few KiB; more is not one (read no further)


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_config(path: Path) -> dict:
    """The JSON object of a config file, read as UTF-8, at most CONFIG_MAX_BYTES; anything else one InputError."""
    what = f"--model: {str(path)!r}"
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"--model: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise InputError(f"{what} is a directory; give its config.json (or a preset name)") from None
    except OSError as e:
        raise InputError(f"{what} cannot be read ({e.strerror or e}); give a readable config.json") from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise InputError(f"{what} is over {CONFIG_MAX_BYTES // 2**20} MiB; a Hugging Face config.json is a few "
                         "KiB (accepted: a JSON object of at most 1 MiB)")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not UTF-8 text (byte {e.start}); accepted: a UTF-8 JSON object") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"{what} is not JSON ({e}); accepted: a JSON object such as a Hugging Face "
                         "config.json") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{what} holds a JSON {_JSON_KINDS.get(type(cfg), 'value')}, not a config "
                         "object; accepted: a JSON object with model_type, hidden_size, ...")
    return cfg


class _Config:
    """A config.json's values, each checked as it is read: a wrong type or range is an InputError naming the
    file, the key, the value and what is accepted."""

    def __init__(self, path: Path, cfg: dict):
        self.path, self.cfg = path, cfg
        self.model_type = cfg.get("model_type")

    def _bad(self, key: str, value, accepted: str) -> InputError:
        return InputError(f"--model: {str(self.path)!r}: {key} = {value!r:.40}; accepted: {accepted}")

    def need(self, *keys: str) -> None:
        missing = [k for k in keys if k not in self.cfg]
        if missing:
            raise InputError(f"--model: {str(self.path)!r} ({self.model_type}) is missing key(s) "
                             f"{', '.join(missing)}; a {self.model_type} config.json has each of "
                             f"{', '.join(keys)}")

    def count(self, key: str, default=None, *, optional: bool = False) -> int | None:
        """A whole number in [1, MAX_DIM] (None where ``optional`` and the key is absent or null)."""
        value = self.cfg.get(key)
        if value is None:  # absent or null: the default (HF's own configs write null for "unset")
            if optional:
                return None
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
            raise self._bad(key, value, f"a whole number from 1 to {MAX_DIM:,}")
        return value

    def number(self, key: str, default: float, *, at_most: float | None = None) -> float:
        """A finite number > 0 (and <= ``at_most``)."""
        value = default if self.cfg.get(key) is None else self.cfg[key]
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value <= 0 or (at_most is not None and value > at_most)):
            raise self._bad(key, value, "a finite number > 0" + (f" and <= {at_most:g}" if at_most else ""))
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = default if self.cfg.get(key) is None else self.cfg[key]
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def divides(self, heads_key: str, heads: int, hidden_key: str, hidden: int) -> None:
        """``heads`` divides ``hidden`` (query heads the width; kv heads the query heads)."""
        if hidden % heads:
            divisors = [d for d in range(1, min(hidden, 256) + 1) if hidden % d == 0]
            raise InputError(f"--model: {str(self.path)!r}: {heads_key} = {heads} does not divide {hidden_key} = "
                             f"{hidden}; accepted: a divisor of {hidden}, such as {', '.join(map(str, divisors[-8:]))}")


def from_hf_config(path: str | Path, stack_families: bool = False) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (``_shape_from_hf_config``) with the family's own
    dropout fields (``DROPOUT_KEYS``)."""
    path = Path(path)
    c = _Config(path, read_config(path))  # read once
    return _shape_from_hf_config(c, stack_families).replace(**_config_dropouts(c, c.model_type))


def _shape_from_hf_config(c: "_Config", stack_families: bool = False) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (llama, mistral, qwen2, gpt2, gpt_neox, and the
    ``STACK_ARCHS`` phi, gemma, stablelm, qwen3 where ``stack_families``: the commands whose walk follows
    transformers' code, ``--stack transformers``; elsewhere memplan's trainer would build the model,
    and these are refused).

    Every value memplan reads is checked here, naming its key (``hidden_size``, not ``--hidden``): whole
    numbers in [1, MAX_DIM], finite positive floats, booleans, head counts that divide."""
    path = c.path
    cfg, model_type = c.cfg, c.model_type
    if model_type not in HF_MODEL_TYPES and not (stack_families and model_type in STACK_MODEL_TYPES):
        also = "" if stack_families else (f" ({', '.join(STACK_MODEL_TYPES)}: with --stack transformers, in "
                                          "estimate, autotune, sweep and trace)")
        accepted = HF_MODEL_TYPES + (STACK_MODEL_TYPES if stack_families else ())
        raise InputError(
            f"--model: {str(path)!r} has model_type {model_type!r:.40}; accepted: {', '.join(accepted)}{also}"
        )
    common = dict(name=config_name(path, cfg), source=str(path))
    if model_type == "gpt2":
        c.need("n_embd", "n_layer", "n_head", "vocab_size")
        hidden, layers, heads, vocab = (c.count(k) for k in ("n_embd", "n_layer", "n_head", "vocab_size"))
        c.divides("n_head", heads, "n_embd", hidden)
        return ModelSpec(arch="gpt2", layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                         ffn=c.count("n_inner", optional=True) or 4 * hidden, vocab=vocab,
                         tied=c.flag("tie_word_embeddings", True), max_positions=c.count("n_positions", 1024),
                         norm_eps=c.number("layer_norm_epsilon", 1e-5, at_most=1),
                         # GPT2Config's default, "gelu_new": the tanh GELU in Python ops (what it saves differs)
                         act="gelu_new" if cfg.get("activation_function", "gelu_new") == "gelu_new" else None,
                         **common)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    c.need(*keys)
    hidden, layers, heads, ffn, vocab = (c.count(k) for k in keys)
    if model_type not in ("gemma", "qwen3"):  # their head_dim is their own
        c.divides("num_attention_heads", heads, "hidden_size", hidden)
    if model_type == "gpt_neox":
        return ModelSpec(arch="gpt_neox", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn,
                         vocab=vocab, tied=c.flag("tie_word_embeddings", False),
                         parallel_residual=c.flag("use_parallel_residual", True),
                         rotary_pct=_rotary_fraction(c, 0.25, keys=("rotary_pct", "partial_rotary_factor")),
                         max_positions=c.count("max_position_embeddings", 2048),
                         norm_eps=c.number("layer_norm_eps", 1e-5, at_most=1),
                         rope_theta=_rope_theta(c, keys=("rotary_emb_base", "rope_theta")), **common)
    if model_type in STACK_ARCHS:
        return _stack_family(c, model_type, hidden, layers, heads, ffn, vocab, common)
    attention_bias, mlp_bias = c.flag("attention_bias", False), c.flag("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise InputError(f"--model: {str(path)!r} sets attention_bias={attention_bias} but mlp_bias={mlp_bias}; "
                         "memplan plans biases on every linear layer or on none (qwen2: q, k, v only)")
    bias = attention_bias
    head_dim = c.count("head_dim", optional=True)
    if head_dim not in (None, hidden // heads):
        raise InputError(f"--model: {str(path)!r} has head_dim {head_dim} != hidden_size / "
                         f"num_attention_heads = {hidden // heads}; memplan plans head_dim = hidden / heads only")
    kv_heads = c.count("num_key_value_heads", optional=True) or heads
    c.divides("num_key_value_heads", kv_heads, "num_attention_heads", heads)
    max_positions = c.count("max_position_embeddings", 2048)
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     vocab=vocab,
                     tied=c.flag("tie_word_embeddings", False),  # LlamaConfig, MistralConfig, Qwen2Config
                     bias=bias, qkv_bias=model_type == "qwen2" and not bias,
                     max_positions=max_positions, rope_scaling=_rope_scaling(c, max_positions),
                     norm_eps=c.number("rms_norm_eps", 1e-6, at_most=1), rope_theta=_rope_theta(c), **common)


def _rotary_fraction(c: _Config, default: float, keys: tuple[str, ...] = ("partial_rotary_factor",)) -> float:
    """The share of each head that rotates: the first of ``keys`` at the top level (gpt_neox's configs:
    ``rotary_pct``, then ``partial_rotary_factor``), else (transformers 5) ``partial_rotary_factor`` inside
    ``rope_parameters``."""
    for key in keys:
        if c.cfg.get(key) is not None:
            return c.number(key, default, at_most=1)
    rope = c.cfg.get("rope_parameters")
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        return _Config(c.path, rope).number("partial_rotary_factor", default, at_most=1)
    return default


def _rope_theta(c: _Config, keys: tuple[str, ...] = ("rope_theta",)) -> float:
    """RoPE's base: the first of ``keys`` at the top level (gpt_neox's configs: ``rotary_emb_base``, then
    ``rope_theta``), else (transformers 5, which writes no top-level key) ``rope_theta`` inside
    ``rope_parameters``."""
    for key in keys:
        if c.cfg.get(key) is not None:
            return c.number(key, 10000.0)
    rope = c.cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        return _Config(c.path, rope).number("rope_theta", 10000.0)
    return 10000.0


# ---- RoPE scaling -------------------------------------------------------------------------------------
# The rope types memplan's model computes, as transformers' modeling_rope_utils does, and the keys each reads
# from rope_parameters / rope_scaling: (required, optional). rope_theta and partial_rotary_factor are read
# apart (``rope_theta``, ``rotary_pct``). original_max_position_embeddings, where a type takes it and the config
# leaves it out, is the config's max_position_embeddings (transformers' ``standardize_rope_params``).
ROPE_SCALINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}
ROPE_TYPES = ("default", *ROPE_SCALINGS)  # what a config's rope_type may be
_ROPE_MAY_BE_ZERO = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # 0: transformers' default (``or``)


def rope_scaling_pairs(value, where: str) -> tuple:
    """A RoPE scaling as ModelSpec keeps it: sorted (key, value) pairs with its ``rope_type`` (a dict, the pairs
    themselves or a list of them as JSON gives them back); () for none or ``default``. Every value is checked:
    the type one of ROPE_SCALINGS with each of its required keys, numbers finite and > 0,
    ``original_max_position_embeddings`` a whole number, ``truncate`` true or false; anything else an InputError
    naming ``where`` and the key."""
    if value is None or (isinstance(value, (tuple, list, dict)) and not value):
        return ()
    try:
        items = dict(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: {value!r:.60} is not an object of RoPE scaling parameters") from None
    kind = items.get("rope_type", items.get("type", "default"))
    if kind == "default":
        return ()
    if not isinstance(kind, str) or kind not in ROPE_SCALINGS:
        raise InputError(f"{where}: rope_type {kind!r:.40} is not one memplan computes; accepted: "
                         f"{', '.join(ROPE_TYPES)}")
    required, optional = ROPE_SCALINGS[kind]
    out: dict = {"rope_type": kind}
    for key in (*required, *optional):
        v = items.get(key)
        if v is None:
            if key in required:
                raise InputError(f"{where}: rope_type {kind!r} needs {key}; a {kind} scaling has each of "
                                 f"{', '.join(required)}")
            continue
        if key == "truncate":
            if not isinstance(v, bool):
                raise InputError(f"{where}: truncate = {v!r:.40}; accepted: true or false")
        elif key == "original_max_position_embeddings":
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DIM:
                raise InputError(f"{where}: {key} = {v!r:.40}; accepted: a whole number from 1 to {MAX_DIM:,}")
        elif (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
              or (v == 0 and key not in _ROPE_MAY_BE_ZERO)):
            raise InputError(f"{where}: {key} = {v!r:.40}; accepted: a finite number "
                             f"{'>= 0' if key in _ROPE_MAY_BE_ZERO else '> 0'}")
        else:
            v = float(v)
        out[key] = v
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise InputError(f"{where}: high_freq_factor {out['high_freq_factor']:g} <= low_freq_factor "
                         f"{out['low_freq_factor']:g}; accepted: high_freq_factor > low_freq_factor")
    return tuple(sorted(out.items()))


def _rope_scaling(c: _Config, max_positions: int) -> tuple:
    """The config's RoPE scaling (ModelSpec.rope_scaling): transformers 5's ``rope_parameters``, else the
    ``rope_scaling`` of earlier configs; its type ``rope_type`` (or the older ``type``). As transformers
    standardizes it, ``original_max_position_embeddings`` at the config's top level wins, then the one inside,
    then ``max_position_embeddings``. A type memplan does not compute (longrope, ...) is an InputError
    naming it and the accepted ones."""
    where = f"--model: {str(c.path)!r}"
    found = None
    for key in ("rope_parameters", "rope_scaling"):
        value = c.cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InputError(f"{where}: {key} = {value!r:.40}; accepted: an object with rope_type")
        found = (key, dict(value))
        break
    if found is None:
        return ()
    key, params = found
    kind = params.get("rope_type", params.get("type", "default"))
    if isinstance(kind, str) and kind in ROPE_SCALINGS and "original_max_position_embeddings" in ROPE_SCALINGS[kind][0]:
        top = c.cfg.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = (top if top is not None else
                                                      params.get("original_max_position_embeddings")
                                                      or max_positions)
    return rope_scaling_pairs(params, f"{where}: {key}")


# hidden_act values of each family's configs that memplan walks (transformers' ACT2FN names)
_HF_ACTS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _stack_family(c: _Config, model_type: str, hidden: int, layers: int, heads: int, ffn: int, vocab: int,
                  common: dict) -> ModelSpec:
    """phi, gemma, stablelm and qwen3 config.json (transformers' PhiConfig, GemmaConfig, StableLmConfig,
    Qwen3Config, with their defaults): the shape memplan counts and walks as transformers builds it."""
    path = str(c.path)
    kv_heads = c.count("num_key_value_heads", optional=True) or heads
    c.divides("num_key_value_heads", kv_heads, "num_attention_heads", heads)
    act_key = "hidden_activation" if model_type == "gemma" and c.cfg.get("hidden_activation") else "hidden_act"
    default_act = {"phi": "gelu_new", "gemma": "gelu_pytorch_tanh", "stablelm": "silu", "qwen3": "silu"}[model_type]
    hf_act = c.cfg.get(act_key) or default_act
    if model_type == "gemma" and hf_act == "gelu":  # GemmaConfig: the legacy "gelu" means the tanh approximation
        hf_act = "gelu_pytorch_tanh"
    if hf_act not in _HF_ACTS:
        raise InputError(f"--model: {path!r}: {act_key} = {hf_act!r:.40}; accepted: {', '.join(_HF_ACTS)}")
    for key in ("qk_layernorm",):
        if c.flag(key, False):
            raise InputError(f"--model: {path!r} sets {key}=true; memplan walks {model_type} without per-head "
                             f"norms on q and k (accepted: {key} false)")
    shape = dict(arch=model_type, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                 act=_HF_ACTS[hf_act], max_positions=c.count("max_position_embeddings", 2048),
                 rope_theta=_rope_theta(c), **common)
    if model_type in ("gemma", "qwen3"):
        head_dim = c.count("head_dim", 256 if model_type == "gemma" else 128)
        if c.flag("attention_bias", False):
            raise InputError(f"--model: {path!r} sets attention_bias=true; memplan walks {model_type} without "
                             "attention biases (accepted: attention_bias false)")
        return ModelSpec(**shape, head_size=head_dim if head_dim * heads != hidden else None,
                         tied=c.flag("tie_word_embeddings", model_type == "gemma"),
                         norm_eps=c.number("rms_norm_eps", 1e-6, at_most=1))
    c.divides("num_attention_heads", heads, "hidden_size", hidden)
    common_ln = dict(norm_eps=c.number("layer_norm_eps", 1e-5, at_most=1),
                     tied=c.flag("tie_word_embeddings", False))
    if model_type == "phi":
        return ModelSpec(**shape, **common_ln, rotary_pct=_rotary_fraction(c, 0.5))
    return ModelSpec(**shape, **common_ln, rotary_pct=_rotary_fraction(c, 0.25),
                     qkv_bias=c.flag("use_qkv_bias", False),
                     parallel_residual=c.flag("use_parallel_residual", False))


def resolve(params: str | None = None, model: str | None = None, stack_families: bool = False,
            **overrides) -> ModelSpec:
    """The ModelSpec for the MODEL option group: ``--params`` or ``--model``, then the overrides.

    ``stack_families``: a config.json may be of a family only transformers' code builds (phi, gemma,
    stablelm, qwen3; ``from_hf_config``). Overrides left as None keep the base shape's values. ``--kv-heads`` defaults to ``--heads``
    when only the head count is overridden on a multi-head base.
    """
    if params and model:
        raise InputError("give --params SIZE or --model NAME|PATH, not both")
    if model:
        looks_like_file = model.endswith(".json") or "/" in model or Path(model).is_file()
        spec = from_hf_config(model, stack_families) if looks_like_file else preset(model)
    else:
        spec = from_size(params or "22m")
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "dropout" in changes:  # --dropout P: attention, residual and embedding dropout alike
        p = check_dropout(changes.pop("dropout"))
        changes.update(attn_dropout=p, resid_dropout=p, embd_dropout=p)
    if not stack_families and changes.get("arch") in STACK_ARCHS:
        raise InputError(f"--arch {changes['arch']}: memplan's own trainer builds {', '.join(MEMPLAN_ARCHS)} "
                         f"(accepted here: {', '.join(MEMPLAN_ARCHS)}; {', '.join(STACK_ARCHS)}: with --stack "
                         "transformers, in estimate, autotune and sweep)")
    if not changes:
        return spec
    if "arch" in changes and changes["arch"] != spec.arch:
        # a different family brings its own components
        for field in ("norm", "pos", "mlp", "bias", "parallel_residual", "act", "head_size"):
            changes.setdefault(field, None)
        changes.setdefault("qkv_bias", False)
        changes.setdefault("rope_scaling", ())  # the scaling was the other family's
    if "heads" in changes and "kv_heads" not in changes and spec.kv_heads == spec.heads:
        changes["kv_heads"] = changes["heads"]
    data = {**spec.to_dict(), **changes}
    shape_changes = sorted(k for k in changes if k not in ("name", "source"))
    if shape_changes:  # no longer the preset or size it started from
        data["name"] = f"{spec.name}, custom" if spec.name else "custom"
        data["source"] = f"{spec.source or spec.name}, with --{', --'.join(k.replace('_', '-') for k in shape_changes)}"
    return ModelSpec(**data)
