"""What a run directory is, from its first byte, and who is writing it.

``RUN/run.json`` (the run record) is the first thing a run writes, before its plan.toml, its
metrics.jsonl and its first step: the resolved plan, the training config (limits, seed,
hyper-parameters), the prepared data (its path and train-split size) and the tokenizer (sha256). It is
written atomically and rewritten only when a run is started again from step 0. ``--resume``
continues exactly the run it records: from the newest checkpoint when there is one, else from step
0 with the recorded plan, data and config. A directory with neither a checkpoint nor a record holds
no run, and ``--resume`` refuses it.

``RUN/.lock`` is held (``memplan.fsutil.hold_lock``: an fcntl lock holding the PID) by the process
writing the run, from before its first check of the directory until it is done; a second writer is
refused with the PID that holds it. The OS frees the lock when its holder dies, so a run killed with
SIGKILL can be resumed at once.

A trained run is read back through one function, ``trained_checkpoint``: its newest (or a named)
checkpoint, verified file by file against its meta.json, with the plan and the tokenizer it trained
with. ``memplan generate``, ``eval``, ``export`` and ``finetune --run`` all start there.

``RUN/metrics.jsonl`` is written through ``MetricsWriter`` and read back through ``metric_records`` (typed records,
``trainer.records``); ``read_metrics`` gives the same lines as JSON objects.

``RUN/launch.json`` (``LAUNCH_FILE``) is what ``memplan train --nproc N`` resolved for its ranks (the plan, the
settings, the data): written atomically before torchrun starts them, read by each (``python -m trainer RUN``)
through ``read_launch``; ``trainer.train_run.LaunchSpec`` says what it holds.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import InputError
from memplan.fsutil import Lock, hold_lock, open_append, write_atomic

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"  # one JSON object per line (docs/run-directory.md)
LOCK_FILE = ".lock"
CHECKPOINT_DIR = "checkpoints"  # RUN/checkpoints/step-NNNNNNNN/ (trainer.checkpoint_format)
TOKENIZER_FILE = "tokenizer.json"  # the tokenizer a checkpoint trained with, in the checkpoint
LAUNCH_FILE = "launch.json"  # what `memplan train --nproc` asks of each rank (trainer.train_run.LaunchSpec)
PLAN_FILE = "plan.toml"  # the plan trained on (rewritten when an out-of-memory step halves the micro-batch)
REPORT_FILE = "report.html"  # the run report (memplan.reports.run)
NOT_A_RUN = (LOCK_FILE, LAUNCH_FILE)  # a directory holding only these holds no run yet
METRICS_FLUSH_SECONDS = 1.0  # train lines reach metrics.jsonl at most this late (events and evals at once)
RUN_FORMAT = "memplan-run"
RUN_VERSION = 1


class RunLock:
    """This process's lock on a run directory: creates the directory if needed, and on release removes
    it again when nothing but the lock was ever put in it (a refused start leaves no trace)."""

    def __init__(self, run_dir: Path, lock: Lock, created: list[Path]):
        self.run_dir, self._lock, self._created = run_dir, lock, created

    def release(self) -> None:
        if not self._lock.held:
            return
        self._lock.release()
        _remove_if_empty(self._created)


def _remove_if_empty(created: list[Path]) -> None:
    """Remove the directories this process created (deepest first) that are still empty."""
    for d in created:
        try:
            d.rmdir()  # only if empty
        except OSError:
            return


def lock_run(run_dir: str | Path) -> RunLock:
    """Lock ``run_dir`` for writing (creating it), or an InputError naming the PID that holds it."""
    run_dir = Path(run_dir)
    if run_dir.is_symlink() and not run_dir.exists():
        raise InputError(f"--out {run_dir}: a symbolic link to nothing; give a directory for the run")
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--out {run_dir}: is a file; give a directory for the run")
    created = [d for d in (run_dir, *run_dir.parents) if not os.path.lexists(d)]  # deepest first
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {run_dir}: cannot create it ({e.strerror or e})") from None
    try:
        lock = hold_lock(run_dir / LOCK_FILE, f"--out {run_dir}: another memplan process (PID {{pid}}) is writing "
                                              "this run; wait for it to end, or choose another --out")
    except OSError as e:  # read-only, not ours, or a full disk: refused before anything is trained
        _remove_if_empty(created)
        raise InputError(f"--out {run_dir}: cannot write there ({e.strerror or e}); choose a writable --out") \
            from None
    except BaseException:
        _remove_if_empty(created)
        raise
    return RunLock(run_dir, lock, created)


def remove_launch(run_dir: Path, created: bool) -> None:
    """Remove RUN/launch.json of a launch whose ranks were refused before the run began, and RUN itself when the
    launch created it and nothing else is left in it: a refused launch leaves nothing a later command trusts."""
    try:
        (Path(run_dir) / LAUNCH_FILE).unlink(missing_ok=True)
        if created:
            Path(run_dir).rmdir()  # only if empty
    except OSError:
        pass


def write_record(run_dir: Path, record: dict) -> None:
    """Write RUN/run.json (atomically, to disk)."""
    body = {"format": RUN_FORMAT, "version": RUN_VERSION, **record}
    write_atomic(Path(run_dir) / RUN_FILE, json.dumps(body, indent=1) + "\n", fsync=True)


def run_identity(data) -> dict:
    """What a run trains on, as its record and every checkpoint's meta.json say it (and a resume checks it,
    ``trainer.checkpoint_policy.check_same_data``): the tokenizer (``tokenizer_sha256``, and ``tokenizer``: what
    rebuilds it) and the prepared data (``data``: its resolved path, train-split size and sources)."""
    tok = data.manifest["tokenizer"]
    return {
        "tokenizer_sha256": tok["sha256"],
        "tokenizer": {k: tok[k] for k in ("kind", "spec", "vocab_size", "eot_id", "eot_token", "sha256", "encoding")
                      if k in tok},
        "data": {"path": str(Path(data.path).resolve()), "train_tokens": data.train_tokens,
                 "sources": list(data.source_names)},
    }


def write_plan(run_dir: Path, plan, writing) -> None:
    """RUN/plan.toml: ``plan`` (``writing(path)``: the context a write of the run is made in, a full disk one
    line)."""
    with writing(Path(run_dir) / PLAN_FILE):
        plan.save(Path(run_dir) / PLAN_FILE)


def open_run(run_dir: Path, *, plan, record=None, writing) -> "MetricsWriter":
    """The run directory made ready for a run's lines: the directory; a new run's record first (``record()``,
    RUN/run.json; None on a resume), then checkpoints/; plan.toml written for a new run, or where the one on disk
    has another setup (resumed at another world size); metrics.jsonl opened to append to. Each write in
    ``writing(path)`` (see ``write_plan``)."""
    from memplan.plan import Plan

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if record is not None:  # what this run is, before anything else of it is written
        with writing(run_dir / RUN_FILE):
            write_record(run_dir, record())
    with writing(run_dir / CHECKPOINT_DIR):
        (run_dir / CHECKPOINT_DIR).mkdir(exist_ok=True)
    try:
        same = record is None and Plan.load(run_dir / PLAN_FILE).setup == plan.setup
    except (InputError, OSError):
        same = False
    if not same:
        write_plan(run_dir, plan, writing)
    with writing(run_dir / METRICS_FILE):
        return MetricsWriter(run_dir)


def read_record(run_dir: str | Path) -> dict | None:
    """RUN/run.json, checked for form, or None when there is none; InputError naming it when unreadable."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"--resume: {path} is unreadable ({type(e).__name__}); the run record is corrupt") from None
    if (not isinstance(record, dict) or record.get("format") != RUN_FORMAT
            or not isinstance(record.get("plan"), dict) or not isinstance(record.get("config"), dict)
            or not isinstance(record.get("data"), dict)):
        raise InputError(f"--resume: {path} is not a memplan run record")
    if record.get("version") != RUN_VERSION:
        raise InputError(f"--resume: {path}: run record version {record.get('version')!r}; this memplan reads "
                         f"{RUN_VERSION}")
    return record


def resume_source(run_dir: str | Path) -> tuple[object, dict]:
    """(newest checkpoint or None, the meta or record it resumes from) of the run in ``run_dir``; an
    InputError saying why when there is no run to resume there."""
    from trainer import checkpoint_format as ckpt

    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise InputError(f"--resume: {run_dir} does not exist; name an existing run with --out, or drop --resume "
                         "to start one")
    if not run_dir.is_dir():
        raise InputError(f"--resume: {run_dir} is a file, not a run directory")
    ref = ckpt.latest_checkpoint(run_dir / CHECKPOINT_DIR)
    if ref is not None:
        return ref, ckpt.read_meta(ref.path)
    record = read_record(run_dir)
    if record is None:
        if any(p.name not in NOT_A_RUN for p in run_dir.iterdir()):
            raise InputError(f"--resume: {run_dir} holds no run to resume (no {RUN_FILE}, no checkpoint)")
        raise InputError(f"--resume: {run_dir} holds no run (it is empty, or its run was stopped before it "
                         "began); start it without --resume")
    return None, record


def recorded_data_path(run_dir: str | Path) -> Path:
    """The prepared data the run in ``run_dir`` trains on (from its newest checkpoint, else its record)."""
    _, source = resume_source(run_dir)
    return Path(str(source.get("data", {}).get("path", "")))


@dataclass(frozen=True)
class TrainedCheckpoint:
    """A verified checkpoint of a run: where it is, its meta.json and its plan."""

    path: Path
    meta: dict
    plan: object  # memplan.plan.Plan

    @property
    def tokenizer_record(self) -> dict:
        """meta.json's ``tokenizer`` entry (its sha256 filled from ``tokenizer_sha256`` where older runs lack it)."""
        tok = dict(self.meta.get("tokenizer") or {})
        tok.setdefault("sha256", self.meta.get("tokenizer_sha256"))
        return tok

    def tokenizer(self):
        """The tokenizer the run trained with: the checkpoint's tokenizer.json (or the tiktoken encoding it names),
        with the end-of-text token and vocabulary its record names (an imported checkpoint's need not be what the
        file alone suggests)."""
        from trainer.tokenizer import Tokenizer

        tok = self.tokenizer_record
        if tok.get("kind") == "tiktoken":
            return Tokenizer.from_tiktoken(tok["encoding"])
        path = self.path / TOKENIZER_FILE
        if not path.is_file():
            raise InputError(f"{path}: missing; the checkpoint is incomplete")
        return Tokenizer.from_file(path, kind=tok.get("kind", "file")).as_recorded(tok, str(path))


def trained_checkpoint(run_dir: str | Path, checkpoint: str | Path | None = None,
                       flag: str = "--run") -> TrainedCheckpoint:
    """The newest checkpoint of the run in ``run_dir`` (or ``checkpoint``), every file's size and sha256 checked
    against its meta.json, and its plan; an InputError naming what is missing (the directory, any checkpoint)."""
    from memplan.plan import Plan
    from trainer import checkpoint_format as ckpt

    run_dir = Path(run_dir)
    if checkpoint is None:
        if not run_dir.is_dir():
            raise InputError(f"{flag} {run_dir}: no such directory; train a run with `memplan train --out {run_dir}`")
        ref = ckpt.latest_checkpoint(run_dir / CHECKPOINT_DIR)
        if ref is None:
            raise InputError(f"{flag} {run_dir}: no checkpoint in {run_dir / CHECKPOINT_DIR}; the run is incomplete "
                             f"(train it with `memplan train --out {run_dir}`)")
        path = ref.path
    else:
        path = Path(checkpoint)
        if not path.is_dir():
            raise InputError(f"--checkpoint {path}: no such directory")
    meta = ckpt.verify_checkpoint(path)
    return TrainedCheckpoint(path=path, meta=meta, plan=Plan.from_dict(meta["plan"], str(path / ckpt.META_FILE)))


class MetricsWriter:
    """RUN/metrics.jsonl's one writer (``metric_records`` its reader): each record's line appended
    (``trainer.records.dumps``), never through a symlink planted in the run; a line a kill cut short is ended
    first, so the next starts on a line of its own."""

    def __init__(self, run_dir: str | Path):
        path = self.path = Path(run_dir) / METRICS_FILE
        self._f = open_append(path, "metrics")  # never through a symlink planted in the run
        fd = self._f.fileno()
        size = os.fstat(fd).st_size
        needs_newline = size > 0 and os.lseek(fd, size - 1, os.SEEK_SET) >= 0 and os.read(fd, 1) != b"\n"
        if needs_newline:  # a kill cut the last line: start on a fresh one
            self._f.write("\n")

        self.flushed = time.perf_counter()

    def write(self, record, flush: bool = True) -> None:
        """Append one record's line (``trainer.records.dumps``); flushed now with ``flush``, else left in the
        buffer for a later flush (the loop flushes train lines at most every METRICS_FLUSH_SECONDS, and before
        anything reads the file)."""
        from trainer.records import dumps

        self._f.write(dumps(record) + "\n")
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
            except OSError:  # the trainer flushed every line before (RunLog.flush): a failure raised there
                pass


class RunLog:
    """A run's lines as they happen (``trainer.records``): appended to metrics.jsonl once ``writer`` is set (a
    ``MetricsWriter``, ``open_run``'s) - a train line in batches, at most METRICS_FLUSH_SECONDS late, any other at
    once - and handed to every ``on_event`` callback. Each write of the file is made in ``writing(path)`` (the
    trainer's: a full disk is one ``DiskFull`` line). Not ``active`` (the ranks other than 0): nothing at all."""

    def __init__(self, writing, active: bool = True):
        self._writing, self.active = writing, active
        self.writer: MetricsWriter | None = None
        self._callbacks: list = []

    def on_event(self, callback) -> None:
        self._callbacks.append(callback)

    def emit(self, line) -> None:
        if not self.active:
            return
        if self.writer is not None:
            from trainer.records import TrainLine

            with self._writing(self.writer.path):
                self.writer.write(line, flush=not isinstance(line, TrainLine) or self.writer.flush_due())
        for callback in self._callbacks:
            callback(line)

    def flush(self, sync: bool = False) -> None:
        """Every line written so far onto the file (before anything reads it: the report, the summary); ``sync``:
        onto the disk (a checkpoint's lines)."""
        if self.writer is not None:
            with self._writing(self.writer.path):
                self.writer.sync() if sync else self.writer.flush()

    def close(self) -> None:
        """Flush and close. Closing after a failure, lines that cannot be written are lost (the run's checkpoints
        are not); a run that ends normally flushed them already."""
        from trainer.stopping import DiskFull

        if self.writer is None:
            return
        try:
            self.flush()
        except (DiskFull, OSError):
            pass
        self.writer.close()


def metric_records(run_dir: str | Path, latest: bool = False) -> list:
    """The lines of RUN/metrics.jsonl as ``trainer.records`` records (a line cut by a kill is skipped; a line
    that is JSON but not one memplan wrote is an InputError naming the file and the line).

    With ``latest``, a train or eval line for a step that a later line of the same kind repeats
    (a run resumed from a checkpoint before it) is dropped, so each step appears once.
    """
    from trainer.records import read_records

    return read_records(Path(run_dir) / METRICS_FILE, latest=latest)


def read_metrics(run_dir: str | Path, latest: bool = False) -> list[dict]:
    """``metric_records``, each as its JSON object (the keys of docs/run-directory.md; keys this memplan does
    not know are left out)."""
    return [r.to_json() for r in metric_records(run_dir, latest=latest)]
