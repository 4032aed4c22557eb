"""The local device and what its memory holds, each read in one place.

Everything in ``trainer/`` that asks which device it runs on, or how much memory something holds,
asks this module: the family (cuda | rocm | mps | cpu), the torch device, and the readers below.
It is a leaf: it imports nothing of the trainer, and it imports torch only inside the functions
that need it, so a process that never trains (the CLI's parent of ``autotune --verify``) can read
the host's memory without starting torch.

The readers, one function each (tests replace these functions to stand in for a GPU):

- **torch's caching allocator** (CUDA and ROCm): ``allocator_memory`` reads
  ``max_memory_allocated`` / ``max_memory_reserved`` since ``reset_allocator_peaks``, the reserve
  now, and the allocator's retry and OOM counts; ``outside_allocator_bytes`` what the device holds
  beyond torch's reserve (``mem_get_info``: the CUDA/HIP context and libraries, and other processes').
- **the driver**: ``driver_memory`` reads NVML (nvidia-ml-py's ``pynvml``) on NVIDIA and ROCm SMI
  (pyrsmi) on AMD: the device's total and used memory, of the pool torch allocates from (an APU such
  as Strix Halo allocates from GTT, a discrete card from VRAM). ``driver_process_bytes`` is NVML's
  figure for one process.
- **Apple**: ``mps_memory`` reads ``current_allocated_memory`` (live tensors) and
  ``driver_allocated_memory`` (what Metal holds for the process); there is no peak counter.
- **the host**: ``current_rss``, ``peak_rss`` (``VmHWM`` on Linux, ``ru_maxrss`` on macOS,
  ``peak_wset`` on Windows), ``reset_peak_rss`` (Linux: write 5 to ``/proc/self/clear_refs``),
  ``status_bytes`` (a field of ``/proc/self/status``), ``host_memory`` (psutil) and ``trim_heap``.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

FAMILIES = ("cuda", "rocm", "mps", "cpu")
APU_GTT_RATIO = 4  # GTT this many times VRAM: an APU whose VRAM is only a BIOS carve-out (Strix Halo)


# ---- which device ------------------------------------------------------------------------

def local_family() -> str:
    """cuda | rocm | mps | cpu: the device torch trains on here (a CUDA/ROCm GPU first, then Apple's)."""
    import torch

    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def torch_device(family: str | None = None, index: int | None = None):
    """The torch device of a family (default: this machine's): ``cuda`` (or ``cuda:index``) on CUDA and
    ROCm (ROCm's torch calls its GPUs cuda), ``mps``, ``cpu``."""
    import torch

    family = family or local_family()
    if family not in FAMILIES:
        raise ValueError(f"device family {family!r} is not one of {FAMILIES}")
    if family in ("cuda", "rocm"):
        return torch.device("cuda") if index is None else torch.device("cuda", index)
    return torch.device(family)


def torch_device_for(profile=None):
    """Where to train: the first CUDA/ROCm GPU, else Apple's GPU, else the CPU (``profile`` is not consulted)."""
    return torch_device(index=0 if local_family() in ("cuda", "rocm") else None)


def gpu_index(device) -> int:
    """The index of a CUDA/ROCm device (``cuda`` alone: the current one), for the driver's readers."""
    import torch

    device = torch.device(device)
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available() else 0


def fake_device(family: str) -> str:
    """The device a FakeTensor trace claims for ``family``: cuda on CUDA and ROCm (every allocation rounded to
    the caching allocator's 512-byte blocks, as max_memory_allocated counts), else cpu (exact bytes; a torch
    without CUDA cannot make fake CUDA tensors, and Apple's allocator keeps no such counter)."""
    return "cuda" if family in ("cuda", "rocm") else "cpu"


def synchronizer(device) -> Callable[[], None]:
    """A function that waits for the device's queued work (nothing to wait for on a CPU)."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.synchronize
    if kind == "mps":
        return torch.mps.synchronize
    return lambda: None


def device_title(family: str) -> str:
    """The device's name as the driver (torch) or the OS reports it."""
    import platform

    if family in ("cuda", "rocm"):
        import torch

        return torch.cuda.get_device_name(0)
    if family == "mps":
        import subprocess

        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=2).stdout.strip() or "Apple GPU"
        except Exception:
            return "Apple GPU"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name


# ---- torch's caching allocator (CUDA, ROCm) ------------------------------------------------

@dataclass(frozen=True)
class AllocatorMemory:
    """What torch's caching allocator reports for one device, in bytes."""

    peak_allocated: int  # max_memory_allocated since the last reset: the live tensor peak
    peak_reserved: int  # max_memory_reserved since the last reset: the allocator's peak reserve
    reserved: int  # memory_reserved now
    alloc_retries: int = 0  # num_alloc_retries: a cudaMalloc failed and the cache was freed to retry
    ooms: int = 0  # num_ooms


def reset_allocator_peaks(device=None) -> None:
    """Start the allocator's peak counters afresh (``torch.cuda.reset_peak_memory_stats``)."""
    import torch

    torch.cuda.reset_peak_memory_stats(device)


def allocator_memory(device=None) -> AllocatorMemory:
    """The allocator's peaks since ``reset_allocator_peaks``, its reserve now, and its retry/OOM counts."""
    import torch

    stats = torch.cuda.memory_stats(device)
    return AllocatorMemory(peak_allocated=int(torch.cuda.max_memory_allocated(device)),
                           peak_reserved=int(torch.cuda.max_memory_reserved(device)),
                           reserved=int(torch.cuda.memory_reserved(device)),
                           alloc_retries=int(stats.get("num_alloc_retries", 0)), ooms=int(stats.get("num_ooms", 0)))


def live_tensor_bytes(device=None) -> int:
    """Bytes of live tensors on the device now (``torch.cuda.memory_allocated``)."""
    import torch

    return int(torch.cuda.memory_allocated(device))


def outside_allocator_bytes(device=None) -> int:
    """What the device holds beyond torch's reserve now: ``mem_get_info``'s used less ``memory_reserved``
    (the CUDA/HIP context and libraries; on a shared GPU, other processes' memory too)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free) - int(torch.cuda.memory_reserved(device)))


def cuda_memory_info(index: int = 0) -> tuple[int, int]:
    """(free, total) of a CUDA/ROCm device as the runtime reports it (``torch.cuda.mem_get_info``)."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def release_cached(device) -> None:
    """Give the allocator's cached blocks back to the driver (CUDA/ROCm; nothing elsewhere)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---- the driver: NVML (NVIDIA), ROCm SMI (AMD) ---------------------------------------------

@dataclass(frozen=True)
class DriverMemory:
    """The device's memory as its driver reports it, in bytes."""

    total: int
    used: int  # by every process, the runtime contexts included
    source: str  # "NVML" | "ROCm SMI (VRAM)" | "ROCm SMI (GTT)"


_opened: dict[str, tuple[int, object]] = {}  # library -> (pid that initialised it, the module)


def _library(name: str):
    """pynvml or pyrsmi's rocml, initialised once per process (a forked child initialises its own), or None."""
    held = _opened.get(name)
    if held is not None and held[0] == os.getpid():
        return held[1]
    try:
        if name == "nvml":
            import pynvml as lib

            lib.nvmlInit()
        else:
            from pyrsmi import rocml as lib

            lib.smi_initialize()
    except Exception:
        return None
    _opened[name] = (os.getpid(), lib)
    return lib


def _nvml_handle(lib, index: int):
    """NVML's handle of torch's device ``index``: by UUID where torch knows it (NVML counts every GPU,
    torch only those CUDA_VISIBLE_DEVICES shows), else by index."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and not torch.version.hip:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            return lib.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        pass
    return lib.nvmlDeviceGetHandleByIndex(index)


def _is_rocm() -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.version.hip)
    return os.path.exists("/dev/kfd")


def driver_memory(index: int = 0) -> DriverMemory | None:
    """Total and used memory of GPU ``index`` as its driver reports it: NVML on NVIDIA, ROCm SMI on AMD
    (the GTT pool on an APU whose GTT is over ``APU_GTT_RATIO`` times its VRAM, else VRAM). None where
    neither library answers (no GPU, no driver, the package missing)."""
    if _is_rocm():
        lib = _library("rocm")
        if lib is None:
            return None
        try:
            pool = "VRAM"
            gtt, vram = lib.smi_get_device_memory_total(index, type="GTT"), \
                lib.smi_get_device_memory_total(index, type="VRAM")
            if gtt and vram and gtt > 0 and vram > 0 and gtt > APU_GTT_RATIO * vram:
                pool = "GTT"
            total = lib.smi_get_device_memory_total(index, type=pool)
            used = lib.smi_get_device_memory_used(index, type=pool)
            if total is None or used is None or total <= 0 or used < 0:
                return None
            return DriverMemory(total=int(total), used=int(used), source=f"ROCm SMI ({pool})")
        except Exception:
            return None
    lib = _library("nvml")
    if lib is None:
        return None
    try:
        info = lib.nvmlDeviceGetMemoryInfo(_nvml_handle(lib, index))
        return DriverMemory(total=int(info.total), used=int(info.used), source="NVML")
    except Exception:
        return None


def driver_process_bytes(pid: int, index: int = 0) -> int | None:
    """Device memory NVML says process ``pid`` holds on GPU ``index`` (its context included); None elsewhere."""
    if _is_rocm():
        return None
    lib = _library("nvml")
    if lib is None:
        return None
    try:
        for proc in lib.nvmlDeviceGetComputeRunningProcesses(_nvml_handle(lib, index)):
            if proc.pid == pid and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


# ---- Apple (MPS) ---------------------------------------------------------------------------

def mps_memory() -> tuple[int, int]:
    """(live tensor bytes, what Metal holds for this process): ``torch.mps.current_allocated_memory`` and
    ``driver_allocated_memory``, now (the MPS allocator keeps no peak)."""
    import torch

    return int(torch.mps.current_allocated_memory()), int(torch.mps.driver_allocated_memory())


def mps_recommended_max() -> int | None:
    """The most Metal recommends one process allocates (``torch.mps.recommended_max_memory``), where torch has it."""
    import torch

    return int(torch.mps.recommended_max_memory()) if hasattr(torch.mps, "recommended_max_memory") else None


# ---- the host ------------------------------------------------------------------------------

def host_memory() -> tuple[int, int]:
    """(total, available) RAM of the host (psutil.virtual_memory)."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def current_rss() -> int:
    """This process's resident memory now (psutil)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmHWM, RssFile, ...) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def can_reset_peak_rss() -> bool:
    """Whether this process can reset its peak RSS: Linux's /proc/self/clear_refs is writable and VmHWM exists."""
    return os.path.exists("/proc/self/clear_refs") and os.access("/proc/self/clear_refs", os.W_OK) \
        and status_bytes("VmHWM") is not None


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-memory high-water mark (VmHWM) to the current RSS: Linux, by writing 5
    to /proc/self/clear_refs. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The process's peak resident memory: VmHWM on Linux, ru_maxrss on macOS, peak_wset on Windows."""
    hwm = status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except ImportError:
        import psutil

        return int(getattr(psutil.Process().memory_info(), "peak_wset", current_rss()))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt(3) parameters (malloc.h)
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: its dynamic threshold's cap
HEAP_TRIM_NEVER = 2**31 - 1  # the largest trim threshold mallopt takes (an int): the heap's top is kept


def keep_heap_resident() -> bool:
    """CPU training: glibc keeps the freed top of its heap instead of giving it back after every step.

    With glibc's defaults, the freed top of the heap is returned to the kernel once it exceeds the trim
    threshold, and the next step faults those pages in again, zeroed. For the quick start's model
    (2 layers, hidden 128, vocab 4096, ctx 256, micro-batch 4, fp32, 2 threads) that was 9,182 minor
    faults and 61 ms per step, against 77 faults and 44-47 ms with the trim threshold out of reach and
    the mmap threshold fixed at its dynamic cap (32 MiB): the 47.6 ms memplan predicts, which counts
    fresh pages only above 32 MiB. Setting either threshold turns glibc's dynamic adjustment off, so
    both are set. The heap's top then stays at the step's peak, which the peak already holds. True when
    glibc took both."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
                    and libc.mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_NEVER))
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator as it is
        return False


def trim_heap() -> None:
    """Collect Python's garbage and give the C heap's free pages back to the OS (glibc's malloc_trim), so
    that the resident size is what is in use, not what an earlier workload left in the arenas."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- what a device holds, for a profile --------------------------------------------------

def device_memory(family: str) -> tuple[int, int, str]:
    """(total, usable, source): what the device holds and what one training process can hold now.
    CUDA: NVML's total (torch's free); ROCm: torch's, or ROCm SMI's GTT pool on an APU; Apple: the host's
    RAM and Metal's recommended maximum; CPU: the host's total and available RAM."""
    if family in ("cuda", "rocm"):
        free, total = cuda_memory_info(0)
        source = "torch.cuda.mem_get_info"
        driver = driver_memory(0)
        if driver is not None and family == "cuda":
            total, source = driver.total, "nvidia-ml-py nvmlDeviceGetMemoryInfo (total), torch.cuda.mem_get_info (free)"
        elif driver is not None and driver.source == "ROCm SMI (GTT)":  # an APU trains from GTT
            total, free = driver.total, driver.total - driver.used
            source = "pyrsmi smi_get_device_memory_total/used(type='GTT')"
        return int(total), int(min(free, total)), source
    total, available = host_memory()
    if family == "mps":
        usable = mps_recommended_max()
        return total, min(usable if usable is not None else available, total), \
            "psutil total; torch.mps.recommended_max_memory usable"
    return total, available, "psutil.virtual_memory (total, available)"
