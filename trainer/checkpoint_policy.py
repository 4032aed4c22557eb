"""A run's checkpoints as a policy: when one is due, where it goes, how many stay, how every rank of a
distributed run takes part in it, how a resume reads one back, and what a full disk leaves behind. The
on-disk format is ``trainer/checkpoint_format.py``'s. The checks a run makes before anything is written are here
too (``check_*``), and what a resume continues from and with (``resume_settings``: the newest checkpoint
verified, the run's plan and config with the overrides given, rescaled for this launch's processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from memplan.errors import InputError
from memplan.fsutil import no_space
from memplan.plan import Plan
from memplan.run_control import LIMITS
from trainer import checkpoint_format as ckpt
from trainer import distributed
from trainer import rundir
from trainer.rundir import CHECKPOINT_DIR, METRICS_FILE, TOKENIZER_FILE
from trainer.schedule import Schedule
from trainer.stopping import DiskFull


@dataclass(frozen=True)
class Restored:
    """Where a resumed run goes on from (``CheckpointManager.restore``): a checkpoint's state.pt, read."""

    step: int
    tokens: int
    train_seconds: float  # over all invocations so far
    schedule: Schedule
    eval_every: int | None  # the evaluation cadence: the one given, else the run's as saved
    nonfinite_run: int


class CheckpointManager:
    """The checkpoints of the run in ``run_dir``: one every ``save_every`` steps (``due``), the newest ``keep``
    kept, written atomically (``trainer.checkpoint_format.save_checkpoint``) by one process, or with every rank's
    shards of the model and optimizer under torchrun (``dist``: ``trainer.distributed.DistContext``)."""

    def __init__(self, run_dir: Path, *, keep: int, dist, save_every: int | None = None):
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.dist = dist
        self.save_every = save_every
        self.last_saved_step = -1

    @property
    def directory(self) -> Path:
        return self.run_dir / CHECKPOINT_DIR

    def due(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def newest(self) -> ckpt.CheckpointRef | None:
        return ckpt.latest_checkpoint(self.directory)

    def newest_note(self) -> str:
        """Which checkpoint a run that stops now leaves to resume from."""
        try:
            newest = self.newest()
        except OSError:
            newest = None
        return f"the newest checkpoint, {newest.path.name}, is intact" if newest else "no checkpoint was saved"

    @contextlib.contextmanager
    def writing(self, path: Path, step: int, report: bool = False):
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
            raise DiskFull(f"{path}: {what} at step {step}; {self.newest_note()}; {then}") from None

    def save(self, step: int, *, model: torch.nn.Module, wrapped: torch.nn.Module, optimizer,
             state: Callable[[], dict], meta: Callable[[], dict], tokenizer, tied: bool, sharding: str) -> Path:
        """Checkpoint ``step`` now (atomically) and keep the newest ``keep``: ``model``'s weights, ``state()``
        (state.pt), ``meta()`` (meta.json, in the process that writes it), its tokenizer.json beside them
        unless the tokenizer is tiktoken's (named in the meta)."""
        extra = {}
        if tokenizer.kind != "tiktoken":
            extra[TOKENIZER_FILE] = tokenizer.to_json_str().encode("utf-8")
        with self.writing(self.directory / ckpt.checkpoint_name(step), step):
            if self.dist.world_size > 1:
                path = self._save_distributed(step, wrapped, optimizer, state, meta, extra, tied, sharding)
            else:
                path = ckpt.save_checkpoint(self.directory, step, model, state(), meta(), keep=self.keep,
                                            extra_files=extra)
        self.last_saved_step = step
        return path

    def _save_distributed(self, step: int, wrapped, optimizer, state, meta, extra: dict[str, bytes],
                          tied: bool, sharding: str) -> Path:
        """Every rank writes its shards of the model and optimizer (torch.distributed.checkpoint) into
        the checkpoint's temporary directory; rank 0 adds the whole weights (gathered: what generate and
        export read), the rest of the state, the meta, and renames it into place.

        Each part (rank 0's preparation, the sharded state, DCP's writes, the model's shards for the whole
        weights, rank 0's finish) ends with every rank's outcome exchanged (``trainer.distributed.settle``), and
        every exchange of the save, DCP's own and the whole weights' all-gather (``distributed.gather_whole``)
        included, goes over a gloo group that times out (``$MEMPLAN_SAVE_TIMEOUT``): a rank that fails stops
        every rank with one line naming it and its cause, and a rank that hangs is named
        by rank 0 once the timeout has passed, instead of leaving the others waiting for ever."""
        directory = self.directory
        what = f"checkpoint step {step}"
        try:
            tmp = distributed.from_rank0(ckpt.temporary_dir(directory, step), save=True)
        except Exception as e:  # a rank that never came to the save: the timeout passed
            raise distributed.unanswered(what, e) from None

        def part(work: Callable[[], object], everywhere: bool = True):
            result = error = None
            if everywhere or self.dist.is_main:
                try:
                    result = work()
                except BaseException as e:  # DCP's CheckpointException is a BaseException
                    if not isinstance(e, Exception) and getattr(e, "failures", None) is None:
                        raise  # KeyboardInterrupt, SystemExit
                    error = e
            distributed.settle(what, error)  # one failure stops all
            return result

        def prepare():
            directory.mkdir(parents=True, exist_ok=True)
            ckpt.clean_leftovers(directory)
            (tmp / distributed.SHARDED_DIR).mkdir(parents=True)

        part(prepare, everywhere=False)
        sharded = part(lambda: distributed.sharded_state(wrapped, optimizer))
        part(lambda: distributed.write_sharded(tmp / distributed.SHARDED_DIR, sharded))
        sharded = None  # its references to the shards go
        shards = part(lambda: distributed.model_shards(wrapped))  # every rank here before the gather
        weights = distributed.gather_whole(shards, what)  # whole on rank 0, over the save group: it times out
        shards = None

        def finish() -> Path:
            whole = {ckpt.canonical_name(k): v.contiguous() for k, v in weights.items()
                     if not (tied and k == "head.weight")}  # tied: stored once, as the model's
            kept = {k: v for k, v in state().items() if k != "optimizer"}
            described = {**meta(), "distributed": {"world_size": self.dist.world_size, "sharding": sharding,
                                                   "sharded": distributed.SHARDED_DIR}}
            return ckpt.save_checkpoint(directory, step, None, kept, described, keep=self.keep,
                                        extra_files=extra, weights=whole, tmp=tmp)

        path = part(finish, everywhere=False)
        return path if self.dist.is_main else directory / ckpt.checkpoint_name(step)

    def load(self, path: Path, *, model: torch.nn.Module, wrapped: torch.nn.Module, optimizer, device,
             plain: Callable[[], tuple[torch.nn.Module, object]]) -> tuple[dict, dict]:
        """(meta, state) of a checkpoint, its weights and optimizer state loaded into this run's model:
        a distributed run's shards (any world size, or one process), or a single-process checkpoint
        (in one process as saved; over several, from rank 0, each rank keeping its shards: ``plain()``
        builds rank 0 the run's model and optimizer on the CPU to read it into). The state's optimizer
        is None where it is loaded already."""
        # sharded only when meta.json says so (the resume verified every file it lists, and that it
        # lists every file): a directory planted in a checkpoint is never what decides how to load it
        if (ckpt.read_meta(path).get("distributed") or {}).get("sharded") == distributed.SHARDED_DIR:
            meta, state = ckpt.load_checkpoint(path, None, map_location=device, verify=False)
            distributed.load_sharded(path / distributed.SHARDED_DIR, wrapped, optimizer)
            return meta, {**state, "optimizer": None}
        if self.dist.world_size == 1:
            return ckpt.load_checkpoint(path, model, map_location=device, verify=False)
        meta, state = ckpt.load_checkpoint(path, None, map_location="cpu", verify=False)
        plain_model = plain_optimizer = None
        if self.dist.is_main:
            plain_model, plain_optimizer = plain()
            ckpt.load_weights(plain_model, ckpt.read_weights(path / ckpt.MODEL_FILE), str(path / ckpt.MODEL_FILE))
            plain_optimizer.load_state_dict(state["optimizer"])
        distributed.load_single_process_state(wrapped, optimizer, plain_model, plain_optimizer, self.dist.is_main)
        return meta, {**state, "optimizer": None}

    def restore(self, path: Path, *, model: torch.nn.Module, wrapped: torch.nn.Module, optimizer, scaler, stream,
                device, plain: Callable[[], tuple[torch.nn.Module, object]], eval_every: int | None) -> Restored:
        """A resume from the (verified) checkpoint in ``path``: weights and optimizer state loaded (``load``), the
        grad ``scaler``'s state (if the run has one), the data ``stream``'s position and the RNG states restored;
        the evaluation and checkpoint cadence the run saved unless one was given (``eval_every``, ``save_every``),
        the checkpoint counted as saved. An ``InputError`` naming state.pt when the state is incomplete."""
        _, state = self.load(path, model=model, wrapped=wrapped, optimizer=optimizer, device=device, plain=plain)
        try:
            if state.get("optimizer") is not None:  # (a sharded checkpoint's is loaded already)
                optimizer.load_state_dict(state["optimizer"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            schedule = Schedule(**state["scheduler"])
            stream.load_state_dict(state["data"])
            ckpt.set_rng_state(state["rng"])
            restored = Restored(step=int(state["step"]), tokens=int(state["tokens"]),
                                train_seconds=float(state.get("train_seconds", 0.0)), schedule=schedule,
                                eval_every=state["eval_every"] if eval_every is None else eval_every,
                                nonfinite_run=int(state.get("nonfinite_run", 0)))
            if self.save_every is None:
                self.save_every = state["save_every"]
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path / ckpt.STATE_FILE}: incomplete training state ({type(e).__name__}: {e}); the "
                             "checkpoint is corrupt") from None
        self.last_saved_step = restored.step
        return restored


# =================================================================================================
# Checks before anything is written
# =================================================================================================

def lock_run(run_dir: Path) -> "rundir.RunLock | None":
    """The run's lock, taken by the process that writes it (rank 0 of a distributed run)."""
    rank, _, _ = distributed.env_world()
    return rundir.lock_run(run_dir) if rank == 0 else None


def holding_lock(run_dir: Path, build: Callable[[], object]) -> tuple[object, "rundir.RunLock | None"]:
    """(``build()``, the run's lock) with ``build`` run while holding the lock (``lock_run``: rank 0's, None on
    other ranks), which the caller then keeps; released again when ``build`` fails."""
    lock = lock_run(run_dir)
    try:
        return build(), lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def check_new_run(run_dir: Path, plan: Plan, data, profile, *, allow_existing: bool, verify_data: bool) -> None:
    """Every check a new run makes before anything is written: ``run_dir`` free (``check_run_dir_free``;
    ``allow_existing``: it may hold a run that never reached a checkpoint), its metrics file a plain one, the
    plan right for the data and this launch (``check_plan_for_data``) and fitting the device
    (``check_plan_fits``); the data's files verified (``verify_data``)."""
    if not allow_existing:
        check_run_dir_free(run_dir)
    elif ckpt.latest_checkpoint(run_dir / CHECKPOINT_DIR) is not None:
        raise InputError(f"--out {run_dir}: holds checkpoints; resume it with --resume")
    check_metrics_file(run_dir)
    check_plan_for_data(plan, data)
    check_plan_fits(plan, profile)
    if verify_data:
        data.verify()


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
RUN_CONTROL = ("max_steps", "max_tokens", "max_minutes", "save_every", "eval_every", "eval_batches", "keep",
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


def check_same_data(run_dir: Path, meta: dict, data) -> None:
    """A resume trains on the run's own data: the same tokenizer, a train split of the same size."""
    tok_sha = data.manifest["tokenizer"]["sha256"]
    if tok_sha != meta.get("tokenizer_sha256"):
        raise InputError(f"--resume: {run_dir} was trained with another tokenizer (sha256 "
                         f"{str(meta.get('tokenizer_sha256'))[:12]}) than {data.path}'s ({tok_sha[:12]}); "
                         "resume with the run's own prepared data")
    if data.train_tokens != meta.get("data", {}).get("train_tokens"):
        raise InputError(f"--resume: {run_dir} was trained on a train split of "
                         f"{meta.get('data', {}).get('train_tokens')} tokens, {data.path} has "
                         f"{data.train_tokens}; resume with the run's own prepared data")


def apply_overrides(config, overrides: dict):
    """The run's config with the run-control settings given on a resume. The limits (LIMITS) go together:
    any given replaces the run's three (those not given are lifted); none given keeps the run's."""
    changes = {}
    if any(overrides.get(k) is not None for k in LIMITS):
        changes.update({k: overrides.get(k) for k in LIMITS})
    for k, v in overrides.items():
        if v is None:
            continue
        if k in RUN_CONTROL:
            changes[k] = tuple(v) if k == "prompts" else v
        elif getattr(config, k) != v:
            raise InputError(f"--resume: the run trains with {k.replace('_', '-')} = {getattr(config, k)!r}, this "
                             f"command asks for {v!r}; drop --{k.replace('_', '-')} to resume it")
    return config.replace(**changes) if changes else config


def resume_point(run_dir: Path, kind: str) -> tuple[ckpt.CheckpointRef | None, dict, str]:
    """(the newest checkpoint, verified, or None; its meta, else the run record; where that was read) of the
    run in ``run_dir``. A run stopped before its first checkpoint must be of ``kind`` (train, finetune) to
    start again from step 0 here."""
    ref, source = rundir.resume_source(run_dir)
    if ref is not None:
        return ref, ckpt.verify_checkpoint(ref.path), f"{ref.path / ckpt.META_FILE}"
    if source.get("kind", "train") != kind:
        raise InputError(f"--resume: {run_dir} is a {source.get('kind')} run; resume it with memplan "
                         f"{source.get('kind')}")
    return None, source, f"{run_dir / rundir.RUN_FILE}"


def predicted_for(plan: Plan, profile):
    """What memplan predicts for this plan on this device, the figures the run is measured against: a
    ``memplan.prediction.Prediction`` (written into the metrics records as its dict)."""
    from memplan.prediction import predict

    return predict(plan.model, plan.setup, profile)


def check_plan_for_data(plan: Plan, data) -> None:
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


def check_plan_fits(plan: Plan, profile) -> None:
    """A plan whose predicted peak exceeds the device's usable memory is refused before it starts (on a CPU
    the operating system would kill the process or swap, with no out-of-memory error to back off from)."""
    from memplan.units import format_bytes

    peak = predicted_for(plan, profile).peak_reserved
    if peak > profile.usable_bytes:
        raise InputError(f"the plan needs {format_bytes(peak)} (predicted peak) but {profile.name} has "
                         f"{format_bytes(profile.usable_bytes)} usable; plan for this device (`memplan autotune "
                         f"... --device {profile.name}`), or lower --batch / --ctx, or use --checkpointing full")


@dataclass(frozen=True)
class ResumeSettings:
    """What a resume continues: the checkpoint (None: the run stopped before its first, and starts again from
    step 0 as its run record says), its meta (or the record) and where that was read, the run's plan (for this
    launch's number of processes), its config with the run-control settings given, and the config as stored."""

    ref: ckpt.CheckpointRef | None
    meta: dict
    where: str
    plan: Plan
    config: object
    stored_config: object


def resume_settings(run_dir: Path, data, profile, *, kind: str, read_config: Callable[[dict], object],
                    plan: Plan | None = None, overrides: dict | None = None,
                    sharding: str | None = None) -> ResumeSettings:
    """Every check a resume makes before anything is written, and what it continues (``ResumeSettings``): the
    newest checkpoint verified (``resume_point``), its plan and config readable (``read_config``: the config's
    ``from_dict``), ``plan`` the same as the run's (``check_same_plan``), ``data`` the run's
    (``check_same_data``), ``overrides`` only run control (``apply_overrides``); launched in another number of
    processes than the run was saved with, the same global batch (``distributed.rescaled_for_world``, with
    ``sharding``, else ``plan``'s), the plan checked against the data and this launch (``check_plan_for_data``),
    the data's files verified unless the config says not to."""
    ref, meta, where = resume_point(run_dir, kind)
    try:
        saved_plan = Plan.from_dict(meta["plan"], where)
        config = read_config(meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"--resume: {where}: unreadable run settings ({type(e).__name__}: {e})") from None
    check_metrics_file(run_dir)
    if plan is not None:
        check_same_plan(saved_plan, plan, run_dir)
    check_same_data(run_dir, meta, data)
    stored = config
    config = apply_overrides(config, overrides or {})
    _, launched, _ = distributed.env_world()
    asked_sharding = sharding or (plan.setup.sharding if plan is not None and plan.setup.sharding != "none"
                                  else None)
    setup = distributed.rescaled_for_world(saved_plan.setup, launched, asked_sharding)
    if setup != saved_plan.setup:  # another world size than the run was saved with: the same global batch
        saved_plan = dataclasses.replace(saved_plan, setup=setup, predicted=predicted_for(
            dataclasses.replace(saved_plan, setup=setup), profile).plan_table())
    check_plan_for_data(saved_plan, data)
    if config.verify_data:
        data.verify()
    return ResumeSettings(ref=ref, meta=meta, where=where, plan=saved_plan, config=config, stored_config=stored)


def state_of(*, optimizer, scaler, schedule, stream, step: int, tokens: int, train_seconds: float,
             eval_every, save_every, nonfinite_run: int) -> dict:
    """A checkpoint's state.pt: everything that decides the next step besides the weights."""
    return {
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "scheduler": schedule.to_dict(),
        "data": stream.state_dict(),
        "rng": ckpt.rng_state(),
        "step": step, "tokens": tokens, "train_seconds": train_seconds,
        "eval_every": eval_every, "save_every": save_every, "nonfinite_run": nonfinite_run,
    }
