"""This machine's calibration for a run (``memplan train``): the cached one (``memplan.local``), else, for the quick
start, one measured now and kept when steady enough to trust. Measuring needs torch in a process of its own:
the trainer passes that in (``measure(again)``: ``trainer.train_run.calibrate_in_child``), so this module stays
torch-free.
"""

from __future__ import annotations

import time
from typing import Callable

QUICKSTART_CALIBRATE_SECONDS = 15.0  # the quick start's first calibration of this machine (then cached)
CALIBRATE_ATTEMPTS = 2  # the quick start measures again once when the first calibration is too noisy to keep


def local_calibration(profile, measure_now: bool, threads: int | None = None,
                      measure: Callable[[bool], object] | None = None):
    """``_local_calibration``, and where its rates are a one-thread CPU calibration timed by CPU time,
    its share of the core measured again now (``memplan.local.core_share_now``): the contention of the
    run about to start, not of the calibration's minute."""
    from memplan import local

    profile, note = _local_calibration(profile, measure_now, threads, measure)
    share = profile.calibrated.get("cpu_share") if profile.family == "cpu" else None
    if share and note and "nominal" not in note:
        profile, said = local.with_share_probes(profile, local.core_share_probes())
        note = f"{note}; {said}"
    return profile, note


def _local_calibration(profile, measure_now: bool, threads: int | None = None,
                       measure: Callable[[bool], object] | None = None):
    """The local ``profile`` with what this machine measured (rates and runtime context): its cached
    calibration (``memplan.local``) with ``threads`` torch threads (default: the count calibration
    found fastest) if there is a trusted one; else, with ``measure_now`` (the quick start), a short
    calibration (QUICKSTART_CALIBRATE_SECONDS) run now in a process of its own (``measure(again)``, returning a
    ``memplan.local.LocalCalibration`` in a temporary file, or raising RuntimeError), and cached if its
    timings are steady enough to trust (measured again once if not; a noisy one is used for this run
    only, its spread printed); else the profile as it is. Returns the profile and a line saying
    where its rates come from (printed once the run's options are all accepted, so that an error
    stays one line)."""
    from memplan import local

    if profile.calibrated:
        return profile, None
    family = profile.family
    cached = local.find_calibration(family, threads)
    if cached is not None:
        return cached.applied(profile), cached.note()
    noisy = local.find_noisy_calibration(family, threads)
    if not measure_now and noisy is not None:
        return local.context_only(profile, noisy)
    if not measure_now:
        return profile, ("[dim]rates: the profile's nominal figures; `memplan train` measures this machine once "
                         "(predictions of time are far closer afterwards)[/]")
    local.require_cache("the quick start keeps this machine's calibration there")  # before measuring, not after
    measured = []  # each in a temporary file, removed below
    started = time.perf_counter()  # the whole of it: start-up, the thread trial, the measurements, a second attempt
    try:
        for attempt in range(CALIBRATE_ATTEMPTS):
            try:
                measured.append(measure(attempt > 0))
            except RuntimeError as e:
                if measured:
                    break
                return profile, f"[yellow]rates: the profile's nominal figures[/] ({e})"
            if measured[-1].trusted:
                break
        best = min(measured, key=lambda c: c.noise)
        took = calibration_took(time.perf_counter() - started, len(measured))
        title = local.local_title(family)
        version = local.torch_version()
        path = local.calibration_path(family, title, best.threads, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        from memplan.fsutil import write_atomic as write_atomically  # the old file survives any failure

        if threads is None:  # the thread count it found fastest (steps interleaved) is this machine's default
            seconds = best.calibrated.get("thread_seconds", {})
            write_atomically(local.threads_path(family, title, version),
                             "# the torch thread count `memplan train` measured fastest here\n"
                             f"threads = {best.threads}\n"
                             + "".join(f"seconds_{n}t = {v:.6g}\n" for n, v in seconds.items()))
        if not best.trusted:  # kept apart, for its runtime memory only: never as this machine's rates
            write_atomically(local.noisy_path(path), best.path.read_text())
            return best.applied(profile), (
                f"{best.note()} — [yellow]too noisy to keep[/] (other processes competed for the CPU): time "
                f"predictions are uncertain by about ±{best.noise:.0%}; the next run measures again ({took})")
        write_atomically(path, best.path.read_text())
        local.noisy_path(path).unlink(missing_ok=True)
    finally:
        for cal in measured:
            cal.path.unlink(missing_ok=True)
    kept = local.read_calibration(path)
    return kept.applied(profile), f"{kept.note()} ({took}; kept)"


def calibration_took(seconds: float, attempts: int) -> str:
    """How long measuring this machine took, all of it (the README's 15 s are the measurements alone)."""
    return (f"measured now in {seconds:.0f} s: {QUICKSTART_CALIBRATE_SECONDS:g} s of measurements"
            + (f" × {attempts} attempts" if attempts > 1 else "") + ", the thread trial and torch's start-up")
