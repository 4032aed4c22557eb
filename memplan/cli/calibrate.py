"""``memplan calibrate``: measure the local device and write a profile TOML that ``--device PATH`` uses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.cli.fit import print_fitted
from memplan.cli.options import JsonOpt, print_json
from memplan.errors import InputError
from memplan.fsutil import check_room
from memplan.local import NOISY, slug

# What a training process (`memplan train`, a rank of `python -m trainer RUN`) has loaded besides trainer before
# its model exists: this command line. The calibration imports it before it measures the runtime context.
TRAINING_PROCESS_MODULES = ("memplan.cli",)

OutOpt = Annotated[Optional[str], typer.Option(
    "--out", metavar="PATH", help="Profile TOML to write (default: calibrated-<device>.toml in the current directory).",
    show_default=False)]
DeviceNameOpt = Annotated[Optional[str], typer.Option(
    "--device-name", metavar="NAME", help="The profile's name (what `--device` reports); default: <bundled name>-calibrated or "
                          "the device's model name.", show_default=False)]
SecondsOpt = Annotated[str, typer.Option(
    "--seconds", metavar="S", help="Time budget of the measurements (the smallest case of every table is always measured); "
                      "CPU seconds with --clock cpu.")]
ThreadsOpt = Annotated[Optional[str], typer.Option(
    "--threads", metavar="N", help="torch CPU threads to measure with (recorded in the profile; train with the same). "
                      "Default on a CPU: the faster of one thread and all cores, timed first on a small "
                      "training step.", show_default=False)]
ClockOpt = Annotated[str, typer.Option(
    "--clock", metavar="CLOCK", help="wall | cpu. cpu times one CPU thread by its process CPU time, which leaves out the time "
                    "other processes hold the core (shared machines); needs --threads 1.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite an existing --out file.")]
CompileMeasureOpt = Annotated[bool, typer.Option(
    "--compile", help="Also time torch.compile on a reference training step (its speedup and its one-off compile "
                      "time, outside --seconds: tens of seconds), so autotune can weigh it.")]

DEFAULT_SECONDS = "50"  # measurements plan 80% of it; with torch's import the command ends within a minute


PROFILE_BYTES_AT_MOST = 64 << 10  # a calibrated profile's TOML: a few KiB (the largest shipped profile is 6.7 KiB)


def check_out(out: Path, force: bool) -> None:
    """--out must be a writable file path; an existing file needs --force (nothing is touched before)."""
    if out.is_dir():
        raise InputError(f"--out: {str(out)!r} is a directory; give a file name such as my-device.toml")
    if out.exists() and not force:
        raise InputError(f"--out: {str(out)!r} exists; pass --force to overwrite it, or choose another file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"--out: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--out: cannot write to the directory {str(parent)!r}")
    if out.exists() and not os.access(out, os.W_OK):
        raise InputError(f"--out: {str(out)!r} is not writable")


def _print_summary(console, device, cal, out: Path) -> None:
    from rich.table import Table

    from memplan.units import format_bytes

    t = Table(title=f"Calibrated {device.title}", title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("", style="dim")
    rates = cal.matmul_tflops()
    for dtype, rate in rates.items():
        peak = device.peak_tflops.get(dtype)
        if dtype != "fp32" and not device.native.get(dtype) and rates.get("fp32"):
            note = f"not native here: {rate / rates['fp32']:.0%} of the fp32 rate"
        else:
            note = f"{rate / peak:.0%} of {peak:.3g} TFLOPS peak" if peak else ""
        t.add_row(f"matmul {dtype}", f"{rate * 1e3:,.1f} GFLOPS" if rate < 1 else f"{rate:,.1f} TFLOPS", note)
    t.add_row("copy bandwidth", f"{cal.bandwidth_bytes_per_second / 1e9:,.1f} GB/s", "read + written")
    t.add_row("launch overhead", f"{cal.launch_overhead_seconds * 1e6:,.1f} µs", "per dispatched op")
    if cal.first_touch_bytes_per_second:
        t.add_row("first touch", f"{cal.first_touch_bytes_per_second / 1e9:,.2f} GB/s",
                  f"fresh tensors above {format_bytes(cal.first_touch_threshold_bytes or 0)}")
    for name, (per_param, per_tensor) in cal.optimizer.items():
        t.add_row(f"optimizer {name}", f"{per_param * 1e9:,.2f} ns/param", f"+ {per_tensor * 1e6:,.1f} µs/tensor")
    t.add_row("memory", format_bytes(cal.memory_total_bytes), f"{format_bytes(cal.memory_usable_bytes)} usable")
    def steps(seconds: dict[str, float]) -> str:  # a thread trial's median step per thread count
        return ", ".join(f"{n}: {s * 1e3:,.1f} ms" for n, s in seconds.items())

    trial, again = steps(cal.thread_seconds), steps(cal.thread_recheck)
    t.add_row("threads", str(cal.threads), f"clock: {cal.clock}" + (f"; small step with {trial}" if trial else "")
              + (f"; after the measurements {again}" if again else ""))
    t.add_row("noise", f"{cal.noise:.0%}", "median spread (IQR / median) of repeated timings"
              + (f", or how much slower the small step ran after it ({cal.thread_slowdown:.0%}), the larger"
                 if cal.thread_recheck else ""))
    print_fitted(console, t)  # (memplan/cli/fit.py: borderless where the rows would wrap)
    if cal.noise > NOISY:
        console.print(f"[yellow]note[/]: repeated timings spread by {cal.noise:.0%} (IQR / median): other processes "
                      "are competing for the device. On a shared CPU, `--threads 1 --clock cpu` times by CPU time "
                      "(and train with one thread); otherwise calibrate again when the machine is idle.")
    if cal.skipped:
        console.print(f"[dim]{len(cal.skipped)} measurement(s) skipped to stay within the budget "
                      "(the model interpolates and holds the nearest measured rates).[/]")
    console.print(f"Wrote [bold]{out}[/] in {cal.seconds:.0f} s; use it with [bold]--device {out}[/]")


@app.command("calibrate")
def calibrate_command(
    out: OutOpt = None, device_name: DeviceNameOpt = None, seconds: SecondsOpt = DEFAULT_SECONDS,
    threads: ThreadsOpt = None,
    clock: ClockOpt = "wall", force: ForceOpt = False, json: JsonOpt = False, compile: CompileMeasureOpt = False,
) -> None:
    """Measure this machine's device (matmul per dtype and shape, memory bandwidth, attention, optimizer, launch
    overhead, memory) and write a profile TOML with the measured rates."""
    from memplan.units import parse_count, parse_float

    budget = parse_float(seconds, "--seconds", low=0, low_open=True, example="60 (seconds)")
    n_threads = parse_count(threads, "--threads") if threads is not None else None
    if clock not in ("wall", "cpu"):
        raise InputError(f"--clock: {clock!r} is not one of wall, cpu")
    if clock == "cpu" and n_threads != 1:
        raise InputError("--clock cpu times one CPU thread: pass --threads 1 with it")
    if device_name is not None and not device_name.strip():
        raise InputError("--device-name: give a non-empty name, such as my-laptop")
    target = Path(out) if out else None
    if target is not None:
        check_out(target, force)
        check_room(target, PROFILE_BYTES_AT_MOST, "--out", "a calibrated profile")  # before minutes of measuring

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trainer import calibrate as cal_mod

    from memplan.hardware import match_profile

    console = Console(stderr=True)
    columns = (TextColumn("[bold]calibrating[/] {task.description:<18}"), BarColumn(),
               TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=json) as progress:
        task = progress.add_task("starting", total=1.0)
        cal = cal_mod.calibrate(budget, threads=n_threads, clock=clock, choose_threads=n_threads is None, compile=compile,
                                loaded=TRAINING_PROCESS_MODULES,
                                progress=lambda stage, done: progress.update(task, description=stage, completed=done))
    base = match_profile(cal.title, cal.family) if cal.family != "cpu" else None
    name = device_name.strip() if device_name else (f"{base.name}-calibrated" if base else slug(cal.title))
    if target is None:
        target = Path(f"calibrated-{slug(name)}.toml")
        check_out(target, force)
        check_room(target, PROFILE_BYTES_AT_MOST, "--out", "a calibrated profile")
    data = cal_mod.profile_data(cal, name, base)
    text = cal_mod.profile_toml(data)
    # the file must load as a profile before it replaces anything
    from memplan.compat import tomllib

    from memplan.hardware import device_from_toml

    device = device_from_toml(tomllib.loads(text), str(target))
    from memplan.fsutil import full_disk_is_one_line, write_atomic

    with full_disk_is_one_line(target, "--out", "the profile"):  # one line, exit 1
        write_atomic(target, text)  # a temporary file beside it, renamed over: the old file survives any failure
    if json:
        print_json({"out": str(target), "profile": data})
    else:
        _print_summary(Console(), device, cal, target)
