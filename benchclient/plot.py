"""`pdserve bench --plot FILE.png`: throughput against latency, one point per concurrency level, as a PNG.

Each level of a sweep is one point: output tokens/s on x, TTFT p50 (left) and ITL p50 (right) on y, labelled
with its concurrency, so the knee where more streams stop buying throughput shows at a glance. Needs
matplotlib (`pip install 'pdserve[plot]'`); drawn off-screen, no display needed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pdserve.benchclient.report import LevelSummary


def plot(summaries: Sequence[LevelSummary], path: str | Path, title: str) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pdserve[plot]'") from None
    matplotlib.use("Agg")  # off-screen: servers and CI have no display
    import matplotlib.pyplot as plt

    done = [s for s in summaries if s.completed]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, field, label in ((axes[0], "ttft_ms_p50", "TTFT p50 (ms)"), (axes[1], "itl_ms_p50", "ITL p50 (ms)")):
        points = [(s.output_tok_s, getattr(s, field), s.concurrency) for s in done if getattr(s, field) is not None]
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o")
        for x, y, concurrency in points:
            ax.annotate(f"{concurrency}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title + " (labels: concurrency)")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
