"""Figures of a `pshard sweep`: step time and exposed communication against
the slow link's bandwidth, one line per lever (every other flag that the
sweep varied), measured as points and predicted as lines, with each lever's
compute-bound knee marked. One figure per link delay when the sweep varied
it. Usage: plot_sweep.py results.csv OUT_DIR; prints the PNG paths."""

import csv
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

FIGURES = [("step_ms", "step time (ms)"), ("exposed_ms", "exposed communication (ms)")]
FIXED = {"point", "link_mbit", "knee_mbit", "step_error", "link_rate", "link_delay"}


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{path}: no results")
    return rows


def varied_flags(rows):
    """The flag columns (before link_mbit) whose values differ between rows."""
    header = list(rows[0].keys())
    flags = header[1:header.index("link_mbit")]
    return [f for f in flags if len({r[f] for r in rows}) > 1]


SHORT = {"weight_encoding": "weights", "grad_encoding": "grads", "reshard_after_forward": "reshard",
         "fabric_group_size": "group", "micro_batches": "K"}


def lever_name(row, levers):
    return ", ".join(f"{SHORT.get(f, f)} {row[f]}" for f in levers) or "as given"


def safe(text):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text) or "all"


def plot(rows, title, path, levers):
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(13, 5.6))
    by_lever = {}
    for r in rows:
        by_lever.setdefault(lever_name(r, levers), []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles = []
    knees = {}
    for i, (name, series) in enumerate(sorted(by_lever.items())):
        series.sort(key=lambda r: float(r["link_mbit"]))
        color = colors[i % len(colors)]
        x = [float(r["link_mbit"]) for r in series]
        for ax, (column, label) in zip(axes, FIGURES):
            # Marked too, so that a sweep of one rate still shows its prediction.
            line, = ax.plot(x, [float(r["predicted_" + column]) for r in series], "-x", color=color, label=name)
            ax.plot(x, [float(r["measured_" + column]) for r in series], "o", color=color)
            knee = float(series[0]["knee_mbit"])  # inf: latency alone keeps it communication-bound
            if 0 < knee < math.inf:
                ax.axvline(knee, color=color, linestyle=":", linewidth=1)
                knees.setdefault(round(knee, 1), color)
        handles.append(line)
    for ax, (_, label) in zip(axes, FIGURES):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("slow link (Mbit/s per node interface)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    handles.append(Line2D([], [], color="black", linestyle="-", label="predicted (pshard plan)"))
    handles.append(Line2D([], [], color="black", linestyle="none", marker="o", label="measured"))
    handles.append(Line2D([], [], color="black", linestyle=":", label="knee: compute-bound to its right"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(handles) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_sweep.py results.csv OUT_DIR")
    rows = load(sys.argv[1])
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    shaped = [r for r in rows if float(r["link_mbit"]) > 0]
    if not shaped:
        sys.exit("no point has a --link_rate: nothing to plot against bandwidth")
    levers = [f for f in varied_flags(shaped) if f not in FIXED]
    delays = sorted({r.get("link_delay", "") for r in shaped})
    for delay in delays:
        subset = [r for r in shaped if r.get("link_delay", "") == delay]
        title = "pshard sweep" + (f", link delay {delay}" if delay else "")
        path = os.path.join(out, f"sweep_delay_{safe(delay)}.png" if len(delays) > 1 or delay else "sweep.png")
        plot(subset, title, path, levers)
        print(path)


if __name__ == "__main__":
    main()
