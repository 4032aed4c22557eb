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
    RUN/checkpoints/    atomic checkpoints (trainer/checkpoint.py)
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import math
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memplan.errors import InputError
from memplan.fsutil import no_space, open_append
from memplan.hardware import Device
from memplan.plan import Plan
from memplan.setup import TrainSetup
from trainer import checkpoint as ckpt
from trainer import distributed
from trainer import records, rundir
from trainer.rundir import METRICS_FILE, read_metrics  # noqa: F401  (read_metrics: callers import it from here too)
from trainer.data import PreparedData, TrainStream
from trainer.device import current_rss as _process_rss, torch_device_for, trim_heap as _trim_heap  # noqa: F401
from trainer.model import build_model, lm_loss
from trainer.monitor import MemoryMonitor
from trainer.sample import sample_text
from trainer.step import autocast, make_optimizer, param_dtype, set_matmul_precision, train_step
from trainer.verify import is_out_of_memory

PLAN_FILE = "plan.toml"
REPORT_FILE = "report.html"
CHECKPOINT_DIR = "checkpoints"
TOKENIZER_FILE = "tokenizer.json"

WARMUP_FRACTION = 0.05  # default warmup: 5% of the steps ...
WARMUP_MAX_STEPS = 100  # ... but at most this many
EVALS_PER_RUN = 5  # default eval (and checkpoint) cadence: this many times over the run ...
EVAL_EVERY_MAX = 1000  # ... but at least every this many steps
PROBE_STEPS = 2  # time-limited runs time this many zero-lr steps to estimate their length (warmup, evals)
EVAL_TIME_SHARE = 0.2  # ... and give evaluations at most this share of the time
DECAY_SHARE = 0.2  # a time-limited run decays its learning rate over the last fifth of its time
TIME_LIMIT_ALLOWANCE = 0.03  # share of a time budget left for the final eval, checkpoint and report
ETA_WINDOW = 20  # steps whose median step time predicts the rest
REPORT_REFRESH_SECONDS = 60.0  # a checkpoint refreshes RUN/report.html at most this often (rendering takes ~1 s)
METRICS_FLUSH_SECONDS = 1.0  # train lines reach metrics.jsonl at most this late (events and evals at once)
MEMORY_SAMPLE_SECONDS = 1.0  # one process: a step's memory is measured at most once per this much training time
REPEAT_WARN_PASSES = 4.0  # a run planned for more passes than this over its training tokens is warned of it
SEED_MAX = 2**32 - 1  # seeds are mixed with steps and epochs into torch's and numpy's 64-bit seeds
LIMITS = ("max_steps", "max_tokens", "max_minutes")  # the settings that decide when a run stops


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


class TrainingStopped(Exception):
    """The run stopped on its own for a reason the user must act on (diverged, no memory left).
    The message is one line; checkpoints and metrics written so far stay."""


class DiskFull(TrainingStopped):
    """A write of the run (a checkpoint, metrics.jsonl, plan.toml, run.json, the report) found the disk
    full. The message is one line naming the file; the unfinished checkpoint is gone, earlier ones stay."""


# =================================================================================================
# Metrics
# =================================================================================================

class _MetricsWriter:
    def __init__(self, path: Path):
        self.path = path
        self._f = open_append(path, "metrics")  # never through a symlink planted in the run
        fd = self._f.fileno()
        size = os.fstat(fd).st_size
        needs_newline = size > 0 and os.lseek(fd, size - 1, os.SEEK_SET) >= 0 and os.read(fd, 1) != b"\n"
        if needs_newline:  # a kill cut the last line: start on a fresh one
            self._f.write("\n")

        self.flushed = time.perf_counter()

    def write(self, record: records.Record, flush: bool = True) -> None:
        """Append one record's line (``trainer.records.dumps``); flushed now with ``flush``, else left in the
        buffer for a later flush (the loop flushes train lines at most every METRICS_FLUSH_SECONDS, and before
        anything reads the file)."""
        self._f.write(records.dumps(record) + "\n")
        if flush:
            self.flush()

    def flush(self) -> None:
        self._f.flush()
        self.flushed = time.perf_counter()

    def flush_due(self) -> bool:
        return time.perf_counter() - self.flushed >= METRICS_FLUSH_SECONDS

    def sync(self) -> None:
        self.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:  # the loop flushed every line before (Trainer._flush_metrics): a failure raised there
                pass


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


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


def predicted_for(plan: Plan, profile: Device) -> dict:
    """What memplan predicts for this plan on this device (the figures the run is measured against):
    ``memplan.prediction.predict``'s, as a dict."""
    from memplan.prediction import predict

    return predict(plan.model, plan.setup, profile).as_dict()


def training_settings(config: TrainConfig) -> dict:
    """A plan's [training] table (``memplan.plan.TRAINING_KEYS``) for ``config``; ``schedule`` says which decay
    its limits give (wsd for a run limited by time alone, else cosine)."""
    from memplan.plan import TRAINING_KEYS

    out = {k: getattr(config, k) for k in TRAINING_KEYS if getattr(config, k) is not None}
    time_only = config.max_minutes is not None and config.max_steps is None and config.max_tokens is None
    out["schedule"] = "wsd" if time_only else "cosine"
    return out


@dataclass(frozen=True)
class StartingWeights:
    """Weights a new run starts from instead of a seeded initialisation (``memplan train --from``: a Hugging
    Face checkpoint, continued pretraining). ``load()`` reads them as canonical-named tensors, called once
    while the model is built, after the process's baseline memory is taken (so the copy it holds only
    briefly is not counted as runtime context); on ranks other than 0 it is not called, since DDP and FSDP
    take rank 0's weights. ``record`` is what the run keeps of where they came from (``base_hf`` in
    run.json and each checkpoint's meta.json): path, model_type, dtype and ``weights_sha256``."""

    load: Callable[[], dict]
    record: dict
    where: str


def starting_from_hf(directory: Path, spec, *, model_type: str, recorded_sha256: str | None = None,
                     flag: str = "--from") -> StartingWeights:
    """The weights of the Hugging Face checkpoint in ``directory`` as a run's start: names and shapes checked
    against ``spec`` now (headers only), the files' sha256 taken now (``recorded_sha256``: it must still be
    that one, for a run that starts again from step 0), the tensors read when the model is built."""
    from trainer import hf_import

    hf_import.check_weights(directory, spec)
    sha = hf_import.weights_sha256(directory)
    if recorded_sha256 is not None and sha != recorded_sha256:
        raise InputError(f"{flag}: the weights in {directory} changed since the run started from them (sha256 "
                         f"{sha[:12]}, recorded {recorded_sha256[:12]}); start a new run from them instead")

    def load() -> dict:
        return hf_import.read_weights(directory, spec)[0]

    return StartingWeights(load=load, record={"path": str(directory.resolve()), "model_type": model_type,
                                              "weights_sha256": sha}, where=f"{flag} {directory}")


def starting_weights_again(meta: dict, where: str, plan: Plan) -> StartingWeights:
    """A ``--from`` run resumed before its first checkpoint starts again from the checkpoint it recorded."""
    base = meta.get("base_hf")
    if not isinstance(base, dict) or not isinstance(base.get("path"), str) \
            or not isinstance(base.get("weights_sha256"), str):
        raise InputError(f"--resume: {where}: base_hf must name the checkpoint's path and weights_sha256")
    directory = Path(base["path"])
    if not directory.is_dir():
        raise InputError(f"--resume: the run stopped before its first checkpoint and started from {directory}, "
                         "which is gone; start it again with --from")
    return starting_from_hf(directory, plan.model, model_type=str(base.get("model_type")),
                            recorded_sha256=base["weights_sha256"], flag="--resume")


def check_plan_for_data(plan: Plan, data: PreparedData) -> None:
    """The model must embed the data's vocabulary and, with learned positions, hold the context."""
    if plan.model.vocab != data.vocab_size:
        raise InputError(f"the model's vocabulary is {plan.model.vocab} but {data.path}'s tokenizer has "
                         f"{data.vocab_size} tokens; the vocabulary comes from the prepared data")
    if plan.model.pos == "learned" and plan.setup.ctx > plan.model.max_positions:
        raise InputError(f"--ctx {plan.setup.ctx} exceeds the model's {plan.model.max_positions} learned positions")
    _, launched, _ = distributed.env_world()
    if plan.setup.world_size != launched:
        raise InputError(f"the plan is for --world-size {plan.setup.world_size} but {launched} process(es) run it; "
                         f"launch it with `memplan train --nproc {plan.setup.world_size}` (torchrun)"
                         if plan.setup.world_size > 1 else
                         f"the plan is for one process but {launched} were launched; plan with --world-size "
                         f"{launched}")


def check_plan_fits(plan: Plan, profile: Device) -> None:
    """A plan whose predicted peak exceeds the device's usable memory is refused before it starts (on a CPU
    the operating system would kill the process or swap, with no out-of-memory error to back off from)."""
    from memplan.units import format_bytes

    peak = predicted_for(plan, profile)["peak_reserved"]
    if peak > profile.usable_bytes:
        raise InputError(f"the plan needs {format_bytes(peak)} (predicted peak) but {profile.name} has "
                         f"{format_bytes(profile.usable_bytes)} usable; plan for this device (`memplan autotune "
                         f"... --device {profile.name}`), or lower --batch / --ctx, or use --checkpointing full")


class Trainer:
    """One training run. Build it with ``Trainer.start`` (a new run) or ``Trainer.resume``; both check
    everything before anything is written. Then ``run()``.

    Attributes a caller (or a test) may use between construction and ``run()``: ``model`` (the
    plain ``nn.Module``; forward hooks registered on it fire during training), ``optimizer``,
    ``plan``, ``schedule`` (None until ``run`` fixes it for a time-limited run), ``step``.
    """

    run_kind = "train"  # RUN/run.json's kind: what resumes the run from step 0

    def __init__(self, run_dir: Path, plan: Plan, data: PreparedData, config: TrainConfig, profile: Device,
                 device: torch.device | None, resume_from: ckpt.CheckpointRef | None,
                 starting: StartingWeights | None = None):
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
        self.save_every = config.save_every
        self.nonfinite_run = 0
        self.last_eval: records.EvalLine | None = None
        self.last_saved_step = -1
        self.last_eval_step = -1
        self.stop_signal: int | None = None  # the signal (SIGINT, SIGTERM) that asked the run to stop
        self._events: list[Callable[[dict], None]] = []
        self._writer: _MetricsWriter | None = None
        self._report_written = -math.inf
        self._recent: list[float] = []  # the latest step times, for the ETA
        # the latest memory reading, the step it measured and when (``_memory_due``: sampled, not every step)
        self._memory = None
        self._memory_step: int | None = None
        self._memory_at = -math.inf
        self._memory_clock = 0.0  # training seconds of this invocation, the clock memory samples run on
        self._memory_reads = 0  # steps measured since the invocation started (or the micro-batch changed)
        self._eval_seconds: list[float] = []  # the latest evaluations' times
        self._started = time.perf_counter()
        self._resume_from = resume_from
        self._lock: rundir.RunLock | None = None  # held from Trainer.start / resume until close()
        # a resume: the limits the run had when the command line replaced them (None: kept as they were)
        self.replaced_limits: dict | None = None
        self._schedule_ends_run = True  # whether reaching the schedule's end stops a run with no step/token limit
        self.first_step = 0
        self.tokenizer = data.tokenizer
        self.dist = distributed.init()  # rank and world size under torchrun; one process otherwise
        self.is_main = self.dist.is_main
        if self.dist.world_size > 1:
            self.device = self.dist.device

        set_matmul_precision(self.setup.precision)
        if self.device.type == "cpu":  # what preparing data or planning left in the C heap is not the runtime's
            _trim_heap()
        self.baseline_bytes = _process_rss()  # the process before the model exists (its runtime context, on a CPU)
        initial = starting if starting is not None and resume_from is None else None  # a checkpoint has its own
        if self.dist.world_size > 1:  # DDP or FSDP2; the plain module (FSDP2's is sharded in place) as self.model
            self.wrapped = distributed.build_wrapped_model(
                plan.model, self.setup, self.dist, config.seed,
                initial=(lambda model: ckpt.load_weights(model, initial.load(), initial.where)) if initial else None)
            self.model = distributed.unwrapped(self.wrapped)
        else:
            torch.manual_seed(config.seed)
            self.model = self._build_model()
            if initial is not None:
                ckpt.load_weights(self.model, initial.load(), initial.where)
            self.wrapped = self.model
        self.optimizer = self._make_optimizer()
        self.scaler = self._make_scaler()
        self.stream = self._make_stream(self.setup.micro_batch)
        self.step_model = torch.compile(self.wrapped) if self.setup.compile else self.wrapped
        self.monitor = MemoryMonitor(self.device)
        self.predicted = predicted_for(plan, profile)
        self.flops_per_step = model_flops_per_step(plan)
        self.peak_flops = peak_flops_per_second(profile, self.setup)
        if resume_from is not None:  # Trainer.resume verified the files already
            self._restore(*self._load(resume_from.path))
        self.first_step = self.step

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def start(cls, run_dir: str | Path, plan: Plan, data: PreparedData, config: TrainConfig, profile: Device,
              device: torch.device | None = None, allow_existing: bool = False,
              starting: StartingWeights | None = None) -> "Trainer":
        """A new run in ``run_dir``, which must not hold a run already (``allow_existing``: it may hold
        one that never reached a checkpoint; its metrics.jsonl is appended to); from ``starting``'s weights
        if given, else from a seeded initialisation."""
        run_dir = Path(run_dir)

        def checked() -> "Trainer":
            if not allow_existing:
                check_run_dir_free(run_dir)
            elif ckpt.latest_checkpoint(run_dir / CHECKPOINT_DIR) is not None:
                raise InputError(f"--out {run_dir}: holds checkpoints; resume it with --resume")
            check_metrics_file(run_dir)
            check_plan_for_data(plan, data)
            check_plan_fits(plan, profile)
            if config.verify_data:
                data.verify()
            return cls(run_dir, plan, data, config, profile, device, None, starting)

        return cls._holding_run_lock(run_dir, checked)  # locked before the checks: no second writer passes them

    @classmethod
    def resume(cls, run_dir: str | Path, data: PreparedData, profile: Device, *, plan: Plan | None = None,
               overrides: dict | None = None, device: torch.device | None = None,
               sharding: str | None = None) -> "Trainer":
        """Continue the run in ``run_dir`` from its newest checkpoint; one stopped before its first
        checkpoint starts again from step 0 as its RUN/run.json records it (trainer/rundir.py).

        ``plan``, if given, must describe the same model and setup as the run's (else an
        ``InputError`` and nothing on disk is touched); ``overrides`` may change the run-control
        settings (max_steps, max_tokens, max_minutes, save_every, eval_every, eval_batches, keep,
        sample_tokens, prompts, verify_data, max_nonfinite) and must leave the others as the run has
        them. The limits (LIMITS) go together: any of them given replaces the run's three (the others
        lifted; ``replaced_limits`` keeps what the run had, and the schedule is refitted:
        ``_refit_schedule``); none given keeps the run's.

        Launched in another number of processes than the run was saved with (torchrun), the run goes
        on with the same global batch (``distributed.rescaled_for_world``), with ``sharding`` (else
        ``plan``'s, else the run's, else ddp) when there are several.
        """
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            rundir.resume_source(run_dir)  # the InputError saying what is there instead
        return cls._holding_run_lock(run_dir, lambda: cls._resume_locked(
            run_dir, data, profile, plan=plan, overrides=overrides, device=device, sharding=sharding))

    @staticmethod
    def _holding_run_lock(run_dir: Path, build) -> "Trainer":
        """``build()`` while holding the run's lock (``_lock_run``: rank 0's, None on other ranks), which the
        trainer then keeps; released again when ``build`` fails."""
        lock = _lock_run(run_dir)
        try:
            trainer = build()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        trainer._lock = lock
        return trainer

    @classmethod
    def _resume_locked(cls, run_dir: Path, data: PreparedData, profile: Device, *, plan, overrides, device,
                       sharding) -> "Trainer":
        ref, source = rundir.resume_source(run_dir)  # the newest checkpoint, else the run record (from step 0)
        if ref is not None:
            meta = ckpt.verify_checkpoint(ref.path)
            where = f"{ref.path / ckpt.META_FILE}"
        else:
            meta, where = source, f"{run_dir / rundir.RUN_FILE}"
            if meta.get("kind", "train") != cls.run_kind:
                raise InputError(f"--resume: {run_dir} is a {meta.get('kind')} run; resume it with memplan "
                                 f"{meta.get('kind')}")
        try:
            saved_plan = Plan.from_dict(meta["plan"], where)
            config = TrainConfig.from_dict(meta["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"--resume: {where}: unreadable run settings ({type(e).__name__}: {e})") from None
        check_metrics_file(run_dir)
        if plan is not None:
            check_same_plan(saved_plan, plan, run_dir)
        tok_sha = data.manifest["tokenizer"]["sha256"]
        if tok_sha != meta.get("tokenizer_sha256"):
            raise InputError(f"--resume: {run_dir} was trained with another tokenizer (sha256 "
                             f"{str(meta.get('tokenizer_sha256'))[:12]}) than {data.path}'s ({tok_sha[:12]}); "
                             "resume with the run's own prepared data")
        if data.train_tokens != meta.get("data", {}).get("train_tokens"):
            raise InputError(f"--resume: {run_dir} was trained on a train split of "
                             f"{meta.get('data', {}).get('train_tokens')} tokens, {data.path} has "
                             f"{data.train_tokens}; resume with the run's own prepared data")
        stored = config
        config = _apply_overrides(config, overrides or {})
        _, launched, _ = distributed.env_world()
        asked_sharding = sharding or (plan.setup.sharding if plan is not None and plan.setup.sharding != "none"
                                      else None)
        setup = distributed.rescaled_for_world(saved_plan.setup, launched, asked_sharding)
        if setup != saved_plan.setup:  # another world size than the run was saved with: the same global batch
            saved_plan = dataclasses.replace(saved_plan, setup=setup, predicted=predicted_for(
                dataclasses.replace(saved_plan, setup=setup), profile))
        check_plan_for_data(saved_plan, data)
        if config.verify_data:
            data.verify()
        # ref None: again from step 0, from the weights it started from (a --from run's, checked unchanged)
        starting = starting_weights_again(meta, where, saved_plan) if ref is None and meta.get("base_hf") else None
        trainer = cls(run_dir, saved_plan, data, config, profile, device, ref, starting)
        trainer.base_hf = meta.get("base_hf")
        if any((overrides or {}).get(k) is not None for k in LIMITS):
            trainer.replaced_limits = {k: getattr(stored, k) for k in LIMITS}
            trainer._refit_schedule()
        return trainer

    def _refit_schedule(self) -> None:
        """A resume whose limits were replaced: the restored schedule made to end where the new limits do.

        A step or token limit ends a warmup-stable-decay schedule whose decay was not fixed yet with a
        decay over the last DECAY_SHARE of the new length (from this step on at the latest; its warmup, sized
        for the old estimate, cut to end by then); a cosine, or a
        decay already fixed, stays (past its end the rate is the floor). A time limit alone trains until its
        time is up: the schedule's end no longer stops the run (an unfixed decay is fixed by this process's
        clock, as in a new run)."""
        c, sched = self.config, self.schedule
        if sched is None:  # again from step 0: the schedule is fixed by open() for the new limits
            return
        ends = [n for n in (c.max_steps, math.ceil(c.max_tokens / self.setup.tokens_per_step)
                            if c.max_tokens is not None else None) if n is not None]
        if ends:
            if not sched.fixed:
                end = min(ends)
                last_stable = max(self.step, end - max(1, math.ceil(DECAY_SHARE * end)))
                # (a warmup sized for the time limit's estimate ends by the decay at the latest)
                self.schedule = dataclasses.replace(sched, warmup_steps=min(sched.warmup_steps, last_stable)
                                                    ).with_decay(last_stable, end - last_stable)
        else:
            self._schedule_ends_run = False

    def _build_model(self):
        """The model to train (finetuning builds it from a trained run instead: trainer/finetune.py)."""
        return build_model(self.plan.model, self.setup.attention, self.setup.checkpointing,
                           param_dtype(self.setup.precision), device=self.device)

    def _make_stream(self, micro_batch: int):
        """The training batches, resumable (finetuning streams its examples instead)."""
        return TrainStream(self.data, batch=micro_batch, ctx=self.setup.ctx, seed=self.config.seed,
                           rank=self.dist.rank, world_size=self.dist.world_size)

    def _make_optimizer(self):
        return make_optimizer(self.model, self.setup.optimizer, lr=self.config.lr,
                              weight_decay=self.config.weight_decay, betas=(self.config.beta1, self.config.beta2))

    def _make_scaler(self):
        if self.setup.precision != "fp16-mixed":
            return None
        return torch.amp.GradScaler(self.device.type)

    def _load(self, path: Path) -> tuple[dict, dict]:
        """(meta, state) of a checkpoint, its weights and optimizer state loaded into this run's model:
        a distributed run's shards (any world size, or one process), or a single-process checkpoint
        (in one process as saved; over several, from rank 0, each rank keeping its shards)."""
        # sharded only when meta.json says so (Trainer.resume verified every file it lists, and that it
        # lists every file): a directory planted in a checkpoint is never what decides how to load it
        if (ckpt.read_meta(path).get("distributed") or {}).get("sharded") == distributed.SHARDED_DIR:
            meta, state = ckpt.load_checkpoint(path, None, map_location=self.device, verify=False)
            distributed.load_sharded(path / distributed.SHARDED_DIR, self.wrapped, self.optimizer)
            return meta, {**state, "optimizer": None}
        if self.dist.world_size == 1:
            return ckpt.load_checkpoint(path, self.model, map_location=self.device, verify=False)
        meta, state = ckpt.load_checkpoint(path, None, map_location="cpu", verify=False)
        plain = plain_optimizer = None
        if self.is_main:
            plain = build_model(self.plan.model, self.setup.attention, self.setup.checkpointing,
                                param_dtype(self.setup.precision), device="cpu")
            ckpt.load_weights(plain, ckpt.read_weights(path / ckpt.MODEL_FILE), str(path / ckpt.MODEL_FILE))
            plain_optimizer = make_optimizer(plain, self.setup.optimizer, lr=self.config.lr,
                                             weight_decay=self.config.weight_decay,
                                             betas=(self.config.beta1, self.config.beta2))
            plain_optimizer.load_state_dict(state["optimizer"])
        distributed.load_single_process_state(self.wrapped, self.optimizer, plain, plain_optimizer, self.is_main)
        return meta, {**state, "optimizer": None}

    def _restore(self, meta: dict, state: dict) -> None:
        where = f"{self._resume_from.path / ckpt.STATE_FILE}"
        try:
            if state.get("optimizer") is not None:  # (a sharded checkpoint's is loaded already)
                self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.schedule = Schedule(**state["scheduler"])
            self.stream.load_state_dict(state["data"])
            ckpt.set_rng_state(state["rng"])
            self.step = int(state["step"])
            self.tokens = int(state["tokens"])
            self.train_seconds = float(state.get("train_seconds", 0.0))
            self.eval_every = state["eval_every"] if self.config.eval_every is None else self.config.eval_every
            self.save_every = state["save_every"] if self.config.save_every is None else self.config.save_every
            self.nonfinite_run = int(state.get("nonfinite_run", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: incomplete training state ({type(e).__name__}: {e}); the checkpoint "
                             "is corrupt") from None
        self.last_saved_step = self.step
        self.last_eval_step = self.step

    # ---- the loop ----------------------------------------------------------------------------------

    def on_event(self, callback: Callable[[records.Record], None]) -> None:
        """Call ``callback(record)`` for every metrics line (``trainer.records``), as it is written."""
        self._events.append(callback)

    def _emit(self, line: records.Record) -> None:
        if not self.is_main:  # rank 0 alone writes and reports
            return
        if self._writer is not None:
            with self._writing(self._writer.path):
                # train lines are flushed in batches (at most METRICS_FLUSH_SECONDS late); any other at once
                self._writer.write(line, flush=not isinstance(line, records.TrainLine) or self._writer.flush_due())
        for cb in self._events:
            cb(line)

    def _flush_metrics(self) -> None:
        """Every line written so far onto the file (before anything reads it: the report, the summary)."""
        if self._writer is not None:
            with self._writing(self._writer.path):
                self._writer.flush()

    def run(self) -> RunSummary:
        """Train until a stop criterion is met (or a signal arrives); returns what happened.

        Raises ``TrainingStopped`` (after logging and writing the report) when the run cannot go on.
        """
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for s in previous:
                signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread: no signal handling
            previous = {}
        try:
            self.open()
            while (reason := self._stop_reason()) is None:
                self.advance()
            return self._finish(reason)
        except (MemoryError, RuntimeError, ImportError, OSError) as e:  # a step's own are backed off from
            message = memory_failure(e)
            if message is None:
                raise
            stopped = TrainingStopped(f"step {self.step}: out of memory outside a training step ({message}); "
                                      f"{self._newest_checkpoint_note()}; free memory (or raise `ulimit -v`), "
                                      "then continue it with --resume")
            raise stopped from None
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.close()

    def open(self) -> None:
        """Start writing the run: directories, plan.toml, metrics.jsonl, the schedule, the start line.
        (``run`` calls it; call it yourself only to drive the loop with ``advance``.)"""
        self._started = self._report_written = time.perf_counter()  # the first refresh a minute in
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self._resume_from is None:  # what this run is, before anything else of it is written
                with self._writing(self.run_dir / rundir.RUN_FILE):
                    rundir.write_record(self.run_dir, self.record())
            with self._writing(self.run_dir / CHECKPOINT_DIR):
                (self.run_dir / CHECKPOINT_DIR).mkdir(exist_ok=True)
            if self._resume_from is None or self._plan_on_disk_differs():  # (resumed at another world size)
                with self._writing(self.run_dir / PLAN_FILE):
                    self.plan.save(self.run_dir / PLAN_FILE)
            with self._writing(self.run_dir / METRICS_FILE):
                self._writer = _MetricsWriter(self.run_dir / METRICS_FILE)
        if self.schedule is None:
            self.schedule = self._fix_schedule(self._started)
            # timed probe steps fix a time-limited run's length: every rank takes rank 0's
            self.schedule, self.eval_every, self.save_every = distributed.from_rank0(
                (self.schedule, self.eval_every, self.save_every))
        self._emit(self._start_line())

    def _plan_on_disk_differs(self) -> bool:
        try:
            return Plan.load(self.run_dir / PLAN_FILE).setup != self.setup
        except (InputError, OSError):
            return True

    def close(self) -> None:
        self.monitor.close()
        if self._writer is not None:
            try:
                self._flush_metrics()
            except (DiskFull, OSError):  # closing after a failure: lines that could not be written are lost (the
                pass  # run's checkpoints are not); a run that ends normally flushed them in _finish already
            self._writer.close()
        if self._lock is not None:
            self._lock.release()

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.stop_signal = int(signum)

    def _fix_schedule(self, started: float) -> Schedule:
        """The schedule's length: from --max-steps / --tokens, or for --max-minutes alone from timed steps."""
        c = self.config
        tokens_per_step = self.setup.tokens_per_step
        candidates = []
        if c.max_steps is not None:
            candidates.append(c.max_steps)
        if c.max_tokens is not None:
            candidates.append(max(1, math.ceil(c.max_tokens / tokens_per_step)))
        kind = "cosine"
        if candidates:
            total = min(candidates)
        elif c.max_minutes is not None:  # an estimate until the decay starts (see Schedule)
            total = self._probe_steps(c.max_minutes * 60.0 - (time.perf_counter() - started))
            kind = "wsd"
        else:  # one epoch of the train split
            total = max(1, len(self.stream.epoch_plan(0)[1]) // (self.stream.global_batch * self.setup.grad_accum))
        warmup = c.warmup_steps if c.warmup_steps is not None else default_warmup(total)
        if self.eval_every is None:
            self.eval_every = default_eval_every(total)
        if self.save_every is None:
            self.save_every = self.eval_every or default_eval_every(total)
        return Schedule(peak_lr=c.lr, min_lr=c.lr * c.min_lr_ratio, warmup_steps=min(warmup, total),
                        total_steps=total, kind=kind)

    def _probe_steps(self, budget_seconds: float) -> int:
        """How many steps fit in ``budget_seconds``, from PROBE_STEPS real steps timed at learning rate 0 (the
        weights do not move; optimizer and scaler state are reset after) and one timed evaluation.

        Evaluations get at most EVAL_TIME_SHARE of the budget: with the default cadence, as many of
        EVALS_PER_RUN as fit in it (sets ``eval_every``; 0 means only the final one)."""
        data_state = self.stream.state_dict()
        batches = [self._to_device(next(self.stream)) for _ in range(self.setup.grad_accum)]
        self.stream.load_state_dict(data_state)
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        times = []
        for _ in range(PROBE_STEPS):
            t0 = time.perf_counter()
            result = self._train_step(batches)
            float(result.loss)
            times.append(time.perf_counter() - t0)
        del batches
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        self.scaler = self._make_scaler()
        step_seconds = times[-1]
        t0 = time.perf_counter()
        self._evaluate(step=0, emit=False)
        eval_seconds = time.perf_counter() - t0
        self._eval_seconds.append(eval_seconds)
        budget = budget_seconds * (1.0 - TIME_LIMIT_ALLOWANCE) - sum(times) - eval_seconds  # the final eval
        if self.config.eval_every is None:
            evals = max(0, min(EVALS_PER_RUN, int(EVAL_TIME_SHARE * budget / max(eval_seconds, 1e-9))))
            total = max(1, int((budget - evals * eval_seconds) / step_seconds))
            self.eval_every = total // evals if evals and total >= evals else 0
            return total
        # evaluations every k steps: each step carries 1/k of one
        return max(1, int(budget / (step_seconds + eval_seconds / self.config.eval_every)))

    def planned_steps(self) -> int | None:
        """The step this run is planned to end at: its step or token limit (the nearer), else the schedule's
        end (one epoch, or for a time limit the estimate from timed steps). A time limit may stop it earlier.
        None for a resume given a new time limit alone after its schedule's end (nothing estimates it)."""
        c = self.config
        ends = [n for n in (c.max_steps, math.ceil(c.max_tokens / self.setup.tokens_per_step)
                            if c.max_tokens is not None else None) if n is not None]
        if not ends and not self._schedule_ends_run:
            return None
        return max(self.step, min(ends) if ends else self.schedule.total_steps)

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
            predicted=self.predicted, schedule=self.schedule.to_dict(),
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

    def _to_device(self, xy):
        x, y = xy
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def _train_step(self, batches):
        return train_step(self.step_model, self.optimizer, batches, self.setup, self.device.type, scaler=self.scaler,
                          clip=self.config.clip or None)

    def _stop_reason(self) -> str | None:
        if self.dist.world_size == 1:
            return self._local_stop_reason()
        # a signal any rank received stops them all; the clock's verdict is rank 0's
        signum = distributed.max_across_ranks(self.stop_signal or 0, self.device)
        if signum and self.stop_signal is None:
            self.stop_signal = signum
        return distributed.from_rank0(self._local_stop_reason())

    def _local_stop_reason(self) -> str | None:
        c = self.config
        if self.stop_signal is not None:
            return "interrupted"
        if c.max_steps is not None and self.step >= c.max_steps:
            return "max_steps"
        if c.max_tokens is not None and self.tokens >= c.max_tokens:
            return "max_tokens"
        if c.max_steps is None and c.max_tokens is None and self.schedule.fixed and self._schedule_ends_run \
                and self.step >= self.schedule.total_steps:
            return "max_minutes" if c.max_minutes is not None else "epoch"
        if c.max_minutes is not None and time.perf_counter() - self._started >= c.max_minutes * 60.0 * (
                1.0 - TIME_LIMIT_ALLOWANCE):
            return "max_minutes"
        return None

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
        self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
        line = records.TrainLine(
            step=step, loss=_finite_or_none(loss),
            tokens_per_second=self.setup.tokens_per_step / seconds, lr=lr,
            grad_norm=_finite_or_none(grad_norm), tokens=self.tokens, step_seconds=seconds,
            time=self.train_seconds, mfu=self.flops_per_step / seconds / self.peak_flops,
            memory_bytes=memory.peak_bytes, memory_step=self._memory_step,
            micro_batch=self.setup.micro_batch,
            grad_accum=self.setup.grad_accum, skipped=skipped,
            eta_seconds=self._eta(),
            total_steps=self.schedule.total_steps,
            memory_allocated_bytes=memory.allocated_bytes,
            nonfinite=None if finite else str(loss),
        )
        self._emit(line)
        if not finite:
            self._emit(records.NonfiniteEvent(step=step, loss=str(loss), in_a_row=self.nonfinite_run, lr=lr))
            if self.nonfinite_run >= self.config.max_nonfinite:
                self._write_report()
                raise TrainingStopped(
                    f"step {step}: the loss was not finite ({loss}) for {self.nonfinite_run} steps in a row, "
                    f"so the run stopped (updates were skipped; the newest checkpoint is from step "
                    f"{max(self.last_saved_step, 0)}); lower the learning rate (--lr, now {self.config.lr:g}), "
                    + ("use bf16-mixed instead of fp16-mixed, " if self.setup.precision == "fp16-mixed" else "")
                    + "or lower --clip, then start again or --resume")
        if self.eval_every and step % self.eval_every == 0:
            self._evaluate(step)
        if self.save_every and step % self.save_every == 0:
            self.save()
        return line

    def _maybe_start_decay(self) -> None:
        """wsd: once DECAY_SHARE of the time is left, fix the decay's length from the measured step time
        (the median of the latest steps, plus the evaluations' share) and log it."""
        budget = self.config.max_minutes * 60.0 * (1.0 - TIME_LIMIT_ALLOWANCE)
        elapsed = time.perf_counter() - self._started
        if elapsed < budget * (1.0 - DECAY_SHARE) or not self._recent or self.step <= self.schedule.warmup_steps:
            return
        per_step = statistics.median(self._recent)
        if self.eval_every and self._eval_seconds:
            per_step += statistics.median(self._eval_seconds) / self.eval_every
        final_eval = statistics.median(self._eval_seconds) if self._eval_seconds else 0.0
        steps = int((budget - elapsed - final_eval) / per_step)
        self.schedule = self.schedule.with_decay(self.step, steps)
        self._emit(records.DecayEvent(step=self.step, decay_steps=max(1, steps),
                                      total_steps=self.schedule.total_steps, seconds_left=budget - elapsed,
                                      step_seconds=per_step))

    @property
    def elapsed_seconds(self) -> float:
        """Wall-clock seconds since this invocation started training (what --max-minutes counts)."""
        return time.perf_counter() - self._started

    def _eta(self) -> float:
        """Seconds left: steps to the nearest step or token limit (else the schedule's end) at the median
        recent step time, or the time left when a time limit comes first. A time-limited run whose length is
        not fixed yet (wsd before its decay) runs until its time is up: its ETA is the time left (its
        ``total_steps`` is only the probe steps' estimate, which the run may pass)."""
        c = self.config
        steps_left = self.schedule.total_steps - self.step
        if c.max_steps is not None:
            steps_left = c.max_steps - self.step
        if c.max_tokens is not None:
            steps_left = min(steps_left, math.ceil((c.max_tokens - self.tokens) / self.setup.tokens_per_step))
        eta = max(0, steps_left) * statistics.median(self._recent)
        if c.max_minutes is not None:
            left = max(0.0, c.max_minutes * 60.0 - self.elapsed_seconds)
            eta = min(eta, left) if self.schedule.fixed else left
        return eta

    def _run_step(self, step: int):
        """One optimizer step, redone with half the micro-batch when it runs out of memory."""
        while True:
            data_state = self.stream.state_dict()
            batches = [self._to_device(next(self.stream)) for _ in range(self.setup.grad_accum)]
            measure = self._memory_due()
            if measure:
                self.monitor.reset()
            oom = None
            t0 = time.perf_counter()
            try:
                result = self._train_step(batches)
                loss = float(distributed.mean_across_ranks(result.loss))  # waits for the device
                seconds = time.perf_counter() - t0
                grad_norm = float(result.grad_norm)
                self._memory_clock += seconds
                if measure:
                    memory = self.monitor.read()
                    if self.dist.world_size > 1 and memory.peak_bytes is not None:  # the fullest device
                        memory = dataclasses.replace(memory, peak_bytes=distributed.max_across_ranks(
                            memory.peak_bytes, self.device))
                    self._memory, self._memory_step, self._memory_at = memory, step, self._memory_clock
                    self._memory_reads += 1
                return loss, grad_norm, bool(result.skipped), seconds, self._memory
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                oom = out_of_memory(e)
                if oom is None:
                    raise
            # outside the except block, so the traceback no longer pins the step's tensors
            del batches
            if self.dist.world_size > 1:
                raise TrainingStopped(
                    f"step {step}: out of memory on rank {self.dist.rank} ({oom}); the ranks of a distributed run "
                    "cannot shrink their micro-batch one by one: re-plan with `memplan autotune --world-size "
                    f"{self.dist.world_size}` (FSDP shards the model), or use --checkpointing full")
            self._recover_from_oom(step, data_state, oom)

    def _memory_due(self) -> bool:
        """Whether this step's memory is measured (the monitor reset before it, read after it). Reading it
        costs /proc reads (CPU) or driver queries (GPU) that a step need not pay: one process measures the
        first two steps of an invocation (and of a new micro-batch: the first allocates the optimizer state,
        the second is the steady state the report takes), then a step once MEMORY_SAMPLE_SECONDS of training
        have passed since the last measured one; the lines between carry that reading, with
        ``memory_step`` naming the step it measured. Several processes measure every step (each rank's
        decision must be the same, and the largest over the ranks is a collective)."""
        return self.dist.world_size > 1 or self._memory_reads < 2 or \
            self._memory_clock - self._memory_at >= MEMORY_SAMPLE_SECONDS

    def _recover_from_oom(self, step: int, data_state: dict, message: str) -> None:
        self._memory_reads = 0  # the next steps, at the new micro-batch, are measured
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        old = self.setup
        if old.micro_batch == 1:
            self._write_report()
            raise TrainingStopped(
                f"step {step}: out of memory at micro-batch 1 ({message}); nothing smaller to try: use "
                "--checkpointing full, a shorter --ctx, a smaller model, or let `memplan autotune` plan it")
        # halve the micro-batch, double the accumulation; an odd micro-batch m goes to its largest
        # divisor d < m with the accumulation times m/d, so the global batch never changes
        new_micro = max(d for d in range(1, old.micro_batch) if old.micro_batch % d == 0)
        new_accum = old.grad_accum * (old.micro_batch // new_micro)
        self.setup = old.replace(micro_batch=new_micro, grad_accum=new_accum)
        self.plan = dataclasses.replace(self.plan, setup=self.setup)
        self.predicted = predicted_for(self.plan, self.profile)
        self.flops_per_step = model_flops_per_step(self.plan)
        stream = self._make_stream(new_micro)
        stream.load_state_dict(data_state)  # the same windows, in the same order, in smaller pieces
        self.stream = stream
        if self.scaler is not None:  # a step cut short may have left the scaler mid-step
            scaler_state = self.scaler.state_dict()
            self.scaler = self._make_scaler()
            self.scaler.load_state_dict(scaler_state)
        with self._writing(self.run_dir / PLAN_FILE):
            self.plan.save(self.run_dir / PLAN_FILE)
        self._emit(records.OomEvent(step=step, time=self.train_seconds, message=message,
                                    micro_batch=new_micro, grad_accum=new_accum,
                                    previous={"micro_batch": old.micro_batch, "grad_accum": old.grad_accum},
                                    predicted=self.predicted))

    # ---- evaluation ------------------------------------------------------------------------------

    def sample_prompts(self) -> list[str]:
        """The configured prompts, else the start of each source's first held-out document."""
        return list(self.config.prompts) or default_prompts(self.data, self.tokenizer)

    def evaluate(self) -> dict:
        """Held-out loss per source and overall, and perplexity (``evaluate`` with this run's settings)."""
        return evaluate(self.model, self.data, self.setup, self.device, self.config.eval_batches)

    def samples(self, step: int) -> list[dict]:
        """One sample per prompt, seeded by the run's seed, the step and the prompt's index."""
        if not self.config.sample_tokens:
            return []
        return [{"prompt": prompt,
                 "text": sample_text(self.model, self.tokenizer, prompt, self.config.sample_tokens, ctx=self.setup.ctx,
                                     seed=self.config.seed * 1_000_003 + step * 101 + i,
                                     precision=self.setup.precision)}
                for i, prompt in enumerate(self.sample_prompts())]

    def _evaluate(self, step: int, emit: bool = True) -> records.EvalLine | None:
        t0 = time.perf_counter()
        oom = None
        try:
            result = self.evaluate()
            samples = self.samples(step)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            oom = out_of_memory(e)
            if oom is None:
                raise
        if oom is not None:  # outside the except block, so the traceback no longer pins tensors
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if emit:
                self.last_eval_step = step
                self._emit(records.EvalOomEvent(step=step, message=oom))
            return None
        if not emit:
            return None
        self.last_eval_step = step
        if not result:
            return None
        self._eval_seconds = (self._eval_seconds + [time.perf_counter() - t0])[-ETA_WINDOW:]
        line = records.EvalLine(step=step, **{k: _json_safe(v) for k, v in result.items()},
                                samples=samples, eval_seconds=self._eval_seconds[-1], tokens=self.tokens)
        self.last_eval = line
        self._emit(line)
        return line

    # ---- checkpoints and the end ---------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "scheduler": self.schedule.to_dict(),
            "data": self.stream.state_dict(),
            "rng": ckpt.rng_state(),
            "step": self.step, "tokens": self.tokens, "train_seconds": self.train_seconds,
            "eval_every": self.eval_every, "save_every": self.save_every, "nonfinite_run": self.nonfinite_run,
        }

    def record(self) -> dict:
        """RUN/run.json: what this run is (plan, config with its limits, data, tokenizer), as a
        checkpoint's meta.json has it, so that a resume reads either the same way."""
        tok = self.data.manifest["tokenizer"]
        return {
            "kind": self.run_kind,
            "plan": self.plan.to_dict(), "config": self.config.to_dict(), "tokenizer_sha256": tok["sha256"],
            "tokenizer": {k: tok[k] for k in ("kind", "spec", "vocab_size", "eot_id", "eot_token", "sha256",
                                              "encoding") if k in tok},
            "data": {"path": str(Path(self.data.path).resolve()), "train_tokens": self.data.train_tokens,
                     "sources": list(self.data.source_names)},
            "device": self.profile.name, "torch": torch.__version__, "created_unix_time": time.time(),
            **({"base_hf": self.base_hf} if self.base_hf else {}),
        }

    def meta(self) -> dict:
        tok = self.data.manifest["tokenizer"]
        return {
            "tokens": self.tokens, "plan": self.plan.to_dict(), "config": self.config.to_dict(),
            "schedule": self.schedule.to_dict(), "tokenizer_sha256": tok["sha256"],
            "tokenizer": {k: tok[k] for k in ("kind", "spec", "vocab_size", "eot_id", "eot_token", "sha256",
                                              "encoding") if k in tok},
            "data": {"path": str(self.data.path.resolve()), "train_tokens": self.data.train_tokens,
                     "sources": list(self.data.source_names)},
            "torch": torch.__version__, "device": self.profile.name, "torch_device": str(self.device),
            "saved_unix_time": time.time(), **({"base_hf": self.base_hf} if self.base_hf else {}),
        }

    def save(self) -> Path:
        """Checkpoint now (atomically), keep the newest ``keep``, refresh the report."""
        t0 = time.perf_counter()
        extra = {}
        if self.tokenizer.kind != "tiktoken":
            extra[TOKENIZER_FILE] = self.tokenizer.to_json_str().encode("utf-8")
        with self._writing(self.run_dir / CHECKPOINT_DIR / ckpt.checkpoint_name(self.step)):
            if self.dist.world_size > 1:
                path = self._save_distributed(extra)
            else:
                path = ckpt.save_checkpoint(self.run_dir / CHECKPOINT_DIR, self.step, self.model, self.state(),
                                            self.meta(), keep=self.config.keep, extra_files=extra)
        self.last_saved_step = self.step
        if self._writer is not None:
            with self._writing(self._writer.path):
                self._writer.sync()
        self._emit(records.CheckpointEvent(step=self.step, path=str(path), seconds=time.perf_counter() - t0))
        if time.perf_counter() - self._report_written >= REPORT_REFRESH_SECONDS:
            self._write_report()
        return path

    def _save_distributed(self, extra: dict[str, bytes]) -> Path:
        """Every rank writes its shards of the model and optimizer (torch.distributed.checkpoint) into
        the checkpoint's temporary directory; rank 0 adds the whole weights (gathered: what generate and
        export read), the rest of the state, the meta, and renames it into place."""
        directory = self.run_dir / CHECKPOINT_DIR
        tmp = distributed.from_rank0(ckpt.temporary_dir(directory, self.step))
        if self.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            ckpt.clean_leftovers(directory)
            (tmp / distributed.SHARDED_DIR).mkdir(parents=True)
        distributed.barrier()
        distributed.save_sharded(tmp / distributed.SHARDED_DIR, self.wrapped, self.optimizer)
        weights = distributed.full_weights(self.wrapped)
        distributed.barrier()
        path = directory / ckpt.checkpoint_name(self.step)
        if self.is_main:
            weights = {ckpt.canonical_name(k): v.contiguous() for k, v in weights.items()
                       if not (self.plan.model.tied and k == "head.weight")}  # tied: stored once, as the model's
            state = {k: v for k, v in self.state().items() if k != "optimizer"}
            meta = {**self.meta(), "distributed": {"world_size": self.dist.world_size, "sharding": self.setup.sharding,
                                                   "sharded": distributed.SHARDED_DIR}}
            path = ckpt.save_checkpoint(directory, self.step, None, state, meta, keep=self.config.keep,
                                        extra_files=extra, weights=weights, tmp=tmp)
        distributed.barrier()
        return path

    @contextlib.contextmanager
    def _writing(self, path: Path, report: bool = False):
        """Writes of ``path`` within: a full disk (``memplan.fsutil.no_space``, however torch reported it)
        becomes one ``DiskFull`` line naming the file, the step and the newest checkpoint (which is intact)."""
        try:
            yield
        except DiskFull:
            raise
        except BaseException as e:
            err = no_space(e)
            if err is None:
                raise
            if report:
                then = f"free space, then `memplan train --report --out {self.run_dir}`"
            else:
                then = "free space, then continue it with --resume"
            what = "no space left on device" if err.errno == errno.ENOSPC else str(err.strerror or err).lower()
            raise DiskFull(f"{path}: {what} at step {self.step}; {self._newest_checkpoint_note()}; {then}") from None

    def _newest_checkpoint_note(self) -> str:
        """Which checkpoint a run that stops now leaves to resume from."""
        try:
            newest = ckpt.latest_checkpoint(self.run_dir / CHECKPOINT_DIR)
        except OSError:
            newest = None
        return f"the newest checkpoint, {newest.path.name}, is intact" if newest else "no checkpoint was saved"

    def _write_report(self) -> Path | None:
        from memplan.reports.run import write_run_report

        if not self.is_main:
            return None

        self._report_written = time.perf_counter()
        self._flush_metrics()  # the report reads metrics.jsonl
        try:
            with self._writing(self.run_dir / REPORT_FILE, report=True):
                return write_run_report(self.run_dir)
        except DiskFull:  # the run's checkpoints are saved; nothing more can be written
            raise
        except Exception as e:  # a report must never cost the run
            self._emit(records.ReportFailedEvent(step=self.step, error=f"{type(e).__name__}: {e}"[:300]))
            return None

    def _finish(self, reason: str) -> RunSummary:
        if self.step > self.last_eval_step:
            self._evaluate(self.step)
        checkpoint = None
        if self.step > self.last_saved_step:
            checkpoint = self.save()
        else:
            ref = ckpt.latest_checkpoint(self.run_dir / CHECKPOINT_DIR)
            checkpoint = ref.path if ref else None
        self._flush_metrics()
        last_train = next((r for r in reversed(rundir.metric_records(self.run_dir))
                           if isinstance(r, records.TrainLine)), None) if self.is_main else None
        self._emit(records.StopEvent(step=self.step, reason=reason, tokens=self.tokens, time=self.train_seconds,
                                     wall_seconds=time.perf_counter() - self._started,
                                     signal=signal.Signals(self.stop_signal).name if self.stop_signal else None))
        report = self._write_report()
        return RunSummary(run_dir=self.run_dir, step=self.step, tokens=self.tokens, stop_reason=reason,
                          train_seconds=self.train_seconds, last_loss=last_train.loss if last_train else None,
                          last_eval=self.last_eval, checkpoint=checkpoint, report=report,
                          samples=self.last_eval.samples if self.last_eval else [], first_step=self.first_step,
                          wall_seconds=self.elapsed_seconds)


def _ppl(loss: float) -> float | None:
    try:
        return math.exp(loss) if math.isfinite(loss) else None
    except OverflowError:
        return None


def _json_safe(v):
    if isinstance(v, float):
        return _finite_or_none(v)
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    return v


# =================================================================================================
# Evaluation
# =================================================================================================

PROMPT_TOKENS = 12  # default prompts: at most this many tokens of a held-out document, cut at a word


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PreparedData, setup: TrainSetup, device: torch.device,
             max_batches: int) -> dict:
    """Mean next-token loss on held-out windows: per source (``max_batches`` batches of ``setup.micro_batch``
    windows of ``setup.ctx`` tokens, evenly spaced over the source's val split) and overall (the mean over
    every evaluated token), with perplexities. Empty when no source holds a full window."""
    was_training = model.training
    model.eval()
    by_source, tokens_by_source = {}, {}
    total_loss, total_tokens = 0.0, 0
    try:
        for s in data.sources:
            loss_sum, n = 0.0, 0
            for x, y in data.val_batches(s.name, batch=setup.micro_batch, ctx=setup.ctx, max_batches=max_batches):
                x, y = x.to(device), y.to(device)
                with autocast(setup.precision, device.type):
                    logits = model(x)
                loss_sum += float(lm_loss(logits, y)) * y.numel()
                n += y.numel()
                del logits
            if n:
                by_source[s.name], tokens_by_source[s.name] = loss_sum / n, n
                total_loss += loss_sum
                total_tokens += n
    finally:
        model.train(was_training)
    if not total_tokens:
        return {}
    overall = total_loss / total_tokens
    return {"eval_loss": overall, "eval_ppl": _ppl(overall), "eval_tokens": total_tokens,
            "eval_loss_by_source": by_source, "eval_ppl_by_source": {k: _ppl(v) for k, v in by_source.items()},
            "eval_tokens_by_source": tokens_by_source}


def default_prompts(data: PreparedData, tokenizer) -> list[str]:
    """The first words (up to PROMPT_TOKENS tokens, cut after the last whole word) of each source's
    first held-out document: prompts in the corpus's own style, the same on every run."""
    prompts = []
    for s in data.sources:
        n = min(s.val_tokens, PROMPT_TOKENS + 1)
        ids = [i for i in data.val.read(s.val_offset, n).tolist() if i != data.eot_id][:PROMPT_TOKENS] if n else []
        text = tokenizer.decode(ids) if ids else ""
        cut = max(text.rfind(" "), text.rfind("\n"))
        if cut > 0:
            text = text[:cut]
        text = text.rstrip()
        if text and text not in prompts:
            prompts.append(text)
    return prompts or ["The"]


# =================================================================================================
# Checks before anything is written
# =================================================================================================

def _lock_run(run_dir: Path) -> "rundir.RunLock | None":
    """The run's lock, taken by the process that writes it (rank 0 of a distributed run)."""
    rank, _, _ = distributed.env_world()
    return rundir.lock_run(run_dir) if rank == 0 else None


def check_metrics_file(run_dir: Path) -> None:
    """RUN/metrics.jsonl is appended to: it must be a plain file (a symlink would send the run's lines elsewhere)."""
    path = run_dir / METRICS_FILE
    if path.is_symlink():
        raise InputError(f"--out {run_dir}: its {METRICS_FILE} is a symbolic link; refusing to write through it")
    if path.exists() and not path.is_file():
        raise InputError(f"--out {run_dir}: its {METRICS_FILE} is not a regular file")


def check_run_dir_free(run_dir: Path) -> None:
    """A new run needs an absent or empty directory (or one that is not a run: then it must be empty);
    the lock file of the process checking and the launch file of ``memplan train --nproc`` do not count."""
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--out {run_dir}: is a file; give a directory for the run")
    if run_dir.is_dir() and any(p.name not in rundir.NOT_A_RUN for p in run_dir.iterdir()):
        if any(os.path.lexists(run_dir / n) for n in (METRICS_FILE, CHECKPOINT_DIR, rundir.RUN_FILE)):
            raise InputError(f"--out {run_dir}: already holds a run; add --resume to continue it, or choose "
                             "another --out")
        raise InputError(f"--out {run_dir}: exists and is not empty; give a new or empty directory")


_SPEC_IGNORED = ("name", "source")  # where a shape came from does not change it
_RUN_CONTROL = ("max_steps", "max_tokens", "max_minutes", "save_every", "eval_every", "eval_batches", "keep",
                "sample_tokens", "prompts", "verify_data", "max_nonfinite")


def check_same_plan(saved: Plan, asked: Plan, run_dir: Path) -> None:
    """The plan given on a resume must be the run's: same model shape, same setup (the micro-batch may
    have been halved after an out-of-memory step, so only the global batch is compared)."""
    a = {k: v for k, v in saved.model.to_dict().items() if k not in _SPEC_IGNORED}
    b = {k: v for k, v in asked.model.to_dict().items() if k not in _SPEC_IGNORED}
    diff = [k for k in a if a[k] != b.get(k)]
    if diff:
        k = diff[0]
        raise InputError(f"--resume: {run_dir} trains a model with {k} = {a[k]!r}, this command asks for "
                         f"{b.get(k)!r}; drop the model options to resume it, or start a new run with another --out")
    s, t = saved.setup, asked.setup
    for k in ("ctx", "precision", "attention", "checkpointing", "optimizer", "compile"):
        if getattr(s, k) != getattr(t, k):
            raise InputError(f"--resume: {run_dir} trains with {k} = {getattr(s, k)!r}, this command asks for "
                             f"{getattr(t, k)!r}; drop the option to resume it, or start a new run with another --out")
    if s.micro_batch * s.grad_accum * s.world_size != t.micro_batch * t.grad_accum * t.world_size:
        raise InputError(f"--resume: {run_dir} trains with a global batch of {s.micro_batch} × {s.grad_accum} × "
                         f"{s.world_size} sequences, this command asks for {t.micro_batch} × {t.grad_accum} × "
                         f"{t.world_size}; drop --batch/--grad-accum to resume it")


def _apply_overrides(config: TrainConfig, overrides: dict) -> TrainConfig:
    """The run's config with the run-control settings given on a resume. The limits (LIMITS) go together:
    any given replaces the run's three (those not given are lifted); none given keeps the run's."""
    changes = {}
    if any(overrides.get(k) is not None for k in LIMITS):
        changes.update({k: overrides.get(k) for k in LIMITS})
    for k, v in overrides.items():
        if v is None:
            continue
        if k in _RUN_CONTROL:
            changes[k] = tuple(v) if k == "prompts" else v
        elif getattr(config, k) != v:
            raise InputError(f"--resume: the run trains with {k.replace('_', '-')} = {getattr(config, k)!r}, this "
                             f"command asks for {v!r}; drop --{k.replace('_', '-')} to resume it")
    return config.replace(**changes) if changes else config


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
    model = build_model(plan.model, plan.setup.attention, "none", param_dtype(plan.setup.precision), device=device)
    if plan.setup.lora_rank:  # a LoRA finetune: its adapters, folded into the weights once loaded
        from trainer.lora import apply_lora, merge_lora

        lora = meta.get("finetune", {}).get("lora", {})
        apply_lora(model, plan.setup.lora_rank, float(lora.get("alpha", 16.0)), plan.setup.lora)
    ckpt.load_weights(model, ckpt.read_weights(path / ckpt.MODEL_FILE), str(path / ckpt.MODEL_FILE))
    if plan.setup.lora_rank:
        merge_lora(model)
    model.eval()
    return model, trained.tokenizer(), meta
