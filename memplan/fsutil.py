"""Writing files where other processes (and other users' files) may be: one atomic-write helper and one lock.

Atomic writes. ``write_atomic`` writes a new file under a name nobody can predict (``tempfile.mkstemp``
in the target's directory: created with O_CREAT|O_EXCL, so a planted file or symlink of any name is
never opened, let alone written through), then renames it over the target. The rename replaces the
target's directory entry (a symlink at the target is replaced, not followed), and a reader sees the
old file or the new one, never half of one. Every file memplan writes whole (plans, reports,
calibrations, run records) goes through it; ``temp_dir_beside`` is the same for a directory that is
filled and then renamed into place (a prepared corpus, an export).

Locks. ``hold_lock`` takes an advisory ``fcntl.flock`` on a lock file and writes this process's PID
into it; a second writer is told which PID holds it. The operating system drops a flock when its
holder dies (``kill -9`` included), so a lock file left by a dead process is simply taken over. The
holder unlinks the file before it lets go, and a process that locked a file checks that it is still
the one under that name (else it locked an unlinked file, and tries again). POSIX only: where
``fcntl`` is missing (Windows) no lock is taken.

Pure Python (no torch): the planner and the trainer both use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path, PurePosixPath

from memplan.errors import EnvironmentFailure, InputError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, content: str | bytes, *, encoding: str = "utf-8", fsync: bool = False) -> Path:
    """Write ``content`` to ``path`` atomically: a fresh exclusive temporary file beside it (never a
    predictable name), then one rename over ``path``. On any failure the old file is untouched and
    the temporary one removed. The new file gets the ordinary mode (0666 less the umask); with
    ``fsync`` its bytes and the rename reach the disk before this returns."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    data = content.encode(encoding) if isinstance(content, str) else bytes(content)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; these are ordinary files
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_path(parent)
    return path


def check_target(path: str | Path, flag: str, example: str) -> Path:
    """An output path a command will write (``write_atomic``, or ``temp_dir_beside`` then a rename), checked
    before any work: its directory must exist and be writable (the temporary file or directory goes
    there). Each failure is one InputError line naming ``flag``, the path and what is accepted; an
    existing file at ``path`` is not touched here."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise InputError(f"{flag}: the directory {str(parent)!r} of {str(path)!r} does not exist; create it first "
                         f"or give a path in an existing directory, such as {example}")
    if not parent.is_dir():
        raise InputError(f"{flag}: {str(parent)!r} is a file, not a directory; give a path such as {example}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag}: cannot write in the directory {str(parent)!r} (read-only or not yours); give a "
                         f"path in a writable directory, such as {example}")
    return path


NO_SPACE_ERRNOS = tuple(n for n in (getattr(errno, "ENOSPC", None), getattr(errno, "EDQUOT", None)) if n is not None)


def no_space(exc: BaseException | None) -> OSError | None:
    """The OSError saying the disk (or the user's quota) is full behind ``exc``, looking through its
    ``__cause__`` / ``__context__`` chain, else None. torch.save, for one, reports a failed write as a
    RuntimeError ("unexpected pos ...") raised while the OSError with ENOSPC is being handled, and
    safetensors as its own SafetensorError whose message holds the OS's words ("No space left on
    device (os error 28)"): such a message counts as that OSError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return exc
        for n in NO_SPACE_ERRNOS:
            if os.strerror(n).lower() in str(exc).lower():
                return OSError(n, os.strerror(n))
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(directory: str | Path) -> int:
    """Bytes this process may still write on the disk holding ``directory`` (root may use the reserved blocks)."""
    st = os.statvfs(directory)
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def check_room(path: str | Path, need_bytes: int, flag: str, what: str) -> None:
    """Before any work: ``EnvironmentFailure`` (one line, exit 1) when the disk of ``path``'s directory has less
    than ``need_bytes`` free, ``what`` naming what the command writes there."""
    from memplan.units import format_bytes

    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    free = free_bytes(parent)
    if free < need_bytes:
        raise EnvironmentFailure(f"{flag}: cannot write {str(path)!r}: only {format_bytes(free)} free on its disk, "
                                 f"and {what} takes up to {format_bytes(need_bytes)}; free some space or name a file "
                                 "on another disk")


@contextlib.contextmanager
def full_disk_is_one_line(path: str | Path, flag: str, what: str = ""):
    """Writes of ``path`` within: a full disk (``no_space``, however the writer reported it) becomes one
    ``EnvironmentFailure`` line (exit 1) saying the earlier ``path`` is intact, or that nothing was written
    (the writes within are atomic: a temporary sibling renamed over ``path`` once whole)."""
    path = Path(path)
    existed = path.exists() or path.is_symlink()
    try:
        yield
    except Exception as e:
        if no_space(e) is None:
            raise
        kept = f"the earlier {path} is intact" if existed else "nothing was written"
        raise EnvironmentFailure(f"{flag} {path}: no space left on device{' while writing ' + what if what else ''}; "
                                 f"{kept}; free space, then run it again") from None


def temp_dir_beside(path: str | Path, tag: str) -> Path:
    """A fresh, empty directory ``.NAME.TAG-XXXXXXXX`` beside ``path`` (same filesystem, so renaming it to
    ``path`` is atomic), created exclusively under an unpredictable name, with the ordinary mode (0777 less
    the umask; mkdtemp makes it 0700, which the renamed corpus or export would keep)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    made = Path(tempfile.mkdtemp(prefix=f".{path.name}.{tag}-", dir=str(parent)))
    os.chmod(made, 0o777 & ~_umask())
    return made


def remove_entry(path: str | Path) -> None:
    """Remove ``path`` whatever it is: a real directory with everything in it, a file, or a symbolic link
    (the link itself, never what it points to: ``shutil.rmtree`` refuses a link, and with ``ignore_errors``
    would leave it behind silently). Missing is fine; other failures are ignored, as a cleanup's are."""
    import shutil

    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.unlink()
    except OSError:
        pass


def inside_name(name: object) -> bool:
    """A name a manifest (a checkpoint's meta.json, a corpus's manifest.json) may list: a relative POSIX path
    inside its directory, written plainly (not absolute, no '..', no backslash, no '.' or empty parts)."""
    if not isinstance(name, str) or not name:
        return False
    p = PurePosixPath(name)
    return not p.is_absolute() and ".." not in p.parts and "\\" not in name and p.as_posix() == name


def fsync_path(path: str | Path) -> None:
    """Flush a file, or a directory's entries (a rename into it), to disk; a no-op where directories cannot
    be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_append(path: str | Path, what: str):
    """``path`` opened to append text (created if absent), refusing a symlink (which would send the
    writes to a file somewhere else) or anything but a regular file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError:
        if path.is_symlink():
            raise InputError(f"{what} {path}: is a symbolic link; refusing to write through it (remove it)") from None
        raise
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"{what} {path}: not a regular file; refusing to write to it")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


class Lock:
    """A held lock (``hold_lock``); ``release`` (or leaving a ``with`` block) lets it go."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still held: a waiter that opened it sees it is gone and retries
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            try:
                os.close(self._fd)  # the OS drops the flock; the file stays, to be taken over
            except OSError:
                pass


def lock_holder(path: str | Path) -> int | None:
    """The PID written in lock file ``path``, or None."""
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def hold_lock(path: str | Path, busy: str) -> Lock:
    """Take the advisory lock ``path`` (created if absent) for this process, or raise an InputError
    ``busy`` (its ``{pid}`` replaced) naming the process that holds it. A lock whose holder died is free."""
    path = Path(path)
    if fcntl is None:
        return Lock(path, None)
    for _ in range(100):  # a holder unlinking as we lock: try again on the new file
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
        except OSError:
            if path.is_symlink():
                raise InputError(f"{path}: the lock file is a symbolic link; refusing it (remove it)") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = lock_holder(path)
            raise InputError(busy.replace("{pid}", str(pid) if pid is not None else "unknown")) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            on_disk = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            on_disk = None
        mine = os.fstat(fd)
        if on_disk is None or (on_disk.st_dev, on_disk.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        except BaseException:  # (a full disk) no lock file left behind: it is ours to remove
            Lock(path, fd).release()
            raise
        return Lock(path, fd)
    raise InputError(f"{path}: could not take the lock (it keeps changing); try again")
