"""The learning-rate schedule of a run, and the cadence (evaluations, checkpoints) fixed with it: arithmetic on
the run's limits and measured times, no torch. ``trainer.loop.Trainer`` owns the clock and the steps; this
module decides what they mean for the learning rate.

A run with a known number of steps (``--max-steps``, ``--tokens``, or one epoch) warms up linearly and then
follows a cosine to ``min_lr_ratio`` of the peak. A run limited only by time (``--max-minutes``) holds the
peak and decays over its last fifth, the decay's length fixed from the step time measured by then
(``Schedule`` kind ``wsd``; ``decayed``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

WARMUP_FRACTION = 0.05  # default warmup: 5% of the steps ...
WARMUP_MAX_STEPS = 100  # ... but at most this many
EVALS_PER_RUN = 5  # default eval (and checkpoint) cadence: this many times over the run ...
EVAL_EVERY_MAX = 1000  # ... but at least every this many steps
EVAL_TIME_SHARE = 0.2  # a time-limited run gives evaluations at most this share of the time
DECAY_SHARE = 0.2  # a time-limited run decays its learning rate over the last fifth of its time
TIME_LIMIT_ALLOWANCE = 0.03  # share of a time budget left for the final eval, checkpoint and report
PROBE_STEPS = 2  # time-limited runs time this many zero-lr steps to estimate their length (warmup, evals)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rate of every step.

    ``cosine`` (a known number of steps): linear warmup to ``peak_lr`` over ``warmup_steps``, then cosine
    decay to ``min_lr`` at ``total_steps`` (Loshchilov & Hutter 2017, without restarts), ``min_lr`` after.

    ``wsd`` (a time limit, where the number of steps is not known in advance): warmup, then ``peak_lr``
    until the last DECAY_SHARE of the time, when the loop fixes ``decay_start`` and ``total_steps`` from
    the step time measured so far (``with_decay``); then the same cosine decay over those steps
    (warmup-stable-decay: Hu et al. 2024, MiniCPM; Hägele et al. 2024 find it matches a cosine of known
    length). Until then ``total_steps`` is an estimate (from timed probe steps), used for the ETA only.
    """

    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    kind: str = "cosine"  # cosine | wsd
    decay_start: int | None = None  # wsd: the last step at peak_lr, once fixed

    def lr(self, step: int) -> float:
        """The learning rate of step ``step`` (1-based)."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        start = self.warmup_steps
        if self.kind == "wsd":
            if self.decay_start is None or step <= self.decay_start:
                return self.peak_lr
            start = self.decay_start
        span = max(1, self.total_steps - start)
        progress = min(1.0, max(0.0, (step - start) / span))
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    @property
    def fixed(self) -> bool:
        """Whether total_steps is final (always for cosine; for wsd once the decay has started)."""
        return self.kind == "cosine" or self.decay_start is not None

    def with_decay(self, last_stable_step: int, decay_steps: int) -> "Schedule":
        """A wsd schedule whose decay runs over the ``decay_steps`` steps after ``last_stable_step``."""
        return dataclasses.replace(self, decay_start=last_stable_step, total_steps=last_stable_step + max(1, decay_steps))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_warmup(total_steps: int) -> int:
    """5% of the steps, at most 100, at least 1 when there are 20 steps or more."""
    return min(WARMUP_MAX_STEPS, int(total_steps * WARMUP_FRACTION))


def default_eval_every(total_steps: int) -> int:
    return max(1, min(EVAL_EVERY_MAX, total_steps // EVALS_PER_RUN))


def limit_ends(config, tokens_per_step: int) -> list[int]:
    """The steps at which ``config``'s step and token limits end a run (none, one or both)."""
    return [n for n in (config.max_steps, math.ceil(config.max_tokens / tokens_per_step)
                        if config.max_tokens is not None else None) if n is not None]


def steps_from_limits(config, tokens_per_step: int) -> int | None:
    """A new run's length from ``--max-steps`` / ``--tokens`` (the nearer; a token limit is at least one
    step), else None (a time limit or one epoch decides it)."""
    candidates = []
    if config.max_steps is not None:
        candidates.append(config.max_steps)
    if config.max_tokens is not None:
        candidates.append(max(1, math.ceil(config.max_tokens / tokens_per_step)))
    return min(candidates) if candidates else None


def new_schedule(config, total: int, kind: str = "cosine") -> Schedule:
    """The schedule of a run of ``total`` steps: ``config.lr`` peak, ``min_lr_ratio`` floor, its warmup
    (``config.warmup_steps``, else ``default_warmup``; never longer than the run)."""
    warmup = config.warmup_steps if config.warmup_steps is not None else default_warmup(total)
    return Schedule(peak_lr=config.lr, min_lr=config.lr * config.min_lr_ratio, warmup_steps=min(warmup, total),
                    total_steps=total, kind=kind)


def cadence(eval_every: int | None, save_every: int | None, total: int) -> tuple[int, int]:
    """(eval_every, save_every) with the defaults filled in for a run of ``total`` steps: evaluations
    ``default_eval_every``, checkpoints with the evaluations (or at that default when evaluations are off)."""
    if eval_every is None:
        eval_every = default_eval_every(total)
    if save_every is None:
        save_every = eval_every or default_eval_every(total)
    return eval_every, save_every


def probed_length(budget_seconds: float, step_times: list[float], eval_seconds: float,
                  eval_every: int | None) -> tuple[int, int | None]:
    """(steps, eval_every) of a time-limited run from timed probe steps (``step_times``: their durations, the
    last the steady one) and one timed evaluation, within ``budget_seconds`` less TIME_LIMIT_ALLOWANCE, the
    probes' own time and a final evaluation.

    With the default cadence (``eval_every`` None) evaluations get at most EVAL_TIME_SHARE of the budget: as many
    of EVALS_PER_RUN as fit (the eval_every returned; 0 means only the final one). With a cadence given, each
    step carries 1/eval_every of an evaluation, and that cadence is returned unchanged."""
    step_seconds = step_times[-1]
    budget = budget_seconds * (1.0 - TIME_LIMIT_ALLOWANCE) - sum(step_times) - eval_seconds  # the final eval
    if eval_every is None:
        evals = max(0, min(EVALS_PER_RUN, int(EVAL_TIME_SHARE * budget / max(eval_seconds, 1e-9))))
        total = max(1, int((budget - evals * eval_seconds) / step_seconds))
        return total, (total // evals if evals and total >= evals else 0)
    return max(1, int(budget / (step_seconds + eval_seconds / eval_every))), eval_every


def probe(step: Callable[[], object], evaluate: Callable[[], object], *, budget_seconds: float,
          eval_every: int | None, after_steps: Callable[[], None] = lambda: None, steps: int = PROBE_STEPS,
          clock: Callable[[], float] = time.perf_counter) -> tuple[int, int | None, float]:
    """(steps, eval_every, eval_seconds) of a time-limited run within ``budget_seconds``: ``steps`` calls of
    ``step`` (a real training step at learning rate 0, returning once the device is done) timed one by one,
    ``after_steps()`` untimed (the caller undoes what they changed: optimizer and scaler state), then one
    ``evaluate()`` timed; the length and cadence from those times (``probed_length``)."""
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    after_steps()
    t0 = clock()
    evaluate()
    eval_seconds = clock() - t0
    total, every = probed_length(budget_seconds, times, eval_seconds, eval_every)
    return total, every, eval_seconds


def first_schedule(config, tokens_per_step: int, *, eval_every: int | None, save_every: int | None,
                   probe: Callable[[], tuple[int, int | None]], epoch_steps: Callable[[], int]
                   ) -> tuple[Schedule, int, int]:
    """(schedule, eval_every, save_every) of a run starting from step 0: its length from ``--max-steps`` /
    ``--tokens`` (cosine), else for ``--max-minutes`` alone from ``probe()`` (wsd: an estimate until the decay
    starts; ``probe`` gives (steps, eval_every), whose cadence is taken when ``config`` sets none), else one
    epoch (``epoch_steps()``); the evaluation and checkpoint cadence with it (``cadence``)."""
    total, kind = steps_from_limits(config, tokens_per_step), "cosine"
    if total is None and config.max_minutes is not None:
        total, probed_every = probe()
        if config.eval_every is None:
            eval_every = probed_every
        kind = "wsd"
    elif total is None:
        total = epoch_steps()
    eval_every, save_every = cadence(eval_every, save_every, total)
    return new_schedule(config, total, kind), eval_every, save_every


def refitted(schedule: Schedule, config, step: int, tokens_per_step: int) -> tuple[Schedule, bool]:
    """A resume whose limits were replaced: (the restored schedule made to end where ``config``'s limits do,
    whether reaching the schedule's end still stops a run with no step or token limit).

    A step or token limit ends a warmup-stable-decay schedule whose decay was not fixed yet with a decay over
    the last DECAY_SHARE of the new length (from ``step`` on at the latest; its warmup, sized for the old
    estimate, cut to end by then); a cosine, or a decay already fixed, stays (past its end the rate is the
    floor). A time limit alone trains until its time is up: the schedule's end no longer stops the run (an
    unfixed decay is fixed by the clock, as in a new run)."""
    ends = limit_ends(config, tokens_per_step)
    if not ends:
        return schedule, False
    if schedule.fixed:
        return schedule, True
    end = min(ends)
    last_stable = max(step, end - max(1, math.ceil(DECAY_SHARE * end)))
    # (a warmup sized for the time limit's estimate ends by the decay at the latest)
    return dataclasses.replace(schedule, warmup_steps=min(schedule.warmup_steps, last_stable)
                               ).with_decay(last_stable, end - last_stable), True


def decayed(schedule: Schedule, *, budget_seconds: float, elapsed: float, step: int, recent: list[float],
            eval_seconds: list[float], eval_every: int | None) -> tuple[Schedule, dict] | None:
    """wsd: once DECAY_SHARE of ``budget_seconds`` (the time limit less TIME_LIMIT_ALLOWANCE) is left, the
    schedule with its decay fixed from the measured step time (the median of ``recent`` step times, plus the
    evaluations' share) and the details the loop logs (decay_steps, total_steps, seconds_left, step_seconds);
    None while it is not time yet (or still warming up, or nothing measured)."""
    if elapsed < budget_seconds * (1.0 - DECAY_SHARE) or not recent or step <= schedule.warmup_steps:
        return None
    per_step = statistics.median(recent)
    if eval_every and eval_seconds:
        per_step += statistics.median(eval_seconds) / eval_every
    final_eval = statistics.median(eval_seconds) if eval_seconds else 0.0
    steps = int((budget_seconds - elapsed - final_eval) / per_step)
    schedule = schedule.with_decay(step, steps)
    return schedule, {"decay_steps": max(1, steps), "total_steps": schedule.total_steps,
                      "seconds_left": budget_seconds - elapsed, "step_seconds": per_step}
