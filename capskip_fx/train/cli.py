"""The command line: ``capskip-train [train] FLAGS``, ``capskip-train compare RUNS`` and
``capskip-train choose-budget SELECT_DIR`` (capskip's b from validation runs).

Parsing needs neither torch nor timm: what a command runs is imported after its flags are read, so
``--help`` and flag errors answer at once."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from .config import AMP, BACKENDS, DATA_RULES, DATASETS, TASKS, FIELDS, RULE_NAMES, SCHEDULES, TrainConfig, default, normalise_keys, read_yaml

DESCRIPTION = "Training harness: fine-tune a timm model with a selective-backprop rule, log everything."


def _optional(tp):
    def conv(s: str):
        return None if s.lower() in ("none", "null", "") else tp(s)

    conv.__name__ = tp.__name__  # argparse names the type in its error messages
    return conv


def _key_value(s: str):
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    return k.replace("-", "_"), yaml.safe_load(v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capskip-train", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", metavar="{train,compare,choose-budget}")
    t = sub.add_parser("train", help="train one run (the default sub-command)",
                       argument_default=argparse.SUPPRESS)  # only flags given on the command line override

    def add(name, type=None, help="", **kw):
        dest = name.lstrip("-").replace("-", "_")
        if "action" not in kw:
            kw["type"] = type
        g.add_argument(name, dest=dest, help=f"{help} (default: {default(dest)})".strip(), **kw)

    g = t
    t.add_argument("--config", dest="config_file", help="YAML file of config keys; flags override it")
    g = t.add_argument_group("data")
    add("--task", str, "classify images, or lm: a tiny causal LM (--model gpt2 | llama) on pytext, the Python "
                       "standard library's source as byte tokens; a row is a sequence", choices=TASKS)
    add("--dataset", str, choices=DATASETS)
    add("--seq-len", int, "--task lm: tokens per row")
    add("--data-dir", _optional(str), "folder with the dataset files")
    add("--train-subset", _optional(int), "use a fixed random subset of this many training images")
    add("--eval-subset", _optional(int), "use a fixed random subset of this many eval images")
    add("--val-split", _optional(int), "evaluate on this many images held out of the training split (the same "
                                       "for every seed) instead of the test set: for choosing hyper-parameters")
    add("--augment", action=argparse.BooleanOptionalAction, help="random crop (+ flip) when training")
    add("--workers", int, "DataLoader workers")
    g = t.add_argument_group("model")
    add("--model", str, "any timm model name")
    add("--img-size", _optional(int), "input size; None: the dataset's default")
    add("--patch-size", _optional(int), "ViT patch size; None: img_size // 4")
    add("--depth", _optional(int))
    add("--embed-dim", _optional(int))
    add("--num-heads", _optional(int))
    add("--in-chans", _optional(int), "model input channels; None: from the data (1 -> 3 repeats grey)")
    g.add_argument("--model-kw", dest="model_kw", type=_key_value, action="append",
                   help="extra timm.create_model kwarg KEY=VALUE (YAML value), repeatable")
    g = t.add_argument_group("checkpoints")
    add("--resume", _optional(str), "a run's checkpoint.pt: continue that run bit-exactly (its config is the "
                                    "base; flags override, e.g. --epochs to train longer)")
    add("--initial-checkpoint", _optional(str), "start from these model weights only: a checkpoint.pt, a "
                                                "state_dict .pt/.pth or a .safetensors file")
    add("--reset-head", action=argparse.BooleanOptionalAction, help="with --initial-checkpoint: keep the "
                                                                   "fresh classifier head (fine-tuning on a new task)")
    add("--pretrained", action=argparse.BooleanOptionalAction, help="start from timm's pretrained weights "
                                                                   "(downloads; offline use --initial-checkpoint)")
    g = t.add_argument_group("selection")
    add("--rule", str, "selection rule ('vcas': all rows, VCAS samples inside the backward; 'infobatch': "
                       "InfoBatch prunes samples at the sampler; 'capskip+infobatch': both)", choices=RULE_NAMES)
    add("--budget", float, "relative last-layer gradient budget b")
    add("--keep", _optional(float), "keep fraction (forced, random, sb)")
    add("--match", _optional(str), "rule whose per-step kept counts to match (random): that rule runs on this run's "
                                   "own batches and model")
    add("--keep-counts-of", _optional(str), "a finished run's directory (rule random): keep exactly as many rows as "
                                            "that run kept at the same step (its steps.jsonl; at least 1)")
    g.add_argument("--rule-opt", dest="rule_opt", type=_key_value, action="append",
                   help="extra rule option KEY=VALUE (YAML value), repeatable")
    g.add_argument("--vcas-opt", dest="vcas_opt", type=_key_value, action="append",
                   help="VCAS option KEY=VALUE (capskip_fx.VCAS fields, e.g. freq=16); with a rule other "
                        "than vcas it turns VCAS on inside that rule's kept rows; repeatable")
    add("--infobatch-ratio", float, "InfoBatch (rule infobatch, capskip+infobatch): share r of the samples whose "
                                    "last loss is below the mean pruned each epoch (kept ones weigh 1/(1-r))")
    add("--infobatch-delta", float, "InfoBatch: the first delta x epochs epochs prune, the rest use all data")
    add("--backend", str, choices=BACKENDS)
    g = t.add_argument_group("optimisation")
    add("--epochs", int)
    add("--batch-size", int)
    add("--eval-batch-size", int)
    add("--lr", float, "peak AdamW learning rate")
    add("--min-lr", float, "cosine floor")
    add("--weight-decay", float)
    add("--warmup-epochs", float, "linear warm-up length")
    add("--schedule", str, "after the warm-up: 'cosine' to --min-lr over the run's steps; 'truncated': the "
                           "--epochs' cosine cut off at --max-steps; 'linear': constant, then linear to --min-lr "
                           "over the last --decay-frac of the steps", choices=SCHEDULES)
    add("--decay-frac", float, "--schedule linear: the share of the steps its final decay takes")
    add("--budget-batch", action=argparse.BooleanOptionalAction,
        help="with --max-steps / --steps-of: the batch size that spends those steps in --epochs epochs")
    add("--amp", str, choices=AMP)
    g = t.add_argument_group("run")
    add("--seed", int)
    add("--device", str, "auto, cpu, cuda, cuda:1, ...")
    add("--threads", _optional(int), "torch.set_num_threads")
    add("--out", _optional(str), "run directory; None: runs/<dataset>-<rule>-s<seed>")
    add("--label", _optional(str), "group label for compare; None: rule + budget/options")
    add("--time-budget", _optional(float), "stop once training wall-clock (s) reaches this")
    add("--max-steps", _optional(int), "stop after this many steps; the warm-up + cosine schedule spans them")
    add("--steps-of", _optional(str), "a finished run's directory: a step-matched baseline of round(--ratio x its "
                                      "steps) steps (sets --max-steps), with its own complete schedule")
    add("--ratio", _optional(float), "with --steps-of: that rule's step-time ratio to dense (benchmarks/interleaved.py)")
    add("--schedule-by-time", action=argparse.BooleanOptionalAction,
        help="with --time-budget, anneal the learning rate on time progress too")
    add("--check-every", int, "exact distortion check every K steps (0: never)")
    add("--check-tol", float, "slack on capskip's head rel-L2 <= budget")
    add("--log-every", int, "plain log line every N steps when not a TTY (0: auto)")

    c = sub.add_parser("compare", help="plots + Markdown table over run directories")
    c.add_argument("runs", nargs="+", help="run directories, or folders searched for them")
    c.add_argument("--out", default="runs/compare", help="output folder (default: runs/compare)")
    c.add_argument("--load-drift", type=float, default=0.2,
                   help="mark a wall-clock ratio when a run's median data-loading time per step differs from "
                        "dense's by more than this fraction (the machine's load changed; default: 0.2)")
    c.add_argument("--speed", default=None, help="benchmarks/interleaved.py's JSON: the step-time ratios' intervals")
    c.add_argument("--wide", action="store_true", help="every column (default: at most 8, none that is n/a throughout)")
    b = sub.add_parser("choose-budget", help="pick capskip's b from validation runs; prints it, writes the table")
    b.add_argument("select_dir", help="folder with dense-s{SEED} and capskip-b{B}-s{SEED} runs (--val-split)")
    b.add_argument("--seeds", nargs="+", required=True, help="selection seeds (not comparison seeds)")
    b.add_argument("--budgets", nargs="+", required=True, help="the budgets tried, as in the run names")
    b.add_argument("--tol", type=float, default=0.5, help="points of validation top-1 below dense allowed")
    b.add_argument("--out", required=True, help="Markdown file for the table")
    return p


def _resume_base(path: str) -> dict[str, Any]:
    """The resolved config saved in a run's checkpoint: a resumed run's defaults."""
    if not Path(path).is_file():
        raise SystemExit(f"config: resume {path!r} is not a file (--resume)")
    from . import checkpoint

    return normalise_keys(checkpoint.load_for_resume(path)["config"], f"--resume {path}")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Defaults <- the checkpoint's config (``--resume``) <- YAML file <- flags given on the command line."""
    values: dict[str, Any] = {}
    if getattr(ns, "resume", None):
        base = _resume_base(ns.resume)
        if getattr(ns, "rule", None) is not None and ns.rule != base.get("rule"):
            raise SystemExit(f"--resume continues a {base.get('rule')} run: --rule {ns.rule} would load its rule "
                             f"state into another rule; start a new run (--initial-checkpoint {ns.resume} takes "
                             f"its weights)")
        from .report import run_label

        if base.get("label") == run_label({**base, "label": None}):
            base["label"] = None  # the label the run's options made: made again from the options now given
        values.update(base)
    cfg_file = getattr(ns, "config_file", None)
    from_file = read_yaml(cfg_file) if cfg_file else {}
    values.update(from_file)
    flags = {k: v for k, v in vars(ns).items() if k in FIELDS}
    values.update(flags)
    for flag, key in (("model_kw", "model_kwargs"), ("rule_opt", "rule_options"), ("vcas_opt", "vcas_options")):
        if getattr(ns, flag, None):
            values[key] = {**(values.get(key) or {}), **dict(getattr(ns, flag))}
    # a value other than the default (a resolved config.yaml names every key) for a rule that would not read it
    given = {**from_file, **flags}
    ib = sorted(k for k in ("infobatch_ratio", "infobatch_delta") if k in given and given[k] != default(k))
    rule = values.get("rule", default("rule"))
    if ib and rule not in DATA_RULES:
        raise SystemExit(f"{', '.join('--' + k.replace('_', '-') for k in ib)} set InfoBatch's pruning, which runs "
                         f"with --rule {' or '.join(DATA_RULES)} only (rule {rule!r})")
    if values.get("rule") == "vcas" and values.get("vcas_options") is None:
        values["vcas_options"] = {}
    try:
        return TrainConfig(**values)
    except (TypeError, ValueError) as e:
        raise SystemExit(str(e)) from e


def parse_config(argv: Sequence[str]) -> TrainConfig:
    ns = build_parser().parse_args(["train", *argv])
    return config_from_args(ns)


def run(argv: Optional[Sequence[str]] = None) -> Any:
    """Parse and dispatch; returns the train result dict or the compare table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv in (["-h"], ["--help"]):  # the default sub-command's flags are what a newcomer looks for
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        print(parser.format_help() + "\n`capskip-train [train] FLAGS` (train is the default):\n\n"
              + sub.choices["train"].format_help())
        raise SystemExit(0)
    if not argv or argv[0] not in ("train", "compare", "choose-budget", "-h", "--help"):
        argv.insert(0, "train")
    ns = parser.parse_args(argv)
    if ns.command == "compare":
        table = compare(ns.runs, ns.out, drift=ns.load_drift, speed=ns.speed, wide=ns.wide)
        print(table + f"\nwritten to {ns.out}/compare.md")
        return table
    if ns.command == "choose-budget":
        from .report import choose_budget

        chosen, page = choose_budget(ns.select_dir, ns.seeds, ns.budgets, ns.tol)
        Path(ns.out).write_text(page)
        print(f"{chosen:g}")
        return chosen
    cfg = config_from_args(ns)
    from .loop import train

    return train(cfg)


def compare(paths: Sequence[str | Path], out_dir: str | Path, drift: Optional[float] = None,
            speed: Optional[str | Path] = None, wide: bool = False) -> str:
    """``capskip-train compare``: the figures and ``compare.md`` for the runs under ``paths``; returns the
    Markdown table.  What the table marks (time budget not reached, machine load changed) is also
    printed to stderr as warnings."""
    from . import plots, report

    runs = report.find_runs(paths)
    out_dir = Path(out_dir)
    plots.plot_runs(runs, out_dir)
    rows = json.loads(Path(speed).read_text())["rows"] if speed else ()
    table = report.compare_table(runs, report.LOAD_DRIFT if drift is None else drift, rows, wide=wide)
    for line in table.splitlines():
        if line.startswith((report.MISSED, report.LOADED, report.UNFINISHED)):
            print(f"warning: {line}", file=sys.stderr)
    (out_dir / "compare.md").write_text(report.compare_page(runs, table, plots.PLOTS))
    return table


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point (``capskip-train``)."""
    run(argv)
