"""The card's plot: mean KL divergence (log scale) and perplexity against bits per weight, one point per
measured artifact, the original marked.  matplotlib with the Agg backend (no display needed).

The PNG carries, as text chunks, the points it draws and their pixel positions, so a reader (or a test) can
check the picture against the table without guessing from pixels alone."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # card.py draws with this module
    from .card import CardRow

ORIGINAL_BPW = 16.0
POINT_COLOR = "#1f77b4"


def points(rows: list["CardRow"]) -> list[dict]:
    return [{"label": f"{r.format}:{r.variant}", "bits_per_weight": r.bits_per_weight,
             "mean_kld": r.metrics["mean_kld"], "perplexity": r.metrics["perplexity"]}
            for r in rows if r.bits_per_weight and r.metrics and r.metrics.get("mean_kld") is not None]


def write_plot(rows: list["CardRow"], path: Path, title: str) -> Path | None:
    """The PNG at `path`, or None when no artifact has a mean KLD to plot."""
    pts = points(rows)
    if not pts:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    base = next((r.metrics["base_perplexity"] for r in rows if r.metrics and r.metrics.get("base_perplexity")), None)
    fig, (kld_ax, ppl_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    x = [p["bits_per_weight"] for p in pts]
    kld_ax.scatter(x, [max(p["mean_kld"], 1e-6) for p in pts], color=POINT_COLOR, s=30, zorder=3)
    kld_ax.set_yscale("log")
    kld_ax.set(xlabel="bits per weight", ylabel="mean KLD vs the original (log)", title="divergence")
    ppl_ax.scatter(x, [p["perplexity"] for p in pts], color=POINT_COLOR, s=30, zorder=3)
    ppl_ax.set(xlabel="bits per weight", ylabel="perplexity", title="perplexity")
    if base:
        ppl_ax.scatter([ORIGINAL_BPW], [base], marker="*", color="black", s=120, zorder=3, label="original")
        ppl_ax.axhline(base, color="gray", linestyle="--", linewidth=0.8)
        ppl_ax.legend(loc="upper right")
    for ax, key in ((kld_ax, "mean_kld"), (ppl_ax, "perplexity")):
        ax.grid(True, which="both", alpha=0.3)
        for p in pts:
            ax.annotate(p["label"].split(":")[1], (p["bits_per_weight"], max(p[key], 1e-6)), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    fig.suptitle(title)
    fig.tight_layout()
    fig.canvas.draw()
    height = fig.canvas.get_width_height()[1]
    for p in pts:   # where each point landed, in image pixels (origin top left, as image readers index)
        for ax, key in ((kld_ax, "mean_kld"), (ppl_ax, "perplexity")):
            px, py = ax.transData.transform((p["bits_per_weight"], max(p[key], 1e-6)))
            p.setdefault("pixels", []).append([round(float(px)), round(height - float(py))])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": "quantkit", "Description": json.dumps(pts)})
    plt.close(fig)
    return path
