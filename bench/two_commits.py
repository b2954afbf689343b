"""quantkit's wall time for one conversion at two commits of this repository, taking turns, on the same machine
and input: whether a change made a path slower, apart from the machine's own drift (a benchmark's ratio against
another tool moves with both).

    python bench/two_commits.py OLD_COMMIT [NEW_COMMIT=working tree] [--rounds 2] [--format gptq:4bit-g128]
                                [--model demo:smollm2-135m]

Each commit runs from its own `git worktree` (in bench/_work/commits), CPU; calibrated formats (GPTQ) draw
wikitext-2 valid 128 × 512, seed 0.  Prints each run and the medians; writes nothing under bench/results.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "commits"
CALIB = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
# Each commit sees only its own built-in formats: the installed entry points are the working tree's, and may name a
# format an older commit does not have.
CONVERT = ("import sys, importlib.metadata as md; everything = md.entry_points; "
           "md.entry_points = lambda **k: [] if k.get('group') == 'quantkit.backends' else everything(**k); "
           "from quantkit import api; calib = sys.argv[4] or None; "
           "api.convert(sys.argv[1], [sys.argv[2]], sys.argv[3], options={'calib': calib, 'calib_samples': 128, "
           "'calib_seqlen': 512, 'seed': 0, 'device': 'cpu'})")


def checkout(commit: str | None) -> Path:
    if commit is None:
        return ROOT
    tree = WORK / commit
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(tree), commit], check=True)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--format", default="gptq:4bit-g128")
    ap.add_argument("--model", default="demo:smollm2-135m")
    args = ap.parse_args()
    trees = {args.old: checkout(args.old), args.new or "working tree": checkout(args.new)}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            out = WORK / "out"
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            t = time.perf_counter()
            calib = str(CALIB) if args.format.startswith("gptq:") else ""
            subprocess.run([sys.executable, "-c", CONVERT, args.model, args.format, str(out), calib], cwd=trees[name],
                           env={**os.environ, "PYTHONPATH": str(trees[name])}, check=True, capture_output=True)
            times[name].append(round(time.perf_counter() - t, 1))
            print(f"{name}: {times[name][-1]} s", flush=True)
    for name, ts in times.items():
        print(f"{name}: median {median(ts):.1f} s of {ts}")


if __name__ == "__main__":
    main()
