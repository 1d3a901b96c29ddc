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
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from . import aot_cache
from .config import CapskipConfig
from .passes import pipeline
from .records import ONE_ROW_NOTE, BackwardMode, CompileRecord, GraphRecord, Refusal, RefusalKind, counters
from .functions import undeclared_function
from .runtime.backward import SelectedRowBackward
from .runtime.executors import Dense, MaskedInGraph
from .runtime.state import RuntimeState
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


def _batch_arg(gm: fx.GraphModule, example_inputs) -> Optional[int]:
    """Index of the first input whose dim 0 is a plain symbol (the batch); in a static graph, of the first
    tangent (a weight's dim 0 is not the batch); else of the first tensor."""
    tensors = [(i, t) for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0]
    sym = [i for i, t in tensors if isinstance(t.shape[0], torch.SymInt) and t.shape[0].node.expr.is_Symbol]
    if sym:
        return sym[0]
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    tangent = [i for i, _ in tensors if i < len(names) and names[i].startswith("tangents")]
    return tangent[0] if tangent else (tensors[0][0] if tensors else None)


def _rows_out(gm: fx.GraphModule, example_inputs) -> bool:
    """A backward graph's tangent has a dim 0 (its forward returned rows, not only a loss's scalar)."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return any(name.startswith("tangents") and isinstance(t, torch.Tensor) and t.dim() > 0
               for name, t in zip(names, example_inputs))


def _marked_batch(example_inputs) -> bool:
    """Whether an input tensor's dim 0 carries a dynamic mark (``maybe_mark_dynamic`` / ``mark_dynamic``: the
    backend's example inputs are the real tensors the frame was called with)."""
    return any(0 in getattr(t, "_dynamo_weak_dynamic_indices", ()) or 0 in getattr(t, "_dynamo_dynamic_indices", ())
               for t in example_inputs if isinstance(t, torch.Tensor))


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

    kind: str  # "forward", "dense" (plain or runtime.executors.Dense) or "rows" (SelectedRowBackward)
    record: CompileRecord = field(default_factory=CompileRecord)  # the graph's compile record (its plan included)
    head_bias: Optional[bool] = None  # the head graph's (the state's is set by the graph that found the head)
    out_idx: list = field(default_factory=list)
    training: bool = True
    batch_arg: Optional[int] = None
    rows_out: bool = False  # "dense": a tangent holds rows (not a loss's scalar): a refused one may move them


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
        """A graph runs the rule (compiled with a head, not demoted at run time)."""
        return any(r.head for r in self.records)

    @property
    def compiled_head(self) -> bool:
        """A graph was compiled with a head, whether or not a run demoted it: its forward's logits came from
        elsewhere (eager code, a graph after it), so a step whose logits are unbound is not a head-less model's."""
        return any(r.compiled.head for r in self.records)

    @property
    def refusal(self) -> Optional[Refusal]:
        """The first graph's compile-time refusal: why a model none of whose graphs selects runs dense."""
        return next((r.compiled.refusal for r in self.records if r.compiled.refusal is not None), None)

    def _settle(self, rec: GraphRecord, fields: dict) -> None:
        """A pipeline result into the graph's record (the one path a compile-time refusal takes): the
        graph's first refusal is counted (GraphRecord.settle) and warned once."""
        refusal = rec.settle(**fields)
        if refusal is not None and refusal.detail != ONE_ROW_NOTE:  # a batch of 1: by design, no warning
            where = f" [{refusal.where}]" if refusal.where else ""
            runs = ("dense backward for this graph: all rows, the rule's weights applied (dense-masked: exact, "
                    "no speed-up)" if fields.get("backward") == BackwardMode.DENSE_MASKED else
                    "dense backward for this graph (other graphs may still select: see report())")
            self.state.warn_once(f"{refusal.detail} -> {runs}{where}", at=refusal.location)

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
        ctx = pipeline.JointContext(self.key, self.logits_index, self.config.on_coupling, refused,
                                    derive_loss_grad=self.config.loss_grad == "derived",
                                    keep_token_logits=self.state.rule.reads_logits,
                                    marked_batch=_marked_batch(example_inputs))
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
            # a refused graph whose outputs hold rows may move them (flip(0), an undeclared Function, a static
            # batch no proof ran on): the heads upstream of it run dense (RuntimeState.mixing_backward)
            mixes = built.rows_out and rec.reason != ONE_ROW_NOTE
            wrapper = Dense(compiled, self.state, rec.reason, built.batch_arg, rec, mixes) if rec.reason else compiled
        else:
            wrapper = SelectedRowBackward(compiled, rec.plan, self.state, self.config, rec)
        return aot_cache.carry_cache_attrs(wrapper, compiled)

    def _compile(self, rec: GraphRecord, gm: fx.GraphModule, example_inputs, kwargs) -> tuple[Any, Optional[Built]]:
        """(the compiled graph, or our wrapper where it cannot be described; its description or None)."""
        base = self._base(rec)
        if not kwargs.get("is_backward", False):
            if rec.error is not None:
                return _RaiseOnCall(rec.error), None
            out_idx = _batch_outputs(gm)
            pipeline.forward(gm)
            compiled = base(gm, example_inputs, **kwargs)
            return compiled, Built("forward", out_idx=out_idx, training=rec.backward != BackwardMode.INFERENCE)
        _no_donated_buffers()
        vcas = functools.partial(vcas_backward, self.config, self.state, rec) if self.config.vcas is not None else None
        ctx = pipeline.BackwardContext(base, kwargs, vcas, fused_prefix=not self.state.rule.reads_gradient,
                                       gather_in_graph=self.config.gather == "graph")
        res = pipeline.backward(gm, example_inputs, rec.joint, ctx)
        self._settle(rec, res.record_fields())
        if res.plan is None:
            if res.refusal is None:  # no selection node: the plain backward
                return res.compiled, Built("dense", batch_arg=_batch_arg(gm, example_inputs),
                                           rows_out=_rows_out(gm, example_inputs))
            if res.select_in_graph:  # a head graph: select runs in its backward, at N rows
                self.state.masked_reason = self.state.masked_reason or res.refusal.detail
                return MaskedInGraph(res.compiled, rec), None  # its graph calls select(..., key): this model's
            return res.compiled, None
        if res.mode == BackwardMode.SELECTED:
            counters()["rewritten"] += 1
        self.state.variants += 1
        counters()["variants"] += 1
        _trace(f"capskip_backward_graph_{rec.index}", lambda: f"# {rec.backward}: {res.plan.gathered_inputs} gathered "
               f"inputs, reason: {rec.reason}\n" + res.graph.print_readable(print_output=False))
        if res.gathered is not None:
            counters()["gather_in_graph"] += 1
        if res.prefix is None and not res.segmented and res.gathered is None:
            return res.compiled, Built("rows")
        # several graphs (a prefix, VCAS's segments, the gathering twin): not described
        return SelectedRowBackward(res.compiled, res.plan, self.state, self.config, rec, prefix=res.prefix,
                                   prefix_gathered=res.prefix_gathered, gathered=res.gathered), None
