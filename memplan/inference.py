"""Memory and speed of running a trained model: weights, the KV cache, one forward's activations.

What ``memplan estimate --mode inference`` prints, and what ``memplan validate --mode inference``
checks against generation measured on this machine. Pure Python; never imports torch.

The memory model follows ``trainer/generate.py`` tensor by tensor (one small function per term,
then a walk over one cached forward that finds the peak):

- **prefill**: one forward over the prompt (P tokens, n = B·P) that writes every layer's K/V into
  the cache and returns the logits of the last position only (B × V, fp32).
- **decode**: one forward of one token per sequence (n = B) at the last position of the cache
  (the cache full, the RoPE tables grown to the whole context: the largest decode step), plus
  choosing the next token from the fp32 logits (top-k sampling: a scaled copy, its mask and
  the filtered copy; greedy: an arg-max).

Notation: B batch, P prompt tokens, T tokens the forward runs over (P in prefill, 1 in decode),
n = B·T, C context held by the cache (prompt + new tokens), H hidden, F ffn, V vocab, kv =
kv_heads·head_dim, rd = rotary dims, a = bytes of an activation (the weights' dtype for fp32 /
bf16 / fp16 weights; fp32 for int8 / int4, which llama.cpp-style runtimes dequantise into fp32
matmuls on a CPU), c = bytes of a cached K/V element.

Quantised weights follow GGUF's block formats: int8 is Q8_0 (blocks of 32 int8 values and one
fp16 scale: 34 bytes per 32 weights), int4 is Q4_0 (32 four-bit values and one fp16 scale: 18
bytes per 32). Norm weights and biases stay fp32. Only fp32 and bf16 weights run in this repo's
trainer and are validated here; int8 / int4 figures are for a llama.cpp-style runtime and are
not measured by this repo.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memplan.errors import InputError
from memplan.hardware import Device
from memplan.memory import runtime_bytes
from memplan.model import ModelSpec
from memplan.units import choice_error

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
KV_DTYPES = ("fp32", "bf16", "fp16", "int8")
SAMPLINGS = ("top-k", "greedy")

# Bytes per weight-matrix element, by dtype (GGUF Q8_0 / Q4_0 blocks for the integer formats).
GGUF_BLOCK = 32
_MATRIX_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": (GGUF_BLOCK + 2) / GGUF_BLOCK,
                 "int4": (GGUF_BLOCK // 2 + 2) / GGUF_BLOCK}
_KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": (GGUF_BLOCK + 2) / GGUF_BLOCK}
FP32_BYTES = 4
INDEX_BYTES = 8  # token ids, int64
MASK_BYTES = 1  # torch.bool

TOP_K = 50  # trainer.generate.SamplingConfig's default top-k
MAX_SEARCH = 1 << 24  # bound of the largest-context / largest-batch searches


@dataclass(frozen=True, kw_only=True)
class InferenceSetup:
    """How a model is run: cache length, prompt, batch, weight and cache dtypes. Frozen; validates itself."""

    ctx: int = 2048  # positions the KV cache holds: prompt + new tokens
    prompt: int | None = None  # tokens of the prompt prefilled in one forward; None = ctx (the worst case)
    batch: int = 1  # sequences generated together
    weights_dtype: str = "fp32"  # fp32 | bf16 | fp16 | int8 (GGUF Q8_0) | int4 (GGUF Q4_0)
    kv_dtype: str | None = None  # fp32 | bf16 | fp16 | int8; None = the activation dtype (fp16 for int8/int4)
    sampling: str = "top-k"  # top-k (temperature, top-k filter, multinomial) | greedy (arg-max)

    def __post_init__(self) -> None:
        for name in ("ctx", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"--{name}: {value!r} must be a positive integer")
        if self.prompt is not None:
            if not isinstance(self.prompt, int) or isinstance(self.prompt, bool) or self.prompt < 1:
                raise InputError(f"--prompt-tokens: {self.prompt!r} must be a positive integer")
            if self.prompt > self.ctx:
                raise InputError(f"--prompt-tokens {self.prompt} exceeds --ctx {self.ctx}: the cache holds the "
                                 "prompt and the new tokens; accepted: --prompt-tokens up to --ctx")
        if self.weights_dtype not in WEIGHT_DTYPES:
            raise choice_error("--weights-dtype", str(self.weights_dtype), list(WEIGHT_DTYPES))
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise choice_error("--kv-dtype", str(self.kv_dtype), list(KV_DTYPES))
        if self.sampling not in SAMPLINGS:
            raise choice_error("--sampling", str(self.sampling), list(SAMPLINGS))

    @property
    def prompt_tokens(self) -> int:
        return self.ctx if self.prompt is None else self.prompt

    @property
    def quantized(self) -> bool:
        return self.weights_dtype in ("int8", "int4")

    @property
    def activation_dtype(self) -> str:
        """The dtype matmuls run in: the weights' for fp32/bf16/fp16, fp32 for int8/int4."""
        return "fp32" if self.quantized else self.weights_dtype

    @property
    def cache_dtype(self) -> str:
        if self.kv_dtype is not None:
            return self.kv_dtype
        return "fp16" if self.quantized else self.activation_dtype

    def to_json(self) -> dict:
        return {"ctx": self.ctx, "prompt_tokens": self.prompt_tokens, "batch": self.batch,
                "weights_dtype": self.weights_dtype, "kv_dtype": self.cache_dtype,
                "activation_dtype": self.activation_dtype, "sampling": self.sampling}

    def replace(self, **changes) -> "InferenceSetup":
        return dataclasses.replace(self, **changes)


# ---- terms ---------------------------------------------------------------------------------

def act_bytes(setup: InferenceSetup) -> int:
    """a: bytes of an activation element."""
    return int(_MATRIX_BYTES[setup.activation_dtype])


def _vector_params(spec: ModelSpec) -> int:
    """Norm weights and biases: everything that is not a matrix or an embedding table."""
    matrices = spec.matmul_params - spec.vocab * spec.hidden  # the blocks' matrices
    tables = spec.embedding_params + spec.head_params
    return spec.params - matrices - tables


def inference_weight_bytes(spec: ModelSpec, setup: InferenceSetup) -> int:
    """All parameters as stored for inference. fp32/bf16/fp16: N·a. int8/int4: the matrices and
    embedding tables in GGUF blocks (Q8_0 34 bytes, Q4_0 18 bytes per 32 weights), norm weights
    and biases in fp32."""
    if not setup.quantized:
        return spec.params * act_bytes(setup)
    vectors = _vector_params(spec)
    blocked = spec.params - vectors
    return int(round(blocked * _MATRIX_BYTES[setup.weights_dtype])) + vectors * FP32_BYTES


def kv_cache_bytes(spec: ModelSpec, setup: InferenceSetup, ctx: int | None = None) -> int:
    """The KV cache: layers × 2 × kv_heads × head_dim × C × B × c (K and V of every layer,
    allocated once for the whole context, ``trainer.generate.KVCache``)."""
    c = setup.ctx if ctx is None else ctx
    return int(round(spec.layers * 2 * spec.kv_dim * c * setup.batch * _KV_BYTES[setup.cache_dtype]))


def rope_table_bytes(spec: ModelSpec, rows: int) -> int:
    """RoPE's cos and sin tables, rows × rd/2 each, fp32 (grown to the positions in use). 0 for learned positions."""
    return 2 * rows * (spec.rotary_dim // 2) * FP32_BYTES if spec.pos == "rope" else 0


def rope_growth_bytes(spec: ModelSpec, rows: int) -> int:
    """Growing the tables to ``rows`` positions: the angles (rows × rd/2) and the new cos and sin,
    fp32, made while the old tables are still held; plus the frequency vector (rd/2)."""
    if spec.pos != "rope":
        return 0
    half = spec.rotary_dim // 2
    return 3 * rows * half * FP32_BYTES + half * FP32_BYTES


def rope_cast_bytes(spec: ModelSpec, setup: InferenceSetup, tokens: int) -> int:
    """The tables' rows of this forward cast to the activation dtype (cos and sin, T × rd/2 × a); 0 in fp32."""
    if spec.pos != "rope" or act_bytes(setup) == FP32_BYTES:
        return 0
    return 2 * tokens * (spec.rotary_dim // 2) * act_bytes(setup)


def token_id_bytes(setup: InferenceSetup, length: int) -> int:
    """The token ids generation keeps (prompt and output, int64): B × length × 8."""
    return setup.batch * length * INDEX_BYTES


def last_logits_bytes(spec: ModelSpec, setup: InferenceSetup) -> int:
    """The fp32 logits of the last position, B × V × 4 (``forward_cached`` returns no others)."""
    return setup.batch * spec.vocab * FP32_BYTES


def sampling_bytes(spec: ModelSpec, setup: InferenceSetup) -> int:
    """Choosing a token beyond the logits: top-k sampling holds the logits / temperature, the k
    largest values (B·k·4), the below-the-k-th mask (bool) and the filtered copy
    (2·B·V·4 + B·V + B·k·4); greedy an arg-max (B·8)."""
    if setup.sampling == "greedy":
        return setup.batch * INDEX_BYTES
    k = min(TOP_K, spec.vocab)
    return setup.batch * spec.vocab * (2 * FP32_BYTES + MASK_BYTES) + setup.batch * k * FP32_BYTES


def norm_work_bytes(spec: ModelSpec, setup: InferenceSetup, n: int) -> int:
    """A norm's working tensors without autograd. RMSNorm (``F.rms_norm`` on the CPU): x·rstd and
    its product with the weight in fp32, plus the fp32 copy of a bf16/fp16 input (2 or 3 × n·H·4),
    and rstd (n·4). LayerNorm: its mean and rstd (n·4 each); its output is counted by the caller."""
    if spec.norm == "rmsnorm":
        copies = 2 if act_bytes(setup) == FP32_BYTES else 3
        return copies * n * spec.hidden * FP32_BYTES + n * FP32_BYTES
    return 2 * n * FP32_BYTES


def repeated_kv_bytes(spec: ModelSpec, setup: InferenceSetup, keys: int, family: str, flash: bool) -> int:
    """K and V repeated to every head for SDPA under grouped-query attention where no flash kernel
    takes them as they are (not on a CPU): 2 × B × heads × keys × head_dim × c."""
    if spec.kv_heads == spec.heads or family == "cpu":
        return 0
    if flash and setup.activation_dtype in ("bf16", "fp16"):
        return 0
    return int(2 * setup.batch * spec.heads * keys * spec.head_dim * _KV_BYTES[setup.cache_dtype])


# ---- the walk over one cached forward ------------------------------------------------------

CATEGORIES = ("weights", "kv_cache", "activations", "logits")


@dataclass(frozen=True)
class Moment:
    name: str
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class _Walk:
    def __init__(self):
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak: Moment | None = None
        self.where = ""

    def alloc(self, category: str, nbytes: int) -> None:
        self.live[category] += int(nbytes)
        total = sum(self.live.values())
        if self.peak is None or total > self.peak.total:
            self.peak = Moment(self.where, dict(self.live))

    def free(self, category: str, nbytes: int) -> None:
        self.live[category] -= int(nbytes)


def _norm(w: _Walk, spec: ModelSpec, setup: InferenceSetup, n: int) -> int:
    """A norm: its working tensors come and go, its output (n·H·a) stays with the caller."""
    out = n * spec.hidden * act_bytes(setup)
    work = norm_work_bytes(spec, setup, n)
    if spec.norm == "rmsnorm":
        w.alloc("activations", work)
        w.alloc("activations", out)
        w.free("activations", work)
    else:
        w.alloc("activations", out + work)
        w.free("activations", work)
    return out


def _forward(w: _Walk, spec: ModelSpec, setup: InferenceSetup, tokens: int, end: int, rope_rows: int,
             family: str, flash: bool) -> None:
    """``trainer.generate.forward_cached`` over ``tokens`` positions ending at ``end``, the RoPE
    tables holding ``rope_rows`` positions before. Leaves the fp32 last-position logits live."""
    B, H, a = setup.batch, spec.hidden, act_bytes(setup)
    n = B * tokens
    x = n * H * a
    w.where = "embedding"
    w.alloc("activations", x)
    if spec.pos == "learned":  # + the position rows: arange, their embeddings, the sum
        w.alloc("activations", tokens * INDEX_BYTES + tokens * H * a + x)
        w.free("activations", tokens * INDEX_BYTES + tokens * H * a + x)
    if spec.pos == "rope" and rope_rows < end:  # the tables grow to `end` positions
        w.where = "RoPE tables"
        w.alloc("activations", rope_growth_bytes(spec, end))
        w.free("activations", rope_growth_bytes(spec, end))
        w.free("weights", rope_table_bytes(spec, rope_rows))
        w.alloc("weights", rope_table_bytes(spec, end))
    w.alloc("activations", rope_cast_bytes(spec, setup, tokens))
    qkv = n * (H + 2 * spec.kv_dim) * a
    rotary = n * (H + spec.kv_dim) * a if spec.pos == "rope" else 0
    w.where = "attention"
    h = _norm(w, spec, setup, n)
    w.alloc("activations", qkv)
    w.alloc("activations", rotary)  # rotated q and k
    if spec.pos == "rope":  # k, v written into the cache; q is the rotated copy: the qkv output dies
        w.free("activations", qkv + n * spec.kv_dim * a)
    repeated = repeated_kv_bytes(spec, setup, end, family, flash)
    w.alloc("activations", repeated)
    out = n * H * a
    lse = n * spec.heads * FP32_BYTES  # the flash kernel's log-sum-exp, returned and dropped
    w.alloc("activations", out + lse)
    w.free("activations", lse + repeated)
    w.alloc("activations", x)  # the output projection
    w.free("activations", out + h + (n * H * a if spec.pos == "rope" else qkv))  # y, the norm output, q
    attn = x
    w.where = "MLP"
    if spec.parallel_residual:
        w.alloc("activations", x)  # x + attention, before the MLP's output is added
    else:
        w.alloc("activations", x)  # x + attention ...
        w.free("activations", x)  # ... replaces x
    h = _norm(w, spec, setup, n)
    up = n * spec.ffn * a * (2 if spec.mlp == "swiglu" else 1)
    inner = n * spec.ffn * a
    w.alloc("activations", up)
    w.alloc("activations", inner)  # silu(gate), or gelu(up)
    if spec.mlp == "swiglu":
        w.alloc("activations", inner)  # silu(gate)·up
        w.free("activations", inner + up)
    else:
        w.free("activations", up)
    w.alloc("activations", x)  # down
    w.free("activations", inner + h)
    w.alloc("activations", x)  # the block's output
    w.free("activations", 2 * x + attn + (x if spec.parallel_residual else 0))
    # every other block is the same: the peak of one is the peak of all
    w.where = "final norm and LM head"
    h = _norm(w, spec, setup, B)  # over the last position only
    w.alloc("logits", B * spec.vocab * a)
    if a != FP32_BYTES:  # .float()
        w.alloc("logits", last_logits_bytes(spec, setup))
        w.free("logits", B * spec.vocab * a)
    w.free("activations", x + h + rope_cast_bytes(spec, setup, tokens))  # dropped when the forward returns


@dataclass(frozen=True)
class InferenceMemory:
    """Memory of generation: the larger of the prefill and decode peaks, by category."""

    weights: int
    kv_cache: int
    activations: int  # at the peak: one forward's working tensors, token ids, RoPE tables' growth
    logits: int  # at the peak: fp32 logits and the sampling copies
    runtime: int
    prefill_peak_allocated: int
    decode_peak_allocated: int
    peak_allocated: int
    peak_reserved: int
    peak_phase: str  # prefill | decode
    peak_moment: str
    prefill_moment: str = ""
    decode_moment: str = ""
    rope_tables: int = 0

    def to_json(self) -> dict:
        """The memory keys of ``estimate --json`` (docs/json.md; gradients, optimizer and temporaries are 0 when
        nothing trains), plus kv_cache and the two phases' peaks."""
        return {"weights": self.weights, "gradients": 0, "optimizer": 0, "activations": self.activations,
                "logits": self.logits, "temporaries": 0, "runtime": self.runtime,
                "peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "peak_phase": self.peak_phase, "kv_cache": self.kv_cache,
                "prefill_peak_allocated": self.prefill_peak_allocated,
                "decode_peak_allocated": self.decode_peak_allocated, "peak_moment": self.peak_moment}


def prefill_peak(spec: ModelSpec, setup: InferenceSetup, family: str = "cpu", flash: bool = False) -> Moment:
    """The peak of the prompt's forward: weights, the empty cache, the prompt's ids, one forward over P tokens."""
    w = _Walk()
    P = setup.prompt_tokens
    w.where = "start"
    w.alloc("weights", inference_weight_bytes(spec, setup))
    w.alloc("kv_cache", kv_cache_bytes(spec, setup))
    w.alloc("activations", token_id_bytes(setup, P))
    _forward(w, spec, setup, P, P, 0, family, flash)
    if setup.sampling != "greedy":
        w.where = "sampling the first token"
    else:
        w.where = "choosing the first token"
    w.alloc("logits", sampling_bytes(spec, setup))
    return w.peak


def decode_peak(spec: ModelSpec, setup: InferenceSetup, family: str = "cpu", flash: bool = False) -> Moment:
    """The peak of the last decode step: the full cache, the ids of the whole context, the
    previous step's logits, one forward of one token per sequence; then choosing the next token."""
    w = _Walk()
    C = setup.ctx
    w.where = "start"
    w.alloc("weights", inference_weight_bytes(spec, setup) + rope_table_bytes(spec, C - 1))
    w.alloc("kv_cache", kv_cache_bytes(spec, setup))
    w.alloc("activations", token_id_bytes(setup, C))
    w.alloc("logits", last_logits_bytes(spec, setup))  # the previous step's, held until the new ones exist
    _forward(w, spec, setup, 1, C, C - 1, family, flash)
    w.free("logits", last_logits_bytes(spec, setup))
    w.where = "choosing the next token"
    w.alloc("logits", sampling_bytes(spec, setup))
    return w.peak


def inference_memory(spec: ModelSpec, setup: InferenceSetup, device: Device | None = None) -> InferenceMemory:
    """Both phases' peaks, the larger one by category, and the runtime on top (peak_reserved)."""
    family = device.family if device else "cpu"
    flash = device.flash_attention if device else False
    pre, dec = prefill_peak(spec, setup, family, flash), decode_peak(spec, setup, family, flash)
    peak, phase = (pre, "prefill") if pre.total >= dec.total else (dec, "decode")
    runtime = runtime_bytes(peak.total, device.runtime_context_bytes, device.allocator_overhead) if device else 0
    weights = inference_weight_bytes(spec, setup)
    return InferenceMemory(
        weights=weights, kv_cache=peak.bytes["kv_cache"],
        activations=peak.bytes["activations"] + peak.bytes["weights"] - weights,
        logits=peak.bytes["logits"], runtime=runtime, prefill_peak_allocated=pre.total,
        decode_peak_allocated=dec.total, peak_allocated=peak.total, peak_reserved=peak.total + runtime,
        peak_phase=phase, peak_moment=f"{phase}: {peak.name}", prefill_moment=pre.name, decode_moment=dec.name,
        rope_tables=rope_table_bytes(spec, setup.ctx),
    )


# ---- speed ---------------------------------------------------------------------------------

def prefill_flops(spec: ModelSpec, setup: InferenceSetup) -> float:
    """One forward over the prompt: 2·(block matrices)·n for the matmuls, 2·2·L·B·P²/2·H for the
    causal attention (q·kᵀ and probabilities·v over half the square), and 2·H·V·B for the LM
    head on the last position only."""
    n, P = setup.batch * setup.prompt_tokens, setup.prompt_tokens
    blocks = spec.matmul_params - spec.vocab * spec.hidden
    return 2.0 * blocks * n + 2.0 * spec.layers * setup.batch * P * P * spec.hidden + 2.0 * spec.hidden * spec.vocab * setup.batch


def decode_bytes_per_step(spec: ModelSpec, setup: InferenceSetup, ctx: int | None = None) -> int:
    """What one decode step reads from memory: every weight once (the embedding only its B rows)
    and the KV cache of the context so far."""
    c = setup.ctx if ctx is None else ctx
    table = spec.vocab * spec.hidden
    weights = inference_weight_bytes(spec, setup)
    if not spec.tied:  # the embedding table is read only at B rows; a tied one is read whole by the head
        weights -= int(table * _MATRIX_BYTES[setup.weights_dtype]) - setup.batch * spec.hidden * act_bytes(setup)
    return weights + kv_cache_bytes(spec, setup, c)


def decode_flops(spec: ModelSpec, setup: InferenceSetup, ctx: int | None = None) -> float:
    """One decode step: 2·matmul_params·B, plus attention over the context, 2·2·L·B·C·H."""
    c = setup.ctx if ctx is None else ctx
    return 2.0 * spec.matmul_params * setup.batch + 4.0 * spec.layers * setup.batch * c * spec.hidden


# ---- the host's share of a decode step -------------------------------------------------------
# Dispatched aten ops of one single-token decode step of trainer/generate.py's ``forward_cached``
# (TorchDispatchMode, torch 2.13, no grad, SDPA; views included), per block and outside the blocks
# (embedding, final norm, head, positions): (fp32, bf16/fp16 weights, whose norms upcast). GQA and tied
# heads change nothing. tests/unit/test_inference.py recounts them.
DECODE_LAYER_DISPATCHES = {"llama": (71, 75), "gpt2": (37, 37), "gpt_neox": (59, 59)}
DECODE_BASE_DISPATCHES = {"llama": (25, 30), "gpt2": (9, 10), "gpt_neox": (20, 23)}
# A dispatch without autograd costs a fraction of the training step's calibrated one (which carries the
# autograd node and its backward): ~2 us per `2*x` without requires_grad against 7 us with it
# (pytorch/pytorch #41383), 2/7. On this repo's build machine that gives 4 us per op against the 2.5-5.4 us
# measured per dispatch of the inference matrix's small decode steps.
NO_GRAD_DISPATCH_SHARE = 2 / 7


def decode_dispatches(spec: ModelSpec, setup: "InferenceSetup") -> int:
    """Aten ops one decode step dispatches: L·per_block + outside the blocks (``DECODE_*_DISPATCHES``),
    whatever the batch or the cache length."""
    low = 0 if setup.activation_dtype == "fp32" else 1
    return (spec.layers * DECODE_LAYER_DISPATCHES[spec.arch][low]
            + DECODE_BASE_DISPATCHES[spec.arch][low])


def decode_dispatch_seconds(spec: ModelSpec, setup: "InferenceSetup", device: Device) -> float:
    """The host's time to issue one decode step: dispatches × the device's per-op launch cost (its
    calibration's ``launch_overhead_seconds``, else memplan.timing's default for the family) ×
    ``NO_GRAD_DISPATCH_SHARE``. The floor of a small model's decode step, whatever its bytes."""
    from memplan.timing import rates_for

    return decode_dispatches(spec, setup) * rates_for(device).launch_seconds() * NO_GRAD_DISPATCH_SHARE


def predicted_decode_step(roofline_seconds: float, dispatch_seconds: float, family: str) -> float:
    """A decode step with its host share: on a CPU the host dispatches and computes in turn (the sum);
    a GPU's host runs ahead of the device (the larger of the two)."""
    return roofline_seconds + dispatch_seconds if family == "cpu" else max(roofline_seconds, dispatch_seconds)


@dataclass(frozen=True)
class InferenceTime:
    prefill_seconds: float
    prefill_tokens_per_second: float
    decode_seconds_per_step: float  # at the full context (the slowest step): the bandwidth/compute roofline
    decode_tokens_per_second: float  # B tokens per step, at the full context (roofline)
    decode_tokens_per_second_start: float  # at the prompt's end (a short cache reads less)
    decode_bound: str  # bandwidth | compute
    bandwidth_bytes_per_second: float
    matmul_flops_per_second: float
    decode_dispatch_seconds: float = 0.0  # the host's dispatch of one decode step (decode_dispatch_seconds)
    decode_step_seconds_with_dispatch: float = 0.0  # the roofline step with the dispatch (predicted_decode_step)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def inference_time(spec: ModelSpec, setup: InferenceSetup, device: Device) -> InferenceTime:
    """Prefill from compute (its matmuls at the device's achievable rate); decode from the
    bandwidth roofline: each step reads every weight and the cache, max(bytes / bandwidth,
    flops / matmul rate)."""
    rate = device.matmul_flops_per_second(setup.activation_dtype)
    bw = device.bandwidth_bytes_per_second
    pre = prefill_flops(spec, setup) / rate

    def step(ctx: int) -> tuple[float, str]:
        mem_s, flop_s = decode_bytes_per_step(spec, setup, ctx) / bw, decode_flops(spec, setup, ctx) / rate
        return (mem_s, "bandwidth") if mem_s >= flop_s else (flop_s, "compute")

    full, bound = step(setup.ctx)
    start, _ = step(min(setup.prompt_tokens + 1, setup.ctx))
    host = decode_dispatch_seconds(spec, setup, device)
    return InferenceTime(prefill_seconds=pre, prefill_tokens_per_second=setup.batch * setup.prompt_tokens / pre,
                         decode_seconds_per_step=full, decode_tokens_per_second=setup.batch / full,
                         decode_tokens_per_second_start=setup.batch / start, decode_bound=bound,
                         bandwidth_bytes_per_second=bw, matmul_flops_per_second=rate,
                         decode_dispatch_seconds=host,
                         decode_step_seconds_with_dispatch=predicted_decode_step(full, host, device.family))


# ---- the estimate --------------------------------------------------------------------------

def _fits(spec: ModelSpec, setup: InferenceSetup, device: Device) -> bool:
    return inference_memory(spec, setup, device).peak_reserved <= device.usable_bytes


def _largest(ok, limit: int) -> int:
    """The largest k in [1, limit] with ok(k), ok being monotone; 0 if ok(1) fails."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def max_context(spec: ModelSpec, setup: InferenceSetup, device: Device) -> int:
    """The longest cache (prompt = the whole context unless a prompt length is held) that fits
    at this batch; 0 if none. Capped at the learned position table's rows."""
    limit = spec.max_positions if spec.pos == "learned" else MAX_SEARCH

    def ok(c: int) -> bool:
        prompt = None if setup.prompt is None else min(setup.prompt, c)
        return _fits(spec, setup.replace(ctx=c, prompt=prompt), device)

    return _largest(ok, limit)


def max_batch(spec: ModelSpec, setup: InferenceSetup, device: Device) -> int:
    """The most sequences generated together at this context that fit; 0 if none."""
    return _largest(lambda b: _fits(spec, setup.replace(batch=b), device), MAX_SEARCH)


@dataclass(frozen=True)
class InferenceEstimate:
    model: ModelSpec
    setup: InferenceSetup
    device: Device
    memory: InferenceMemory
    time: InferenceTime
    fits: bool
    max_ctx: int
    max_batch: int
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {"mode": "inference", "model": self.model.to_json(), "inference": self.setup.to_json(),
                "device": self.device.to_json(), "memory": self.memory.to_json(), "fits": self.fits,
                "max_ctx": self.max_ctx, "max_batch": self.max_batch, "time": self.time.to_json(),
                "notes": list(self.notes)}


def estimate_inference(spec: ModelSpec, setup: InferenceSetup, device: Device) -> InferenceEstimate:
    """Memory by phase, fit, the largest context and batch, and prefill / decode speed."""
    spec.check_context(setup.ctx)
    notes = []
    if setup.quantized:
        notes.append(f"{setup.weights_dtype} weights: GGUF {'Q8_0' if setup.weights_dtype == 'int8' else 'Q4_0'} "
                     "block sizes for a llama.cpp-style runtime; this repo's trainer does not run them, so this "
                     "figure is not validated here")
    if setup.activation_dtype != "fp32" and not device.supports(setup.activation_dtype):
        notes.append(f"{device.name} has no fast native {setup.activation_dtype}: speed uses its fp32 rate")
    if spec.pos == "rope" and setup.ctx > spec.max_positions:
        notes.append(f"ctx {setup.ctx} is beyond the model's nominal {spec.max_positions} positions: RoPE "
                     "extrapolates poorly past the context it was trained at")
    memory = inference_memory(spec, setup, device)
    return InferenceEstimate(model=spec, setup=setup, device=device, memory=memory,
                             time=inference_time(spec, setup, device),
                             fits=memory.peak_reserved <= device.usable_bytes,
                             max_ctx=max_context(spec, setup, device), max_batch=max_batch(spec, setup, device),
                             notes=tuple(notes))
