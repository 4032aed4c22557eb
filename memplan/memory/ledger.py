"""The ledger a walk of a training step keeps: live bytes by category through its allocations and frees, the
moment of the peak and the named marks (``memplan.memory.walk`` walks the step; the hooks write into it).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.memory.sharding import gradients_persist
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import MEMPLAN, Stack

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


# ---- the walk's bookkeeping -----------------------------------------------------------------

@dataclass(frozen=True)
class Moment:
    """Live bytes by category at one moment of a step."""

    name: str
    phase: str  # forward | backward | optimizer
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class _StepWalk:
    """Live bytes by category through a step's allocations and frees, remembering the peak."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup, stack: Stack = MEMPLAN):
        self.spec, self.setup, self.stack = spec, setup, stack
        self.gradients_persist = gradients_persist(setup)  # .grad exists before the backward (the sharding hook's)
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak: Moment | None = None
        self.phase = "forward"
        self.where = "start of step"
        self.marks: list[Moment] = []  # the live totals at named points, for reports
        # the highest live logits, and the highest live total besides them, each at its own moment
        # (``mapped_logits_high_water_bytes``: on a CPU the two high-waters are resident together)
        self.logits_high = self.rest_high = 0
        self.compiled = False  # the step's torch.compile is modelled (memplan.memory.compiled); set by the step

    def alloc(self, category: str, nbytes: int, where: str | None = None) -> None:
        self.live[category] += int(nbytes)
        total = sum(self.live.values())
        self.logits_high = max(self.logits_high, self.live["logits"])
        self.rest_high = max(self.rest_high, total - self.live["logits"])
        if self.peak is None or total > self.peak.total:
            self.peak = Moment(where or self.where, self.phase, dict(self.live))

    def free(self, category: str, nbytes: int) -> None:
        self.live[category] -= int(nbytes)

    def mark(self, name: str) -> None:
        self.marks.append(Moment(name, self.phase, dict(self.live)))
