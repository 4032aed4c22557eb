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

import math
from dataclasses import dataclass
from typing import Callable

import torch

from trainer import device as devices

MEMORY_SAMPLE_SECONDS = 1.0  # one process: a step's memory is measured at most once per this much training time


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
    """``reset()`` before a step, ``read()`` after it. ``source`` names what is read (trainer/device.py reads it)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.kind = self.device.type
        self._clear_refs = False
        self._file_baseline = None
        self._index = 0
        if self.kind == "cuda":
            self._index = devices.gpu_index(self.device)
            self.source = "torch.cuda.max_memory_allocated/reserved"
            driver = devices.driver_memory(self._index)
            self._driver = driver is not None
            if driver is not None:
                self.source += " + " + driver.source.split(" (")[0]  # NVML | ROCm SMI
        elif self.kind == "mps":
            self.source = "torch.mps allocated/driver memory"
        else:
            self._clear_refs = devices.can_reset_peak_rss()
            self._file_baseline = devices.status_bytes("RssFile")
            self.source = ("peak resident memory (VmHWM, reset per step, less the token shards' mapped pages)"
                           if self._clear_refs else "resident memory (psutil)")

    def reset(self) -> None:
        if self.kind == "cuda":
            devices.reset_allocator_peaks(self.device)
        elif self._clear_refs:
            self._clear_refs = devices.reset_peak_rss()

    def read(self) -> MemoryReading:
        if self.kind == "cuda":
            allocator = devices.allocator_memory(self.device)
            driver = devices.driver_memory(self._index) if self._driver else None
            context = max(0, driver.used - allocator.reserved) if driver is not None else 0
            return MemoryReading(peak_bytes=allocator.peak_reserved + context, allocated_bytes=allocator.peak_allocated,
                                 reserved_bytes=allocator.peak_reserved, driver_bytes=driver.used if driver else None,
                                 alloc_retries=allocator.alloc_retries, ooms=allocator.ooms)
        if self.kind == "mps":
            allocated, driver = devices.mps_memory()
            return MemoryReading(peak_bytes=driver, allocated_bytes=allocated)
        if self._clear_refs:
            hwm, file_now = devices.status_bytes("VmHWM"), devices.status_bytes("RssFile")
            if hwm is not None:
                mapped = max(0, file_now - self._file_baseline) if None not in (file_now, self._file_baseline) else 0
                return MemoryReading(peak_bytes=hwm - mapped)
        return MemoryReading(peak_bytes=devices.current_rss())

    def close(self) -> None:
        """Nothing to release: the driver libraries stay initialised for the process (trainer/device.py)."""


class MemorySampler:
    """Which steps' memory is measured (the monitor reset before the step, read after it). Reading it costs
    /proc reads (CPU) or driver queries (GPU) that a step need not pay: one process measures the first two
    steps of an invocation (and of a new micro-batch, ``restart``: the first allocates the optimizer state, the
    second is the steady state the report takes), then a step once ``interval`` seconds of training have passed
    since the last measured one; the steps between carry that reading, with ``step`` naming the step it
    measured. ``every_step`` (several processes) measures every step: each rank's decision must be the same,
    and the largest over the ranks is a collective."""

    def __init__(self, every_step: bool, interval: float = MEMORY_SAMPLE_SECONDS):
        self.every_step, self.interval = every_step, interval
        self.reading: MemoryReading | None = None  # the latest reading ...
        self.step: int | None = None  # ... the step it measured ...
        self._at = -math.inf  # ... and when, on the clock below
        self._clock = 0.0  # seconds of the steps trained in this invocation, the clock the samples run on
        self._reads = 0  # steps measured since the invocation started (or the micro-batch changed)
        self._measuring = False

    def due(self) -> bool:
        """Whether the next step is measured."""
        return self.every_step or self._reads < 2 or self._clock - self._at >= self.interval

    def restart(self) -> None:
        """The micro-batch changed: the next two steps are measured."""
        self._reads = 0

    def before_step(self, monitor: MemoryMonitor) -> None:
        """A step starts: ``monitor``'s peak reset when the step is measured."""
        self._measuring = self.due()
        if self._measuring:
            monitor.reset()

    def after_step(self, step: int, seconds: float, read: Callable[[], MemoryReading]) -> MemoryReading | None:
        """Step ``step`` took ``seconds``: its memory ``read()`` when it was measured; the latest reading."""
        self._clock += seconds
        if self._measuring:
            self.reading, self.step, self._at = read(), step, self._clock
            self._reads += 1
        return self.reading
