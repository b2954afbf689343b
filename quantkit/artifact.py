"""Artifacts appear only when complete: everything is written under a hidden
`.partial-*` name in the output folder and renamed into place at the end."""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
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


@contextmanager
def atomic_folder(final: Path):
    """Yield a temporary folder beside `final`; it becomes `final` only if the block succeeds."""
    final = Path(final)
    ensure_output_dir(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{final.name}.", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; a finished artifact gets normal permissions
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(_os_error_message(final, e)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
