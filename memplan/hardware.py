"""Device profiles: one TOML file per device in ``memplan/profiles/``, loaded into a frozen ``Device``.

A profile is data with a source for every number. Its schema (all sizes in bytes, rates in the
unit their key names)::

    name = "rtx-4090"                 # what --device takes
    title = "NVIDIA GeForce RTX 4090"
    family = "cuda"                   # cuda | rocm | mps | cpu
    memory_reader = "nvml"            # nvml | rocm-smi | mps | psutil
    match = ["RTX 4090"]              # substrings of the driver's device name, for detection

    [memory]
    total_bytes = 25757220864
    usable_bytes = 25390000000        # what one training process can hold (peak_reserved must fit)
    bandwidth_bytes_per_second = 1.008e12
    source = "..."

    [peak_tflops]                     # dense, no sparsity, FP32 accumulation
    fp32 = 82.6
    source = "..."

    [native]                          # dtypes that run natively and fast in PyTorch here
    bf16 = true

    [achievable]                      # fraction of peak a PyTorch matmul reaches, measured
    fp32 = 0.67
    source = "..."

    [runtime]
    context_bytes = 400000000         # runtime context outside the allocator (CUDA context, ...)
    allocator_overhead = 0.05         # caching-allocator reserve beyond allocated, as a fraction
    source = "..."
    # optional, CPU (written by memplan calibrate): what transformers' model code, and peft's, keep resident
    # in a training process (memplan.memory.terms.model_code_resident_bytes; default: its measured figures)
    # transformers_code_bytes = 46137344
    # peft_code_bytes = 11744051

Optional tables: ``[kernels]`` (``flash_attention = true`` where SDPA's flash kernel runs: it is
the only CUDA/ROCm backend that takes grouped-query K/V without repeating them, so the planner
counts repeated K/V elsewhere; default true for the CPU, false otherwise), ``[native]`` (above), ``[interconnect]`` (the link between devices: ``kind`` such as
nvlink4 | pcie4 | infinity-fabric | ethernet, ``bandwidth_bytes_per_second`` per direction,
``latency_seconds`` per hop, ``peer_bandwidth_bytes_per_second`` where one peer gets less than all
together, as on MI300X, ``source``) and ``[calibrated]`` (rates measured by ``memplan calibrate``).
``[calibrated]`` may also hold ``compile_speedup``, the eager step time over the ``torch.compile``d
one (e.g. 1.25): ``memplan autotune`` proposes torch.compile only where it is present and above 1;
``compile_seconds``, the one-off compile time; and ``[calibrated.compile_reference]`` (written by
``memplan calibrate --compile``: the reference step's shape and its measured ``eager_seconds``,
``compiled_seconds`` and ``compile_seconds``), from which ``memplan.timing`` models every compiled setup; and
``[calibrated.compile_cost]`` (``fixed_seconds`` and ``seconds_per_op`` of the compiled graph, from which
``memplan.timing.compile_seconds`` predicts the one-off compile time of any model).
Every table's ``source`` ends up in ``Device.sources``. A bundled profile's ``source`` is its own evidence:
for each origin, the document (repository and file, URL, issue or pull request) and the figure it states,
``; ``-separated, so the profile needs nothing outside it. ``--device PATH`` loads any file of this schema.

``[calibrated]``, written by ``memplan calibrate`` (``trainer/calibrate.py`` measures, ``memplan/timing.py``
uses). Every field is optional; a missing one falls back to the profile's peaks and bandwidth. Kernel
times are *net*: the first-touch cost of fresh outputs is taken out (timing adds it back)::

    [calibrated]
    date = "2026-01-01T12:00:00"      # when it was measured
    torch = "2.13.0+cpu"              # the torch it was measured with
    threads = 1                       # torch.get_num_threads() while measuring: train with the same
    seconds = 58.2                    # how long the calibration took
    noise = 0.04                      # median relative spread (IQR / median) of repeated timings, or
                                      # thread_slowdown where that is larger
    thread_slowdown = 0.0             # several threads, wall clock: how much slower the thread trial's
                                      # step ran after the measurements than before (max(0, after/before-1))
    cpu_share = 0.55                  # clock "cpu", one thread: CPU time / wall time over the calibration
                                      # (the core's share other processes left it; timing's contention term)
    launch_overhead_seconds = 2.1e-5  # per dispatched aten op (views included), forward + backward of a
                                      # tiny reference block divided by memplan's count of its ops
    copy_bytes_per_second = 5.3e9     # bytes read + written per second by a large copy
    first_touch_bytes_per_second = 7e8  # CPU: fresh pages written per second (kernel page zeroing)
    first_touch_threshold_bytes = 33554432  # CPU: tensors above this are fresh pages (glibc mmap threshold)
    skipped = ["matmul bf16 4096x1024x32768"]  # measurements the time budget did not allow
    source = "measured by memplan calibrate on ..."

    [calibrated.matmul_tflops]        # best net forward F.linear rate per dtype (Device.matmul_flops_per_second)
    fp32 = 0.075

    [calibrated.matmul]               # per dtype: rows [tokens, in, out, forward_tflops, backward_tflops]
    fp32 = [[64, 64, 64, 0.02, 0.025], ...]   # forward: x(tokens, in) · W(out, in)ᵀ; backward: both
                                              # gradient matmuls through autograd, 4·tokens·in·out FLOPs
    [calibrated.elementwise]          # per dtype: rows [operand_bytes, bytes_per_second] of an add (2 reads,
    fp32 = [[262144, 1.1e10], ...]    # 1 write), operands cycled through 32 MiB as a step's tensors are

    [calibrated.modules]              # "<rmsnorm|layernorm|rotary|swiglu|gelu>_<dtype>": rows [output
    rmsnorm_fp32 = [[16384, 1e-4, 3e-4], ...] # elements, forward_seconds, backward_seconds], each module timed
                                              # whole through autograd (its dispatches included)

    [calibrated.transcendental]       # elements per second: silu_fp32, silu_bf16, log_softmax_fp32, ...
    silu_fp32 = 3.1e8

    [calibrated.attention]            # "<sdpa|eager>_<dtype>": rows [ctx, head_dim, forward_tflops,
    sdpa_fp32 = [[64, 32, 0.01, 0.008], ...]  # backward_tflops] against nominal 4·B·heads·T²·head_dim forward
                                              # FLOPs and twice that backward (causal masking not discounted)
    [calibrated.optimizer]            # clip_grad_norm_ + step() + zero_grad(): [seconds_per_param,
    adamw = [3.0e-9, 2.0e-5]          #   seconds_per_tensor], for adamw (foreach), adamw-fused, sgd

Nothing here imports torch: detection of the local device reads NVML, ROCm SMI, the OS and psutil.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import re
from memplan.compat import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a bundled resource: a path in a wheel or a checkout, a zip member in a zip import
    from importlib.resources.abc import Traversable

from memplan.errors import InputError
from memplan.units import choice_error

FAMILIES = ("cuda", "rocm", "mps", "cpu")
MEMORY_READERS = ("nvml", "rocm-smi", "mps", "psutil")
DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")


@dataclass(frozen=True, kw_only=True)
class Device:
    """A device profile. Rates per dtype are keyed by ``fp32``, ``tf32``, ``fp16``, ``bf16``, ``fp8``."""

    name: str  # short name, what --device takes
    title: str  # marketing name
    family: str  # cuda | rocm | mps | cpu
    memory_reader: str  # nvml | rocm-smi | mps | psutil
    memory_bytes: int  # total device (or unified) memory
    usable_bytes: int  # what one training process can hold
    bandwidth_bytes_per_second: float  # sustained memory bandwidth
    peak_tflops: dict[str, float]  # dense vendor peak per dtype
    achievable: dict[str, float]  # fraction of peak a PyTorch matmul reaches, per dtype
    native: dict[str, bool]  # dtypes that run natively and fast
    runtime_context_bytes: int  # memory outside the allocator: CUDA/HIP context, libraries
    allocator_overhead: float  # reserved beyond allocated by the caching allocator, as a fraction
    flash_attention: bool = False  # SDPA's flash kernel runs here (it alone takes grouped-query K/V unrepeated)
    # CPU: what transformers' model code (peft's) keeps resident in a training process, as measured here
    # ([runtime] transformers_code_bytes / peft_code_bytes); None: memplan.memory.terms' default
    transformers_code_bytes: int | None = None
    peft_code_bytes: int | None = None
    match: tuple[str, ...] = ()  # substrings of the driver's name that identify this device
    interconnect: dict = field(default_factory=dict)  # bandwidth_bytes_per_second, kind, latency_seconds
    calibrated: dict = field(default_factory=dict)  # rates measured by memplan calibrate
    sources: dict = field(default_factory=dict)  # table -> citation
    path: str = ""  # the file it came from

    def matmul_flops_per_second(self, dtype: str) -> float:
        """Achievable dense matmul rate for a compute dtype: the calibrated rate if measured,
        else peak × achievable fraction. Falls back to fp32 for a dtype the device lacks."""
        measured = self.calibrated.get("matmul_tflops", {})
        if dtype in measured:
            return measured[dtype] * 1e12
        if dtype not in self.peak_tflops:
            dtype = "fp32"
        return self.peak_tflops[dtype] * 1e12 * self.achievable.get(dtype, 0.5)

    def supports(self, dtype: str) -> bool:
        """Whether ``dtype`` runs natively (fp32 always does)."""
        return dtype == "fp32" or bool(self.native.get(dtype, False))

    @property
    def best_precision(self) -> str:
        """The training precision this device runs best: bf16-mixed where bf16 is native, else fp16-mixed where
        fp16 is, else fp32 (a CPU emulates half types). What ``train`` and ``estimate`` take when not told."""
        if self.supports("bf16"):
            return "bf16-mixed"
        if self.supports("fp16"):
            return "fp16-mixed"
        return "fp32"

    def to_json(self) -> dict:
        """The ``device`` object of the --json output (docs/json.md)."""
        return {"name": self.name, "memory_bytes": self.memory_bytes, "usable_bytes": self.usable_bytes}

    def replace(self, **changes) -> "Device":
        return dataclasses.replace(self, **changes)

    def with_memory(self, total_bytes: int) -> "Device":
        """The same device with another memory size (a Mac or a Strix Halo configured otherwise);
        usable memory keeps its share of the total."""
        share = self.usable_bytes / self.memory_bytes
        return self.replace(memory_bytes=total_bytes, usable_bytes=int(total_bytes * share))


# ---- loading -------------------------------------------------------------------------------

def _profiles_dir() -> Traversable:
    """The bundled profiles, ``memplan/profiles/*.toml``, as package resources: the same files in a
    checkout, an editable install, a wheel or a zip import (never a filesystem path round trip)."""
    return resources.files("memplan") / "profiles"


def profile_names() -> list[str]:
    return sorted(p.name[:-len(".toml")] for p in _profiles_dir().iterdir() if p.name.endswith(".toml"))


def bundled_profile_ref(name: str) -> str:
    """How a bundled profile's ``Device.path`` reads (its resource's location)."""
    return str(_profiles_dir() / f"{name}.toml")


def _need(table: dict, key: str, where: str, path: str):
    if key not in table:
        raise InputError(f"profile {path}: missing field {where}{key}")
    return table[key]


def _table(data: dict, key: str, path: str, required: bool = True) -> dict:
    """A TOML table, as a copy (an absent optional one is empty)."""
    value = _need(data, key, "", path) if required else data.get(key, {})
    if not isinstance(value, dict):
        raise InputError(f"profile {path}: {key} must be a table ([{key}])")
    return dict(value)


def _finite(value, minimum: float = 0.0, strict: bool = False) -> bool:
    """``value`` is a finite number (not a TOML boolean, not nan or inf) >= ``minimum`` (> with ``strict``)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and (value > minimum if strict else value >= minimum))


def _accepted(minimum: float, strict: bool) -> str:
    return f"a finite number {'>' if strict else '>='} {minimum:g}"


def _number(table: dict, key: str, where: str, path: str, minimum: float = 0.0, strict: bool = False) -> float:
    """A required finite number >= minimum (> minimum with ``strict``); TOML booleans, nan and inf are not."""
    value = _need(table, key, where, path)
    if not _finite(value, minimum, strict):
        raise InputError(f"profile {path}: {where}{key} = {value!r:.60}; accepted: {_accepted(minimum, strict)}")
    return value


def device_from_toml(data: dict, path: str = "<toml>") -> Device:
    """A Device from a parsed profile; a missing or wrong field is an InputError naming it."""
    mem = _table(data, "memory", path)
    peak = _table(data, "peak_tflops", path)
    ach = _table(data, "achievable", path)
    runtime = _table(data, "runtime", path)
    native = _table(data, "native", path, required=False)
    interconnect = _table(data, "interconnect", path, required=False)
    kernels = _table(data, "kernels", path, required=False)
    family = _need(data, "family", "", path)
    if family not in FAMILIES:
        raise InputError(f"profile {path}: family {family!r} is not one of {', '.join(FAMILIES)}")
    reader = data.get("memory_reader", {"cuda": "nvml", "rocm": "rocm-smi", "mps": "mps", "cpu": "psutil"}[family])
    if reader not in MEMORY_READERS:
        raise InputError(f"profile {path}: memory_reader {reader!r} is not one of {', '.join(MEMORY_READERS)}")
    sources = {k: v.pop("source") for k, v in (("memory", mem), ("peak_tflops", peak), ("achievable", ach),
                                                 ("native", native), ("runtime", runtime),
                                                 ("interconnect", interconnect), ("kernels", kernels)) if "source" in v}
    flash = kernels.get("flash_attention", family == "cpu")
    if not isinstance(flash, bool):
        raise InputError(f"profile {path}: kernels.flash_attention = {flash!r}; expected true or false")
    if "fp32" not in peak:
        raise InputError(f"profile {path}: missing field peak_tflops.fp32")
    for table_name, table in (("peak_tflops", peak), ("achievable", ach)):
        for k, v in table.items():  # a zero, nan or inf peak would divide step times by it
            if k not in DTYPES or not _finite(v, 0, strict=True):
                raise InputError(f"profile {path}: {table_name}.{k} = {v!r:.60}; keys are {', '.join(DTYPES)}, "
                                 f"values {_accepted(0, True)}")
    for k, v in ach.items():
        if not 0 < v <= 1:
            raise InputError(f"profile {path}: achievable.{k} = {v!r} is not a fraction of peak in (0, 1]")
    for k, v in native.items():
        if k not in DTYPES or not isinstance(v, bool):
            raise InputError(f"profile {path}: native.{k} = {v!r}; keys are {', '.join(DTYPES)}, values true/false")
    for key, strict in (("bandwidth_bytes_per_second", True), ("peer_bandwidth_bytes_per_second", True),
                        ("latency_seconds", False)):
        if key in interconnect:
            _number(interconnect, key, "interconnect.", path, strict=strict)
    for key, value in (("name", data.get("name", "")), ("title", data.get("title", "")),
                       ("interconnect.kind", interconnect.get("kind", ""))):
        if not isinstance(value, str):
            raise InputError(f"profile {path}: {key} = {value!r:.60}; accepted: a string")
    match = data.get("match", [])
    if not isinstance(match, list) or not all(isinstance(m, str) and m.strip() for m in match):
        raise InputError(f"profile {path}: match = {match!r:.60}; accepted: a list of non-empty strings, "
                         'such as ["RTX 4090"]')
    total = int(_number(mem, "total_bytes", "memory.", path, minimum=1))
    usable = int(_number(mem, "usable_bytes", "memory.", path, minimum=1))
    if not 0 < usable <= total:
        raise InputError(f"profile {path}: memory.usable_bytes must be in (0, total_bytes]")
    return Device(
        name=str(_need(data, "name", "", path)),
        title=str(data.get("title", data["name"])),
        family=family,
        memory_reader=reader,
        memory_bytes=total,
        usable_bytes=usable,
        bandwidth_bytes_per_second=float(_number(mem, "bandwidth_bytes_per_second", "memory.", path, strict=True)),
        peak_tflops={k: float(v) for k, v in peak.items()},
        achievable={k: float(v) for k, v in ach.items()},
        native=native,
        runtime_context_bytes=int(_number(runtime, "context_bytes", "runtime.", path)),
        allocator_overhead=float(_number(runtime, "allocator_overhead", "runtime.", path)),
        flash_attention=flash,
        transformers_code_bytes=_optional_int(runtime, "transformers_code_bytes", path),
        peft_code_bytes=_optional_int(runtime, "peft_code_bytes", path),
        match=tuple(match),
        interconnect=interconnect,
        calibrated=_calibrated(data, path),
        sources=sources,
        path=path,
    )


def _optional_int(runtime: dict, key: str, path: str) -> int | None:
    """An optional non-negative byte count of ``[runtime]`` (None where the profile has none)."""
    return int(_number(runtime, key, "runtime.", path)) if key in runtime else None


_CALIBRATED_NUMBERS = ("threads", "seconds", "noise", "launch_overhead_seconds", "copy_bytes_per_second",
                       "first_touch_bytes_per_second", "first_touch_threshold_bytes", "cpu_share", "thread_slowdown")
_CALIBRATED_ROWS = {"matmul": 5, "elementwise": 2, "attention": 4, "modules": 3}  # table -> numbers per row


def _calibrated(data: dict, path: str) -> dict:
    """The ``[calibrated]`` table, checked: non-negative numbers, positive rates, rows of the documented width."""
    cal = _table(data, "calibrated", path, required=False)
    for key in _CALIBRATED_NUMBERS:
        if key in cal:
            _number(cal, key, "calibrated.", path, minimum=1 if key == "threads" else 0)
    for name in ("matmul_tflops", "transcendental", "optimizer", *_CALIBRATED_ROWS):
        table = cal.get(name, {})
        if not isinstance(table, dict):
            raise InputError(f"profile {path}: calibrated.{name} must be a table")
        for key, value in table.items():
            width = _CALIBRATED_ROWS.get(name, 2 if name == "optimizer" else 0)
            values = [value] if not width else value
            if width and name != "optimizer":
                if not isinstance(value, list) or not value:
                    raise InputError(f"profile {path}: calibrated.{name}.{key} must be a list of rows")
                values = [x for row in value for x in (row if isinstance(row, list) and len(row) == width
                                                       else [None])]
            elif name == "optimizer" and (not isinstance(value, list) or len(value) != 2):
                values = [None]
            for x in values:
                if not _finite(x, 0, strict=name != "optimizer"):
                    what = f"rows of {width} positive finite numbers" if width else "a positive finite number"
                    raise InputError(f"profile {path}: calibrated.{name}.{key} = {value!r:.60}; expected {what}")
    return cal


PROFILE_MAX_BYTES = 4 << 20  # a profile, calibrated tables included, is tens of KiB; read no further


def load_profile_file(path: str | Path | Traversable) -> Device:
    """A profile from a file on disk or a bundled resource: UTF-8 TOML of at most PROFILE_MAX_BYTES; a file
    that is not one (a directory, unreadable, binary, too large, not TOML) is one InputError line."""
    if isinstance(path, str):
        path = Path(path)
    what = f"--device: {str(path)!r}"
    try:
        with path.open("rb") as f:
            raw = f.read(PROFILE_MAX_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"--device: no such profile file {str(path)!r}") from None
    except IsADirectoryError:
        raise InputError(f"{what} is a directory; give a profile TOML file or a name from `memplan profiles`") \
            from None
    except OSError as e:
        raise InputError(f"{what} cannot be read ({e.strerror or e}); give a readable profile TOML") from None
    if len(raw) > PROFILE_MAX_BYTES:
        raise InputError(f"{what} is over {PROFILE_MAX_BYTES >> 20} MiB; accepted: a profile TOML (tens of KiB)")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not UTF-8 text (byte {e.start}); accepted: a profile TOML") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{what} is not valid TOML ({e})") from None
    if not data:
        raise InputError(f"{what} is empty; accepted: a profile TOML with name, family, [memory], [peak_tflops], "
                         "[achievable] and [runtime] (see `memplan profiles`)")
    return device_from_toml(data, str(path))


def load_profile(name_or_path: str) -> Device:
    """``--device NAME|PATH``: a bundled profile by name, or any TOML of the same schema."""
    text = name_or_path.strip()
    if text.endswith(".toml") or "/" in text or Path(text).exists():  # a file, or a directory given by mistake
        return load_profile_file(text)
    names = profile_names()
    if text.lower() not in names:
        raise choice_error("--device", text, names)
    device = load_profile_file(_profiles_dir() / f"{text.lower()}.toml")
    return _with_local_memory(device) if device.family == "cpu" else device


def all_profiles() -> list[Device]:
    return [load_profile(n) for n in profile_names()]


# ---- the local device ----------------------------------------------------------------------

def _with_local_memory(device: Device) -> Device:
    """The host's RAM for a CPU profile: total from psutil, usable = what is available now."""
    import psutil

    vm = psutil.virtual_memory()
    return device.replace(memory_bytes=int(vm.total), usable_bytes=int(vm.available))


def _nvidia_names() -> list[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _rocm_names() -> list[str]:
    if not Path("/dev/kfd").exists():
        return []
    try:
        from pyrsmi import rocml

        rocml.smi_initialize()
        try:
            return [str(rocml.smi_get_device_name(i)) for i in range(rocml.smi_get_device_count())]
        finally:
            rocml.smi_shutdown()
    except Exception:
        return []


def _apple_chip() -> str:
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return ""
    import subprocess

    try:
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=2).stdout.strip()
    except Exception:
        return "Apple"


def _name_matches(needle: str, reported_name: str) -> bool:
    """``needle`` occurs in the name as whole words: "NVIDIA L4" matches "NVIDIA L4" but not "NVIDIA L40S"."""
    return re.search(rf"(?<![a-z0-9]){re.escape(needle.lower())}(?![a-z0-9])", reported_name.lower()) is not None


def match_profile(reported_name: str, family: str) -> Device | None:
    """The bundled profile whose ``match`` strings occur in a driver-reported name (longest match wins)."""
    best = None
    for device in all_profiles():
        if device.family != family:
            continue
        for needle in device.match:
            if _name_matches(needle, reported_name) and (best is None or len(needle) > best[0]):
                best = (len(needle), device)
    return best[1] if best else None


def detect_local() -> Device:
    """The device this process would train on: the first NVIDIA or AMD GPU, an Apple GPU, else the CPU.

    An accelerator without a bundled profile raises an InputError that says to run
    ``memplan calibrate`` (which writes one) or to pass ``--device``.
    """
    for family, names in (("cuda", _nvidia_names()), ("rocm", _rocm_names())):
        if names:
            device = match_profile(names[0], family)
            if device is None:
                raise InputError(f"the local GPU {names[0]!r} has no bundled profile; run `memplan calibrate --out "
                                 "my-gpu.toml` and pass --device my-gpu.toml, or name one with --device")
            return device
    chip = _apple_chip()
    if chip:
        device = match_profile(chip, "mps")
        if device is None:
            raise InputError(f"the local Apple chip {chip!r} has no bundled profile; run `memplan calibrate` or "
                             "pass --device m3-max or m4-max")
        import psutil

        return device.with_memory(int(psutil.virtual_memory().total))
    return load_profile("cpu")


def resolve_device(name_or_path: str | None, memory: int | None = None) -> Device:
    """The DEVICE option group: ``--device`` (default: the local device) and ``--device-memory``."""
    device = load_profile(name_or_path) if name_or_path else detect_local()
    return device.with_memory(memory) if memory else device


def device_from_flags(device: str | None = None, device_memory: str | None = None) -> Device:
    """``resolve_device`` of the DEVICE flags as typed (``--device-memory`` a size such as ``16GiB``)."""
    from memplan.units import parse_size

    return resolve_device(device, parse_size(device_memory, "--device-memory") if device_memory else None)

