"""Time of a training step: the kernels the step runs, each timed on a roofline, summed by term.

``step_kernels`` lists the kernels of one optimizer step of the reference model
(``trainer/model.py``) and step (``trainer/step.py``): every linear's forward and backward
matmuls, attention, the elementwise ops (norms, rotary, activation, residual adds, autocast
casts), the loss, the embedding and the optimizer, each with its FLOPs, the bytes it reads and
writes, the fresh tensors it allocates and, for a matmul, its shape. ``step_time`` times each
kernel on the device and sums them by term:

- **forward / backward / recompute**: the linears' matmuls (rate interpolated from the calibrated
  shape table: small shapes are launch- and cache-bound, large ones compute-bound) and the
  elementwise kernels (bytes over the elementwise bandwidth at that working-set size, or elements
  over the transcendental rate for exp/tanh kernels on a CPU, whichever is longer); ``recompute``
  is what activation checkpointing runs again.
- **attention**: the fused SDPA kernel or the eager score/softmax path, forward and backward.
- **loss**: the fp32 cross-entropy over the (tokens, vocab) logits.
- **optimizer**: gradient clipping, the optimizer step and zero_grad, over the parameters whose
  state the process holds (``optimizer_params``: its shards under FSDP, the adapters under LoRA).
- **data**: handing a micro-batch of token ids to the model.
- **launch**: the dispatch cost of every other aten op (the PyTorch dispatcher, autograd, the
  kernel launch): the floor of small models.
- **communication**: the gradient all-reduce (DDP) or the all-gathers and reduce-scatter (FSDP),
  ring collectives over the profile's [interconnect]; only what the forward and backward do not
  hide (``memplan.comm.communication``: overlapped on CUDA/ROCm, not on gloo).

Each kernel takes the longer of its compute time (FLOPs over the rate) and its memory time
(bytes over the bandwidth): its roofline; a term's ``bound`` is whichever side dominates its
time. On a CPU the device runs every op itself, so dispatch and kernel time add; on a GPU the
host dispatches ahead while the device works, so the step takes the longer of the two and the
``launch`` term is what dispatch adds beyond the device's work. On a CPU, a tensor above the
allocator's mmap threshold is fresh memory the kernel zeroes page by page on first write
(measured by ``memplan calibrate``): its ``first touch`` is counted with the kernel that writes it.

**torch.compile** (``setup.compile``) is modelled where the profile carries ``memplan calibrate --compile``'s
measurement (``[calibrated] compile_reference``: a reference step eager and compiled, and the compile's one-off
time): compiling fuses the elementwise kernels, the loss and the dispatches around them (the *fusible* work)
and leaves the matmuls, attention and the optimizer as they are, so the fusible seconds of a compiled step are
the eager ones over the speedup that makes the reference's prediction match its measurement
(``compile_fusion``). The compile itself is a one-off (``compile_seconds``): a fixed part F (the process's
first compile, its distinct kernels' builds) plus c seconds per op of the compiled graph (``compiled_graph_ops``:
ops per layer × layers + the rest), F and c as ``memplan calibrate --compile`` measured them
(``[calibrated] compile_cost``) or the build machine's defaults; not in the step time, in the epoch time.

Rates come from the device profile. A profile written by ``memplan calibrate`` carries measured
rates (``[calibrated]``, see ``memplan/hardware.py``); a bundled profile has only vendor peaks,
achievable matmul fractions and bandwidths, so the terms fall back to the sourced defaults below.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field

from memplan.hardware import Device
from memplan.memory.sharding import (COLLECTIVES_OF_FAMILY, fsdp_gather_bytes, fsdp_group_numel, fsdp_local_params,
                                     fsdp_reduce_bytes, param_shapes)
from memplan.memory.terms import _matrix_shapes, lora_tensors, sdpa_gqa_repeats, trainable_params
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, HALF_BYTES, TrainSetup

FORWARD_FLOPS_PER_PARAM_TOKEN = 2  # one multiply-add per weight per token
BACKWARD_FLOPS_PER_PARAM_TOKEN = 4  # input gradient and weight gradient
CAUSAL_FRACTION = 0.5  # fused causal attention skips the masked half of the scores
FLASH_BACKWARD_RATIO = 2.5  # FlashAttention-2's backward does 2.5× the forward's matmul FLOPs (Dao 2023, §3.1)
INDEX_BYTES = 8  # token ids are int64

# ---- defaults for profiles without [calibrated] rates -----------------------------------------
# Elementwise kernels reach a fraction of the DRAM bandwidth: measured/theoretical bandwidth from
# github.com/chsasank/device-benchmarks README.md: RTX 3060 330/360 = 0.92, L4 235/300 = 0.78,
# RX 7900 XTX 792/960 = 0.83, M3 Max 318/400 = 0.80, M4 Max 396/546 = 0.73; Strix Halo 212-229/256 = 0.86
# (lhl's llm-tracker Strix Halo post). Median 0.8. The profiles' [memory] sources cite the same figures.
STREAM_FRACTION = 0.8
# Per dispatched aten op (views included), host side: the Python op call, the dispatcher, autograd
# bookkeeping and the launch. Measured: "4 us per op on CUDA" for a dispatch-bound model on an A100
# (pytorch/pytorch #82793); 7 us per `2*x` with requires_grad on the CPU, ~2 us without (pytorch/pytorch
# #41383); 8 us per add submitted to an A100 (flagos-ai/Torch-FL PR #27). The reference block's ~195 dispatches
# per layer include views (~1-2 us) and autograd nodes, so 6 us on average for CUDA; ROCm's launch is slower
# and Apple's MPS encodes command buffers (estimates, no measurement found). The CPU figure is this repo's build
# machine (a 2.45 GHz EPYC KVM guest, one thread, `memplan calibrate`): 12-16 us per dispatch, kernels included.
DEFAULT_LAUNCH_SECONDS = {"cuda": 6e-6, "rocm": 8e-6, "mps": 1e-5, "cpu": 1.4e-5}
# FlashAttention-2 reaches 50-73% of A100's peak FLOP/s in the forward (Dao 2023, abstract), less in the
# backward and with head dim 64 (its Fig. 5-6); PyTorch's SDPA runs FA2 or memory-efficient kernels. We take the
# low end, 0.5, of the dtype's dense peak, for the causal FLOPs actually done.
ATTENTION_EFFICIENCY = 0.5
# Host-to-device copy of the token ids: pinned PCIe 4.0 x16 moves ~25 GB/s (stas00/ml-engineering network README:
# 31 GB/s unidirectional theoretical; ~80% in practice).
H2D_BYTES_PER_SECOND = 25e9
DATA_DISPATCHES_PER_MICRO_BATCH = 4  # two tensors made from the loader's arrays and moved to the device

# ---- dispatch counts of the reference model (TorchDispatchMode over trainer/model.py, torch 2.13) -------------
# Per block, forward and backward, fp32, SDPA, no checkpointing, multi-head attention; views included.
# tests/unit/test_timing.py recounts them on a real step.
LAYER_DISPATCHES = {"llama": (66, 113), "gpt2": (32, 68), "gpt_neox": (54, 88)}
EAGER_DISPATCHES = (19, 20)  # the explicit score path instead of one SDPA call
EAGER_GQA_DISPATCHES = (6, 5)  # repeat_interleave of k and v for grouped-query attention
MIXED_DISPATCHES = {"llama": (6, 8), "gpt2": (10, 12), "gpt_neox": (10, 12)}  # autocast casts
PURE_BF16_DISPATCHES = {"llama": (6, 12), "gpt2": (0, 0), "gpt_neox": (0, 0)}  # RMSNorm's fp32 upcasts
RECOMPUTE_EXTRA_DISPATCHES = {"full": 33, "selective": 29}  # checkpoint's own ops beyond the re-run forward
SELECTIVE_FORWARD_DISPATCHES = 5  # the selective policy's context in the forward
# Per micro-batch outside the blocks (embedding, final norm, head, loss), forward + backward.
BASE_DISPATCHES = {"llama": 54, "gpt2": 37, "gpt_neox": 32}
BASE_EXTRA_DISPATCHES = {"eager": 2, "mixed": {"llama": 8, "gpt2": 6, "gpt_neox": 8},
                         "bf16": {"llama": 13, "gpt2": 2, "gpt_neox": 4}}
# Dispatches inside a linear and inside attention: their calibrated times include them, so the launch term
# leaves them out. Forward: view, t, mm, _unsafe_view (+2 autocast casts); backward: two mm, their
# transposes and views (+2 casts back to fp32).
LINEAR_DISPATCHES = (4, 6)
ATTENTION_DISPATCHES = {"sdpa": (2, 4), "eager": (17, 19)}
# Modules timed as one by calibration (forward, backward), counted on the module alone in a step.
RMSNORM_DISPATCHES = (6, 19)
LAYERNORM_DISPATCHES = (1, 1)
ROTARY_DISPATCHES = {False: (11, 10), True: (14, 13)}  # full / partial rotary (the pass-through copy)
SWIGLU_DISPATCHES = (3, 4)
GELU_DISPATCHES = (1, 1)
OPTIMIZER_BASE_DISPATCHES = 31  # clip_grad_norm_ and foreach AdamW: per-group foreach ops
OPTIMIZER_DISPATCHES_PER_TENSOR = 2  # AdamW reads each tensor's step count on the host (.item())
# Foreach AdamW over fp32 tensors (torch.optim._multi_tensor_adamw), passes over each parameter's bytes:
# weight decay 2, lerp(exp_avg) 3, mul(exp_avg_sq) 2, addcmul 4, sqrt 2, div 2, add eps 2, addcdiv 4 = 21.
ADAMW_FOREACH_PASSES = 21
ADAMW_FUSED_PASSES = 7  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
SGD_FOREACH_PASSES = 8  # weight decay add 3, momentum mul+add 3 (buf = buf·m + g), param add 3 → ~8 with reuse
CLIP_PASSES = 3  # the foreach norm reads every gradient; the scale reads and writes it
FUSIBLE_KINDS = ("elementwise", "transcendental", "module")  # what torch.compile fuses (with the loss and dispatch)
COMPILE_FUSION_BOUNDS = (0.5, 20.0)  # the fusible speedup a calibration can give, at most this slower / faster
# torch.compile's one-off where calibration did not measure it (``[calibrated] compile_cost``): F + ops · c
# (``compile_seconds``; the graph is compiled once, ``trainer_recompiles``). A least-squares fit over
# benchmarks/compile_time.py's three one-offs of memplan's Llama step (fp32, SDPA, ctx 256, micro-batch 4, vocab
# 4096; each in a fresh process with an empty inductor cache; CPU seconds of the process and its C++ builds, with
# inductor's compile_threads = 1) on this repo's build machine (AMD EPYC Zen 3 KVM guest, torch 2.13.0+cpu, g++ 12):
# 2 blocks, 412 ops: 37.0 s; 6 blocks, 1,128 ops: 49.7 s; 10 blocks, 1,844 ops: 59.4 s; each within 2% of
# 31 s + 16 ms per op (the same run's calibration: 31.1 s + 16.15 ms). Before the trainer stopped recompiling a
# rotary model's graph at its second step, the one-offs were 38.3, 57.1 and 72.4 s, fitted as 30 s + 2 × 12 ms per
# op. The fixed part is mostly the process's first compile (inductor's imports) and the C++ builds of the graph's
# distinct kernels; a GPU builds Triton kernels instead and its host does the same per-op work: there these figures
# are an estimate, unmeasured.
DEFAULT_COMPILE_FIXED_SECONDS = 31.0
DEFAULT_COMPILE_SECONDS_PER_OP = 0.016


# ---- FLOPs ---------------------------------------------------------------------------------

def tokens(setup: TrainSetup) -> int:
    """n = B·T, tokens in one micro-batch."""
    return setup.micro_batch * setup.ctx


def step_tokens(setup: TrainSetup) -> int:
    """Tokens one process handles per optimizer step: micro_batch · ctx · grad_accum."""
    return tokens(setup) * setup.grad_accum


def matmul_flops(spec: ModelSpec, setup: TrainSetup) -> float:
    """Forward and backward of every weight matrix: 6 · matmul_params · tokens (Kaplan et al. 2020, §2.1)."""
    per_token = FORWARD_FLOPS_PER_PARAM_TOKEN + BACKWARD_FLOPS_PER_PARAM_TOKEN
    return float(per_token * spec.matmul_params * step_tokens(setup))


def attention_forward_flops(spec: ModelSpec, setup: TrainSetup) -> float:
    """q·kᵀ and probs·v in the forward: 4 · B · T² · H per layer, halved for SDPA's causal kernel
    (eager attention computes the masked half too)."""
    full = 4.0 * setup.micro_batch * setup.ctx * setup.ctx * spec.hidden * spec.layers * setup.grad_accum
    return full * (CAUSAL_FRACTION if setup.attention == "sdpa" else 1.0)


def attention_flops(spec: ModelSpec, setup: TrainSetup) -> float:
    """Attention forward plus backward: the backward does twice the forward's matmuls in eager
    attention, 2.5× in a fused kernel (which recomputes the scores)."""
    ratio = FLASH_BACKWARD_RATIO if setup.attention == "sdpa" else 2.0
    return attention_forward_flops(spec, setup) * (1.0 + ratio)


def recompute_flops(spec: ModelSpec, setup: TrainSetup) -> float:
    """Full checkpointing runs every block's forward again in backward: 2 · layer matmul params ·
    tokens plus the attention forward. Selective recomputes only cheap ops (counted as traffic)."""
    if setup.checkpointing != "full":
        return 0.0
    layer_matmul = spec.matmul_params - spec.vocab * spec.hidden
    return FORWARD_FLOPS_PER_PARAM_TOKEN * layer_matmul * step_tokens(setup) + attention_forward_flops(spec, setup)


def model_flops(spec: ModelSpec, setup: TrainSetup) -> float:
    """The FLOPs MFU is measured against (PaLM, Chowdhery et al. 2022, App. B): 6·N per token
    plus 12·L·H·T per token for attention, no recomputation."""
    return matmul_flops(spec, setup) + 12.0 * spec.layers * spec.hidden * setup.ctx * step_tokens(setup)


# ---- the kernels of a step -----------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """One kernel (or one module's few ops) of a step, per call; ``calls`` per optimizer step."""

    term: str  # forward | backward | recompute | attention | loss | optimizer | data
    name: str  # what it computes, e.g. "qkv", "rmsnorm", "silu"
    kind: str  # matmul | attention | module | elementwise | transcendental | optimizer | h2d
    calls: int = 1
    flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    fresh: tuple[float, ...] = ()  # sizes of the tensors it allocates (first touch on a CPU)
    elements: float = 0.0  # transcendental: elements through exp/tanh; module: elements of its output
    op: str = ""  # transcendental: log_softmax; module: rmsnorm | layernorm | rotary | swiglu | gelu
    dtype: str = "fp32"  # compute dtype of a matmul / attention / module / elementwise kernel
    shape: tuple = ()  # matmul: (tokens, in, out); attention: (T, batch·heads, head_dim)
    direction: str = "forward"  # forward | backward (matmul, attention and module rates)
    impl: str = ""  # attention: sdpa | eager
    dispatches: int = 0  # aten ops it dispatches (views included), part of step_dispatches
    exp_elements: float = 0.0  # module: elements through exp/tanh (SiLU, GELU)


def _dtype_name(nbytes: int, setup: TrainSetup) -> str:
    """The elementwise dtype of a tensor with ``nbytes`` per element in this setup."""
    if nbytes == FP32_BYTES:
        return "fp32"
    return "fp16" if setup.precision == "fp16-mixed" else "bf16"


class _Builder:
    """Collects the kernels of one micro-batch of one block (or of the model's ends)."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup, repeat_kv: bool = False):
        self.spec, self.setup = spec, setup
        self.repeat_kv = repeat_kv  # SDPA with grouped-query attention where no flash kernel takes it
        self.n = tokens(setup)
        self.a = setup.compute_bytes  # activations in the compute dtype
        self.r = HALF_BYTES if setup.precision == "bf16" else FP32_BYTES  # residual stream
        self.p = setup.param_bytes
        self.kernels: list[Kernel] = []

    def ew(self, term: str, name: str, read: float, write: float, nbytes: int, fresh: bool = True,
           elements: float = 0.0, op: str = "", dispatches: int = 1) -> None:
        """An elementwise kernel: reads ``read`` bytes, writes ``write`` bytes of ``nbytes``-wide elements."""
        kind = "transcendental" if elements else "elementwise"
        self.kernels.append(Kernel(term=term, name=name, kind=kind, read_bytes=read, write_bytes=write,
                                   fresh=(write,) if fresh and write else (), elements=elements, op=op,
                                   dtype=_dtype_name(nbytes, self.setup), dispatches=dispatches))

    def module(self, term: str, op: str, direction: str, elements: float, nbytes: int,
               passes: list[tuple[float, float, bool]], dispatches: int, transcendental: float = 0.0) -> None:
        """A module timed as one kernel when calibrated (its measured time at this many output elements),
        else by its ops' traffic: ``passes`` of (read bytes, written bytes, fresh output)."""
        self.kernels.append(Kernel(
            term=term, name=op if direction == "forward" else f"{op} backward", kind="module", op=op,
            direction=direction, elements=elements, dtype=_dtype_name(nbytes, self.setup),
            read_bytes=sum(r for r, _, _ in passes), write_bytes=sum(w for _, w, _ in passes),
            fresh=tuple(w for _, w, f in passes if f and w), exp_elements=transcendental, dispatches=dispatches))

    # ---- modules: each appends its forward or backward kernels ----

    def norm(self, term: str, direction: str) -> None:
        """RMSNorm (trainer/model.py ``_RMSNormFunction``). Forward: x², its mean, x·rstd, ·weight in fp32
        (4 reads and 3 writes of n·H fp32); backward: n̂ = x·rstd, grad·n̂ and its sum over tokens (the
        weight gradient), grad·weight written into that buffer, the per-token dot g·n̂ (a reduction over
        H), then three in-place updates (11 reads, 6 writes of n·H fp32). A bf16 input is upcast (twice
        forward, three times backward) and the result cast back.
        LayerNorm: one fused kernel each way (``native_layer_norm``)."""
        nh, r, f = self.n * self.spec.hidden, self.r, FP32_BYTES
        if self.spec.norm == "layernorm":
            passes = [(nh * r, nh * r + 2 * self.n * r, True)] if direction == "forward" else \
                [(2 * nh * r, nh * r, True)]
            self.module(term, "layernorm", direction, nh, r, passes, LAYERNORM_DISPATCHES[direction == "backward"])
            return
        casts = (2 if direction == "forward" else 3) if r != f else 0
        passes = [(nh * r, nh * f, True)] * casts
        if direction == "forward":
            passes += [(nh * f, nh * f, True), (nh * f, self.n * f, False), (nh * f, nh * f, True)]
            passes += [(nh * f, nh * r, True)] if r != f else []
            passes += [(nh * r, nh * r, True)]
        else:
            passes += [(nh * f, nh * f, True), (2 * nh * f, nh * f, True), (nh * f, 0, False),
                       (nh * f, nh * f, False), (2 * nh * f, 0, False), (4 * nh * f, 3 * nh * f, False)]
            passes += [(nh * f, nh * r, True)] if r != f else []
        self.module(term, "rmsnorm", direction, nh, r, passes, RMSNORM_DISPATCHES[direction == "backward"])

    # kept for readability of block_kernels
    def norm_forward(self, term: str) -> None:
        self.norm(term, "forward")

    def norm_backward(self, term: str) -> None:
        self.norm(term, "backward")

    def linear(self, term: str, name: str, k: int, out: int, bias: bool, cast_input: bool,
               direction: str) -> None:
        """A linear layer: the (n, k) × (k, out) matmul forward, or its two backward matmuls (input and
        weight gradients). Under autocast: the fp32 weight cast to the compute dtype (and the input,
        when it arrives in fp32) in the forward; the weight gradient (and that input's gradient) cast
        back in the backward. With a bias: its gradient, a sum over n."""
        n, a = self.n, self.a
        dtype = self.setup.compute_dtype
        flops = 2.0 * n * k * out * (2 if direction == "backward" else 1)
        if direction == "forward":
            if self.setup.mixed:
                self.ew(term, f"{name} weight cast", k * out * FP32_BYTES, k * out * a, a)
                if cast_input:
                    self.ew(term, f"{name} input cast", n * k * FP32_BYTES, n * k * a, a)
            traffic = (n * k + k * out) * a
            written = n * out * a
        else:
            traffic = (2 * n * out + n * k + k * out) * a
            written = (n * k + k * out) * a
            if bias:
                self.ew(term, f"{name} bias grad", n * out * a, out * a, a, fresh=False)
        self.kernels.append(Kernel(term=term, name=name, kind="matmul", flops=flops, read_bytes=traffic,
                                   write_bytes=written, fresh=(n * out * a,) if direction == "forward" else
                                   (n * k * a, k * out * a), dtype=dtype, shape=(n, k, out),
                                   direction=direction, dispatches=LINEAR_DISPATCHES[direction == "backward"]))
        if direction == "backward" and self.setup.mixed:
            self.ew(term, f"{name} weight grad cast", k * out * a, k * out * FP32_BYTES, FP32_BYTES)
            if cast_input:
                self.ew(term, f"{name} input grad cast", n * k * a, n * k * FP32_BYTES, FP32_BYTES)

    def rotary(self, term: str, direction: str = "forward") -> None:
        """RoPE on q and on k (``_rotate``; its backward is the same rotation): on the rotating share of
        each width two multiplies and two addcmuls (3 reads, 2 writes per element) into a new tensor,
        the rest copied."""
        if self.spec.pos != "rope":
            return
        pct = self.spec.rotary_dim / self.spec.head_dim
        partial = self.spec.rotary_dim < self.spec.head_dim
        for width in (self.spec.hidden, self.spec.kv_dim):
            e = self.n * width * self.a
            passes = [(e * (3 * pct + (1 - pct)), 0, False), (0, e * (2 * pct + (1 - pct)), True)]
            self.module(term, "rotary", direction, self.n * width, self.a, passes,
                        ROTARY_DISPATCHES[partial][direction == "backward"])

    def attention(self, term: str, direction: str) -> None:
        """The attention core: SDPA, or eager attention's copies, score matmuls, scale, mask and softmax
        (timed as one by calibration). Eager also copies its output back to (B, T, H). With grouped-query
        attention, eager attention repeats k and v to every head (and sums their gradients back), and so
        does the model before SDPA where no flash kernel takes them (``memory.sdpa_gqa_repeats``)."""
        s, spec = self.setup, self.spec
        bh = s.micro_batch * spec.heads
        scores = bh * s.ctx * s.ctx * self.a
        fresh = (scores,) if s.attention == "eager" else ()
        if s.attention == "eager" and direction == "backward":
            fresh = (scores, scores)
        nominal = 4.0 * bh * s.ctx * s.ctx * spec.head_dim * (2 if direction == "backward" else 1)
        qkv_bytes = self.n * (spec.hidden + 2 * spec.kv_dim) * self.a
        out_bytes = self.n * spec.hidden * self.a
        traffic = qkv_bytes + out_bytes * (2 if direction == "backward" else 1)
        if s.attention == "eager":
            traffic += scores * (4 if direction == "forward" else 6)
        self.kernels.append(Kernel(term=term, name=f"{s.attention} attention", kind="attention", flops=nominal,
                                   read_bytes=traffic, write_bytes=out_bytes, fresh=fresh, dtype=s.compute_dtype,
                                   shape=(s.ctx, bh, spec.head_dim), direction=direction, impl=s.attention,
                                   dispatches=ATTENTION_DISPATCHES[s.attention][direction == "backward"]))
        if s.attention == "eager" or self.repeat_kv:
            e = self.n * spec.hidden * self.a
            if spec.kv_heads != spec.heads:
                if direction == "forward":
                    self.ew(term, "repeat k, v", 2 * self.n * spec.kv_dim * self.a, 2 * e, self.a, dispatches=0)
                else:
                    self.ew(term, "sum k, v grads", 2 * e, 2 * self.n * spec.kv_dim * self.a, self.a, dispatches=0)
            if direction == "forward" and s.attention == "eager":
                self.ew(term, "attention output copy", e, e, self.a)

    def activation(self, term: str, direction: str) -> None:
        """SwiGLU: silu(gate)·up (backward: two products, silu's backward, and the cat of the gate and up
        gradients); GELU (tanh). exp/tanh per element: compute-bound on a CPU."""
        nf, a = self.n * self.spec.ffn, self.a
        if self.spec.mlp == "swiglu":
            passes = [(nf * a, nf * a, True), (2 * nf * a, nf * a, True)] if direction == "forward" else \
                [(4 * nf * a, 2 * nf * a, True), (2 * nf * a, nf * a, True), (2 * nf * a, 2 * nf * a, True)]
            self.module(term, "swiglu", direction, nf, a, passes, SWIGLU_DISPATCHES[direction == "backward"],
                        transcendental=nf)
        else:
            passes = [(nf * a, nf * a, True)] if direction == "forward" else [(2 * nf * a, nf * a, True)]
            self.module(term, "gelu", direction, nf, a, passes, GELU_DISPATCHES[direction == "backward"],
                        transcendental=nf)

    def residual(self, term: str, direction: str) -> None:
        """x + branch: reads the stream and the branch (compute dtype), writes the stream; in backward the
        two gradient paths into x are summed, and under autocast the branch's gradient is cast down."""
        nh = self.n * self.spec.hidden
        if direction == "forward":
            self.ew(term, "residual add", nh * (self.r + self.a), nh * self.r, self.r)
        else:
            self.ew(term, "residual grad add", 2 * nh * self.r, nh * self.r, self.r)
            if self.setup.mixed:
                self.ew(term, "branch grad cast", nh * FP32_BYTES, nh * self.a, self.a)

    def qkv_grad_cat(self, term: str) -> None:
        """The q, k and v gradients concatenated for the fused qkv matmul's backward."""
        e = self.n * (self.spec.hidden + 2 * self.spec.kv_dim) * self.a
        self.ew(term, "cat q, k, v grads", e, e, self.a)


def block_kernels(spec: ModelSpec, setup: TrainSetup, term: str, direction: str,
                  repeat_kv: bool = False) -> list[Kernel]:
    """One block's kernels for one micro-batch, in the order trainer/model.py runs them (``direction``
    forward) or autograd runs their backward. Attention kernels go to the ``attention`` term unless
    ``term`` is recompute."""
    b = _Builder(spec, setup, repeat_kv)
    bias, h, kv, f = bool(spec.bias), spec.hidden, spec.kv_dim, spec.ffn
    qkv_bias = bias or spec.qkv_bias
    up = (2 if spec.mlp == "swiglu" else 1) * f
    att_term = "recompute" if term == "recompute" else "attention"
    cast_qkv_in = setup.mixed  # the norm's fp32 output is cast for the matmul
    if direction == "forward":
        b.norm_forward(term)
        b.linear(term, "qkv", h, h + 2 * kv, qkv_bias, cast_qkv_in, "forward")
        b.rotary(term)
        b.attention(att_term, "forward")
        b.linear(term, "proj", h, h, bias, False, "forward")
        b.residual(term, "forward")
        b.norm_forward(term)
        b.linear(term, "up", h, up, bias, setup.mixed, "forward")
        b.activation(term, "forward")
        b.linear(term, "down", f, h, bias, False, "forward")
        b.residual(term, "forward")
    else:
        b.residual(term, "backward")
        b.linear(term, "down", f, h, bias, False, "backward")
        b.activation(term, "backward")
        b.linear(term, "up", h, up, bias, setup.mixed, "backward")
        b.norm_backward(term)
        b.residual(term, "backward")
        b.linear(term, "proj", h, h, bias, False, "backward")
        b.attention(att_term, "backward")
        b.rotary(term, "backward")
        b.qkv_grad_cat(term)
        b.linear(term, "qkv", h, h + 2 * kv, qkv_bias, cast_qkv_in, "backward")
        b.norm_backward(term)
    return b.kernels


def recompute_kernels(spec: ModelSpec, setup: TrainSetup, repeat_kv: bool = False) -> list[Kernel]:
    """What checkpointing runs again in backward: the whole block forward (full), or all but the saved
    matmul and attention outputs (selective)."""
    if setup.checkpointing == "none":
        return []
    forward = block_kernels(spec, setup, "recompute", "forward", repeat_kv)
    if setup.checkpointing == "full":
        return forward
    # the selective policy (trainer/model.py) keeps the outputs of mm/addmm, SDPA and eager attention's
    # softmax; everything else runs again, eager attention's score matmuls, scaling and mask included
    keep = ("matmul",) if setup.attention == "eager" else ("matmul", "attention")
    return [k for k in forward if k.kind not in keep]


def ends_kernels(spec: ModelSpec, setup: TrainSetup) -> list[Kernel]:
    """Outside the blocks, per micro-batch: embedding (and learned positions), final norm, LM head,
    the fp32 cross-entropy, and their backward."""
    b = _Builder(spec, setup)
    n, h, v, p = b.n, spec.hidden, spec.vocab, setup.param_bytes
    f = FP32_BYTES
    b.ew("forward", "embedding", n * h * p + n * INDEX_BYTES, n * h * p, p)
    if spec.pos == "learned":
        b.ew("forward", "position add", n * h * p + setup.ctx * h * p, n * h * p, p)
    b.norm_forward("forward")
    b.linear("forward", "head", h, v, False, setup.mixed, "forward")
    nv = n * v
    if setup.compute_bytes != f:
        b.ew("loss", "logits upcast", nv * setup.compute_bytes, nv * f, f)
    b.ew("loss", "log_softmax", nv * f, nv * f, f, elements=nv, op="log_softmax")
    b.ew("loss", "nll_loss backward zeros", 0, nv * f, f)
    b.ew("loss", "log_softmax backward", 2 * nv * f, nv * f, f, elements=nv, op="log_softmax")
    if setup.compute_bytes != f:
        b.ew("loss", "logits grad cast", nv * f, nv * setup.compute_bytes, setup.compute_bytes)
    b.linear("backward", "head", h, v, False, setup.mixed, "backward")
    b.norm_backward("backward")
    # embedding_dense_backward: a zeroed (V, H) gradient, then the n rows added in
    b.ew("backward", "embedding backward", n * h * p + n * INDEX_BYTES, v * h * p + n * h * p, p)
    if spec.tied:
        b.ew("backward", "tied grads add", 2 * v * h * p, v * h * p, p)
    if spec.pos == "learned":
        b.ew("backward", "position grad", n * h * p, spec.max_positions * h * p + setup.ctx * h * p, p)
    return b.kernels


def optimizer_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Parameters whose gradients this process clips and whose optimizer state it steps, the ones its
    memory holds state for (memplan.memory): under FSDP rank 0's local shards (``fsdp_local_params``,
    ceil(rows/W) rows of every tensor: the most of any rank, so the slowest step), under LoRA the
    adapters (``trainable_params``), else all N. DDP steps every parameter on every rank."""
    if setup.sharding == "fsdp" and setup.world_size > 1:
        return fsdp_local_params(spec, setup, 0)
    return trainable_params(spec, setup)


def optimizer_tensors(spec: ModelSpec, setup: TrainSetup) -> int:
    """Tensors the optimizer steps: every parameter tensor (an FSDP2 shard is one DTensor per
    parameter, so sharding keeps the count), under LoRA the adapters' A and B (``lora_tensors``)."""
    return lora_tensors(spec, setup) if setup.lora_rank else param_tensors(spec)


def _largest_optimizer_tensor(spec: ModelSpec, setup: TrainSetup) -> int:
    """Elements of the largest tensor the optimizer steps: the embedding (V·H; its ceil(V/W) rows under
    FSDP), or under LoRA the largest adapter matrix (r × the widest side of a targeted matrix)."""
    if setup.lora_rank:
        shapes = _matrix_shapes(spec)  # q, k, v alone: their slices; head: H → V
        return setup.lora_rank * max(max(shapes[m]) for m in (*setup.lora_adapters, *("head",) * setup.lora_head))
    rows = spec.vocab if setup.sharding != "fsdp" else -(-spec.vocab // setup.world_size)
    return rows * spec.hidden


def optimizer_kernels(spec: ModelSpec, setup: TrainSetup) -> list[Kernel]:
    """Gradient clipping (foreach norm, then scale) and the optimizer's passes over the parameters it
    steps (``optimizer_params``: a rank's shards under FSDP, the adapters under LoRA), N_opt of them:
    clip reads CLIP_PASSES·N_opt·p bytes; the step moves passes·N_opt·p (adamw8bit: N_opt·(3p + 4),
    its states being 1 byte each)."""
    n_opt = optimizer_params(spec, setup)
    nbytes = n_opt * setup.param_bytes
    passes = {"adamw": ADAMW_FOREACH_PASSES, "adamw-fused": ADAMW_FUSED_PASSES, "sgd": SGD_FOREACH_PASSES,
              "adamw8bit": ADAMW_FUSED_PASSES}[setup.optimizer]
    if setup.optimizer == "adamw8bit":  # 8-bit states: param + grad read/written at p bytes, states at 1
        traffic = n_opt * (3 * setup.param_bytes + 4)
    else:
        traffic = passes * nbytes
    # foreach AdamW's sqrt(exp_avg_sq) is a fresh tensor per parameter; the largest is what may be fresh pages
    fresh = (float(_largest_optimizer_tensor(spec, setup) * setup.param_bytes),) if setup.optimizer == "adamw" \
        else ()
    return [Kernel(term="optimizer", name="clip_grad_norm_", kind="optimizer", read_bytes=CLIP_PASSES * nbytes),
            Kernel(term="optimizer", name=setup.optimizer, kind="optimizer", read_bytes=traffic, fresh=fresh)]


def compute_setup(setup: TrainSetup) -> TrainSetup:
    """The setup the forward and backward kernels follow. Under FSDP with bf16-mixed / fp16-mixed,
    FSDP2's MixedPrecisionPolicy replaces autocast (as ``memory.fsdp_compute_setup`` walks it): the
    gathered parameters are 16-bit, so the step computes as a pure 16-bit one, with no autocast
    casts; the fp32 master weights are touched only by ``fsdp_kernels`` and the optimizer."""
    if setup.sharding == "fsdp" and setup.world_size > 1 and setup.mixed:
        return setup.replace(precision="bf16")
    return setup


def fsdp_kernels(spec: ModelSpec, setup: TrainSetup, collectives: str = "nccl") -> list[Kernel]:
    """FSDP2's own copies, per micro-batch, of the tensors the memory walk's FSDP hook allocates (pad(G):
    a group's padded shard in elements; c, g: bytes of a gathered parameter and of a reduced gradient):

    - per all-gather of a group (the blocks twice, in forward and again in backward; the root once,
      kept unsharded from forward to backward): under mixed precision the copy-in, the shard cast to
      16 bits (pad(G)·(p + c)); always the copy-out of the gathered output into the parameters
      (2·W·pad(G)·c);
    - per group in backward: the unsharded gradients packed into the reduce-scatter input
      (|G|·c read, W·pad(G)·g written; the cast to the fp32 reduce dtype under mixed precision);
      gloo's flat copy of that input (2·W·pad(G)·g, CPU only); after the first micro-batch of a
      step, the reduced shard added into the sharded gradients (3·pad(G)·g).
    """
    if setup.sharding != "fsdp" or setup.world_size == 1:
        return []
    w, p, c, g = setup.world_size, setup.param_bytes, fsdp_gather_bytes(setup), fsdp_reduce_bytes(setup)
    out: list[Kernel] = []

    def ew(term: str, name: str, read: float, write: float, nbytes: int, calls: int) -> None:
        out.append(Kernel(term=term, name=name, kind="elementwise", read_bytes=read, write_bytes=write,
                          fresh=(write,), dtype=_dtype_name(nbytes, setup), calls=calls))

    shapes = param_shapes(spec)
    for group, count in (("block", spec.layers), ("root", 1)):
        pad = fsdp_group_numel(spec, setup, group)
        whole = sum(rows * length for rows, length in shapes[group])
        gathers = (("forward", "backward") if group == "block" else ("forward",))
        for term in gathers:
            if setup.mixed:
                ew(term, f"fsdp {group} copy-in cast", pad * p, pad * c, c, setup.grad_accum * count)
            ew(term, f"fsdp {group} copy-out", w * pad * c, w * pad * c, c, setup.grad_accum * count)
        ew("backward", f"fsdp {group} reduce-scatter input", whole * c, w * pad * g, g, setup.grad_accum * count)
        if collectives == "gloo":
            ew("backward", f"gloo {group} reduce-scatter copy", w * pad * g, w * pad * g, g, setup.grad_accum * count)
        if setup.grad_accum > 1:
            ew("backward", f"fsdp {group} gradient accumulation", 2 * pad * g, pad * g, g,
               (setup.grad_accum - 1) * count)
    return out


def step_kernels(spec: ModelSpec, setup: TrainSetup, repeat_kv: bool = False,
                 collectives: str = "nccl") -> list[Kernel]:
    """Every kernel of one optimizer step, ``calls`` set to how often it runs per step. ``repeat_kv``:
    the model repeats grouped-query K/V before SDPA on this device (``memory.sdpa_gqa_repeats``).
    Under FSDP the forward and backward follow ``compute_setup`` (no autocast; fp16-mixed's kernels
    run in fp16), FSDP2's copies are ``fsdp_kernels``, and the optimizer steps the rank's shards."""
    compute = compute_setup(setup)
    per_micro = ends_kernels(spec, compute)
    per_layer = (block_kernels(spec, compute, "forward", "forward", repeat_kv)
                 + recompute_kernels(spec, compute, repeat_kv)
                 + block_kernels(spec, compute, "backward", "backward", repeat_kv))
    if compute is not setup and setup.precision == "fp16-mixed":  # sized as bf16, run in fp16
        per_micro, per_layer = ([dataclasses.replace(k, dtype="fp16") if k.dtype == "bf16" else k for k in ks]
                                for ks in (per_micro, per_layer))
    out = [dataclasses.replace(k, calls=setup.grad_accum) for k in per_micro]
    out += [dataclasses.replace(k, calls=setup.grad_accum * spec.layers) for k in per_layer]
    out += fsdp_kernels(spec, setup, collectives)
    out += optimizer_kernels(spec, setup)
    out.append(Kernel(term="data", name="token ids", kind="h2d", calls=setup.grad_accum,
                      read_bytes=2 * tokens(setup) * INDEX_BYTES))
    return out


# ---- dispatch counts -----------------------------------------------------------------------

def _family(spec: ModelSpec) -> str:
    return spec.arch if spec.arch in LAYER_DISPATCHES else "llama"


def layer_dispatches(spec: ModelSpec, setup: TrainSetup, repeat_kv: bool = False) -> int:
    """aten ops (views included) one block dispatches per micro-batch: forward, backward and
    recomputation, counted on the reference model (see LAYER_DISPATCHES)."""
    fam = _family(spec)
    fwd, bwd = LAYER_DISPATCHES[fam]
    if setup.attention == "eager":
        fwd, bwd = fwd + EAGER_DISPATCHES[0], bwd + EAGER_DISPATCHES[1]
    if spec.kv_heads != spec.heads and (setup.attention == "eager" or repeat_kv):
        fwd, bwd = fwd + EAGER_GQA_DISPATCHES[0], bwd + EAGER_GQA_DISPATCHES[1]
    extra = MIXED_DISPATCHES[fam] if setup.mixed else PURE_BF16_DISPATCHES[fam] if setup.precision == "bf16" \
        else (0, 0)
    fwd, bwd = fwd + extra[0], bwd + extra[1]
    if setup.checkpointing != "none":
        bwd += fwd + RECOMPUTE_EXTRA_DISPATCHES[setup.checkpointing]
        if setup.checkpointing == "selective":
            fwd += SELECTIVE_FORWARD_DISPATCHES
    return fwd + bwd


def base_dispatches(spec: ModelSpec, setup: TrainSetup) -> int:
    """aten ops per micro-batch outside the blocks: embedding, final norm, head, loss, and their backward."""
    fam = _family(spec)
    n = BASE_DISPATCHES[fam]
    if setup.attention == "eager":
        n += BASE_EXTRA_DISPATCHES["eager"]
    if setup.mixed:
        n += BASE_EXTRA_DISPATCHES["mixed"][fam]
    elif setup.precision == "bf16":
        n += BASE_EXTRA_DISPATCHES["bf16"][fam]
    return n


def step_dispatches(spec: ModelSpec, setup: TrainSetup, repeat_kv: bool = False) -> int:
    """aten ops dispatched by the forward and backward passes of one step (the optimizer's excluded)."""
    return setup.grad_accum * (spec.layers * layer_dispatches(spec, setup, repeat_kv) + base_dispatches(spec, setup))


def param_tensors(spec: ModelSpec) -> int:
    """Parameter tensors of trainer/model.py (q, k, v fused in one matrix, SwiGLU's gate and up in one):
    per block qkv, proj, up, down and two norms, each with its bias where the family has biases (LayerNorm
    has a shift); then the embedding, learned positions, the final norm and an untied head."""
    norm = 2 if spec.norm == "layernorm" else 1
    per_layer = 4 + 2 * norm + (4 if spec.bias else 1 if spec.qkv_bias else 0)
    return spec.layers * per_layer + 1 + (1 if spec.pos == "learned" else 0) + norm + (0 if spec.tied else 1)


def optimizer_dispatches(spec: ModelSpec, setup: TrainSetup) -> int:
    """aten ops of clipping and a foreach optimizer step: a few per group plus a host read per tensor."""
    return OPTIMIZER_BASE_DISPATCHES + OPTIMIZER_DISPATCHES_PER_TENSOR * optimizer_tensors(spec, setup)


# ---- rates ---------------------------------------------------------------------------------

def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear interpolation in log x of log y, clamped to the ends."""
    if len(xs) == 1:
        return ys[0]
    lx = math.log(x)
    lxs = [math.log(v) for v in xs]
    if lx <= lxs[0]:
        return ys[0]
    if lx >= lxs[-1]:
        return ys[-1]
    i = bisect.bisect_right(lxs, lx) - 1
    t = (lx - lxs[i]) / (lxs[i + 1] - lxs[i])
    return math.exp(math.log(ys[i]) * (1 - t) + math.log(ys[i + 1]) * t)


class MatmulTable:
    """Net matmul rates measured on a (tokens, in, out) grid, interpolated in log space.

    Rows: ``[tokens, in, out, forward_tflops, backward_tflops]``. The grid may be ragged (calibration
    skips the largest shapes when its budget runs out): along tokens, each (in, out) pair interpolates
    its own measured rows; beyond its largest measured token count it follows the nearest pair measured
    further, and beyond every measurement it holds (large shapes plateau); between (in, out) pairs,
    bilinear in log in and log out; a pair with no rows takes the nearest pair's.
    """

    def __init__(self, rows: list[list[float]]):
        self.by_pair: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
        for m, k, n, fwd, bwd in rows:
            self.by_pair.setdefault((int(k), int(n)), []).append((int(m), float(fwd), float(bwd)))
        for v in self.by_pair.values():
            v.sort()
        self.ks = sorted({k for k, _ in self.by_pair})
        self.ns = sorted({n for _, n in self.by_pair})

    def _along_tokens(self, pair: tuple[int, int], m: float, col: int) -> float:
        rows = self.by_pair[pair]
        return _interp(m, [r[0] for r in rows], [r[col] for r in rows])

    def _nearest(self, k: int, n: int, pairs) -> tuple[int, int] | None:
        pairs = list(pairs)
        if not pairs:
            return None
        return min(pairs, key=lambda p: (math.log(p[0] / k)) ** 2 + (math.log(p[1] / n)) ** 2)

    def _pair(self, k: int, n: int, m: float, col: int) -> float:
        """The rate of the (in, out) pair at m tokens. Beyond the pair's largest measured token count, the
        rate changes as it does for the nearest pair measured that far (the tokens dimension mostly
        amortises per-call costs, alike across widths), rather than staying flat."""
        pair = (k, n) if (k, n) in self.by_pair else self._nearest(k, n, self.by_pair)
        rate = self._along_tokens(pair, m, col)
        top = self.by_pair[pair][-1][0]
        if m > top:
            ref = self._nearest(*pair, (p for p, rows in self.by_pair.items() if rows[-1][0] > top))
            if ref is not None:
                rate *= self._along_tokens(ref, m, col) / self._along_tokens(ref, top, col)
        return rate

    @staticmethod
    def _bracket(x: float, grid: list[int]) -> tuple[int, int, float]:
        if x <= grid[0] or len(grid) == 1:
            return grid[0], grid[0], 0.0
        if x >= grid[-1]:
            return grid[-1], grid[-1], 0.0
        i = bisect.bisect_right(grid, x) - 1
        lo, hi = grid[i], grid[i + 1]
        return lo, hi, math.log(x / lo) / math.log(hi / lo)

    def tflops(self, m: float, k: float, n: float, direction: str) -> float:
        col = 1 if direction == "forward" else 2
        k0, k1, tk = self._bracket(k, self.ks)
        n0, n1, tn = self._bracket(n, self.ns)
        total = 0.0
        for kk, wk in ((k0, 1 - tk), (k1, tk)):
            for nn, wn in ((n0, 1 - tn), (n1, tn)):
                if wk * wn > 0:
                    total += wk * wn * math.log(self._pair(kk, nn, m, col))
        return math.exp(total)


@dataclass(frozen=True)
class Rates:
    """The device's rates as the step-time model uses them: calibrated where measured, else derived
    from the profile's peaks and bandwidth with the sourced defaults above."""

    device: Device
    calibrated: bool

    @property
    def cal(self) -> dict:
        return self.device.calibrated

    @property
    def family(self) -> str:
        return self.device.family

    def launch_seconds(self) -> float:
        return float(self.cal.get("launch_overhead_seconds", DEFAULT_LAUNCH_SECONDS[self.family]))

    def matmul_dtype(self, dtype: str) -> str:
        """The dtype whose rate a matmul gets: measured dtypes as they are (an emulated bf16 runs, slowly);
        without a measurement, an unsupported dtype falls back to fp32 (tf32 keeps its own peak)."""
        if dtype in self.cal.get("matmul_tflops", {}) or dtype in self.cal.get("matmul", {}):
            return dtype
        if not self.device.supports(dtype) and dtype != "tf32":
            return "fp32"
        return dtype

    def matmul_flops_per_second(self, dtype: str, shape: tuple = (), direction: str = "forward") -> float:
        dtype = self.matmul_dtype(dtype)
        table = self.cal.get("matmul", {}).get(dtype)
        if table and shape:
            return MatmulTable(table).tflops(*shape, direction) * 1e12
        return self.device.matmul_flops_per_second(dtype)

    def elementwise_bytes_per_second(self, dtype: str, operand_bytes: float) -> float:
        rows = self.cal.get("elementwise", {}).get(dtype) or self.cal.get("elementwise", {}).get("fp32")
        if rows:
            return _interp(max(operand_bytes, 1.0), [r[0] for r in rows], [r[1] for r in rows])
        return self.device.bandwidth_bytes_per_second * STREAM_FRACTION

    def transcendental_elements_per_second(self, op: str, dtype: str) -> float:
        t = self.cal.get("transcendental", {})
        rate = t.get(f"{op}_{dtype}") or t.get(f"{op}_fp32")
        return float(rate) if rate else math.inf

    def first_touch(self) -> tuple[float, float] | None:
        """(bytes per second, threshold bytes) for fresh pages, CPU calibrations only."""
        bps = self.cal.get("first_touch_bytes_per_second")
        if not bps or self.family != "cpu":
            return None
        return float(bps), float(self.cal.get("first_touch_threshold_bytes", 32 * 2**20))

    def attention_flops_per_second(self, impl: str, dtype: str, ctx: int, head_dim: int,
                                   direction: str) -> float | None:
        """Calibrated nominal attention rate (4·B·h·T²·d forward, twice that backward), interpolated in T
        at each measured head width, then in the head width (log-log, held beyond the measured ones); a
        dtype not measured takes fp32's scaled by the two dtypes' matmul rates."""
        table = self.cal.get("attention", {})
        rows = table.get(f"{impl}_{dtype}")
        scale = 1.0
        if not rows and table.get(f"{impl}_fp32"):
            rows = table[f"{impl}_fp32"]
            scale = self.matmul_flops_per_second(dtype) / self.matmul_flops_per_second("fp32")
        if not rows:
            return None
        col = 2 if direction == "forward" else 3
        widths = sorted({int(r[1]) for r in rows})
        at_width = []
        for d in widths:
            sub = sorted((r for r in rows if int(r[1]) == d), key=lambda r: r[0])
            at_width.append(_interp(ctx, [r[0] for r in sub], [r[col] for r in sub]))
        return _interp(head_dim, widths, at_width) * 1e12 * scale

    def module_seconds(self, op: str, dtype: str, elements: float, direction: str) -> float | None:
        """Calibrated seconds of a module (norm, rotary, activation) at this many elements, interpolated
        log-log between measured sizes; below the smallest it holds (its dispatch floor), above the largest
        it grows in proportion to the elements."""
        table = self.cal.get("modules", {})
        rows = table.get(f"{op}_{dtype}") or table.get(f"{op}_bf16" if dtype == "fp16" else "") or \
            table.get(f"{op}_fp32")
        if not rows:
            return None
        col = 1 if direction == "forward" else 2
        rows = sorted(rows)
        top = rows[-1]
        if elements > top[0]:
            return top[col] * elements / top[0]
        return _interp(max(elements, 1.0), [r[0] for r in rows], [r[col] for r in rows])

    def includes_dispatch(self, k: Kernel) -> bool:
        """Whether the kernel's time comes from a calibrated measurement, which includes its dispatches."""
        if k.kind == "matmul":
            return self.matmul_dtype(k.dtype) in self.cal.get("matmul", {})
        if k.kind == "attention":
            return bool(self.cal.get("attention", {}).get(f"{k.impl}_fp32"))
        if k.kind == "module":
            return bool(self.cal.get("modules", {}).get(f"{k.op}_fp32"))
        return False

    def optimizer_seconds(self, name: str) -> tuple[float, float] | None:
        """Calibrated (seconds per parameter, seconds per tensor) of clip + step + zero_grad."""
        row = self.cal.get("optimizer", {}).get(name)
        return (float(row[0]), float(row[1])) if row else None


def rates_for(device: Device) -> Rates:
    return Rates(device=device, calibrated=bool(device.calibrated.get("matmul_tflops") or
                                                device.calibrated.get("matmul")))


# ---- timing the kernels --------------------------------------------------------------------

def kernel_seconds(k: Kernel, rates: Rates) -> tuple[float, float, float]:
    """(compute seconds, memory seconds, first-touch seconds) of one call of a kernel."""
    memory_bytes = k.read_bytes + k.write_bytes
    first = 0.0
    ft = rates.first_touch()
    if ft is not None:
        bps, threshold = ft
        # glibc mmaps a request whose chunk (the request and its header) reaches the threshold: a tensor of
        # exactly the threshold (micro-batch 8 × ctx 256 × vocab 4096 fp32 logits: 32 MiB) is fresh pages too
        first = sum(b for b in k.fresh if b >= threshold) / bps
    if k.kind == "matmul":
        compute = k.flops / rates.matmul_flops_per_second(k.dtype, k.shape, k.direction)
        memory = memory_bytes / (rates.device.bandwidth_bytes_per_second * STREAM_FRACTION)
        if rates.calibrated and k.dtype in rates.cal.get("matmul", {}):
            memory = 0.0  # the measured rate already includes the matmul's own traffic
        return compute, memory, first
    if k.kind == "attention":
        ctx, bh, hd = k.shape
        rate = rates.attention_flops_per_second(k.impl, rates.matmul_dtype(k.dtype), ctx, hd, k.direction)
        if rate is not None:
            return k.flops / rate, 0.0, first
        # no calibration: the FLOPs actually done (causal half for SDPA, 2.5× backward) at the attention
        # efficiency of the matmul peak; eager: its score matmuls at the matmul rate and its T² traffic
        peak = rates.device.matmul_flops_per_second(rates.matmul_dtype(k.dtype))
        if k.impl == "sdpa":
            done = k.flops * CAUSAL_FRACTION * (FLASH_BACKWARD_RATIO / 2 if k.direction == "backward" else 1.0)
            return done / (peak * ATTENTION_EFFICIENCY), memory_bytes / rates.elementwise_bytes_per_second(
                k.dtype, k.write_bytes), first
        return k.flops / peak, memory_bytes / rates.elementwise_bytes_per_second(k.dtype, memory_bytes), first
    if k.kind == "module":
        measured = rates.module_seconds(k.op, k.dtype, k.elements, k.direction)
        if measured is not None:
            return measured, 0.0, first
        per_pass = k.write_bytes / max(1, len(k.fresh)) if k.fresh else k.read_bytes
        memory = memory_bytes / rates.elementwise_bytes_per_second(k.dtype, per_pass)
        compute = k.exp_elements / rates.transcendental_elements_per_second("silu", k.dtype) if k.exp_elements \
            else 0.0
        return compute, memory, first
    if k.kind == "transcendental":
        memory = memory_bytes / rates.elementwise_bytes_per_second(k.dtype, k.write_bytes)
        compute = k.elements / rates.transcendental_elements_per_second(k.op, k.dtype)
        return compute, memory, first
    if k.kind == "optimizer":  # step_time replaces this with the calibrated cost when there is one
        return 0.0, memory_bytes / rates.elementwise_bytes_per_second("fp32", 1 << 30), first
    if k.kind == "h2d":
        if rates.family == "cpu":
            return 0.0, memory_bytes / rates.elementwise_bytes_per_second("fp32", memory_bytes), 0.0
        return 0.0, memory_bytes / H2D_BYTES_PER_SECOND, 0.0
    return 0.0, memory_bytes / rates.elementwise_bytes_per_second(k.dtype, k.write_bytes or k.read_bytes), first


@dataclass(frozen=True)
class TimeTerm:
    seconds: float
    bound: str  # compute | memory | launch | communication (none for a term that takes no time)
    flops: float = 0.0
    bytes: float = 0.0
    compute_seconds: float = 0.0  # of its kernels, the time of those bound by compute
    memory_seconds: float = 0.0  # ... by memory (first touch included)

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "bound": self.bound, "flops": self.flops, "bytes": self.bytes,
                "compute_seconds": self.compute_seconds, "memory_seconds": self.memory_seconds}


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per step by term, and what follows from them."""

    terms: dict[str, TimeTerm]
    flops_per_step: float  # all FLOPs executed, recomputation included
    model_flops_per_step: float  # what MFU counts
    step_seconds: float
    tokens_per_second: float
    mfu: float  # model FLOPs per second over the device's dense peak for the compute dtype
    epoch_seconds: float | None
    rate_source: str = ""  # "calibrated (...)" or "profile peak × achievable fraction"
    notes: list[str] = field(default_factory=list)
    matmul_flops_per_second: float = 0.0  # the achievable (calibrated or peak × achievable) large-matmul rate
    dispatches: int = 0  # aten ops dispatched per step (forward, backward, recompute)
    fusible_seconds: float = 0.0  # of step_seconds, what torch.compile fuses (elementwise, loss, dispatch)
    compile_seconds: float = 0.0  # torch.compile's one-off (in epoch_seconds, not step_seconds); 0 when eager

    @property
    def mfu_achievable(self) -> float:
        """Model FLOPs per second over the achievable matmul rate (the calibrated peak when calibrated)."""
        return self.model_flops_per_step / self.step_seconds / self.matmul_flops_per_second
    communication: object = None  # memplan.comm.Communication of a data-parallel step (world_size > 1)

    def to_json(self) -> dict:
        return {
            "flops_per_step": self.flops_per_step,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "epoch_seconds": self.epoch_seconds,
            "breakdown": {k: t.to_json() for k, t in self.terms.items()},
            "model_flops_per_step": self.model_flops_per_step,
            "mfu_achievable": self.mfu_achievable,
            "rate_source": self.rate_source,
            "notes": list(self.notes),
            "fusible_seconds": self.fusible_seconds,
            "compile_seconds": self.compile_seconds,
            **({"communication": self.communication.to_json()} if self.communication is not None else {}),
        }


TERMS = ("forward", "backward", "recompute", "attention", "loss", "optimizer", "data", "communication", "launch",
         "contention")


def contention_seconds(busy_seconds: float, device: Device) -> float:
    """The time other processes hold the core during a step: busy × (1/share − 1), where share is the
    CPU time / wall time a one-thread calibration by CPU time got (``calibrated.cpu_share``; a CPU only).
    Such a calibration's kernel rates are an idle core's; a sustained step gets only that share of it."""
    share = device.calibrated.get("cpu_share") if device.family == "cpu" else None
    if not share or not 0 < share < 1:
        return 0.0
    return busy_seconds * (1.0 / share - 1.0)


def compile_reference(device: Device) -> tuple[ModelSpec, TrainSetup, dict] | None:
    """The reference step ``memplan calibrate --compile`` timed (``[calibrated] compile_reference``: its shape and
    its measured eager_seconds, compiled_seconds, compile_seconds), or None when the profile has none."""
    ref = device.calibrated.get("compile_reference")
    if not isinstance(ref, dict):
        return None
    try:
        spec = ModelSpec(arch="llama", layers=int(ref["layers"]), hidden=int(ref["hidden"]), heads=int(ref["heads"]),
                         kv_heads=int(ref["heads"]), ffn=int(ref["ffn"]), vocab=int(ref["vocab"]), tied=True)
        setup = TrainSetup(ctx=int(ref["ctx"]), micro_batch=int(ref["micro_batch"]), precision="fp32",
                           attention="sdpa", optimizer="adamw")
        measured = {k: float(ref[k]) for k in ("eager_seconds", "compiled_seconds", "compile_seconds")}
    except (KeyError, TypeError, ValueError):
        return None
    if not (measured["eager_seconds"] > 0 and measured["compiled_seconds"] > 0 and measured["compile_seconds"] >= 0):
        return None
    return spec, setup, measured


def compile_fusion(device: Device) -> float | None:
    """The speedup torch.compile gives the fusible work on ``device``: f / (f − saved), where the reference
    step's measured eager seconds E were saved ``E − compiled`` by compiling, and f = E × (its predicted fusible
    seconds / its predicted busy seconds) is the fusible part of E. Bounded by COMPILE_FUSION_BOUNDS (a compile
    that saved more than the fusible work is taken as the upper bound). None without a calibrated reference."""
    found = compile_reference(device)
    if found is None:
        return None
    spec, setup, m = found
    eager = step_time(spec, setup, device)  # (not compiled: no recursion)
    busy = eager.step_seconds - eager.terms["contention"].seconds
    fusible = m["eager_seconds"] * eager.fusible_seconds / busy if busy > 0 else 0.0
    if fusible <= 0:
        return None
    saved = m["eager_seconds"] - m["compiled_seconds"]
    low, high = COMPILE_FUSION_BOUNDS
    if saved >= fusible * (1 - 1 / high):
        return high
    return min(high, max(low, fusible / (fusible - saved)))


def compiled_graph_ops(spec: ModelSpec, setup: TrainSetup, repeat_kv: bool = False) -> int:
    """Ops of the graph ``torch.compile`` builds of the trainer's model (trainer/loop.py compiles the whole model):
    L · layer_dispatches + base_dispatches, one micro-batch's forward and backward (recomputation included under
    checkpointing), counted as the eager step dispatches them. The graph is compiled once and run by every
    micro-batch, so ``grad_accum`` does not multiply it; the loss and the optimizer stay eager, but the count keeps
    them (``base_dispatches``), as calibration counts its own model, so the per-op cost absorbs them alike."""
    return spec.layers * layer_dispatches(spec, setup, repeat_kv) + base_dispatches(spec, setup)


def compile_cost(device: Device) -> tuple[float, float, str]:
    """(fixed seconds, seconds per op, where they come from) of torch.compile's one-off on ``device``.

    - ``[calibrated] compile_cost`` (``memplan calibrate --compile``, trainer/calibrate.py ``measure_compile_cost``):
      this machine's fixed seconds and seconds per op;
    - else a ``compile_reference`` from an older calibration: the default seconds per op, and the fixed part
      that makes the reference's measured compile time come out (its compile time − ``compile_graph_seconds``);
    - else DEFAULT_COMPILE_FIXED_SECONDS and DEFAULT_COMPILE_SECONDS_PER_OP (this repo's build machine)."""
    cost = device.calibrated.get("compile_cost")
    if isinstance(cost, dict):
        fixed, per_op = cost.get("fixed_seconds"), cost.get("seconds_per_op")
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in (fixed, per_op)):
            return float(fixed), float(per_op), "calibrated"
    found = compile_reference(device)
    if found is not None:
        ref, setup, m = found
        per_op = DEFAULT_COMPILE_SECONDS_PER_OP
        graph = compile_graph_seconds(compiled_graph_ops(ref, setup), per_op, trainer_recompiles(ref, setup))
        return max(0.0, m["compile_seconds"] - graph), per_op, "calibrated reference"
    return DEFAULT_COMPILE_FIXED_SECONDS, DEFAULT_COMPILE_SECONDS_PER_OP, "default"


def compile_graph_seconds(ops: int, per_op: float, recompiles: int = 0) -> float:
    """The part that grows with the graph: (1 + recompiles) · ops · c, where c is the seconds per op (dynamo's
    trace, AOTAutograd's joint graph and partition, inductor's lowering, scheduling and code of every node); a
    recompile (a new input shape or grad mode) traces and lowers the whole graph again."""
    return (1 + recompiles) * ops * per_op


def trainer_recompiles(spec: ModelSpec, setup: TrainSetup) -> int:
    """Recompiles the trainer triggers after its first step: 0, for every model memplan's trainer builds. Its graph
    has one set of guards that later steps pass: every micro-batch has one shape (the loader yields full
    (micro_batch, ctx) windows), gradient accumulation reruns the same graph, evaluation runs the uncompiled model
    (trainer/loop.py's ``Evaluation`` gets ``self.model``, not the compiled ``step_model``), and a rotary model's
    cos and sin tables are computed in the compiled graph (``Transformer.rope``), not registered on the module by
    the first forward, which failed dynamo's guard ``not hasattr(self, 'rope_cos')`` at the second step and
    compiled the whole graph again (``TORCH_LOGS=recompiles`` showed it; tests/runs/test_compile_recompiles.py
    checks there is none now). ``compile_seconds`` takes a count that is not zero (a path that does recompile:
    a new input shape or grad mode) as ``recompiles``."""
    return 0


def compile_seconds(spec: ModelSpec, device: Device, setup: TrainSetup | None = None,
                    recompiles: int | None = None) -> float:
    """torch.compile's one-off for this model: F + (1 + recompiles) · ops · c (``compile_graph_seconds``), F the
    part that does not grow with the graph (dynamo's and inductor's first use in the process, their compile workers,
    the C++ / Triton builds of the graph's distinct kernels, which repeat block after block so their number does not
    grow with the layers), with ops = ``compiled_graph_ops`` of ``setup`` (default: fp32, SDPA, no
    checkpointing), F and c from ``compile_cost`` and the recompiles the trainer triggers (``trainer_recompiles``).
    A profile whose ``[calibrated]`` gives ``compile_seconds`` alone, without a reference or a compile_cost, gets
    that figure as is. Measured against benchmarks/compile_time.py (cold inductor cache, as a run's first compile)."""
    setup = setup or TrainSetup(ctx=256, micro_batch=1, precision="fp32", attention="sdpa")
    recompiles = trainer_recompiles(spec, setup) if recompiles is None else recompiles
    value = device.calibrated.get("compile_seconds")
    if ("compile_cost" not in device.calibrated and compile_reference(device) is None
            and isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
        return float(value)
    fixed, per_op, _ = compile_cost(device)
    ops = compiled_graph_ops(spec, compute_setup(setup))
    return fixed + compile_graph_seconds(ops, per_op, recompiles)


def compile_seconds_words(spec: ModelSpec, device: Device, setup: TrainSetup) -> str:
    """Where ``compile_seconds`` comes from, in a few words: "25 s + 1,220 ops × 5.0 ms, calibrated"."""
    fixed, per_op, source = compile_cost(device)
    ops = compiled_graph_ops(spec, compute_setup(setup))
    recompiles = trainer_recompiles(spec, setup)
    if abs(fixed + compile_graph_seconds(ops, per_op, recompiles) - compile_seconds(spec, device, setup)) > 1e-9:
        return "the profile's calibrated compile_seconds"
    graphs = f" × {1 + recompiles} compiles" if recompiles else ""
    return f"{fixed:.0f} s + {ops:,} ops{graphs} × {per_op * 1e3:.1f} ms, {source}"


def step_time(spec: ModelSpec, setup: TrainSetup, device: Device, epoch_tokens: int | None = None) -> TimeBreakdown:
    """Predicted seconds per optimizer step on ``device`` (one process), by term. ``epoch_seconds`` adds a
    compiled setup's one-off ``compile_seconds`` to the epoch's steps."""
    rates = rates_for(device)
    fusion = compile_fusion(device) if setup.compile else None
    fuse = fusion or 1.0  # the fusible kernels' and dispatches' speedup under torch.compile
    fusible = 0.0
    acc: dict[str, list[float]] = {t: [0.0, 0.0, 0.0, 0.0] for t in TERMS}  # compute, memory, flops, bytes
    repeat_kv = sdpa_gqa_repeats(spec, setup, device.flash_attention, device.family)
    kernels = step_kernels(spec, setup, repeat_kv, COLLECTIVES_OF_FAMILY[device.family])
    device_seconds = 0.0
    for k in kernels:
        compute, memory, first = kernel_seconds(k, rates)
        if k.kind == "optimizer":
            measured = rates.optimizer_seconds(setup.optimizer)
            if measured is not None:  # clip + step + zero_grad, measured together
                compute = 0.0
                memory = 0.0 if k.name == "clip_grad_norm_" else \
                    measured[0] * optimizer_params(spec, setup) + measured[1] * optimizer_tensors(spec, setup)
            elif k.name != "clip_grad_norm_":
                memory += optimizer_dispatches(spec, setup) * rates.launch_seconds()
        slot = acc[k.term]
        if k.kind in FUSIBLE_KINDS or k.term == "loss":
            compute, memory, first = compute / fuse, memory / fuse, first / fuse
        seconds = max(compute, memory)
        if compute >= memory:
            slot[0] += k.calls * seconds
        else:
            slot[1] += k.calls * seconds
        slot[1] += k.calls * first
        slot[2] += k.calls * k.flops
        slot[3] += k.calls * (k.read_bytes + k.write_bytes)
        device_seconds += k.calls * (seconds + first)
        if k.kind in FUSIBLE_KINDS or k.term == "loss":
            fusible += k.calls * (seconds + first)
    communication = None
    if setup.world_size > 1 and setup.sharding != "none":  # what the compute does not hide (memplan.comm)
        from memplan.comm import communication as step_communication

        def busy(*names: str) -> float:
            return sum(acc[n][0] + acc[n][1] for n in names)

        communication = step_communication(spec, setup, device, forward_seconds=busy("forward"),
                                           backward_seconds=busy("backward", "recompute"))
        acc["communication"][1] = communication.exposed_seconds
    dispatches = step_dispatches(spec, compute_setup(setup), repeat_kv) + DATA_DISPATCHES_PER_MICRO_BATCH * setup.grad_accum
    # calibrated kernel times (linears, attention, modules) include their own dispatches; static ones do not
    timed = sum(k.calls * k.dispatches for k in kernels if rates.includes_dispatch(k))
    host = max(0, dispatches - timed) * rates.launch_seconds() / fuse
    notes: list[str] = []
    if rates.family == "cpu":
        launch = host  # the CPU dispatches and computes in turn
    else:
        launch = max(0.0, host - device_seconds)  # the host runs ahead; only what it adds beyond the device
        if launch > 0:
            notes.append("launch-bound: the host dispatches more slowly than the device computes")
    terms: dict[str, TimeTerm] = {}
    for name in TERMS:
        c, m, flops, nbytes = acc[name]
        if name == "launch":
            terms[name] = TimeTerm(launch, "launch")
            continue
        if name == "contention":
            busy = sum(t.seconds for t in terms.values())
            waited = contention_seconds(busy, device)
            terms[name] = TimeTerm(waited, "contention" if waited else "none")
            continue
        bound = "none" if c + m == 0 else "compute" if c >= m else "memory"
        terms[name] = TimeTerm(c + m, bound, flops, nbytes, c, m)
    seconds = sum(t.seconds for t in terms.values())
    n_tokens = step_tokens(setup) * setup.world_size
    dtype = rates.matmul_dtype(setup.compute_dtype)
    if not device.supports(dtype) and dtype != "tf32" and dtype not in device.peak_tflops:
        dtype = "fp32"
    peak = device.peak_tflops.get(dtype, device.peak_tflops["fp32"]) * 1e12
    flops = matmul_flops(spec, setup) + attention_flops(spec, setup) + recompute_flops(spec, setup)
    mflops = model_flops(spec, setup)
    tps = n_tokens / seconds
    if rates.matmul_dtype(setup.compute_dtype) != setup.compute_dtype:
        notes.append(f"{device.name} has no fast native {setup.compute_dtype}; the time below uses its fp32 rate "
                     "(see `memplan autotune` for the precision it runs best)")
    one_off = compile_seconds(spec, device, setup) if setup.compile else 0.0
    if setup.compile and fusion is not None:
        notes.append(f"torch.compile modelled from the calibrated reference step: elementwise kernels, the loss and "
                     f"dispatch at 1/{fusion:.2f} of their eager time; compiling takes ~{one_off:.0f} s once "
                     f"({compile_seconds_words(spec, device, setup)}; in epoch_seconds, not in the step)")
    elif setup.compile:
        notes.append("torch.compile is not modelled: the prediction is for eager PyTorch (compile fuses elementwise "
                     "kernels and is usually faster; `memplan calibrate --compile` measures it); compiling takes "
                     f"~{one_off:.0f} s once ({compile_seconds_words(spec, device, setup)}; in epoch_seconds)")
    measured = [d for d in (setup.compute_dtype,) if d in device.calibrated.get("matmul", {})]
    source = (f"calibrated {str(device.calibrated.get('date', ''))[:10]}, "
              f"{device.calibrated.get('threads', '?')} thread(s)" if rates.calibrated and measured else
              "profile peak × achievable fraction")
    return TimeBreakdown(
        terms=terms, flops_per_step=flops, model_flops_per_step=mflops, step_seconds=seconds,
        tokens_per_second=tps, mfu=mflops / seconds / peak,
        epoch_seconds=(epoch_tokens / tps + one_off) if epoch_tokens else None, rate_source=source, notes=notes,
        matmul_flops_per_second=rates.matmul_flops_per_second(setup.compute_dtype),
        dispatches=dispatches,
        communication=communication,
        fusible_seconds=fusible + launch,
        compile_seconds=one_off,
    )
