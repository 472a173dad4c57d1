"""`pdserve simulate --plot FILE.png`: latency over the simulated run, one point per request at its arrival time:
its TTFT (left) and its mean ITL after the first token (right), each with its SLO as a dashed line, and the
planner's switches as vertical lines. Drawn off-screen with matplotlib (`pip install 'pdserve[plot]'`).
"""
from __future__ import annotations

from pathlib import Path

from pdserve.planning.simulator import SimResult


def plot(result: SimResult, path: str | Path, ttft_slo_s: float, itl_slo_s: float) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pdserve[plot]'") from None
    matplotlib.use("Agg")  # off-screen: servers and CI have no display
    import matplotlib.pyplot as plt

    done = [r for r in result.requests if r.first >= 0]
    at = [r.arrival - result.start for r in done]
    ttft = [(r.first - r.arrival) * 1e3 for r in done]
    itl = [(r.last - r.first) / (r.output_len - 1) * 1e3 if r.output_len > 1 else None for r in done]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    for ax, values, slo, label in ((axes[0], ttft, ttft_slo_s, "TTFT (ms)"), (axes[1], itl, itl_slo_s,
                                                                              "mean ITL (ms)")):
        points = [(t, v) for t, v in zip(at, values) if v is not None]
        ax.scatter([t for t, _ in points], [v for _, v in points], s=4, alpha=0.5)
        ax.axhline(slo * 1e3, color="tab:red", linestyle="--", linewidth=1, label="SLO")
        for switch in result.switches:
            ax.axvline(switch.at - result.start, color="tab:gray", linewidth=0.8)
        ax.set_xlabel("arrival (s into the run)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    switches = f", {len(result.switches)} role switches (grey)" if result.switches else ""
    fig.suptitle(f"{result.deployment.label}: {len(done)} requests{switches}")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
