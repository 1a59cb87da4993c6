"""Figures from benchmark JSON files, as PNG.

    python benchmarks/plot.py benchmarks/results/sweep/*.json --output-dir benchmarks/results
    python benchmarks/plot.py --profile profile.json --output-dir benchmarks/results

Serving JSONs (benchmark_serving.py / `dvllm bench serve` --output-json): latency p50 and p95 against
throughput, one line per engine (the JSON's label), one point per run, ordered by request rate ->
latency_vs_throughput.png. Profile JSONs: phase -> seconds (e.g. {"schedule": .., "gather": ..,
"forward": .., "update_scatter": .., "decode": .., "bookkeeping": ..}; non-numeric entries are
skipped, "num_steps"/"steps" divides into per-step times), dvllm.profiler's breakdown, or a
benchmark_throughput.py --profile --output-json file -> step_breakdown.png, one stacked bar per file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict
from typing import Any

_COUNT_KEYS = ("num_steps", "steps")
_NOT_PHASES = {*_COUNT_KEYS, "total_seconds", "share_outside_forward"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("plot.py needs matplotlib: pip install 'dvllm[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def load_runs(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """label -> serving runs, ordered by offered load (inf last)."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if "summary" not in data:
            raise ValueError(f"{path} is not a serving benchmark JSON (no 'summary')")
        runs[data.get("label") or os.path.basename(path)].append(data)
    for label in runs:
        runs[label].sort(key=lambda d: float(d.get("request_rate", math.inf)))
    return dict(runs)


def plot_latency_throughput(runs: dict[str, list[dict[str, Any]]], path: str, title: str | None = None,
                            x_key: str = "requests_per_s") -> str:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, items in sorted(runs.items()):
        xs = [d["summary"][x_key] or 0.0 for d in items]
        for ax, q in zip(axes, ("p50", "p95")):
            ys = [d["summary"][f"latency_{q}_s"] for d in items]
            line, = ax.plot(xs, ys, marker="o", label=label)
            for x, y, d in zip(xs, ys, items):  # the offered load, next to each point
                if y is not None and d.get("request_rate") not in (None, "inf"):
                    ax.annotate(f"{float(d['request_rate']):g}/s", (x, y), textcoords="offset points",
                                xytext=(4, 4), fontsize=7, color=line.get_color())
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, q in zip(axes, ("p50", "p95")):
        ax.set_title(f"latency {q}")
        ax.set_xlabel("throughput (completed requests/s; labels: offered load)" if x_key == "requests_per_s"
                      else x_key)
        ax.grid(True, alpha=0.3)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
    axes[0].set_ylabel("latency (s, log scale)")
    axes[1].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_profile(path: str) -> dict[str, float]:
    """phase -> seconds, per step when the file gives a step count. Takes a plain {phase: seconds}
    dict, dvllm.profiler.breakdown's {"steps", "seconds", "ms_per_step", ...}, or a throughput JSON
    holding one under "profile"."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a JSON object of phase -> seconds")
    count = next((data[k] for k in _COUNT_KEYS if _number(data.get(k)) and data[k] > 0), None)
    if isinstance(data.get("ms_per_step"), dict):
        phases, count = {k: v / 1000 for k, v in data["ms_per_step"].items() if _number(v)}, None
    else:
        nested = next((data[k] for k in ("seconds", "phases") if isinstance(data.get(k), dict)), None)
        source = nested if nested is not None else data
        phases = {k: float(v) for k, v in source.items() if k not in _NOT_PHASES and _number(v)}
    if not phases:
        raise ValueError(f"{path}: no phase -> seconds entries")
    return {k: v / count for k, v in phases.items()} if count else phases


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_breakdown(profiles: dict[str, dict[str, float]], path: str, title: str | None = None) -> str:
    plt = _pyplot()
    phases = list(dict.fromkeys(p for prof in profiles.values() for p in prof))
    labels = list(profiles)
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.6 * len(labels)))
    left = [0.0] * len(labels)
    colors = plt.get_cmap("tab10")
    for i, phase in enumerate(phases):
        widths = [1000 * profiles[label].get(phase, 0.0) for label in labels]
        ax.barh(labels, widths, left=left, label=phase, color=colors(i % 10))
        left = [a + b for a, b in zip(left, widths)]
    for y, label in enumerate(labels):
        prof = profiles[label]
        total = sum(prof.values())
        outside = total - prof.get("forward", 0.0)
        note = f"{1000 * total:.2f} ms" + (f", {100 * outside / total:.1f}% outside forward"
                                           if "forward" in prof and total > 0 else "")
        ax.text(left[y], y, "  " + note, va="center", fontsize=8)
    ax.set_xlabel("ms (per step when the profile gives num_steps)")
    ax.set_xlim(0, max(left) * 1.45 if max(left) > 0 else 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or "time per engine step, by phase")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="Serving benchmark JSON files (one engine per label).")
    p.add_argument("--profile", nargs="*", default=[], help="Profile JSON files (phase -> seconds).")
    p.add_argument("--output-dir", default="benchmarks/results")
    p.add_argument("--name", default="latency_vs_throughput.png", help="File name of the latency figure.")
    p.add_argument("--title")
    args = p.parse_args(argv)
    if not args.runs and not args.profile:
        p.error("give serving JSON files and/or --profile files")
    os.makedirs(args.output_dir, exist_ok=True)
    try:
        if args.runs:
            print(plot_latency_throughput(load_runs(args.runs), os.path.join(args.output_dir, args.name), args.title))
        if args.profile:
            profiles = {os.path.splitext(os.path.basename(f))[0]: load_profile(f) for f in args.profile}
            print(plot_breakdown(profiles, os.path.join(args.output_dir, "step_breakdown.png")))
    except (ValueError, KeyError, OSError) as e:
        p.exit(2, f"plot.py: error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
