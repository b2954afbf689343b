"""`quantkit collect`: the shards' result.json files merged into one report — report.json, report.md and a
plot per model — with the jobs that failed or never reported (when the recipe is given) named, so the last
job of a CI pipeline fails when the work is not all done."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact import atomic_file, model_stem
from ..errors import UsageError
from .runner import RESULTS, recipe_groups


@dataclass
class Report:
    results: list[dict]
    missing: list[dict] = field(default_factory=list)    # jobs of the recipe with no result anywhere
    files: list[Path] = field(default_factory=list)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if r.get("status") != "ok"]

    @property
    def complete(self) -> bool:
        return not self.failed and not self.missing

    def to_dict(self) -> dict:
        return {"complete": self.complete, "jobs": len(self.results) + len(self.missing),
                "ok": len(self.results) - len(self.failed), "failed": [r["id"] for r in self.failed],
                "missing": self.missing, "results": self.results}


def collect(folders: list[Path], out: Path, recipe: Path | None = None) -> Report:
    results: dict[str, dict] = {}
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            raise UsageError(f"{folder}: no such folder of results")
        # a run's output folder, or anything above such folders (CI artifacts downloaded side by side)
        found = sorted(p for p in folder.rglob("*.json") if p.parent.name.startswith(RESULTS))
        for path in found:
            try:
                r = json.loads(path.read_text())
            except ValueError:
                raise UsageError(f"{path}: not valid JSON (a result is written atomically: was it edited?)") from None
            previous = results.get(r["id"])
            if previous is None or (previous.get("status") != "ok" and r.get("status") == "ok"):
                results[r["id"]] = r
    report = Report(sorted(results.values(), key=lambda r: (r["name"], r["format"])))
    if recipe is not None:
        _, groups = recipe_groups(recipe)
        report.missing = [{"id": j.id, "model": j.model, "format": j.format}
                          for g in groups for j in g.jobs if j.id not in results]
    out = Path(out)
    with atomic_file(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    with atomic_file(out / "report.md") as tmp:
        tmp.write_text(_markdown(report))
    report.files = [out / "report.json", out / "report.md"] + _plots(report, out)
    return report


def _markdown(report: Report) -> str:
    lines = ["# quantkit run report", "",
             f"{len(report.results) - len(report.failed)} ok, {len(report.failed)} failed, "
             f"{len(report.missing)} missing.", "",
             "| model | format | status | perplexity | mean KLD | top-1 | convert s | Hub commit |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in report.results:
        m, t = r.get("metrics") or {}, r.get("timings") or {}
        cell = lambda v, f: f.format(v) if v is not None else "–"  # noqa: E731
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
        lines.append(f"| {r['name']} | {r['format']} | {status} | {cell(m.get('perplexity'), '{:.3f}')} | "
                     f"{cell(m.get('mean_kld'), '{:.5f}')} | {cell(m.get('top1_agreement'), '{:.2%}')} | "
                     f"{cell(t.get('convert_s'), '{:.1f}')} | {(r.get('hub') or {}).get('commit', '–') or '–'} |")
    for m in report.missing:
        lines.append(f"| {m['model']} | {m['format']} | missing | – | – | – | – | – |")
    return "\n".join(lines) + "\n"


def _plots(report: Report, out: Path) -> list[Path]:
    """One KLD / perplexity against bits-per-weight plot per model that has measured artifacts (from the
    results alone: the artifacts themselves may be on other machines)."""
    from ..publish.card import CardRow
    from ..publish.plot import write_plot
    by_model: dict[str, list] = {}
    for r in report.results:
        m = r.get("metrics")
        if r.get("status") == "ok" and m and r.get("bits_per_weight"):
            metrics = {**m, "protocol": {}}
            by_model.setdefault(r["name"], []).append(CardRow(r["format"], r["format"].split(":")[0],
                                                              r["variant"], r["size"], r["bits_per_weight"], metrics))
    written = []
    for name, rows in by_model.items():
        path = write_plot(rows, out / f"{model_stem(name)}-kld-vs-bpw.png", f"{name}: quantized artifacts")
        if path is not None:
            written.append(path)
    return written
