"""The PNG: measured speedup against average active layers, with the ideal L / layers line.

matplotlib is imported here only (a bench-only extra: pip install matplotlib).
"""

from __future__ import annotations

import math

from .results import ResultRow
from .stats import bandwidth_ceiling

MARKERS = {"ort": "o", "ort-nospin": "s", "torch": "^"}
COLORS = {"ort": "tab:red", "ort-nospin": "tab:blue", "torch": "tab:green"}
STYLES = ["-", "--", ":", "-."]  # one per shape


def plot(rows: list[ResultRow], models: dict, path) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the plot needs matplotlib (a bench-only extra): pip install matplotlib; "
                          "or pass --plot '' to skip it") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = [a for a in models if any(r.arch == a and r.available for r in rows)]
    fig, axes = plt.subplots(1, max(len(archs), 1), figsize=(6.2 * max(len(archs), 1), 4.6), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        model = models[arch]
        L = model["num_layers"]
        xs = [L * i / 200 for i in range(20, 201)]
        ax.plot(xs, [L / x for x in xs], color="black", lw=1, label="ideal L / layers")
        ax.plot(xs, [bandwidth_ceiling(L, x, model["layer_bytes"], model["head_bytes"]) for x in xs],
                color="gray", lw=1, ls="--", label="bandwidth ceiling (lm_head every step)")
        series = {}
        for r in rows:
            if r.arch != arch or not r.available or math.isnan(r.measured_speedup):
                continue
            series.setdefault((r.backend, r.batch, r.prompt), []).append(r)
        # full-depth-only rows (transformers, Optimum) are the single point (L, 1): not plotted
        series = {k: v for k, v in series.items() if len(v) > 1}
        shapes = sorted({(b, p) for _, b, p in series})
        top = 6.0
        for (backend, batch, prompt), pts in sorted(series.items()):
            pts.sort(key=lambda r: -r.figures.avg_layers)
            top = max(top, max(r.measured_speedup for r in pts) * 1.1)
            ax.plot([r.figures.avg_layers for r in pts], [r.measured_speedup for r in pts],
                    marker=MARKERS.get(backend, "x"), color=COLORS.get(backend), lw=1, ms=5,
                    ls=STYLES[shapes.index((batch, prompt)) % len(STYLES)],
                    label=f"{backend} b{batch} p{prompt}")
        ax.set_title(f"{arch} shapes ({L} layers)")
        ax.set_xlabel("average active layers per generated token")
        ax.set_ylabel("measured decode speedup vs full depth (same backend)")
        ax.set_xlim(0, L * 1.05)
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
