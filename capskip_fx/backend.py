"""The torch.compile backend object: Inductor's ``compile_fx`` with capskip's pass pipeline.

One backend per ``capskip_fx.compile`` call (Dynamo matches compiled entries by backend
object, so configs must not share one).  It wires the two pipelines of ``passes/pipeline.py`` into
Inductor's hooks (``joint_custom_pre_pass``, ``inner_compile``), turns their results into the graph's
record and the wrappers that run it, and remembers every graph it received, what was rewritten and
why it was refused (``records``), like Thunder's backend.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from . import aot_cache, ops
from .config import (ENV_BUDGET, ENV_OPTIONS, ENV_RULE, CapskipConfig, dynamic_batch_enabled, options_from_env,
                     split_options)
from .passes import pipeline
from .records import BackwardMode, CompileRecord, GraphRecord, Refusal, RefusalKind, counters
from .functions import undeclared_function
from .rules import build_rule
from .runtime.backward import SelectedRowBackward
from .runtime.state import UNBOUND_REASON, ForwardContext, RuntimeState, logits_of
from .vcas import build_backward as vcas_backward

_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


class _Interpreted:
    """aot_eager's 'compiled' graph: an FX interpreter that records matmul row counts."""

    def __init__(self, gm: fx.GraphModule, record: Optional[GraphRecord] = None):
        self._boxed_call = True
        self.gm = gm
        self.record = record

    def __call__(self, args: list) -> Any:
        rows = []
        record = self.record

        class _I(fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if record is not None and n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in _MATMULS:
                    args = [a for a in self.fetch_args_kwargs_from_env(n)[0] if isinstance(a, torch.Tensor)]
                    rows.append((str(n.target), [tuple(a.shape) for a in args]))
                return out

        out = _I(self.gm).run(*args)
        args.clear()
        if record is not None:
            if record.segmented:  # a segment: the runner clears the list once per backward
                record.matmul_shapes.extend(rows)
            else:
                record.matmul_shapes = rows
        return out


class _Forward:
    """Forward wrapper: refuse compiled autograd; tag batch-carrying outputs as (weakly) dynamic in dim 0.

    Across a graph break Dynamo traces the next graph from real tensors, so its batch would be
    static and the head graph could not drop rows.  The tag is what ``maybe_mark_dynamic`` sets.
    """

    def __init__(self, compiled, out_idx: list[int], training: bool, published=None):
        self._boxed_call = True
        self.compiled = compiled
        self.out_idx = out_idx
        self.training = training
        self.published = published  # runtime/published.py: watches the outputs for hooks (reuse of rows)

    def __call__(self, args):
        if self.training:
            RuntimeState.check_not_compiled_autograd()
        outs = self.compiled(args)
        for i in self.out_idx:
            o = outs[i]
            if isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(o, 0)
        if self.training and self.published is not None:
            self.published.watch(id(self), [outs[i] for i in self.out_idx])
        return outs

    def __getattr__(self, name):
        return getattr(self.compiled, name)


class _DenseBackward:
    """Backward of a refused graph: plain dense.  Without bound forwards (the string backend) it is what
    records the step (n rows, all kept, the reason) in stats(); CapskipModule records it at its forward."""

    def __init__(self, compiled, state: RuntimeState, reason: Optional[str], batch_arg: Optional[int]):
        self._boxed_call = True
        self.compiled, self.state, self.reason, self.batch_arg = compiled, state, reason, batch_arg

    def __call__(self, args):
        if not self.state.bound_forwards and self.batch_arg is not None:
            self.state.record_dense_graph(int(args[self.batch_arg].shape[0]), self.reason)
        return self.compiled(args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def _batch_arg(example_inputs) -> Optional[int]:
    """Index of the first input whose dim 0 is a plain symbol (the batch), else of the first tensor."""
    tensors = [(i, t) for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0]
    sym = [i for i, t in tensors if isinstance(t.shape[0], torch.SymInt) and t.shape[0].node.expr.is_Symbol]
    return sym[0] if sym else (tensors[0][0] if tensors else None)


def _trace(name: str, payload) -> None:
    """A structured-trace artifact (tlparse shows it beside Inductor's graphs)."""
    torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                                    payload_fn=payload)


class _RaiseOnCall:
    """Forward of a graph refused with ``on_coupling="error"``: raise at its first run, not at compile
    time (Dynamo would wrap a compile-time error in BackendCompilerFailed)."""

    def __init__(self, message: str):
        self._boxed_call = True
        self.message = message

    def __call__(self, args):
        args.clear()
        raise ValueError(self.message)


class _Keyless:
    """A compiled graph AOTAutogradCache must not store (its key hidden: graph_compile.py _should_save_cache)."""

    _fx_graph_cache_key = None

    def __init__(self, compiled):
        self._boxed_call = True
        self.compiled = compiled

    def __call__(self, args):
        return self.compiled(args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


@dataclass
class Built:
    """What ``_inner`` built around one compiled graph: enough to build it again around the same graph
    served by AOTAutogradCache (stored beside Inductor's cache, aot_cache.py).  Nothing per model: the
    wrappers are rebuilt for the compiling backend's state."""

    kind: str  # "forward", "dense" (plain or _DenseBackward) or "rows" (SelectedRowBackward)
    record: CompileRecord = field(default_factory=CompileRecord)  # the graph's compile record (its plan included)
    head_bias: Optional[bool] = None  # the head graph's (the state's is set by the graph that found the head)
    out_idx: list = field(default_factory=list)
    training: bool = True
    batch_arg: Optional[int] = None
    in_graph: bool = False  # the backward gathers / scatters itself (gather="graph")


def _batch_outputs(gm: fx.GraphModule) -> list[int]:
    """User-visible forward outputs with the batch symbol as dim 0 (not saved activations: one of
    those may be the user's input tensor, and tagging it would fail Dynamo's guard next step)."""
    out = list(gm.graph.find_nodes(op="output"))[0]
    outs = out.args[0]
    visible = out.meta.get("user_visible_output_idxs") or []
    idx = []
    for i in visible:
        o = outs[i]
        v = o.meta.get("val") if isinstance(o, fx.Node) and o.op != "placeholder" else None
        if isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(v.shape[0], torch.SymInt) \
                and v.shape[0].node.expr.is_Symbol:
            idx.append(i)
    return idx


def _no_donated_buffers() -> None:
    """Let retain_graph/create_graph backwards run: our gathered inputs are fresh copies, so
    donating the saved activations' buffers to the backward buys little here."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is not None and hasattr(meta, "bw_donated_idxs"):
        meta.bw_donated_idxs = []


def _eager_inner(gm: fx.GraphModule, example_inputs, record: Optional[GraphRecord] = None, **kwargs):
    return _Interpreted(gm, record if kwargs.get("is_backward") else None)


class CapskipBackend:
    def __init__(self, config: CapskipConfig, state: RuntimeState, key: int, logits_index: Optional[int] = None):
        self.config = config
        self.state = state
        self.key = key
        self.logits_index = logits_index
        self.records: list[GraphRecord] = []
        self.options_key: Optional[str] = None  # string backend: the settings it was made for

    @property
    def any_head(self) -> bool:
        return any(r.head for r in self.records)

    @property
    def refusal(self) -> Optional[Refusal]:
        """The first graph's compile-time refusal: why a model none of whose graphs selects runs dense."""
        return next((r.compiled.refusal for r in self.records if r.compiled.refusal is not None), None)

    def _settle(self, rec: GraphRecord, fields: dict) -> None:
        """A pipeline result into the graph's record (the one path a compile-time refusal takes): the
        graph's first refusal is counted (GraphRecord.settle) and warned once."""
        refusal = rec.settle(**fields)
        if refusal is not None:
            where = f" [{refusal.where}]" if refusal.where else ""
            runs = ("dense backward for this graph: all rows, the rule's weights applied (dense-masked: exact, "
                    "no speed-up)" if fields.get("backward") == BackwardMode.DENSE_MASKED else
                    "dense backward for this graph (other graphs may still select: see report())")
            self.state.warn_once(f"{refusal.detail} -> {runs}{where}")

    def __call__(self, gm: fx.GraphModule, example_inputs, **kwargs):
        from torch._dynamo.utils import counters as torch_counters
        from torch._inductor.compile_fx import compile_fx

        rec = GraphRecord(index=len(self.records), nodes=len(gm.graph.nodes))
        self.records.append(rec)
        counters()["graphs"] += 1
        unproven = undeclared_function(gm)
        refused = None
        if unproven is not None:  # the joint pass then leaves the graph alone: a plain dense backward
            refused = Refusal(RefusalKind.UNDECLARED_FUNCTION, unproven)
            self._settle(rec, {"refusal": refused})
        ctx = pipeline.JointContext(self.key, self.logits_index, self.config.on_coupling, refused)
        joint = pipeline.JointPass(ctx, self.config, functools.partial(self._joint_done, rec))
        patches = {**self.config.inductor_options(), "joint_custom_pre_pass": joint}
        if self._aot_cache():  # a hit rebuilds our wrappers around the served graphs
            patches["cudagraph_policy"] = aot_cache.RebuildPolicy(functools.partial(self._rebuild, rec),
                                                                  lambda: self._inner_depth > 0)
            cache = contextlib.nullcontext()
        else:  # a hit would skip our inner compile: no wrappers, a dense backward
            cache = torch._functorch.config.patch(enable_autograd_cache=False)
        hits = torch_counters["aot_autograd"]["autograd_cache_hit"]
        with cache:
            out = compile_fx(gm, example_inputs, inner_compile=functools.partial(self._inner, rec),
                             config_patches=patches)
        if torch_counters["aot_autograd"]["autograd_cache_hit"] > hits and not rec.cached:
            raise RuntimeError("capskip_fx: AOTAutogradCache served a graph without calling the cache policy "
                               f"that rebuilds capskip's backward (torch {torch.__version__}); set "
                               "TORCHINDUCTOR_AUTOGRAD_CACHE=0 and report this torch version")
        return out

    def _joint_done(self, rec: GraphRecord, result: pipeline.JointResult) -> None:
        rec.joint = result
        self._settle(rec, result.record_fields())
        if result.head:
            self.state.head_bias = result.head_bias

    _inner_depth = 0  # > 0 while _inner runs

    def _aot_cache(self) -> bool:
        """Whether AOTAutogradCache may serve this backend's graphs: Inductor graphs whose wrappers we can
        describe (not VCAS: its backward is several graphs and calls back into a per-model runner), and
        no CUDA graphs / user cudagraph policy (ours would replace it)."""
        from torch._inductor import config as inductor_config

        return (aot_cache.available() and self.config.backend == "inductor" and self.config.vcas is None
                and inductor_config.cudagraph_policy is None and not inductor_config.triton.cudagraphs
                and not self.config.inductor_options().get("triton.cudagraphs", False))

    def _base(self, rec: GraphRecord):
        if self.config.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx_inner
            return compile_fx_inner
        return functools.partial(_eager_inner, record=rec)

    def _inner(self, rec: GraphRecord, gm: fx.GraphModule, example_inputs, **kwargs):
        """Inductor's inner compile: our passes, compile, wrap; describe the wrappers for AOTAutogradCache."""
        self._inner_depth += 1
        try:
            compiled, built = self._compile(rec, gm, example_inputs, kwargs)
        finally:
            self._inner_depth -= 1
        if built is None:  # nothing a description can rebuild: AOTAutograd must not store it
            return compiled if isinstance(compiled, _RaiseOnCall) else _Keyless(compiled)
        built.record = rec.compiled
        built.head_bias = self.state.head_bias if rec.head else None
        key = getattr(compiled, "_fx_graph_cache_key", None)
        if key is not None and aot_cache.installed():  # AOTAutogradCache is on for this compile
            aot_cache.save(key, built)
        return self._wrap(rec, built, compiled)

    def _rebuild(self, rec: GraphRecord, built: Built, compiled):
        """A graph served by AOTAutogradCache: the record and wrappers ``_inner`` made for it, for this
        backend's state."""
        fields = {f: getattr(built.record, f) for f in CompileRecord.__dataclass_fields__}
        self._settle(rec, fields)  # its refusal counted and warned once per graph, as on a compile
        if built.head_bias is not None:
            self.state.head_bias = built.head_bias
        rec.cached = True
        if built.kind == "rows":
            if rec.backward == BackwardMode.SELECTED:
                counters()["rewritten"] += 1
            self.state.variants += 1
            counters()["variants"] += 1
        return self._wrap(rec, built, compiled)

    def _wrap(self, rec: GraphRecord, built: Built, compiled):
        if built.kind == "forward":
            wrapper = _Forward(compiled, built.out_idx, built.training, self.state.published)
        elif built.kind == "dense":
            wrapper = _DenseBackward(compiled, self.state, rec.reason, built.batch_arg) if rec.reason else compiled
        else:
            wrapper = SelectedRowBackward(compiled, rec.plan, self.state, self.config, rec,
                                          dense_only=rec.backward != BackwardMode.SELECTED, in_graph=built.in_graph)
        return aot_cache.carry_cache_attrs(wrapper, compiled)

    def _compile(self, rec: GraphRecord, gm: fx.GraphModule, example_inputs, kwargs) -> tuple[Any, Optional[Built]]:
        """(the compiled graph, or our wrapper where it cannot be described; its description or None)."""
        base = self._base(rec)
        if not kwargs.get("is_backward", False):
            if rec.error is not None:
                return _RaiseOnCall(rec.error), None
            out_idx = _batch_outputs(gm)
            compiled = base(gm, example_inputs, **kwargs)
            return compiled, Built("forward", out_idx=out_idx, training=rec.backward != BackwardMode.INFERENCE)
        _no_donated_buffers()
        vcas = functools.partial(vcas_backward, self.config, self.state, rec) if self.config.vcas is not None else None
        ctx = pipeline.BackwardContext(base, kwargs, self.config.gather, vcas,
                                       fused_prefix=not self.state.rule.reads_gradient)
        res = pipeline.backward(gm, example_inputs, rec.joint, ctx)
        self._settle(rec, res.record_fields())
        if res.plan is None:
            if res.refusal is None:  # no selection node: the plain backward
                return res.compiled, Built("dense", batch_arg=_batch_arg(example_inputs))
            if res.select_in_graph:  # a head graph: select runs in its backward, at N rows
                self.state.masked_reason = self.state.masked_reason or res.refusal.detail
            return res.compiled, None  # its graph calls select(..., key): this model's
        if res.in_graph:
            counters()["gather_in_graph"] += 1
        if res.mode == BackwardMode.SELECTED:
            counters()["rewritten"] += 1
        self.state.variants += 1
        counters()["variants"] += 1
        _trace(f"capskip_backward_graph_{rec.index}", lambda: f"# {rec.backward}: {res.plan.gathered_inputs} gathered "
               f"inputs, reason: {rec.reason}\n" + res.graph.print_readable(print_output=False))
        if res.prefix is None and not res.segmented:
            return res.compiled, Built("rows", in_graph=res.in_graph)
        # several graphs (a prefix, VCAS's segments): not described
        return SelectedRowBackward(res.compiled, res.plan, self.state, self.config, rec,
                                   dense_only=rec.backward != BackwardMode.SELECTED, prefix=res.prefix,
                                   prefix_gathered=res.prefix_gathered,
                                   in_graph=res.in_graph), None


# -- the string backend: torch.compile(model, backend="capskip"[, options={...}]) ----------------------
# One CapskipBackend (one rule state, one record list) per model and settings, so all graphs of a model
# (graph breaks, recompiles, every block of a regional compile, every layer compiled in place) share it,
# and it is freed with the model.  The model is settled by the module tree (_owning_module): the outermost
# module being called that holds the graph's parameters.  A forward hook on it binds each forward to the
# autograd node of its logits, so exactly one graph per forward (the one returning the logits) runs the
# rule, and every other graph drops only the rows that reach it with no gradient.  For torch.compile of a
# function (no module): the backend that compiled a graph taking the same parameters, else the one that
# compiled the previous graph.
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
    owner = _owning_module(params)
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
        _BY_OWNER.setdefault(owner, {})[key] = backend
        backend.state.published.owner = weakref.ref(owner)
        bind = _BindLogits(backend, owner)
        if getattr(owner, "_compiled_call_impl", None) is not None:
            # compiled in place (m.compile()): Dynamo traced its _call_impl, hooks included, and does not guard
            # on hooks added later; the compiled call itself is wrapped so that the binding runs eagerly
            owner._compiled_call_impl = _BoundCall(owner._compiled_call_impl, bind)
        else:
            owner.register_forward_hook(bind)
        for m in (owner, getattr(owner, "_orig_mod", None), getattr(owner, "module", None)):
            pending = _PENDING_STATE.pop(m, None) if m is not None else None
            if pending is not None:  # capskip_fx.load_state_dict before the first step: restore now
                backend.state.load_state_dict(pending)
    for p in params:
        _BY_PARAM.setdefault(p, {})[key] = backend
    _LAST[0] = weakref.ref(backend)
    _pin_to_module(gm)
    return backend(gm, example_inputs)


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
        if not isinstance(logits, torch.Tensor) or not logits.requires_grad or logits.dim() != 2:
            return  # nothing to bind (token-shaped outputs): each graph records its own reason
        state = backend.state
        if not state.end_forward(ForwardContext(), logits, by_hook=True):
            state.warn_once(UNBOUND_REASON)
            state.record_dense_step(int(logits.shape[0]), UNBOUND_REASON, at_forward=True)


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


def _owning_module(params: list) -> Optional[torch.nn.Module]:
    """The model a graph belongs to: the torch.compile'd module (OptimizedModule) being called, else the
    outermost module being called that holds all the graph's parameters: the root model for ``m.compile()``
    and for layers or blocks compiled in place (regional compile), under DDP or a trainer's wrapper alike.
    Without parameters, the innermost module being called; None outside any module."""
    from torch._dynamo.eval_frame import OptimizedModule

    called: list[torch.nn.Module] = []  # innermost first
    frame = sys._getframe(1)
    while frame is not None:
        mod = frame.f_locals.get("self")
        if isinstance(mod, OptimizedModule):
            return mod
        if isinstance(mod, torch.nn.Module) and all(mod is not c for c in called):
            called.append(mod)
        frame = frame.f_back
    if not params:
        return called[0] if called else None
    ids = {id(p) for p in params}
    return next((m for m in reversed(called) if ids <= {id(p) for p in m.parameters()}),
                called[0] if called else None)


def _string_backend(opts: dict, from_env: bool) -> CapskipBackend:
    opts = dict(opts)
    rule, budget, seed = opts.pop("rule", "capskip"), opts.pop("budget", 0.1), opts.pop("seed", 0)
    logits_index = opts.pop("logits_index", None)
    try:
        config, rule, rule_opts = split_options(rule, opts)
        state = RuntimeState(build_rule(rule, budget, rule_opts), seed=seed, scope=config.scope)
        state.print_at_exit = True
    except (TypeError, ValueError) as e:
        where = f"{ENV_RULE} / {ENV_BUDGET} / {ENV_OPTIONS}" if from_env else "torch.compile(options=...)"
        raise ValueError(f"capskip backend settings ({where}): {e}") from None
    return CapskipBackend(config, state, ops.register(state), logits_index)


def backend_of(module) -> Optional[CapskipBackend]:
    """The string backend that compiled ``module`` (the module torch.compile returned, or the original),
    the one holding its head graph when several settings compiled it; None if none did."""
    found: list[CapskipBackend] = list(_BY_OWNER.get(module, {}).values()) if isinstance(module, torch.nn.Module) else []
    inner = getattr(module, "_orig_mod", module)
    for p in inner.parameters() if isinstance(inner, torch.nn.Module) else ():
        for b in _BY_PARAM.get(p, {}).values():
            if b not in found:
                found.append(b)
    return next((b for b in found if b.any_head), found[0] if found else None)


#: Dynamo source names of a compiled frame's own tensor arguments (``L['x']``, ``L['args'][0]``,
#: ``L['kwargs']['mask']``; not attributes of them: no parameter, no buffer), dim 0 only.  Weakly dynamic:
#: a model that fixes its batch size specialises it, no error.
BATCH_SOURCES = r"L\['[^']*'\](\[[^\]]*\])?$:0"


def make_batch_dynamic() -> bool:
    """Have Dynamo trace dim 0 of every compiled frame's tensor arguments as dynamic, as capskip_fx.compile
    does for its module: without it a drop_last loader's batch is static and no row could be dropped.
    Process-wide (``torch.compiler.config.dynamic_sources``); ``CAPSKIP_DYNAMIC_BATCH=0`` opts out.
    False where this torch has no per-dim dynamic sources."""
    from torch._dynamo.variables import builder

    if not dynamic_batch_enabled() or not hasattr(builder, "_parse_source_entry"):
        return False
    cfg = torch.compiler.config
    entries = [e for e in cfg.dynamic_sources.split(",") if e.strip()]
    if BATCH_SOURCES not in entries:
        cfg.dynamic_sources = ",".join(entries + [BATCH_SOURCES])
    return True
