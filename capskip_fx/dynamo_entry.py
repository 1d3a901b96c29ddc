"""The string backend, ``torch.compile(model, backend="capskip"[, options={...}])``: the
``torch_dynamo_backends`` entry point (pyproject.toml), so the name works in a fresh process without
``import capskip_fx``.  It settles which model a graph belongs to (one rule state per model and settings)
and binds each forward of that model to its logits.

Loading it changes nothing else in the process: no Dynamo setting is touched, so other models compiled
beside a capskip one trace as they would without it.  A model's batch is made dynamic on that model's own
inputs (``mark_batch_dynamic``), from its first graph on.
"""
from __future__ import annotations

import functools

from . import compat

compat.check()  # a moved torch internal fails here, loudly

import sys  # noqa: E402
import weakref  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
from torch import fx  # noqa: E402
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

from . import ops  # noqa: E402
from .backend import CapskipBackend  # noqa: E402
from .config import ENV_BUDGET, ENV_DYNAMIC_BATCH, ENV_OPTIONS, ENV_RULE, dynamic_batch_enabled, options_from_env, split_options  # noqa: E402
from .records import counters  # noqa: E402
from .rules import build_rule  # noqa: E402
from .runtime.state import UNBOUND_REASON, ForwardContext, RuntimeState, logits_of  # noqa: E402

# -- the string backend: torch.compile(model, backend="capskip"[, options={...}]) ----------------------
# One CapskipBackend (one rule state, one record list) per model and settings, so all graphs of a model
# (graph breaks, recompiles, every block of a regional compile, every layer compiled in place) share it,
# and it is freed with the model.  The model is bound explicitly (``bind``: compile_regions and
# mark_compiled_batches, hence the trainer callbacks, bind the model they are given before its first call);
# an unbound model is bound at its first graph from the call stack (_owning_module).  A forward hook on it
# binds each forward to the autograd node of its logits, so exactly one graph per forward (the one returning
# the logits) runs the rule, and every other graph drops only the rows that reach it with no gradient.  For
# torch.compile of a function (no module): the backend that compiled a graph taking the same parameters, else
# the one that compiled the previous graph.
_BY_OWNER: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, CapskipBackend]]" = weakref.WeakKeyDictionary()
_BY_PARAM: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # Parameter -> {settings: backend}
_LAST: list = [None]  # weakref of the backend that compiled the last graph
# rule states loaded (capskip_fx.load_state_dict) into a model whose backend does not exist yet
_PENDING_STATE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def load_pending_state(module: torch.nn.Module, state: dict) -> None:
    """Keep a rule state for the backend ``module``'s first compiled graph will create."""
    _PENDING_STATE[module] = state


def capskip_backend(gm: fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """``torch.compile(model, backend="capskip", options={...})``; with no options, the ``CAPSKIP_*``
    environment settings (config.options_from_env).  ``torch.compile(..., mode="reduce-overhead")`` (timm's
    ``--torchcompile-mode``) reaches us as ``mode``: Inductor's mode for our graphs (CapskipConfig.mode)."""
    from_env = not options
    opts = options_from_env() if from_env else dict(options)
    if mode is not None:
        opts["mode"] = mode
    key = repr(sorted(opts.items(), key=lambda kv: kv[0]))
    params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter)]
    owner, frame_module = _owning_module(params)
    backend = _BY_OWNER.get(owner, {}).get(key) if owner is not None else None
    if backend is None:
        backend = next((b for b in (_BY_PARAM.get(p, {}).get(key) for p in params) if b is not None), None)
    last = _LAST[0]() if _LAST[0] is not None else None
    if backend is None and owner is None and last is not None and last.options_key == key:
        backend = last
    if backend is None:
        backend = _string_backend(opts, from_env)
        backend.options_key = key
    if owner is not None and key not in _BY_OWNER.get(owner, {}):
        if frame_module is owner and getattr(owner, "_compiled_call_impl", None) is not None:
            # the module compiled in place again, with other options: its compiled call is the new one's, so
            # are stats() and report(); the earlier backends no longer run its forward, and the new call gets
            # the binding and the batch marking the old one had
            _BY_OWNER.pop(owner, None)
            _OWNER_BOUND.discard(owner)
            _MARKED.discard(owner)
            _MARKS_RAN.pop(owner, None)
        _BY_OWNER.setdefault(owner, {})[key] = backend
        backend.state.published.owner = weakref.ref(owner)
        if owner not in _OWNER_BOUND:  # else bind() installed it before the first forward: it finds this backend
            _install_binding(owner, _BindLogits(backend, owner))
        for m in (owner, getattr(owner, "_orig_mod", None), getattr(owner, "module", None)):
            pending = _PENDING_STATE.pop(m, None) if m is not None else None
            if pending is not None:  # capskip_fx.load_state_dict before the first step: restore now
                backend.state.load_state_dict(pending)
    for p in params:
        _BY_PARAM.setdefault(p, {})[key] = backend
    _LAST[0] = weakref.ref(backend)
    _pin_to_module(gm)
    # only where the batch came static: a mark added on a frame traced dynamic would recompile it for nothing
    # (a batch of 1 is specialised whatever the marks: compiled, its step recorded dense by design)
    if frame_module is not None and _static_batch(gm) and not _one_row(example_inputs) \
            and install_batch_marking(frame_module) and not _MARKS_RAN.get(frame_module, False):
        return _StaticFirst(gm, backend)
    return backend(gm, example_inputs)  # a static batch with marks on: the model specialises it (refused, said)


#: the note of a static first batch's step (see mark_batch_dynamic below): dense by design, not a fallback
STATIC_FIRST = ("the first batch was traced with a static size: this step ran eagerly (dense); the next recompiles "
                "once with the batch marked dynamic on the model's inputs")
_STATIC_RECORDED: "weakref.WeakSet[CapskipBackend]" = weakref.WeakSet()  # backends whose static step is in stats


class _StaticFirst:
    """A graph traced with a static batch whose later calls arrive marked dynamic: Dynamo replaces it at the
    next call, so it runs as traced (eager, dense, exact) instead of being compiled for one step.  The first
    one to run records the step (once per model: every graph of that first forward is one of these)."""

    def __init__(self, gm: fx.GraphModule, backend: CapskipBackend):
        self.gm, self.backend = gm, weakref.ref(backend)

    def __call__(self, *args):
        out = self.gm(*args)
        backend = self.backend()
        if backend is not None and torch.is_grad_enabled() and backend not in _STATIC_RECORDED:
            _STATIC_RECORDED.add(backend)
            rows = [a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
                    and a.dim() > 0]
            grads = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            if rows:
                # claimed by this step's backward (a hook on the output), so graphs it runs (a checkpoint's
                # recompute) fold into it, and the next step's backward does not take it for its own
                backend.state.record_dense_step(int(rows[0].shape[0]), None, at_forward=True)
                backend.state.clock.last.note = STATIC_FIRST
                if grads:
                    grads[0].register_hook(functools.partial(_claim, backend.state, int(rows[0].shape[0])))
        return out


def _claim(state, n: int, grad) -> None:
    """A tensor hook that claims the step for the running backward; returns None (the gradient unchanged).
    A later backward through the same output (retain_graph) is a step of its own, as through a compiled graph."""
    if not state.clock.claim():
        state.record_dense_step(n, None, at_forward=True)
        state.clock.last.note = STATIC_FIRST
        state.clock.claim()


#: per backend, the logits its binding took last: a forward whose two binding hooks both run (bind()'s
#: forward hook and an in-place compile's wrapped call) is bound, or recorded dense, once
_HOOKED: "weakref.WeakKeyDictionary[CapskipBackend, weakref.ref]" = weakref.WeakKeyDictionary()


class _BindLogits:
    """Forward hook on the model that owns a string backend's graphs: binds each training forward to the
    autograd node of the logits it returns (RuntimeState.end_forward), so only that graph runs the rule.
    Logits from eager code (a head left out of a regional compile) make the step dense, with the reason."""

    def __init__(self, backend: "CapskipBackend", owner: torch.nn.Module):
        self.backend, self.owner = weakref.ref(backend), weakref.ref(owner)

    def __call__(self, module, args, out) -> None:
        backend = self.backend()
        if backend is None or not torch.is_grad_enabled() or module is not self.owner():
            return  # a deep copy of the model (an EMA, a reference) carries this hook too: not ours
        logits = logits_of(out, backend.logits_index)
        state = backend.state
        if not isinstance(logits, torch.Tensor) or not logits.requires_grad or logits.dim() != 2:
            return  # nothing to bind (token-shaped outputs): each graph records its own reason
        last = _HOOKED.get(backend)
        if last is not None and last() is logits:
            return  # this forward's other binding hook took it (an eager step would be counted twice)
        _HOOKED[backend] = weakref.ref(logits)
        if not state.end_forward(ForwardContext(), logits, by_hook=True, out=out):
            state.warn_once(UNBOUND_REASON)
            state.record_dense_step(int(logits.shape[0]), UNBOUND_REASON, at_forward=True)


class _BindOwner:
    """``_BindLogits`` for every backend that compiled a graph of ``owner``, looked up at each forward: installed
    by ``bind`` before the first forward, so its first step is bound too (a hook registered during the
    forward that compiles the first graph would miss that forward)."""

    def __init__(self, owner: torch.nn.Module):
        self.owner = weakref.ref(owner)

    @torch._dynamo.disable  # a module compiled in place after bind() traces its hooks: this one stays eager
    def __call__(self, module, args, out) -> None:
        owner = self.owner()
        for backend in list(_BY_OWNER.get(owner, {}).values()) if owner is not None else ():
            _BindLogits(backend, owner)(module, args, out)


def _install_binding(owner: torch.nn.Module, binder) -> None:
    if getattr(owner, "_compiled_call_impl", None) is not None:
        # compiled in place (m.compile()): Dynamo traced its _call_impl, hooks included, and does not guard
        # on hooks added later; the compiled call itself is wrapped so that the binding runs eagerly
        owner._compiled_call_impl = _BoundCall(owner._compiled_call_impl, binder)
    else:
        owner.register_forward_hook(binder)


class _BoundCall:
    """An in-place compiled module's compiled call, then the forward's binding (``_BindLogits``), eagerly."""

    def __init__(self, call, bind: _BindLogits):
        self.call, self.bind = call, bind

    def __call__(self, *args, **kwargs):
        out = self.call(*args, **kwargs)
        owner = self.bind.owner()
        if owner is not None:
            self.bind(owner, args, out)
        return out


def _pin_to_module(gm: fx.GraphModule) -> None:
    """Guard this graph's cache entry on the identity of the module its parameters come from.

    Dynamo shares cache entries across instances of one class (parameters are graph inputs) and treats
    equal ``torch.compile(backend="capskip")`` wrappers as one backend, so a second instance would run the
    first one's backend, rule state and settings.  Each instance thus compiles its own entry; beyond
    ``torch._dynamo.config.recompile_limit`` instances of one class, ``isolate_recompiles=True`` keeps them
    apart (torch.compile's own option)."""
    from torch._dynamo.guards import GuardBuilder

    tc = torch._guards.TracingContext.try_get()
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        if arg is not None and isinstance(getattr(arg, "example", None), torch.nn.Parameter) and tc is not None:
            root = arg.source
            while getattr(root, "base", None) is not None:
                root = root.base
            tc.guards_context.dynamo_guards.add(root.make_guard(GuardBuilder.ID_MATCH))
            return


# -- the model a graph belongs to -------------------------------------------------------------------------
_OWNER_BOUND: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models bind() installed _BindOwner on
_ROOT_OF: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # Parameter -> weakref of the model bound for it
# the module torch.compile returned, by the module it wraps
_WRAPPER_OF: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def bind(model: torch.nn.Module) -> None:
    """Bind ``model`` (the module ``torch.compile`` returned, or one compiled in place or holding modules
    compiled in place) as the owner of every string-backend graph whose parameters are all its own: the model
    that graph's rule state, forward binding and published rows belong to.  A parameter keeps the outermost
    model bound for it.  Idempotent."""
    from torch._dynamo.eval_frame import OptimizedModule

    inner = model._orig_mod if isinstance(model, OptimizedModule) else model
    if inner is not model:
        _WRAPPER_OF[inner] = weakref.ref(model)
    for m in inner.modules():  # torch.compile modules assigned as its submodules: their graphs' frames
        if isinstance(m, OptimizedModule) and m._orig_mod not in _WRAPPER_OF:
            _WRAPPER_OF[m._orig_mod] = weakref.ref(m)
    # the forward binding, from the first step on; not on a plain module none of whose parts is compiled yet:
    # one compiled in place later would trace the hook (the first compile installs it then, as without bind)
    compiled = any(map(compiled_part, model.modules()))
    if compiled and model not in _OWNER_BOUND and model not in _BY_OWNER:
        _OWNER_BOUND.add(model)
        _install_binding(model, _BindOwner(model))
    ref, held = weakref.ref(model), {}  # held: id of a model bound before -> whether ``model`` holds it
    for p in inner.parameters():
        old = _ROOT_OF.get(p)
        old = old() if old is not None else None
        if old is not None and old is not model and id(old) not in held:
            held[id(old)] = _holds(model, old)
        if old is None or (old is not model and held[id(old)]):
            _ROOT_OF[p] = ref


def compiled_part(module: torch.nn.Module) -> bool:
    """``module`` is compiled: in place (``m.compile()``) or the module ``torch.compile`` returned."""
    from torch._dynamo.eval_frame import OptimizedModule

    return getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, OptimizedModule)


def _holds(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    outer = getattr(outer, "_orig_mod", outer)
    return any(m is inner or getattr(inner, "_orig_mod", None) is m for m in outer.modules())


def _owning_module(params: list) -> tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """(owner, frame module) of a graph.  The owner is the model the graph belongs to: the model bound for
    all its parameters (``bind``), else the one found on the call stack (``_stack_owner``, counted).  The
    frame module is the one whose compiled call Dynamo is tracing (compat.traced_module): the
    ``torch.compile``'d module around it, else the module itself if compiled in place, else None (a function,
    or a frame resumed inside a submodule after a graph break)."""
    from torch._dynamo.eval_frame import OptimizedModule

    traced = compat.traced_module()
    frame = None
    if traced is not None:
        wrapper = _WRAPPER_OF.get(traced)
        frame = wrapper() if wrapper is not None else None
        if frame is None and getattr(traced, "_compiled_call_impl", None) is not None:
            frame = traced
    owner = _bound_root(params if params else (list(traced.parameters()) if traced is not None else []))
    if isinstance(owner, OptimizedModule):
        # another torch.compile wrapper of the same module (an evaluation wrapper, a re-wrap with other
        # options) is its own model: its own binding, batch marking and stats, not the first one bound's
        called = _calling_wrapper(owner._orig_mod)
        if called is not None and called is not owner:
            counters()["wrapper from the call stack"] += 1
            bind(called)
            return called, called
    if owner is not None:
        if frame is None and isinstance(owner, OptimizedModule):
            frame = owner  # a frame resumed inside it after a graph break: its compiled call marks the batch
        return owner, frame
    counters()["owner from the call stack"] += 1
    owner, stack_frame = _stack_owner(params)
    if owner is not None:
        bind(owner)  # its later graphs find it without the call stack
    return owner, stack_frame if stack_frame is not None else frame


def _calling_wrapper(inner: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The innermost torch.compile'd module (OptimizedModule) around ``inner`` being called on the Python
    stack, if any: the wrapper whose call Dynamo is compiling (one walk per graph compiled)."""
    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    while frame is not None:
        mod = frame.f_locals.get("self")
        if isinstance(mod, OptimizedModule) and mod._orig_mod is inner:
            return mod
        frame = frame.f_back
    return None


def _bound_root(params: list) -> Optional[torch.nn.Module]:
    """The one live model bound for every parameter in ``params``; None if any is unbound or they differ."""
    roots = {id(r): r for r in ((_ROOT_OF.get(p) or (lambda: None))() for p in params)}
    return next(iter(roots.values())) if len(roots) == 1 and None not in roots.values() else None


def _stack_owner(params: list) -> tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """(owner, frame module) from the Python frames of the call being traced, for a model not bound yet:
    Dynamo hands a backend the graph only, and the caller that holds the module ``torch.compile`` returned, or
    the root model of a regional compile, is known only there.  The owner: the torch.compile'd module
    (OptimizedModule) being called, else the outermost module being called that holds all the graph's
    parameters (the root model for ``m.compile()`` and for layers compiled in place, under DDP or a trainer's
    wrapper alike); without parameters, the innermost module being called; None outside any module.  The
    frame module: that OptimizedModule, else the innermost module being called that is compiled in place."""
    from torch._dynamo.eval_frame import OptimizedModule

    called: list[torch.nn.Module] = []  # innermost first
    frame = sys._getframe(1)
    while frame is not None:
        mod = frame.f_locals.get("self")
        if isinstance(mod, OptimizedModule):
            return _model_holding(mod, frame.f_back) or mod, mod
        if isinstance(mod, torch.nn.Module) and all(mod is not c for c in called):
            called.append(mod)
        frame = frame.f_back
    in_place = next((m for m in called if getattr(m, "_compiled_call_impl", None) is not None), None)
    if not params:
        return (called[0] if called else None), in_place
    ids = {id(p) for p in params}
    return next((m for m in reversed(called) if ids <= {id(p) for p in m.parameters()}),
                called[0] if called else None), in_place


def _model_holding(wrapper: torch.nn.Module, frame) -> Optional[torch.nn.Module]:
    """The outermost model whose ``forward`` is running on the stack from ``frame`` outwards, holds ``wrapper`` (a
    ``torch.compile`` module assigned as a submodule: ``model.block = torch.compile(...)``) and trains parameters
    of its own outside every such wrapper (layers of its own, eager); None if there is none.  Such a model owns
    the wrapper's graphs, as it does a submodule compiled in place: its forward's returned logits decide the step
    (eager layers after the wrapper make it dense, with the reason), where the wrapper's own output would leave
    them the unweighted gradient.  A holder without trainable parameters of its own (a container that computes
    the loss, timm's task) leaves the wrapper its own model, as do DDP, FSDP and DataParallel."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = None
    while frame is not None:
        mod = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(mod, torch.nn.Module) and \
                not isinstance(mod, (OptimizedModule,) + _PASS_THROUGH) and mod is not wrapper and \
                _holds(mod, wrapper) and _trains_own_parameters(mod):
            found = mod
        frame = frame.f_back
    if found is not None:
        counters()["model holding the wrapper"] += 1
    return found


def _trains_own_parameters(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a parameter that requires grad outside every torch.compile module it holds."""
    from torch._dynamo.eval_frame import OptimizedModule

    wrapped = {id(p) for m in model.modules() if isinstance(m, OptimizedModule) for p in m.parameters()}
    return any(p.requires_grad and id(p) not in wrapped for p in model.parameters())


def _pass_through() -> tuple:
    from torch.nn import DataParallel
    from torch.nn.parallel import DistributedDataParallel

    kinds = [DataParallel, DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds.append(FullyShardedDataParallel)
    except ImportError:  # a torch built without distributed
        pass
    return tuple(kinds)


_PASS_THROUGH = _pass_through()


def _string_backend(opts: dict, from_env: bool) -> CapskipBackend:
    opts = dict(opts)
    rule, budget, seed = opts.pop("rule", "capskip"), opts.pop("budget", 0.1), opts.pop("seed", 0)
    logits_index = opts.pop("logits_index", None)
    try:
        if "dynamic_batch" in opts:
            raise ValueError(f"dynamic_batch is capskip_fx.compile's option; backend='capskip' marks the batch "
                             f"dynamic unless {ENV_DYNAMIC_BATCH}=0 is set in the environment")
        config, rule, rule_opts = split_options(rule, opts)
        state = RuntimeState(build_rule(rule, budget, rule_opts), seed=seed, scope=config.scope)
        state.print_at_exit = True
    except (TypeError, ValueError) as e:
        where = f"{ENV_RULE} / {ENV_BUDGET} / {ENV_OPTIONS}" if from_env else "torch.compile(options=...)"
        raise ValueError(f"capskip backend settings ({where}): {e}") from None
    return CapskipBackend(config, state, ops.register(state), logits_index)


def backend_of(module) -> Optional[CapskipBackend]:
    """The string backend that compiled ``module`` (the module torch.compile returned, or the original),
    the one holding its head graph when several settings compiled it (a module compiled in place again with
    other options: the last compile's); None if none did."""
    own: list[CapskipBackend] = list(_BY_OWNER.get(module, {}).values()) if isinstance(module, torch.nn.Module) else []
    if own:  # the backends of its own forward (a module compiled in place again: the last one's)
        return next((b for b in own if b.any_head), own[0])
    found: list[CapskipBackend] = []
    inner = getattr(module, "_orig_mod", module)
    for p in inner.parameters() if isinstance(inner, torch.nn.Module) else ():
        for b in _BY_PARAM.get(p, {}).values():
            if b not in found:
                found.append(b)
    return next((b for b in found if b.any_head), found[0] if found else None)


# -- the batch, dynamic on the model's own inputs ----------------------------------------------------------
# Dynamo traces a tensor's dim 0 as a size symbol only when the tensor is marked (or its size has changed).
# A drop_last loader never changes it, and the selected-row backward needs the symbol.  capskip_fx.compile
# marks its inputs itself; here the marking is installed on the compiled callable of the frame a graph came
# from (an in-place compiled module, each block of a regional compile) or as a pre-hook of the
# torch.compile'd module.  Installed at that frame's first graph, it marks from the next call on: Dynamo
# guards on the marks (a tensor marked where the cached entry saw none recompiles), so step 0 runs dense on
# a static batch and step 1 recompiles once with a dynamic one.  compile_regions installs it before the
# first call, so its step 0 selects.
_MARKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_MARKS_RAN: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()  # marked a call yet


def mark_batch_dynamic(inputs) -> None:
    """Mark dim 0 weakly dynamic (``maybe_mark_dynamic``: a model that fixes it specialises it, no error) on
    every tensor among ``inputs`` (any container) whose dim 0 is the batch (the first tensor's dim 0)."""
    leaves = [a for a in torch.utils._pytree.tree_leaves(inputs) if isinstance(a, torch.Tensor) and a.dim() > 0]
    n = leaves[0].shape[0] if leaves else 0
    if n < 2:  # a batch of 1 specialises anyway (and its backward could not drop rows)
        return
    for a in leaves:
        if a.shape[0] == n:
            torch._dynamo.maybe_mark_dynamic(a, 0)


class _MarkedCall:
    """An in-place compiled module's compiled call, its batch marked dynamic first."""

    def __init__(self, call, module: torch.nn.Module):
        self.call, self.module = call, weakref.ref(module)

    def __call__(self, *args, **kwargs):
        mark_batch_dynamic((args, kwargs))
        module = self.module()
        if module is not None:
            _MARKS_RAN[module] = True
        return self.call(*args, **kwargs)


@torch._dynamo.disable  # under an outer torch.compile of the wrapper (its own frame compiles, marked)
def _mark_pre_hook(module, args, kwargs):
    mark_batch_dynamic((args, kwargs))
    _MARKS_RAN[module] = True


def install_batch_marking(module: torch.nn.Module) -> bool:
    """Mark the batch of every later call of ``module`` dynamic: ``module`` is compiled in place
    (``m.compile()``: its compiled call is wrapped) or is the module ``torch.compile`` returned (a pre-hook,
    which runs before its compiled frame).  False when the module is neither, marking is switched off
    (``CAPSKIP_DYNAMIC_BATCH=0``), or this torch does not recompile on the mark (2.11: the static batch then
    runs the documented dense fallback); True once installed (idempotent)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not dynamic_batch_enabled() or not compat.weak_marks_recompile():
        return False
    if module in _MARKED:
        return True
    if getattr(module, "_compiled_call_impl", None) is not None:
        module._compiled_call_impl = _MarkedCall(module._compiled_call_impl, module)
    elif isinstance(module, OptimizedModule):
        module.register_forward_pre_hook(_mark_pre_hook, with_kwargs=True)
    else:
        return False
    _MARKED.add(module)
    return True


def _one_row(example_inputs) -> bool:
    """The frame's first tensor argument that is not a parameter (the batch) has one row."""
    rows = [t for t in example_inputs if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
            and t.dim() > 0]
    return bool(rows) and rows[0].shape[0] == 1


def _static_batch(gm: fx.GraphModule) -> bool:
    """No tensor input's dim 0 is a size symbol: Dynamo traced this frame with a static batch.  (The backend's
    example inputs are the real tensors; the traced sizes are on the placeholders.)"""
    vals = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    tensors = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() > 0]
    return bool(tensors) and not any(isinstance(v.shape[0], torch.SymInt) for v in tensors)


#: Dynamo source names of a compiled frame's own tensor arguments (``L['x']``, ``L['args'][0]``; not attributes
#: of them: no parameter, no buffer), dim 0 only.  Weakly dynamic: a model that fixes its batch specialises it.
BATCH_SOURCES = r"L\['[^']*'\](\[[^\]]*\])?$:0"


def process_wide_batch_dynamic() -> bool:
    """Dim 0 of every compiled frame's tensor arguments dynamic, process-wide (``dynamic_sources``): only for
    FSDP2-sharded blocks (compile_regions), whose pre-forward re-creates the block's inputs through an
    autograd Function, so a mark on the tensors the block was called with never reaches its frame.  False
    where this torch has no per-dim dynamic sources or marking is off."""
    from torch._dynamo.variables import builder

    if not dynamic_batch_enabled() or not hasattr(builder, "_parse_source_entry"):
        return False
    cfg = torch.compiler.config
    entries = [e for e in cfg.dynamic_sources.split(",") if e.strip()]
    if BATCH_SOURCES not in entries:
        cfg.dynamic_sources = ",".join(entries + [BATCH_SOURCES])
    return True


backend = capskip_backend
