"""timm zoo sweep -> Markdown table (benchmarks/results/zoo.md).

Each model at a tiny size, float64, backend="aot_eager", one step with a forced keep set (2 of 6
rows), gradients against the float64 dense-masked eager reference; the same sweep as tests/test_zoo.py.

    python benchmarks/zoo_report.py            # all models
    python benchmarks/zoo_report.py swin_tiny  # some
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_zoo import KEEP, N, ZOO, run_zoo_model  # noqa: E402


def main(names: list[str]) -> str:
    import timm

    torch.set_num_threads(2)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=64):
            row = run_zoo_model(name)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{name}: {row['backward']}, err {row['max_rel_err']:.1e}, {row['seconds']:.1f}s", flush=True)
    lines = [
        "# timm zoo: selected-row backward vs float64 dense-masked eager",
        "",
        f"torch {torch.__version__}, timm {timm.__version__}, {platform.machine()}, backend aot_eager, float64, "
        f"N = {N}, forced keep rows {list(KEEP)}.  max rel grad error: max over parameters of "
        "||g - g_ref|| / ||g_ref|| (floored at 1e-9 of the total gradient norm for parameters whose true "
        "gradient is exactly zero).  `python benchmarks/zoo_report.py` regenerates this file.",
        "",
        "| model | config | params | graphs | backward mode | reason | max rel grad error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reason = (r["reason"] or "").split(" (at:")[0]
        lines.append(f"| {r['model']} | {r['config']} | {r['params']:,} | {r['graphs']} | {r['backward']} | "
                     f"{reason} | {r['max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    names = sys.argv[1:] or list(ZOO)
    md = main(names)
    out = ROOT / "benchmarks" / "results" / "zoo.md"
    if names == list(ZOO):
        out.write_text(md)
        print(f"wrote {out}")
    print(md)
