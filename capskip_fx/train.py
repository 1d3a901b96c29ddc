"""Training harness: fine-tune a timm model with a selective-backprop rule, log everything.

    python -m capskip_fx.train --dataset fashion-mnist --rule capskip --budget 0.1 --epochs 5 --out runs/x
    python -m capskip_fx.train --config configs/fashion_mnist_tiny.yaml --seed 1 --out runs/y
    python -m capskip_fx.train compare runs/x runs/y --out runs/cmp

``train`` (the default sub-command) writes into ``--out``:
  * ``config.yaml``  the resolved config (defaults <- ``--config`` file <- flags, derived sizes filled in);
  * ``steps.jsonl``  one line per step: step, epoch, loss, kept, n, bound, lr, step_time_s, ...;
  * ``summary.csv``  one row per epoch: train_loss, eval_top1 (%), wall_clock_s (training time
    only: compile warm-up, evaluation and distortion checks excluded), compile_s, cumulative
    backward rows, mean kept fraction, check violations;
  * ``checks.jsonl`` every ``--check-every`` steps: selected vs dense gradient of that batch;
  * ``result.json`` and the plots of :mod:`capskip_fx.report`.

Compile time: a step is a compile step when it is the first one or when the core reports a
new variant (``stats().variants`` grew); its excess over the median of recent steady steps is
``compile_s`` (the whole first step while no steady step exists yet) and is left out of
``wall_clock_s``, which is also what ``--time-budget`` is measured against.  With a time
budget the learning-rate schedule follows max(step progress, time progress), so a
time-matched run anneals fully instead of being cut off at a high learning rate.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import dataclasses
import json
import math
import random
import statistics
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
import yaml
from torch import nn

import capskip_fx
from capskip_fx import plots
from capskip_fx.data.datasets import DATASETS, DEFAULT_IMG_SIZE, load_dataset
from capskip_fx.rules import RULES

RULE_NAMES = sorted(RULES) + ["vcas"]

BACKENDS = ("inductor", "aot_eager", "eager")
AMP = ("none", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    # data
    dataset: str = "fashion-mnist"
    data_dir: Optional[str] = None
    train_subset: Optional[int] = None
    eval_subset: Optional[int] = None
    augment: bool = True
    workers: int = 0
    # model (timm; pretrained=False always)
    model: str = "deit_tiny_patch16_224"
    img_size: Optional[int] = None  # None: the dataset's default (28 for Fashion-MNIST)
    patch_size: Optional[int] = None  # None: img_size // 4 (7 at 28), passed only if the model takes it
    depth: Optional[int] = None
    embed_dim: Optional[int] = None
    num_heads: Optional[int] = None
    in_chans: Optional[int] = None  # None: the data's channels
    model_kwargs: dict = field(default_factory=dict)
    # selection
    rule: str = "capskip"
    budget: float = 0.1
    keep: Optional[float] = None
    match: Optional[str] = None
    rule_options: dict = field(default_factory=dict)
    vcas_options: Optional[dict] = None  # VCAS inside the backward (rule "vcas", or with another rule)
    backend: str = "inductor"
    # optimisation: AdamW, linear warm-up then cosine to min_lr
    epochs: int = 10
    batch_size: int = 128
    eval_batch_size: int = 512
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    amp: str = "none"
    # run
    seed: int = 0
    device: str = "auto"
    threads: Optional[int] = None
    out: Optional[str] = None
    label: Optional[str] = None
    time_budget: Optional[float] = None
    schedule_by_time: bool = True
    check_every: int = 100  # 0: no distortion checks
    check_tol: float = 1e-4
    log_every: int = 0  # 0: about ten plain log lines per epoch

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"config: {msg}")

        for name, tp in _HINTS.items():  # YAML reads 1e-3 as a string; flags arrive typed already
            object.__setattr__(self, name, _coerce(name, tp, getattr(self, name)))

        if self.dataset not in DATASETS:
            bad(f"dataset {self.dataset!r} not in {DATASETS}")
        if self.rule not in RULE_NAMES:
            bad(f"rule {self.rule!r} not in {RULE_NAMES}")
        if self.backend not in BACKENDS:
            bad(f"backend {self.backend!r} not in {BACKENDS}")
        if self.amp not in AMP:
            bad(f"amp {self.amp!r} not in {AMP}")
        if self.epochs < 1 or self.batch_size < 1 or self.eval_batch_size < 1:
            bad("epochs, batch_size and eval_batch_size must be >= 1")
        if self.time_budget is not None and self.time_budget <= 0:
            bad(f"time_budget must be positive seconds, got {self.time_budget}")
        if self.check_every < 0 or self.warmup_epochs < 0:
            bad("check_every and warmup_epochs must be >= 0")
        if not isinstance(self.model_kwargs, dict) or not isinstance(self.rule_options, dict):
            bad("model_kwargs and rule_options must be mappings")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            bad(f"data_dir {self.data_dir!r} is not a folder")
        # the rule is built here too, so a bad budget or option fails before any data is loaded
        try:
            from .rules import build_rule

            if self.rule != "vcas":
                build_rule(self.rule, self.budget, rule_options(self))
        except (TypeError, ValueError) as e:
            bad(f"rule {self.rule!r}: {e}")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


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


# ---------------------------------------------------------------- command line

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


def _default(name: str) -> Any:
    f = FIELDS[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capskip-train", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="{train,compare}")
    t = sub.add_parser("train", help="train one run (the default sub-command)",
                       argument_default=argparse.SUPPRESS)  # only flags given on the command line override

    def add(name, type=None, help="", **kw):
        dest = name.lstrip("-").replace("-", "_")
        if "action" not in kw:
            kw["type"] = type
        g.add_argument(name, dest=dest, help=f"{help} (default: {_default(dest)})".strip(), **kw)

    g = t
    t.add_argument("--config", dest="config_file", help="YAML file of config keys; flags override it")
    g = t.add_argument_group("data")
    add("--dataset", str, choices=DATASETS)
    add("--data-dir", _optional(str), "folder with the dataset files")
    add("--train-subset", _optional(int), "use a fixed random subset of this many training images")
    add("--eval-subset", _optional(int), "use a fixed random subset of this many eval images")
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
    g = t.add_argument_group("selection")
    add("--rule", str, "selection rule ('vcas': all rows, VCAS samples inside the backward)", choices=RULE_NAMES)
    add("--budget", float, "relative last-layer gradient budget b")
    add("--keep", _optional(float), "keep fraction (forced, random, sb)")
    add("--match", _optional(str), "rule whose per-step kept counts to match (random)")
    g.add_argument("--rule-opt", dest="rule_opt", type=_key_value, action="append",
                   help="extra rule option KEY=VALUE (YAML value), repeatable")
    g.add_argument("--vcas-opt", dest="vcas_opt", type=_key_value, action="append",
                   help="VCAS option KEY=VALUE (capskip_fx.VCAS fields, e.g. freq=16); with a rule other "
                        "than vcas it turns VCAS on inside that rule's kept rows; repeatable")
    add("--backend", str, choices=BACKENDS)
    g = t.add_argument_group("optimisation")
    add("--epochs", int)
    add("--batch-size", int)
    add("--eval-batch-size", int)
    add("--lr", float, "peak AdamW learning rate")
    add("--min-lr", float, "cosine floor")
    add("--weight-decay", float)
    add("--warmup-epochs", float, "linear warm-up length")
    add("--amp", str, choices=AMP)
    g = t.add_argument_group("run")
    add("--seed", int)
    add("--device", str, "auto, cpu, cuda, cuda:1, ...")
    add("--threads", _optional(int), "torch.set_num_threads")
    add("--out", _optional(str), "run directory; None: runs/<dataset>-<rule>-s<seed>")
    add("--label", _optional(str), "group label for compare; None: rule + budget/options")
    add("--time-budget", _optional(float), "stop once training wall-clock (s) reaches this")
    add("--schedule-by-time", action=argparse.BooleanOptionalAction,
        help="with --time-budget, anneal the learning rate on time progress too")
    add("--check-every", int, "exact distortion check every K steps (0: never)")
    add("--check-tol", float, "slack on capskip's head rel-L2 <= budget")
    add("--log-every", int, "plain log line every N steps when not a TTY (0: auto)")

    c = sub.add_parser("compare", help="plots + Markdown table over run directories")
    c.add_argument("runs", nargs="+", help="run directories, or folders searched for them")
    c.add_argument("--out", default="runs/compare", help="output folder (default: runs/compare)")
    return p


def _normalise_keys(d: dict, source: str) -> dict:
    out = {}
    for k, v in d.items():
        key = str(k).replace("-", "_")
        if key not in FIELDS:
            raise SystemExit(f"{source}: unknown config key {k!r}; known: {', '.join(FIELDS)}")
        out[key] = v
    return out


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Defaults <- YAML file <- flags given on the command line."""
    values: dict[str, Any] = {}
    cfg_file = getattr(ns, "config_file", None)
    if cfg_file:
        loaded = yaml.safe_load(Path(cfg_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"{cfg_file}: expected a mapping of config keys")
        values.update(_normalise_keys(loaded, cfg_file))
    flags = {k: v for k, v in vars(ns).items() if k in FIELDS}
    values.update(flags)
    for flag, key in (("model_kw", "model_kwargs"), ("rule_opt", "rule_options"), ("vcas_opt", "vcas_options")):
        if getattr(ns, flag, None):
            values[key] = {**(values.get(key) or {}), **dict(getattr(ns, flag))}
    if values.get("rule") == "vcas" and values.get("vcas_options") is None:
        values["vcas_options"] = {}
    try:
        return TrainConfig(**values)
    except (TypeError, ValueError) as e:
        raise SystemExit(str(e)) from e


def parse_config(argv: Sequence[str]) -> TrainConfig:
    ns = build_parser().parse_args(["train", *argv])
    return config_from_args(ns)


# ---------------------------------------------------------------- pieces

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _vcas_log(v: Optional[dict]) -> Optional[dict]:
    """The step's VCAS state, compact: probe step?, s, mean rho / nu, mean rows per segment."""
    if not v:
        return None
    mean = lambda xs: statistics.mean(xs) if xs else 1.0
    return {"probe": v["probe"], "s": v["s"], "rho": mean(v["rho"]), "nu": mean(v["nu"]),
            "rows": mean(v["segment_rows"])}


def rule_options(cfg: TrainConfig) -> dict[str, Any]:
    opts = dict(cfg.rule_options)
    if cfg.keep is not None:
        opts["keep"] = cfg.keep
    if cfg.match is not None:
        opts["match"] = cfg.match  # compile() hands the budget on to a matched rule
    return opts


def build_model(cfg: TrainConfig, num_classes: int) -> tuple[nn.Module, TrainConfig]:
    """timm model from the config; returns the config with what was actually passed."""
    import timm

    shape = {k: getattr(cfg, k) for k in ("depth", "embed_dim", "num_heads") if getattr(cfg, k) is not None}
    vit = {"img_size": cfg.img_size, "patch_size": cfg.patch_size} if cfg.patch_size else {}
    kw = dict(pretrained=False, num_classes=num_classes, in_chans=cfg.in_chans, **vit, **shape, **cfg.model_kwargs)
    try:
        return timm.create_model(cfg.model, **kw), cfg
    except TypeError as e:
        if not vit or "unexpected keyword" not in str(e):  # CNNs etc. take no img_size/patch_size
            raise
        print(f"[model] {cfg.model} takes no img_size/patch_size ({e}); creating it without them")
        kw = {k: v for k, v in kw.items() if k not in vit}
        return timm.create_model(cfg.model, **kw), dataclasses.replace(cfg, patch_size=None)


def find_head(model: nn.Module) -> nn.Module:
    """The classifier: timm's ``get_classifier()``, else the last nn.Linear."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("no classifier head found (no get_classifier() and no nn.Linear)")
    return linears[-1]


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up to ``lr`` over warmup_epochs/epochs of progress, then cosine to ``min_lr``."""
    p = min(max(progress, 0.0), 1.0)
    w = min(cfg.warmup_epochs / cfg.epochs, 1.0)
    if p < w:
        return cfg.lr * p / w
    if w >= 1.0:
        return cfg.lr
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def _finite(x: Any) -> Any:
    """JSON-safe number: NaN/inf become null."""
    if isinstance(x, torch.Tensor):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class CompileClock:
    """Training wall-clock with compile steps' excess over steady steps taken out."""

    def __init__(self, window: int = 200):
        self.total = 0.0  # loop time: data wait + step time
        self.compile_steps: list[float] = []
        self.steady = collections.deque(maxlen=window)

    def add(self, data_s: float, step_s: float, is_compile: bool) -> None:
        self.total += data_s + step_s
        (self.compile_steps.append if is_compile else self.steady.append)(step_s)

    @property
    def compile_s(self) -> float:
        med = statistics.median(self.steady) if self.steady else 0.0
        return sum(max(0.0, t - med) for t in self.compile_steps)

    @property
    def wall_s(self) -> float:
        return self.total - self.compile_s


def _norms(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    """Cosine and relative L2 ||a - b|| / ||b|| over a list of tensors, in float64."""
    dot = sum((x.double() * y.double()).sum() for x, y in zip(a, b))
    na = math.sqrt(sum(x.double().square().sum() for x in a))
    nb = math.sqrt(sum(y.double().square().sum() for y in b))
    nd = math.sqrt(sum((x.double() - y.double()).square().sum() for x, y in zip(a, b)))
    return {"cos": float(dot) / (na * nb) if na > 0 and nb > 0 else math.nan,
            "rel_l2": nd / nb if nb > 0 else math.nan, "norm_selected": na, "norm_dense": nb}


def distortion_check(model: nn.Module, head: nn.Module, x, y, autocast, rng_state) -> dict[str, float]:
    """Dense backward of the full loss on the same batch through the eager model; compare with the
    selected gradients currently in ``.grad``, then put those back."""
    params = [p for p in model.parameters() if p.requires_grad]
    head_ids = {id(p) for p in head.parameters()}
    selected = [p.grad for p in params]
    for p in params:
        p.grad = None
    cpu_state, cuda_state = rng_state  # same dropout masks as the selected forward (eager)
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, x.device)
    with autocast():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    dense = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    sel = [g if g is not None else torch.zeros_like(p) for g, p in zip(selected, params)]
    for p, g in zip(params, selected):
        p.grad = g
    allm = _norms(sel, dense)
    hm = _norms([g for g, p in zip(sel, params) if id(p) in head_ids],
                [g for g, p in zip(dense, params) if id(p) in head_ids])
    return {"cos_all": allm["cos"], "rel_l2_all": allm["rel_l2"], "cos_head": hm["cos"],
            "rel_l2_head": hm["rel_l2"], "dense_loss": loss.item()}


@torch.no_grad()
def evaluate(model: nn.Module, loader, device, autocast) -> tuple[float, float]:
    """Top-1 (%) and mean loss, in eval mode, through the eager model."""
    was = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            z = model(x)
        loss_sum += F.cross_entropy(z.float(), y, reduction="sum").item()
        correct += (z.argmax(1) == y).sum().item()
        total += y.numel()
    model.train(was)
    return 100.0 * correct / max(total, 1), loss_sum / max(total, 1)


SUMMARY_FIELDS = ("epoch", "steps", "train_loss", "eval_top1", "eval_loss", "wall_clock_s", "compile_s",
                  "backward_rows", "rows", "mean_kept_frac", "lr", "checks", "violations", "fallbacks",
                  "time_budget_hit")


# ---------------------------------------------------------------- the loop

def train(cfg: TrainConfig) -> dict[str, Any]:
    """One run.  Returns the final result (also written to ``result.json``)."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)

    data = load_dataset(cfg.dataset, cfg.data_dir, img_size=cfg.img_size, in_chans=cfg.in_chans,
                        train_subset=cfg.train_subset, eval_subset=cfg.eval_subset, augment=cfg.augment)
    img = cfg.img_size or DEFAULT_IMG_SIZE[cfg.dataset]
    cfg = dataclasses.replace(cfg, img_size=img, in_chans=data.in_chans,
                              patch_size=cfg.patch_size or max(1, img // 4), device=str(device))
    model, cfg = build_model(cfg, data.num_classes)
    cfg = dataclasses.replace(cfg, label=plots.run_label(dataclasses.asdict(cfg)),
                              out=cfg.out or f"runs/{cfg.dataset}-{cfg.rule}-s{cfg.seed}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[run] {cfg.label} seed {cfg.seed}: {cfg.model} ({n_params:,} params) on {device}, "
          f"backend {cfg.backend}, out {out}")

    model.to(device)
    head = find_head(model)
    vcas = capskip_fx.VCAS(**cfg.vcas_options) if cfg.vcas_options is not None else None
    cm = capskip_fx.compile(model, rule=cfg.rule, budget=cfg.budget, backend=cfg.backend, seed=cfg.seed,
                            vcas=vcas, **rule_options(cfg))
    cm.train()
    from timm.optim import create_optimizer_v2  # AdamW without decay on biases/norms/tokens

    opt = create_optimizer_v2(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    pin = device.type == "cuda"
    # a ragged last batch would be one more shape to compile
    train_loader = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, generator=gen,
                              drop_last=len(data.train) >= cfg.batch_size, num_workers=cfg.workers,
                              pin_memory=pin, persistent_workers=cfg.workers > 0)
    eval_loader = DataLoader(data.test, batch_size=cfg.eval_batch_size, num_workers=cfg.workers, pin_memory=pin)
    steps_per_epoch = len(train_loader)
    total_steps = cfg.epochs * steps_per_epoch
    log_every = cfg.log_every or max(1, steps_per_epoch // 10)

    def autocast():
        if cfg.amp == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    clock = CompileClock()
    step, backward_rows, rows, checks, violations, fallbacks = 0, 0, 0, 0, 0, 0
    prev_variants, hit_budget = None, False
    summary: list[dict[str, Any]] = []
    tol_limit = cfg.budget + cfg.check_tol
    with open(out / "steps.jsonl", "w") as steps_f, open(out / "checks.jsonl", "w") as checks_f:
        for epoch in range(1, cfg.epochs + 1):
            ep_loss, ep_kept_frac, ep_steps, ep_rows, ep_wall0 = 0.0, 0.0, 0, 0, clock.wall_s
            cm.set_epoch(epoch - 1)
            bar = tqdm(train_loader, desc=f"epoch {epoch}/{cfg.epochs}", disable=None, leave=True, dynamic_ncols=True)
            t_prev = time.perf_counter()
            lr = lr_at(cfg, 0.0)
            for x, y, idx in bar:
                x, y, idx = (t.to(device, non_blocking=True) for t in (x, y, idx))
                t0 = time.perf_counter()
                data_s = t0 - t_prev
                progress = (step + 1) / total_steps
                if cfg.time_budget and cfg.schedule_by_time:
                    progress = max(progress, clock.wall_s / cfg.time_budget)
                lr = lr_at(cfg, progress)
                for group in opt.param_groups:
                    group["lr"] = lr
                do_check = cfg.check_every > 0 and (step + 1) % cfg.check_every == 0
                rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None) \
                    if do_check else None
                opt.zero_grad(set_to_none=True)
                with autocast():
                    logits = cm(x, capskip_targets=y, capskip_index=idx)
                    loss = F.cross_entropy(logits, y)
                loss.backward()
                st = capskip_fx.stats(cm)
                loss_v = loss.item()
                sync()
                t1 = time.perf_counter()
                if not math.isfinite(loss_v):
                    raise FloatingPointError(f"non-finite loss {loss_v} at step {step} (epoch {epoch})")
                kept, n = int(st.kept), int(st.n)
                bound = _finite(st.bound)
                if do_check:
                    chk = distortion_check(model, head, x, y, autocast, rng)
                    checks += 1
                    violation = bool(cfg.rule == "capskip" and chk["rel_l2_head"] > tol_limit)
                    violations += violation
                    if violation:
                        print(f"[check] step {step}: capskip head rel-L2 {chk['rel_l2_head']:.6g} > budget "
                              f"{cfg.budget} (+{cfg.check_tol}); rule bound {bound}", file=sys.stderr)
                    checks_f.write(json.dumps({"step": step, "epoch": epoch, "kept": kept, "n": n, "bound": bound,
                                               **{k: _finite(v) for k, v in chk.items()},
                                               "violation": violation}) + "\n")
                    checks_f.flush()
                t2 = time.perf_counter()
                opt.step()
                sync()
                t3 = time.perf_counter()
                step_s = (t1 - t0) + (t3 - t2)
                variants = st.variants
                is_compile = step == 0 or (prev_variants is not None and variants > prev_variants)
                prev_variants = variants
                clock.add(data_s, step_s, is_compile)
                fallback = st.fallback
                fallbacks += fallback is not None
                backward_rows += kept
                rows += n
                ep_loss += loss_v
                ep_kept_frac += kept / max(n, 1)
                ep_steps += 1
                ep_rows += n
                steps_f.write(json.dumps({
                    "step": step, "epoch": epoch, "loss": loss_v, "kept": kept, "n": n, "bound": bound,
                    "rows_run": st.rows, "lr": lr, "step_time_s": step_s, "data_time_s": data_s, "compile_step": is_compile,
                    "variants": variants, "fallback": fallback,
                    "selection_ms": _finite(st.selection_ms), "vcas": _vcas_log(st.vcas)}) + "\n")
                step += 1
                ep_wall = clock.wall_s - ep_wall0
                ips = ep_rows / ep_wall if ep_wall > 0 else float("nan")
                if bar.disable:
                    if ep_steps % log_every == 0 or ep_steps == steps_per_epoch:
                        print(f"epoch {epoch} step {ep_steps}/{steps_per_epoch} loss {ep_loss / ep_steps:.4f} "
                              f"kept {ep_kept_frac / ep_steps:.3f} img/s {ips:.0f} lr {lr:.2e}", flush=True)
                else:
                    bar.set_postfix(loss=f"{ep_loss / ep_steps:.4f}", kept=f"{ep_kept_frac / ep_steps:.3f}",
                                    img_s=f"{ips:.0f}", refresh=False)
                if cfg.time_budget and clock.wall_s >= cfg.time_budget:
                    hit_budget = True
                    break
                t_prev = time.perf_counter()
            bar.close()
            steps_f.flush()
            top1, eval_loss = evaluate(model, eval_loader, device, autocast)
            summary.append({
                "epoch": epoch, "steps": step, "train_loss": ep_loss / max(ep_steps, 1), "eval_top1": top1,
                "eval_loss": eval_loss, "wall_clock_s": clock.wall_s, "compile_s": clock.compile_s,
                "backward_rows": backward_rows, "rows": rows, "mean_kept_frac": ep_kept_frac / max(ep_steps, 1),
                "lr": lr, "checks": checks, "violations": violations, "fallbacks": fallbacks,
                "time_budget_hit": int(hit_budget)})
            with open(out / "summary.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
                w.writeheader()
                w.writerows(summary)
            print(f"[epoch {epoch}] train_loss {summary[-1]['train_loss']:.4f} eval_top1 {top1:.2f}% "
                  f"wall {clock.wall_s:.1f}s compile {clock.compile_s:.1f}s kept {summary[-1]['mean_kept_frac']:.3f}"
                  + (f" violations {violations}" if violations else ""), flush=True)
            if hit_budget:
                print(f"[run] time budget {cfg.time_budget:.1f}s reached after {step} steps (epoch {epoch})")
                break

    result = {"out": str(out), "label": cfg.label, "seed": cfg.seed, "final_top1": summary[-1]["eval_top1"],
              "wall_clock_s": clock.wall_s, "compile_s": clock.compile_s, "steps": step,
              "kept_frac": backward_rows / max(rows, 1), "backward_rows": backward_rows, "checks": checks,
              "violations": violations, "fallbacks": fallbacks, "time_budget_hit": hit_budget,
              "data_source": data.source, "n_params": n_params, "torch": torch.__version__}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    plots.plot_runs([plots.load_run(out)], out)
    return result


def run(argv: Optional[Sequence[str]] = None) -> Any:
    """Parse and dispatch; returns the train result dict or the compare table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv in (["-h"], ["--help"]):  # the default sub-command's flags are what a newcomer looks for
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        print(parser.format_help() + "\n`capskip-train [train] FLAGS` (train is the default):\n\n"
              + sub.choices["train"].format_help())
        raise SystemExit(0)
    if not argv or argv[0] not in ("train", "compare", "-h", "--help"):
        argv.insert(0, "train")
    ns = parser.parse_args(argv)
    if ns.command == "compare":
        table = plots.compare(ns.runs, ns.out)
        print(table + f"\nwritten to {ns.out}/compare.md")
        return table
    return train(config_from_args(ns))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point (``capskip-train``)."""
    run(argv)


if __name__ == "__main__":
    main()
