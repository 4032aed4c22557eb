"""Text generation with a KV cache: what ``memplan generate`` runs, and what memplan's inference memory plan
(``memplan/inference.py``) describes tensor by tensor.

The trained model (``trainer/model.py``) is used as it is; only its forward is re-walked here, module by
module, with a cache. Training's forward and what it saves for backward are untouched.

- ``KVCache``: per layer one K and one V tensor of shape (B, kv_heads, max_len, head_dim), allocated
  once in the weights' dtype (``KVCache.nbytes`` = layers · 2 · kv_heads · head_dim · max_len · B ·
  bytes, the formula memplan plans with).
- ``forward_cached``: a forward over T new tokens at positions [start, start + T) that writes their
  K/V into the cache and attends over the cache's first start + T positions. It returns the logits
  of the last position only (B, vocab), in fp32: generation never needs the others, and a
  (B, T, vocab) prompt logit tensor would dominate the memory of a long prompt.
- ``generate_ids``: prefill the prompt in one forward, then one forward per new token; yields each
  token as it is chosen (streaming). When the cache is full (the model's context window), the
  newest half of the window is kept and prefilled again at positions from 0 ("context shift":
  RoPE's rotation and a learned position table both depend on absolute positions, so the kept
  keys cannot simply be moved).

Sampling, in the order Hugging Face's ``generate`` applies its logits processors: repetition
penalty (CTRL, Keskar et al. 2019: a seen token's logit is divided by the penalty if positive,
multiplied if negative, over the prompt and the output), temperature, top-k, top-p (nucleus,
Holtzman et al. 2020: the smallest set of most likely tokens whose probabilities sum to at least
p), then one draw from a ``torch.Generator`` seeded with ``seed`` (never the global RNG). Greedy
takes the arg-max after the repetition penalty and is deterministic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from memplan.errors import InputError
from trainer.model import Transformer, apply_rotary, sdpa_takes_gqa
from trainer.sample import NonFiniteLogits, finite_logits
from trainer.step import autocast

REPETITION_NGRAM = 4  # the repetition score counts repeated 4-grams of the output


# =================================================================================================
# Configuration and results
# =================================================================================================

@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to choose each new token. Frozen; validates itself."""

    max_new_tokens: int = 128  # tokens to generate at most (end-of-text stops earlier)
    greedy: bool = False  # take the most likely token (deterministic); the sampling options are then ignored
    temperature: float = 0.8  # logits / temperature before top-k / top-p
    top_k: int | None = 50  # keep the k most likely tokens; None or 0: all
    top_p: float | None = None  # keep the smallest set whose probabilities sum to ≥ p; None or 1: all
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the output
    seed: int = 0  # seed of the sampling generator
    stop_at_eot: bool = True  # end at the end-of-text token (not included in the output)

    def __post_init__(self):
        def whole(name, minimum):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < minimum):
                raise InputError(f"--{name.replace('_', '-')}: {v!r} must be a whole number ≥ {minimum}")

        whole("max_new_tokens", 0)
        whole("top_k", 0)
        whole("seed", 0)
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise InputError(f"--temperature: {self.temperature!r} must be a positive number (use --greedy for "
                             "deterministic output)")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise InputError(f"--top-p: {self.top_p!r} must be in (0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError(f"--repetition-penalty: {self.repetition_penalty!r} must be a positive number "
                             "(1 = off; 1.1-1.3 discourages repeats)")


@dataclass
class GenerationStats:
    """What one generation did and how fast. Times are wall-clock seconds of this process."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0  # the prompt's forward (and its context shifts' re-prefills)
    decode_seconds: float = 0.0  # the one-token forwards and the sampling
    stopped: str = ""  # eot | max_new_tokens | nonfinite (the logits left no token to choose: NaN weights)
    context_shifts: int = 0  # times the window was full and its newest half re-prefilled
    output_ids: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """New tokens after the first (each one decode forward) per decode second."""
        if self.new_tokens <= 1 or self.decode_seconds <= 0:
            return None
        return (self.new_tokens - 1) / self.decode_seconds

    @property
    def prefill_tokens_per_second(self) -> float | None:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    @property
    def tokens_per_second(self) -> float | None:
        """New tokens per second of the whole generation (prefill included)."""
        total = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / total if total > 0 and self.new_tokens else None

    @property
    def repetition(self) -> float:
        return repetition_score(self.output_ids)

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "tokens_per_second": self.tokens_per_second, "decode_tokens_per_second": self.decode_tokens_per_second,
                "prefill_tokens_per_second": self.prefill_tokens_per_second, "repetition_4gram": self.repetition,
                "stopped": self.stopped, "context_shifts": self.context_shifts}


def repetition_score(ids: list[int], n: int = REPETITION_NGRAM) -> float:
    """Share of the output's n-grams (of token ids) that repeat an earlier one: (count − distinct) / count.

    0 for text without a repeated n-gram, near 1 for a loop (``a b c d a b c d ...`` → (k − 4)/k).
    0 for an output shorter than n tokens.
    """
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


# =================================================================================================
# The cache and the cached forward
# =================================================================================================

class KVCache:
    """Keys and values of every layer for ``batch`` sequences of up to ``max_len`` positions.

    One K and one V tensor per layer, (B, kv_heads, max_len, head_dim), allocated once and written in
    place; ``length`` is how many positions are filled.
    """

    def __init__(self, model: Transformer, batch: int, max_len: int, dtype: torch.dtype | None = None):
        spec = model.spec
        param = model.embed.weight
        dtype = dtype or param.dtype
        shape = (batch, spec.kv_heads, max_len, spec.head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=param.device) for _ in range(spec.layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=param.device) for _ in range(spec.layers)]
        self.batch, self.max_len, self.length = batch, max_len, 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def _attention_cached(attn, x: torch.Tensor, rope, cache: KVCache, layer: int, start: int) -> torch.Tensor:
    """One attention layer over T new positions; their K/V go into the cache at [start, start + T)."""
    B, T, C = x.shape
    kv = attn.kv_heads * attn.head_dim
    q, k, v = attn.qkv(x).split([C, kv, kv], dim=-1)
    q = q.view(B, T, attn.heads, attn.head_dim)  # (B, T, heads, hd)
    k = k.view(B, T, attn.kv_heads, attn.head_dim)
    v = v.view(B, T, attn.kv_heads, attn.head_dim)
    if rope is not None:
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    end = start + T
    cache.k[layer][:, :, start:end] = k.transpose(1, 2)  # (B, kv_heads, T, hd), copied into the cache
    cache.v[layer][:, :, start:end] = v.transpose(1, 2)
    del k, v
    keys, values = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]  # views, no copy
    q = q.transpose(1, 2)  # (B, heads, T, hd)
    gqa = attn.kv_heads != attn.heads
    if gqa and not sdpa_takes_gqa(q, keys, values):
        groups = attn.heads // attn.kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        gqa = False
    if T == 1:  # one query sees every cached position
        y = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
    elif start == 0:
        y = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
    else:  # T new queries after `start` cached positions: query i sees positions ≤ start + i
        mask = torch.ones(T, end, dtype=torch.bool, device=x.device).tril_(start)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    y = y.transpose(1, 2).reshape(B, T, C)
    return attn.proj(y)


@torch.no_grad()
def forward_cached(model: Transformer, idx: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """Logits (B, vocab), fp32, of the last of the T tokens ``idx`` (B, T) at positions [start, start + T).

    Writes their keys and values into ``cache`` and sets ``cache.length = start + T``. Module by
    module the same computation as ``Transformer.forward`` (norms, rotary, grouped-query attention,
    MLP, parallel residual), so the logits agree with a full forward over the whole sequence.
    """
    B, T = idx.shape
    end = start + T
    if end > cache.max_len:
        raise ValueError(f"positions up to {end} exceed the cache's {cache.max_len}")
    x = model.embed(idx)  # (B, T, H)
    if model.pos is not None:
        x = x + model.pos(torch.arange(start, end, device=idx.device))
    rope = model.rope(end, idx.device)
    if rope is not None:
        dtype = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) \
            else model.embed.weight.dtype
        rope = (rope[0][start:end].to(dtype), rope[1][start:end].to(dtype))
    for i, block in enumerate(model.blocks):
        block = getattr(block, "block", block)  # a Checkpointed wrapper's block
        a = _attention_cached(block.attn, block.norm1(x), rope, cache, i, start)
        if block.parallel:
            x = x + a + block.mlp(block.norm2(x))
        else:
            x = x + a
            x = x + block.mlp(block.norm2(x))
        del a
    cache.length = end
    return model.head(model.norm(x[:, -1])).float()  # (B, vocab)


# =================================================================================================
# Choosing tokens
# =================================================================================================

def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on the tokens in ``seen`` (B, S): logit / penalty if positive, · penalty if not."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(1, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(1, seen, picked)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits outside the top-k, then outside the nucleus of mass top_p, set to −inf (the most likely stays)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the first token always stays (before = 0)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose(logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor,
           generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row (B,) from fp32 logits (B, vocab); non-finite logits are guarded
    (``trainer.sample.finite_logits``: ``NonFiniteLogits`` where a row has nothing left to choose)."""
    logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    if config.greedy:
        return finite_logits(logits).argmax(dim=-1)
    logits = filter_top_k_top_p(finite_logits(logits / config.temperature), config.top_k, config.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


# =================================================================================================
# Generation
# =================================================================================================

def context_window(model: Transformer, meta: dict | None = None) -> int:
    """Positions the model can attend over: its learned table's rows, else the context it was trained at
    (RoPE extrapolates poorly beyond it), else its nominal max_positions."""
    spec = model.spec
    if spec.pos == "learned":
        return spec.max_positions
    ctx = ((meta or {}).get("plan") or {}).get("setup", {}).get("ctx")
    return int(ctx) if ctx else spec.max_positions


@torch.no_grad()
def generate_ids(model: Transformer, prompt_ids: list[list[int]] | list[int], config: SamplingConfig, *,
                 window: int, eot_id: int | None = None, precision: str = "fp32",
                 stats: GenerationStats | None = None,
                 on_phase: Callable[[str], None] | None = None) -> Iterator[list[int]]:
    """Yield the next token of every sequence, one step at a time (the prompt not included).

    ``prompt_ids`` is one prompt (a list of ids) or a batch of prompts of equal length. Stops after
    ``config.max_new_tokens`` steps, or (one sequence, ``config.stop_at_eot``) at ``eot_id``, which
    is not yielded. ``window`` is the model's context; the cache holds
    min(window, prompt + max_new_tokens) positions. ``stats`` (if given) is filled in as it goes;
    ``on_phase("prefill" | "decode")`` is called before each forward (memory measurement hooks).
    """
    batch = [list(prompt_ids)] if prompt_ids and isinstance(prompt_ids[0], int) else [list(p) for p in prompt_ids]
    if not batch or not batch[0]:
        raise ValueError("the prompt must hold at least one token")
    if len({len(p) for p in batch}) != 1:
        raise ValueError("prompts of a batch must have the same length")
    stats = stats if stats is not None else GenerationStats()
    device = model.embed.weight.device
    model.eval()
    ids = torch.tensor(batch, dtype=torch.long, device=device)  # (B, T): every token so far
    keep = max(1, window // 2)  # a context shift keeps the newest half of the window
    if ids.shape[1] >= window:  # a prompt longer than the window: its newest tokens
        stats.context_shifts += 1
    stats.prompt_tokens = ids.shape[1]
    cache = (model.new_cache if hasattr(model, "new_cache") else partial(KVCache, model))(  # trainer.hf_model's own
        ids.shape[0], min(window, ids.shape[1] + config.max_new_tokens))
    cached = getattr(model, "forward_cached", None) or partial(forward_cached, model)
    generator = torch.Generator().manual_seed(config.seed)
    single = ids.shape[0] == 1

    def prefill(context: torch.Tensor) -> torch.Tensor:
        if on_phase:
            on_phase("prefill")
        t0 = time.perf_counter()
        with autocast(precision, device.type):
            out = cached(context, cache, 0)
        stats.prefill_seconds += time.perf_counter() - t0
        return out

    logits = prefill(ids[:, -(window - 1):] if ids.shape[1] >= window else ids)
    for step in range(config.max_new_tokens):
        t0 = time.perf_counter()
        try:
            nxt = choose(logits, config, ids, generator)  # (B,)
        except NonFiniteLogits:
            stats.decode_seconds += time.perf_counter() - t0
            stats.stopped = "nonfinite"
            return
        if single and config.stop_at_eot and eot_id is not None and int(nxt[0]) == eot_id:
            stats.decode_seconds += time.perf_counter() - t0
            stats.stopped = "eot"
            return
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        stats.new_tokens += 1
        stats.output_ids.append(int(nxt[0]))
        stats.decode_seconds += time.perf_counter() - t0
        yield nxt.tolist()
        if step == config.max_new_tokens - 1:
            break
        if cache.length + 1 > cache.max_len:  # the window is full: keep its newest half, prefilled anew
            stats.context_shifts += 1
            logits = prefill(ids[:, -keep:])
            continue
        if on_phase:
            on_phase("decode")
        t0 = time.perf_counter()
        with autocast(precision, device.type):
            logits = cached(nxt[:, None], cache, cache.length)
        stats.decode_seconds += time.perf_counter() - t0
    stats.stopped = "max_new_tokens"


def generate_text(model: Transformer, tokenizer, prompt: str, config: SamplingConfig, *, window: int,
                  precision: str = "fp32", on_text: Callable[[str], None] | None = None,
                  on_token: Callable[[GenerationStats], None] | None = None) -> tuple[str, GenerationStats]:
    """The prompt's continuation as text, and the stats; ``on_text(piece)`` receives it as it streams, and
    ``on_token(stats)`` is called after each new token (progress of a long generation).

    An empty prompt starts a new document (the end-of-text token the corpus separates documents with).
    Streaming decodes everything generated so far at each step and passes on only what is new and
    complete: a byte-level BPE token can end in the middle of a UTF-8 character (shown as U+FFFD
    until the next token completes it).
    """
    prompt_ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    stats = GenerationStats()
    out: list[int] = []
    shown = 0
    for token in generate_ids(model, prompt_ids, config, window=window, eot_id=tokenizer.eot_id,
                              precision=precision, stats=stats):
        out.append(token[0])
        if on_token is not None:
            on_token(stats)
        if on_text is not None:
            text = tokenizer.decode(out)
            if not text.endswith("\ufffd") and len(text) > shown:
                on_text(text[shown:])
                shown = len(text)
    text = tokenizer.decode(out)
    if on_text is not None and len(text) > shown:
        on_text(text[shown:])
    return text, stats
