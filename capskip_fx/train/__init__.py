"""Training harness: fine-tune a timm model with a selective-backprop rule, log everything.

    python -m capskip_fx.train --dataset fashion-mnist --rule capskip --budget 0.1 --epochs 5 --out runs/x
    python -m capskip_fx.train --config configs/fashion_mnist_tiny.yaml --seed 1 --out runs/y
    python -m capskip_fx.train --resume runs/x/checkpoint.pt                # continue run x
    python -m capskip_fx.train compare runs/x runs/y --out runs/cmp

``train`` (the default sub-command) writes into ``--out``:
  * ``config.yaml``  the resolved config (defaults <- ``--config`` file <- flags, derived sizes filled in);
  * ``steps.jsonl``  one line per step: step, epoch, loss, kept, n, bound, lr, step_time_s, ...;
  * ``summary.csv``  one row per epoch: train_loss, eval_top1 (%), wall_clock_s (training time
    only: compile warm-up, evaluation and distortion checks excluded), compile_s, cumulative
    backward rows, mean kept fraction, check violations;
  * ``checks.jsonl`` every ``--check-every`` steps: selected vs dense gradient of that batch;
  * ``checkpoint.pt`` at each epoch end (atomically replaced): what ``--resume`` needs;
  * ``result.json`` and the plots of :mod:`capskip_fx.train.plots`.

Compile time: a step is a compile step when it is the process's first one or when the core
reports a new variant (``stats().variants`` grew); its excess over the median of recent steady
steps is ``compile_s`` (the whole first step while no steady step exists yet) and is left out of
``wall_clock_s``, which is also what ``--time-budget`` is measured against.  With a time
budget the learning-rate schedule follows max(step progress, time progress), so a
time-matched run anneals fully instead of being cut off at a high learning rate.

Modules: :mod:`.config` (TrainConfig, YAML), :mod:`.cli` (flags, ``run``, ``main``, ``compare``),
:mod:`.loop` (``RunState``, ``train``, evaluation, LR schedule), :mod:`.data` (loaders) and
:mod:`.datasets` (the datasets), :mod:`.infobatch` (InfoBatch's sampler, ``--rule infobatch``), :mod:`.model`, :mod:`.checks` (distortion check, CompileClock),
:mod:`.checkpoint`, :mod:`.report` (run directories, statistics, tables), :mod:`.plots` (figures).

Only the command line and the config are imported here; the rest loads on first use, so that
``capskip-train --help`` answers without importing torch or timm.
"""
from importlib import import_module

from .cli import build_parser, compare, config_from_args, main, parse_config, run
from .config import AMP, BACKENDS, DATASETS, RULE_NAMES, TrainConfig, rule_options

# name -> submodule, loaded on first access (PEP 562)
_LAZY = {"CompileClock": "checks", "distortion_check": "checks", "RunState": "loop", "SUMMARY_FIELDS": "loop",
         "evaluate": "loop", "lr_at": "loop", "train": "loop", "build_model": "model", "find_head": "model"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TrainConfig", "parse_config", "config_from_args", "build_parser", "run", "main", "compare", "train",
           "RunState", "evaluate", "lr_at", "CompileClock", "distortion_check", "rule_options", "build_model",
           "find_head", "RULE_NAMES", "BACKENDS", "AMP", "DATASETS", "SUMMARY_FIELDS"]
