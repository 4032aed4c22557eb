"""``memplan profiles [--json]``: list the bundled device profiles.

Reads ``memplan/profiles/*.toml`` through ``memplan.hardware``; nothing here imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from memplan.cli.app import app
from memplan.cli.fit import fits
from memplan.cli.options import JsonOpt, print_json
from memplan.hardware import Device, all_profiles
from memplan.units import GiB

# The dtypes a training run can compute in (the --precision choices; fp8 is not one of them), in order
# of preference when two are equally fast: bf16 needs no loss scaling, fp16 beats tf32 beats fp32.
TRAINING_DTYPES = ("bf16", "fp16", "tf32", "fp32")


def best_native_dtype(device: Device) -> tuple[str, float]:
    """The native training dtype with the highest achievable matmul rate, and that rate in TFLOPS.

    Achievable = peak x achievable fraction (or a calibrated rate); fp32 always qualifies."""
    rates = {dtype: device.matmul_flops_per_second(dtype) / 1e12
             for dtype in TRAINING_DTYPES if dtype in device.peak_tflops and device.supports(dtype)}
    dtype = max(rates, key=rates.__getitem__)  # the first of equals wins
    return dtype, rates[dtype]


def profile_json(device: Device) -> dict:
    """One profile as plain data: every field of the Device, plus the best native dtype."""
    dtype, tflops = best_native_dtype(device)
    return {
        "name": device.name,
        "title": device.title,
        "family": device.family,
        "memory_reader": device.memory_reader,
        "memory_bytes": device.memory_bytes,
        "usable_bytes": device.usable_bytes,
        "bandwidth_bytes_per_second": device.bandwidth_bytes_per_second,
        "peak_tflops": device.peak_tflops,
        "achievable": device.achievable,
        "native": device.native,
        "best_native_dtype": dtype,
        "best_achievable_tflops": round(tflops, 3),
        "runtime_context_bytes": device.runtime_context_bytes,
        "allocator_overhead": device.allocator_overhead,
        "interconnect": device.interconnect,
        "match": list(device.match),
        "sources": device.sources,
        "path": device.path,
    }


def _short_path(path: str) -> str:
    """The profile's path relative to the working directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _profiles_table(devices, with_title: bool):
    """The profiles table; without the title column (for a narrow terminal), the titles go under it."""
    from rich.table import Table

    table = Table(title="Device profiles (GiB = 2^30 bytes; cpu shows this host's RAM)", title_justify="left")
    table.add_column("name", style="bold", no_wrap=True)
    if with_title:
        table.add_column("title", no_wrap=True)
    table.add_column("family", no_wrap=True)
    table.add_column("GiB total\n/ usable", justify="right", no_wrap=True)
    table.add_column("GB/s", justify="right", no_wrap=True)
    table.add_column("best native\ndtype TFLOPS", justify="right", no_wrap=True)
    for d in devices:
        dtype, tflops = best_native_dtype(d)
        table.add_row(d.name, *([d.title] if with_title else []), d.family,
                      f"{d.memory_bytes / GiB:.1f} / {d.usable_bytes / GiB:.1f}",
                      f"{d.bandwidth_bytes_per_second / 1e9:,.0f}", f"{dtype} {tflops:,.1f}")
    return table


def _files_line(devices) -> str:
    """Where the profiles are read from: one ``DIR/NAME.toml`` line when every file is its name's in one
    directory (the bundled profiles), else each path."""
    paths = [Path(_short_path(d.path)) for d in devices]
    folders = {p.parent for p in paths}
    if len(folders) == 1 and all(p.name == f"{d.name}.toml" for p, d in zip(paths, devices)):
        return f"files: {next(iter(folders)) / 'NAME.toml'}"
    return "files:\n" + "\n".join(f"  {d.name}: {p}" for p, d in zip(paths, devices))


@app.command("profiles")
def profiles(as_json: JsonOpt = False) -> None:
    """List the bundled device profiles: memory, bandwidth, and the fastest native dtype."""
    from rich.console import Console
    from rich.table import Table

    devices = all_profiles()
    if as_json:
        print_json([profile_json(d) for d in devices])
        return
    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=160, highlight=False)  # a pipe or a file has no width to fit: the wide table
    table = _profiles_table(devices, with_title=True)
    if fits(console, table):
        console.print(table)
    else:  # a narrow terminal: each row stays on one line, the titles go under the table
        console.print(_profiles_table(devices, with_title=False))
        titles = Table.grid(padding=(0, 2))
        titles.add_column(style="bold", no_wrap=True)
        titles.add_column()
        for d in devices:
            titles.add_row(d.name, d.title)
        console.print(titles)
    console.print(_files_line(devices), soft_wrap=True)
