"""Run directories written by :mod:`capskip_fx.train`, their statistics and the comparison tables.

A run directory holds ``config.yaml`` (the resolved config), ``summary.csv`` (one row per
epoch) and ``steps.jsonl`` (one line per step).  Runs are grouped by their label (rule +
budget/options, see :func:`run_label`); seeds of one configuration share a label.

The table gives 95% t intervals over seeds, the paired (same-seed) difference to the time-matched
dense runs, and the wall-clock to reach dense's final top-1 (and 99% of it).  It marks what the
numbers cannot carry (:func:`table_warnings`): a time-matched run that finished before its budget
(not time-matched), and a wall-clock ratio measured while the machine's load changed (the per-step
data-loading time, which only the rules of ``DATA_PATH_RULES`` change, drifting from dense's by more than
``LOAD_DRIFT``).  The figures are
:mod:`.plots`; ``capskip-train compare`` (:func:`capskip_fx.train.cli.compare`) writes both.
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

import numpy as np
import yaml

from .config import DATA_RULES


def rule_takes_budget(rule: str) -> bool:
    """Whether ``rule`` reads ``budget`` (so it belongs in the label)."""
    try:
        from capskip_fx.rules import RULES
    except ImportError:  # pragma: no cover - rules package missing
        RULES = {}
    cls = RULES.get(rule.split("+")[0])  # capskip+infobatch: capskip's budget
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
    if "infobatch" in str(rule):
        parts.append(f"r={float(cfg.get('infobatch_ratio', 0.5)):g} delta={float(cfg.get('infobatch_delta', 0.875)):g}")
    parts += [f"{k}={v}" for k, v in sorted((cfg.get("rule_options") or {}).items())]
    vcas = cfg.get("vcas_options")
    if vcas is not None and rule != "vcas":
        parts.append("+vcas")
    if vcas:
        parts += [f"vcas.{k}={v}" for k, v in sorted(vcas.items())]
    if cfg.get("time_budget"):
        parts.append("time-matched")
    if cfg.get("steps_of"):
        parts.append(f"step-matched ×{float(cfg.get('ratio') or math.nan):g} to {_label_of(cfg['steps_of'])}")
    elif cfg.get("max_steps"):
        parts.append(f"{int(cfg['max_steps'])} steps")
    return " ".join(parts)


def _label_of(run_dir: str) -> str:
    """The label of the run in ``run_dir`` (a step-matched run names the rule run it matches)."""
    try:
        return run_label(yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        return Path(run_dir).name


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


#: relative drift of the median per-step data-loading time from dense's (same seed) above which a
#: wall-clock ratio is marked as measured under another machine load
LOAD_DRIFT = 0.2
#: rules whose selection runs in the data loader (Stale-SB's batch filter, InfoBatch's sampler): their data time
#: per step is theirs, so it tells nothing of the machine's load
DATA_PATH_RULES = ("stale_sb", *DATA_RULES)
MISSED = "†"  # time budget not reached
LOADED = "‡"  # machine load changed between the runs
UNFINISHED = "§"  # a run with no result.json: stopped (killed, crashed) before its end


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: list[dict[str, Any]]
    steps: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)  # result.json, once the run finished

    @property
    def label(self) -> str:
        return run_label(self.config)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def is_dense_reference(self) -> bool:
        c = self.config
        return c.get("rule") == "dense" and not (c.get("time_budget") or c.get("max_steps") or c.get("steps_of"))

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

    @property
    def forward_frac(self) -> float:
        """Forwarded rows / rows drawn from the data (below 1 only where a data-side filter drops rows)."""
        f = self.final
        rows = f.get("rows")
        seen = f.get("rows_seen") or rows
        return rows / seen if rows is not None and seen else math.nan

    @property
    def budget_missed(self) -> bool:
        """A time-matched run (``time_budget`` set) that ended before reaching it: not time-matched."""
        if not self.config.get("time_budget"):
            return False
        hit = self.result.get("time_budget_hit", self.final.get("time_budget_hit"))
        return hit is not None and not bool(hit)

    @property
    def data_s(self) -> float:
        """Median data-loading time per step (s) over the steady steps; NaN without step logs."""
        xs = [s["data_time_s"] for s in self.steps
              if s.get("data_time_s") is not None and not s.get("compile_step")]
        return statistics.median(xs) if xs else math.nan


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
    result = {}
    if (path / "result.json").is_file():
        try:
            result = json.loads((path / "result.json").read_text())
        except ValueError:  # a run killed while writing it
            result = {}
    return Run(path, config, summary, steps, result)


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


def eval_curve(r: Run, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(x values, eval top-1) of the summary rows that have an evaluation."""
    rows = [s for s in r.summary if s.get("eval_top1") is not None]
    return np.array([float(s[x]) for s in rows]), np.array([float(s["eval_top1"]) for s in rows])


# ---------------------------------------------------------------- statistics

def band(ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and 95% t half-width over axis 0 (rows = seeds); half-width 0 for one seed."""
    from scipy import stats

    ys = np.asarray(ys, dtype=float)
    mean = np.nanmean(ys, axis=0)
    n = np.sum(~np.isnan(ys), axis=0)
    if ys.shape[0] < 2:
        return mean, np.zeros_like(mean)
    sd = np.nanstd(ys, axis=0, ddof=1)
    half = stats.t.ppf(0.975, np.maximum(n - 1, 1)) * sd / np.sqrt(np.maximum(n, 1))
    return mean, np.where(n >= 2, half, 0.0)


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


def t_interval(xs: Sequence[Optional[float]], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the ``level`` Student-t interval); half-width NaN for fewer than 2 values."""
    from scipy import stats

    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, float(stats.t.ppf(0.5 + level / 2, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))


def fmt_interval(xs: Sequence[Optional[float]], fmt: str = ".2f", signed: bool = False) -> str:
    """``mean [lo, hi]`` (95% t), or the value alone for one seed."""
    m, h = t_interval(xs)
    if math.isnan(m):
        return "n/a"
    f = ("+" if signed else "") + fmt
    return format(m, f) if math.isnan(h) else f"{format(m, f)} [{format(m - h, f)}, {format(m + h, f)}]"


def _time_to(r: Run, target: float) -> Optional[float]:
    """First wall-clock at which the run's eval curve reaches ``target``, linearly interpolated between
    evaluations (the first evaluation's time if it is already there); None if never."""
    prev = None
    for t, acc in zip(*eval_curve(r, "wall_clock_s")):
        if acc >= target:
            if prev is None:
                return float(t)
            (t0, a0) = prev
            return float(t0 + (t - t0) * (target - a0) / (acc - a0))
        prev = (t, acc)
    return None


def _ratio_to(members: Sequence[Run], dense: Sequence[Run], target: float) -> str:
    """Median time to ``target`` over the group's seeds / dense's, and how many seeds reached it."""
    mine = [t for t in (_time_to(r, target) for r in members) if t is not None]
    ref = [t for t in (_time_to(r, target) for r in dense) if t is not None]
    if not mine or not ref:
        return f"never ({len(mine)}/{len(members)})"
    return f"{statistics.median(mine) / statistics.median(ref):.2f} ({len(mine)}/{len(members)})"


# ---------------------------------------------------------------- tables

def _dense_ref(dense: Optional[Sequence[Run]], seed: Any) -> Optional[Run]:
    return next((d for d in dense or () if d.seed == seed), None)


def load_drift(r: Run, dense: Optional[Sequence[Run]]) -> float:
    """Relative change of ``r``'s median per-step data time from its dense reference's (same seed, else
    the dense runs' median); NaN when either has no step log, or when ``r``'s rule works in the data loader
    (DATA_PATH_RULES: its data time is its own, not the machine's load)."""
    if r.config.get("rule") in DATA_PATH_RULES:
        return math.nan
    ref = _dense_ref(dense, r.seed)
    base = ref.data_s if ref is not None else _median([d.data_s for d in dense or ()])
    mine = r.data_s
    if math.isnan(mine) or math.isnan(base) or base <= 0:
        return math.nan
    return mine / base - 1


def _median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def table_warnings(runs: Sequence[Run], drift: float = LOAD_DRIFT) -> list[str]:
    """What the table marks, one sentence each: time budgets not reached (†), wall-clock ratios measured
    under another machine load (‡), runs that did not finish (§)."""
    groups = group_runs(runs)
    dense = next((g for g in groups.values() if all(r.is_dense_reference for r in g)), None)
    out = []
    for label, members in groups.items():
        missed = [r for r in members if r.budget_missed]
        if missed:
            budget = float(missed[0].config["time_budget"])
            secs = [float(r.final.get("wall_clock_s") or math.nan) for r in missed]
            digits = 0 if all(round(w) < round(budget) for w in secs) else 2  # never "25 s < 25 s"
            walls = ", ".join(f"{w:.{digits}f}" for w in secs)
            out.append(f"{MISSED} {label}: seed(s) {', '.join(str(r.seed) for r in missed)} finished all epochs "
                       f"before the time budget ({walls} s < {budget:.{digits}f} s): not "
                       f"time-matched, so a Δ against it compares with a longer run than the rule's")
        stopped = [r for r in members if not r.result]
        if stopped:
            done = ", ".join(f"seed {r.seed}: {len(r.summary)} of {r.config.get('epochs')} epochs" for r in stopped)
            out.append(f"{UNFINISHED} {label}: unfinished, no result.json ({done}): its numbers are its last "
                       f"epoch's; resume it (--resume <run>/checkpoint.pt) or leave it out")
        if dense is None or members is dense:
            continue
        loaded = [(r, load_drift(r, dense)) for r in members]
        loaded = [(r, d) for r, d in loaded if not math.isnan(d) and abs(d) > drift]
        if loaded:
            out.append(f"{LOADED} {label}: data loading per step (this rule does not change it) differs from dense's by "
                       + ", ".join(f"{d:+.0%} (seed {r.seed}: {1e3 * r.data_s:.1f} vs "
                                   f"{1e3 * (_dense_ref(dense, r.seed) or r).data_s:.1f} ms)" for r, d in loaded)
                       + f", above {drift:.0%}: the machine's load changed between the runs and the wall-clock "
                         f"ratio reflects it; measure speed with benchmarks/interleaved.py instead")
    return out


def compare_table(runs: Sequence[Run], drift: float = LOAD_DRIFT, speed: Sequence[dict] = (), wide: bool = False) -> str:
    """Markdown table, one row per label: final top-1 mean ± std (sample std over seeds), etc.
    Runs on different datasets (or subsets) are never compared in one table: one table each.
    Marks (†, ‡) and their notes below each table: :func:`table_warnings`.  ``speed``: the rows of
    benchmarks/interleaved.py's JSON, for the step-time ratios' intervals.  By default at most
    :data:`DEFAULT_COLUMNS` (8), leaving out those that read n/a on every row; ``wide``: every column."""
    by_data: dict[str, list[Run]] = {}
    for r in runs:
        c = r.config
        key = f"{c.get('dataset')} (train subset {c.get('train_subset')}, eval subset {c.get('eval_subset')})"
        by_data.setdefault(key, []).append(r)
    if len(by_data) > 1:
        return "\n".join(f"### {key}\n\n{_table(members, drift, speed, wide)}" for key, members in by_data.items())
    return _table(runs, drift, speed, wide)


#: every column of the comparison table, in order
COLUMNS = ("run", "seeds", "final top-1 (%) [95% CI]", "Δ vs own step-matched dense (pp, paired) [95% CI]",
           "step-time r (interleaved) [95% CI]", "Δ vs time-matched dense (pp, paired) [95% CI]", "wall-clock (s)",
           "× dense wall-clock (paired) [95% CI]", "time to dense's final top-1 (× dense)", "to 99% of it", "mean kept",
           "forwarded", "backward rows", "check violations", "data ms/step")
#: the columns shown without --wide (those reading n/a on every row left out too)
DEFAULT_COLUMNS = ("run", "seeds", "final top-1 (%) [95% CI]", "Δ vs own step-matched dense (pp, paired) [95% CI]",
                   "Δ vs time-matched dense (pp, paired) [95% CI]", "× dense wall-clock (paired) [95% CI]",
                   "mean kept", "backward rows")


def rows_run(r: Run) -> float:
    """Rows the backward ran on (``stats().rows`` summed: kept plus padding, or every row of a step that ran
    them all); from the summary, else the step log; NaN when neither has it."""
    v = r.final.get("rows_run")
    if v not in (None, ""):
        return float(v)
    if r.steps and all("rows_run" in s for s in r.steps):
        return float(sum(s["rows_run"] if s["rows_run"] is not None else s.get("n", 0) for s in r.steps))
    return math.nan


def _table(runs: Sequence[Run], drift: float = LOAD_DRIFT, speed: Sequence[dict] = (), wide: bool = False) -> str:
    groups = group_runs(runs)
    dense = next((g for g in groups.values() if all(r.is_dense_reference for r in g)), None)
    matched = next((g for g in groups.values()
                    if all(r.config.get("rule") == "dense" and r.config.get("time_budget") for r in g)), None)
    dense_wall = _mean([r.final.get("wall_clock_s") for r in dense]) if dense else math.nan
    target = _mean([r.final.get("eval_top1") for r in dense]) if dense else math.nan
    by_seed = lambda g: {r.seed: r.final.get("eval_top1") for r in g}  # noqa: E731
    matched_missed = matched is not None and any(r.budget_missed for r in matched)
    table: list[list[str]] = []
    for label, members in groups.items():
        wall = _mean([r.final.get("wall_clock_s") for r in members])
        ratio = f"{wall / dense_wall:.2f}" if dense_wall and not math.isnan(dense_wall) and not math.isnan(wall) else "n/a"
        paired = [(r.final.get("wall_clock_s"), _dense_ref(dense, r.seed)) for r in members]
        paired = [w / d.final["wall_clock_s"] for w, d in paired if w and d is not None and d.final.get("wall_clock_s")]
        if paired:  # per-seed ratios to the same seed's dense, with their interval
            ratio = fmt_interval(paired, ".2f")
        drifts = [load_drift(r, dense) for r in members] if dense and members is not dense else []
        if any(not math.isnan(d) and abs(d) > drift for d in drifts):
            ratio += f" {LOADED}"
        missed = any(r.budget_missed for r in members)
        unfinished = any(not r.result for r in members)
        rows = _mean([rows_run(r) for r in members])
        viol = sum(int(r.final.get("violations") or 0) for r in members)
        diff = "n/a"
        if matched is not None and members is not matched:
            a, b = by_seed(members), by_seed(matched)
            diffs = [a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None]
            diff = fmt_interval(diffs, ".2f", signed=True) if diffs else "n/a"
            if diffs and matched_missed:
                diff += f" {MISSED}"
        reach = (_ratio_to(members, dense, target), _ratio_to(members, dense, 0.99 * target)) \
            if dense and not math.isnan(target) else ("n/a", "n/a")
        table.append([
            f"{label}{f' {MISSED}' if missed else ''}{f' {UNFINISHED}' if unfinished else ''}", str(len(members)),
            fmt_interval([r.final.get("eval_top1") for r in members]), _step_matched_diff(members, runs),
            _step_ratio(members, runs, speed), diff, _mean_std([r.final.get("wall_clock_s") for r in members], ".1f"),
            ratio, reach[0], reach[1], _mean_std([r.kept_frac for r in members], ".3f"),
            _mean_std([r.forward_frac for r in members], ".3f"), "n/a" if math.isnan(rows) else f"{rows:.0f}",
            str(viol), _mean_std([1e3 * r.data_s for r in members], ".1f")])
    cols = list(range(len(COLUMNS)))
    if not wide:
        cols = [i for i in cols if COLUMNS[i] in DEFAULT_COLUMNS and (i < 3 or any(row[i] != "n/a" for row in table))]
    lines = ["| " + " | ".join(COLUMNS[i] for i in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row[i] for i in cols) + " |" for row in table]
    notes = table_warnings(runs, drift)
    if not wide and any(int(r.final.get("violations") or 0) for r in runs):
        notes.append("check violations: " + ", ".join(f"{label} {n}" for label, members in groups.items()
                                                     if (n := sum(int(r.final.get('violations') or 0) for r in members)))
                     + " (the exact check found the rule's bound exceeded; --wide shows the column)")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def step_matched_pairs(members: Sequence[Run], runs: Sequence[Run]) -> list[tuple[Run, Run]]:
    """(rule run, its step-matched dense run) for each member some run names with ``steps_of``, same seed.
    A ``steps_of`` path that names no run here (the runs were moved, e.g. into a results folder) matches
    the run folder of the same name."""
    by_path, by_name = {}, {}
    here = {r.path.resolve() for r in runs}
    for r in runs:
        if r.config.get("steps_of"):
            target = Path(r.config["steps_of"])
            if target.resolve() in here:
                by_path.setdefault(target.resolve(), []).append(r)
            else:
                by_name.setdefault(target.name, []).append(r)
    pairs = []
    for m in members:
        for d in by_path.get(m.path.resolve(), []) + by_name.get(m.path.name, []):
            if d.seed == m.seed:
                pairs.append((m, d))
    return pairs


def _step_matched_diff(members: Sequence[Run], runs: Sequence[Run]) -> str:
    diffs = [m.final.get("eval_top1") - d.final.get("eval_top1") for m, d in step_matched_pairs(members, runs)
             if m.final.get("eval_top1") is not None and d.final.get("eval_top1") is not None]
    return f"{fmt_interval(diffs, '.2f', signed=True)} (n={len(diffs)})" if diffs else "n/a"


def _step_ratio(members: Sequence[Run], runs: Sequence[Run], speed: Sequence[dict] = ()) -> str:
    """The step-time ratio r the rule's step-matched dense runs were made with (``--ratio``), with its 95%
    interval when ``speed`` (benchmarks/interleaved.py's rows) has the arm it was read from."""
    ratios = sorted({float(d.config["ratio"]) for _, d in step_matched_pairs(members, runs) if d.config.get("ratio")})
    cells = []
    for r in ratios:
        arms = [a for a in speed if round(a.get("vs_dense", math.nan), 3) == r and "vs_dense_lo" in a]
        if len(arms) > 1:  # several arms read the same r: the one timing this rule's share of rows
            arms = [a for a in arms if a["arm"] == f"forced:keep={_rows_share(members):.3f}"]
        cells.append(f"{r:g}" if len(arms) != 1 else f"{r:g} [{arms[0]['vs_dense_lo']:.3f}, {arms[0]['vs_dense_hi']:.3f}]")
    return ", ".join(cells) if cells else "n/a"


def _rows_share(members: Sequence[Run]) -> float:
    """Rows back-propagated / rows forwarded over the runs (their last summary rows): the share of rows the
    interleaved benchmark's ``forced:keep=`` arm for them times."""
    back = sum(r.final.get("backward_rows") or 0 for r in members)
    rows = sum(r.final.get("rows") or 0 for r in members)
    return back / rows if rows else math.nan


def compare_page(runs: Sequence[Run], table: str, figures: Sequence[str]) -> str:
    """The text of ``compare.md``: the table, how to read it, the figures and the run directories."""
    dirs = "\n".join(f"- `{r.path}` ({r.label}, seed {r.seed})" for r in runs)
    return ("# Comparison\n\n" + table + "\nWall-clock is the training loop's time: data loading and "
            "augmentation on the training thread included; compile warm-up, distortion checks and "
            "evaluation excluded. It is measured on whatever else the machine was doing: a row marked "
            f"{LOADED} ran while the load differed from dense's (its median data-loading time per step, which "
            f"only Stale-SB's and InfoBatch's data-side selection change, drifted by more than {LOAD_DRIFT:.0%}); a row marked {MISSED} is a time-matched "
            "run that finished before its budget. Δ vs own step-matched dense pairs each seed of a rule with the "
            "dense run of the same seed made with `--steps-of` that rule run's directory (round(r × its steps) "
            "steps, its own warm-up and cosine; r its step-time ratio from benchmarks/interleaved.py): free of "
            "machine load. Top-1 is the last evaluation of each run. Intervals: 95% Student-t over "
            "seeds; Δ pairs each seed with the time-matched dense run of the same seed; time to an accuracy is "
            "read off each run's per-epoch evaluations (linear between them), median over seeds / dense's "
            "median, with the number of seeds that reached it. Wall-clock ± is the sample std; × dense "
            "wall-clock is each seed's ratio to the same seed's dense run, mean [95% t interval]. Forwarded: rows "
            "forwarded / rows drawn from the data (below 1 only under Stale-SB's data-side filter or InfoBatch's sampler); mean kept is "
            "of the forwarded rows. Backward rows: the rows the backward ran on, summed over the run (`stats().rows`: "
            "the kept rows plus padding, or every row of a step whose backward ran on all of them), mean over seeds. "
            "Columns that read n/a on every row are left out; `capskip-train compare --wide` shows every column "
            "(step-time r, wall-clock, time to accuracy, forwarded, check violations, data ms/step).\n\n"
            + "".join(f"![{p}]({p})\n" for p in figures) + "\nRuns:\n" + dirs + "\n")


def choose_budget(select_dir: str | Path, seeds: Sequence[str], budgets: Sequence[str],
                  tol: float) -> tuple[float, str]:
    """``capskip-train choose-budget``: the largest b whose mean validation top-1 over ``seeds`` is within
    ``tol`` points of dense's mean, else the smallest b; and the Markdown page that shows why.  Reads
    ``SELECT_DIR/dense-s{seed}`` and ``SELECT_DIR/capskip-b{b}-s{seed}`` (runs made with --val-split)."""
    root = Path(select_dir)

    def result(name: str) -> dict:
        path = root / name / "result.json"
        if not path.is_file():
            raise FileNotFoundError(f"choose-budget: {path} is missing (has that run finished?)")
        return json.loads(path.read_text())

    dense = [result(f"dense-s{s}")["final_top1"] for s in seeds]
    rows = ["| run | validation top-1 per seed | mean | kept (mean) | within tol |", "|---|---|---|---|---|",
            f"| dense | {', '.join(f'{a:.2f}' for a in dense)} | {statistics.fmean(dense):.2f} | 1.00 | |"]
    ok = []
    for b in budgets:
        res = [result(f"capskip-b{b}-s{s}") for s in seeds]
        acc = [r["final_top1"] for r in res]
        good = statistics.fmean(acc) >= statistics.fmean(dense) - tol
        ok += [float(b)] * good
        rows.append(f"| capskip b={b} | {', '.join(f'{a:.2f}' for a in acc)} | {statistics.fmean(acc):.2f} | "
                    f"{statistics.fmean(r['kept_frac'] for r in res):.2f} | {'yes' if good else 'no'} |")
    chosen = max(ok) if ok else min(map(float, budgets))
    page = [f"# Budget chosen on validation: b = {chosen:g}", "",
            f"Largest b whose mean validation top-1 over the selection seeds ({', '.join(seeds)}; not comparison "
            f"seeds) is within {tol:g} points of dense's mean, else the smallest. Validation: rows held out of "
            f"the training split (--val-split); the test set is not looked at.", ""] + rows
    return chosen, "\n".join(page) + "\n"
