"""The one entry point: ``capskip_fx.compile(model, *, rule="capskip", budget=0.1, **options)``."""
from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from . import compat

compat.check()  # a moved torch internal fails here, loudly, never as a silently dense step

from . import ops
from .backend import CapskipBackend
from .dynamo_entry import (backend_of, bind, capskip_backend, compiled_part, install_batch_marking, load_pending_state,
                           mark_batch_dynamic, process_wide_batch_dynamic)
from .config import CapskipConfig, split_options
from .hf_loss import set_loss_type
from .records import BackwardMode, Report
from .rules import Rule, build_rule, make_rule
from .runtime.state import UNBOUND_REASON, ForwardContext, RunSummary, RuntimeState, StepStats, logits_of

_RULE_STATE_KEY = "_capskip"
#: the original module -> the CapskipModule capskip_fx.compile last made of it (stats(original) finds it)
_COMPILED_FROM: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class CapskipModule(nn.Module):
    """The compiled model.  Call it like the original; optional keyword inputs:

    ``capskip_targets``: (N,) int labels (needed for losses other than cross-entropy, and
    recommended with label smoothing); ``capskip_index``: (N,) dataset indices (rules with
    per-example histories).  ``state_dict()`` is the original model's plus the rule's state.
    """

    def __init__(self, model: nn.Module, state: RuntimeState, config: CapskipConfig, logits_index=None):
        super().__init__()
        self.model = model
        self.config = config
        self._state = state
        state.published.owner = weakref.ref(model)  # its module backward hooks gate the reuse of rows
        state.published.wrapper = weakref.ref(self)  # a backward hook on it acts on the logits' gradient too
        _COMPILED_FROM[model] = weakref.ref(self)
        key = ops.register(state)
        self._backend = CapskipBackend(config, state, key, logits_index)
        head: Optional[nn.Linear] = None
        if config.backend == "eager":
            compiled = model
            self._eager_h: Optional[Tensor] = None
            head = _last_linear(model)
            head.register_forward_hook(self._capture_h)
        else:
            compiled = torch.compile(model, backend=self._backend, **_ISOLATED)
        # not submodules (they are, or live in, self.model): no duplicate state_dict keys
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_eager_head", head)
        # checkpoints carry the original model's keys plus the rule's state, also when nested (DDP(...))
        self.register_state_dict_post_hook(_state_dict_hook)
        self.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)

    def __deepcopy__(self, memo: dict) -> "CapskipModule":
        """A copy (an EMA, a best-model snapshot): the model deep-copied and compiled afresh with the same
        settings, the rule and its state copied (its selections go on as the original's would); none of the
        original's compiled graphs, nor of its step in progress (autograd cannot deep-copy those).  Reached from a
        deep copy of its own model (through the eager backend's hook on the head), it is copied member by
        member, as the copy of that hook's owner."""
        if id(self.model) in memo:  # the model is half-built in memo: nothing to compile yet
            new = object.__new__(type(self))
            memo[id(self)] = new
            members = dict(self.__dict__)
            if "_eager_h" in members:  # the last step's head input: the original's autograd graph
                members["_eager_h"] = None
            new.__setstate__(copy.deepcopy(members, memo))
            return new
        state = RuntimeState(copy.deepcopy(self._state.rule, memo), seed=self._state.seed, scope=self._state.scope)
        state.load_state_dict(copy.deepcopy(self._state.state_dict(), memo))
        new = type(self)(copy.deepcopy(self.model, memo), state, self.config, self._backend.logits_index)
        new.train(self.training)
        memo[id(self)] = new
        return new

    @property
    def rule(self) -> Rule:
        return self._state.rule

    @rule.setter
    def rule(self, rule: Rule) -> None:
        """Swap the rule without recompiling.  The graphs depend on the rule in one way: a head graph of
        token logits (N, T, C) with the loss outside, compiled for a rule that reads none of their values
        (``Rule.reads_logits``: CAPSkip, UB, random, forced), keeps none; a rule set later that reads them
        (SB, Stale-SB, K-ABENA) then runs dense steps, with a note, until the model is compiled again."""
        self._state.rule = make_rule(rule)

    def set_epoch(self, epoch: int) -> None:
        """The (0-based) epoch rules see: SB priming and Stale-SB staleness count epochs."""
        self._state.epoch = int(epoch)

    @property
    def backend(self) -> CapskipBackend:
        return self._backend

    def forward(self, *args, capskip_targets: Optional[Tensor] = None, capskip_index: Optional[Tensor] = None,
                **kwargs):
        return self._step(args, kwargs, capskip_targets, capskip_index)

    # an outer torch.compile (a trainer compiling the model it is given) steps around this call: what it
    # would trace is this module's own compiled graph, which the call runs.  On a helper, not on forward: a
    # wrapper that rebinds forward (accelerate's unwrap_model) keeps it
    @torch._dynamo.disable
    def _step(self, args: tuple, kwargs: dict, capskip_targets: Optional[Tensor], capskip_index: Optional[Tensor]):
        _check_targets(capskip_targets)
        fwd = ForwardContext(capskip_targets, capskip_index)
        if self.config.backend == "eager":
            return self._eager_forward(fwd, *args, **kwargs)
        train = torch.is_grad_enabled()
        n = _batch_size(args, kwargs)
        if self.config.dynamic_batch and train and n == 1:
            # a batch of 1 specialises the batch dim: a recompile (an Inductor compile per ragged last
            # batch) whose backward can't drop rows anyway.  The eager model is the same dense step.
            out = self.model(*args, **kwargs)
            # by design, as the static first batch: not a fallback; counted in the step of its backward
            self._state.one_row_forward(logits_of(out, self._backend.logits_index), _N1_NOTE)
            return out
        if self.config.dynamic_batch and n >= 2:
            mark_batch_dynamic((args, kwargs))  # n, as _batch_size finds it: the first tensor's dim 0
        out = self._compiled(*args, **kwargs)
        if capskip_targets is not None and capskip_targets.dim() == 2:
            z = logits_of(out, self._backend.logits_index)
            if isinstance(z, Tensor) and z.shape[:-1] != capskip_targets.shape:
                raise ValueError(f"capskip_targets must be a 1-D integer tensor of class labels for logits (N, C), "
                                 f"or (N, T) for token-shaped logits (N, T, C); got {tuple(capskip_targets.shape)} "
                                 f"for logits of shape {tuple(z.shape)}")
        if train:
            bound = self._state.end_forward(fwd, logits_of(out, self._backend.logits_index), out=out)
            if not self._backend.records:
                # Dynamo ran the model without handing us a graph (e.g. its recompile_limit was reached
                # by earlier compiles of the same forward code): an eager, dense step; say so
                reason = _no_graph_reason(self.model)
                self._state.warn_once(reason)
                self._state.record_dense_step(n, reason)
            elif not self._backend.compiled_head:  # no graph found the head: every step is dense
                refusal = self._backend.refusal  # a graph's refusal: warned once, for its graph
                reason = refusal.detail if refusal is not None else None
                if reason is None:
                    reason = next((r.no_head for r in self._backend.records if r.no_head),
                                  "no graph holds the classifier head")
                    self._state.warn_once(f"{reason} -> dense backward")
                untraced = _untraced_rnns(self.model)
                if untraced and untraced not in reason:  # the graphs after an RNN's break: the cause first
                    reason = f"{untraced}; the graph after it: {reason}"
                self._state.record_dense_step(n, reason, at_forward=True)  # its backward's graphs claim it
            elif not bound:
                self._state.warn_once(UNBOUND_REASON)
                # claimed by this forward's backward, whose graphs then select nothing (as the string backend's hook)
                self._state.record_dense_step(n, UNBOUND_REASON, at_forward=True)
        return out

    # -- backend="eager": the reference semantics, dense cost ---------------------------
    def _capture_h(self, mod, inp, out):
        self._eager_h = inp[0]

    def _eager_forward(self, fwd, *args, **kwargs):
        z = self.model(*args, **kwargs)
        if torch.is_grad_enabled() and isinstance(z, Tensor) and z.requires_grad:
            h = self._eager_h.detach()
            zd = z.detach()
            state = self._state
            state.head_bias = self._eager_head.bias is not None

            def mask(g):
                w, _ = state.select(h.reshape(-1, h.shape[-1]), zd, g, fwd)
                return g * w.view(-1, *([1] * (g.dim() - 1)))

            z.register_hook(mask)
        return z

def _state_dict_hook(module: "CapskipModule", state_dict, prefix: str, local_metadata) -> None:
    inner = prefix + "model."
    for k in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + k[len(inner):]] = state_dict.pop(k)
    state_dict[prefix + _RULE_STATE_KEY] = module._state.state_dict()


def _load_state_dict_pre_hook(module: "CapskipModule", state_dict, prefix: str, *args) -> None:
    extra = state_dict.pop(prefix + _RULE_STATE_KEY, None)
    if extra is not None:
        module._state.load_state_dict(extra)
    inner = prefix + "model."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix):]] = state_dict.pop(k)


def _untraced_rnns(model: nn.Module) -> Optional[str]:
    """RNN modules Dynamo does not trace: it runs them eagerly (no graph, or a graph break before the head
    whose graph then sees a static batch, torch >= 2.15)."""
    rnns = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if rnns and not getattr(torch._dynamo.config, "allow_rnn", False):
        return f"Dynamo does not trace {'/'.join(rnns)} (torch._dynamo.config.allow_rnn is False)"
    return None


def _no_graph_reason(model: nn.Module) -> str:
    """Why Dynamo handed us no graph: RNN modules it does not trace, else (most likely) its recompile_limit."""
    untraced = _untraced_rnns(model)
    if untraced:
        return f"{untraced}, so torch.compile ran the model eagerly: dense backward"
    return _NO_GRAPH_REASON


_NO_GRAPH_REASON = ("torch.compile produced no graph for this model (Dynamo's recompile_limit reached? see "
                    "its log): the step ran eagerly, dense backward")
# each compiled model its own Dynamo cache entries: many models sharing one forward (nn.Sequential, a
# sweep in one process) must not exhaust one shared recompile_limit and silently run eager
_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
_N1_NOTE = "batch of size 1: ran the eager model (dense backward) instead of a static-batch recompile"


def _check_targets(t) -> None:
    """Shape and dtype only (no device sync); the label range is checked with the selection."""
    if t is None:
        return
    # 2-D: token-shaped logits (N, T, C), one label per position (-100 ignored); the runtime checks the shape
    if not isinstance(t, Tensor) or t.dim() not in (1, 2) or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        what = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"capskip_targets must be a 1-D integer tensor of class labels (-1 = unknown), or 2-D "
                         f"(N, T) for token-shaped logits, got {what}")


def _batch_size(args, kwargs=None) -> int:
    """The batch: dim 0 of the first tensor argument (positional first, then keyword)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    return next((a.shape[0] for a in leaves if isinstance(a, Tensor) and a.dim() > 0), 0)


def _last_linear(model: nn.Module) -> nn.Linear:
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not lin:
        raise ValueError("capskip_fx: the model has no nn.Linear head; the selection needs the logits "
                         "to come from a final Linear layer")
    return lin[-1]


def compile(model: nn.Module, *, rule: Union[str, Rule] = "capskip", budget: Optional[float] = 0.1,
            seed: int = 0, logits_index: Optional[int] = None, **options: Any) -> CapskipModule:
    """Compile ``model`` so that its backward runs on the rows the rule keeps.

    ``rule``: a name (``capskip_fx.rules.RULES``) or a Rule object.  ``budget``: CAPSkip's
    relative budget b in [0, 1] (ignored by rules that don't take one).  Other ``options`` go
    to :class:`CapskipConfig` (``backend``, ``granule``, ...) or to the rule (``keep``, ...).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capskip_fx.compile expects an nn.Module, got {type(model).__name__}")
    if any(isinstance(m, CapskipModule) for m in model.modules()):
        raise ValueError("capskip_fx.compile: this model is or holds a capskip_fx.compile module already, whose own "
                         "rule would run its graphs while this one's reported them dense; compile the original "
                         "model once (a CapskipModule's .model), with the options wanted")
    config, rule, rule_opts = split_options(rule, options)
    rule_obj = build_rule(rule, budget, rule_opts)
    _check_device(model)
    _check_not_fsdp2(model)
    set_loss_type(model)  # GPT-2's unrecognised loss_type: its lookup would break the graph before the loss
    state = RuntimeState(rule_obj, seed=seed, scope=config.scope)
    return CapskipModule(model, state, config, logits_index)


def _check_not_fsdp2(model: nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise NotImplementedError(
            "capskip_fx.compile does not take an FSDP2 (fully_shard) model as a whole: Dynamo hands no graph "
            "of FSDP2-managed modules to a backend here, so no row could be dropped. Compile its blocks and "
            "head in place instead: fully_shard each block, capskip_fx.compile_regions(model, ...), then "
            "fully_shard the root (docs/recipes.md, Regional compile and FSDP2); or use DistributedDataParallel: "
            "DDP(capskip_fx.compile(model))")


def _check_device(model: nn.Module) -> None:
    devs = {p.device.type for p in model.parameters()}
    bad = devs - {"cpu", "cuda", "xpu"}
    if bad:
        raise ValueError(f"capskip_fx supports models on cpu/cuda/xpu; got parameters on {sorted(bad)}")


def _register() -> None:
    """``backend="capskip"``: normally the installed entry point (torch_dynamo_backends) is what torch finds;
    from a source tree without one, register the same function here."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "capskip" not in list_backends(exclude_tags=()):
        register_backend(name="capskip")(capskip_backend)


_register()


def _backend_of(model) -> CapskipBackend:
    if isinstance(model, CapskipModule):
        return model.backend
    if isinstance(model, CapskipBackend):
        return model
    backend = backend_of(model) if isinstance(model, nn.Module) else None
    if backend is None and isinstance(model, nn.Module):
        backend = _wrapped_backend(model)
    if backend is None and isinstance(model, nn.Module) and any(isinstance(m, nn.RNNBase) for m in model.modules()):
        raise TypeError(f"capskip_fx.stats/report: no graph of this model reached capskip: {_no_graph_reason(model)}")
    if backend is None:
        raise TypeError("capskip_fx.stats/report expect the module returned by capskip_fx.compile, or one "
                        "compiled by torch.compile(backend='capskip') after its first step. If this one has run "
                        "a step, Dynamo handed capskip no graph of it: it ran eagerly (dense), "
                        + _no_graph_cause(model))
    return backend


def _no_graph_cause(model) -> str:
    """Why Dynamo may have handed capskip no graph of ``model``, most specific first."""
    inner = getattr(model, "_orig_mod", model) if isinstance(model, nn.Module) else None
    layers = inner is not None and any(m is not inner and compiled_part(m) for m in inner.modules())
    if inner is not model and layers:  # ``model`` is the torch.compile module around them
        return ("because its layers were compiled (in place, compile_regions, or as torch.compile modules) and the "
                "whole model again by this torch.compile: Dynamo inlines the inner compiles and only the outer "
                "backend runs, densely. Compile the layers or the whole model with backend='capskip', not both")
    nested = ("or because a model holding it was compiled again by torch.compile, which inlines the inner compiles "
              "(only the outer backend runs, densely: compile the layers or the whole model, not both), " if layers
              or (inner is not None and compiled_part(inner)) else "")
    return (f"{nested}e.g. because torch._dynamo.config.recompile_limit instances of its class were compiled "
            "before it (see Dynamo's warning; torch.compile(..., isolate_recompiles=True) avoids that)")


def _wrapped_backend(model: nn.Module) -> Optional[CapskipBackend]:
    """The backend of the one CapskipModule ``model`` is or holds (``DDP(cm)``, a container), else of the one
    capskip_fx.compile last made of a module it is or holds (the original model); None if none.  Several
    held: an error naming the fix."""
    held = {id(m.backend): m.backend for m in model.modules() if isinstance(m, CapskipModule)}
    if not held:
        made = (_COMPILED_FROM.get(m) for m in model.modules())
        held = {id(w.backend): w.backend for w in (r() for r in made if r is not None) if w is not None}
    if len(held) > 1:
        raise TypeError(f"capskip_fx.stats/report: this module holds {len(held)} modules compiled by "
                        "capskip_fx.compile (a deep copy of one included): pass the one you mean")
    return next(iter(held.values()), None)


def stats(model) -> StepStats:
    """The last step's statistics (no device sync unless ``.bound``, or ``.fallback`` after a step of a
    fixed-count rule, is read)."""
    state = _backend_of(model).state
    s = state.last
    s.variants = state.variants
    return s


def report(model) -> Report:
    """One row per graph the backend received: how its backward runs and why (prints as a table).  Where no
    graph holds a head, a body graph (built to follow a head's rows) runs dense: said so, with nothing to verify."""
    backend = _backend_of(model)
    rows = [r.as_dict() for r in backend.records]
    if not backend.compiled_head:
        for row in rows:
            if row["role"] == "body" and row["backward"] == str(BackwardMode.SELECTED):
                row["backward"] = str(BackwardMode.DENSE)
    return Report(rows)


def summary(model, *, logged: bool = False) -> RunSummary:
    """The run so far: steps, kept % and rows-run % of the forwarded rows, steps by mode, and the fallbacks
    by kind.  ``print(capskip_fx.summary(model))`` for a readable line.  A script that reads its summary
    gets no second copy printed at exit; ``logged=True`` (a trainer callback's log, not the user's read)
    leaves the exit line on."""
    state = _backend_of(model).state
    if not logged:
        state.print_at_exit = False
    return state.summary()


def state_dict(model) -> dict:
    """The rule's state (histories, EMAs, generators, step and epoch) of a model compiled with any idiom:
    ``capskip_fx.compile``, ``torch.compile(m, backend="capskip")``, ``m.compile(...)``, per block.  Save it
    beside the model's own state_dict (which, but for CapskipModule's, does not hold it)."""
    return _backend_of(model).state.state_dict()


def load_state_dict(model, state: dict) -> None:
    """Restore :func:`state_dict`.  Before the model's first step (a resume) the state is kept until its
    first compiled graph creates the backend."""
    if isinstance(model, (CapskipModule, CapskipBackend)):
        _backend_of(model).state.load_state_dict(state)
        return
    backend = backend_of(model) if isinstance(model, nn.Module) else None
    if backend is not None:
        backend.state.load_state_dict(state)
    elif isinstance(model, nn.Module):
        load_pending_state(model, state)
    else:
        raise TypeError(f"capskip_fx.load_state_dict expects a module, got {type(model).__name__}")


def compile_regions(model: nn.Module, *, rule: Union[str, Rule] = "capskip", budget: Optional[float] = 0.1,
                    blocks: Optional[Any] = None, head: Optional[nn.Module] = None, **options: Any) -> nn.Module:
    """Regional compile: compile the model's repeated blocks and its head in place with
    ``backend="capskip"`` (one compile per block, as torchtitan and PyTorch's tutorials do), and return the
    model itself (its state_dict keys unchanged).  ``blocks``: the block modules (default: the longest
    ModuleList / Sequential of one class, e.g. timm's ``blocks``, Hugging Face's ``layers``); ``head``: the
    classifier (default: timm's ``get_classifier()``, else the last Linear).  Every block's backward runs on
    the rows the head's rule keeps; ``options`` as for :func:`compile`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"capskip_fx.compile_regions expects an nn.Module, got {type(model).__name__}")
    if not isinstance(rule, str):
        raise TypeError("compile_regions takes a rule name (the string backend's options); use compile() for a Rule")
    opts = dict(options, rule=rule, budget=budget)
    blocks = list(blocks) if blocks is not None else _repeated_blocks(model)
    head = head if head is not None else _classifier(model)
    if any(_fsdp2_sharded(b) for b in blocks):
        process_wide_batch_dynamic()  # FSDP2 re-creates a block's inputs: marks on them are lost (limits.md)
    for m in blocks + [head]:
        m.compile(backend="capskip", options=opts)
        install_batch_marking(m)  # before the first call: step 0 traces a dynamic batch and selects
    bind(model)  # every block's graphs belong to the model: one rule state, its forward bound to its logits
    return model


def mark_compiled_batches(model: nn.Module) -> int:
    """Have ``model`` (compiled in place or returned by ``torch.compile``) and every module inside it compiled
    in place trace their batch as dynamic from their first call, as :func:`compile_regions` does, so that a
    ``backend="capskip"`` model's step 0 selects instead of running its static first batch dense.  The trainer
    callbacks call it for the model they are given; a module compiled with another backend inside it would
    trace a dynamic batch too.  It also binds ``model`` as the owner of its ``backend="capskip"`` graphs, so
    none of them reads the call stack to find it.  Returns how many modules it marks."""
    if not isinstance(model, nn.Module):
        return 0
    bind(model)
    return sum(install_batch_marking(m) for m in model.modules())  # each in place compiled, or model itself


def _fsdp2_sharded(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def _repeated_blocks(model: nn.Module) -> list:
    best: list = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > len(best):
            kids = list(m.children())
            if kids and all(type(k) is type(kids[0]) for k in kids) and not isinstance(kids[0], nn.Linear):
                best = kids
    if not best:
        raise ValueError("capskip_fx.compile_regions: no ModuleList / Sequential of repeated blocks found; "
                         "pass blocks=[...]")
    return best


def _classifier(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) and any(True for _ in head.parameters()) else _last_linear(model)
