"""``pdserve bench --plot FILE.png``: latency against request rate, one curve per target.

Each point is one run (a target at one ``--request-rate``), placed at the request throughput it
achieved (so "all at once" runs sit at the target's capacity); the panels show TTFT, TPOT and ITL
at p50 (solid) and p99 (dashed). matplotlib is imported lazily (the ``test`` and ``bench``
extras) with the file-only Agg backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

Row = dict[str, object]
PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"))


def plot(rows: Sequence[Row], path: Path, title: str = "") -> None:
    """Write the latency-vs-rate figure of ``rows`` (the rows of ``--compare``) to ``path``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'pdserve[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(str(r["target"]) for r in rows))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], PANELS, strict=True):
        for i, target in enumerate(targets):
            points = sorted((float(r["request_throughput"]), r[key]) for r in rows  # type: ignore[arg-type]
                            if r["target"] == target)
            xs = [x for x, _ in points]
            color = f"C{i}"
            ax.plot(xs, [s["p50"] for _, s in points], "o-", color=color, label=target)  # type: ignore[index]
            ax.plot(xs, [s["p99"] for _, s in points], "x--", color=color, alpha=0.6)  # type: ignore[index]
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small", title="p50 solid, p99 dashed")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
