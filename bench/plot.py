"""Bar chart of benchmark results (one PNG per device).

Used by :mod:`bench.benchmark`; also redraws a chart from a saved JSON file::

    python -m bench.plot bench/results/nvidia-h200.json [out.png]

Requires matplotlib (imported here, so importing this module fails without it).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

# Fixed colours so a variant looks the same in every chart.
VARIANT_COLORS = {
    "eager": "#7f7f7f",
    "compile": "#1f77b4",
    "compile_ro": "#17becf",
    "torchdiffeq": "#9467bd",
    "fused": "#d62728",
    "fused_compile_ro": "#ff9896",
}
FALLBACK_COLORS = ["#2ca02c", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22"]


def _variant_order(rows: List[Dict[str, Any]]) -> List[str]:
    """Variants timed (or failed) at least once, in the table's order (fused last)."""
    names: List[str] = []
    for row in rows:
        for name, res in row.get("variants", {}).items():
            if res.get("status") in ("ok", "error") and name not in names:
                names.append(name)
    fused = [n for n in ("fused", "fused_compile_ro") if n in names]
    known = [n for n in VARIANT_COLORS if n in names and n not in fused]
    others = [n for n in names if n not in VARIANT_COLORS]
    return known + others + fused


def plot_results(data: Dict[str, Any], path: Path) -> None:
    """Draw ``data`` (the benchmark JSON) as grouped bars to ``path``.

    One group per workload/size, one bar per variant, log-scale microseconds
    per call; each bar is labelled with its time.  On CUDA the DESIGN.md
    target for the fused op is drawn as a black tick over its group.
    """
    meta, rows = data["metadata"], [r for r in data["results"] if r.get("variants")]
    variants = _variant_order(rows)
    colors = dict(VARIANT_COLORS)
    for name, color in zip([v for v in variants if v not in colors], FALLBACK_COLORS):
        colors[name] = color

    n_groups, n_bars = len(rows), max(len(variants), 1)
    width = 0.8 / n_bars
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.4 * n_groups * n_bars + 3.0)), 5.5))

    all_ys: List[float] = []
    for j, name in enumerate(variants):
        xs, ys, mismatched = [], [], []
        for i, row in enumerate(rows):
            res = row["variants"].get(name, {})
            if res.get("status") == "ok":
                xs.append(i - 0.4 + (j + 0.5) * width)
                ys.append(res["median_us"])
                mismatched.append(res.get("match") is False)
        bars = ax.bar(xs, ys, width=width * 0.95, color=colors[name], label=name)
        for bar, y, bad in zip(bars, ys, mismatched):
            text = _short(y)
            if bad:  # output differs from eager: do not let the bar pass unremarked
                bar.set_hatch("xx")
                text += " MISMATCH"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=6, rotation=90)
            all_ys.append(y)

    # Say why a group has no bar where one is expected.
    for i, row in enumerate(rows):
        for j, name in enumerate(variants):
            res = row["variants"].get(name, {})
            missing = res.get("status") == "error" or (name == "fused" and res.get("status") == "skipped")
            if missing:
                ax.annotate("error" if res["status"] == "error" else "n/a",
                            (i - 0.4 + (j + 0.5) * width, 0), xycoords=("data", "axes fraction"),
                            xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                            fontsize=6, rotation=90, color=colors[name])

    target_drawn = False
    for i, row in enumerate(rows):
        target = row.get("target_us")
        if target is not None:
            ax.hlines(target, i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1,
                      label=None if target_drawn else "fused target")
            target_drawn = True
            all_ys.append(target)

    ax.set_yscale("log")
    if all_ys:
        # Whole decades below, room for the rotated labels above.
        ax.set_ylim(10 ** math.floor(math.log10(min(all_ys))), max(all_ys) * 6)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    train = meta.get("mode") == "train"
    ax.set_ylabel(f"microseconds per {'training step' if train else 'call'} (median, log scale)")
    ax.set_xticks(range(n_groups))
    ax.set_xticklabels([f"{r['workload']}\n{r['size']}\n{r['shape']}" for r in rows], fontsize=7)
    ax.set_xlim(-0.6, n_groups - 0.4)
    ax.grid(axis="y", which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(
        ("fused_ops train step (fwd+bwd" + ("" if meta.get("optimizer", "none") == "none"
                                             else f"+{meta['optimizer']}") + ")" if train
         else "fused_ops")
        + f" on {meta['device']} | torch {meta['torch_version']}"
        + (f", CUDA {meta['cuda_version']}" if meta.get("device_type") == "cuda" else "")
        + f" | {meta['date_utc'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _short(us: float) -> str:
    """Compact bar label."""
    if us >= 10_000:
        return f"{us / 1000:.0f}ms"
    if us >= 1000:
        return f"{us / 1000:.1f}ms"
    return f"{us:.3g}"


def main(argv: List[str]) -> int:
    """Redraw ``<json>`` to ``[out.png]`` (default: next to the JSON)."""
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) == 2 else src.with_suffix(".png")
    plot_results(json.loads(src.read_text()), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
