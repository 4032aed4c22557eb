"""RUN/report.html, rendered in a process of its own.

The page is a few MB of HTML (plotly.js inlined, about 4.7 MB) built from the run's metrics with plotly.
Rendered inside the training process, that left the process holding what the render allocated: on a
CPU, where the process's resident memory is the training's measured peak, the first render of the quick
start's run added about 25 MiB of resident memory that stayed (plotly's lazily imported validators and
the page's strings in Python's arenas), and the freed pages it left in the C heap moved the next steps'
allocations higher (heap 234 -> 250 MiB): the quick start's measured peak grew from 401 to 437 MiB over
a 90-second run against a flat 401 MiB prediction (``benchmarks/local_memory.py --whole``). The training
process now never imports plotly; ``python -m memplan.reports.run RUN`` renders the page beside it.

- ``refresh()``: start a render and return at once (a checkpoint's periodic refresh, when ``refresh_due``: at
  most once per REPORT_REFRESH_SECONDS); one at a time, a refresh while one runs is skipped. Its outcome is
  read by the next ``refresh`` or ``write``.
- ``write()``: render now and wait (the end of a run, a run given up), returning the page's path.

A render that fails costs the run nothing: it is a ``ReportFailedEvent`` line. A full disk stops the run
as any other write of the run does (``DiskFull`` through ``writing``).
"""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import memplan
from trainer.rundir import REPORT_FILE

NO_SPACE_EXIT = 3  # memplan.reports.run's exit status when the disk was full
REPORT_REFRESH_SECONDS = 60.0  # a checkpoint refreshes RUN/report.html at most this often


def _command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "memplan.reports.run", str(run_dir), "--background"]


def _environment() -> dict:
    """This process's environment, with memplan's own directory first on PYTHONPATH (the child imports
    the same memplan this process runs, installed or not)."""
    root = str(Path(memplan.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class ReportRenderer:
    """Renders ``run_dir``/report.html in a child process (``python -m memplan.reports.run``); a refresh is due
    ``refresh_seconds`` (on ``clock``) after the last render asked for (``last_render``: the trainer sets it when
    the run opens, so the first refresh comes that long into it)."""

    def __init__(self, run_dir: Path, on_failure: Callable[[str], None],
                 refresh_seconds: float = REPORT_REFRESH_SECONDS, clock: Callable[[], float] = time.perf_counter):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / REPORT_FILE
        self._on_failure = on_failure  # a failed render's one line (the trainer logs a ReportFailedEvent)
        self._child: subprocess.Popen | None = None
        self.refresh_seconds, self._clock = refresh_seconds, clock
        self.last_render = -math.inf  # when a render was last asked for (a refresh skipped counts)

    def refresh_due(self) -> bool:
        return self._clock() - self.last_render >= self.refresh_seconds

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.poll() is None

    def refresh(self) -> None:
        """Start a render unless one is running; a finished one's outcome is taken first (``OSError`` with
        ENOSPC when it found the disk full)."""
        self.last_render = self._clock()
        if self.running:
            return
        self._reap()
        self._child = self._start()

    def write(self) -> Path | None:
        """Render now, after any render still running, and wait. The page's path, or None when the render
        failed (reported through ``on_failure``); ``OSError`` (ENOSPC) when the disk is full."""
        self.last_render = self._clock()
        self._reap()
        self._child = self._start()
        return self.path if self._reap() else None

    def close(self) -> None:
        """Wait for a render still running (a run closed after a failure does not raise for it)."""
        try:
            self._reap()
        except OSError:
            pass

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(_command(self.run_dir), env=_environment(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def _reap(self) -> bool:
        """Take the last render's outcome, waiting for it if it still runs: True when it wrote the page (or
        there was none to take)."""
        child, self._child = self._child, None
        if child is None:
            return True
        _, err = child.communicate()
        if child.returncode == 0:
            return True
        line = (err or "").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
        if child.returncode == NO_SPACE_EXIT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        self._on_failure(line[0][:300])
        return False
