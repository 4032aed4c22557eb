"""One training step, defined once: the trainer's loop, ``validate``, ``trace`` and ``autotune --verify`` all run this.

A step is: ``grad_accum`` micro-batches of forward, fp32 cross-entropy and backward (loss
scaled by 1/grad_accum), gradient clipping, the optimizer step, then ``zero_grad(set_to_none=True)``
(under DDP the gradients are views into its buckets, zeroed in place). Under DDP or FSDP2
(``trainer/distributed.py``) the same step runs in every rank on its share of the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memplan.errors import InputError
from memplan.setup import TrainSetup
from trainer.model import lm_loss

SGD_MOMENTUM = 0.9
NO_DECAY_DIMS = 1  # parameters with this many dims (norms, biases) get no weight decay


def param_dtype(precision: str) -> torch.dtype:
    """Storage dtype of weights: bf16 for pure bf16, else fp32 (master weights under mixed precision)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)


def autocast(precision: str, device_type: str):
    """The autocast context of a precision (a no-op for fp32, tf32 and pure bf16)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def set_matmul_precision(precision: str) -> None:
    """tf32 enables TF32 tensor-core matmuls; everything else asks for full fp32 matmuls."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and the embedding), none on norms and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() <= NO_DECAY_DIMS else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(model: torch.nn.Module, name: str, lr: float = 3e-4, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """adamw (foreach), adamw-fused, sgd (momentum 0.9, foreach) or adamw8bit (bitsandbytes)."""
    groups = param_groups(model, weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=SGD_MOMENTUM, foreach=True)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise InputError("--optimizer adamw8bit needs the bitsandbytes package (pip install bitsandbytes); "
                             "accepted without it: adamw, adamw-fused, sgd") from None
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
    raise InputError(f"--optimizer: unknown {name!r} (accepted: adamw, adamw-fused, sgd, adamw8bit)")


def _distributed(model: torch.nn.Module):
    """(sync context of a micro-batch, whether autocast casts, whether zero_grad frees the
    gradients) for the model as wrapped (trainer/distributed.py). DDP skips the all-reduce of
    every micro-batch but a step's last (``no_sync``) and keeps its gradients, views into its
    buckets, zeroed in place rather than freed; FSDP2's MixedPrecisionPolicy casts the parameters
    itself, so autocast stays off under it. A model outside a process group: neither."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from trainer.wrapping import is_ddp, is_fsdp, no_sync

        return no_sync, not is_fsdp(model), not is_ddp(model)
    return (lambda model, last: contextlib.nullcontext()), True, True


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the micro-batches (0-dim, on the device)
    grad_norm: torch.Tensor  # total gradient norm before clipping
    skipped: bool  # the update was skipped (non-finite loss or gradients)


def next_batches(stream, n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The next ``n`` micro-batches (inputs, targets) of ``stream`` on ``device`` (to a GPU through pinned
    memory, without waiting for the copy): one optimizer step's with ``n`` the accumulation steps."""
    out = []
    for x, y in (next(stream) for _ in range(n)):
        if device.type == "cuda":
            out.append((x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)))
        else:
            out.append((x.to(device), y.to(device)))
    return out


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches, setup: TrainSetup,
               device_type: str, scaler=None, clip: float | None = 1.0, check_finite: bool = True,
               before_forward: Callable[[int], None] | None = None,
               after_forward: Callable[[int], None] | None = None) -> StepResult:
    """Run ``len(micro_batches)`` forward/backward passes and one optimizer step.

    ``micro_batches`` is a list of (inputs, targets), each (micro_batch, ctx) int64. With
    ``check_finite`` (one device sync) a non-finite loss or gradient skips the update; the
    FakeTensor trace turns it off, since fake tensors have no values. ``before_forward(i)`` is
    called before micro-batch i's forward (MemTracker resets its per-module stats there), and
    ``after_forward(i)`` once its loss exists, before its backward (validate reads memory there).
    """
    total = torch.zeros((), device=next(model.parameters()).device)
    n = len(micro_batches)
    sync, casts, set_to_none = _distributed(model)
    for i, (x, y) in enumerate(micro_batches):
        if before_forward is not None:
            before_forward(i)
        with sync(model, i == n - 1):
            with autocast(setup.precision if casts else "fp32", device_type):
                logits = model(x)
            loss = lm_loss(logits, y) / n
            del logits
            if after_forward is not None:
                after_forward(i)
            total += loss.detach()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True) if clip
                 else torch.zeros(()))
    finite = not check_finite or (bool(torch.isfinite(total)) and bool(torch.isfinite(grad_norm)))
    if scaler is not None:
        scaler.step(optimizer)  # skips the update itself when it found inf/nan gradients
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return StepResult(loss=total, grad_norm=grad_norm, skipped=not finite)
