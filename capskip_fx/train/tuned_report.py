"""compare.md of experiments/run_finetune_tuned.sh: every arm against the dense run tuned at its matched
budget, beside the re-annealed and truncated step-matched dense, and time to accuracy.

Runs are found by their directory names, ``ARM-sSEED`` (the script's names); an arm's Δ pairs each seed with
the same seed's run of the baseline arm (95 % t interval over the pairs).  Time to accuracy: the first
wall-clock (or compute: rows back-propagated plus rows forwarded) at which a run's test top-1 reaches the
target, interpolated between its per-epoch evaluations; the target is dense's (16 epochs) mean final top-1,
or 99 % of it.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Optional

from .report import Run, fmt_interval, load_run

# (arm, what the table calls it, the tuned dense it is compared with, its r's rule, the rows' normalisation)
ARMS = [
    ("dense", "dense, 16 epochs", None, None, "batch mean"),
    ("capskip", "capskip b = {B}", "dense-tuned-capskip", "capskip", "batch mean (1/N)"),
    ("dense-tuned-capskip", "dense tuned at capskip's budget", None, "capskip", "batch mean"),
    ("dense-tunedany-capskip", "dense tuned at capskip's budget in steps, any batch", "dense-tuned-capskip", "capskip",
     "batch mean"),
    ("dense-sm-capskip", "dense re-annealed at capskip's budget", "dense-tuned-capskip", "capskip", "batch mean"),
    ("dense-trunc-capskip", "dense truncated at capskip's budget", "dense-tuned-capskip", "capskip", "batch mean"),
    ("random-kept", "random at capskip's counts, rows weigh N/k", "dense-tuned-capskip", "capskip", "kept mean (N/k)"),
    ("random-batch", "random at capskip's counts, rows weigh 1/N", "dense-tuned-capskip", "capskip", "batch mean (1/N)"),
    ("sb", "SB at capskip's rate", "dense-tuned-capskip", "capskip", "kept mean"),
    ("kabena", "KABENA", "dense-tuned-kabena", "kabena", "its weights"),
    ("dense-tuned-kabena", "dense tuned at KABENA's budget", None, "kabena", "batch mean"),
    ("dense-tunedany-kabena", "dense tuned at KABENA's budget in steps, any batch", "dense-tuned-kabena", "kabena",
     "batch mean"),
    ("dense-sm-kabena", "dense re-annealed at KABENA's budget", "dense-tuned-kabena", "kabena", "batch mean"),
    ("dense-trunc-kabena", "dense truncated at KABENA's budget", "dense-tuned-kabena", "kabena", "batch mean"),
    ("infobatch", "InfoBatch", None, None, "InfoBatch's 1/(1-r)"),
]
CURVES = ["dense", "dense-tuned-capskip", "capskip", "kabena", "dense-tuned-kabena", "infobatch"]


def group(runs_dir: str | Path) -> dict[str, dict[int, Run]]:
    """{arm: {seed: finished run}} from ``runs_dir/ARM-sSEED`` directories with a result.json."""
    out: dict[str, dict[int, Run]] = {}
    for d in sorted(Path(runs_dir).iterdir()):
        m = re.fullmatch(r"(.+)-s(\d+)", d.name)
        if m and (d / "result.json").is_file():
            out.setdefault(m.group(1), {})[int(m.group(2))] = load_run(d, with_steps=False)
    return out


def top1(r: Run) -> float:
    return float(r.result["final_top1"])


def paired(a: dict[int, Run], b: dict[int, Run]) -> tuple[list[float], int]:
    seeds = sorted(set(a) & set(b))
    return [top1(a[s]) - top1(b[s]) for s in seeds], len(seeds)


def curve(r: Run, x: str) -> tuple[list[float], list[float]]:
    """(x, test top-1) per epoch; x is "wall" (training wall-clock, s) or "compute" (rows back-propagated plus
    rows forwarded, cumulative)."""
    xs, ys = [], []
    for row in r.summary:
        xs.append(float(row["wall_clock_s"]) if x == "wall" else float(row["backward_rows"]) + float(row["rows"]))
        ys.append(float(row["eval_top1"]))
    return xs, ys


def time_to(r: Run, target: float, x: str) -> Optional[float]:
    prev = None
    for t, acc in zip(*curve(r, x)):
        if acc >= target:
            if prev is None:
                return t
            t0, a0 = prev
            return t0 + (t - t0) * (target - a0) / (acc - a0)
        prev = (t, acc)
    return None


def _tta(members: dict[int, Run], dense: dict[int, Run], target: float, x: str) -> str:
    mine = [t for t in (time_to(r, target, x) for r in members.values()) if t is not None]
    ref = [t for t in (time_to(r, target, x) for r in dense.values()) if t is not None]
    if not mine or not ref:
        return f"never ({len(mine)}/{len(members)})"
    return f"{statistics.median(mine) / statistics.median(ref):.2f} ({len(mine)}/{len(members)})"


def _batch(r: Run) -> str:
    c = r.config
    return f"{c.get('schedule', 'cosine')}, lr {c.get('lr'):g}, batch {c.get('batch_size')}, {r.result.get('steps')} steps"


def back_frac(r: Run) -> float:
    """Rows the backward ran on / rows forwarded (``rows_run``; the kept rows for runs that predate it)."""
    f = r.final
    back = f.get("rows_run") if f.get("rows_run") not in (None, "") else f.get("backward_rows")
    return float(back) / float(f["rows"])


def compute(r: Run) -> float:
    """Rows forwarded plus rows the backward ran on, over the run."""
    return float(r.final["rows"]) * (1 + back_frac(r))


def compare(runs_dir: str | Path, out_dir: str | Path, r_json: Optional[str | Path] = None,
            wide: bool = False) -> str:
    """Write ``out_dir/compare.md`` and ``time_to_accuracy.png``; returns the page."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = group(runs_dir)
    rinfo = json.loads(Path(r_json).read_text()) if r_json and Path(r_json).is_file() else None
    budget = next((r.config.get("budget") for r in g.get("capskip", {}).values()), None)
    dense = g.get("dense", {})
    lines = ["# Fine-tuning against a tuned dense baseline at matched compute", "",
             "Test top-1 after each run, 95 % t intervals over seeds; Δ: paired by seed with the dense run tuned at "
             "the arm's matched budget (its learning rate, schedule and batch chosen on validation, `select.md`). "
             "Generated by `python -m capskip_fx.train.tuned compare` from the per-run files in `runs/`.", ""]
    if rinfo:
        lines += [f"r (`r.md`; {rinfo['blocks']} blocks, {rinfo['threads']} thread(s)): " + "; ".join(
            f"{k} {v['r']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}] at {100 * v['k']:.0f} % of rows"
            for k, v in rinfo["rules"].items()) + ".", ""]
    dense_compute = statistics.fmean(compute(r) for r in dense.values()) if dense else math.nan
    head = ["arm", "n", "top-1 (%)", "Δ vs tuned matched dense (pp)", "rows back-propagated", "compute (× dense)",
            "normalisation", "schedule, lr, batch, steps"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, name, base, _rule, norm in ARMS:
        members = g.get(arm)
        if not members:
            continue
        rs = list(members.values())
        delta = ""
        if base and g.get(base):
            d, n = paired(members, g[base])
            delta = f"{fmt_interval(d, signed=True)} (n = {n})" if n else ""
        rows = statistics.fmean(back_frac(r) for r in rs)
        comp = statistics.fmean(compute(r) for r in rs) / dense_compute
        lines.append(f"| {name.format(B=budget)} | {len(rs)} | {fmt_interval([top1(r) for r in rs])} | {delta} | "
                     f"{100 * rows:.1f} % | {comp:.2f} | {norm} | {_batch(rs[0])} |")
    lines += ["", "Re-annealed: a full warm-up and cosine over the matched steps at lr 1e-3, batch 128 (run_finetune_long's "
              "step-matched dense); truncated: the 16-epoch cosine stopped at the matched steps. Their Δ is against the "
              "tuned dense too (negative: the tuned grid found better). Budgets are in steps (round(r × the rule run's "
              "steps)): a dense run whose chosen batch is above 128 (the batch that spends the budget in 16 epochs) "
              "forwards and back-propagates more rows per step, so its compute column is above its r: the tuned dense is "
              "the best batch-128 configuration, and the best of any batch, when another, has its own row. Compute: rows "
              "forwarded plus rows the backward ran on, over dense's (16 epochs)."]
    # the rules against every dense baseline of their budget
    lines += ["", "## Each rule against each dense baseline of its budget (pp, paired by seed)", "",
              "| arm | vs tuned | vs re-annealed | vs truncated |", "|---|---|---|---|"]
    for arm, name, base, rule, _ in ARMS:
        if not base or arm.startswith("dense") or not g.get(arm):
            continue
        cells = []
        for b in (f"dense-tuned-{rule}", f"dense-sm-{rule}", f"dense-trunc-{rule}"):
            d, n = paired(g[arm], g.get(b, {}))
            cells.append(f"{fmt_interval(d, signed=True)} (n = {n})" if n else "")
        lines.append(f"| {name.format(B=budget)} | " + " | ".join(cells) + " |")
    # time to accuracy
    if dense:
        target = statistics.fmean(top1(r) for r in dense.values())
        lines += ["", f"## Time to accuracy (target: dense's mean final top-1, {target:.2f} %, and 99 % of it)", "",
                  "Median over the seeds that reach it, over dense's median; (seeds that reach it / seeds). Wall-clock is "
                  "the training loop's time on a shared machine (other work on the other core); compute is rows "
                  "back-propagated plus rows forwarded.", "",
                  "| arm | wall-clock to dense's top-1 | to 99 % | compute to dense's top-1 | to 99 % |",
                  "|---|---|---|---|---|"]
        for arm, name, *_ in ARMS:
            if g.get(arm):
                lines.append(f"| {name.format(B=budget)} | " + " | ".join(
                    _tta(g[arm], dense, t, x) for x in ("wall", "compute") for t in (target, 0.99 * target)) + " |")
        fig = plot_time_to_accuracy(g, out / "time_to_accuracy.png", target, budget)
        if fig:
            lines += ["", f"![test top-1 against wall-clock and compute]({fig.name})"]
    page = "\n".join(lines) + "\n"
    (out / "compare.md").write_text(page)
    print(f"written {out / 'compare.md'}")
    return page


def plot_time_to_accuracy(g: dict[str, dict[int, Run]], path: Path, target: float, budget) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {a: n.format(B=budget) for a, n, *_ in ARMS}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = False
    for arm in CURVES:
        members = list(g.get(arm, {}).values())
        if not members:
            continue
        for ax, x in zip(axes, ("wall", "compute")):
            curves = [curve(r, x) for r in members]
            n = min(len(c[0]) for c in curves)
            xs = [statistics.fmean(c[0][i] for c in curves) for i in range(n)]
            ys = [statistics.fmean(c[1][i] for c in curves) for i in range(n)]
            ax.plot(xs, ys, marker=".", label=f"{names[arm]} (n = {len(members)})")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, xl in zip(axes, ("training wall-clock (s), mean over seeds",
                             "compute: rows back-propagated + rows forwarded")):
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.axhline(0.99 * target, color="grey", lw=0.8, ls=":")
        ax.set_xlabel(xl)
        ax.set_ylabel("test top-1 (%)")
        ax.set_ylim(max(0.0, target - 15), min(100.0, target + 3))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("Time to accuracy (dashed: dense's mean final top-1; dotted: 99 % of it)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
