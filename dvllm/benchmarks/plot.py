"""Figures from benchmark JSON files, as PNG.

    python benchmarks/plot.py run.json --output-dir benchmarks/results           # a `dvllm bench run` result
    python benchmarks/plot.py --profile profile.json --output-dir benchmarks/results

A `dvllm bench run` result (--output-json) -> latency_cdf.png (each contender's latency CDF, and the same as a
share of each request's SLO, at each rate) and, with several rates, goodput_vs_load.png (requests/s finishing
within their SLO, and the share that did, against the offered rate). Profile JSONs: phase -> seconds (e.g.
{"schedule": .., "gather": .., "forward": .., "update_scatter": .., "decode": .., "bookkeeping": ..}; non-numeric
entries are skipped, "num_steps"/"steps" divides into per-step times), dvllm.profiler's breakdown, or a
`dvllm bench run --profile-steps --output-json` file -> step_breakdown.png, one stacked bar per file.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

_COUNT_KEYS = ("num_steps", "steps")
_NOT_PHASES = {*_COUNT_KEYS, "total_seconds", "share_outside_forward"}


def pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ValueError("plots need matplotlib: pip install 'dvllm[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _rate_label(rate: float | None) -> str:
    return "the trace's arrivals" if rate is None else f"{rate:g} req/s"


def plot_run(result: dict[str, Any], output_dir: str) -> list[str]:
    """A `dvllm bench run` result's figures; returns their paths. Each contender's rounds are pooled."""
    if "runs" not in result:
        raise ValueError("not a `dvllm bench run` result (no 'runs')")
    plt = pyplot()
    os.makedirs(output_dir, exist_ok=True)
    runs = result["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 7), squeeze=False)
    for column, run in enumerate(runs):
        for row, (key, label) in enumerate((("latencies", "latency (s)"), ("slo_shares", "latency / SLO"))):
            ax = axes[row][column]
            for name, summaries in run["contenders"].items():
                values = sorted(v for s in summaries for v in s[key])
                total = sum(s["num_requests"] for s in summaries)  # failed requests never reach 1
                if values:
                    ax.step(values, [(i + 1) / total for i in range(len(values))], where="post", label=name)
            if key == "slo_shares":
                ax.axvline(1.0, color="gray", linestyle="--", linewidth=0.8)
            ax.set_xlabel(label)
            ax.set_ylim(0, 1.02)
            ax.grid(True, alpha=0.3)
            if column == 0:
                ax.set_ylabel("share of requests")
            if row == 0:
                ax.set_title(_rate_label(run["rate"]))
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{result['requests']} requests on {result['model']}: latency CDF (SLO {result['slo_factor']:g}x "
                 "solo)")
    fig.tight_layout()
    paths = [os.path.join(output_dir, "latency_cdf.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    rated = [run for run in runs if run["rate"] is not None]
    if len(rated) > 1:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for name in rated[0]["contenders"]:
            rates = [run["rate"] for run in rated]
            goodput = [_mean(s["goodput_rps"] for s in run["contenders"][name]) for run in rated]
            met = [_mean(100 * (s["slo_attainment"] or 0) for s in run["contenders"][name]) for run in rated]
            left.plot(rates, goodput, marker="o", label=name)
            right.plot(rates, met, marker="o", label=name)
        left.set(xlabel="offered load (req/s)", ylabel="goodput (req/s within SLO)")
        right.set(xlabel="offered load (req/s)", ylabel="requests within SLO (%)", ylim=(0, 102))
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
        left.legend(fontsize=8)
        fig.suptitle(f"{result['model']}: goodput against load (SLO {result['slo_factor']:g}x solo)")
        fig.tight_layout()
        paths.append(os.path.join(output_dir, "goodput_vs_load.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _mean(values: Any) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def load_profile(path: str) -> dict[str, float]:
    """phase -> seconds, per step when the file gives a step count. Takes a plain {phase: seconds}
    dict, dvllm.profiler.breakdown's {"steps", "seconds", "ms_per_step", ...}, or a `dvllm bench run` JSON
    holding one engine's under "profiles"."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and isinstance(data.get("profiles"), dict):
        if len(data["profiles"]) != 1:
            raise ValueError(f"{path}: one engine's profile, not {sorted(data['profiles']) or 'none'}: run one "
                             "engine with --profile-steps")
        (data,) = data["profiles"].values()
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
    plt = pyplot()
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
    p.add_argument("runs", nargs="*", help="`dvllm bench run` result JSON files (their figures go to one folder "
                   "each, named after the file, when there are several).")
    p.add_argument("--profile", nargs="*", default=[], help="Profile JSON files (phase -> seconds).")
    p.add_argument("--output-dir", default="benchmarks/results")
    args = p.parse_args(argv)
    if not args.runs and not args.profile:
        p.error("give `dvllm bench run` JSON files and/or --profile files")
    try:
        for path in args.runs:
            with open(path) as f:
                result = json.load(f)
            name = os.path.splitext(os.path.basename(path))[0]
            for figure in plot_run(result, args.output_dir if len(args.runs) == 1
                                   else os.path.join(args.output_dir, name)):
                print(figure)
        if args.profile:
            os.makedirs(args.output_dir, exist_ok=True)
            profiles = {os.path.splitext(os.path.basename(f))[0]: load_profile(f) for f in args.profile}
            print(plot_breakdown(profiles, os.path.join(args.output_dir, "step_breakdown.png")))
    except (ValueError, KeyError, OSError) as e:
        p.exit(2, f"plot.py: error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
