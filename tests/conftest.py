import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The tests by kind: tests/unit (the planner and the trainer's units), tests/walk (the memory walk: the golden
# figures, the walk against traces, the stacks), tests/runs (training, slow, distributed, browser, install). The
# fast tier is the folders `python -m pytest tests/unit tests/walk`, and a test marked slow belongs in tests/runs
# (pytest_collection_modifyitems refuses one elsewhere). This directory holds the helpers all three share
# (runs_helper.py, this conftest); the folders' test modules also import each other's helpers by module name
# (test_hf_import's checkpoints, test_families' shapes), whichever folders pytest is given.
KINDS = ("unit", "walk", "runs")
sys.path[:0] = [str(ROOT / "tests"), *(str(ROOT / "tests" / kind) for kind in KINDS)]


def pytest_collection_modifyitems(config, items):
    """A test marked slow outside tests/runs would sit in the fast tier, and a test outside the three folders
    in no tier: each refused, naming them."""
    runs = ROOT / "tests" / "runs"
    misplaced = [item.nodeid for item in items
                 if item.get_closest_marker("slow") and runs not in Path(item.path).resolve().parents]
    if misplaced:
        raise pytest.UsageError("tests marked slow outside tests/runs/ (the fast tier is tests/unit and "
                                "tests/walk): " + ", ".join(misplaced))
    loose = sorted({item.nodeid.split("::")[0] for item in items
                    if Path(item.path).resolve().parent.name not in KINDS})
    if loose:
        raise pytest.UsageError(f"test files outside tests/{{{','.join(KINDS)}}}/ (the tests sit by kind): "
                                + ", ".join(loose))


def run_memplan(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`memplan ARGS` as a separate process (as a user runs it), from this checkout."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", "memplan", *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=ROOT)


@pytest.fixture
def memplan_cli():
    return run_memplan


def _in_session_dir(tmp_path_factory, variable: str, name: str):
    """``variable`` set to a fresh directory of this test session while it runs, as it was afterwards."""
    saved = os.environ.get(variable)
    os.environ[variable] = str(tmp_path_factory.mktemp(name))
    yield
    if saved is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = saved


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """memplan's cache (the embedded corpus, the local calibration) lives in a directory of this test
    session, never in the user's ~/.cache."""
    yield from _in_session_dir(tmp_path_factory, "MEMPLAN_CACHE", "memplan-cache")


@pytest.fixture(autouse=True, scope="session")
def _private_inductor_cache(tmp_path_factory):
    """torch.compile's cache (inductor's compiled kernels) in a directory of this test session: the
    default, /tmp/torchinductor_USER, is shared with every other process of the machine, and a
    kernel another process left half-written there fails every later compile that loads it
    ("file too short")."""
    yield from _in_session_dir(tmp_path_factory, "TORCHINDUCTOR_CACHE_DIR", "inductor-cache")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    small models run faster and their results do not depend on the thread count."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@contextlib.contextmanager
def tmpfs(mount: Path, size: int | str = "2m"):
    """A fresh tmpfs of ``size`` mounted at ``mount`` (created if missing; ``mount -t tmpfs``, which CI can do
    as root) for the block, unmounted afterwards; the test is skipped where mounting is not permitted."""
    mount.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@contextlib.contextmanager
def read_only_directory(directory: Path, files: dict[str, str] | None = None):
    """``directory`` holding ``files`` (name: text), then not writable by this process for the block: mode
    0555 for a user, a tmpfs remounted read-only for root (who writes through file modes)."""
    if os.geteuid() != 0:
        directory.mkdir(exist_ok=True)
        for name, text in (files or {}).items():
            (directory / name).write_text(text)
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(0o755)
        return
    with tmpfs(directory, "1m"):
        for name, text in (files or {}).items():
            (directory / name).write_text(text)
        done = subprocess.run(["mount", "-o", "remount,ro", str(directory)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {done.stderr.decode(errors='replace').strip()}")
        yield directory


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a fresh 2 MiB tmpfs, for "disk full" cases (``tmpfs``)."""
    with tmpfs(tmp_path / "small-disk") as mount:
        yield mount


@pytest.fixture
def read_only_dir(tmp_path):
    """An existing, empty directory this process cannot write into (``read_only_directory``)."""
    with read_only_directory(tmp_path / "read-only") as directory:
        yield directory


def fill_disk(mount: Path, leave: int = 0) -> None:
    """Fill ``mount`` up to ``leave`` bytes free, with one file named ``filler``."""
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))
