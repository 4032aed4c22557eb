"""When a run stops, and how it stops when it must: the limits (steps, tokens, time, the schedule's end), a
signal, non-finite losses in a row, memory running out (the micro-batch halved, or advice at 1). Decisions
only: ``trainer.loop.Trainer`` measures, steps and writes; ``Stopping`` says whether to go on, and the
functions here say what a run out of memory trains with next and what the user is told.
"""

from __future__ import annotations

import contextlib
import errno
import math
import signal as signals
import statistics
import time
from typing import Callable

from trainer.schedule import TIME_LIMIT_ALLOWANCE, Schedule
from trainer.verify import is_out_of_memory

ETA_WINDOW = 20  # steps whose median step time predicts the rest


class TrainingStopped(Exception):
    """The run stopped on its own for a reason the user must act on (diverged, no memory left).
    The message is one line; checkpoints and metrics written so far stay."""


class DiskFull(TrainingStopped):
    """A write of the run (a checkpoint, metrics.jsonl, plan.toml, run.json, the report) found the disk
    full. The message is one line naming the file; the unfinished checkpoint is gone, earlier ones stay."""


class RankFailed(TrainingStopped):
    """A rank of a distributed run failed in a part of a checkpoint save, or did not answer within the save's
    timeout (``trainer.distributed.settle``): every rank stops with this one line, naming the rank and the cause,
    instead of waiting in a collective for a rank that will never come."""


def out_of_memory(e: BaseException) -> str | None:
    """The first line of ``e`` (at most 300 characters) when it says the device ran out of memory
    (``trainer.verify.is_out_of_memory``: a GPU's ``torch.OutOfMemoryError``; on a CPU the allocator's
    RuntimeError ``DefaultCPUAllocator: can't allocate memory``, as under ``ulimit -v``, or a MemoryError),
    else None. The loop backs off from either alike. (``is_out_of_memory`` is imported with this module: an
    import while memory is exhausted fails with a MemoryError of its own.)"""
    if not is_out_of_memory(e):
        return None
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def memory_failure(e: BaseException) -> str | None:
    """``out_of_memory``'s line, or the first line of a failure to map memory (a shared library that cannot be
    mapped under ``ulimit -v``, an ENOMEM), else None."""
    message = out_of_memory(e)
    if message is not None:
        return message
    text = str(e).strip()
    if (isinstance(e, ImportError) and "failed to map segment" in text) or (
            isinstance(e, OSError) and e.errno == errno.ENOMEM):
        return text.splitlines()[0][:300]
    return None


def eta_seconds(config, schedule: Schedule, step: int, tokens: int, tokens_per_step: int, recent: list[float],
                elapsed: float) -> float:
    """Seconds left: steps to the nearest step or token limit (else the schedule's end) at the median
    ``recent`` step time, or the time left when a time limit comes first. A time-limited run whose length is
    not fixed yet (wsd before its decay) runs until its time is up: its ETA is the time left (its
    ``total_steps`` is only the probe steps' estimate, which the run may pass)."""
    steps_left = schedule.total_steps - step
    if config.max_steps is not None:
        steps_left = config.max_steps - step
    if config.max_tokens is not None:
        steps_left = min(steps_left, math.ceil((config.max_tokens - tokens) / tokens_per_step))
    eta = max(0, steps_left) * statistics.median(recent)
    if config.max_minutes is not None:
        left = max(0.0, config.max_minutes * 60.0 - elapsed)
        eta = min(eta, left) if schedule.fixed else left
    return eta


class Stopping:
    """The stop decisions of one invocation of a run: ``config``'s limits, the clock started at ``started``
    (``time.perf_counter``), the signal received, the non-finite losses in a row.

    ``schedule_ends_run``: whether reaching a fixed schedule's end stops a run with no step or token limit
    (False for a resume given a new time limit alone: ``trainer.schedule.refitted``)."""

    def __init__(self, config, started: float | None = None):
        self.config = config
        self.started = time.perf_counter() if started is None else started
        self.schedule_ends_run = True
        self.stop_signal: int | None = None  # the signal (SIGINT, SIGTERM) that asked the run to stop
        # called with (signum, now) as each signal arrives: now is False for the first (stop after this step),
        # True for a second (stop at once; the KeyboardInterrupt follows the call)
        self.on_signal: Callable[[int, bool], None] | None = None
        self.nonfinite_run = 0  # non-finite losses in a row

    @property
    def elapsed(self) -> float:
        """Wall-clock seconds since this invocation started training (what --max-minutes counts)."""
        return time.perf_counter() - self.started

    @property
    def time_budget(self) -> float | None:
        """Seconds of training a time limit allows, less TIME_LIMIT_ALLOWANCE for the final eval, checkpoint
        and report; None without a time limit."""
        m = self.config.max_minutes
        return None if m is None else m * 60.0 * (1.0 - TIME_LIMIT_ALLOWANCE)

    def signal(self, signum: int) -> bool:
        """Record ``signum`` as the reason to stop; False when one was recorded already (a second Ctrl-C:
        the caller stops at once)."""
        if self.stop_signal is not None:
            return False
        self.stop_signal = int(signum)
        return True

    @contextlib.contextmanager
    def catching_signals(self):
        """Within: SIGINT and SIGTERM recorded as the reason to stop (``signal``: the run finishes its step,
        saves and stops), a second one a ``KeyboardInterrupt`` (stop now); the handlers before are put back
        after. Outside the main thread, where Python takes no handlers, nothing is caught."""
        def handler(signum, frame):
            first = self.signal(signum)
            if self.on_signal is not None:
                self.on_signal(signum, not first)
            if not first:
                raise KeyboardInterrupt

        previous = {s: signals.getsignal(s) for s in (signals.SIGINT, signals.SIGTERM)}
        try:
            for s in previous:
                signals.signal(s, handler)
        except ValueError:  # not the main thread
            previous = {}
        try:
            yield
        finally:
            for s, h in previous.items():
                signals.signal(s, h)

    def reason(self, step: int, tokens: int, schedule: Schedule) -> str | None:
        """Why the run stops before step ``step + 1`` (``tokens`` trained so far), or None to go on:
        interrupted, max_steps, max_tokens, the schedule's end (max_minutes for a time limit, else epoch),
        or the time limit."""
        c = self.config
        if self.stop_signal is not None:
            return "interrupted"
        if c.max_steps is not None and step >= c.max_steps:
            return "max_steps"
        if c.max_tokens is not None and tokens >= c.max_tokens:
            return "max_tokens"
        if c.max_steps is None and c.max_tokens is None and schedule.fixed and self.schedule_ends_run \
                and step >= schedule.total_steps:
            return "max_minutes" if c.max_minutes is not None else "epoch"
        if c.max_minutes is not None and self.elapsed >= self.time_budget:
            return "max_minutes"
        return None

    def reason_in_ranks(self, step: int, tokens: int, schedule: Schedule, *, largest: Callable[[int], int],
                        from_rank0: Callable[[object], object]) -> str | None:
        """``reason`` agreed by the ranks of a distributed run: a signal any rank received stops them all
        (``largest``: the maximum over the ranks, which every rank then has), the clock's verdict is rank 0's
        (``from_rank0``: rank 0's value, in every rank)."""
        signum = largest(self.stop_signal or 0)
        if signum and self.stop_signal is None:
            self.stop_signal = signum
        return from_rank0(self.reason(step, tokens, schedule))

    def planned_steps(self, step: int, schedule: Schedule, tokens_per_step: int) -> int | None:
        """The step this run is planned to end at: its step or token limit (the nearer), else the schedule's
        end. None for a resume given a new time limit alone after its schedule's end (nothing estimates it)."""
        from trainer.schedule import limit_ends

        ends = limit_ends(self.config, tokens_per_step)
        if not ends and not self.schedule_ends_run:
            return None
        return max(step, min(ends) if ends else schedule.total_steps)

    def count_loss(self, loss: float) -> bool:
        """Count a step's loss; True when it is the ``max_nonfinite``-th non-finite one in a row (stop)."""
        self.nonfinite_run = 0 if math.isfinite(loss) else self.nonfinite_run + 1
        return self.nonfinite_run >= self.config.max_nonfinite

    def nonfinite_message(self, step: int, loss: float, last_saved_step: int, precision: str) -> str:
        return (f"step {step}: the loss was not finite ({loss}) for {self.nonfinite_run} steps in a row, "
                f"so the run stopped (updates were skipped; the newest checkpoint is from step "
                f"{max(last_saved_step, 0)}); lower the learning rate (--lr, now {self.config.lr:g}), "
                + ("use bf16-mixed instead of fp16-mixed, " if precision == "fp16-mixed" else "")
                + "or lower --clip, then start again or --resume")


def halved(setup):
    """The setup an out-of-memory step is redone with: half the micro-batch, twice the accumulation (an odd
    micro-batch m goes to its largest divisor d < m, the accumulation times m/d), so the global batch never
    changes; None at micro-batch 1 (nothing smaller to try)."""
    if setup.micro_batch == 1:
        return None
    new_micro = max(d for d in range(1, setup.micro_batch) if setup.micro_batch % d == 0)
    return setup.replace(micro_batch=new_micro, grad_accum=setup.grad_accum * (setup.micro_batch // new_micro))


def out_of_memory_at_one(step: int, message: str) -> str:
    return (f"step {step}: out of memory at micro-batch 1 ({message}); nothing smaller to try: use "
            "--checkpointing full, a shorter --ctx, a smaller model, or let `memplan autotune` plan it")


def out_of_memory_outside_step(step: int, message: str, newest_note: str) -> str:
    return (f"step {step}: out of memory outside a training step ({message}); {newest_note}; free memory (or "
            "raise `ulimit -v`), then continue it with --resume")


def out_of_memory_in_ranks(step: int, rank: int, world_size: int, message: str) -> str:
    return (f"step {step}: out of memory on rank {rank} ({message}); the ranks of a distributed run "
            "cannot shrink their micro-batch one by one: re-plan with `memplan autotune --world-size "
            f"{world_size}` (FSDP shards the model), or use --checkpointing full")
