"""The tuned-baseline experiment's tables (experiments/run_finetune_tuned.sh).

``python -m capskip_fx.train.tuned select DIR --group G --configs C1 C2 ... --seeds 100 101 102 --out FILE``
reads the validation top-1 of the runs ``DIR/G-C-sSEED`` (``--val-split`` runs), writes every configuration's
per-seed and mean scores to FILE and prints the configuration with the highest mean (the first listed on a
tie).  ``compare`` renders the comparison against the tuned dense baseline (see :func:`compare`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence


def _final_top1(run: Path) -> Optional[float]:
    f = run / "result.json"
    return float(json.loads(f.read_text())["final_top1"]) if f.is_file() else None


def select(root: str | Path, group: str, configs: Sequence[str], seeds: Sequence[str], out: str | Path,
           title: str = "", partial: bool = False) -> str:
    """The configuration of ``group`` with the highest mean validation top-1 over ``seeds``; the table to ``out``.
    Every run must have finished (a missing one stops, naming it): a choice over part of the grid is not one.
    ``partial``: list what has finished (missing runs as "running or to run"), choose nothing, return ""."""
    root = Path(root)
    scores: dict[str, list[Optional[float]]] = {}
    for c in configs:
        per = []
        for s in seeds:
            v = _final_top1(root / f"{group}-{c}-s{s}")
            if v is None and not partial:
                raise SystemExit(f"select {group}: {root / f'{group}-{c}-s{s}'} has no result.json")
            per.append(v)
        scores[c] = per
    complete = all(v is not None for per in scores.values() for v in per)
    means = {c: statistics.fmean(v) if all(x is not None for x in v) else None for c, v in scores.items()}
    best = max(configs, key=lambda c: (means[c], -list(configs).index(c))) if complete else ""
    lines = [f"# {title or group}: validation top-1 per configuration"
             + ("" if complete else " (PARTIAL: the grid has not finished, nothing is chosen yet)"), "",
             f"Runs `{root.name}/{group}-CONFIG-sSEED` (validation rows held out of the training split; seeds "
             f"{', '.join(seeds)}, not comparison seeds). Chosen: the highest mean (the first listed on a tie).", "",
             "| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | |",
             "|---|" + "---|" * len(seeds) + "---|---|"]
    cell = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    for c in configs:
        lines.append(f"| {c} | " + " | ".join(cell(v) for v in scores[c]) + f" | {cell(means[c])} | "
                     + ("**chosen**" if c == best else "") + " |")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")
    return best


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m capskip_fx.train.tuned", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select", help="the configuration with the best mean validation top-1")
    s.add_argument("root")
    s.add_argument("--group", required=True)
    s.add_argument("--configs", nargs="+", required=True)
    s.add_argument("--seeds", nargs="+", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--title", default="")
    s.add_argument("--partial", action="store_true", help="list the finished runs of an unfinished grid, choose nothing")
    c = sub.add_parser("compare", help="compare.md: every arm against the tuned matched dense")
    c.add_argument("runs")
    c.add_argument("--out", required=True)
    c.add_argument("--speed", default=None, help="the r file the script wrote (r.json)")
    a = p.parse_args(argv)
    if a.cmd == "select":
        print(select(a.root, a.group, a.configs, a.seeds, a.out, a.title, a.partial))
    else:
        from .tuned_report import compare

        compare(a.runs, a.out, a.speed)


if __name__ == "__main__":
    main(sys.argv[1:])
