"""What memplan predicts for one plan on one device, as one value: the figures a run is measured against.

``predict`` is the one place that asks the memory walk (``memplan.estimate.memory_on``) and the step-time model
(``memplan.timing.step_time``) for a plan; a plan's ``[predicted]`` table (plan.toml), a trainer's comparison
figures and autotune's candidates are all read off a ``Prediction``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memplan.hardware import Device
from memplan.model import ModelSpec
from memplan.setup import TrainSetup


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Memory and time of one training step of a plan on a device (bytes, seconds, per-second rates)."""

    peak_allocated: int  # live tensors at the step's peak
    peak_reserved: int  # what the device holds at the peak: live tensors, allocator reserve, runtime context
    peak_phase: str  # forward | backward | optimizer
    step_seconds: float
    tokens_per_second: float
    mfu: float  # model FLOPs per second over the device's dense peak
    epoch_seconds: float | None = None  # the tokens of one epoch, with torch.compile's one-off; None: not asked
    compile_seconds: float = 0.0  # torch.compile's one-off (in epoch_seconds, not in step_seconds)
    # wall | cpu: CPU time of a step (an idle core's), where the machine's load was too unsteady to predict wall
    # time (memplan.local.with_share_probes); the run compares it with its steps' CPU time
    clock: str = "wall"

    def plan_table(self) -> dict:
        """plan.toml's ``[predicted]`` (docs/run-directory.md): peak_reserved, step_seconds, tokens_per_second,
        peak_allocated, peak_phase and, when known, epoch_seconds (TOML has no null)."""
        table = {"peak_reserved": self.peak_reserved, "step_seconds": self.step_seconds,
                 "tokens_per_second": self.tokens_per_second, "epoch_seconds": self.epoch_seconds,
                 "peak_allocated": self.peak_allocated, "peak_phase": self.peak_phase}
        return {k: v for k, v in table.items() if v is not None}

    def as_dict(self) -> dict:
        return asdict(self)

    def json(self) -> dict:
        """The ``predicted`` object of ``autotune --json`` (docs/json.md): the plan table's keys, epoch_seconds
        null when unknown."""
        return {"peak_reserved": self.peak_reserved, "step_seconds": self.step_seconds,
                "tokens_per_second": self.tokens_per_second, "epoch_seconds": self.epoch_seconds,
                "peak_allocated": self.peak_allocated, "peak_phase": self.peak_phase}


def predict(spec: ModelSpec, setup: TrainSetup, device: Device, tokens: int | None = None) -> Prediction:
    """memplan's prediction for ``setup`` of ``spec`` on ``device``; ``tokens`` (one epoch) gives epoch_seconds."""
    from memplan.estimate import memory_on
    from memplan.timing import step_time

    mem = memory_on(spec, setup, device)
    t = step_time(spec, setup, device)
    return Prediction(peak_allocated=mem.peak_allocated, peak_reserved=mem.peak_reserved, peak_phase=mem.peak_phase,
                      step_seconds=t.step_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                      epoch_seconds=tokens / t.tokens_per_second + t.compile_seconds if tokens else None,
                      compile_seconds=t.compile_seconds,
                      clock="cpu" if device.calibrated.get("predicts") == "cpu" else "wall")
