"""Timing a benchmark step in its own process: wall time and that process's own peak RSS.

os.wait4 reports the child's rusage; the driver imports no torch, and Linux carries ru_maxrss across
fork + exec from a large parent, so each measured step must be a fresh child of a small driver."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def run(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> tuple[float, int]:
    """Run a command; return (wall seconds, peak RSS bytes).  Output goes to `log` (a file, not a pipe: a
    chatty child would block on a full pipe); a failure ends the benchmark with the log's tail."""
    with open(log, "wb") as sink:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=sink, stderr=subprocess.STDOUT,
                                cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{log.read_text(errors='replace')[-3000:]}")
    return wall, usage.ru_maxrss * 1024
