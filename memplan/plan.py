"""A training plan: the model, the setup chosen for it, the device and budget it was chosen for, and what was predicted.

``memplan autotune --out plan.toml`` writes one; ``memplan train --plan plan.toml`` trains on it
and writes it again into the run directory as ``RUN/plan.toml``.
"""

from __future__ import annotations

from memplan.compat import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from memplan.errors import InputError
from memplan.memory.stacks import DEFAULT, STACKS, shown
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

PLAN_VERSION = 1
_CONTRACT_PLAN_KEYS = ("micro_batch", "grad_accum", "checkpointing", "attention", "precision", "optimizer", "compile",
                       "ctx", "world_size", "sharding")  # the last two were added to autotune's original plan keys


# The optimisation settings a plan carries in its [training] table (trainer.loop.TrainConfig's names), so that a
# plan file reproduces a run as a nanoGPT or litgpt config does. `schedule` (cosine, or wsd for a time-limited
# run) is written for the reader; the trainer derives it from the run's limits.
TRAINING_KEYS = ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "clip")


def _training_table(table, where: str) -> dict:
    """A plan's [training] table checked: known keys, finite numbers (``schedule`` a string)."""
    import math

    if not isinstance(table, dict):
        raise InputError(f"{where}: [training] must be a table of {', '.join(TRAINING_KEYS)}")
    out = {}
    for key, value in table.items():
        if key == "schedule":
            if not isinstance(value, str):
                raise InputError(f"{where}: [training] schedule = {value!r} must be a string (cosine, wsd)")
            out[key] = value
            continue
        if key not in TRAINING_KEYS:
            raise InputError(f"{where}: [training] has unknown key {key!r} (accepted: {', '.join(TRAINING_KEYS)}, "
                             "schedule)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"{where}: [training] {key} = {value!r} must be a finite number")
        out[key] = int(value) if key == "warmup_steps" else float(value)
    return out


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    setup: TrainSetup
    device: str = ""  # profile name or path the plan was made for
    budget_bytes: int = 0  # the memory budget it was made within
    predicted: dict = field(default_factory=dict)  # peak_reserved, step_seconds, tokens_per_second, epoch_seconds
    verified: dict = field(default_factory=dict)  # what autotune --verify measured (peak_measured, tokens/s, ...)
    training: dict = field(default_factory=dict)  # lr, warmup, weight decay, betas, clip ([training], TRAINING_KEYS)
    stack: str = "memplan"  # whose code the plan is for (memplan.memory.stacks.STACKS: autotune --stack)

    def contract_plan(self) -> dict:
        """The ``plan`` object of ``autotune --json`` (docs/json.md)."""
        setup = self.setup.to_dict()
        return {k: setup[k] for k in _CONTRACT_PLAN_KEYS}

    def to_dict(self) -> dict:
        data = {"version": PLAN_VERSION, "device": self.device, "budget_bytes": self.budget_bytes,
                **({"stack": self.stack} if shown(self.stack) else {}),  # memplan's own: the file as it was
                "model": {k: v for k, v in self.model.to_dict().items() if v is not None},
                "setup": self.setup.to_dict(),
                "predicted": {k: v for k, v in self.predicted.items() if v is not None}}
        if self.verified:
            data["verified"] = {k: v for k, v in self.verified.items() if v is not None}
        if self.training:  # a table older memplan versions skip: the plan stays readable by them
            data["training"] = {k: v for k, v in self.training.items() if v is not None}
        return data

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        """Write the plan as TOML (``memplan.fsutil.write_atomic``: never a half-written plan, never through a
        planted temporary name)."""
        from memplan.fsutil import write_atomic

        write_atomic(Path(path), self.to_toml())

    @classmethod
    def from_dict(cls, data: dict, where: str = "plan") -> "Plan":
        if data.get("fits") is False:  # what autotune --out writes when nothing fits (save_no_plan)
            raise InputError(f"{where}: holds no plan: autotune found nothing that fits "
                             f"({data.get('reason') or 'no reason recorded'}); run `memplan autotune` again with "
                             "one of the changes its advice lists")
        for key in ("model", "setup"):
            if key not in data or not isinstance(data[key], dict):
                raise InputError(f"{where}: missing table [{key}]")
        try:
            model = ModelSpec(**data["model"])
            setup = TrainSetup(**data["setup"])
        except TypeError as e:
            raise InputError(f"{where}: {e}") from None
        stack = data.get("stack", DEFAULT)
        if stack not in STACKS:
            raise InputError(f"{where}: stack = {stack!r} is not one memplan plans for (accepted: {', '.join(STACKS)})")
        return cls(model=model, setup=setup, device=str(data.get("device", "")), stack=stack,
                   budget_bytes=int(data.get("budget_bytes", 0)), predicted=dict(data.get("predicted", {})),
                   verified=dict(data.get("verified", {})), training=_training_table(data.get("training", {}), where))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"--plan: no such file {str(path)!r}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"--plan: {str(path)!r} is not valid TOML ({e})") from None
        return cls.from_dict(data, f"--plan {path}")


def save_no_plan(path: str | Path, *, model: ModelSpec, device: str, budget_bytes: int, reason: str,
                 advice: list[str]) -> None:
    """What ``memplan autotune --out PATH`` writes when nothing fits: ``fits = false``, why, and what
    would fit, with the model but no ``[setup]``. ``Plan.load`` refuses it, so that a plan an earlier
    run left at PATH is never trained by mistake (written like ``Plan.save``: whole or not at all)."""
    path = Path(path)
    data = {"version": PLAN_VERSION, "fits": False, "device": device, "budget_bytes": budget_bytes,
            "reason": reason, "advice": list(advice),
            "model": {k: v for k, v in model.to_dict().items() if v is not None}}
    from memplan.fsutil import write_atomic

    write_atomic(path, tomli_w.dumps(data))  # never through a planted plan.toml.tmp, never half-written
