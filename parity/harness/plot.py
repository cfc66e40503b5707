"""`mha-parity --plot`: how much of its tolerance each group used, at a glance.

One point per (check, implementation or peer, dtype): the worst row's max error ÷ the
bound it was allowed, on a log scale with the pass line at 1. Points far left have
room to spare; points near the line are where agreement is thin.
"""

from __future__ import annotations

from mha_spec.files import atomic_path
from parity.harness.report import Report, margin

# One colour per check (parity.harness.matrix.CHECKS, in its order); red is a group with a failing row.
CHECK_COLOURS = {"forward": "#1f77b4", "gradient": "#ff7f0e", "leak": "#8c564b", "training": "#2ca02c",
                 "peers": "#9467bd", "decode": "#17becf", "sharded": "#e377c2"}
FAILED_COLOUR = "red"
_DTYPE_MARKERS = {"float64": "o", "float32": "s", "bfloat16": "^", "float16": "D"}


def margins(report: Report) -> list[tuple[str, str, str, float, bool]]:
    """(check, impl, dtype, worst margin, any row failed) per group, sorted for the plot."""
    worst: dict = {}
    for r in report.rows:
        m = margin(r)
        if m is None:
            continue
        key = (r.check, r.impl, r.dtype)
        prev = worst.get(key, (0.0, False))
        worst[key] = (max(prev[0], m), prev[1] or r.status == "fail")
    order = list(CHECK_COLOURS)
    return sorted(((c, i, d, m, f) for (c, i, d), (m, f) in worst.items()),
                  key=lambda g: (order.index(g[0]) if g[0] in order else 9, g[1], g[2]))


def legend_checks(groups) -> list[str]:
    """The checks the legend names: those with a point in the plot (`margins`' groups), in CHECK_COLOURS'
    order, any other after them."""
    present = {g[0] for g in groups}
    return [c for c in CHECK_COLOURS if c in present] + sorted(present - set(CHECK_COLOURS))


def write_margin_plot(report: Report, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = margins(report)
    labels = sorted({(c, i) for c, i, *_ in groups}, key=lambda ci: [(g[0], g[1]) for g in groups].index(ci))
    fig, ax = plt.subplots(figsize=(8, 2.0 + 0.28 * max(len(labels), 1)))
    for c, i, d, m, failed in groups:
        y = labels.index((c, i))
        ax.scatter(min(max(m, 1e-6), 1e6), y, marker=_DTYPE_MARKERS.get(d, "x"), s=36,  # inf (NaN placement) at 1e6
                   color=FAILED_COLOUR if failed else CHECK_COLOURS.get(c, "grey"), edgecolors="black", linewidths=0.4,
                   zorder=3)
    ax.axvline(1.0, color="red", linestyle="--", linewidth=1, label="pass line (error = bound)")
    ax.set_xscale("log")
    ax.set_yticks(range(len(labels)), [f"{c} · {i}" for c, i in labels], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("worst max error ÷ its bound (log; < 1 passes; drawn within 1e-6 to 1e6)")
    env = report.environment
    ax.set_title(f"mha-parity margins — device {env.get('device')}, seed {env.get('seed')}, "
                 f"precision jax={env.get('jax_default_matmul_precision')} torch={env.get('torch_float32_matmul_precision')}",
                 fontsize=9)
    for d, mk in _DTYPE_MARKERS.items():
        ax.scatter([], [], marker=mk, color="white", edgecolors="black", label=d)
    for c in legend_checks(groups):
        ax.scatter([], [], marker="s", color=CHECK_COLOURS.get(c, "grey"), label=c)
    if any(failed for *_, failed in groups):
        ax.scatter([], [], marker="s", color=FAILED_COLOUR, label="a row failed")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=5, frameon=False)  # below: never over a point
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
