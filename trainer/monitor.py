"""Measured memory of the training process, step by step, the way each platform allows.

Like torchtitan's ``DeviceMemoryMonitor``: reset the peak before a step, read it after. What is
read, and how it compares with memplan's prediction:

- CUDA / ROCm: ``torch.cuda.max_memory_allocated`` (compare with ``peak_allocated``) and
  ``max_memory_reserved``; with NVML (nvidia-ml-py) or ROCm SMI (pyrsmi), the driver's figure for
  the device, from which the runtime context (driver minus reserved) is added to the reserved
  peak to give the figure to compare with ``peak_reserved``. Also the allocator's retry and OOM
  counts.
- Apple (MPS): ``torch.mps.current_allocated_memory`` / ``driver_allocated_memory`` after the step
  (there is no peak counter).
- CPU: the process's peak resident memory (Linux ``VmHWM``, reset each step through
  ``/proc/self/clear_refs``; elsewhere the current RSS from psutil), compared with ``peak_reserved``,
  which includes the process's runtime context. The token shards are memory-mapped, and every
  page of them the data loader has touched counts as resident; so on Linux the growth of the
  file-backed resident memory since the monitor started (``RssFile``) is subtracted, or a corpus
  read once would look like a leak as large as the corpus.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryReading:
    """One step's measured memory, in bytes (None where the platform cannot tell)."""

    peak_bytes: int | None  # compare with the predicted peak_reserved
    allocated_bytes: int | None = None  # live tensors at the peak (compare with peak_allocated)
    reserved_bytes: int | None = None  # the caching allocator's peak reserve
    driver_bytes: int | None = None  # what NVML / ROCm SMI report in use on the device now
    alloc_retries: int | None = None
    ooms: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class MemoryMonitor:
    """``reset()`` before a step, ``read()`` after it. ``source`` names what is read."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.kind = self.device.type
        self._nvml = None
        self._rocm = False
        self._proc = None
        self._clear_refs = False
        self._file_baseline = None
        if self.kind == "cuda":
            self.source = "torch.cuda.max_memory_allocated/reserved"
            self._open_driver()
        elif self.kind == "mps":
            self.source = "torch.mps allocated/driver memory"
        else:
            import psutil

            self._proc = psutil.Process()
            self._clear_refs = _can_reset_hwm()
            self._file_baseline = _status_bytes("RssFile")
            self.source = ("peak resident memory (VmHWM, reset per step, less the token shards' mapped pages)"
                           if self._clear_refs else "resident memory (psutil)")

    def _open_driver(self) -> None:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if torch.version.hip:
            try:
                from pyrsmi import rocml

                rocml.smi_initialize()
                self._rocm = True
                self._rocm_index = index
                self.source += " + ROCm SMI"
            except Exception:
                self._rocm = False
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.source += " + NVML"
        except Exception:
            self._nvml = None

    def _driver_used(self) -> int | None:
        try:
            if self._nvml is not None:
                import pynvml

                return int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used)
            if self._rocm:
                from pyrsmi import rocml

                used = rocml.smi_get_device_memory_used(self._rocm_index)
                return int(used) if used is not None and used >= 0 else None
        except Exception:
            return None
        return None

    def reset(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._clear_refs:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._clear_refs = False

    def read(self) -> MemoryReading:
        if self.kind == "cuda":
            allocated = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            driver = self._driver_used()
            context = max(0, driver - int(torch.cuda.memory_reserved(self.device))) if driver is not None else 0
            stats = torch.cuda.memory_stats(self.device)
            return MemoryReading(peak_bytes=reserved + context, allocated_bytes=allocated, reserved_bytes=reserved,
                                 driver_bytes=driver, alloc_retries=int(stats.get("num_alloc_retries", 0)),
                                 ooms=int(stats.get("num_ooms", 0)))
        if self.kind == "mps":
            allocated = int(torch.mps.current_allocated_memory())
            return MemoryReading(peak_bytes=int(torch.mps.driver_allocated_memory()), allocated_bytes=allocated)
        if self._clear_refs:
            hwm, file_now = _status_bytes("VmHWM"), _status_bytes("RssFile")
            if hwm is not None:
                mapped = max(0, file_now - self._file_baseline) if None not in (file_now, self._file_baseline) else 0
                return MemoryReading(peak_bytes=hwm - mapped)
        return MemoryReading(peak_bytes=int(self._proc.memory_info().rss))

    def close(self) -> None:
        try:
            if self._nvml is not None:
                import pynvml

                pynvml.nvmlShutdown()
            if self._rocm:
                from pyrsmi import rocml

                rocml.smi_shutdown()
        except Exception:
            pass
        self._nvml, self._rocm = None, False


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _can_reset_hwm() -> bool:
    """Linux lets a process reset its own peak RSS by writing 5 to /proc/self/clear_refs."""
    return os.path.exists("/proc/self/clear_refs") and os.access("/proc/self/clear_refs", os.W_OK) \
        and _status_bytes("VmHWM") is not None
