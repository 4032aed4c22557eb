"""ModelSpec: the shape of a decoder-only transformer, its exact parameter count, and where shapes come from.

Three sources of a shape, all returning the same frozen ``ModelSpec``:

- ``from_size("350m")``: a documented table of Llama-style shapes (``SIZE_TABLE``), and for any
  other size a rule (``shape_for_params``) that picks depth and width the way small-model
  recipes do.
- ``preset("tinyllama-1.1b")``: named published models, each row citing the config it copies.
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

    def to_dict(self) -> dict:
        """Every field, for plan files and checkpoints (``ModelSpec(**d)`` rebuilds it)."""
        return dataclasses.asdict(self)

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
}


def _round_up(x: float, multiple: int) -> int:
    return max(multiple, int(-(-x // multiple) * multiple))


def shape_for_params(target: int, vocab: int = DEFAULT_VOCAB) -> dict:
    """The rule for a size not in SIZE_TABLE.

    Width follows depth with the aspect ratio of small Llamas, hidden = 64·layers (nanochat's
    "depth × 64"), with 64-wide heads, FFN = 8/3·hidden rounded up to 256, embeddings tied
    below 1B and 4 query heads per KV head from 1B up. Among depths 2–64, the one whose exact
    parameter count is closest to the target wins.
    """
    best = None
    for layers in range(2, 65):
        hidden = 64 * layers
        heads = hidden // 64
        large = target >= 10**9
        kv_heads = heads // 4 if large and heads % 4 == 0 else heads
        shape = _llama(layers, hidden, heads, kv_heads, _round_up(8 * hidden / 3, 256), vocab=vocab,
                       tied=not large)
        n = ModelSpec(**shape).params
        if best is None or abs(n - target) < abs(best[0] - target):
            best = (n, shape)
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

# Published models, each copied from the config it cites.
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
    "llama-3.2-1b": _llama(16, 2048, 32, 8, 8192, vocab=128256, tied=True, rope_theta=500000.0,
                           max_positions=131072, source=_HF.format("meta-llama/Llama-3.2-1B")),
    "llama-3.2-3b": _llama(28, 3072, 24, 8, 8192, vocab=128256, tied=True, rope_theta=500000.0,
                           max_positions=131072, source=_HF.format("meta-llama/Llama-3.2-3B")),
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, tied=False, max_positions=4096,
                         source=_HF.format("meta-llama/Llama-2-7b-hf")),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, tied=False, rope_theta=1000000.0, max_positions=32768,
                         source=_HF.format("mistralai/Mistral-7B-v0.3")),
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, vocab=49152, tied=True, rope_theta=100000.0,
                           source=_HF.format("HuggingFaceTB/SmolLM2-135M")),
    "smollm2-360m": _llama(32, 960, 15, 5, 2560, vocab=49152, tied=True, rope_theta=100000.0,
                           source=_HF.format("HuggingFaceTB/SmolLM2-360M")),
    "qwen2.5-0.5b": _llama(24, 896, 14, 2, 4864, vocab=151936, tied=True, qkv_bias=True, rope_theta=1000000.0,
                           norm_eps=1e-6, max_positions=32768, source=_HF.format("Qwen/Qwen2.5-0.5B")),
    "pythia-70m": dict(arch="gpt_neox", layers=6, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=50304,
                       tied=False, rotary_pct=0.25, source=_HF.format("EleutherAI/pythia-70m")),
    "pythia-160m": dict(arch="gpt_neox", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50304,
                        tied=False, rotary_pct=0.25, source=_HF.format("EleutherAI/pythia-160m")),
    "pythia-410m": dict(arch="gpt_neox", layers=24, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=50304,
                        tied=False, rotary_pct=0.25, source=_HF.format("EleutherAI/pythia-410m")),
}


# ---- presets of the families transformers' model class trains (issue 24) --------------------------------
# Each is its model's config.json as published on the Hub (cited here), shipped in memplan/presets/NAME.json and
# read as any --model config.json is (``from_hf_config``). memplan cannot fetch the real weights here: these
# presets plan the real shape, and train from a checkpoint of the same family (``memplan train --from DIR``).
CONFIG_PRESETS: dict[str, str] = {
    "qwen3-0.6b": _HF.format("Qwen/Qwen3-0.6B"),
    "gemma-2b": _HF.format("google/gemma-2b"),
    "phi-2": _HF.format("microsoft/phi-2"),
}


def config_preset_path(name: str) -> Path:
    """The shipped config.json of a ``CONFIG_PRESETS`` model."""
    return Path(__file__).parent / "presets" / f"{name}.json"


def preset(name: str) -> ModelSpec:
    """A named published model; a misspelt name suggests the closest ones."""
    key = name.strip().lower()
    if key in CONFIG_PRESETS:
        spec = from_hf_config(config_preset_path(key), stack_families=True)
        return spec.replace(name=key, source=CONFIG_PRESETS[key])
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
    """A ModelSpec from a Hugging Face ``config.json`` (llama, mistral, qwen2, gpt2, gpt_neox, and the
    ``STACK_ARCHS`` phi, gemma, stablelm, qwen3 where ``stack_families``: the commands whose walk follows
    transformers' code, ``--stack transformers``; elsewhere memplan's trainer would build the model,
    and these are refused).

    Every value memplan reads is checked here, naming its key (``hidden_size``, not ``--hidden``): whole
    numbers in [1, MAX_DIM], finite positive floats, booleans, head counts that divide."""
    path = Path(path)
    c = _Config(path, read_config(path))
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
                         norm_eps=c.number("layer_norm_epsilon", 1e-5, at_most=1), **common)
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
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     vocab=vocab,
                     tied=c.flag("tie_word_embeddings", False),  # LlamaConfig, MistralConfig, Qwen2Config
                     bias=bias, qkv_bias=model_type == "qwen2" and not bias,
                     max_positions=c.count("max_position_embeddings", 2048),
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
    if "heads" in changes and "kv_heads" not in changes and spec.kv_heads == spec.heads:
        changes["kv_heads"] = changes["heads"]
    data = {**spec.to_dict(), **changes}
    shape_changes = sorted(k for k in changes if k not in ("name", "source"))
    if shape_changes:  # no longer the preset or size it started from
        data["name"] = f"{spec.name}, custom" if spec.name else "custom"
        data["source"] = f"{spec.source or spec.name}, with --{', --'.join(k.replace('_', '-') for k in shape_changes)}"
    return ModelSpec(**data)
