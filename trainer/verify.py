"""``memplan autotune --verify``: run a few real training steps of a plan on this machine, measure them, step down.

Every trial runs in a process of its own. On Linux a small server (``python -m trainer.verify
serve``) imports torch once, never runs an op, and forks one child per trial; elsewhere each trial
is a new interpreter. A process per trial matters twice:

- running out of memory is an exception on CUDA, ROCm and Apple GPUs but, on a CPU, usually a
  SIGKILL from the kernel's out-of-memory killer; the child absorbs either and the parent reports it;
- each measurement starts clean: no caching allocator holding an earlier trial's blocks, no pages
  resident from it.

For ``autotune --stack transformers|litgpt|torchtune`` a trial runs that library's own code instead
(``trainer.stacks.trial_steps``): transformers' ``Trainer`` with the ``TrainingArguments`` (and peft
``LoraConfig``) that ``--emit`` writes for the plan, litgpt's ``GPT`` and its scripts' step, torchtune's
builders and its recipes' step (the twins ``trainer/stacks/*.py`` that ``memplan trace`` runs on fake
tensors), measured as below. The library is imported in the trial after its CPU baseline, so its code's
resident memory is in the growth, as the plan's ``model_code`` term predicts it.

A trial of memplan's own stack builds the trainer's model (``trainer.model.build_model``) and runs ``steps`` real steps of
``trainer.step.train_step`` with the plan's micro-batch, checkpointing, attention, precision
(``fp16-mixed`` with a ``GradScaler``), optimizer and ``torch.compile``. A step runs at most
``max_micro_batches`` of the plan's micro-batches: with accumulation every gradient is held from
the first micro-batch on, so the peak of a step of 2 or 4 micro-batches is that of one of 64 (the
inputs of all of them are made and held, as in a real step); tokens/s is measured on the step that
ran and compared with the prediction for that same step. The first step is a warm-up (optimizer
state appears, kernels load); tokens/s is that of the median of the others. The peak is over all steps.

What "measured peak" means, per platform, so that it compares with the predicted ``peak_reserved``:

- CUDA / ROCm: ``torch.cuda.max_memory_reserved()`` over the trial, plus what the device holds
  outside the allocator at its end (``mem_get_info`` used − ``memory_reserved()``: the CUDA/HIP
  context and libraries; on a GPU shared with other processes, theirs too).
- Apple (MPS): the largest ``torch.mps.driver_allocated_memory()`` after a step, plus the profile's
  runtime context (the Metal context is not separately measurable).
- CPU: the profile's runtime context plus the growth of the process's resident memory, from a
  baseline taken after a warm-up step of a tiny model of the same configuration (which loads the
  code of every kernel the step uses) to the kernel's high-water mark (``VmHWM``, reset with
  ``/proc/self/clear_refs``). The growth counts live tensors and everything the C allocator and the
  libraries keep besides; the context is the profile's figure, as in the prediction, so the two
  differ only by what the memory model does not see. The absolute peak RSS is reported beside it.
  ``--budget`` is checked against this figure, so the whole loop runs on a CPU.

Stepping down: candidates are tried in the objective's order (``AutotuneResult.ranked_fitting``).
A measured overshoot (measured − predicted) is carried forward: a later candidate is tried only if
its prediction plus the largest overshoot seen fits the budget. After an out-of-memory, only
candidates predicted to need less than the one that failed are tried.

The parent process (the CLI) never imports torch; only the trial processes do.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memplan.errors import InputError
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup
from trainer import device as devices

DEFAULT_STEPS = 3  # per trial: one warm-up step, two timed (Lightning's BatchSizeFinder also runs 3 per trial)
DEFAULT_MAX_MICRO_BATCHES = 4  # micro-batches a trial step runs at most (the peak is the same with more)
DEFAULT_MAX_PLANS = 6  # plans tried at most before giving up
WARMUP_CTX = 16  # the tiny warm-up model's context (CPU only)
# (attention, checkpointing, optimizer) the trial server runs once on the CPU before forking any trial
SERVER_WARM_UPS = tuple((a, c, o) for a in ("sdpa", "eager") for c in ("none", "selective", "full")
                        for o in ("adamw", "adamw-fused"))

# Substrings of the messages PyTorch raises when memory runs out, lower-cased:
OOM_MARKERS = (
    "out of memory",  # "CUDA out of memory", "HIP out of memory", "MPS backend out of memory"
    "can't allocate memory",  # CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate ..."
    "cannot allocate memory",  # ENOMEM from the OS
    "not enough memory",  # CPU on Windows: "DefaultCPUAllocator: not enough memory"
    "cublas_status_alloc_failed",  # cuBLAS could not allocate its workspace
    "hiperroroutofmemory", "cudaerrormemoryallocation",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory, on CUDA, ROCm/HIP, MPS or CPU."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
        if oom_type is not None and isinstance(exc, oom_type):
            return True
    message = str(exc).lower()
    return any(marker in message for marker in OOM_MARKERS)


# ---- one trial, inside its own process ---------------------------------------------------

def _warm_up(spec: ModelSpec, setup: TrainSetup, device: str, steps: int = 2) -> None:
    """Steps of a tiny model with the plan's configuration: loads every kernel's code (tens of MB of
    resident pages on a CPU) so that the baseline after it holds them and the growth is the plan's."""
    import torch

    from trainer.model import build_model
    from trainer.step import make_optimizer, param_dtype, train_step

    tiny = spec.replace(layers=1, hidden=32, heads=2, kv_heads=1 if spec.kv_heads < spec.heads else 2, ffn=64,
                        vocab=64, name="warm-up")
    warm = setup.replace(ctx=min(setup.ctx, WARMUP_CTX), micro_batch=1, grad_accum=min(2, setup.grad_accum),
                         compile=False)
    model = build_model(tiny, warm.attention, warm.checkpointing, param_dtype(warm.precision), device=device)
    optimizer = make_optimizer(model, warm.optimizer)
    batches = [(torch.randint(0, tiny.vocab, (1, warm.ctx), device=device),
                torch.randint(0, tiny.vocab, (1, warm.ctx), device=device)) for _ in range(warm.grad_accum)]
    for _ in range(steps):
        train_step(model, optimizer, batches, warm, device)
    del model, optimizer, batches
    gc.collect()


def _memplan_steps(spec: ModelSpec, setup: TrainSetup, run_setup: TrainSetup, steps: int, device, seed: int,
                   on_step: Callable[[float], None]) -> None:
    """``steps`` steps of memplan's own trainer (``trainer.step.train_step``), ``on_step(seconds)`` after each."""
    import torch

    from trainer.model import build_model
    from trainer.step import make_optimizer, param_dtype, set_matmul_precision, train_step

    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    model = build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=device)
    optimizer = make_optimizer(model, setup.optimizer)
    if setup.compile:
        model = torch.compile(model)
    scaler = torch.amp.GradScaler(device.type) if setup.precision == "fp16-mixed" else None
    gen = torch.Generator(device=device).manual_seed(seed)
    sync = devices.synchronizer(device)

    def ids():
        return torch.randint(0, spec.vocab, (setup.micro_batch, setup.ctx), device=device, generator=gen)

    # every micro-batch's inputs exist for the whole step, as in the trainer; the step runs the first few
    batches = [(ids(), ids()) for _ in range(setup.grad_accum)]
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(model, optimizer, batches[:run_setup.grad_accum], run_setup, device.type, scaler=scaler)
        sync()
        on_step(time.perf_counter() - t0)


def run_trial(request: dict) -> dict:
    """Run one trial in this process (which should be fresh) and return what it measured, as JSON data.

    ``request``: model (ModelSpec fields), setup (TrainSetup fields), steps, max_micro_batches,
    context_bytes (the profile's runtime context, added on CPU and MPS), seed; stack (default memplan: memplan's
    own trainer; another runs that library's code, ``trainer.stacks.trial_steps``) and, for transformers,
    emitted (``autotune --emit``'s files, by name: the trial's ``TrainingArguments``). The library is imported
    here, after the CPU baseline: its code's resident memory is in the growth, as the plan's ``model_code``
    term predicts it.
    """
    spec = ModelSpec(**request["model"])
    setup = TrainSetup(**request["setup"])
    steps = int(request["steps"])
    family = devices.local_family()
    device = devices.torch_device(family)
    run_accum = min(setup.grad_accum, int(request["max_micro_batches"]))
    run_setup = setup.replace(grad_accum=run_accum)
    out = {"status": "ok", "family": family, "steps_run": 0, "micro_batches": run_accum, "error": "",
           "peak_bytes": None, "peak_allocated": None, "peak_rss": None, "baseline_rss": None,
           "tokens_per_second": None, "step_seconds": []}
    baseline = 0
    if family == "cpu":
        # the trial server has run every configuration once already (fork mode): one step reloads nothing
        _warm_up(spec, setup, device.type, steps=1 if request.get("server_warmed") else 2)
        devices.trim_heap()
        devices.keep_heap_resident()  # as the trainer's steps run (trainer.device.keep_heap_resident)
        out["hwm_reset"] = devices.reset_peak_rss()
        baseline = devices.current_rss()
        out["baseline_rss"] = baseline
    elif family in ("cuda", "rocm"):
        devices.reset_allocator_peaks(device)
    mps_peak = 0
    sync = devices.synchronizer(device)

    stack = request.get("stack", "memplan")

    def on_step(seconds: float) -> None:
        nonlocal mps_peak
        out["step_seconds"].append(seconds)
        out["steps_run"] += 1
        if family == "mps":
            mps_peak = max(mps_peak, devices.mps_memory()[1])

    try:
        seed = int(request.get("seed", 0))
        if stack == "memplan":
            _memplan_steps(spec, setup, run_setup, steps, device, seed, on_step)
        else:  # the library's own code: its model and step, or (transformers) its Trainer
            from trainer.stacks import StackModel, trial_steps

            trial_steps(stack, StackModel(spec=spec), setup, run_setup, steps, device, seed=seed,
                        emitted=request.get("emitted"), on_step=on_step)
    except Exception as e:  # noqa: BLE001 - every failure is reported; OOMs are told apart
        out["steps_run"] += 1  # the step that failed (or the model's build)
        out["status"] = "oom" if is_out_of_memory(e) else "error"
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]

    tokens_per_step = setup.micro_batch * setup.ctx * run_accum
    timed = out["step_seconds"][1:] or out["step_seconds"]
    if out["status"] == "ok" and timed:  # the median step: robust to another process taking the CPU a while
        out["tokens_per_second"] = tokens_per_step / statistics.median(timed)
    if family == "cpu":
        out["peak_rss"] = devices.peak_rss()
        out["peak_bytes"] = int(request["context_bytes"]) + max(0, out["peak_rss"] - baseline)
        out["method"] = ("profile runtime context + growth of resident memory (VmHWM) over a baseline "
                         "taken after a warm-up step")
    elif family in ("cuda", "rocm"):
        sync()
        outside = devices.outside_allocator_bytes(device)
        allocator = devices.allocator_memory(device)
        out["peak_allocated"] = allocator.peak_allocated
        out["peak_bytes"] = allocator.peak_reserved + int(outside)
        out["method"] = "torch.cuda.max_memory_reserved + memory outside the allocator (mem_get_info)"
    else:
        out["peak_allocated"] = devices.mps_memory()[0]
        out["peak_bytes"] = mps_peak + int(request["context_bytes"])
        out["method"] = "largest torch.mps.driver_allocated_memory after a step + profile runtime context"
    if stack != "memplan":
        from trainer.stacks import TRIAL_CODE

        out["method"] = f"{TRIAL_CODE[stack]}; {out['method']}"
    return out


# ---- running trials from the parent ------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """What one trial measured."""

    setup: TrainSetup  # the plan's setup (its grad_accum, not the trial's)
    status: str  # ok | oom | error
    peak_bytes: int | None  # measured peak, comparable with the predicted peak_reserved
    tokens_per_second: float | None  # measured over the timed steps
    steps_run: int  # real training steps run (a failed one counts)
    micro_batches: int  # micro-batches per trial step
    method: str = ""
    error: str = ""
    peak_allocated: int | None = None  # live tensors (CUDA/ROCm)
    peak_rss: int | None = None  # the trial process's absolute peak resident memory (CPU)
    baseline_rss: int | None = None  # its resident memory after the warm-up, before the model (CPU)
    family: str = ""
    step_seconds: tuple[float, ...] = ()
    ranks: tuple[dict, ...] = ()  # a trial on several ranks (trainer.verify_ranks): each rank's own figures

    @classmethod
    def from_json(cls, setup: TrainSetup, data: dict) -> "TrialResult":
        return cls(setup=setup, status=data.get("status", "error"), peak_bytes=data.get("peak_bytes"),
                   tokens_per_second=data.get("tokens_per_second"), steps_run=int(data.get("steps_run", 0)),
                   micro_batches=int(data.get("micro_batches", 0)), method=data.get("method", ""),
                   error=data.get("error", ""), peak_allocated=data.get("peak_allocated"),
                   peak_rss=data.get("peak_rss"), baseline_rss=data.get("baseline_rss"),
                   family=data.get("family", ""), step_seconds=tuple(data.get("step_seconds", ())),
                   ranks=tuple(data.get("ranks", ())))


def _repo_env(extra: dict[str, str] | None = None) -> dict:
    """The environment for a trial process: this one's, with this checkout importable and output unbuffered."""
    env = {**os.environ, **(extra or {})}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _signal_result(status: int, stderr_tail: str) -> dict:
    """The result of a trial process that died without reporting."""
    import signal

    if status < 0:
        sig = -status
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        killed = sig == signal.SIGKILL
        return {"status": "oom" if killed else "error",
                "error": f"the trial process was killed by {name}" + (
                    " (on Linux, the kernel's out-of-memory killer)" if killed else "") + stderr_tail}
    return {"status": "error", "error": f"the trial process exited with status {status} without a result{stderr_tail}"}


class TrialRunner:
    """Runs trials in fresh processes: forked from a torch-importing server on Linux, else one interpreter each.

    Use as a context manager; ``family`` is the local device family torch sees.
    """

    def __init__(self, fork: bool | None = None, env: dict[str, str] | None = None):
        self.fork = sys.platform.startswith("linux") if fork is None else fork
        self.env = dict(env or {})  # extra environment for the trial processes (e.g. OMP_NUM_THREADS)
        self._server: subprocess.Popen | None = None
        self._stderr = None
        self.family: str | None = None

    def __enter__(self) -> "TrialRunner":
        self._stderr = tempfile.TemporaryFile(mode="w+")
        if self.fork:
            self._server = subprocess.Popen([sys.executable, "-m", "trainer.verify", "serve"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                            env=_repo_env(self.env))
            hello = self._server.stdout.readline()
            if not hello:
                raise RuntimeError(f"the trial server did not start{self._stderr_tail()}")
            self.family = json.loads(hello)["family"]
        else:
            done = subprocess.run([sys.executable, "-m", "trainer.verify", "family"], capture_output=True, text=True,
                                  env=_repo_env(self.env))
            if done.returncode != 0:
                raise RuntimeError(f"could not start torch: {done.stderr.strip()[-500:]}")
            self.family = done.stdout.strip().splitlines()[-1]
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._server is not None:
            try:
                self._server.stdin.close()
                self._server.wait(timeout=30)
            except Exception:
                self._server.kill()
                self._server.wait()
            self._server = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().strip().splitlines() if ln.strip()]
        return f"; stderr: {lines[-1][:300]}" if lines else ""

    def run(self, spec: ModelSpec, setup: TrainSetup, *, steps: int = DEFAULT_STEPS,
            max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES, context_bytes: int = 0, seed: int = 0,
            stack: str = "memplan", emitted: dict[str, str] | None = None) -> TrialResult:
        """One trial of ``setup`` in a fresh process, of ``stack``'s code (``emitted``: transformers' arguments)."""
        if self.family is None:
            raise RuntimeError("TrialRunner.run outside `with TrialRunner() as runner:`")
        request = {"model": spec.to_dict(), "setup": setup.to_dict(), "steps": steps,
                   "max_micro_batches": max_micro_batches, "context_bytes": context_bytes, "seed": seed,
                   "stack": stack, "emitted": emitted}
        if self.fork:
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            line = self._server.stdout.readline()
            if not line:
                raise RuntimeError(f"the trial server stopped{self._stderr_tail()}")
            data = json.loads(line)
        else:
            done = subprocess.run([sys.executable, "-m", "trainer.verify", "trial"], input=json.dumps(request),
                                  capture_output=True, text=True, env=_repo_env(self.env))
            lines = done.stdout.strip().splitlines()
            if done.returncode == 0 and lines:
                data = json.loads(lines[-1])
            else:
                tail = done.stderr.strip().splitlines()
                data = _signal_result(done.returncode, f"; stderr: {tail[-1][:300]}" if tail else "")
        return TrialResult.from_json(setup, data)


def _in_child(work: Callable[[], dict]) -> dict:
    """Run ``work`` in a forked child and return its JSON result (or what its death says)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.dup2(2, 1)  # anything printed goes to stderr, never into the protocol
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001
            result = {"status": "oom" if is_out_of_memory(e) else "error", "error": f"{type(e).__name__}: {e}"[:500]}
        data = json.dumps(result).encode()
        while data:
            data = data[os.write(write_fd, data):]
        os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 1 << 16):
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    if chunks:
        return json.loads(b"".join(chunks))
    return _signal_result(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), "")


def _serve() -> None:
    """The trial server: import torch, say hello, then fork one child per request line (Linux).

    The server itself never initialises CUDA (a forked child could not use it then): even the
    device family is asked of a child.
    """
    import torch

    import trainer.model  # noqa: F401  (imported once, inherited by every child)
    import trainer.step  # noqa: F401

    # Load the code of a training step once, here, so that no child pays for it (seconds each). With
    # one thread no OpenMP pool exists yet, so forking stays safe.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tiny = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=True)
    for attention, checkpointing, optimizer in SERVER_WARM_UPS:
        _warm_up(tiny, TrainSetup(ctx=WARMUP_CTX, micro_batch=1, grad_accum=2, precision="fp32", attention=attention,
                                  checkpointing=checkpointing, optimizer=optimizer), "cpu")
    gc.collect()
    gc.freeze()  # children's collections skip everything made so far (else each one touches every page: ~1 s)
    family = _in_child(lambda: {"family": devices.local_family()}).get("family", "cpu")
    out = sys.stdout
    out.write(json.dumps({"ready": True, "family": family, "pid": os.getpid()}) + "\n")
    out.flush()

    def trial(request: dict) -> dict:
        torch.set_num_threads(threads)
        return run_trial(request)

    for line in sys.stdin:
        if line.strip():
            request = {**json.loads(line), "server_warmed": True}
            out.write(json.dumps(_in_child(lambda: trial(request))) + "\n")
            out.flush()


# ---- verify: trials until one fits -------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One candidate tried for real."""

    plan: Plan  # the candidate, with its prediction for the plan's full step
    trial: TrialResult
    predicted_trial_tokens_per_second: float  # the prediction for the step the trial ran
    outcome: str  # fits | over budget | out of memory | error

    def to_json(self) -> dict:
        t = self.trial
        return {"plan": self.plan.contract_plan(), "outcome": self.outcome,
                "predicted_peak": self.plan.predicted.get("peak_reserved"), "measured_peak": t.peak_bytes,
                "predicted_tokens_per_second": self.predicted_trial_tokens_per_second,
                "measured_tokens_per_second": t.tokens_per_second, "steps": t.steps_run,
                "micro_batches_per_step": t.micro_batches, "peak_rss": t.peak_rss, "error": t.error,
                **({"ranks": [rank_json(r) for r in t.ranks]} if t.ranks else {})}


def rank_json(rank: dict) -> dict:
    """One rank of a trial on several ranks, as ``autotune --json`` gives it (docs/json.md): its measured peak (the
    prediction is the attempt's ``predicted_peak``, the walk's per rank), its steps' seconds."""
    return {"rank": rank["rank"], "measured_peak": rank.get("peak_bytes"), "peak_rss": rank.get("peak_rss"),
            "peak_allocated": rank.get("peak_allocated"), "step_seconds": list(rank.get("step_seconds", ()))}


@dataclass(frozen=True, kw_only=True)
class Verification:
    """What ``--verify`` found: the plan finally chosen (None if none held up), and every attempt."""

    plan: Plan | None  # the first candidate whose measured peak fit the budget, with ``verified`` filled in
    attempts: list[Attempt]
    budget_bytes: int
    steps_per_trial: int
    max_micro_batches: int
    family: str
    skipped: int = 0  # candidates passed over because a measurement showed they would not fit either
    method: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def trials(self) -> int:
        """Real training steps run, over all attempts."""
        return sum(a.trial.steps_run for a in self.attempts)

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.plan is not None else None

    @property
    def peak_measured(self) -> int | None:
        return self.final.trial.peak_bytes if self.final else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.final.trial.tokens_per_second if self.final else None

    def to_json(self) -> dict:
        """The ``verified`` object of ``autotune --json`` (docs/json.md). With no plan holding up, the measured
        figures are null."""
        return {"peak_measured": self.peak_measured, "tokens_per_second": self.tokens_per_second,
                "trials": self.trials, "plans_tried": len(self.attempts), "skipped": self.skipped,
                "steps_per_trial": self.steps_per_trial, "max_micro_batches_per_step": self.max_micro_batches,
                "plan": self.plan.contract_plan() if self.plan is not None else None,
                "predicted_tokens_per_second": (self.final.predicted_trial_tokens_per_second
                                                if self.final else None),
                "device_family": self.family, "method": self.method, "notes": list(self.notes),
                "attempts": [a.to_json() for a in self.attempts]}


def _trial_tokens_per_second(result, setup: TrainSetup, max_micro_batches: int) -> float:
    """The predicted tokens/s of the step a trial runs (its micro-batches capped)."""
    trial = setup.replace(grad_accum=min(setup.grad_accum, max_micro_batches))
    return result._evaluator.tokens_per_second(trial)


def trial_config(plan: Plan, stack: str) -> dict[str, str] | None:
    """What a trial of ``stack`` runs the plan with: for transformers, ``autotune --emit``'s files (its
    ``TrainingArguments``, peft's ``LoraConfig``), rendered as ``--emit`` writes them; None for the others,
    whose trial takes the plan's setup."""
    if stack != "transformers":
        return None
    from memplan.emit import render

    return render(plan, stack)


def check_family(result, family: str) -> None:
    """InputError when ``result`` was planned for a device of another family than this machine's ``family``: the
    trial would measure the wrong thing."""
    if family != result.device.family:
        raise InputError(f"--verify runs the plan on this machine's {family}, but it was made for "
                         f"{result.device.name} ({result.device.family}); plan for the local device "
                         f"(omit --device) or drop --verify")


def verify(result, *, steps: int = DEFAULT_STEPS, max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES,
           max_plans: int = DEFAULT_MAX_PLANS, runner: TrialRunner | None = None, seed: int = 0,
           on_attempt: Callable[[Attempt], None] | None = None) -> Verification:
    """Run the chosen plan of an ``AutotuneResult`` for real; step down the ranking until one fits the budget.
    The trials run the code of the result's stack (``autotune --stack``): memplan's own trainer, or that
    library's (``trainer.stacks.trial_steps``), which must be installed (``trainer.stacks.require_installed``).

    Raises InputError when the result is for a device of another family than this machine's (the
    trial would measure the wrong thing) or when there is nothing to verify.
    """
    if steps < 2:
        raise InputError(f"--verify-steps: {steps} must be at least 2 (a warm-up step and a measured one)")
    if result.plan is None:
        raise InputError("--verify: nothing fits the budget, so there is no plan to run")

    stack = result._evaluator.stack.name
    if stack != "memplan":
        from trainer.stacks import require_installed

        require_installed(stack, lora=bool(result.plan.setup.lora_rank))
    own = runner is None
    if own:
        from memplan.hardware import detect_local

        check_family(result, detect_local().family)  # before starting torch: NVML, ROCm SMI and the OS say enough
        runner = TrialRunner().__enter__()
    try:
        check_family(result, runner.family)
        budget = result.budget_bytes
        context = result.device.runtime_context_bytes
        attempts: list[Attempt] = []
        excess = 0  # largest measured − predicted so far
        oom_below: int | None = None  # after an out-of-memory: only candidates predicted below this
        skipped = 0
        final = None
        notes = []
        for cand in result.ranked_fitting():
            if len(attempts) >= max_plans:
                notes.append(f"stopped after {max_plans} plans (max_plans)")
                break
            predicted = cand.peak_reserved
            if predicted + excess > budget or (oom_below is not None and predicted >= oom_below):
                skipped += 1
                continue
            trial = runner.run(result.model, cand.setup, steps=steps, max_micro_batches=max_micro_batches,
                               context_bytes=context, seed=seed, stack=stack, emitted=trial_config(cand.plan, stack))
            if trial.status == "ok":
                outcome = "fits" if trial.peak_bytes <= budget else "over budget"
            else:
                outcome = "out of memory" if trial.status == "oom" else "error"
            attempt = Attempt(plan=cand.plan, trial=trial, outcome=outcome,
                              predicted_trial_tokens_per_second=_trial_tokens_per_second(result, cand.setup,
                                                                                         max_micro_batches))
            attempts.append(attempt)
            if on_attempt is not None:
                on_attempt(attempt)
            if outcome == "fits":
                final = cand
                break
            if outcome == "over budget":
                excess = max(excess, trial.peak_bytes - predicted)
            elif outcome == "out of memory":
                oom_below = predicted if oom_below is None else min(oom_below, predicted)
        method = next((a.trial.method for a in attempts if a.trial.method), "")
        plan = None
        if final is not None:
            last = attempts[-1]
            verified = {"peak_measured": last.trial.peak_bytes, "tokens_per_second": last.trial.tokens_per_second,
                        "trials": sum(a.trial.steps_run for a in attempts), "plans_tried": len(attempts),
                        "steps_per_trial": steps, "micro_batches_per_step": last.trial.micro_batches,
                        "predicted_tokens_per_second": last.predicted_trial_tokens_per_second,
                        "method": method}
            plan = Plan(model=final.plan.model, setup=final.plan.setup, device=final.plan.device,
                        budget_bytes=final.plan.budget_bytes, predicted=dict(final.plan.predicted), verified=verified)
        elif attempts:
            notes.append("no candidate's measured peak fit the budget")
        return Verification(plan=plan, attempts=attempts, budget_bytes=budget, steps_per_trial=steps,
                            max_micro_batches=max_micro_batches, family=runner.family, skipped=skipped,
                            method=method, notes=notes)
    finally:
        if own:
            runner.close()


def verify_here(result, *, steps: int = DEFAULT_STEPS, threads: int | None = None, on_attempt=None):
    """``verify`` on this machine with ``threads`` torch threads in the trial processes (their
    ``OMP_NUM_THREADS``; None: the trial processes' default). A plan for several devices:
    ``trainer.verify_ranks.verify_on_ranks``."""
    if not threads:
        return verify(result, steps=steps, on_attempt=on_attempt)
    with TrialRunner(env={"OMP_NUM_THREADS": str(threads)}) as runner:
        return verify(result, steps=steps, runner=runner, on_attempt=on_attempt)


def main(argv: list[str] | None = None) -> None:
    """``python -m trainer.verify serve | trial | family`` (used by TrialRunner)."""
    argv = sys.argv[1:] if argv is None else argv
    mode = argv[0] if argv else ""
    if mode == "serve":
        _serve()
    elif mode == "trial":
        request = json.loads(sys.stdin.read())
        try:
            result = run_trial(request)
        except BaseException as e:  # noqa: BLE001
            result = {"status": "oom" if is_out_of_memory(e) else "error", "error": f"{type(e).__name__}: {e}"[:500]}
        sys.stdout.write(json.dumps(result) + "\n")
    elif mode == "family":
        sys.stdout.write(devices.local_family() + "\n")
    else:
        sys.exit("usage: python -m trainer.verify serve | trial | family")


if __name__ == "__main__":
    main()
