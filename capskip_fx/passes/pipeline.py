"""The passes in order: one pipeline per direction, each returning a frozen result.

joint graph (Inductor's ``joint_custom_pre_pass``, before partitioning), :func:`joint`:
  1. find_head.find_head            the logits output z, its tangent g, the head input h
                                    (no head: the body path, step 4 with capskip::shared)
  2. in_graph_loss.find_in_graph_loss  a loss computed in the graph from the logits
     loss_grad.match_cross_entropy  that loss recognised as a cross-entropy whose dL/dz the runtime can
                                    derive from the forward (its inputs then read by the selection node)
     row_index.recompute_row_indices the backward's reads of arange(N) get their own arange
  3. insert_select.prove_layout     where the batch lies in every forward value (placement/)
  4. insert_select.select_head      w = capskip::select(h, z, g); every batch-shaped tangent *= w;
                                    the graph returns a copy of z (z itself is saved); token
                                    logits uncopied (a stand-in saved where the rule reads none)
     (or select_body)

forward graph (Inductor's ``inner_compile``), :func:`forward`:
     insert_select.fusable_copies   the returned copy of z becomes a clone the compiler fuses

backward graph (Inductor's ``inner_compile``), :func:`backward`:
  5. selected_rows.plan_backward    the selection node -> a new last input w; every gathered input
                                    checked against step 3's proof; an in-graph loss's prefix split off
     prefix_rows.prove_prefix_rows  that prefix row-wise (it may then run on the kept rows only)
     gather_in_graph.compile_gathering  that prefix also compiled gathering its kept rows itself (when
                                    the rule reads no dL/dz)
     validate.prove_backward        the rewritten backward that will run, proven row-wise on gathered rows
                                    (refused: it runs on all rows, dense-masked)
  6. compile: VCAS (the context's ``vcas``, when set), else the plain graph
     gather_in_graph.compile_gathering  with gather="graph", that graph also compiled gathering its kept rows
                                    itself (Inductor fuses the gathers into their first reads)
  7. symbolic.check_not_specialised compiling must not have fixed the batch size

A pass that will not rewrite a graph raises ``records.Refused``; the pipeline turns it into the
result's ``refusal`` (the graph then runs dense, or dense-masked after step 5).  Passes see the graph
and a frozen context only: the backend (backend.py) turns results into records and wrappers.
"""
from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..placement import backward_nodes
from ..records import ONE_ROW_NOTE, BackwardMode, Refusal, RefusalKind, Refused, counters
from ..symbolic import batch_symbol_of, check_not_specialised
from . import insert_select
from .find_head import find_head
from .in_graph_loss import find_in_graph_loss
from .insert_select import SELECT
from .loss_grad import NotDerivable, match_cross_entropy
from .gather_in_graph import compile_gathering
from .prefix_rows import prove_prefix_rows
from .row_index import recompute_row_indices
from .selected_rows import BackwardPlan, plan_backward
from .validate import prove_backward

VCAS_TOKEN_MAJOR = ("VCAS: a forward value holds the batch token-major ((outer, N, inner)); VCAS reads the "
                    "backward's values batch-major: exact backward")


# -- the joint graph -------------------------------------------------------------------------------

@dataclass(frozen=True)
class JointContext:
    """What the joint passes read: the model's registry key (an argument of the selection node), which
    output holds the logits, the coupling policy, and a refusal met before AOT (the graph is left alone)."""

    key: int
    logits_index: Optional[int] = None
    on_coupling: str = "dense"
    refused: Optional[Refusal] = None
    derive_loss_grad: bool = False  # CapskipConfig.loss_grad == "derived": recognise an in-graph cross-entropy
    keep_token_logits: bool = True  # the rule reads token logits' values (Rule.reads_logits)
    marked_batch: bool = False  # an input's dim 0 was marked dynamic (a static batch is then the model's doing)


@dataclass(frozen=True)
class JointResult:
    """What the joint passes did to one graph."""

    head: bool = False  # capskip::select inserted
    body: bool = False  # capskip::shared inserted (no head)
    inference: bool = False  # no tangents: nothing to do
    no_head: Optional[str] = None
    in_graph_loss: bool = False
    # a recognised in-graph cross-entropy: the recipe its dL/dz is derived by (passes/loss_grad.py), or why not
    loss_grad: Any = None
    loss_grad_why: Optional[str] = None
    masked_tangents: int = 0
    logits_stand_in: bool = False  # select reads a stand-in of token logits: they are neither saved nor copied
    head_bias: Optional[bool] = None  # the head Linear has a bias (the rules' head view needs it)
    layouts: Mapping = field(default_factory=lambda: MappingProxyType({}), repr=False)  # value name -> Layout
    refusal: Optional[Refusal] = None
    error: Optional[str] = None  # on_coupling="error": raised at the graph's first forward

    def record_fields(self) -> dict:
        """The CompileRecord fields this result sets."""
        fields = dict(head=self.head, body=self.body, no_head=self.no_head, in_graph_loss=self.in_graph_loss,
                      logits_kept=not self.logits_stand_in,
                      masked_tangents=self.masked_tangents, error=self.error, refusal=self.refusal,
                      coupled=self.refusal is not None and self.refusal.kind is RefusalKind.CROSS_EXAMPLE)
        if self.inference:
            fields["backward"] = BackwardMode.INFERENCE
        return fields


def joint(graph: fx.Graph, ctx: JointContext) -> Optional[JointResult]:
    """Steps 1-4 on the joint graph, in place.  None if the graph already has a selection node (the
    hook ran twice): the first result stands."""
    if insert_select.has_selection(graph):
        return None
    if not insert_select.tangents(graph):
        return JointResult(inference=True, refusal=ctx.refused)
    if ctx.refused is not None:  # an undeclared custom autograd.Function: a plain dense backward
        return JointResult(refusal=ctx.refused)
    try:
        try:
            head = find_head(graph, ctx.logits_index)
        except Refused as no_head:
            return _body(graph, ctx, no_head.refusal)
        if _one_row_value(head.z.meta.get("val")):  # logits specialised to a batch of 1: dense by design
            return _refused(Refusal(RefusalKind.STATIC_BATCH, ONE_ROW_NOTE), ctx)
        sym = batch_symbol_of(head.z.meta["val"], ctx.marked_batch)
        loss = find_in_graph_loss(graph, head, backward_nodes(graph))
        recipe, loss_inputs, why = None, None, None
        if loss is not None and not ctx.derive_loss_grad:
            why = "loss_grad='prefix' (the default: the loss's backward on every row is the cheaper way to dL/dz)"
        elif loss is not None:
            try:
                recipe, loss_inputs = match_cross_entropy(graph, head, loss)
            except NotDerivable as e:
                why = str(e)
        recompute_row_indices(graph, sym)  # before the proof: the backward must not read arange(N)
        layouts = insert_select.prove_layout(graph, sym, exclude=loss.nodes if loss else ())
        layouts = dict(layouts)
        masked, stand_in = insert_select.select_head(graph, head, loss, ctx.key, layouts, loss_inputs,
                                                     keep_logits=ctx.keep_token_logits)
    except Refused as e:
        return _refused(e.refusal, ctx)
    if stand_in:
        counters()["token logits not kept"] += 1
    return JointResult(head=True, in_graph_loss=loss is not None, masked_tangents=masked, head_bias=head.bias,
                       logits_stand_in=stand_in,
                       layouts=MappingProxyType(layouts), loss_grad=recipe, loss_grad_why=why)


def _body(graph: fx.Graph, ctx: JointContext, no_head: Refusal) -> JointResult:
    sym = insert_select.body_symbol(graph)
    if sym is None:
        # a ragged last batch of 1 (the head matcher sees its specialised graph): say so, not "no head"
        return _refused(Refusal(RefusalKind.STATIC_BATCH, ONE_ROW_NOTE) if _headless_one_row(graph) else no_head, ctx)
    try:
        layouts = insert_select.prove_layout(graph, sym)
        masked = insert_select.select_body(graph, sym, ctx.key)
    except Refused as e:
        return _refused(e.refusal, ctx)
    return JointResult(body=True, no_head=no_head.detail, masked_tangents=masked, layouts=MappingProxyType(layouts))


def _headless_one_row(graph: fx.Graph) -> bool:
    """A graph without a head whose first batch-shaped output (its first tangent of one dim or more) has a
    static dim 0 of 1: a graph specialised to one row."""
    return _one_row_value(next((n.meta.get("val") for n in insert_select.tangents(graph)
                                if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 1), None))


def _one_row_value(v) -> bool:
    """A tensor value whose dim 0 is the static size 1."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], int) and v.shape[0] == 1


def _refused(refusal: Refusal, ctx: JointContext) -> JointResult:
    error = None
    if refusal.kind is RefusalKind.CROSS_EXAMPLE and ctx.on_coupling == "error":
        error = f"capskip_fx (on_coupling='error'): {refusal.detail}"
    return JointResult(refusal=refusal, error=error)


@functools.cache
def source_files() -> tuple[str, ...]:
    """capskip_fx's graph-side sources (everything but the training harness), sorted."""
    root = pathlib.Path(__file__).resolve().parents[1]
    return tuple(str(p) for p in sorted(root.rglob("*.py")) if "train" not in p.relative_to(root).parts)


class JointPass(CustomGraphPass):
    """:func:`joint` as Inductor's ``joint_custom_pre_pass``: each result goes to ``deliver``."""

    def __init__(self, ctx: JointContext, config: Any, deliver: Callable[[JointResult], None] = lambda r: None):
        self.ctx, self.config, self.deliver = ctx, config, deliver

    def uuid(self) -> Optional[bytes]:
        # what Inductor's FX graph cache and AOTAutogradCache key our rewrite on: the source of the code that
        # shapes the graphs, the config, the logits choice and whether token logits are kept (the rule's
        # Rule.reads_logits at compile).  Not the model's registry key: a compiled graph
        # that calls back into a run-time object (select in a refused backward, VCAS's sampled_wgrad) carries
        # the key as an argument, so the FX graph's own hash tells models apart, and the backend keeps such
        # graphs out of AOTAutogradCache (whose key is Dynamo's graph, before this pass).
        return get_hash_for_files(source_files(), extra=f"capskip:{self.config}:{self.ctx.logits_index}:"
                                   f"{self.ctx.keep_token_logits}")

    def __call__(self, graph: fx.Graph) -> None:
        result = joint(graph, self.ctx)
        if result is not None:
            self.deliver(result)


# -- the forward graph -----------------------------------------------------------------------------

def forward(gm: fx.GraphModule) -> None:
    """The partitioned forward graph, rewritten in place before it compiles."""
    insert_select.fusable_copies(gm)


# -- the backward graph ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BackwardContext:
    """What the backward passes read: Inductor's compile for one graph (``compile(gm, example_inputs,
    **kwargs)``), its keyword arguments, and VCAS's builder when ``vcas=`` is set
    (``vcas(gm, example_inputs, sym, compile, kwargs) -> (compiled or None, note)``), and whether a row-wise
    in-graph loss's backward is also compiled with its kept rows gathered in the graph (``fused_prefix``: the
    rule at compile time reads no dL/dz; a rule set later that reads none gathers them eagerly), and whether
    the selected backward is also compiled gathering its own kept rows (``gather_in_graph``: gather="graph")."""

    compile: Callable
    kwargs: Mapping
    vcas: Optional[Callable] = None
    fused_prefix: bool = False
    gather_in_graph: bool = False  # also compile the selected backward gathering its kept rows itself


@dataclass(frozen=True)
class BackwardResult:
    """What the backward passes made of one backward graph."""

    compiled: Any  # the compiled backward (the rewritten graph, run on the kept rows, when plan is set)
    mode: BackwardMode
    plan: Optional[BackwardPlan] = None
    prefix: Any = None  # an in-graph loss's compiled backward up to dL/dz (runs first, on all rows)
    refusal: Optional[Refusal] = None
    select_in_graph: bool = False  # refused after the joint pass put select in a head graph: it runs there
    vcas: Optional[str] = None  # VCAS: what it built, or why it did not apply
    segmented: bool = False  # the compiled backward is VCAS's segment runner
    graph: Optional[fx.GraphModule] = field(default=None, repr=False)  # the rewritten graph (for tracing)
    # that backward taking all rows and the kept-row index, returning the kept rows' (passes/prefix_rows.py)
    prefix_gathered: Any = field(default=None, repr=False)
    # the selected backward taking all rows and the kept-row index (gather="graph"), or why it is not
    gathered: Any = field(default=None, repr=False)
    gather_refused: Optional[str] = None

    def record_fields(self) -> dict:
        """The CompileRecord fields this result sets."""
        fields: dict = dict(backward=self.mode, refusal=self.refusal)
        if self.plan is not None:
            fields.update(plan=self.plan, vcas=self.vcas, segmented=self.segmented)
        if self.gathered is not None:
            fields.update(gather="graph")
        elif self.gather_refused is not None:
            fields.update(gather=f"eager ({self.gather_refused})")
        return fields


def backward(gm: fx.GraphModule, example_inputs, joint_result: Optional[JointResult],
             ctx: BackwardContext) -> BackwardResult:
    """Steps 5-7 on one partitioned backward graph: compiled once, with a symbolic batch."""
    compile_graph, kwargs = ctx.compile, dict(ctx.kwargs)
    if not insert_select.has_selection(gm.graph):
        return BackwardResult(compile_graph(gm, example_inputs, **kwargs), BackwardMode.DENSE)
    layouts = joint_result.layouts if joint_result is not None else {}
    try:
        gm, plan, w_val, example_inputs = plan_backward(gm, example_inputs, layouts)
    except Refused as e:  # the graph as partitioned: select runs in it, at N rows (dense-masked, exact)
        return BackwardResult(compile_graph(gm, example_inputs, **kwargs), BackwardMode.DENSE_MASKED,
                              refusal=e.refusal, select_in_graph=any(n.target is SELECT for n in gm.graph.nodes))
    prefix, prefix_gathered = None, None
    if plan.prefix is not None:  # an in-graph loss: its backward runs first (on the kept rows if row-wise)
        plan = _prefix_rows(_loss_grad(plan, joint_result))
        pre, pre_kwargs = plan.prefix, dict(kwargs, static_input_idxs=())
        prefix = compile_graph(pre.gm, list(pre.examples), **pre_kwargs)
        # kept rows gathered inside (fused into its first reads) when the rule may choose first: it reads no
        # dL/dz at compile time, or that dL/dz is derived from the forward
        if pre.specs is not None and (ctx.fused_prefix or pre.grad is not None):
            try:
                prefix_gathered = compile_gathering(pre.gm, pre.specs, plan.sym, list(pre.examples), w_val.shape[0],
                                                    compile_graph, pre_kwargs)
            except Refused:  # the runtime gathers its kept rows eagerly
                prefix_gathered = None
    inputs = list(example_inputs) + [w_val]
    compiled, vcas_note = None, None
    refusal, mode = None, BackwardMode.SELECTED
    try:
        prove_backward(gm, plan)
    except Refused as e:  # at N rows the rewritten graph is the dense-masked backward: still exact
        refusal, mode = e.refusal, BackwardMode.DENSE_MASKED
    if refusal is None and ctx.vcas is not None and _token_major(layouts):  # its segments' specs: batch-major only
        vcas_note = VCAS_TOKEN_MAJOR
    elif refusal is None and ctx.vcas is not None:  # VCAS's backward, or None: the exact one below
        compiled, vcas_note = ctx.vcas(gm, inputs, plan.sym, compile_graph, kwargs)
    segmented = compiled is not None
    gathered, gather_refused = None, None
    if ctx.gather_in_graph and refusal is None:
        if segmented:
            gather_refused = "VCAS's segments gather their own rows"
        else:  # the proven graph (copied before Inductor's passes edit it), gathering its kept rows in its reads
            try:
                gathered = compile_gathering(gm, plan.specs, plan.sym, inputs, w_val.shape[0], compile_graph, kwargs)
            except Refused as e:  # the runtime gathers its kept rows eagerly
                gather_refused = e.refusal.detail
    if compiled is None:
        compiled = compile_graph(gm, inputs, **kwargs)
    if refusal is None:
        try:
            check_not_specialised(example_inputs, plan.sym, plan.stride_syms)
        except Refused as e:  # the rewritten graph at N rows is the dense-masked backward: still exact
            refusal, mode, gathered = e.refusal, BackwardMode.DENSE_MASKED, None
    return BackwardResult(compiled, mode, plan, prefix, refusal, vcas=vcas_note, segmented=segmented, graph=gm,
                          prefix_gathered=prefix_gathered, gathered=gathered, gather_refused=gather_refused)


def _loss_grad(plan: BackwardPlan, joint_result: Optional[JointResult]) -> BackwardPlan:
    """The plan with the recognised cross-entropy's recipe on its prefix, when the backward has its inputs;
    else why a rule that reads dL/dz needs the loss's backward on every row first."""
    pre = plan.prefix
    recipe = joint_result.loss_grad if joint_result is not None else None
    if recipe is None:
        why = joint_result.loss_grad_why if joint_result is not None else None
        return replace(plan, prefix=replace(pre, grad_why=why or pre.grad_why or "the loss was not analysed"))
    if pre.grad_args is None:
        return replace(plan, prefix=replace(pre, grad_why=pre.grad_why or "the loss's inputs are not backward inputs"))
    return replace(plan, prefix=replace(pre, grad=recipe))


def _prefix_rows(plan: BackwardPlan) -> BackwardPlan:
    """The plan with its prefix's row proof: the specs its kept rows are gathered by, or why it runs on all rows."""
    pre = plan.prefix
    n_out = len(pre.gm.graph.output_node().args[0])
    try:
        specs = prove_prefix_rows(pre.gm, list(pre.examples), plan.sym, plan.specs[len(plan.specs) - n_out:])
    except Refused as e:
        return replace(plan, prefix=replace(pre, whole_rows=e.refusal.detail))
    return replace(plan, prefix=replace(pre, specs=specs))


def _token_major(layouts: Mapping) -> bool:
    return any(lay.kind == "batch" and lay.outer != 1 for lay in layouts.values())
