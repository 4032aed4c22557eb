"""This machine's calibration as memplan's commands use it: where it is cached, when it applies, what it changes.

``memplan train`` (the quick start) calibrates the local device once and caches the result under the
cache directory (``$MEMPLAN_CACHE``, else ``$XDG_CACHE_HOME/memplan``, else ``~/.cache/memplan``)::

    calibrated/<family>-<device>-<N>t-torch<version>.toml   # a profile TOML measured with N torch threads
    calibrated/<family>-<device>-torch<version>.threads.toml # the thread count calibration measured fastest
    calibrated/<family>-<device>-<N>t-torch<version>.noisy.toml  # one whose timings spread too much to trust

A calibration whose repeated timings spread by more than NOISY was taken while other processes
competed for the machine: it is never used for this machine's rates. What it measured of memory
(the runtime context) does not depend on timing, so that part is used until a steady one exists.

Every command that plans for *this machine* then uses those rates and that runtime context instead of
the bundled profile's nominal figures: ``estimate``, ``autotune`` and ``sweep`` as much as ``train``.
"This machine" is the local device (no ``--device``), or ``--device NAME`` naming the bundled profile
that detection picks here (``--device cpu`` on a host without a GPU). Another named profile, or a
profile file, keeps its own figures: that is how one plans for a device one does not have.

What the calibration replaces in the profile: the ``[calibrated]`` rates and the runtime context
(``runtime_context_bytes``: the resident memory of a process with torch and memplan's trainer loaded
and warmed up, before any model exists; ``trainer/calibrate.py`` measures it), and on a CPU what
transformers' model code and peft's keep resident on top of it (``[runtime] transformers_code_bytes``,
``peft_code_bytes``: ``memplan.memory.terms.model_code_resident_bytes``; a calibration written before they
were measured lacks them and loads as before, the plan taking the terms' measured defaults). The allocator
overhead stays the profile's.

Nothing here imports torch: torch's version comes from the installed distribution's metadata and the
device's name from the OS, NVML or ROCm SMI (as ``memplan.hardware`` detects the device).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from memplan.compat import tomllib
from memplan.errors import InputError
from memplan.hardware import Device

NOISY = 0.15  # a median spread (IQR / median) of repeated timings above this: the machine was busy; not trusted


def cache_dir() -> Path:
    """$MEMPLAN_CACHE, else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan."""
    if os.environ.get("MEMPLAN_CACHE"):
        return Path(os.environ["MEMPLAN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "memplan"


CACHE_HOW = "set MEMPLAN_CACHE to a directory you can write (created if missing)"


def cache_problem() -> str | None:
    """Why memplan cannot write its cache directory, in a few words naming it (None when it can): the path
    is a file, lies under a file, or it (or the nearest directory above it, where it is still to be
    made) is not writable, as on a read-only filesystem."""
    path = cache_dir()
    where = f"the cache directory {str(path)!r}"
    if path.exists() and not path.is_dir():
        return f"{where} is a file, not a directory"
    probe = path
    while not probe.exists() and probe != probe.parent:  # the nearest part that exists decides
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{where} lies under the file {str(probe)!r}"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{where} is not writable" + ("" if probe == path else f" (nor is {str(probe)!r}, where it would be made)")
    return None


def require_cache(why: str) -> Path:
    """The cache directory, for a command that must write there (the quick start's corpus and calibration);
    an unwritable one is one InputError line naming the path and how to choose another."""
    problem = cache_problem()
    if problem:
        raise InputError(f"{problem}; {why}: {CACHE_HOW}")
    return cache_dir()


def slug(text: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(p for p in out.split("-") if p)[:48] or "device"


def torch_version() -> str:
    """The installed torch's version (e.g. ``2.13.0+cpu``), from its distribution's metadata: no import."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def cpu_title() -> str:
    """The CPU's model name as /proc/cpuinfo (else the platform) reports it: what calibration records."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def local_title(family: str) -> str:
    """The local device's name as calibration records it (torch reports the same names as the drivers)."""
    from memplan import hardware

    if family == "cuda":
        names = hardware._nvidia_names()
    elif family == "rocm":
        names = hardware._rocm_names()
    elif family == "mps":
        names = [hardware._apple_chip() or "Apple GPU"]
    else:
        names = [cpu_title()]
    return names[0] if names else family


def calibration_path(family: str, title: str, threads: int, version: str) -> Path:
    """The cached calibration of a device measured with ``threads`` torch threads under torch ``version``."""
    return cache_dir() / "calibrated" / f"{family}-{slug(title)}-{threads}t-torch{slug(version)}.toml"


def noisy_path(path: Path) -> Path:
    """Where a calibration too noisy to trust for rates is kept (for its runtime context only)."""
    return path.with_name(path.name[:-len(".toml")] + ".noisy.toml")


def threads_path(family: str, title: str, version: str) -> Path:
    """The cached choice of thread count for a device under torch ``version``."""
    return cache_dir() / "calibrated" / f"{family}-{slug(title)}-torch{slug(version)}.threads.toml"


@dataclass(frozen=True)
class LocalCalibration:
    """A cached calibration of this machine."""

    path: Path
    calibrated: dict  # the profile's [calibrated] table
    runtime_context_bytes: int  # the profile's [runtime] context_bytes: what a process here holds
    # [runtime] transformers_code_bytes / peft_code_bytes: what transformers' model code and peft's keep resident
    # in a training process here (``trainer.calibrate.model_code_bytes``, CPU). None in a calibration from
    # before they were measured: the plan then takes memplan.memory.terms' default (measured on the build
    # machine), until the next calibration measures them
    transformers_code_bytes: int | None = None
    peft_code_bytes: int | None = None

    @property
    def memory(self) -> dict:
        """What it measured of memory, as ``Device`` fields (timing does not change them)."""
        return {"runtime_context_bytes": self.runtime_context_bytes,
                "transformers_code_bytes": self.transformers_code_bytes, "peft_code_bytes": self.peft_code_bytes}

    @property
    def threads(self) -> int:
        return int(self.calibrated.get("threads", 0))

    @property
    def noise(self) -> float:
        return float(self.calibrated.get("noise", 0.0))

    @property
    def trusted(self) -> bool:
        return self.noise <= NOISY

    def applied(self, profile: Device) -> Device:
        """``profile`` with this machine's measured rates and runtime memory."""
        return profile.replace(calibrated=self.calibrated, **self.memory)

    def note(self) -> str:
        """One line: where the rates come from."""
        when = str(self.calibrated.get("date", ""))[:10] or "an unknown date"
        n = self.threads
        share = self.calibrated.get("cpu_share")
        slowdown = float(self.calibrated.get("thread_slowdown", 0.0) or 0.0)
        spread = (f"its step {slowdown:.0%} slower after it measured" if slowdown and slowdown >= self.noise
                  else f"spread {self.noise:.0%}")  # the noise is the larger of the two (trainer.calibrate)
        return (f"rates: this machine's calibration of {when}, {n} thread{'s' if n != 1 else ''}, {spread}"
                + (f", {share:.0%} of a core free" if share and share < 0.95 else ""))


SHARE_PROBE_SECONDS = 0.2  # one probe of the share of a core this process gets now (train, before its steps)
SHARE_PROBES = 5  # probes in a row: their median is the share, their range tells whether the load holds still
SHARE_UNSTEADY = 0.25  # probes whose range exceeds this share of their median: the load comes and goes
# a share below this: others hold most of the core, and the few points it moves between the probes and the run
# are a large part of it (0.16 probed, 0.21 got: a third off); wall time is not predicted from it
SHARE_FLOOR = 0.5


def core_share_now(seconds: float = SHARE_PROBE_SECONDS) -> float:
    """The share of one core this process gets now: CPU time / wall time of ``seconds`` of busy Python.

    A one-thread calibration timed by CPU time records its share (``cpu_share``) while it ran, and
    ``memplan.timing.contention_seconds`` adds busy × (1/share − 1) to each step. On a shared machine
    the share when a run starts can be far from the calibration's (other work came or went), so
    ``train`` measures it again, here, just before it predicts."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        pass
    wall = time.perf_counter() - wall0
    return min(1.0, max(0.01, (time.process_time() - cpu0) / wall))


def core_share_probes(repeats: int = SHARE_PROBES, seconds: float = SHARE_PROBE_SECONDS) -> list[float]:
    """``repeats`` probes of ``core_share_now`` in a row (one second in all by default)."""
    return [core_share_now(seconds) for _ in range(repeats)]


def with_share_probes(profile: Device, shares: list[float]) -> tuple[Device, str]:
    """``profile`` (a one-thread CPU calibration timed by CPU time) for the run about to start, from
    ``shares``, probes of the share of a core measured now; and the words for the rates line.

    Probes that agree (range within SHARE_UNSTEADY of their median) on a share of at least SHARE_FLOOR, with
    a calibration steady enough to keep: their median is the share, and step times are wall time with the
    waits for other processes in (``with_share_now``). Otherwise the load moves more than a prediction of
    wall time can follow (a 0.5 s probe read 62% on a machine where the run then got nearly all of a core,
    predicting half its speed; on a machine loaded 6 times over, 16% probed and 21% got, a third off): no
    share is applied, the prediction is the step's CPU time, an idle core's (``predicts`` cpu), and the run
    compares it with each step's measured CPU time, a figure the load does not move."""
    import statistics

    median = statistics.median(shares)
    low, high = min(shares), max(shares)
    noise = float(profile.calibrated.get("noise", 0.0) or 0.0)
    why = []
    if high - low > SHARE_UNSTEADY * median:
        why.append(f"{low:.0%}-{high:.0%} over {len(shares)} probes")
    elif median < SHARE_FLOOR:
        why.append(f"others hold {1 - median:.0%} of it")
    if noise > NOISY:
        why.append(f"the calibration's timings spread {noise:.0%}")
    if not why:
        return with_share_now(profile, median)
    calibrated = {k: v for k, v in profile.calibrated.items() if k != "cpu_share"}
    calibrated["predicts"] = "cpu"
    return profile.replace(calibrated=calibrated), (
        f"now {median:.0%} of a core free ({'; '.join(why)}), too unsteady to predict wall time: times predicted "
        "are CPU time (an idle core's), compared with the steps' own CPU time")


def with_share_now(profile: Device, share: float) -> tuple[Device, str]:
    """``profile`` (a one-thread CPU calibration timed by CPU time) with ``share``, the share of a core
    measured now, as its ``cpu_share``; and the words for the rates line."""
    calibrated = {**profile.calibrated, "cpu_share": share}
    return profile.replace(calibrated=calibrated), f"now {share:.0%} of a core free"


def read_calibration(path: Path) -> LocalCalibration | None:
    """The calibration cached at ``path``; None when there is none or it does not load as a profile."""
    from memplan.hardware import device_from_toml

    if not path.is_file():
        return None
    try:
        device = device_from_toml(tomllib.loads(path.read_text()), str(path))
    except (InputError, tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
        return None
    if not device.calibrated:
        return None
    return LocalCalibration(path=path, calibrated=device.calibrated, runtime_context_bytes=device.runtime_context_bytes,
                            transformers_code_bytes=device.transformers_code_bytes,
                            peft_code_bytes=device.peft_code_bytes)


def chosen_threads(family: str, title: str | None = None, version: str | None = None) -> int | None:
    """The thread count calibration measured fastest on this machine (None before any calibration)."""
    title = local_title(family) if title is None else title
    version = torch_version() if version is None else version
    path = threads_path(family, title, version)
    try:
        data = tomllib.loads(path.read_text())
        n = int(data["threads"])
        return n if n >= 1 else None
    except (OSError, KeyError, ValueError, TypeError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None


def find_calibration(family: str, threads: int | None = None, title: str | None = None,
                     version: str | None = None) -> LocalCalibration | None:
    """This machine's trusted cached calibration with ``threads`` torch threads (default: the count
    calibration chose; without a recorded choice, the only calibration cached, if there is one)."""
    title = local_title(family) if title is None else title
    version = torch_version() if version is None else version
    if threads is None:
        threads = chosen_threads(family, title, version)
    if threads is None:
        found = sorted(calibration_path(family, title, 0, version).parent.glob(
            f"{family}-{slug(title)}-*t-torch{slug(version)}.toml")) if cache_dir().is_dir() else []
        if len(found) != 1:
            return None
        cal = read_calibration(found[0])
    else:
        cal = read_calibration(calibration_path(family, title, threads, version))
    return cal if cal is not None and cal.trusted else None


def find_noisy_calibration(family: str, threads: int | None = None, title: str | None = None,
                           version: str | None = None) -> LocalCalibration | None:
    """The newest calibration of this machine kept as too noisy for rates (with ``threads``, if given)."""
    title = local_title(family) if title is None else title
    version = torch_version() if version is None else version
    folder = cache_dir() / "calibrated"
    if not folder.is_dir():
        return None
    pattern = f"{family}-{slug(title)}-{threads if threads else '*'}t-torch{slug(version)}.noisy.toml"
    for path in sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True):
        cal = read_calibration(path)
        if cal is not None:
            return cal
    return None


def context_only(profile: Device, noisy: LocalCalibration) -> tuple[Device, str]:
    """``profile`` with the runtime context a noisy calibration measured (memory does not depend on timing),
    its rates left nominal, and the one line that says so."""
    when = str(noisy.calibrated.get("date", ""))[:10]
    return (profile.replace(**noisy.memory),
            f"rates: profile peak × achievable fraction, nominal (this machine's calibration of {when} spread "
            f"{noisy.noise:.0%}, too noisy for rates; its measured runtime memory is used)")


def is_this_machine(device_arg: str | None, local: Device | None) -> bool:
    """Whether ``--device`` (None: the default) means the device this process runs on."""
    if device_arg is None:
        return True
    text = device_arg.strip().lower()
    if local is None or text.endswith(".toml") or "/" in text or Path(text).is_file():
        return False
    return text == local.name


def means_this_machine(device_arg: str | None) -> bool:
    """``is_this_machine`` with the local device detected (only when ``--device`` names a profile)."""
    if device_arg is None:
        return True
    from memplan.hardware import detect_local

    try:
        return is_this_machine(device_arg, detect_local())
    except InputError:
        return False


def local_profile(device_arg: str | None, device_memory: int | None = None,
                  threads: int | None = None) -> tuple[Device, str | None]:
    """The DEVICE option group with this machine's cached calibration applied where it is this machine.

    Returns the device and one line saying where its rates come from (None for a named profile of
    another device or a profile file: its figures are its own)."""
    from memplan.hardware import detect_local, resolve_device

    device = resolve_device(device_arg, device_memory)
    if device.calibrated:  # a calibrated profile file, or a bundled profile with measured rates
        return device, None
    try:
        local = device if device_arg is None else detect_local()
    except InputError:
        local = None
    if not is_this_machine(device_arg, local):
        return device, None
    cal = find_calibration(device.family, threads)
    if cal is None:
        noisy = find_noisy_calibration(device.family, threads)
        if noisy is not None:
            return context_only(device, noisy)
        problem = cache_problem()
        return device, ("rates: profile peak × achievable fraction, nominal (this machine is not calibrated"
                        + (f" with {threads} threads" if threads else "")
                        + (f" yet, and {problem}, so no calibration can be kept: {CACHE_HOW})" if problem else
                           " yet: `memplan train` measures it once)"))
    return cal.applied(device), cal.note()
