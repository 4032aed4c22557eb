"""What ``memplan estimate`` suggests when no micro-batch fits: each lever not already pulled, re-estimated.

A suggestion must change something: a lever already at its lightest setting (checkpointing full
when it is already full, bf16 when the setup is already pure bf16) is not offered. Each lever is
pulled alone, the rest of the setup held, at micro-batch 1 (the lightest); its predicted peak says
what it gives, and whether that fits. ``memplan autotune`` combines them.

Each lever is walked on the stack whose step is estimated (``memplan estimate --stack``: the same stack object's
hooks), and only a change that stack's code takes is offered: its checkpointings, precisions, optimizers and
shardings (the stack's attributes), and a setup its checks accept (``Stack.check_walked``, ``check_lora_targets``,
``check_setup``).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import InputError
from memplan.estimate import max_micro_batch, memory_on
from memplan.hardware import Device
from memplan.memory.stacks import MEMPLAN, Stack
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

# Memory rank of each precision: fp32 master weights and fp32 activations (0), fp32 master weights
# with 16-bit activations (1), 16-bit weights, gradients, states and activations (2).
PRECISION_WEIGHT = {"fp32": 0, "tf32": 0, "bf16-mixed": 1, "fp16-mixed": 1, "bf16": 2}
PRECISION_DTYPE = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}  # what must run natively
CTX_STEP = 64  # a shorter context is suggested as a multiple of this
MAX_DEVICES = 1024  # the most devices the FSDP lever considers
LORA_RANK = 8  # the LoRA lever's rank (adapters on every block matrix)


@dataclass(frozen=True)
class Lever:
    """One change to the setup or model, and what it gives at micro-batch 1."""

    change: str  # the flags that pull it, e.g. "--checkpointing full"
    what: str  # in words, e.g. "recompute each block in backward"
    peak_reserved: int  # predicted peak at micro-batch 1 with this change alone
    fits: bool  # peak_reserved ≤ the device's usable memory
    max_micro_batch: int  # with this change, the largest micro-batch that fits (0: none)

    def to_json(self) -> dict:
        return {"change": self.change, "what": self.what, "peak_reserved": self.peak_reserved, "fits": self.fits,
                "max_micro_batch": self.max_micro_batch}


def _largest(fits, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n), given fits is monotone (true then false); lo - 1 if none."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _smallest(fits, lo: int, hi: int) -> int | None:
    """The smallest n in [lo, hi] with fits(n), given fits is monotone (false then true); None if none."""
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def _takes(stack: Stack, spec: ModelSpec, setup: TrainSetup) -> bool:
    """Whether ``stack``'s code runs ``setup`` for ``spec``: what it has (its attributes) and its checks."""
    if (setup.checkpointing not in stack.checkpointings or setup.precision not in stack.precisions
            or setup.optimizer not in stack.optimizers or setup.sharding not in stack.shardings):
        return False
    try:
        stack.check_walked(setup)
        stack.check_lora_targets(spec, setup)
        stack.check_setup(spec, setup)
    except InputError:
        return False
    return True


def levers(spec: ModelSpec, setup: TrainSetup, device: Device, stack: Stack = MEMPLAN) -> list[Lever]:
    """Every lever not already pulled, each alone at micro-batch 1, lightest first: checkpointing,
    lower precision, an 8-bit optimizer, a shorter context, FSDP over (more) devices, fewer layers,
    LoRA. A lever that does not lower the peak is left out, and so is one ``stack``'s code does not take;
    each is walked on ``stack``."""
    usable = device.usable_bytes
    base = setup.replace(micro_batch=1)
    base_peak = memory_on(spec, base, device, stack).peak_reserved
    out: list[Lever] = []

    def add(change: str, what: str, s: TrainSetup, model: ModelSpec = spec) -> None:
        if not _takes(stack, model, s):
            return
        peak = memory_on(model, s, device, stack).peak_reserved
        if peak < base_peak:
            out.append(Lever(change, what, peak, peak <= usable, max_micro_batch(model, s, device, stack=stack)))

    order = ("none", "selective", "full")
    for level in order[order.index(setup.checkpointing) + 1:]:
        add(f"--checkpointing {level}", "recompute " + ("the cheap ops" if level == "selective" else "each block")
            + " in backward", base.replace(checkpointing=level))
    for precision, weight in PRECISION_WEIGHT.items():
        if weight > PRECISION_WEIGHT[setup.precision] and device.supports(PRECISION_DTYPE[precision]):
            add(f"--precision {precision}", "16-bit activations" + (", weights and states" if precision == "bf16"
                                                                     else ""), base.replace(precision=precision))
    if setup.optimizer in ("adamw", "adamw-fused") and setup.sharding != "fsdp":
        add("--optimizer adamw8bit", "8-bit AdamW states (bitsandbytes)", base.replace(optimizer="adamw8bit"))
    if setup.ctx > 1:
        step = CTX_STEP if setup.ctx > CTX_STEP else 1
        n = _largest(lambda k: memory_on(spec, base.replace(ctx=k * step), device, stack).peak_reserved <= usable,
                     1, (setup.ctx - 1) // step)
        if n >= 1:
            add(f"--ctx {n * step}", "the longest shorter context that fits", base.replace(ctx=n * step))
    fsdp = base if base.optimizer != "adamw8bit" else base.replace(optimizer="adamw-fused")
    first = setup.world_size + 1 if setup.sharding == "fsdp" else max(2, setup.world_size)
    if first <= MAX_DEVICES and "fsdp" in stack.shardings:
        k = _smallest(lambda w: memory_on(spec, fsdp.replace(world_size=w, sharding="fsdp"),
                                          device, stack).peak_reserved <= usable, first, MAX_DEVICES)
        w = k if k is not None else MAX_DEVICES
        add(f"--world-size {w} --sharding fsdp", f"shard weights, gradients and states over {w} devices"
            + ("" if k is not None else " (the most considered; fewer do not fit either)"),
            fsdp.replace(world_size=w, sharding="fsdp"))
    if spec.layers > 1:
        n = _largest(lambda k: memory_on(spec.replace(layers=k), base, device, stack).peak_reserved <= usable,
                     1, spec.layers - 1)
        layers = max(n, 1)
        small = spec.replace(layers=layers)
        add(f"--layers {layers}", f"a smaller model: {layers} of its {spec.layers} layers "
            f"({small.params:,} parameters)", base, small)
    if not setup.lora_rank:
        add(f"--lora-rank {LORA_RANK}", "finetuning only: train rank-8 adapters, the weights frozen",
            base.replace(lora_rank=LORA_RANK))
    out.sort(key=lambda lever: (not lever.fits, lever.peak_reserved))
    return out

