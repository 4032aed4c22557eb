"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases (``--log``).

Each logger is a callback of ``Trainer.on_event``: it sees every metrics line as it is written (rank 0
only), so every scalar of ``metrics.jsonl`` reaches it with the same value and step:

- ``train`` lines: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_second``,
  ``train/mfu``, ``train/step_seconds``, ``memory/measured_bytes`` (beside ``memory/predicted_peak_bytes``,
  the plan's predicted peak reserved, as a constant line to compare with), ``memory/allocated_bytes``;
- ``eval`` lines: ``eval/loss``, ``eval/perplexity`` and ``eval/loss/SOURCE`` per source;
- the ``start`` / ``resume`` event: the plan (model, setup), the predictions and the run's settings
  as the run's hyper-parameters (TensorBoard's text and hparams, W&B's ``config``).

TensorBoard writes ``RUN/tensorboard/`` through ``torch.utils.tensorboard.SummaryWriter`` (the
tensorboard package: ``pip install 'memplan[logging]'``). W&B writes ``RUN/wandb/`` with the wandb
package, offline unless this machine is logged in (``WANDB_API_KEY`` or a netrc entry for
api.wandb.ai) or ``WANDB_MODE`` says otherwise; an offline run is uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from memplan.errors import InputError

LOGGERS = ("jsonl", "tensorboard", "wandb")
EXTRA = "pip install 'memplan[logging]'"


WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # wandb.Settings.mode's values
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}  # the package each logger imports
_DIRECTORY = {"tensorboard": "tensorboard", "wandb": "wandb"}  # where in RUN each writes


def check_loggers(names: list[str] | None, run_dir: str | Path | None = None) -> list[str]:
    """``--log`` values, checked (jsonl is always on; it may be named) before anything is created or appended:
    each logger's package importable, ``WANDB_MODE`` one wandb takes, and with ``run_dir`` the directory each
    writes (``RUN/tensorboard``, ``RUN/wandb``) not a symbolic link and, where it exists, a writable directory.
    Each failure is one InputError line."""
    import importlib.util

    out = []
    for name in names or []:
        for part in name.split(","):
            part = part.strip()
            if part not in LOGGERS:
                raise InputError(f"--log: unknown {part!r} (accepted: {', '.join(LOGGERS)}; repeat --log for several)")
            if part not in out:
                out.append(part)
    for name in out:
        package = _PACKAGE.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise InputError(f"--log {name}: needs the {package} package; install it with {EXTRA}")
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in out and mode and mode not in WANDB_MODES:
        raise InputError(f"--log wandb: WANDB_MODE={mode!r} is not a mode wandb takes (accepted: "
                         f"{', '.join(WANDB_MODES)}); set it to one or unset it")
    if run_dir is not None:
        for name in out:
            if name in _DIRECTORY:
                _check_directory(name, Path(run_dir) / _DIRECTORY[name])
    return out


def _check_directory(name: str, path: Path) -> None:
    """``path`` (where logger ``name`` writes) is absent, or a real directory this process can write in."""
    if path.is_symlink():
        raise InputError(f"--log {name}: {path} is a symbolic link; refusing to write through it (remove it)")
    if not path.exists():
        return
    if not path.is_dir():
        raise InputError(f"--log {name}: {path} is a file, not a directory; move it away")
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"--log {name}: cannot write in {path} (read-only or not yours); make it writable or "
                         "move it away")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def scalars(line: dict, predicted_peak: int | None) -> dict[str, float]:
    """The scalars of one metrics line, by the names the loggers show (the module docstring)."""
    out: dict[str, float] = {}
    if line.get("kind") == "train":
        for key, name in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                          ("tokens_per_second", "train/tokens_per_second"), ("mfu", "train/mfu"),
                          ("step_seconds", "train/step_seconds"), ("memory_bytes", "memory/measured_bytes"),
                          ("memory_allocated_bytes", "memory/allocated_bytes"), ("tokens", "train/tokens")):
            value = _number(line.get(key))
            if value is not None:
                out[name] = value
        if predicted_peak is not None and "memory/measured_bytes" in out:
            out["memory/predicted_peak_bytes"] = float(predicted_peak)
    elif line.get("kind") == "eval":
        for key, name in (("eval_loss", "eval/loss"), ("eval_ppl", "eval/perplexity")):
            value = _number(line.get(key))
            if value is not None:
                out[name] = value
        for source, loss in (line.get("eval_loss_by_source") or {}).items():
            value = _number(loss)
            if value is not None:
                out[f"eval/loss/{source}"] = value
    return out


def hyperparameters(start: dict) -> dict:
    """The run's configuration from its start line, flat (``model.layers``, ``setup.ctx``, ``predicted.mfu``, ...)."""
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (str, int, float, bool)) or value is None:
            flat[prefix] = value
        else:
            flat[prefix] = json.dumps(value, default=str)

    for key in ("model", "setup", "predicted", "config", "schedule", "device", "tokens_per_step", "planned_steps",
                "train_tokens", "torch"):
        if key in start:
            walk(key, start[key])
    return flat


class _Logger:
    """A metrics-line callback: the start (or resume) event goes to ``start``, with the plan's predicted
    peak kept for the memory chart; every other line's scalars (``scalars``) to ``log``."""

    predicted_peak: int | None = None

    def __call__(self, record) -> None:
        line = record.to_json()  # a trainer.records record: its JSON object, whose documented keys map to names
        if line.get("kind") == "event" and line.get("event") in ("start", "resume"):
            self.predicted_peak = (line.get("predicted") or {}).get("peak_reserved")
            self.start(line)
            return
        values = scalars(line, self.predicted_peak)
        if values:
            self.log(values, line.get("step"))

    def start(self, line: dict) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int | None) -> None:
        raise NotImplementedError


class TensorBoardLogger(_Logger):
    """Scalars and the run's configuration into ``RUN/tensorboard/`` (SummaryWriter)."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError(f"--log tensorboard: needs the tensorboard package; install it with {EXTRA}") from None
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def start(self, line: dict) -> None:
        self.writer.add_text("run/config", "```\n" + json.dumps(hyperparameters(line), indent=1, default=str)
                             + "\n```", global_step=line.get("step", 0))

    def log(self, values: dict[str, float], step: int | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger(_Logger):
    """Scalars and the run's configuration into a W&B run under ``RUN/wandb/`` (offline unless logged in)."""

    def __init__(self, run_dir: Path):
        try:
            import wandb
        except ImportError:
            raise InputError(f"--log wandb: needs the wandb package; install it with {EXTRA}") from None
        self.wandb = wandb
        self.run_dir = Path(run_dir)
        self.mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
        self.run = None

    def start(self, line: dict) -> None:
        if self.run is None:
            self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "memplan"), name=self.run_dir.name,
                                       dir=str(self.run_dir), mode=self.mode, config=hyperparameters(line),
                                       settings=self.wandb.Settings(silent=True, console="off"))

    def log(self, values: dict[str, float], step: int | None) -> None:
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def attach(trainer, names: list[str]) -> list:
    """The loggers ``names`` asks for, subscribed to ``trainer``'s metrics lines (rank 0 only); close them
    with ``close_all`` when the run ends."""
    out = []
    if not trainer.is_main:
        return out
    check_loggers(names, trainer.run_dir)  # (the command checked them before it created anything)
    for name in names:
        logger = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger}.get(name)
        if logger is not None:
            out.append(logger(trainer.run_dir))
    for logger in out:
        trainer.on_event(logger)
    return out


def close_all(loggers: list) -> None:
    for logger in loggers:
        logger.close()
