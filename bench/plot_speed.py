"""Plots of a bench/speed.py results file, each measurement beside its roofline.

    python bench/plot_speed.py results.json --out-dir docs/results/ [--prefix speed_h200]

A separate step because the GPU host has no plotting stack: copy the JSON back and plot anywhere with
matplotlib (`pip install -e .[bench]`). Writes three PNGs: decode ms per step and aggregate tok/s against
busy slots, prefill tok/s against prompt length, and the resent prompt's cold and warm time to first token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

MEASURED, ROOFLINE = "tab:blue", "tab:gray"


def subtitle(r: dict) -> str:
    m = r["model"]
    return (f"{r['device_name']}, {m['source']} ({m['layers']} layers, {m['dtype']}), "
            f"commit {r.get('commit')}, {r['date_utc'][:10]}")


def finish(fig, r: dict, path: Path, fontsize: int) -> None:
    """Title the figure with the run it shows, write it, and free it."""
    fig.suptitle(subtitle(r), fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(r: dict, path: Path) -> None:
    rows = r["decode"]
    busy = [d["busy"] for d in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(busy, [d["ms_per_step"] for d in rows], "o-", color=MEASURED, label="measured")
    left.plot(busy, [d["roofline_ms_per_step"] for d in rows], "--", color=ROOFLINE,
              label="roofline (bytes moved / copy bandwidth)")
    for d in rows:
        left.annotate(f"{d['ratio']:.2f}", (d["busy"], d["ms_per_step"]), textcoords="offset points",
                      xytext=(4, 6), fontsize=8)
    left.set(xlabel="busy slots", ylabel="ms per decode step", title="decode step (ratio = roofline / measured)",
             xticks=busy, ylim=(0, None))
    right.plot(busy, [d["tokens_per_s"] for d in rows], "o-", color=MEASURED, label="measured")
    right.plot(busy, [d["roofline_tokens_per_s"] for d in rows], "--", color=ROOFLINE, label="roofline")
    right.set(xlabel="busy slots", ylabel="tokens / s (all slots)", title="decode throughput", xticks=busy,
              yscale="log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    finish(fig, r, path, fontsize=9)


def plot_prefill(r: dict, path: Path) -> None:
    rows = [p for p in r["prefill"] if "seconds" in p]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    tokens = [p["tokens"] for p in rows]
    ax.plot(tokens, [p["tokens_per_s"] for p in rows], "o-", color=MEASURED, label="measured")
    ax.plot(tokens, [p["roofline_tokens_per_s"] for p in rows], "--", color=ROOFLINE,
            label="roofline (FLOPs / matmul rate)")
    for p in rows:
        ax.annotate(f"{p['ratio']:.2f}", (p["tokens"], p["tokens_per_s"]), textcoords="offset points",
                    xytext=(4, 6), fontsize=8)
    skipped = [str(p["tokens"]) for p in r["prefill"] if "skipped" in p]
    title = "prefill, one request (ratio = roofline / measured)"
    if skipped:
        title += f"\nskipped: {', '.join(skipped)}"
    ax.set(xlabel="prompt tokens", ylabel="tokens / s", title=title, xscale="log", yscale="log")
    ax.set_xticks(tokens, [f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in tokens])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    finish(fig, r, path, fontsize=8)


def plot_ttft(r: dict, path: Path) -> None:
    pc = r["prefix_cache"]
    labels = ["cold (first send)", f"warm ({pc['warm_cached_tokens']} cached)"]
    values = [pc["cold_ttft_s"], pc["warm_ttft_s"]]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    bars = ax.bar(labels, values, color=[ROOFLINE, MEASURED])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.3f} s", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                    textcoords="offset points", xytext=(0, 3), fontsize=9)
    restore = pc["restore"]
    ax.set(ylabel="time to first token (s)",
           title=f"resent {pc['prompt_tokens']}-token prompt: x{pc['speedup']:.1f}, identical: {pc['identical']}\n"
                 f"restore of a {restore['restored_tokens']}-token snapshot ({pc['tier']}): "
                 f"{restore['restore_ms']:.1f} ms")
    ax.grid(alpha=0.3, axis="y")
    finish(fig, r, path, fontsize=8)


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="the JSON bench/speed.py wrote")
    p.add_argument("--out-dir", default="docs/results")
    p.add_argument("--prefix", default=None, help="file name prefix (default: the results file's name)")
    args = p.parse_args(argv)
    r = json.loads(Path(args.results).read_text())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = args.prefix or Path(args.results).stem
    written = []
    for name, plot, key in (("decode", plot_decode, "decode"), ("prefill", plot_prefill, "prefill"),
                            ("ttft", plot_ttft, "prefix_cache")):
        if r.get(key):
            path = out / f"{prefix}_{name}.png"
            plot(r, path)
            written.append(path)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
