"""What-if grids: the estimate of every combination of context, micro-batch, attention, checkpointing and precision.

``sweep`` returns a ``Sweep``: one ``Estimate`` per cell, exactly what ``memplan.estimate.estimate``
returns for that cell's setup, plus which cells are on the Pareto front of (memory, tokens/s).
Reports only render it (``memplan/cli/sweep.py`` prints the tables, ``memplan/reports/sweep.py`` draws the page).

Cells are ordered attention → checkpointing → precision → context → micro-batch, the last varying
fastest, so the cells of one (attention, checkpointing, precision, context) row sit together.

Speed: ``estimate`` searches for the largest micro-batch that fits (a dozen memory walks), and
that answer does not depend on the micro-batch the setup asks for. So each row is estimated once
with ``estimate`` and its other micro-batches reuse the row's ``max_micro_batch``, with their own
memory walk and step time (``memory_on``, ``step_time``): the same numbers ``estimate`` gives,
which tests/unit/test_sweep.py checks cell by cell, at a fraction of the cost.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from memplan.errors import InputError
from memplan.estimate import Estimate, estimate, memory_on
from memplan.memory.stacks import MEMPLAN, Stack
from memplan.hardware import Device
from memplan.model import ModelSpec
from memplan.setup import ATTENTIONS, CHECKPOINTINGS, PRECISIONS, TrainSetup
from memplan.timing import step_time
from memplan.units import choice_error, parse_count

AXES = ("ctx", "micro_batch", "attention", "checkpointing", "precision")  # the setup fields a sweep varies
MAX_CELLS = 4096  # a larger grid is a typo more often than a plan, and its page would not be readable


@dataclass(frozen=True, kw_only=True)
class SweepAxes:
    """The values each swept field takes; every other setup field comes from ``base``."""

    ctx: tuple[int, ...]  # context lengths, ascending
    micro_batch: tuple[int, ...]  # micro-batches, ascending
    attention: tuple[str, ...]  # in the order given
    checkpointing: tuple[str, ...]
    precision: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in AXES:
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values:
                raise InputError(f"--{_flag(name)}: give at least one value")
            if len(set(values)) != len(values):
                raise InputError(f"--{_flag(name)}: {', '.join(map(str, values))} repeats a value")
        for name, choices in (("attention", ATTENTIONS), ("checkpointing", CHECKPOINTINGS),
                              ("precision", PRECISIONS)):
            for value in getattr(self, name):
                if value not in choices:
                    raise choice_error(f"--{name}", value, list(choices))
        for name in ("ctx", "micro_batch"):
            for value in getattr(self, name):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise InputError(f"--{_flag(name)}: {value!r} must be a positive integer")
        if self.cells > MAX_CELLS:
            raise InputError(f"the grid has {self.cells} cells ({' × '.join(str(len(getattr(self, a))) for a in AXES)}); "
                             f"at most {MAX_CELLS}: sweep fewer values at once")

    @property
    def cells(self) -> int:
        n = 1
        for name in AXES:
            n *= len(getattr(self, name))
        return n

    @property
    def variants(self) -> list[tuple[str, str, str]]:
        """(attention, checkpointing, precision) combinations, in cell order."""
        return list(itertools.product(self.attention, self.checkpointing, self.precision))

    def to_json(self) -> dict:
        return {name: list(getattr(self, name)) for name in AXES}


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """The grid: one Estimate per cell (see the module docstring for the order)."""

    model: ModelSpec
    device: Device
    base: TrainSetup  # the fields that do not vary (grad_accum, optimizer, world size, ...)
    axes: SweepAxes
    cells: tuple[Estimate, ...]
    pareto: frozenset[int]  # indices of the cells that fit and that no other fitting cell beats on both
    tokens: int | None = None  # tokens in one epoch, if given

    @property
    def fitting(self) -> list[int]:
        return [i for i, c in enumerate(self.cells) if c.fits]

    @property
    def best(self) -> int | None:
        """The fitting cell with the most tokens/s (ties: the one with less memory), or None."""
        fitting = self.fitting
        if not fitting:
            return None
        return max(fitting, key=lambda i: (self.cells[i].time.tokens_per_second, -self.cells[i].memory.peak_reserved))

    def cell(self, *, ctx: int, micro_batch: int, attention: str | None = None, checkpointing: str | None = None,
             precision: str | None = None) -> Estimate:
        """The cell of one setup; the variant fields default to the axis's only value."""
        want = {"ctx": ctx, "micro_batch": micro_batch, "attention": attention, "checkpointing": checkpointing,
                "precision": precision}
        for c in self.cells:
            if all(v is None or getattr(c.setup, k) == v for k, v in want.items()):
                return c
        raise KeyError(want)

    def to_json(self) -> dict:
        """``memplan sweep --json``: the grid, each cell with the keys of ``memplan estimate --json``."""
        best = self.best
        return {
            "model": self.model.to_json(),
            "device": self.device.to_json(),
            "axes": self.axes.to_json(),
            "tokens": self.tokens,
            "cells": [
                {"setup": c.setup.to_json(), "memory": c.memory.to_json(), "fits": c.fits,
                 "max_micro_batch": c.max_micro_batch, "time": c.time.to_json(), "pareto": i in self.pareto}
                for i, c in enumerate(self.cells)
            ],
            "fitting": len(self.fitting),
            "best": best,
        }


def _flag(axis: str) -> str:
    return {"micro_batch": "batch"}.get(axis, axis)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (memory, speed) that no other point beats: none has memory ≤ and speed ≥
    with one of the two strictly better. Less memory and more speed are better. Equal points are
    all on the front. Sorted by memory, then index.

    Sorting by (memory ascending, speed descending), a point is on the front when its speed beats
    every point before it, or equals the best so far at the same memory.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    best_speed, best_memory = float("-inf"), None
    for i in order:
        memory, speed = points[i]
        if speed > best_speed:
            front.append(i)
            best_speed, best_memory = speed, memory
        elif speed == best_speed and memory == best_memory:
            front.append(i)
    return front


def sweep(spec: ModelSpec, base: TrainSetup, device: Device, axes: SweepAxes, tokens: int | None = None,
          stack: Stack = MEMPLAN) -> Sweep:
    """Estimate every cell of the grid on ``device``, the memory walked as ``stack``'s code runs the step."""
    cells: list[Estimate] = []
    for attention, checkpointing, precision in axes.variants:
        for ctx in axes.ctx:
            row: Estimate | None = None
            for micro_batch in axes.micro_batch:
                setup = base.replace(ctx=ctx, micro_batch=micro_batch, attention=attention,
                                     checkpointing=checkpointing, precision=precision)
                if row is None:
                    row = estimate(spec, setup, device, tokens, stack=stack)
                    cells.append(row)
                    continue
                memory = memory_on(spec, setup, device, stack)
                cells.append(dataclasses.replace(
                    row, setup=setup, memory=memory, time=step_time(spec, setup, device, tokens),
                    fits=memory.peak_reserved <= device.usable_bytes))
    fitting = [i for i, c in enumerate(cells) if c.fits]
    front = pareto_front([(cells[i].memory.peak_reserved, cells[i].time.tokens_per_second) for i in fitting])
    return Sweep(model=spec, device=device, base=base, axes=axes, cells=tuple(cells),
                 pareto=frozenset(fitting[j] for j in front), tokens=tokens)


# ---- parsing the command line's lists ------------------------------------------------------

def parse_list(text: str, flag: str, parse_item: Callable[[str], object], example: str,
               explain: bool = True) -> tuple:
    """``"1k,2k,4k"`` → the parsed items, in order, repeats dropped. Each bad item is one InputError
    that names it (``parse_item`` raises it), followed, with ``explain``, by the list's form."""
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise InputError(f"{flag}: give a comma-separated list such as {example}")
    values: list = []
    for item in items:
        if not item:
            raise InputError(f"{flag}: empty item in {text!r}; give a comma-separated list such as {example}")
        try:
            value = parse_item(item)
        except InputError as e:
            if not explain:
                raise
            raise InputError(f"{e} ({flag} takes a comma-separated list such as {example})") from None
        if value not in values:
            values.append(value)
    return tuple(values)


def parse_counts(text: str, flag: str, *, binary: bool = False, example: str = "1,2,4,8") -> tuple[int, ...]:
    """A list of counts, ascending (``--ctx 1k,2k`` with ``binary=True``: k = 1024)."""
    return tuple(sorted(parse_list(text, flag, lambda item: parse_count(item, flag, binary=binary), example)))


def parse_choices(text: str, flag: str, choices: Sequence[str]) -> tuple[str, ...]:
    """A list of named choices, in the order given."""
    def one(item: str) -> str:
        value = item.lower()
        if value not in choices:
            raise choice_error(flag, item, list(choices))
        return value

    return parse_list(text, flag, one, ",".join(choices), explain=False)
