"""Time of a training step, term by term: FLOPs and bytes moved, each over the device's rate.

Each term is a small pure function returning FLOPs or bytes for one optimizer step (all
micro-batches). ``step_time`` turns them into seconds with a roofline per term: a term takes
the longer of its compute time (FLOPs over the achievable matmul rate) and its memory time
(bytes over the memory bandwidth), and the terms add up (a training step on one device runs its
kernels one after another).

Rates come from the device profile: ``Device.matmul_flops_per_second(dtype)`` (the calibrated
rate when ``memplan calibrate`` measured one, else peak × achievable fraction) and the
bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.hardware import Device
from memplan.memory import act_bytes, layer_activation_terms, tokens
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, TrainSetup

FORWARD_FLOPS_PER_PARAM_TOKEN = 2  # one multiply-add per weight per token
BACKWARD_FLOPS_PER_PARAM_TOKEN = 4  # input gradient and weight gradient
CAUSAL_FRACTION = 0.5  # fused causal attention skips the masked half of the scores
FLASH_BACKWARD_RATIO = 2.5  # FlashAttention-2: backward does 2.5× the forward's FLOPs (Dao 2023, §3.1)
ELEMENTWISE_PASSES = 4  # each saved activation byte is written and read in forward, and twice in backward
CE_PASSES = 6  # cross-entropy over (n, V): fp32 cast, log-softmax, its read in nll, and three in backward
ADAMW_BYTES_PER_PARAM_PASS = 7  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
SGD_BYTES_PER_PARAM_PASS = 5  # read param, grad, momentum; write param, momentum
CLIP_PASSES = 2  # the gradient-norm read and the in-place scale
EAGER_SCORE_PASSES = 8  # T×T tensors: scores written, scaled, masked, softmax read+write; backward 3 more
KERNELS_PER_LAYER = 60  # forward + backward kernel launches of one block (measured with the profiler)
KERNELS_PER_STEP = 40  # embedding, loss, head, clipping and foreach optimizer kernels

DEFAULT_LAUNCH_SECONDS = {"cuda": 6e-6, "rocm": 1e-5, "mps": 2e-5, "cpu": 5e-6}


# ---- FLOPs ---------------------------------------------------------------------------------

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


# ---- bytes moved ---------------------------------------------------------------------------

def elementwise_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """Memory traffic of the non-matmul ops (norms, rotary, activations, residual adds, casts):
    every byte a block saves is written and read in forward and twice in backward; selective
    and full checkpointing recompute the cheap ops once more."""
    per_layer = sum(v for k, v in layer_activation_terms(spec, setup).items()
                    if k not in ("attention", "lowp_weights"))
    passes = ELEMENTWISE_PASSES + (1 if setup.checkpointing != "none" else 0)
    return float(per_layer * spec.layers * passes * setup.grad_accum)


def eager_attention_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """Eager attention's passes over its B·heads·T² tensors (scores, mask, softmax, and their
    gradients). 0 for SDPA, which keeps the scores on chip."""
    if setup.attention != "eager":
        return 0.0
    scores = setup.micro_batch * spec.heads * setup.ctx * setup.ctx * act_bytes(setup)
    passes = EAGER_SCORE_PASSES + (3 if setup.checkpointing != "none" else 0)
    return float(scores * passes * spec.layers * setup.grad_accum)


def loss_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """The fp32 cross-entropy's passes over the (n, V) logits, forward and backward."""
    return float(CE_PASSES * tokens(setup) * spec.vocab * FP32_BYTES * setup.grad_accum)


def optimizer_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """The optimizer step's traffic over every parameter (and the clipping's over every gradient)."""
    per_param = ADAMW_BYTES_PER_PARAM_PASS if setup.optimizer.startswith("adamw") else SGD_BYTES_PER_PARAM_PASS
    state_bytes = 1 if setup.optimizer == "adamw8bit" else setup.param_bytes
    param_bytes = setup.param_bytes * 3  # param and grad read, param written
    return float(spec.params * (param_bytes + (per_param - 3) * state_bytes + CLIP_PASSES * setup.param_bytes))


def kernel_launches(spec: ModelSpec, setup: TrainSetup) -> int:
    """Kernels launched per step; each costs the runtime's launch latency even when tiny."""
    per_micro = KERNELS_PER_LAYER * spec.layers * (1.5 if setup.checkpointing != "none" else 1.0)
    return int(per_micro * setup.grad_accum + KERNELS_PER_STEP)


# ---- the step ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimeTerm:
    seconds: float
    bound: str  # compute | memory | launch | communication
    flops: float = 0.0
    bytes: float = 0.0


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
    rate_source: str = ""  # "calibrated" or "profile peak × achievable"
    notes: list[str] = field(default_factory=list)
    communication: object = None  # memplan.comm.Communication of a data-parallel step (world_size > 1)

    def to_json(self) -> dict:
        return {
            "flops_per_step": self.flops_per_step,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "epoch_seconds": self.epoch_seconds,
            "breakdown": {k: {"seconds": t.seconds, "bound": t.bound} for k, t in self.terms.items()},
            **({"communication": self.communication.to_json()} if self.communication is not None else {}),
        }


def _roofline(flops: float, nbytes: float, flops_per_second: float, bytes_per_second: float) -> TimeTerm:
    compute, memory = flops / flops_per_second, nbytes / bytes_per_second
    return TimeTerm(max(compute, memory), "compute" if compute >= memory else "memory", flops, nbytes)


def step_time(spec: ModelSpec, setup: TrainSetup, device: Device, epoch_tokens: int | None = None) -> TimeBreakdown:
    """Predicted seconds per optimizer step on ``device`` (one process), by term."""
    dtype = setup.compute_dtype
    if not device.supports(dtype) and dtype != "tf32":
        dtype = "fp32"
    rate = device.matmul_flops_per_second(dtype)
    bw = device.bandwidth_bytes_per_second
    launch = device.calibrated.get("launch_overhead_seconds", DEFAULT_LAUNCH_SECONDS[device.family])
    mm = matmul_flops(spec, setup)
    forward_share = FORWARD_FLOPS_PER_PARAM_TOKEN / (FORWARD_FLOPS_PER_PARAM_TOKEN + BACKWARD_FLOPS_PER_PARAM_TOKEN)
    terms = {
        "forward": _roofline(mm * forward_share, 0.0, rate, bw),
        "backward": _roofline(mm * (1 - forward_share), 0.0, rate, bw),
        "recompute": _roofline(recompute_flops(spec, setup), 0.0, rate, bw),
        "attention": _roofline(attention_flops(spec, setup), eager_attention_bytes(spec, setup), rate, bw),
        "elementwise": _roofline(0.0, elementwise_bytes(spec, setup), rate, bw),
        "loss": _roofline(0.0, loss_bytes(spec, setup), rate, bw),
        "optimizer": _roofline(0.0, optimizer_bytes(spec, setup), rate, bw),
        "launch": TimeTerm(kernel_launches(spec, setup) * launch, "launch"),
    }
    communication = None
    if setup.world_size > 1 and setup.sharding != "none":  # what the compute does not hide (memplan.comm)
        from memplan.comm import communication as step_communication

        communication = step_communication(
            spec, setup, device, forward_seconds=terms["forward"].seconds,
            backward_seconds=terms["backward"].seconds + terms["recompute"].seconds)
        terms["communication"] = TimeTerm(communication.exposed_seconds, "communication")
    seconds = sum(t.seconds for t in terms.values())
    n_tokens = step_tokens(setup) * setup.world_size
    peak = device.peak_tflops.get(dtype, device.peak_tflops["fp32"]) * 1e12
    flops = mm + attention_flops(spec, setup) + recompute_flops(spec, setup)
    mflops = model_flops(spec, setup)
    tps = n_tokens / seconds
    return TimeBreakdown(
        terms=terms, flops_per_step=flops, model_flops_per_step=mflops, step_seconds=seconds,
        tokens_per_second=tps, mfu=mflops / seconds / peak,
        epoch_seconds=(epoch_tokens / tps) if epoch_tokens else None,
        rate_source="calibrated" if dtype in device.calibrated.get("matmul_tflops", {}) else
        "profile peak × achievable fraction",
        communication=communication,
    )
