"""TrainConfig: the run's settings, their coercion from YAML / flags, and the YAML file.

Imports neither torch nor timm (the rules load when a config is checked), so that the command line's
``--help`` is quick; hence the dataset and rule names are listed here (a test keeps them in step)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from capskip_fx.config import BACKENDS

DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100", "digits", "pytext")  # .datasets; pytext: .text
TASKS = ("classify", "lm")  # lm: next-byte language modelling on pytext (.text)
LM_MODELS = ("gpt2", "llama")  # transformers causal LMs at a tiny size (--task lm)
# capskip_fx.RULES' names, and VCAS (all rows, sampled inside the backward)
RULE_NAMES = ["capskip", "dense", "forced", "kabena", "random", "sb", "stale_sb", "ub", "vcas"]
# the harness's data-side rules: InfoBatch prunes at the sampler, the model runs the named rule
DATA_RULES = {"infobatch": "dense", "capskip+infobatch": "capskip"}
RULE_NAMES += list(DATA_RULES)
KEEP_RULES = ("forced", "random", "sb")  # the rules that take a fixed kept fraction (--keep)

AMP = ("none", "bf16")
# the learning rate after the warm-up: cosine to min_lr over the run's steps; the same cosine over the
# full epochs' steps, cut off where --max-steps stops the run; constant, then linear to min_lr over the
# last decay_frac of the run's steps
SCHEDULES = ("cosine", "truncated", "linear")


@dataclass(frozen=True)
class TrainConfig:
    # data
    task: str = "classify"  # or "lm": a causal LM on pytext, a row is a sequence
    dataset: str = "fashion-mnist"
    seq_len: int = 64  # --task lm: tokens per row
    data_dir: Optional[str] = None
    train_subset: Optional[int] = None
    eval_subset: Optional[int] = None
    val_split: Optional[int] = None  # evaluate on this many rows held out of the training split (not the test set)
    augment: bool = True
    workers: int = 0
    # model (timm)
    model: str = "deit_tiny_patch16_224"
    img_size: Optional[int] = None  # None: the dataset's default (28 for Fashion-MNIST)
    patch_size: Optional[int] = None  # None: img_size // 4 (7 at 28), passed only if the model takes it
    depth: Optional[int] = None
    embed_dim: Optional[int] = None
    num_heads: Optional[int] = None
    in_chans: Optional[int] = None  # None: the data's channels
    model_kwargs: dict = field(default_factory=dict)
    pretrained: bool = False  # timm's pretrained weights (needs the HF hub or timm's cache)
    initial_checkpoint: Optional[str] = None  # model weights only (checkpoint.pt, .pt/.pth, .safetensors)
    reset_head: bool = False  # with initial_checkpoint: keep the fresh classifier head (a new task)
    # selection
    rule: str = "capskip"
    budget: float = 0.1
    keep: Optional[float] = None
    match: Optional[str] = None
    keep_counts_of: Optional[str] = None  # rule random: keep, step by step, as many rows as that run's steps.jsonl
    rule_options: dict = field(default_factory=dict)
    vcas_options: Optional[dict] = None  # VCAS inside the backward (rule "vcas", or with another rule)
    infobatch_ratio: float = 0.5  # InfoBatch's r: share of the below-mean-loss samples pruned per epoch
    infobatch_delta: float = 0.875  # InfoBatch's delta: the first delta * epochs epochs prune
    backend: str = "inductor"
    # optimisation: AdamW, linear warm-up then cosine to min_lr
    epochs: int = 10
    batch_size: int = 128
    eval_batch_size: int = 512
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    schedule: str = "cosine"  # SCHEDULES
    decay_frac: float = 0.2  # schedule "linear": the share of the steps the final linear decay takes
    budget_batch: bool = False  # with max_steps: the batch size that spends max_steps in `epochs` epochs
    amp: str = "none"
    # run
    seed: int = 0
    device: str = "auto"
    threads: Optional[int] = None
    out: Optional[str] = None
    label: Optional[str] = None
    time_budget: Optional[float] = None
    max_steps: Optional[int] = None  # stop after this many steps; the warm-up + cosine schedule spans them
    steps_of: Optional[str] = None  # a finished run's dir: max_steps = round(ratio x its steps) (step-matched)
    ratio: Optional[float] = None  # with steps_of: that rule's step-time ratio to dense
    schedule_by_time: bool = True
    check_every: int = 100  # 0: no distortion checks
    check_tol: float = 1e-4
    log_every: int = 0  # 0: about ten plain log lines per epoch
    resume: Optional[str] = None  # a run's checkpoint.pt: continue that run

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"config: {msg}")

        for name, tp in _HINTS.items():  # YAML reads 1e-3 as a string; flags arrive typed already
            object.__setattr__(self, name, _coerce(name, tp, getattr(self, name)))

        if self.dataset not in DATASETS:
            bad(f"dataset {self.dataset!r} not in {DATASETS}")
        if self.task not in TASKS:
            bad(f"task {self.task!r} not in {TASKS}")
        if (self.task == "lm") != (self.dataset == "pytext"):
            bad(f"task {self.task!r} with dataset {self.dataset!r}: --task lm trains on --dataset pytext, and pytext "
                f"is text (pass both, or neither)")
        if self.task == "lm" and self.model not in LM_MODELS:
            bad(f"--task lm: model {self.model!r} not in {LM_MODELS} (tiny transformers configs: --depth, "
                f"--embed-dim, --num-heads size them)")
        if self.seq_len < 2:
            bad(f"seq_len must be >= 2, got {self.seq_len}")
        if self.rule not in RULE_NAMES:
            bad(f"rule {self.rule!r} not in {RULE_NAMES}")
        if self.backend not in BACKENDS:
            bad(f"backend {self.backend!r} not in {BACKENDS}")
        if self.amp not in AMP:
            bad(f"amp {self.amp!r} not in {AMP}")
        if self.schedule not in SCHEDULES:
            bad(f"schedule {self.schedule!r} not in {SCHEDULES}")
        if not 0.0 < self.decay_frac <= 1.0:
            bad(f"decay_frac must be in (0, 1], got {self.decay_frac}")
        if self.epochs < 1 or self.batch_size < 1 or self.eval_batch_size < 1:
            bad("epochs, batch_size and eval_batch_size must be >= 1")
        if self.time_budget is not None and self.time_budget <= 0:
            bad(f"time_budget must be positive seconds, got {self.time_budget}")
        if not 0.0 <= self.infobatch_ratio < 1.0 or not 0.0 <= self.infobatch_delta <= 1.0:
            bad(f"infobatch_ratio must be in [0, 1) and infobatch_delta in [0, 1], got {self.infobatch_ratio}, "
                f"{self.infobatch_delta} (the reference's defaults: 0.5, 0.875)")
        if self.steps_of is not None:
            self._resolve_steps_of(bad)
        if self.keep_counts_of is not None:
            if self.rule != "random" or self.match is not None:
                bad("keep_counts_of replays a run's per-step kept counts with rule random (no --match)")
            if not (Path(self.keep_counts_of) / "steps.jsonl").is_file():
                bad(f"keep_counts_of {self.keep_counts_of!r}: no steps.jsonl there (name a finished run's directory)")
        if self.max_steps is not None and self.max_steps < 1:
            bad(f"max_steps must be >= 1, got {self.max_steps}")
        if self.budget_batch and self.max_steps is None:
            bad("budget_batch sizes the batch to spend --max-steps (or --steps-of) in --epochs epochs: give one")
        if self.schedule == "truncated" and self.max_steps is None:
            bad("schedule 'truncated' cuts the epochs' cosine at --max-steps (or --steps-of): give one")
        if self.max_steps is not None and (self.rule in DATA_RULES or self.rule == "stale_sb"):
            bad(f"max_steps (a step-matched baseline) with rule {self.rule!r}: its epochs shrink with the data it "
                f"drops and its schedule follows the data, not a step count; step-match a dense run instead")
        if self.check_every < 0 or self.warmup_epochs < 0:
            bad("check_every and warmup_epochs must be >= 0")
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:  # lr 0 with min_lr 0: weights stay (evaluation)
            bad(f"lr must be >= 0 and min_lr in [0, lr] (the cosine's floor), got lr={self.lr}, min_lr={self.min_lr}")
        if not self.weight_decay >= 0 or not self.check_tol >= 0:
            bad(f"weight_decay and check_tol must be >= 0, got {self.weight_decay}, {self.check_tol}")
        if self.log_every < 0 or (self.threads is not None and self.threads < 1):
            bad(f"log_every must be >= 0 (0: about ten lines an epoch) and threads >= 1 (or unset), got "
                f"{self.log_every}, {self.threads}")
        for name in ("train_subset", "eval_subset", "img_size", "patch_size", "in_chans"):
            v = getattr(self, name, None)
            if v is not None and v < 1:
                bad(f"{name} must be >= 1 (or unset: the dataset's default), got {v}")
        if not isinstance(self.model_kwargs, dict) or not isinstance(self.rule_options, dict):
            bad("model_kwargs and rule_options must be mappings")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            bad(f"data_dir {self.data_dir!r} is not a folder")
        for name in ("resume", "initial_checkpoint"):  # a typo fails here, before any data is loaded
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                bad(f"{name} {path!r} is not a file (--{name.replace('_', '-')})")
        # the rule is built here too, so a bad budget or option fails before any data is loaded
        from capskip_fx.rules import build_rule

        if self.keep is not None and model_rule(self) not in KEEP_RULES:
            bad(f"keep (a fixed kept fraction) is an option of rules {KEEP_RULES}; rule {self.rule!r} chooses its "
                f"own count (capskip: --budget)")
        try:
            if self.rule != "vcas":
                build_rule(model_rule(self), self.budget, rule_options(self))
        except (TypeError, ValueError) as e:
            bad(f"rule {self.rule!r}: {e}")
        if self.vcas_options is not None:  # VCAS's own checks, as the rule's, before any data is loaded
            import capskip_fx

            if not isinstance(self.vcas_options, dict):
                bad("vcas_options must be a mapping")
            try:
                capskip_fx.VCAS(**self.vcas_options)
            except (TypeError, ValueError) as e:
                bad(f"vcas options (--vcas-opt): {e}")
        import torch

        try:  # the spelling only: whether this machine has the device is the run's to say (data.resolve_device)
            if self.device != "auto":
                torch.device(self.device)
        except (RuntimeError, ValueError):
            bad(f"device {self.device!r} is not a device: auto, cpu, cuda, cuda:1, mps, ...")


    def _resolve_steps_of(self, bad) -> None:
        """``steps_of`` + ``ratio`` -> ``max_steps`` (a step-matched baseline), from that run's result.json."""
        import json

        if self.ratio is None or not self.ratio > 0 or not self.ratio < float("inf"):
            bad(f"steps_of needs --ratio r > 0 (the rule's step-time ratio to dense, e.g. from "
                f"benchmarks/interleaved.py), got {self.ratio!r}")
        result = Path(self.steps_of) / "result.json"
        if not result.is_file():
            bad(f"steps_of {self.steps_of!r}: no result.json there (--steps-of names a finished run's directory)")
        steps = json.loads(result.read_text())["steps"]
        want = max(1, round(self.ratio * steps))
        if self.max_steps is not None and self.max_steps != want:
            bad(f"max_steps {self.max_steps} contradicts steps_of: round({self.ratio} x {steps}) = {want}")
        object.__setattr__(self, "max_steps", want)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def default(name: str) -> Any:
    """A field's default value."""
    f = FIELDS[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _coerce(name: str, tp: Any, value: Any) -> Any:
    optional = typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
    if value is None:
        if optional:
            return None
        raise ValueError(f"config: {name} must not be null")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "1", "false", "no", "0"):
                return str(value).lower() in ("true", "yes", "1")
            raise ValueError(value)
        if base is int:
            f = float(value)
            if f != int(f):
                raise ValueError(value)
            return int(f)
        if base in (float, str):
            return base(value)
    except (TypeError, ValueError):
        raise ValueError(f"config: {name}={value!r} is not a valid {getattr(base, '__name__', base)}") from None
    return value


def model_rule(cfg: TrainConfig) -> str:
    """The rule the compiled model runs: a data-side rule's model half (``capskip+infobatch``: capskip)."""
    return DATA_RULES.get(cfg.rule, cfg.rule)


def uses_infobatch(cfg: TrainConfig) -> bool:
    return cfg.rule in DATA_RULES


def rule_options(cfg: TrainConfig, total_steps: Optional[int] = None) -> dict[str, Any]:
    """The rule's keyword options; ``total_steps`` places Composer's [start, end) window for sb keep=."""
    opts = dict(cfg.rule_options)
    if cfg.keep is not None:
        opts["keep"] = cfg.keep
        if model_rule(cfg) == "sb" and total_steps and "total_steps" not in opts and "total_epochs" not in opts:
            opts["total_steps"] = total_steps
    if cfg.match is not None:
        opts["match"] = cfg.match  # compile() hands the budget on to a matched rule
    return opts


def normalise_keys(d: dict, source: str) -> dict:
    """Config keys with dashes as underscores; an unknown key exits naming ``source``."""
    out = {}
    for k, v in d.items():
        key = str(k).replace("-", "_")
        if key not in FIELDS:
            raise SystemExit(f"{source}: unknown config key {k!r}; known: {', '.join(FIELDS)}")
        out[key] = v
    return out


def read_yaml(path: str | Path) -> dict:
    """The config keys of a YAML file (``--config``)."""
    if not Path(path).is_file():
        raise SystemExit(f"--config {path}: no such file")
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise SystemExit(f"--config {path}: not YAML ({e})") from None
    if not isinstance(loaded, dict):
        raise SystemExit(f"{path}: expected a mapping of config keys")
    return normalise_keys(loaded, str(path))


def write_yaml(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
