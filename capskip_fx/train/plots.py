"""Figures over run directories written by :mod:`capskip_fx.train` (loaded by :mod:`.report`).

Figures are drawn on :class:`matplotlib.figure.Figure` objects (Agg, no pyplot state), so this
works headless and inside test processes.  Groups with several seeds are drawn as one mean curve with
its 95% t band (:func:`.report.band`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure

from .report import Run, band, eval_curve, group_runs

PLOTS = ("accuracy_vs_wallclock.png", "accuracy_vs_epoch.png", "kept_fraction.png", "rows_by_epoch.png")


def _colors(labels: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {lab: cmap(i % 10) for i, lab in enumerate(labels)}


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _group_curve(members: Sequence[Run], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, top-1 per seed on a common x): epochs as they are; wall-clock interpolated on a common grid
    up to the shortest run's end (no extrapolation)."""
    if name == "accuracy_vs_epoch.png":
        curves = [eval_curve(r, "epoch") for r in members]
        length = min(len(x) for x, _ in curves)
        return curves[0][0][:length], np.stack([y[:length] for _, y in curves])
    curves = [eval_curve(r, "wall_clock_s") for r in members]
    curves = [(x, y) for x, y in curves if len(x)]
    if not curves:
        return np.zeros(0), np.zeros((len(members), 0))
    lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    grid = np.linspace(lo, hi, 50) if hi > lo else np.array([hi])
    return grid, np.stack([np.interp(grid, x, y) for x, y in curves])


def rows_by_epoch(r: Run) -> list[float]:
    """The share of the forwarded rows whose backward ran, per epoch (from summary.csv's running counts)."""
    out, prev_b, prev_n = [], 0, 0
    for s in r.summary:
        b, n = s.get("backward_rows"), s.get("rows")
        if b is None or n is None:
            return []
        out.append((b - prev_b) / max(1, n - prev_n))
        prev_b, prev_n = b, n
    return out


def _plot_rows_by_epoch(groups: dict, colors: dict, out: Path) -> None:
    """Per group that skips rows: the share of rows back-propagated per epoch, mean over seeds with its
    95% band; the right axis reads it as the GPU step ratio (1 + 2k)/3 it projects (forward:backward 1:2)."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, members in groups.items():
        per = [rows_by_epoch(r) for r in members]
        per = [p for p in per if p]
        if not per or all(k >= 1.0 for p in per for k in p):
            continue
        length = min(len(p) for p in per)
        ys = np.array([p[:length] for p in per])
        mean, half = band(ys)
        xs = np.arange(1, length + 1)
        ax.plot(xs, mean, color=colors[label], marker=".", label=f"{label} (n={len(per)})" if len(per) > 1 else label)
        if len(per) > 1:
            ax.fill_between(xs, mean - half, mean + half, color=colors[label], alpha=0.2, linewidth=0)
    ax.set_xlabel("epoch")
    ax.set_ylabel("rows back-propagated / rows forwarded")
    ax.set_ylim(0, 1.05)
    right = ax.secondary_yaxis("right", functions=(lambda k: (1 + 2 * k) / 3, lambda r: (3 * r - 1) / 2))
    right.set_ylabel("projected GPU step ratio (1 + 2k)/3, not measured")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.savefig(out, dpi=110)


def plot_runs(runs: Sequence[Run], out_dir: str | Path) -> list[Path]:
    """Accuracy vs wall-clock, accuracy vs epoch (one mean curve with its 95% band per group), kept
    fraction over steps (one line per run), rows back-propagated per epoch (:func:`_plot_rows_by_epoch`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    colors = _colors(list(groups))
    specs = [
        ("accuracy_vs_wallclock.png", "training wall-clock (s, compile excluded)", "eval top-1 (%)"),
        ("accuracy_vs_epoch.png", "epoch", "eval top-1 (%)"),
        ("kept_fraction.png", "step", "kept fraction (moving average)"),
    ]
    written = []
    for name, xlabel, ylabel in specs:
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
        ax = fig.subplots()
        for label, members in groups.items():
            if name == "kept_fraction.png":
                for j, r in enumerate(members):
                    xs = [s["step"] for s in r.steps]
                    fr = [s["kept"] / s["n"] if s.get("n") else math.nan for s in r.steps]
                    ys = _moving_average(fr, max(1, len(fr) // 50))
                    ax.plot(xs, ys, color=colors[label], alpha=0.85, label=label if j == 0 else None)
                continue
            xs, ys = _group_curve(members, name)
            if not len(xs):
                continue
            mean, half = band(ys)
            n = len(members)
            ax.plot(xs, mean, color=colors[label], marker="." if len(xs) < 20 else None,
                    label=f"{label} (n={n})" if n > 1 else label)
            if n > 1:
                ax.fill_between(xs, mean - half, mean + half, color=colors[label], alpha=0.2, linewidth=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize="small")
        fig.savefig(out_dir / name, dpi=110)
        written.append(out_dir / name)
    _plot_rows_by_epoch(groups, colors, out_dir / "rows_by_epoch.png")
    written.append(out_dir / "rows_by_epoch.png")
    return written
