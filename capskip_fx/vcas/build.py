"""VCAS's one entry point from the backend: rewrite and compile a selected-row backward graph as VCAS."""
from __future__ import annotations

from typing import Callable, Optional

from torch import fx

from ..records import GraphRecord, Refused
from ..symbolic import check_not_specialised, spec_of
from .runtime import VcasBackward
from .sample_wgrad import sample_wgrad
from .segment_backward import block_cuts, find_blocks, find_cuts, split_backward


def build_backward(config, state, rec: GraphRecord, gm: fx.GraphModule, example_inputs: list, sym,
                   compile_graph: Callable, kwargs: dict) -> tuple[Optional[VcasBackward], str]:
    """SampleW rewrite, then the backward cut into segments, each compiled with ``compile_graph``; and a
    note for the graph's record (what was built, or why not).

    (None, why; warned once; ``gm`` untouched) when there is no residual cut or segmenting is refused:
    the caller then compiles ``gm`` whole (exact backward).  ``rec`` is the graph's record, whose run-time
    fields the runner updates."""
    cfg = config.vcas
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # rewritten below; gm stays the exact fallback
    vgm = fx.GraphModule(gm, graph)
    forks = find_cuts(vgm.graph, sym)
    blocks = find_blocks(vgm.graph)
    # the reference's sampler positions: one per repeated block (its output); "fork" (or no repeated
    # block found): every residual fork
    cuts = (block_cuts(vgm.graph, forks, blocks) if blocks and cfg.cut == "block" else forks)[::cfg.every]
    if not cuts:
        return _none(state, "VCAS: no residual fork in this backward (no block structure): exact backward")
    runner = VcasBackward(cfg, state, rec, config.min_rows, config.gather_below)
    try:
        slots = sample_wgrad(vgm, sym, runner.key, cuts[0], set(blocks) if blocks else None) if cfg.sample_w else 0
        split = split_backward(vgm, example_inputs, sym, cuts)
        kw = dict(kwargs, static_input_idxs=())
        compiled = [compile_graph(s.gm, s.examples, **kw) for s in split.segments]
        check_not_specialised(example_inputs, sym)  # the segments share one shape env
    except Refused as e:
        state.remove_runner(runner)
        return _none(state, f"VCAS: {e}: exact backward")
    runner.finish(split, compiled, [spec_of(v, sym) for v in example_inputs], slots)
    return runner, f"{len(split.segments)} segments, {slots} sampled weight-gradient matmuls"


def _none(state, reason: str) -> tuple[None, str]:
    state.warn_once(reason)
    return None, reason
