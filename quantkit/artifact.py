"""Artifacts appear only when complete: everything is written under a hidden
`.partial-*` name in the output folder and renamed into place at the end."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import INTERRUPTS, OutputError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def model_base_name(name: str) -> str:
    """A model spec's last part: 'demo:smollm2-135m' -> 'smollm2-135m', 'org/Name' or a folder path -> 'Name'."""
    return name.split(":", 1)[-1].rstrip("/").split("/")[-1]


def model_stem(name: str) -> str:
    """`model_base_name`, safe as a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model_base_name(name)) or "model"


def ensure_output_dir(out: Path) -> Path:
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out}: cannot create the output folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: the output folder is not writable")
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _os_error_message(path: Path, e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"{path}: the disk is full (no space left while writing); free space or choose another -o folder"
    if e.errno == errno.EDQUOT:
        return f"{path}: the disk quota is used up while writing; free space or choose another -o folder"
    if e.errno == errno.EFBIG:
        return (f"{path}: a file grew past the file-size limit (ulimit -f) or what the file system allows; raise "
                f"the limit or choose another -o folder")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{path}: not writable ({e.strerror})"
    return f"{path}: write failed ({e.strerror or e})"


@contextmanager
def atomic_file(final: Path):
    """Yield a temporary path beside `final`; rename it to `final` only if the block succeeds."""
    final = Path(final)
    ensure_output_dir(final.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".partial-{final.name}.", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp)
    # only the name is kept: the writer creates the file itself (with normal permissions).  Opening
    # an existing empty file with truncation marks it on ext4 for a forced flush at close
    # (auto_da_alloc), which cost ~0.9 s per 2 GiB file
    tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(_os_error_message(final, e)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def partial_folder(final: Path) -> Path:
    """The fixed temporary name of a resumable folder artifact (its run holds `final`'s lock)."""
    return Path(final).parent / f".partial-{Path(final).name}"


@contextmanager
def atomic_folder(final: Path, resume: bool | None = None, keep_on_interrupt=lambda: False):
    """Yield a temporary folder beside `final`; it becomes `final` only if the block succeeds.

    resume None: a fresh folder of a random name, removed on any failure.  resume False / True: the fixed
    `partial_folder(final)`, made afresh / taken up as a previous run left it; an interrupt (Ctrl-C,
    SIGTERM) leaves it for a rerun to resume when `keep_on_interrupt()` says there is something to resume
    (quantkit.calibration.resume); any other failure removes it."""
    final = Path(final)
    ensure_output_dir(final.parent)
    if resume is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".partial-{final.name}.", dir=final.parent))
    else:
        tmp = partial_folder(final)
        if not resume:
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700, exist_ok=True)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; a finished artifact gets normal permissions
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(_os_error_message(final, e)) from None
    except INTERRUPTS:
        if resume is None or not keep_on_interrupt():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def output_locks(paths: list[Path]):
    """Hold an exclusive lock on each output for the block: a second run writing one of them at the same time
    refuses in one line instead of interleaving with this one.  The locks are flock(2) on `.NAME.lock` beside
    each output, so a killed run leaves none behind; the files go when the run ends."""
    held: list[tuple[int, Path]] = []
    try:
        for final in sorted({Path(p) for p in paths}):
            ensure_output_dir(final.parent)
            lock = final.parent / f".{final.name}.lock"
            while True:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise OutputError(f"{final}: another quantkit run is writing it now (lock {lock}); wait for "
                                      f"it to end, or write elsewhere with -o") from None
                # the file may have been removed by the run that held it just before: lock the one on disk
                try:
                    if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)
            held.append((fd, lock))
        yield
    finally:
        for fd, lock in held:
            lock.unlink(missing_ok=True)   # while still held: a waiter then finds a new file and retries
            os.close(fd)
