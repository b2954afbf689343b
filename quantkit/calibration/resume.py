"""Crash resume of a calibrated run: after every finished layer the capture pass leaves what it needs to go on
from there, so a run killed at layer 27 of 32 reruns from layer 27, and ends with the same bytes.

The run's folder, `OUT/.partial-run-KEY/` (KEY from the run's output names), holds

    manifest.json    what the run is made of: model files, calibration tokens, formats, options, quantkit version
    state.json       the last commit point: {pass, layer (layers done in that pass), generation}
    job-K.G.pt       job K's own state (its `resume_state()`) and stream of hidden states at generation G

A commit point is written after every layer: each active job's stream (copied) and every job's state go to
generation G's files in a background thread while the next layer runs, then state.json names G.  Two
generations alternate, so a kill while G is being written leaves G−1 whole and named.  The artifacts' files
sit in their own `.partial-NAME` folders, their finished layers already at their final offsets; a resumed
writer reopens them and skips what the state says was written.

A rerun whose manifest differs starts afresh and says which input changed.  What a job keeps across layers
is its own business (`resume_state` / `restore` on the job protocol); the stream files are torch pickles
that quantkit wrote itself into the run's own output folder.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("quantkit")


@dataclass
class ResumePoint:
    pass_index: int
    layer: int              # layers finished in that pass
    generation: int


def run_key(outputs: list[Path]) -> str:
    return hashlib.sha256("\n".join(sorted(str(Path(p).name) for p in outputs)).encode()).hexdigest()[:16]


def model_fingerprint(model) -> dict:
    """Name, revision and every file of the model folder with its size and modification time."""
    folder = Path(model.folder)
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir()) if p.is_file()}
    return {"name": model.name, "revision": model.revision, "files": files}


class RunCheckpoint:
    def __init__(self, out_dir: Path, outputs: list[Path], manifest: dict):
        self.folder = Path(out_dir) / f".partial-run-{run_key(outputs)}"
        self.manifest = json.loads(json.dumps(manifest, sort_keys=True, default=str))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.generation = 0
        self.saved: ResumePoint | None = None
        self.jobs: list = []

    # --- reading a previous run ---------------------------------------------------------------
    def find(self) -> tuple[ResumePoint | None, str | None]:
        """The commit point to resume from, or (None, why not) — why is None when there was nothing to resume."""
        manifest, state = self.folder / "manifest.json", self.folder / "state.json"
        if not self.folder.exists():
            return None, None
        try:
            before = json.loads(manifest.read_text())
        except (OSError, ValueError):
            return None, "the previous run's manifest is unreadable"
        if before != self.manifest:
            return None, _difference(before, self.manifest)
        try:
            s = json.loads(state.read_text())
            point = ResumePoint(int(s["pass"]), int(s["layer"]), int(s["generation"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None, "the previous run stopped before its first layer was done"
        return point, None

    def load_job(self, index: int, point: ResumePoint) -> tuple[dict, torch.Tensor | None]:
        data = torch.load(self.folder / f"job-{index}.{point.generation % 2}.pt", weights_only=False)
        return torch.load(io.BytesIO(data["state"]), weights_only=False), data["stream"]

    # --- writing this run's commit points ----------------------------------------------------------
    def start_fresh(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        (self.folder / "manifest.json").write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")

    def continue_from(self, point: ResumePoint) -> None:
        self.generation = point.generation
        self.saved = point

    def bind(self, jobs: list) -> None:
        """The run's jobs, in the order their files are numbered (the same order on every run of the manifest)."""
        self.jobs = list(jobs)

    def save(self, pass_index: int, layer: int, streams: list[tuple[object, torch.Tensor]]) -> None:
        """Commit point: `layer` layers of pass `pass_index` done; `streams` are the (job, stream) pairs of the
        pass's active jobs.  States are serialized now (they change as the run goes on) and the streams
        copied; the files are written in the background."""
        self.wait()
        self.generation += 1
        g = self.generation
        of = {id(job): h for job, h in streams}
        payloads = []
        for k, job in enumerate(self.jobs):
            buf = io.BytesIO()
            torch.save(job.resume_state(), buf)
            stream = of.get(id(job))
            payloads.append((k, buf.getvalue(), None if stream is None else stream.detach().to("cpu", copy=True)))
        point = ResumePoint(pass_index, layer, g)

        def write() -> None:
            try:
                for k, state, stream in payloads:
                    path = self.folder / f"job-{k}.{g % 2}.pt"
                    tmp = path.with_suffix(".tmp")
                    torch.save({"state": state, "stream": stream}, tmp)
                    os.replace(tmp, path)
                tmp = self.folder / "state.json.tmp"
                tmp.write_text(json.dumps({"pass": pass_index, "layer": layer, "generation": g}) + "\n")
                os.replace(tmp, self.folder / "state.json")
                self.saved = point
            except BaseException as e:     # reported by the next wait(): a failed commit must not pass silently
                self._error = e

        self._thread = threading.Thread(target=write, name="quantkit-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def settle(self) -> None:
        """Let a commit in flight end, on the way out of a failed run (its own error, if any, is dropped: the
        run's is the one to report, and the last commit that did land is still whole)."""
        try:
            self.wait()
        except BaseException:
            pass

    def remove(self) -> None:
        self.settle()
        shutil.rmtree(self.folder, ignore_errors=True)


def _difference(before: dict, now: dict) -> str:
    """Which input of the run changed, in words."""
    words = {"model": "the model's files changed", "calibration": "the calibration tokens differ",
             "formats": "the formats differ", "options": "the options differ", "quantkit": "another quantkit version",
             "device": "another device"}
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            if key == "options":
                changed = sorted(k for k in set(before.get(key, {})) | set(now.get(key, {}))
                                 if before.get(key, {}).get(k) != now.get(key, {}).get(k))
                return f"the options differ ({', '.join(changed)})"
            return words.get(key, f"{key} differs")
    return "the previous run differs"
