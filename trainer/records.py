"""The lines of RUN/metrics.jsonl as typed records: written and read here, and nowhere else.

docs/run-directory.md is the contract: every line has ``kind`` (``"train"``, ``"eval"`` or ``"event"``), and
each kind (each event name) has the keys its table lists. Each is a frozen dataclass whose fields are exactly
those keys, in the order they are written:

    TrainLine         "kind": "train", one per optimizer step
    EvalLine          "kind": "eval", one per held-out evaluation
    StartEvent        "event": "start" or "resume" (its ``event`` field says which)
    CheckpointEvent   "event": "checkpoint"        OomEvent        "event": "oom"
    EvalOomEvent      "event": "eval_oom"          NonfiniteEvent  "event": "nonfinite"
    DecayEvent        "event": "decay"             ReportFailedEvent "event": "report_failed"
    SignalEvent       "event": "signal" (SIGINT/SIGTERM: stop after this step, or a second one: now)
    StopEvent         "event": "stop" (the run's end: its reason, tokens and time)
    OtherEvent        an event name this memplan does not know (a newer one's): kept, its keys as they are

``to_json()`` is the line's JSON object (``dumps`` its text: non-finite numbers refused, as JSON has none; the
trainer writes them as null), ``from_json(obj, where)`` the record of a parsed line, every key checked: a
missing key, a value of the wrong type, a NaN or an infinity, a line longer than MAX_LINE_BYTES is an
``InputError`` naming the file and the line. Keys a record does not know are ignored (newer versions add
keys). A field whose default is None and whose metadata says ``omit`` is left out of the line when it is
None (the keys a table marks "only when ..."); a field with a default may be missing from lines of older
runs (``memory_step``, ``planned_steps``, ``data_passes``, ``baseline_memory_bytes`` came later).

This module imports neither torch nor anything that does: the report reads runs with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from memplan.errors import InputError

MAX_LINE_BYTES = 16 << 20  # a line longer than this is not one the trainer wrote (an eval line with samples is ~KiB)


def _omit() -> typing.Any:
    """A field left out of the line when it is None (a table's "only when ..." key)."""
    return field(default=None, metadata={"omit": True})


class _Record:
    """What every record shares: its kind (and event name), ``to_json`` and ``from_json``."""

    KIND: typing.ClassVar[str]
    EVENT: typing.ClassVar[str | None] = None  # the event name, for the events with one name

    def to_json(self) -> dict:
        """The line's JSON object: ``kind`` (and for an event ``event``) first, then the fields in order."""
        out: dict = {"kind": self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit"):
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, obj: dict, where: str = "metrics line"):
        """The record of ``obj`` (a parsed line), every key known to it checked; an InputError naming
        ``where`` and the key otherwise."""
        values = field_values(cls, obj, lambda name: f"{where}: {name!r}",
                              lambda name: f"{where}: a {cls.describe()} line without {name!r}; not a line memplan wrote")
        record = cls(**values)
        record._check(where)
        return record

    @classmethod
    def describe(cls) -> str:
        return f"{cls.EVENT!r} event" if cls.EVENT else f"{cls.KIND!r}"

    def _check(self, where: str) -> None:
        """Checks beyond each value's type (nested objects); none by default."""


_HINTS: dict[type, dict] = {}


def field_values(cls, obj: dict, where: typing.Callable[[str], str], missing: typing.Callable[[str], str], *,
                 defaults: bool = True) -> dict:
    """The values of dataclass ``cls``'s fields found in ``obj``, each checked against its annotated JSON type
    (``check_value``, naming ``where(field)``); a field absent from ``obj`` is left to its default where it has
    one and ``defaults`` allows, else it is the InputError ``missing(field)``. (Metrics records, and the launch
    files of ``trainer.train_run`` and ``trainer.finetune_run``.)"""
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            if defaults and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING):
                continue
            raise InputError(missing(f.name))
        values[f.name] = check_value(obj[f.name], hints[f.name], where(f.name))
    return values


def _hints(cls) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", dict: "an object",
          list: "a list", type(None): "null"}


def check_value(value, hint, where: str):
    """``value`` if it has the JSON type ``hint`` names (``int``, ``float``, ``bool``, ``str``, ``dict``, ``list``,
    or a union of them with None; ``float`` takes an int, as other tools write 2.0 as 2; ``int`` takes no
    bool), else an InputError naming ``where``, the value and the accepted types."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    allowed = tuple(typing.get_origin(a) or a for a in allowed)
    for kind in allowed:
        if kind is type(None) and value is None:
            return value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if kind in (str, dict, list) and isinstance(value, kind):
            return value
    accepted = " or ".join(_NAMES.get(k, k.__name__) for k in allowed)
    raise InputError(f"{where} is {json.dumps(value)[:60]}; accepted: {accepted}")


def _check_mapping(mapping: dict, kind, where: str) -> None:
    for key, value in mapping.items():
        check_value(value, kind, f"{where}[{json.dumps(key)[:40]}]")


# ---- "kind": "train" ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrainLine(_Record):
    """One optimizer step (docs/run-directory.md, ``"kind": "train"``)."""

    KIND: typing.ClassVar[str] = "train"

    step: int
    loss: float | None
    tokens_per_second: float
    lr: float
    grad_norm: float | None
    tokens: int
    step_seconds: float
    time: float
    mfu: float
    memory_bytes: int | None = None
    memory_step: int | None = None  # the step memory_bytes measured (lines of older runs lack it: each step)
    micro_batch: int
    grad_accum: int
    skipped: bool
    eta_seconds: float
    total_steps: int
    memory_allocated_bytes: int | None = _omit()  # only where torch can tell
    nonfinite: str | None = _omit()  # only when the loss was not finite
    cpu_seconds: float | None = _omit()  # on a CPU: the process's CPU time over the step

    @property
    def cpu_tokens_per_second(self) -> float | None:
        """Tokens per second of the process's CPU time (on a CPU): what a loaded machine's waits do not move."""
        if not self.cpu_seconds:
            return None
        return self.tokens_per_second * self.step_seconds / self.cpu_seconds

    @property
    def measured_here(self) -> bool:
        """Whether this step's memory was read at this step (not repeated from an earlier one's reading)."""
        return self.memory_step is None or self.memory_step == self.step


# ---- "kind": "eval" ----------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class EvalLine(_Record):
    """One held-out evaluation (``"kind": "eval"``)."""

    KIND: typing.ClassVar[str] = "eval"

    step: int
    eval_loss: float | None
    eval_ppl: float | None
    eval_tokens: int
    eval_loss_by_source: dict
    eval_ppl_by_source: dict
    eval_tokens_by_source: dict
    samples: list
    eval_seconds: float
    tokens: int

    def _check(self, where: str) -> None:
        _check_mapping(self.eval_loss_by_source, float | None, f"{where}: 'eval_loss_by_source'")
        _check_mapping(self.eval_ppl_by_source, float | None, f"{where}: 'eval_ppl_by_source'")
        _check_mapping(self.eval_tokens_by_source, int, f"{where}: 'eval_tokens_by_source'")
        for i, sample in enumerate(self.samples):
            check_value(sample, dict, f"{where}: 'samples'[{i}]")
            for key in ("prompt", "text"):
                if key not in sample:
                    raise InputError(f"{where}: 'samples'[{i}] has no {key!r}; not a line memplan wrote")
                check_value(sample[key], str, f"{where}: 'samples'[{i}][{key!r}]")


# ---- "kind": "event" ---------------------------------------------------------------------------------------

class _Event(_Record):
    KIND: typing.ClassVar[str] = "event"

    def to_json(self) -> dict:
        out = super().to_json()
        if self.EVENT is not None:  # "event" second, as the trainer writes it
            out = {"kind": self.KIND, "event": self.EVENT, **{k: v for k, v in out.items() if k != "kind"}}
        return out


@dataclass(frozen=True, kw_only=True)
class StartEvent(_Event):
    """The run begins (``event`` "start") or ``--resume`` continues it ("resume", with ``checkpoint``)."""

    event: str  # "start" | "resume"
    step: int
    tokens: int
    time: float
    unix_time: float
    model: dict  # json.md's model object plus describe
    setup: dict  # json.md's setup object plus compile
    device: str  # the profile's name
    torch_device: str
    torch: str
    predicted: dict  # peak_allocated, peak_reserved, peak_phase, step_seconds, tokens_per_second, mfu
    schedule: dict
    eval_every: int | None
    save_every: int | None
    tokens_per_step: int
    planned_steps: int | None = None
    data_passes: float | None = None
    train_tokens: int
    replaced_limits: dict | None = _omit()  # a resume given new limits: the run's before
    memory_source: str
    baseline_memory_bytes: int | None = None
    mfu_peak_flops_per_second: float
    data: str
    config: dict
    checkpoint: str | None = _omit()  # a resume: the checkpoint it continues from

    NAMES: typing.ClassVar[tuple[str, ...]] = ("start", "resume")

    @classmethod
    def describe(cls) -> str:
        return "'start' or 'resume' event"

    def _check(self, where: str) -> None:
        if self.event not in self.NAMES:
            raise InputError(f"{where}: 'event' is {self.event!r}; accepted: start, resume")
        if "params" in self.model:
            check_value(self.model["params"], int, f"{where}: 'model'['params']")
        _check_predicted(self.predicted, where)


def _check_predicted(predicted: dict, where: str) -> None:
    """A record's ``predicted`` (``memplan.prediction.Prediction``'s dict): numbers or null, but the phase and
    the clock (wall | cpu)."""
    _check_mapping({k: v for k, v in predicted.items() if k not in ("peak_phase", "clock")}, float | None,
                   f"{where}: 'predicted'")
    if "clock" in predicted and predicted["clock"] not in ("wall", "cpu"):
        raise InputError(f"{where}: 'predicted'[\"clock\"] is {predicted['clock']!r}; accepted: wall, cpu")


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(_Event):
    EVENT: typing.ClassVar[str] = "checkpoint"
    step: int
    path: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class OomEvent(_Event):
    """A step ran out of memory; redone with ``micro_batch`` × ``grad_accum`` (``previous`` the old setup)."""

    EVENT: typing.ClassVar[str] = "oom"
    step: int
    time: float
    message: str
    micro_batch: int
    grad_accum: int
    previous: dict  # {micro_batch, grad_accum}
    predicted: dict

    def _check(self, where: str) -> None:
        for key in ("micro_batch", "grad_accum"):
            if key not in self.previous:
                raise InputError(f"{where}: 'previous' has no {key!r}; not a line memplan wrote")
            check_value(self.previous[key], int, f"{where}: 'previous'[{key!r}]")
        _check_predicted(self.predicted, where)


@dataclass(frozen=True, kw_only=True)
class EvalOomEvent(_Event):
    EVENT: typing.ClassVar[str] = "eval_oom"
    step: int
    message: str


@dataclass(frozen=True, kw_only=True)
class NonfiniteEvent(_Event):
    EVENT: typing.ClassVar[str] = "nonfinite"
    step: int
    loss: str  # "nan", "inf"
    in_a_row: int
    lr: float


@dataclass(frozen=True, kw_only=True)
class DecayEvent(_Event):
    EVENT: typing.ClassVar[str] = "decay"
    step: int
    decay_steps: int
    total_steps: int
    seconds_left: float
    step_seconds: float


@dataclass(frozen=True, kw_only=True)
class ReportFailedEvent(_Event):
    EVENT: typing.ClassVar[str] = "report_failed"
    step: int
    error: str


@dataclass(frozen=True, kw_only=True)
class SignalEvent(_Event):
    """SIGINT or SIGTERM arrived during step ``step`` + 1: the first one stops the run after that step
    (``now`` false: checkpoint, report, stop); a second one stops it at once (``now`` true: written before the
    process exits, with no checkpoint of the step)."""

    EVENT: typing.ClassVar[str] = "signal"
    step: int
    signal: str  # "SIGINT", "SIGTERM"
    now: bool


@dataclass(frozen=True, kw_only=True)
class StopEvent(_Event):
    """The run ends: why (``max_steps``, ``max_tokens``, ``max_minutes``, ``epoch``, ``interrupted``)."""

    EVENT: typing.ClassVar[str] = "stop"
    step: int
    reason: str
    tokens: int
    time: float  # training seconds
    wall_seconds: float  # this invocation
    signal: str | None = _omit()  # only when a signal stopped it


@dataclass(frozen=True, kw_only=True)
class OtherEvent(_Event):
    """An event this memplan does not know (a newer version's): its name, step and other keys as they are."""

    event: str
    step: int
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.KIND, "event": self.event, "step": self.step, **self.extra}

    @classmethod
    def from_json(cls, obj: dict, where: str = "metrics line"):
        if "step" not in obj:
            raise InputError(f"{where}: an event without 'step'; not a line memplan wrote")
        return cls(event=obj["event"], step=check_value(obj["step"], int, f"{where}: 'step'"),
                   extra={k: v for k, v in obj.items() if k not in ("kind", "event", "step")})


Record = typing.Union[TrainLine, EvalLine, StartEvent, CheckpointEvent, OomEvent, EvalOomEvent, NonfiniteEvent,
                      DecayEvent, ReportFailedEvent, SignalEvent, StopEvent, OtherEvent]
EVENTS: dict[str, type] = {**{name: StartEvent for name in StartEvent.NAMES},
                           **{c.EVENT: c for c in (CheckpointEvent, OomEvent, EvalOomEvent, NonfiniteEvent,
                                                   DecayEvent, ReportFailedEvent, SignalEvent, StopEvent)}}
KINDS: dict[str, type] = {"train": TrainLine, "eval": EvalLine}


def from_json(obj, where: str = "metrics line") -> Record | None:
    """The record of one parsed line; None for a kind this memplan does not know (a newer one's: skipped, as
    docs/run-directory.md asks of readers); an InputError for anything else that is not a line it wrote."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: not a JSON object; not a line memplan wrote")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise InputError(f"{where}: no 'kind' (accepted: train, eval, event); not a line memplan wrote")
    if kind == "event":
        name = obj.get("event")
        if not isinstance(name, str):
            raise InputError(f"{where}: an event without a name ('event'); not a line memplan wrote")
        return EVENTS.get(name, OtherEvent).from_json(obj, where)
    cls = KINDS.get(kind)
    return cls.from_json(obj, where) if cls is not None else None


def dumps(record: Record) -> str:
    """The record's line, without its newline: JSON, non-finite numbers refused (the trainer writes null)."""
    if not isinstance(record, _Record):
        raise TypeError(f"a metrics line must be a trainer.records record, not {type(record).__name__}")
    return json.dumps(record.to_json(), allow_nan=False)


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _no_constant(text: str):
    raise _NotFinite(text)


def parse_line(raw: str, where: str) -> Record | None:
    """The record of one line of text; None for a line that is not JSON at all (one cut by a kill: the
    trainer starts a fresh line after it) or of an unknown kind; an InputError for a line that is JSON but
    not a record (a NaN or an infinity included)."""
    try:
        obj = json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except _NotFinite as e:
        raise InputError(f"{where}: holds {e.args[0]}; metrics lines hold finite numbers (null for none)") from None
    except (ValueError, RecursionError):
        return None
    return from_json(obj, where)


def read_records(path: str | Path, latest: bool = False) -> list[Record]:
    """The records of the metrics file ``path`` (none when it does not exist). A line that is not JSON (one
    cut by a kill) is skipped; any other line that is not a record is an InputError naming the file and the
    line. With ``latest``, a train or eval line for a step that a later line of the same kind repeats (a run
    resumed from a checkpoint before it) is dropped, so each step appears once."""
    path = Path(path)
    out: list[Record] = []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise InputError(f"{path}: unreadable ({e.strerror or e})") from None
    with f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            number += 1
            where = f"{path} line {number}"
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{where}: longer than {MAX_LINE_BYTES >> 20} MiB; not a line memplan wrote")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{where}: not UTF-8 text; not a line memplan wrote") from None
            if not text.strip():
                continue
            record = parse_line(text, where)
            if record is not None:
                out.append(record)
    if not latest:
        return out
    last = {}
    for i, r in enumerate(out):
        if isinstance(r, (TrainLine, EvalLine)):
            last[(r.KIND, r.step)] = i
    return [r for i, r in enumerate(out) if not isinstance(r, (TrainLine, EvalLine)) or last[(r.KIND, r.step)] == i]


# ---- the figures of a run's steady steps ---------------------------------------------------------------------

@dataclass(frozen=True)
class SteadyFigures:
    """What a run's steady steps measured (all its steps but the first, which allocates the optimizer state;
    the first alone when there is no other), as ``memplan train``'s summary prints them and the run report
    shows them: the largest step's memory (reserved, and live tensors where torch can tell), the median
    tokens/s and the median MFU (None where no step recorded one)."""

    steps: int
    peak_memory_bytes: int | None
    peak_allocated_bytes: int | None
    tokens_per_second: float | None
    mfu: float | None
    cpu_tokens_per_second: float | None = None  # median tokens per second of CPU time (steps on a CPU)


def steady_figures(records: typing.Iterable[Record]) -> SteadyFigures | None:
    """The ``SteadyFigures`` of ``records`` (a run's metric records, e.g. ``trainer.rundir.metric_records(RUN,
    latest=True)``; only its train lines count, in step order); None without a train line."""
    import statistics

    train = sorted((r for r in records if isinstance(r, TrainLine)), key=lambda r: r.step)
    if not train:
        return None
    steady = train[1:] or train
    memory = [r.memory_bytes for r in steady if r.memory_bytes]
    allocated = [r.memory_allocated_bytes for r in steady if r.memory_allocated_bytes]
    rates = [r.tokens_per_second for r in steady if r.tokens_per_second]
    mfus = [r.mfu for r in steady if r.mfu is not None]
    cpu_rates = [r.cpu_tokens_per_second for r in steady if r.cpu_tokens_per_second]
    return SteadyFigures(steps=len(steady), peak_memory_bytes=max(memory, default=None),
                         peak_allocated_bytes=max(allocated, default=None),
                         tokens_per_second=statistics.median(rates) if rates else None,
                         mfu=statistics.median(mfus) if mfus else None,
                         cpu_tokens_per_second=statistics.median(cpu_rates) if cpu_rates else None)
