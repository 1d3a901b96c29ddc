"""Plots and comparison tables over run directories written by :mod:`capskip_fx.train`.

A run directory holds ``config.yaml`` (the resolved config), ``summary.csv`` (one row per
epoch) and ``steps.jsonl`` (one line per step).  Runs are grouped by their label (rule +
budget/options, see :func:`run_label`); seeds of one configuration share a label.

Figures are drawn on :class:`matplotlib.figure.Figure` objects (Agg, no pyplot state), so this
works headless and inside test processes.
"""
from __future__ import annotations

import csv
import inspect
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml
from matplotlib.figure import Figure

PLOTS = ("accuracy_vs_wallclock.png", "accuracy_vs_epoch.png", "kept_fraction.png")


def rule_takes_budget(rule: str) -> bool:
    """Whether ``rule`` reads ``budget`` (so it belongs in the label)."""
    try:
        from capskip_fx.rules import RULES
    except ImportError:  # pragma: no cover - rules package missing
        RULES = {}
    cls = RULES.get(rule)
    if cls is None:
        return rule == "capskip"
    return "budget" in inspect.signature(cls).parameters


def run_label(cfg: dict[str, Any]) -> str:
    """Group label of a run: explicit ``label``, else rule + the options that define it."""
    if cfg.get("label"):
        return str(cfg["label"])
    rule = cfg.get("rule", "?")
    parts = [rule]
    if cfg.get("match"):
        parts.append(f"match={cfg['match']}")
    if cfg.get("match") or rule_takes_budget(rule):
        parts.append(f"b={float(cfg.get('budget', 0.1)):g}")
    if cfg.get("keep") is not None:
        parts.append(f"keep={float(cfg['keep']):g}")
    parts += [f"{k}={v}" for k, v in sorted((cfg.get("rule_options") or {}).items())]
    vcas = cfg.get("vcas_options")
    if vcas is not None and rule != "vcas":
        parts.append("+vcas")
    if vcas:
        parts += [f"vcas.{k}={v}" for k, v in sorted(vcas.items())]
    if cfg.get("time_budget"):
        parts.append("time-matched")
    return " ".join(parts)


def _num(v: str) -> Any:
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: list[dict[str, Any]]
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return run_label(self.config)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def is_dense_reference(self) -> bool:
        return self.config.get("rule") == "dense" and not self.config.get("time_budget")

    @property
    def final(self) -> dict[str, Any]:
        return self.summary[-1] if self.summary else {}

    @property
    def kept_frac(self) -> float:
        """Overall backward rows / forward rows (not a mean of per-epoch means)."""
        f = self.final
        if f.get("rows"):
            return f["backward_rows"] / f["rows"]
        return f.get("mean_kept_frac", math.nan) if f else math.nan


def load_run(path: str | Path, with_steps: bool = True) -> Run:
    path = Path(path)
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is not a run directory (no config.yaml)")
    config = yaml.safe_load(cfg_file.read_text()) or {}
    summary = []
    if (path / "summary.csv").is_file():
        with open(path / "summary.csv", newline="") as f:
            summary = [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]
    steps = []
    if with_steps and (path / "steps.jsonl").is_file():
        with open(path / "steps.jsonl") as f:
            steps = [json.loads(line) for line in f if line.strip()]
    return Run(path, config, summary, steps)


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Run directories named directly, or found (recursively) under the given folders."""
    dirs: list[Path] = []
    for p in map(Path, paths):
        if (p / "config.yaml").is_file():
            dirs.append(p)
        else:
            dirs += sorted(c.parent for c in p.rglob("config.yaml"))
    seen, runs = set(), []
    for d in dirs:
        if d.resolve() not in seen:
            seen.add(d.resolve())
            runs.append(load_run(d))
    if not runs:
        raise FileNotFoundError(f"no run directories (with config.yaml) in {list(map(str, paths))}")
    return runs


def group_runs(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Label -> runs; the dense reference group first, then in order of appearance."""
    groups: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: not r.is_dense_reference):
        groups.setdefault(r.label, []).append(r)
    return groups


# ---------------------------------------------------------------- plots

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


def plot_runs(runs: Sequence[Run], out_dir: str | Path) -> list[Path]:
    """Accuracy vs wall-clock, accuracy vs epoch, kept fraction over steps; one line per run."""
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
            for j, r in enumerate(members):
                if name == "kept_fraction.png":
                    xs = [s["step"] for s in r.steps]
                    fr = [s["kept"] / s["n"] if s.get("n") else math.nan for s in r.steps]
                    ys = _moving_average(fr, max(1, len(fr) // 50))
                else:
                    rows = [s for s in r.summary if s.get("eval_top1") is not None]
                    xs = [s["wall_clock_s" if name == "accuracy_vs_wallclock.png" else "epoch"] for s in rows]
                    ys = [s["eval_top1"] for s in rows]
                ax.plot(xs, ys, color=colors[label], alpha=0.85, marker="." if len(xs) < 40 else None,
                        label=label if j == 0 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize="small")
        fig.savefig(out_dir / name, dpi=110)
        written.append(out_dir / name)
    return written


# ---------------------------------------------------------------- table

def _mean_std(xs: list[float], fmt: str) -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.mean(xs), fmt)} ± {format(statistics.stdev(xs), fmt)}"


def _mean(xs: list[Optional[float]]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.mean(xs) if xs else math.nan


def compare_table(runs: Sequence[Run]) -> str:
    """Markdown table, one row per label: final top-1 mean ± std (sample std over seeds), etc.
    Runs on different datasets (or subsets) are never compared in one table: one table each."""
    by_data: dict[str, list[Run]] = {}
    for r in runs:
        c = r.config
        key = f"{c.get('dataset')} (train subset {c.get('train_subset')}, eval subset {c.get('eval_subset')})"
        by_data.setdefault(key, []).append(r)
    if len(by_data) > 1:
        return "\n".join(f"### {key}\n\n{_table(members)}" for key, members in by_data.items())
    return _table(runs)


def _table(runs: Sequence[Run]) -> str:
    groups = group_runs(runs)
    dense = next((g for g in groups.values() if all(r.is_dense_reference for r in g)), None)
    dense_wall = _mean([r.final.get("wall_clock_s") for r in dense]) if dense else math.nan
    lines = [
        "| run | seeds | final top-1 (%) | wall-clock (s) | × dense wall-clock | mean kept | backward rows | check violations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, members in groups.items():
        wall = _mean([r.final.get("wall_clock_s") for r in members])
        ratio = f"{wall / dense_wall:.2f}" if dense_wall and not math.isnan(dense_wall) and not math.isnan(wall) else "n/a"
        rows = _mean([r.final.get("backward_rows") for r in members])
        viol = sum(int(r.final.get("violations") or 0) for r in members)
        lines.append(
            f"| {label} | {len(members)} | {_mean_std([r.final.get('eval_top1') for r in members], '.2f')} "
            f"| {_mean_std([r.final.get('wall_clock_s') for r in members], '.1f')} | {ratio} "
            f"| {_mean_std([r.kept_frac for r in members], '.3f')} "
            f"| {'n/a' if math.isnan(rows) else f'{rows:.0f}'} | {viol} |"
        )
    return "\n".join(lines) + "\n"


def compare(paths: Iterable[str | Path], out_dir: str | Path) -> str:
    """Plots + ``compare.md`` for the runs under ``paths``; returns the Markdown table."""
    runs = find_runs(paths)
    out_dir = Path(out_dir)
    plot_runs(runs, out_dir)
    table = compare_table(runs)
    dirs = "\n".join(f"- `{r.path}` ({r.label}, seed {r.seed})" for r in runs)
    (out_dir / "compare.md").write_text(
        "# Comparison\n\n" + table + "\nWall-clock is training time only (compile warm-up and "
        "evaluation excluded); top-1 is the last evaluation of each run.\n\n"
        + "".join(f"![{p}]({p})\n" for p in PLOTS) + "\nRuns:\n" + dirs + "\n")
    return table
