"""Validation matrices and their results: which (ModelSpec, TrainSetup) pairs to check, and how to summarise the check.

A matrix is a TOML file (``memplan/matrices/*.toml``) of ``[[config]]`` tables, each with the
ModelSpec and TrainSetup fields, an optional ``name`` and ``quick = true`` for the subset
``memplan validate --quick`` runs. The measuring itself is in ``trainer/validate.py``.
"""

from __future__ import annotations

import dataclasses
import statistics
from memplan.compat import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a bundled resource: a path in a wheel or a checkout, a zip member in a zip import
    from importlib.resources.abc import Traversable

from memplan.errors import InputError
from memplan.memory.stacks import shown
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.units import choice_error

_SPEC_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)}
_SETUP_FIELDS = {f.name for f in dataclasses.fields(TrainSetup)}

# The bars every run prints (CPU). Analytic against measured: median |error| <= 3% and worst <= 10%. The
# worst bound is autotune's default margin (it keeps 10% of the budget free), so a plan predicted to fit
# still fits when the prediction is off by as much as the worst config measured. The trace against
# measured: <= 1%. The trace runs the same model code on fake tensors, so it should match the real step
# to the byte; anything beyond rounding is a bug in how the step is traced, not a modelling error.
ANALYTIC_MEDIAN_BAR = 0.03
ANALYTIC_WORST_BAR = 0.10
TRACE_BAR = 0.01
# A compiled config (compile = true, memplan/matrices/compiled.toml): the walk's compile hook against the compiled
# trace (inductor's partitioner on fake tensors), within 3% (the bar of the issue that built both). That trace is
# held to no bar against the real compiled step: it runs the partitioned graphs op by op, so its transients are an
# upper bound on inductor's, whose fusion never materialises a pointwise chain (a 16-bit silu's fp32 buffers).
COMPILED_TRACE_BAR = 0.03
DISTRIBUTED_MATRIX = "distributed"  # the matrix `memplan validate --world-size N` runs by default
SHARDINGS_MEASURED = ("ddp", "fsdp")


@dataclass(frozen=True)
class MatrixConfig:
    name: str
    spec: ModelSpec
    setup: TrainSetup
    quick: bool = False


def _matrices_dir() -> Traversable:
    """The bundled matrices, ``memplan/matrices/``, as package resources."""
    return resources.files("memplan") / "matrices"


def _toml_names(folder: Traversable) -> list[str]:
    return sorted(p.name[:-len(".toml")] for p in folder.iterdir() if p.is_file() and p.name.endswith(".toml"))


def matrix_names() -> list[str]:
    return _toml_names(_matrices_dir())


def _matrix_rows(name_or_path: str, bundled: Traversable) -> tuple[Path | Traversable, list[dict]]:
    """``--matrix NAME|FILE``: the file (a matrix bundled in ``bundled`` by name, or any TOML) and its
    ``[[config]]`` tables, or a one-line error naming the problem."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".toml") or path.is_file()):
        names = _toml_names(bundled)
        if name_or_path not in names:
            raise choice_error("--matrix", name_or_path, names)
        path = bundled / f"{name_or_path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"--matrix: no such file {str(path)!r}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--matrix: {str(path)!r} is not valid TOML ({e})") from None
    rows = data.get("config")
    if not isinstance(rows, list) or not rows:
        raise InputError(f"--matrix: {str(path)!r} has no [[config]] tables")
    return path, rows


def load_matrix(name_or_path: str = "default") -> list[MatrixConfig]:
    """The configs of a bundled matrix by name, or of any matrix TOML file."""
    path, rows = _matrix_rows(name_or_path, _matrices_dir())
    configs = []
    for i, row in enumerate(rows):
        unknown = set(row) - _SPEC_FIELDS - _SETUP_FIELDS - {"quick"}
        if unknown:
            raise InputError(f"--matrix: config {i} in {str(path)!r} has unknown key(s) {', '.join(sorted(unknown))}")
        try:
            spec = ModelSpec(**{k: v for k, v in row.items() if k in _SPEC_FIELDS and k != "name"})
            setup = TrainSetup(**{k: v for k, v in row.items() if k in _SETUP_FIELDS})
        except TypeError as e:
            raise InputError(f"--matrix: config {i} in {str(path)!r}: {e}") from None
        configs.append(MatrixConfig(name=row.get("name") or f"config-{i}", spec=spec, setup=setup,
                                    quick=bool(row.get("quick", False))))
    return configs


def distributed_configs(configs: list[MatrixConfig], world_size: int) -> list[MatrixConfig]:
    """The configs of a matrix at ``world_size`` ranks: a config that names its sharding runs
    with it; a single-process one runs twice, under DDP and under FSDP (named NAME/ddp, NAME/fsdp)."""
    out = []
    for c in configs:
        shardings = (c.setup.sharding,) if c.setup.sharding != "none" else SHARDINGS_MEASURED
        for sharding in shardings:
            name = c.name if c.setup.sharding != "none" else f"{c.name}/{sharding}"
            out.append(MatrixConfig(name=name, spec=c.spec, quick=c.quick,
                                    setup=c.setup.replace(world_size=world_size, sharding=sharding)))
    return out


@dataclass
class ValidationRow:
    """One config: the analytic prediction, the exact trace, and the real measurement."""

    name: str
    spec: ModelSpec
    setup: TrainSetup
    predicted_allocated: int
    measured_allocated: int
    trace_allocated: int | None = None
    predicted_reserved: int | None = None
    measured_reserved: int | None = None  # allocator reserve (CUDA/ROCm/MPS)
    driver_used: int | None = None  # what NVML / ROCm SMI reported
    measured_rss_delta: int | None = None  # CPU: peak RSS over the baseline before the model existed
    peak_moment: str = ""
    predicted_terms: dict[str, int] = field(default_factory=dict)
    measured_terms: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    rank: int | None = None  # the rank measured, under --world-size > 1
    stack: str = "memplan"  # whose training code was measured (trainer/stacks)
    # on a GPU (CUDA, ROCm, MPS): the reserve, measured two ways against the prediction
    predicted_context: int | None = None  # the profile's runtime context, inside predicted_reserved
    driver_peak: int | None = None  # the peak reserve + what the device held outside it (NVML / ROCm SMI)
    driver_source: str | None = None  # NVML | ROCm SMI (VRAM) | ROCm SMI (GTT)
    family: str | None = None  # cuda | rocm | mps: the device measured (None: the CPU)

    @property
    def error(self) -> float:
        """(predicted − measured) / measured, of peak_allocated."""
        return (self.predicted_allocated - self.measured_allocated) / self.measured_allocated

    @property
    def trace_error(self) -> float | None:
        if self.trace_allocated is None:
            return None
        return (self.trace_allocated - self.measured_allocated) / self.measured_allocated

    @property
    def compiled_walk_trace_error(self) -> float | None:
        """A compiled config's (predicted − compiled trace) / compiled trace; None for an eager one."""
        if self.trace_allocated is None or not getattr(self.setup, "compile", False):
            return None
        return (self.predicted_allocated - self.trace_allocated) / self.trace_allocated

    @property
    def predicted_allocator_reserve(self) -> int | None:
        """What the prediction says torch's allocator reserves: peak_reserved less the runtime context
        (peak_allocated × (1 + the profile's allocator_overhead))."""
        if self.predicted_reserved is None or self.predicted_context is None:
            return None
        return self.predicted_reserved - self.predicted_context

    @property
    def reserved_error(self) -> float | None:
        """(predicted allocator reserve − measured max_memory_reserved) / measured, on a GPU."""
        if self.predicted_allocator_reserve is None or not self.measured_reserved:
            return None
        return (self.predicted_allocator_reserve - self.measured_reserved) / self.measured_reserved

    @property
    def driver_error(self) -> float | None:
        """(predicted peak_reserved − the driver's peak) / the driver's peak, on a GPU with NVML or ROCm SMI."""
        if self.predicted_reserved is None or not self.driver_peak:
            return None
        return (self.predicted_reserved - self.driver_peak) / self.driver_peak

    def to_json(self) -> dict:
        row = {"name": self.name, "model": self.spec.to_json(), "setup": self.setup.to_json(),
               "predicted_allocated": self.predicted_allocated, "measured_allocated": self.measured_allocated,
               "error": self.error}
        extra = {"trace_allocated": self.trace_allocated, "trace_error": self.trace_error,
                 "compiled_walk_trace_error": self.compiled_walk_trace_error,
                 "predicted_reserved": self.predicted_reserved, "measured_reserved": self.measured_reserved,
                 "driver_used": self.driver_used, "measured_rss_delta": self.measured_rss_delta,
                 "peak_moment": self.peak_moment, "predicted_terms": self.predicted_terms,
                 "measured_terms": self.measured_terms, "seconds": self.seconds, "rank": self.rank,
                 "stack": shown(self.stack),
                 "family": self.family, "predicted_context": self.predicted_context,
                 "predicted_allocator_reserve": self.predicted_allocator_reserve,
                 "reserved_error": self.reserved_error, "driver_peak": self.driver_peak,
                 "driver_source": self.driver_source, "driver_error": self.driver_error}
        row.update({k: v for k, v in extra.items() if v not in (None, {}, "")})
        return row


@dataclass(frozen=True)
class Summary:
    median_abs_error: float
    max_abs_error: float
    worst: str
    trace_max_abs_error: float | None
    compiled_walk_trace_max_abs_error: float | None = None

    def bars(self) -> list[tuple[str, float, float, bool]]:
        """(what, value, bar, met) for each bar: the analytic median and worst |error| against
        ANALYTIC_MEDIAN_BAR and ANALYTIC_WORST_BAR, and the trace's worst |error| against TRACE_BAR (the
        comment above those constants says why they are where they are)."""
        out = [("analytic median |error|", self.median_abs_error, ANALYTIC_MEDIAN_BAR,
                self.median_abs_error <= ANALYTIC_MEDIAN_BAR),
               ("analytic worst |error|", self.max_abs_error, ANALYTIC_WORST_BAR, self.max_abs_error <= ANALYTIC_WORST_BAR)]
        if self.trace_max_abs_error is not None:
            out.append(("trace worst |error|", self.trace_max_abs_error, TRACE_BAR,
                        self.trace_max_abs_error <= TRACE_BAR))
        if self.compiled_walk_trace_max_abs_error is not None:
            out.append(("compiled walk against the compiled trace, worst |error|", self.compiled_walk_trace_max_abs_error,
                        COMPILED_TRACE_BAR, self.compiled_walk_trace_max_abs_error <= COMPILED_TRACE_BAR))
        return out


def summarize(rows: list[ValidationRow]) -> Summary:
    errors = [abs(r.error) for r in rows]
    worst = max(rows, key=lambda r: abs(r.error))
    traces = [abs(r.trace_error) for r in rows if r.trace_error is not None and r.compiled_walk_trace_error is None]
    compiled = [abs(r.compiled_walk_trace_error) for r in rows if r.compiled_walk_trace_error is not None]
    return Summary(median_abs_error=statistics.median(errors), max_abs_error=max(errors), worst=worst.name,
                   trace_max_abs_error=max(traces) if traces else None,
                   compiled_walk_trace_max_abs_error=max(compiled) if compiled else None)


def validation_json(device: str, rows: list[ValidationRow]) -> dict:
    """The JSON of ``memplan validate`` (docs/json.md)."""
    summary = summarize(rows)
    out = {"device": device, "rows": [r.to_json() for r in rows], "median_abs_error": summary.median_abs_error,
           "max_abs_error": summary.max_abs_error, "trace_max_abs_error": summary.trace_max_abs_error}
    if summary.compiled_walk_trace_max_abs_error is not None:  # compiled configs (compile = true)
        out["compiled_walk_trace_max_abs_error"] = summary.compiled_walk_trace_max_abs_error
    stacks = list(dict.fromkeys(r.stack for r in rows))
    if [shown(s) for s in stacks] != [None]:  # --stack: the same figures for each stack's rows alone
        out["stacks"] = {}
        for stack in stacks:
            part = summarize([r for r in rows if r.stack == stack])
            out["stacks"][stack] = {"median_abs_error": part.median_abs_error, "max_abs_error": part.max_abs_error,
                                    "trace_max_abs_error": part.trace_max_abs_error}
    return out


# ---- inference: prefill and decode peaks of real generation ------------------------------------

from memplan.inference import InferenceSetup  # noqa: E402

_INFERENCE_FIELDS = {f.name for f in dataclasses.fields(InferenceSetup)}
# Predicted prefill and decode peaks within 5% of measured, each of them, in every config: half the worst-case
# bar of the training prediction (10%), because generation holds far fewer kinds of tensor (the weights, the
# KV cache, one forward's working set and the sampling copies), each a closed form, and max_ctx / max_batch
# are searched on this prediction, so its error is theirs.
INFERENCE_BAR = 0.05


@dataclass(frozen=True)
class InferenceConfig:
    name: str
    spec: ModelSpec
    setup: InferenceSetup
    quick: bool = False


def _inference_matrices_dir() -> Path:
    return _matrices_dir() / "inference"


def load_inference_matrix(name_or_path: str = "default") -> list[InferenceConfig]:
    """The configs of a bundled inference matrix (``memplan/matrices/inference/*.toml``) or of
    any TOML of ``[[config]]`` tables with ModelSpec and InferenceSetup fields."""
    path, rows = _matrix_rows(name_or_path, _inference_matrices_dir())
    configs = []
    for i, row in enumerate(rows):
        unknown = set(row) - _SPEC_FIELDS - _INFERENCE_FIELDS - {"quick"}
        if unknown:
            raise InputError(f"--matrix: config {i} in {str(path)!r} has unknown key(s) {', '.join(sorted(unknown))}")
        try:
            spec = ModelSpec(**{k: v for k, v in row.items() if k in _SPEC_FIELDS and k not in ("name", "ctx")})
            setup = InferenceSetup(**{k: v for k, v in row.items() if k in _INFERENCE_FIELDS})
        except TypeError as e:
            raise InputError(f"--matrix: config {i} in {str(path)!r}: {e}") from None
        configs.append(InferenceConfig(name=row.get("name") or f"config-{i}", spec=spec, setup=setup,
                                       quick=bool(row.get("quick", False))))
    return configs


@dataclass
class InferenceRow:
    """One inference config: predicted and measured prefill and decode peaks (live tensor bytes)."""

    name: str
    spec: ModelSpec
    setup: InferenceSetup
    predicted_prefill: int
    measured_prefill: int
    predicted_decode: int
    measured_decode: int
    prefill_moment: str = ""
    decode_moment: str = ""
    decode_step_seconds: float | None = None  # median measured decode step (wall time, noisy)
    roofline_step_seconds: float | None = None  # the bandwidth roofline's decode step
    seconds: float = 0.0
    predicted_step_seconds: float | None = None  # the roofline with the host's dispatch (memplan.inference)
    threads: int | None = None  # torch threads the decode steps ran on

    @property
    def step_ratio(self) -> float | None:
        """Measured decode step ÷ predicted (roofline + dispatch): 1 is exact."""
        if not (self.decode_step_seconds and self.predicted_step_seconds):
            return None
        return self.decode_step_seconds / self.predicted_step_seconds

    @property
    def prefill_error(self) -> float:
        return (self.predicted_prefill - self.measured_prefill) / self.measured_prefill

    @property
    def decode_error(self) -> float:
        return (self.predicted_decode - self.measured_decode) / self.measured_decode

    @property
    def predicted_allocated(self) -> int:
        return max(self.predicted_prefill, self.predicted_decode)

    @property
    def measured_allocated(self) -> int:
        return max(self.measured_prefill, self.measured_decode)

    @property
    def error(self) -> float:
        return (self.predicted_allocated - self.measured_allocated) / self.measured_allocated

    def to_json(self) -> dict:
        return {"name": self.name, "model": self.spec.to_json(), "inference": self.setup.to_json(),
                "predicted_allocated": self.predicted_allocated, "measured_allocated": self.measured_allocated,
                "error": self.error, "predicted_prefill": self.predicted_prefill,
                "measured_prefill": self.measured_prefill, "prefill_error": self.prefill_error,
                "predicted_decode": self.predicted_decode, "measured_decode": self.measured_decode,
                "decode_error": self.decode_error, "prefill_moment": self.prefill_moment,
                "decode_moment": self.decode_moment, "decode_step_seconds": self.decode_step_seconds,
                "roofline_step_seconds": self.roofline_step_seconds, "seconds": self.seconds,
                "predicted_step_seconds": self.predicted_step_seconds, "step_ratio": self.step_ratio,
                "threads": self.threads}


def inference_bars(rows: list[InferenceRow]) -> list[tuple[str, float, float, bool]]:
    """(what, worst |error|, bar, met) for the prefill and the decode peaks."""
    out = []
    for what, errors in (("prefill peak worst |error|", [abs(r.prefill_error) for r in rows]),
                         ("decode peak worst |error|", [abs(r.decode_error) for r in rows])):
        worst = max(errors)
        out.append((what, worst, INFERENCE_BAR, worst <= INFERENCE_BAR))
    return out


def inference_validation_json(device: str, rows: list[InferenceRow]) -> dict:
    """validate's JSON (docs/json.md: rows, median and max |error| of the larger peak), with both phases per row."""
    errors = [abs(r.error) for r in rows]
    phases = [abs(e) for r in rows for e in (r.prefill_error, r.decode_error)]
    return {"device": device, "mode": "inference", "rows": [r.to_json() for r in rows],
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "phase_median_abs_error": statistics.median(phases), "phase_max_abs_error": max(phases),
            "bars": [{"what": w, "value": v, "bar": b, "met": m} for w, v, b, m in inference_bars(rows)]}
