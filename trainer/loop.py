"""The training loop of ``memplan train``: a plan, a prepared corpus and a run directory in; a trained model,
its measurements and a report out.

A run directory (documented key by key in docs/run-directory.md)::

    RUN/metrics.jsonl   one JSON object per line, append-only across resumes; every line has "kind":
                        "train" (step, loss, tokens_per_second, lr, grad_norm, tokens, step_seconds,
                        time, mfu, memory_bytes, ...), "eval" (step, eval_loss, eval_ppl,
                        eval_loss_by_source, samples, ...) or "event" (event = start | resume | oom |
                        eval_oom | nonfinite | decay | checkpoint | report_failed | stop, with details).
                        Non-finite numbers are written as null (JSON has no NaN). A step can appear twice when a
                        run was killed after logging it and resumed from an earlier checkpoint: the
                        later line is the one that counts (``read_metrics(..., latest=True)``).
    RUN/plan.toml       the plan trained on (rewritten if an out-of-memory step halves the micro-batch)
    RUN/checkpoints/    atomic checkpoints (trainer/checkpoint_format.py)
    RUN/report.html     the run report (memplan/reports/run.py)

Each step is ``trainer.step.train_step``, the step memplan's memory model describes, with the
learning rate of a linear warmup then cosine decay to ``min_lr_ratio`` of the peak; a run limited
only by time (``--max-minutes``) holds the peak and decays over its last fifth, the decay's length
fixed from the step time measured by then (``Schedule``).
Around it the loop handles what long runs on small machines meet:

- out of memory in a step (a GPU's OutOfMemoryError, or on a CPU the allocator's "can't allocate
  memory" RuntimeError or a MemoryError): halve the micro-batch, double the accumulation (the global
  batch and the data order stay the same), log it, redo the step; at micro-batch 1, stop with advice;
- the disk full while writing a checkpoint, metrics.jsonl, plan.toml or the run record: stop with one
  line naming the file (``DiskFull``); the unfinished checkpoint is removed, the earlier ones stay;
- a non-finite loss: the update is skipped; ``max_nonfinite`` in a row stop the run with a message
  naming the step;
- SIGINT / SIGTERM: finish the step, save a checkpoint, write the report, stop;
- resuming: everything that decides the next step (weights, optimizer, grad scaler, schedule,
  data position, RNG states) is restored, so on a CPU the losses after a resume are bit-identical
  to those of an uninterrupted run.

Under torchrun (``memplan train --nproc N``) every process runs this loop on its own device with
DDP or FSDP2 (trainer/distributed.py): each reads its share of every global batch, the loss logged
is the mean over the ranks, the memory the largest; rank 0 alone writes RUN/ and reports. What is
decided by the clock (when a time-limited run decays and stops, a signal) is rank 0's decision,
shared. Checkpoints add the model's and optimizer's shards through torch.distributed.checkpoint
(RUN/checkpoints/step-N/dcp/), so a run resumes at another world size, or in one process, with the
same global batch. An out-of-memory step stops a distributed run (ranks cannot halve their
micro-batch independently).

The trainer owns the loop; what is decided around it lives in units of their own, each testable alone:
``trainer.schedule`` (the learning rate, the evaluation and checkpoint cadence, a time-limited run's probe),
``trainer.stopping`` (limits, signals and the ranks' agreement on them, non-finite losses),
``trainer.backoff`` (a step out of memory: the micro-batch halved, the stream rebuilt where it was),
``trainer.loop_eval`` (held-out loss and samples), ``trainer.checkpoint_policy`` (when to save, keep-N, distributed
saving, a new run's and a resume's checks, restoring), ``trainer.rundir`` (opening the run directory, the run
record, the metrics lines: ``RunLog``), ``trainer.monitor`` (which steps' memory is measured:
``MemorySampler``) and ``trainer.reporting`` (the report, rendered in a process of its own).
What is trained comes as factories (``trainer.task.TrainingTask``: model, batches, evaluation): a prepared
corpus here (``trainer.task.pretraining``), instruction data for ``memplan finetune``
(``trainer.finetune.finetune_task``), the same in one process and in every rank.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memplan.errors import InputError
from memplan.memory.stacks import stack_class
from memplan.hardware import Device
from memplan.plan import Plan
from memplan.run_control import LIMITS, SEED_MAX
from memplan.setup import TrainSetup
from trainer import checkpoint_format as ckpt
from trainer import distributed
from trainer import records, rundir
from trainer.backoff import back_off, release_memory
from trainer.checkpoint_policy import (CheckpointManager, check_new_run, holding_lock, predicted_for, resume_settings,
                                       state_of)
from trainer.compile_guard import EAGER_FALLBACK, compile_errors, step_model_for, warn
from trainer.device import current_rss as _process_rss, keep_heap_resident, torch_device_for, trim_heap as _trim_heap
from trainer.loop_eval import Evaluation, finite_or_none as _finite_or_none
from trainer.model import build_model
from trainer.monitor import MEMORY_SAMPLE_SECONDS, MemoryMonitor, MemorySampler
from trainer.reporting import REPORT_REFRESH_SECONDS, ReportRenderer
from trainer.rundir import REPORT_FILE
from trainer.schedule import Schedule, decayed, first_schedule, probe, refitted
from trainer.step import make_optimizer, next_batches, param_dtype, set_matmul_precision, train_step
from trainer.stopping import (ETA_WINDOW, Stopping, TrainingStopped, eta_seconds, memory_failure, out_of_memory,
                              out_of_memory_at_one, out_of_memory_in_ranks, out_of_memory_outside_step)
from trainer.task import StartingWeights, TrainingTask, pretraining, starting_weights_again

REPEAT_WARN_PASSES = 4.0  # a run planned for more passes than this over its training tokens is warned of it


# =================================================================================================
# Configuration
# =================================================================================================

@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train, beyond the plan's model and setup. Frozen; validates itself."""

    lr: float = 6e-4  # peak learning rate (GPT-3 Small's, Brown et al. 2020, Table 2.1)
    min_lr_ratio: float = 0.1  # cosine decay ends at this share of the peak (Chinchilla, Hoffmann et al. 2022)
    warmup_steps: int | None = None  # None: 5% of the steps, at most 100
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices and embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float | None = 1.0  # gradient-norm clipping; None or 0 turns it off
    max_steps: int | None = None  # stop after this many optimizer steps (counted from the run's start)
    max_tokens: int | None = None  # ... or after this many training tokens
    max_minutes: float | None = None  # ... or after this many minutes of this invocation
    save_every: int | None = None  # steps between checkpoints; None: as eval_every
    eval_every: int | None = None  # steps between evaluations; None: 5 times per run, at least every 1000
    eval_batches: int = 4  # batches of held-out windows per source in an evaluation
    sample_tokens: int = 32  # tokens per generated sample (0: no samples)
    prompts: tuple[str, ...] = ()  # sample prompts; empty: the start of each source's first held-out document
    keep: int = 3  # checkpoints kept
    seed: int = 0  # model initialisation and data order
    max_nonfinite: int = 5  # this many non-finite losses in a row stop the run
    verify_data: bool = True  # check every shard's sha256 before training

    def __post_init__(self):
        def positive(name, allow_none=True):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
                raise InputError(f"--{name.replace('_', '-')}: {v!r} must be a positive number")

        for name in ("lr", "max_steps", "max_tokens", "max_minutes", "save_every", "eval_every", "eval_batches",
                     "keep", "max_nonfinite"):
            positive(name)
        for name in ("max_steps", "max_tokens", "save_every", "eval_every", "eval_batches", "keep", "max_nonfinite",
                     "warmup_steps", "sample_tokens", "seed"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InputError(f"--{name.replace('_', '-')}: {v!r} must be a whole number ≥ 0")
        if not 0 <= self.seed <= SEED_MAX:
            raise InputError(f"--seed: {self.seed} is out of range; accepted: 0 to {SEED_MAX}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise InputError(f"--min-lr-ratio: {self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 <= self.weight_decay < 1.0:
            raise InputError(f"--weight-decay: {self.weight_decay} must be in [0, 1)")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InputError(f"--{name}: {getattr(self, name)} must be in [0, 1)")
        if self.clip is not None and (self.clip < 0 or not math.isfinite(self.clip)):
            raise InputError(f"--clip: {self.clip} must be ≥ 0 (0 turns clipping off)")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prompts"] = list(self.prompts)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if "prompts" in d:
            d["prompts"] = tuple(d["prompts"])
        return cls(**d)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)



# =================================================================================================
# The run
# =================================================================================================

@dataclass
class RunSummary:
    """What a finished (or stopped) run did."""

    run_dir: Path
    step: int
    tokens: int
    stop_reason: str  # max_steps | max_tokens | max_minutes | epoch | interrupted (by SIGINT or SIGTERM)
    train_seconds: float
    last_loss: float | None
    last_eval: records.EvalLine | None
    checkpoint: Path | None
    report: Path | None
    samples: list[dict] = field(default_factory=list)
    first_step: int = 0  # the step this invocation started from (0 for a new run)
    wall_seconds: float = 0.0  # this invocation's training, wall clock (what --max-minutes counts)


def model_flops_per_step(plan: Plan) -> float:
    from memplan.timing import model_flops

    return model_flops(plan.model, plan.setup)


def peak_flops_per_second(profile: Device, setup: TrainSetup) -> float:
    """The device's dense peak for the setup's compute dtype (fp32 where that dtype is not native), as MFU uses."""
    dtype = setup.compute_dtype
    if not profile.supports(dtype) and dtype != "tf32":
        dtype = "fp32"
    return profile.peak_tflops.get(dtype, profile.peak_tflops["fp32"]) * 1e12


def training_settings(config: TrainConfig) -> dict:
    """A plan's [training] table (``memplan.plan.TRAINING_KEYS``) for ``config``; ``schedule`` says which decay
    its limits give (wsd for a run limited by time alone, else cosine)."""
    from memplan.plan import TRAINING_KEYS

    out = {k: getattr(config, k) for k in TRAINING_KEYS if getattr(config, k) is not None}
    time_only = config.max_minutes is not None and config.max_steps is None and config.max_tokens is None
    out["schedule"] = "wsd" if time_only else "cosine"
    return out



class Trainer:
    """One training run. Build it with ``Trainer.start`` (a new run) or ``Trainer.resume``; both check
    everything before anything is written. Then ``run()``.

    What is trained comes as factories (``task``: a ``trainer.task.TrainingTask``; default
    ``trainer.task.pretraining``: the plan's model, seeded or from ``starting``'s weights, on a prepared
    corpus): the model, the batches, the held-out loss and the prompts, the same in one process and in every
    rank. The trainer owns the loop and composes the units that decide around it: the learning rate
    (``trainer.schedule``), when to stop (``trainer.stopping.Stopping``), how to back off
    (``trainer.backoff``), evaluations (``trainer.loop_eval.Evaluation``), checkpoints
    (``trainer.checkpoint_policy.CheckpointManager``), the run's lines (``trainer.rundir.RunLog``), memory samples
    (``trainer.monitor.MemorySampler``) and the report (``trainer.reporting.ReportRenderer``).

    Attributes a caller (or a test) may use between construction and ``run()``: ``model`` (the
    plain ``nn.Module``; forward hooks registered on it fire during training), ``optimizer``,
    ``plan``, ``schedule`` (None until ``run`` fixes it for a time-limited run), ``step``.
    """

    def __init__(self, run_dir: Path, plan: Plan, data, config: TrainConfig, profile: Device,
                 device: torch.device | None, resume_from: ckpt.CheckpointRef | None,
                 starting: StartingWeights | None = None, task: TrainingTask | None = None):
        self.task = task if task is not None else pretraining(data, starting)
        self.run_dir = Path(run_dir)
        self.base_hf = starting.record if starting is not None else None  # where its first weights came from
        self.plan, self.data, self.config, self.profile = plan, data, config, profile
        # the plan the run writes carries the optimisation settings it trains with ([training], memplan.plan)
        self.plan = dataclasses.replace(plan, training=training_settings(config))
        self.device = device or torch_device_for(profile)
        self.setup = plan.setup
        self.step = 0
        self.tokens = 0
        self.train_seconds = 0.0  # cumulative over all invocations (restored on resume)
        self.schedule: Schedule | None = None
        self.eval_every = config.eval_every
        # (the refresh interval read here, when the trainer is built: a test may set trainer.loop's)
        self.report = ReportRenderer(self.run_dir, on_failure=lambda line: self.log.emit(
            records.ReportFailedEvent(step=self.step, error=line)), refresh_seconds=REPORT_REFRESH_SECONDS)
        self._recent: list[float] = []  # the latest step times, for the ETA
        self._step_cpu_seconds = 0.0  # the process's CPU time over the last step
        self._resume_from = resume_from
        self._lock: rundir.RunLock | None = None  # held from Trainer.start / resume until close()
        # a resume: the limits the run had when the command line replaced them (None: kept as they were)
        self.replaced_limits: dict | None = None
        self.first_step = 0
        self.tokenizer = data.tokenizer
        self.dist = distributed.init()  # rank and world size under torchrun; one process otherwise
        self.is_main = self.dist.is_main
        if self.dist.world_size > 1:
            self.device = self.dist.device
        self.stopping = Stopping(config)
        self.checkpoints = CheckpointManager(self.run_dir, keep=config.keep, dist=self.dist,
                                             save_every=config.save_every)
        self.log = rundir.RunLog(self._writing, active=self.is_main)  # rank 0 alone writes and reports
        self.stopping.on_signal = self._signalled
        self.evaluation = Evaluation(config=config, loss=self.task.evaluate, prompts=self.task.prompts,
                                     tokenizer=self.tokenizer, model=lambda: self.model, setup=lambda: self.setup,
                                     device=self.device)

        set_matmul_precision(self.setup.precision)
        if self.device.type == "cpu":  # what preparing data or planning left in the C heap is not the runtime's
            _trim_heap()
            keep_heap_resident()  # and the steps' freed heap is not given back and faulted in again
        self.baseline_bytes = _process_rss()  # the process before the model exists (its runtime context, on a CPU)
        # a checkpoint has its own weights: the starting ones are not loaded (trainer.task.TrainingTask.built)
        self.wrapped, self.model = self.task.built(plan.model, self.setup, dist=self.dist, seed=config.seed,
                                                   device=self.device, with_weights=resume_from is None)
        self.optimizer = self._make_optimizer()
        self.scaler = self._make_scaler()
        self.stream = self._new_stream(self.setup.micro_batch)
        self.step_model = step_model_for(self.wrapped, self.setup.compile, self.device.type)
        self.monitor = MemoryMonitor(self.device)
        # (the interval read here, when the trainer is built: a test may set trainer.loop's)
        self.sampler = MemorySampler(every_step=self.dist.world_size > 1, interval=MEMORY_SAMPLE_SECONDS)
        self.predicted = predicted_for(plan, profile)
        self.flops_per_step = model_flops_per_step(plan)
        self.peak_flops = peak_flops_per_second(profile, self.setup)
        if resume_from is not None:  # Trainer.resume verified the files already
            self._restore(resume_from.path)
        self.first_step = self.step

    # ---- the units' state, as the loop and its callers read it ----------------------------------------

    @property
    def save_every(self) -> int | None:
        return self.checkpoints.save_every

    @save_every.setter
    def save_every(self, value: int | None) -> None:
        self.checkpoints.save_every = value

    @property
    def stop_signal(self) -> int | None:
        """The signal (SIGINT, SIGTERM) that asked the run to stop."""
        return self.stopping.stop_signal

    @property
    def elapsed_seconds(self) -> float:
        """Wall-clock seconds since this invocation started training (what --max-minutes counts)."""
        return self.stopping.elapsed

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def start(cls, run_dir: str | Path, plan: Plan, data, config: TrainConfig, profile: Device,
              device: torch.device | None = None, allow_existing: bool = False,
              starting: StartingWeights | None = None, task: TrainingTask | None = None) -> "Trainer":
        """A new run in ``run_dir``, which must not hold a run already (``allow_existing``: it may hold
        one that never reached a checkpoint; its metrics.jsonl is appended to); from ``starting``'s weights
        if given, else from a seeded initialisation; ``task``: what it trains (default: ``pretraining`` on
        ``data``, whose model factory loads ``starting``'s weights)."""
        run_dir = Path(run_dir)

        def checked() -> "Trainer":
            check_new_run(run_dir, plan, data, profile, allow_existing=allow_existing, verify_data=config.verify_data)
            return cls(run_dir, plan, data, config, profile, device, None, starting, task)

        return cls._holding_run_lock(run_dir, checked)  # locked before the checks: no second writer passes them

    @classmethod
    def resume(cls, run_dir: str | Path, data, profile: Device, *, plan: Plan | None = None,
               overrides: dict | None = None, device: torch.device | None = None,
               sharding: str | None = None, task: TrainingTask | None = None) -> "Trainer":
        """Continue the run in ``run_dir`` from its newest checkpoint; one stopped before its first
        checkpoint starts again from step 0 as its RUN/run.json records it (trainer/rundir.py).

        ``plan``, if given, must describe the same model and setup as the run's (else an
        ``InputError`` and nothing on disk is touched); ``overrides`` may change the run-control
        settings (max_steps, max_tokens, max_minutes, save_every, eval_every, eval_batches, keep,
        sample_tokens, prompts, verify_data, max_nonfinite) and must leave the others as the run has
        them. The limits (LIMITS) go together: any of them given replaces the run's three (the others
        lifted; ``replaced_limits`` keeps what the run had, and the schedule is refitted:
        ``trainer.schedule.refitted``); none given keeps the run's. ``task``: what the run trains (default
        ``pretraining`` on ``data``); a run record of another kind is refused.

        Launched in another number of processes than the run was saved with (torchrun), the run goes
        on with the same global batch (``distributed.rescaled_for_world``), with ``sharding`` (else
        ``plan``'s, else the run's, else ddp) when there are several.
        """
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            rundir.resume_source(run_dir)  # the InputError saying what is there instead
        return cls._holding_run_lock(run_dir, lambda: cls._resume_locked(
            run_dir, data, profile, plan=plan, overrides=overrides, device=device, sharding=sharding, task=task))

    @staticmethod
    def _holding_run_lock(run_dir: Path, build) -> "Trainer":
        """``build()`` while holding the run's lock (``trainer.checkpoint_policy.holding_lock``), which it then keeps."""
        trainer, lock = holding_lock(run_dir, build)
        trainer._lock = lock
        return trainer

    @classmethod
    def _resume_locked(cls, run_dir: Path, data, profile: Device, *, plan, overrides, device, sharding,
                       task) -> "Trainer":
        r = resume_settings(run_dir, data, profile, kind=task.kind if task is not None else "train",
                            read_config=TrainConfig.from_dict, plan=plan, overrides=overrides, sharding=sharding)
        # ref None: again from step 0, from the weights it started from (a --from run's, checked unchanged)
        starting = starting_weights_again(r.meta, r.where, r.plan) if r.ref is None and r.meta.get("base_hf") \
            else None
        if task is None and stack_class(r.plan.setup.stack).trains_hf_model:  # transformers' model, config recorded
            from trainer import hf_model

            task = pretraining(data, starting, hf_config=hf_model.run_config(r.meta, r.where))
        trainer = cls(run_dir, r.plan, data, r.config, profile, device, r.ref, starting, task)
        trainer.base_hf = r.meta.get("base_hf")
        if any((overrides or {}).get(k) is not None for k in LIMITS):
            trainer.replaced_limits = {k: getattr(r.stored_config, k) for k in LIMITS}
            trainer._refit_schedule()
        return trainer

    def _refit_schedule(self) -> None:
        """A resume whose limits were replaced: the restored schedule made to end where the new limits do
        (``trainer.schedule.refitted``)."""
        if self.schedule is None:  # again from step 0: the schedule is fixed by open() for the new limits
            return
        self.schedule, self.stopping.schedule_ends_run = refitted(self.schedule, self.config, self.step,
                                                                  self.setup.tokens_per_step)

    def _new_stream(self, micro_batch: int):
        """The task's training batches at ``micro_batch``, this rank's share."""
        return self.task.make_stream(micro_batch=micro_batch, ctx=self.setup.ctx, seed=self.config.seed,
                                     rank=self.dist.rank, world_size=self.dist.world_size)

    def _make_optimizer(self, model: torch.nn.Module | None = None):
        return make_optimizer(self.model if model is None else model, self.setup.optimizer, lr=self.config.lr,
                              weight_decay=self.config.weight_decay, betas=(self.config.beta1, self.config.beta2))

    def _make_scaler(self):
        if self.setup.precision != "fp16-mixed":
            return None
        return torch.amp.GradScaler(self.device.type)

    def _restore(self, path: Path) -> None:
        """Go on from the checkpoint in ``path`` (``CheckpointManager.restore``; a single-process checkpoint
        over several ranks is read by rank 0 into the task's model, built on the CPU)."""
        def plain():
            model = self.task.build_model(self.plan.model, self.setup, "cpu", False)
            return model, self._make_optimizer(model)

        r = self.checkpoints.restore(path, model=self.model, wrapped=self.wrapped, optimizer=self.optimizer,
                                     scaler=self.scaler, stream=self.stream, device=self.device, plain=plain,
                                     eval_every=self.config.eval_every)
        self.schedule, self.step, self.tokens, self.train_seconds = r.schedule, r.step, r.tokens, r.train_seconds
        self.eval_every = r.eval_every
        self.stopping.nonfinite_run = r.nonfinite_run
        self.evaluation.last_step = self.step

    # ---- the loop ----------------------------------------------------------------------------------

    def on_event(self, callback: Callable[[records.Record], None]) -> None:
        """Call ``callback(record)`` for every metrics line (``trainer.records``), as it is written."""
        self.log.on_event(callback)

    def run(self) -> RunSummary:
        """Train until a stop criterion is met (or a signal arrives); returns what happened.

        Raises ``TrainingStopped`` (after logging and writing the report) when the run cannot go on.
        """
        try:
            with self.stopping.catching_signals():
                self.open()
                while (reason := self._stop_reason()) is None:
                    self.advance()
                return self._finish(reason)
        except (MemoryError, RuntimeError, ImportError, OSError) as e:  # a step's own are backed off from
            message = memory_failure(e)
            if message is None:
                raise
            raise TrainingStopped(out_of_memory_outside_step(self.step, message,
                                                             self.checkpoints.newest_note())) from None
        finally:
            self.close()

    def open(self) -> None:
        """Start writing the run: directories, plan.toml, metrics.jsonl, the schedule, the start line.
        (``run`` calls it; call it yourself only to drive the loop with ``advance``.)"""
        self.stopping.started = self.report.last_render = time.perf_counter()  # the first refresh a minute in
        if self.is_main:  # (rundir.open_run)
            self.log.writer = rundir.open_run(self.run_dir, plan=self.plan, writing=self._writing,
                                           record=self.record if self._resume_from is None else None)
        if self.schedule is None:  # (trainer.schedule.first_schedule)
            self.schedule, self.eval_every, self.save_every = first_schedule(
                self.config, self.setup.tokens_per_step, eval_every=self.eval_every, save_every=self.save_every,
                probe=self._probe, epoch_steps=lambda: max(1, len(self.stream.epoch_plan(0)[1]) // (
                    self.stream.global_batch * self.setup.grad_accum)))
            # timed probe steps fix a time-limited run's length: every rank takes rank 0's
            self.schedule, self.eval_every, self.save_every = distributed.from_rank0(
                (self.schedule, self.eval_every, self.save_every))
        self.log.emit(self._start_line())

    def _signalled(self, signum: int, now: bool) -> None:
        """A signal arrived (``Stopping.catching_signals``): a ``signal`` line, written and shown at once (the step
        under way finishes first, unless it is the second signal, when this line is the run's last)."""
        self.log.emit(records.SignalEvent(step=self.step, signal=signal.Signals(signum).name, now=now))

    def close(self) -> None:
        self.monitor.close()
        self.report.close()
        self.log.close()
        if self._lock is not None:
            self._lock.release()

    def _probe(self) -> tuple[int, int | None]:
        """(steps, eval_every) of a time-limited run in the time it has left, from PROBE_STEPS real steps on
        the next batches at learning rate 0 (the weights do not move; optimizer and scaler state are reset
        after) and one timed evaluation (``trainer.schedule.probe``)."""
        data_state = self.stream.state_dict()
        batches = next_batches(self.stream, self.setup.grad_accum, self.device)
        self.stream.load_state_dict(data_state)
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0

        def reset() -> None:
            batches.clear()
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.state.clear()
            self.scaler = self._make_scaler()

        total, eval_every, eval_seconds = probe(
            lambda: float(self._train_step(batches).loss), lambda: self._evaluate(step=0, emit=False),
            budget_seconds=self.config.max_minutes * 60.0 - self.stopping.elapsed,
            eval_every=self.config.eval_every, after_steps=reset)
        self.evaluation.seconds.append(eval_seconds)
        return total, eval_every

    def planned_steps(self) -> int | None:
        """The step this run is planned to end at: its step or token limit (the nearer), else the schedule's
        end (one epoch, or for a time limit the estimate from timed steps). A time limit may stop it earlier.
        None for a resume given a new time limit alone after its schedule's end (nothing estimates it)."""
        return self.stopping.planned_steps(self.step, self.schedule, self.setup.tokens_per_step)

    def data_passes(self) -> float | None:
        """Passes over the training tokens that ``planned_steps`` make (tokens trained / training tokens)."""
        steps = self.planned_steps()
        return None if steps is None else steps * self.setup.tokens_per_step / max(1, self.data.train_tokens)

    def _start_line(self) -> records.StartEvent:
        spec, s = self.plan.model, self.setup
        return records.StartEvent(
            event="resume" if self._resume_from is not None else "start", step=self.step,
            tokens=self.tokens, time=self.train_seconds, unix_time=time.time(),
            model={**spec.to_json(), "describe": spec.describe()},
            setup={**s.to_json(), "compile": s.compile}, device=self.profile.name,
            torch_device=str(self.device), torch=torch.__version__,
            predicted=self.predicted.as_dict(), schedule=self.schedule.to_dict(),
            eval_every=self.eval_every, save_every=self.save_every,
            tokens_per_step=s.tokens_per_step, planned_steps=self.planned_steps(),
            data_passes=self.data_passes(), train_tokens=self.data.train_tokens,
            replaced_limits=self.replaced_limits,
            memory_source=self.monitor.source,
            baseline_memory_bytes=self.baseline_bytes,
            mfu_peak_flops_per_second=self.peak_flops, data=str(self.data.path),
            config=self.config.to_dict(),
            checkpoint=str(self._resume_from.path) if self._resume_from is not None else None,
        )

    def _train_step(self, batches):
        try:
            return train_step(self.step_model, self.optimizer, batches, self.setup, self.device.type,
                              scaler=self.scaler, clip=self.config.clip or None)
        except compile_errors() as e:
            if self.step_model is self.wrapped:
                raise
            # the compile failed before the optimizer's update: the step is taken again eager, from no gradients
            warn(f"torch.compile failed at step {self.step + 1} ({type(e).__name__}: "
                 f"{(str(e).strip().splitlines() or [''])[0][:120]}); {EAGER_FALLBACK}")
            self.step_model = self.wrapped
            self.optimizer.zero_grad(set_to_none=True)
            return train_step(self.step_model, self.optimizer, batches, self.setup, self.device.type,
                              scaler=self.scaler, clip=self.config.clip or None)

    def _stop_reason(self) -> str | None:
        if self.dist.world_size == 1:
            return self.stopping.reason(self.step, self.tokens, self.schedule)
        return self.stopping.reason_in_ranks(self.step, self.tokens, self.schedule, from_rank0=distributed.from_rank0,
                                             largest=lambda v: distributed.max_across_ranks(v, self.device))

    def advance(self) -> records.TrainLine:
        """One optimizer step with everything around it (learning rate, logging, evaluation and checkpoint
        when due); returns the step's metrics line (a ``records.TrainLine``)."""
        step = self.step + 1
        if not self.schedule.fixed:
            self._maybe_start_decay()
            self.schedule = distributed.from_rank0(self.schedule)  # decided by rank 0's clock
        lr = self.schedule.lr(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss, grad_norm, skipped, seconds, memory = self._run_step(step)
        self.step = step
        self.tokens += self.setup.tokens_per_step
        self.train_seconds += seconds
        self._recent = (self._recent + [seconds])[-ETA_WINDOW:]
        finite = math.isfinite(loss)
        give_up = self.stopping.count_loss(loss)
        line = records.TrainLine(
            step=step, loss=_finite_or_none(loss),
            tokens_per_second=self.setup.tokens_per_step / seconds, lr=lr,
            grad_norm=_finite_or_none(grad_norm), tokens=self.tokens, step_seconds=seconds,
            time=self.train_seconds, mfu=self.flops_per_step / seconds / self.peak_flops,
            memory_bytes=memory.peak_bytes, memory_step=self.sampler.step,
            micro_batch=self.setup.micro_batch,
            grad_accum=self.setup.grad_accum, skipped=skipped,
            eta_seconds=self._eta(),
            total_steps=self.schedule.total_steps,
            memory_allocated_bytes=memory.allocated_bytes,
            nonfinite=None if finite else str(loss),
            cpu_seconds=self._step_cpu_seconds if self.device.type == "cpu" else None,
        )
        self.log.emit(line)
        if not finite:
            self.log.emit(records.NonfiniteEvent(step=step, loss=str(loss), in_a_row=self.stopping.nonfinite_run,
                                                 lr=lr))
            if give_up:
                self._write_report()
                raise TrainingStopped(self.stopping.nonfinite_message(step, loss, self.checkpoints.last_saved_step,
                                                                      self.setup.precision))
        if self.eval_every and step % self.eval_every == 0:
            self._evaluate(step)
        if self.checkpoints.due(step):
            self.save()
        return line

    def _maybe_start_decay(self) -> None:
        """wsd: once DECAY_SHARE of the time is left, fix the decay's length from the measured step time
        (``trainer.schedule.decayed``) and log it."""
        decay = decayed(self.schedule, budget_seconds=self.stopping.time_budget, elapsed=self.stopping.elapsed,
                        step=self.step, recent=self._recent, eval_seconds=self.evaluation.seconds,
                        eval_every=self.eval_every)
        if decay is None:
            return
        self.schedule, details = decay
        self.log.emit(records.DecayEvent(step=self.step, **details))

    def _eta(self) -> float:
        """Seconds left (``trainer.stopping.eta_seconds``)."""
        return eta_seconds(self.config, self.schedule, self.step, self.tokens, self.setup.tokens_per_step,
                           self._recent, self.elapsed_seconds)

    def _run_step(self, step: int):
        """One optimizer step, redone with half the micro-batch when it runs out of memory; its memory
        measured when the sampler says so (``trainer.monitor.MemorySampler``)."""
        while True:
            data_state = self.stream.state_dict()
            batches = next_batches(self.stream, self.setup.grad_accum, self.device)
            self.sampler.before_step(self.monitor)
            oom = None
            t0, cpu0 = time.perf_counter(), time.process_time()
            try:
                result = self._train_step(batches)
                loss = float(distributed.mean_across_ranks(result.loss))  # waits for the device
                seconds = time.perf_counter() - t0
                self._step_cpu_seconds = time.process_time() - cpu0  # this process's CPU time: the load moves it little
                grad_norm = float(result.grad_norm)
                memory = self.sampler.after_step(step, seconds, self._read_memory)
                return loss, grad_norm, bool(result.skipped), seconds, memory
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                oom = out_of_memory(e)
                if oom is None:
                    raise
            # outside the except block, so the traceback no longer pins the step's tensors
            del batches
            if self.dist.world_size > 1:
                raise TrainingStopped(out_of_memory_in_ranks(step, self.dist.rank, self.dist.world_size, oom))
            self._recover_from_oom(step, data_state, oom)

    def _read_memory(self):
        """The step's measured memory; under torchrun the fullest device's peak."""
        memory = self.monitor.read()
        if self.dist.world_size > 1 and memory.peak_bytes is not None:
            memory = dataclasses.replace(memory, peak_bytes=distributed.max_across_ranks(memory.peak_bytes,
                                                                                         self.device))
        return memory

    def _recover_from_oom(self, step: int, data_state: dict, message: str) -> None:
        """Half the micro-batch, the stream rebuilt at ``data_state`` (``trainer.backoff.back_off``), plan.toml
        rewritten; at micro-batch 1, stop with advice."""
        self.sampler.restart()  # the next steps, at the new micro-batch, are measured
        release_memory(self.optimizer, self.device)
        b = back_off(step, message, plan=self.plan, data_state=data_state, new_stream=self._new_stream,
                     scaler=self.scaler, new_scaler=self._make_scaler, time=self.train_seconds,
                     predict=lambda plan: predicted_for(plan, self.profile), flops=model_flops_per_step)
        if b is None:
            self._write_report()
            raise TrainingStopped(out_of_memory_at_one(step, message))
        self.plan, self.setup, self.predicted, self.flops_per_step = b.plan, b.plan.setup, b.predicted, b.flops_per_step
        self.stream, self.scaler = b.stream, b.scaler
        rundir.write_plan(self.run_dir, self.plan, self._writing)
        self.log.emit(b.event)

    # ---- evaluation ------------------------------------------------------------------------------

    def sample_prompts(self) -> list[str]:
        """The configured prompts, else the task's (for a corpus, the start of each source's first held-out
        document)."""
        return self.evaluation.prompts()

    def _evaluate(self, step: int, emit: bool = True) -> records.EvalLine | None:
        line, event = self.evaluation.run(step, self.tokens, emit)
        if event is not None:
            self.log.emit(event)
        if line is not None:
            self.log.emit(line)
        return line

    # ---- checkpoints and the end ---------------------------------------------------------------------

    def state(self) -> dict:
        return state_of(optimizer=self.optimizer, scaler=self.scaler, schedule=self.schedule, stream=self.stream,
                        step=self.step, tokens=self.tokens, train_seconds=self.train_seconds,
                        eval_every=self.eval_every, save_every=self.save_every,
                        nonfinite_run=self.stopping.nonfinite_run)

    def record(self) -> dict:
        """RUN/run.json: what this run is (plan, config with its limits, data, tokenizer: ``rundir.run_identity``),
        as a checkpoint's meta.json has it, so that a resume reads either the same way."""
        return {
            "kind": self.task.kind, "plan": self.plan.to_dict(), "config": self.config.to_dict(),
            **rundir.run_identity(self.data), "device": self.profile.name, "torch": torch.__version__,
            "created_unix_time": time.time(), **({"base_hf": self.base_hf} if self.base_hf else {}),
        }

    def meta(self) -> dict:
        return {
            "tokens": self.tokens, "plan": self.plan.to_dict(), "config": self.config.to_dict(),
            "schedule": self.schedule.to_dict(), **rundir.run_identity(self.data),
            "torch": torch.__version__, "device": self.profile.name, "torch_device": str(self.device),
            "saved_unix_time": time.time(), **({"base_hf": self.base_hf} if self.base_hf else {}),
            **self.task.meta(self.setup),
        }

    def save(self) -> Path:
        """Checkpoint now (atomically), keep the newest ``keep``, refresh the report."""
        t0 = time.perf_counter()
        # The train lines up to this step reach the disk before the checkpoint is renamed into place: a kill
        # between the two must not leave a checkpoint whose steps metrics.jsonl never recorded (a resume starts
        # after it, so those lines would be lost for good).
        self.log.flush(sync=True)
        path = self.checkpoints.save(self.step, model=self.model, wrapped=self.wrapped, optimizer=self.optimizer,
                                     state=self.state, meta=self.meta, tokenizer=self.tokenizer,
                                     tied=self.plan.model.tied, sharding=self.setup.sharding)
        self.log.emit(records.CheckpointEvent(step=self.step, path=str(path), seconds=time.perf_counter() - t0))
        if self.report.refresh_due():
            self._write_report(wait=False)
        return path

    def _writing(self, path: Path, report: bool = False):
        """Writes of ``path`` within: a full disk becomes one ``DiskFull`` line (``CheckpointManager.writing``)."""
        return self.checkpoints.writing(path, self.step, report)

    def _write_report(self, wait: bool = True) -> Path | None:
        """RUN/report.html, rendered in a process of its own (``trainer.reporting``: the training process
        never holds plotly's or the page's memory). ``wait``: render now and return its path (None when the
        render failed: a ``report_failed`` line); else start a render and go on. A full disk is ``DiskFull``."""
        if not self.is_main:
            return None
        self.log.flush()  # the report reads metrics.jsonl
        with self._writing(self.run_dir / REPORT_FILE, report=True):
            return self.report.write() if wait else self.report.refresh()

    def _finish(self, reason: str) -> RunSummary:
        if self.step > self.evaluation.last_step:
            self._evaluate(self.step)
        checkpoint = None
        if self.step > self.checkpoints.last_saved_step:
            checkpoint = self.save()
        else:
            ref = self.checkpoints.newest()
            checkpoint = ref.path if ref else None
        self.log.flush()
        last_train = next((r for r in reversed(rundir.metric_records(self.run_dir))
                           if isinstance(r, records.TrainLine)), None) if self.is_main else None
        self.log.emit(records.StopEvent(step=self.step, reason=reason, tokens=self.tokens, time=self.train_seconds,
                                     wall_seconds=self.stopping.elapsed,
                                     signal=signal.Signals(self.stop_signal).name if self.stop_signal else None))
        report, last_eval = self._write_report(), self.evaluation.last
        return RunSummary(run_dir=self.run_dir, step=self.step, tokens=self.tokens, stop_reason=reason,
                          train_seconds=self.train_seconds, last_loss=last_train.loss if last_train else None,
                          last_eval=last_eval, checkpoint=checkpoint, report=report,
                          samples=last_eval.samples if last_eval else [], first_step=self.first_step,
                          wall_seconds=self.elapsed_seconds)



# =================================================================================================
# A trained model, for sampling and generation
# =================================================================================================

def load_trained(run_dir: str | Path, device=None, checkpoint: str | Path | None = None):
    """``(model, tokenizer, meta)`` from a run's newest (or the given) checkpoint, model in eval mode
    (``build_trained`` of ``rundir.trained_checkpoint``)."""
    return build_trained(rundir.trained_checkpoint(run_dir, checkpoint), device)


def build_trained(trained: rundir.TrainedCheckpoint, device=None):
    """``(model, tokenizer, meta)`` of a verified checkpoint, model in eval mode.

    The model is built without checkpointing or compile, in fp32 weights unless the plan trained
    pure bf16; a LoRA finetune's adapters are folded into its weights. The tokenizer comes from the
    checkpoint itself (tokenizer.json, or the tiktoken encoding it names), so the prepared data need
    not be present.
    """
    path, meta, plan = trained.path, trained.meta, trained.plan
    device = torch.device(device) if device is not None else torch.device("cpu")
    if stack_class(plan.setup.stack).trains_hf_model:  # transformers' model class, rebuilt from its config.json
        from trainer import hf_model

        return hf_model.trained(trained, plan, meta, device), trained.tokenizer(), meta
    model = build_model(plan.model, plan.setup.attention, "none", param_dtype(plan.setup.precision), device=device)
    if plan.setup.lora_rank:  # a LoRA finetune: its adapters, folded into the weights once loaded
        from trainer.lora import apply_lora, lora_targets, merge_lora

        lora = meta.get("finetune", {}).get("lora", {})
        apply_lora(model, plan.setup.lora_rank, float(lora.get("alpha", 16.0)), lora_targets(plan.setup))
    ckpt.load_weights(model, ckpt.read_weights(path / ckpt.MODEL_FILE), str(path / ckpt.MODEL_FILE))
    if plan.setup.lora_rank:
        merge_lora(model)
    model.eval()
    return model, trained.tokenizer(), meta
