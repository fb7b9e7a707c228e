"""`--plot`: GB/s against request size, one line per method, the limits drawn dashed."""

from __future__ import annotations

from kvwire.bench.report import Row

LIMITS = ("limit-memcpy", "limit-tcp")


def plot_rows(rows: list[Row], path: str) -> None:
    """One panel per (layout, pool) combination present in `rows`; writes a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.error is None]  # a method that did not run has no figures to draw
    panels = sorted({(r.layout, r.pool) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (layout, pool) in zip(axes[0], panels):
        mine = [r for r in rows if (r.layout, r.pool) == (layout, pool)]
        for method in dict.fromkeys(r.method for r in mine):
            line = sorted((r.bytes / 2**20, r.gbps_median) for r in mine if r.method == method)
            style = dict(linestyle="--", color="black" if method == "limit-memcpy" else "grey") \
                if method in LIMITS else dict(marker="o")
            ax.plot([x for x, _ in line], [y for _, y in line], label=method, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request KV size (MiB)")
        ax.set_ylabel("GB/s (median)")
        ax.set_title(f"{layout} blocks, {pool} pool")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
