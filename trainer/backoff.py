"""What a run does when a training step runs out of memory in one process: the memory the failed step held
released, the micro-batch halved (``trainer.stopping.halved``: twice the accumulation, the same global batch),
and everything the micro-batch decides made again for it: the plan, its prediction and FLOPs, the training
stream (at the data position the failed step started from: the same windows, in the same order, in smaller
pieces) and the grad scaler (with its state: a step cut short may have left it mid-step). ``trainer.loop.Trainer``
writes the new plan.toml and the event; a distributed run, whose ranks cannot halve one by one, stops instead.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Callable

import torch

from memplan.plan import Plan
from trainer import records
from trainer.stopping import halved


def release_memory(optimizer, device: torch.device) -> None:
    """What the failed step left: its gradients, the garbage it made, the device's cached blocks."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class BackOff:
    """What a run trains with after an out-of-memory step, and the ``oom`` line saying so."""

    plan: Plan
    predicted: object  # memplan.prediction.Prediction of ``plan``
    flops_per_step: float
    stream: object
    scaler: object | None
    event: records.OomEvent


def back_off(step: int, message: str, *, plan: Plan, data_state: dict, new_stream: Callable[[int], object],
             scaler, new_scaler: Callable[[], object], predict: Callable[[Plan], object],
             flops: Callable[[Plan], float], time: float) -> BackOff | None:
    """The run after step ``step`` ran out of memory (``message``: the error's line) with ``plan``: half the
    micro-batch (None at micro-batch 1: nothing smaller to try); ``new_stream(micro_batch)`` restored to
    ``data_state`` (the stream's state before the failed step); ``new_scaler()`` given ``scaler``'s state (None
    without one); ``predict`` / ``flops`` of the new plan; ``time``: the run's training seconds, for the event."""
    old = plan.setup
    new = halved(old)
    if new is None:
        return None
    plan = dataclasses.replace(plan, setup=new)
    predicted = predict(plan)
    stream = new_stream(new.micro_batch)
    stream.load_state_dict(data_state)  # the same windows, in the same order, in smaller pieces
    if scaler is not None:  # a step cut short may have left the scaler mid-step
        state = scaler.state_dict()
        scaler = new_scaler()
        scaler.load_state_dict(state)
    event = records.OomEvent(step=step, time=time, message=message, micro_batch=new.micro_batch,
                             grad_accum=new.grad_accum,
                             previous={"micro_batch": old.micro_batch, "grad_accum": old.grad_accum},
                             predicted=predicted.as_dict())
    return BackOff(plan=plan, predicted=predicted, flops_per_step=flops(plan), stream=stream, scaler=scaler,
                   event=event)
