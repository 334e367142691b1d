"""matplotlib is optional: the commands that draw a plot (`bench`, `eval`, `calibrate`) write their tables and JSON
without it, and say in one line which plot they skipped and how to get it. The plots that more than one command
draws live here too."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .model.sts import ece, reliability_bins, survival

PLOTS_HINT = "pip install matplotlib, the package's plots extra"


def pyplot(path: str | Path):
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` when matplotlib is not installed, after one
    line on stderr naming the plot ``path`` that is skipped."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} is not drawn ({PLOTS_HINT})", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reliability_plot(
    logits: torch.Tensor, accepted: torch.Tensor, temperatures: list[float] | None, path, bins: int = 15
) -> None:
    """Write a reliability diagram (PNG) of the prefix-survival estimates a_k before and after STS.

    logits, accepted [N, γ] as :func:`sequential_temperature_scaling`. One line per block position k: observed
    frequency of "first k all accepted" against the mean predicted a_k, per bin; the diagonal is perfect calibration.
    """
    plt = pyplot(path)
    if plt is None:
        return None

    outcome = accepted.double().cumprod(-1)
    panels = [("before STS (T = 1)", None), ("after STS", temperatures)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    cmap = plt.get_cmap("viridis")
    gamma = logits.shape[1]
    for ax, (title, temps) in zip(axes, panels, strict=True):
        a = survival(logits.double(), temps)
        for k in range(gamma):
            pts = reliability_bins(a[:, k], outcome[:, k], bins)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, color=cmap(k / max(gamma - 1, 1)))
        mean_ece = sum(ece(a[:, k], outcome[:, k], bins) for k in range(gamma)) / gamma
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(title=f"{title}: mean ECE {100 * mean_ece:.1f}%", xlabel="predicted prefix survival a_k", xlim=(0, 1))
    axes[0].set(ylabel="observed: first k draft tokens accepted", ylim=(0, 1))
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(1, gamma))
    fig.colorbar(sm, ax=axes, label="block position k")
    fig.savefig(path, dpi=110)
    plt.close(fig)
