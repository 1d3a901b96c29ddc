"""``capskip-train --help`` answers without loading what a run needs: the parser imports neither torch
nor timm (they load after the flags are read), and the config's static name lists match the registries."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what only a run or a comparison needs: the harness's extras and its heavy modules
RUN_ONLY = ("timm", "torchvision", "matplotlib", "scipy", "sklearn", "capskip_fx.train.loop",
            "capskip_fx.train.data", "capskip_fx.train.datasets", "capskip_fx.train.model",
            "capskip_fx.train.checks", "capskip_fx.train.checkpoint", "capskip_fx.train.report",
            "capskip_fx.train.plots")

# the harness on its own: capskip_fx/__init__.py (the library, which imports torch) is set aside by
# registering a bare package in its place, so only the harness's own imports are measured
HARNESS_ALONE = textwrap.dedent("""
    import contextlib, io, sys, types
    pkg = types.ModuleType("capskip_fx")
    pkg.__path__ = [sys.argv[1]]
    sys.modules["capskip_fx"] = pkg
    from capskip_fx.train import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.run(["--help"])
    assert "--dataset" in out.getvalue() and "stale_sb" in out.getvalue(), out.getvalue()
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "timm", "torchvision", "matplotlib", "numpy"})
    print("heavy:", ",".join(heavy))
""")


def _imported(stderr: str) -> set[str]:
    """Module names from ``python -X importtime``'s report."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.fixture(scope="module")
def help_run():
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "capskip_fx.train", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    return p, _imported(p.stderr)


@pytest.mark.subprocess
def test_harness_parser_imports_no_torch():
    p = subprocess.run([sys.executable, "-c", HARNESS_ALONE, str(ROOT / "capskip_fx")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"--help failed with the library set aside: {p.stderr[-3000:]}"
    assert "heavy: \n" in p.stdout, f"the parser imported {p.stdout.split('heavy:')[-1].strip()} for --help"


@pytest.mark.subprocess
def test_help_loads_nothing_a_run_needs(help_run):
    p, modules = help_run
    assert p.returncode == 0, f"capskip-train --help failed: {p.stderr[-3000:]}"
    assert "--dataset" in p.stdout, f"--help does not list the train flags: {p.stdout[:2000]}"
    loaded = [r for r in RUN_ONLY if any(m == r or m.startswith(r + ".") for m in modules)]
    assert not loaded, f"--help imported what only a run needs: {loaded}"


@pytest.mark.subprocess
def test_help_imports_no_torch(help_run):
    p, modules = help_run
    assert p.returncode == 0, f"capskip-train --help failed: {p.stderr[-3000:]}"
    assert "torch" not in modules, "python -m capskip_fx.train --help imported torch"


def test_static_names_match_the_registries():
    from capskip_fx.rules import RULES
    from capskip_fx.train import config, datasets

    assert set(config.RULE_NAMES) == set(RULES) | {"vcas"} | set(config.DATA_RULES), \
        f"train/config.py's RULE_NAMES {config.RULE_NAMES} differ from capskip_fx.RULES {sorted(RULES)} + vcas"
    assert set(config.DATA_RULES.values()) <= set(RULES), (
        f"expected set(config.DATA_RULES.values()) <= set(RULES), got {set(config.DATA_RULES.values())!r} vs {set(RULES)!r}")  # the model half of each data-side rule is a rule
    assert set(datasets.DEFAULT_IMG_SIZE) | {"pytext"} == set(config.DATASETS), \
        f"train/config.py's DATASETS {config.DATASETS} differ from the loaders' {sorted(datasets.DEFAULT_IMG_SIZE)}"


def _select_runs(root: Path, top1: dict) -> None:
    """Fake validation runs: ``top1[name] = [per-seed top-1]`` for seeds 100, 101."""
    import json

    for name, accs in top1.items():
        for seed, acc in zip((100, 101), accs):
            d = root / f"{name}-s{seed}"
            d.mkdir(parents=True)
            (d / "result.json").write_text(json.dumps({"final_top1": acc, "kept_frac": 0.5}))


@pytest.mark.parametrize("capskip,chosen", [
    ({"0.3": [80.0, 80.0], "0.5": [79.6, 79.6], "0.7": [79.0, 79.2]}, 0.5),  # 0.5 is 0.4 below: the largest within
    ({"0.3": [78.0, 79.0], "0.5": [70.0, 70.0], "0.7": [60.0, 61.0]}, 0.3),  # none within 0.5: the smallest
    ({"0.3": [81.0, 81.0], "0.5": [80.5, 80.5], "0.7": [79.5, 79.5]}, 0.7),  # the boundary counts as within
])
def test_choose_budget_takes_the_largest_b_within_tolerance(tmp_path, capskip, chosen):
    from capskip_fx.train.cli import run

    _select_runs(tmp_path, {"dense": [80.0, 80.0], **{f"capskip-b{b}": a for b, a in capskip.items()}})
    out = tmp_path / "select.md"
    got = run(["choose-budget", str(tmp_path), "--seeds", "100", "101", "--budgets", *capskip, "--out", str(out)])
    assert got == chosen, f"chose b={got}, expected {chosen} for validation means {capskip}"
    assert f"b = {chosen:g}" in out.read_text(), f"the page names another budget:\n{out.read_text()}"


def test_choose_budget_names_a_missing_run(tmp_path):
    from capskip_fx.train.cli import run

    _select_runs(tmp_path, {"dense": [80.0, 80.0], "capskip-b0.3": [80.0, 80.0]})
    with pytest.raises(FileNotFoundError, match=r"capskip-b0\.5-s100/result\.json is missing"):
        run(["choose-budget", str(tmp_path), "--seeds", "100", "101", "--budgets", "0.3", "0.5",
             "--out", str(tmp_path / "select.md")])
