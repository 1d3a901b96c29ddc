"""capskip_fx.placement: where the batch lies in each forward value of a joint graph.

Real AOT joint graphs come from Inductor's ``joint_custom_pre_pass`` (the hook InsertSelectPass uses);
the pass records the graph and stops compile_fx right there (no partitioning, no code generation),
so each capture costs well under a second.  Random programs traced with ``make_fx`` check that every
layout the analysis claims is true, by perturbing one input row at a time.
"""
from __future__ import annotations

import itertools
import types

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import unset_fake_temporarily

from capskip_fx.placement import Layout, LayoutAnalysis, analyze, backward_nodes, reshape_layout
from capskip_fx.symbolic import batch_symbol

N, T, D = 3, 5, 4  # batch, tokens, width: distinct so no size is mistaken for another


# ------------------------------------------------------------------------------------------
# capturing joint graphs


class _Stop(Exception):
    pass


class _Capture(CustomGraphPass):
    def __init__(self):
        self.graph = None

    def __call__(self, graph):
        self.graph = graph
        raise _Stop  # the joint graph is all we need

    def uuid(self):
        return None


def _call(model, *xs):
    return model(*xs)


_ids = itertools.count()
_JOINTS: dict = {}


def joint(key: str, make_model, *inputs) -> tuple:
    """(joint graph, analysis) of ``make_model()`` on ``inputs`` (dim 0 of the first one dynamic)."""
    if key in _JOINTS:
        return _JOINTS[key]
    cap = _Capture()

    def backend(gm, example_inputs):
        try:
            return compile_fx(gm, example_inputs, config_patches={"joint_custom_pre_pass": cap})
        except Exception:
            if cap.graph is None:
                raise
            return gm.forward

    torch.manual_seed(0)
    model = make_model()
    torch._dynamo.mark_dynamic(inputs[0], 0)
    # a fresh code object per capture: Dynamo caches by code object and would reuse an earlier
    # capture for a same-looking model (resetting Dynamo would drop other tests' compiled models)
    fn = types.FunctionType(_call.__code__.replace(co_name=f"_layout_capture_{next(_ids)}"), globals())
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(fn, backend=backend, fullgraph=True)(model, *inputs)
    assert cap.graph is not None, "no joint graph captured"
    sym = batch_symbol(cap.graph)
    assert isinstance(sym, sympy.Symbol), f"the captured graph should have a symbolic batch size, found {sym!r}"
    _JOINTS[key] = (cap.graph, analyze(cap.graph, sym))
    return _JOINTS[key]


def saved(graph) -> list:
    """Forward nodes read by the backward (what the partitioner may save)."""
    bwd = backward_nodes(graph)
    return [n for n in graph.nodes if n not in bwd and any(u in bwd and u.op != "output" for u in n.users)]


def node(graph, pred):
    found = [n for n in graph.nodes if pred(n)]
    assert found, "the graph has no node of the kind this test looks for"
    return found[0]


def target(n) -> str:
    return str(n.target)


def assert_saved_gatherable(graph, res: LayoutAnalysis):
    for n in saved(graph):
        lay = res.layouts.get(n.name)
        if isinstance(n.meta.get("val"), torch.Tensor):
            assert lay is not None, f"saved value {n.name} got no layout: the backward could not gather it"
            assert lay.gatherable, f"saved value {n.name} has layout {lay}: its rows can't be gathered"


# ------------------------------------------------------------------------------------------
# tiny models


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ViTBlock(nn.Module):
    """Patch embed (reshape/permute), cls token via expand + cat on dim 1, LayerNorm, qkv on
    (N*T, D) rows, sdpa, residual, head on the cls token."""

    def __init__(self, dim=8, patch=2, heads=2):
        super().__init__()
        self.patch, self.heads = patch, heads
        self.proj = nn.Linear(3 * patch * patch, dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 5, dim))
        self.ln = nn.LayerNorm(dim)
        self.qkv, self.out, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, 3)

    def forward(self, x):
        n, c, hh, ww = x.shape
        p = self.patch
        x = x.reshape(n, c, hh // p, p, ww // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, c * p * p)
        x = self.proj(x)
        x = torch.cat([self.cls.expand(n, -1, -1), x], 1) + self.pos
        b, t, d = x.shape
        qkv = self.qkv(self.ln(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(a)
        return self.head(x[:, 0])


class TokenMajor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):  # (N, T, D) -> rows t*N + b
        n, t, d = x.shape
        return self.fc(x.transpose(0, 1).reshape(-1, d)).reshape(t, n, d).transpose(0, 1)


class TokenMajorSaved(nn.Module):
    """Token-major rows scaled by a parameter (the backward reads them for its gradient) and through a
    sigmoid (the backward reads its output), then back to batch-major for the Linear."""

    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(D, D), nn.Parameter(torch.ones(D))

    def forward(self, x):
        n, t, d = x.shape
        h = torch.sigmoid(x.transpose(0, 1).reshape(-1, d) * self.scale)
        return self.fc(h.reshape(t, n, d).transpose(0, 1))


class MHA(nn.Module):
    def __init__(self, batch_first, transpose):
        super().__init__()
        self.transpose = transpose
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)

    def forward(self, x):
        if self.transpose:  # (N, T, E) -> (T, N, E), the layout batch_first=False expects
            x = x.transpose(0, 1)
        y = self.attn(x, x, x, need_weights=False)[0]
        return y.transpose(0, 1) if self.transpose else y


class Fn(nn.Module):
    """Linear -> f -> Linear: f's row behaviour is what the analysis must get right."""

    def __init__(self, f, width=D):
        super().__init__()
        self.f, self.fc1, self.fc2 = f, nn.Linear(width, D), nn.Linear(D, 2)

    def forward(self, x):
        return self.fc2(self.f(self.fc1(x)))


class BN(nn.Module):
    def __init__(self, train):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, 2)
        self.train(train)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


class PosAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, pos):  # pos: (T, D), a second input without the batch
        return self.fc(x + pos)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = F.max_pool2d(self.gn(self.conv(x)), 2)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, D), nn.Linear(D, 2)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


@torch.library.custom_op("capskip_layout_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


mystery.register_autograd(lambda ctx, g: g)


def _x():
    return torch.randn(N, D)


def _tokens():
    return torch.randn(N, T, D)


# ------------------------------------------------------------------------------------------
# row-separable graphs


def test_mlp_is_batch_major_throughout():
    g, res = joint("mlp", MLP, _x())
    assert res.refusal is None, f"an MLP is row-separable, yet refused: {res.refusal}"
    x = node(g, lambda n: n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor) and n.meta["val"].dim() == 2
             and isinstance(n.meta["val"].shape[0], torch.SymInt))
    assert res.layouts[x.name] == Layout("batch", 0), f"the input should be batch-major, not {res.layouts[x.name]}"
    for n in g.nodes:
        if target(n) == "aten.addmm.default" and n not in backward_nodes(g):
            assert res.layouts[n.name] == Layout("batch", 0), f"Linear output {n.name} should be batch-major, not {res.layouts[n.name]}"
    weights = [n for n in g.nodes if n.op == "placeholder" and n.name.startswith("primals")
               and isinstance(n.meta["val"], torch.Tensor) and n is not x]
    assert weights, "the joint graph should have weight placeholders"
    not_free = {w.name: str(res.layouts[w.name]) for w in weights if res.layouts[w.name] != Layout("free")}
    assert not not_free, f"weights do not depend on the batch, yet have layouts {not_free}"
    tangents = [k for k in res.layouts if k.startswith("tangents")]
    assert not tangents, f"backward nodes should get no layout: {tangents}"
    assert_saved_gatherable(g, res)


def test_vit_block_is_row_separable_and_batch_major():
    g, res = joint("vit", ViTBlock, torch.randn(N, 3, 4, 4))
    assert res.refusal is None, f"a ViT block is row-separable, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)
    s = batch_symbol(g)
    bwd = backward_nodes(g)
    fwd = [n for n in g.nodes if n not in bwd]
    # the matmul inputs are (N*T, D) rows: batch-major with inner = tokens (4 patches, then 5 with cls)
    inners = sorted(int(res.layouts[n.args[1].name].inner) for n in fwd if target(n) == "aten.addmm.default")
    assert inners == [1, 4, 5, 5], f"the matmuls' rows should be grouped by 1, 4 patches and 5 tokens (with cls), got inners {inners}"
    # the cls token expanded over the batch is a batch value (rows are copies)
    expand = node(g, lambda n: target(n) == "aten.expand.default" and n not in bwd)
    assert res.layouts[expand.name] == Layout("batch", 0), f"the cls token expanded over the batch is a batch value, not {res.layouts[expand.name]}"
    # sdpa returns a tuple: each element has its own key, and the getitems agree
    sdpa = node(g, lambda n: "scaled_dot_product" in target(n))
    assert res.layouts[f"{sdpa.name}.0"] == Layout("batch", 0), f"sdpa's output should be batch-major, not {res.layouts[f'{sdpa.name}.0']}"
    assert res.layouts[f"{sdpa.name}.1"] == Layout("batch", 0), f"sdpa's second element should be batch-major, not {res.layouts[f'{sdpa.name}.1']}"
    # LayerNorm is decomposed: var_mean over the last dim keeps the batch in dim 0
    vm = node(g, lambda n: target(n) == "aten.var_mean.correction")
    assert res.layouts[f"{vm.name}.0"] == Layout("batch", 0), f"LayerNorm's var_mean over features should keep the batch in dim 0, not {res.layouts[f'{vm.name}.0']}"
    # the analysis added no guard to the shape env
    env = next(n.meta["val"] for n in g.nodes if isinstance(n.meta.get("val"), torch.Tensor)).fake_mode.shape_env
    before = len(env.guards)
    analyze(g, s)
    assert len(env.guards) == before, f"the analysis added {len(env.guards) - before} guards to the shape env; it must add none"
    # every batch value uses the one symbol in its batch dim only
    for n in fwd:
        lay = res.layouts.get(n.name)
        if lay is not None and lay.kind == "batch":
            size = n.meta["val"].shape[lay.dim]
            assert sympy.expand(size.node.expr - lay.outer * s * lay.inner) == 0, f"{n.name}'s batch dim has size {size}, not outer*s*inner of its layout {lay}"


def test_positional_input_without_batch_is_free():
    g, res = joint("pos", PosAdd, _tokens(), torch.randn(T, D))
    assert res.refusal is None, f"adding a positional table is row-separable, yet refused: {res.refusal}"
    pos = node(g, lambda n: n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor)
               and tuple(n.meta["val"].shape) == (T, D))
    assert res.layouts[pos.name] == Layout("free"), f"the positional table has no batch: it should be free, not {res.layouts[pos.name]}"
    add = node(g, lambda n: target(n) == "aten.add.Tensor" and pos in n.args)
    assert res.layouts[add.name] == Layout("batch", 0), f"tokens plus positions should be batch-major, not {res.layouts[add.name]}"
    assert_saved_gatherable(g, res)


def test_dropout_is_row_separable():
    g, res = joint("dropout", lambda: Fn(nn.Dropout(0.5)), _x())
    assert res.refusal is None, f"dropout is row-separable, yet refused: {res.refusal}"
    rand = node(g, lambda n: target(n).startswith("aten.rand"))
    assert res.layouts[rand.name] == Layout("batch", 0), f"dropout's random mask has i.i.d. rows: batch-major, not {res.layouts[rand.name]}"
    assert_saved_gatherable(g, res)


def test_batchnorm_eval_mode_is_row_separable():
    g, res = joint("bn_eval", lambda: BN(train=False), _x())
    assert res.refusal is None, f"BatchNorm in eval mode is per row, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)


def test_conv_groupnorm_pooling():
    # group norm decomposes into views, var_mean per sample and an as_strided; max pool into prims
    g, res = joint("conv", ConvNet, torch.randn(2, 3, 4, 4))
    assert res.refusal is None, f"conv, GroupNorm and pooling are per sample, yet refused: {res.refusal}"
    conv = node(g, lambda n: target(n) == "aten.convolution.default")
    assert res.layouts[conv.name] == Layout("batch", 0), f"a convolution's output should be batch-major, not {res.layouts[conv.name]}"
    assert_saved_gatherable(g, res)


def test_embedding_of_batch_indices():
    g, res = joint("emb", Emb, torch.randint(0, 10, (N, T)))
    assert res.refusal is None, f"an embedding of per-row indices is row-separable, yet refused: {res.refusal}"
    emb = node(g, lambda n: target(n) == "aten.embedding.default")
    assert res.layouts[emb.name] == Layout("batch", 0), f"the embedding of batch indices should be batch-major, not {res.layouts[emb.name]}"


@pytest.mark.parametrize("name,f", [
    ("softmax_rows", lambda h: F.log_softmax(h, 1)),
    ("sort_features", lambda h: torch.sort(h, dim=1)[0]),
    ("cumsum_features", lambda h: h.cumsum(1)),
    ("split_features", lambda h: torch.cat(h.split(2, dim=1)[::-1], 1)),
    ("stack_new_dim0", lambda h: torch.stack([h, h + 1], 0).sum(0)),  # cat along the batch, viewed back
    ("norm_rows", lambda h: h / h.norm(dim=1, keepdim=True)),
    ("pad_features", lambda h: F.pad(h, (1, 1))[:, 1:-1]),
])
def test_ops_along_feature_dims_are_row_separable(name, f):
    g, res = joint(name, lambda: Fn(f), _x())
    assert res.refusal is None, f"{name} works along the feature dims only, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)


def test_splitting_batch_slabs_back_out_is_row_separable():
    """cat along the batch stacks whole slabs (token-major, outer 2); split or chunk back into those slabs,
    each piece is batch-major again, and the graph is row-separable."""
    g, res = joint("slabs_split", lambda: Fn(lambda h: sum(torch.cat([h, h * 2], 0).chunk(2, 0))), _x())
    assert res.refusal is None, f"chunking batch slabs back out is row-separable, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)


def test_splitting_the_batch_in_halves_is_refused_as_mixing():
    """chunk of the batch dim itself (not of whole slabs) then swapped back together: row mixing, named as
    such (not an analysis error)."""
    _, res = joint("batch_halves", lambda: Fn(lambda h: torch.cat(h.chunk(2, 0)[::-1])), _x())
    assert res.refusal is not None and "cross-example op" in res.refusal, f"halves of the batch swapped: {res.refusal}"
    assert "not analysed" not in res.refusal, f"the refusal should name the op, not an analysis error: {res.refusal}"


# ------------------------------------------------------------------------------------------
# token-major layouts


def test_token_major_rows_reach_a_matmul_per_row():
    """(T*N, D) rows into a Linear: each output row reads its own input row, so the matmul is per row and
    its saved input is gathered along dim 0 viewed (T, N, 1)."""
    g, res = joint("token_major", TokenMajor, _tokens())
    assert res.refusal is None, f"token-major rows into a Linear are per row, yet refused: {res.refusal}"
    bwd = backward_nodes(g)
    view = node(g, lambda n: n not in bwd and target(n) == "aten.view.default" and n.args[0].op != "placeholder")
    lay = res.layouts[view.name]  # the (T*N, D) rows fed to the Linear
    assert (lay.dim, lay.outer, lay.inner) == (0, T, 1), f"the (T*N, D) rows should be token-major in dim 0 (outer T, inner 1), not {lay}"
    assert lay.gatherable, f"token-major rows can be gathered at the middle axis of (T, N, 1), yet {lay} is not"
    assert not lay.batch_major, f"(T*N, D) rows from a transpose are token-major, not batch-major: {lay}"
    mm = node(g, lambda n: n not in bwd and target(n) == "aten.addmm.default")
    assert res.layouts[mm.name] == Layout("batch", 0, T, 1), f"the Linear keeps its input's token-major rows, not {res.layouts[mm.name]}"
    assert_saved_gatherable(g, res)


def test_token_major_value_saved_for_the_backward_is_gathered():
    g, res = joint("token_major_saved", TokenMajorSaved, _tokens())
    sig = node(g, lambda n: target(n) == "aten.sigmoid.default")
    assert res.layouts[sig.name] == Layout("batch", 0, T, 1), f"the sigmoid of token-major rows stays token-major, not {res.layouts[sig.name]}"
    assert res.refusal is None, f"a token-major value saved for the backward can be gathered, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)
    # the Linear itself reads batch-major rows again: (N, T, D) viewed as (N*T, D)
    bwd = backward_nodes(g)
    mm = node(g, lambda n: n not in bwd and target(n) == "aten.mm.default")  # a 3-D Linear: view, mm, add
    assert res.layouts[mm.args[0].name] == Layout("batch", 0, 1, T), f"(N, T, D) viewed as (N*T, D) is batch-major with inner T, not {res.layouts[mm.args[0].name]}"


def test_mha_batch_first_false_on_batch_major_input_is_per_row():
    """(N, T, E) input transposed to the (T, N, E) that batch_first=False expects: the in-projection
    multiplies (T*N, E) rows, token-major; the head split (T, N*H, d) merges the batch with the heads
    batch-major (inner H), and attention runs per (row, head)."""
    g, res = joint("mha_bf_false", lambda: MHA(batch_first=False, transpose=True), _tokens())
    assert res.refusal is None, f"MHA on a transposed batch-major input is per row, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)
    bwd = backward_nodes(g)
    mm = node(g, lambda n: n not in bwd and target(n) == "aten.mm.default")
    assert res.layouts[mm.args[0].name] == Layout("batch", 0, T, 1), f"the in-projection multiplies token-major (T*N, E) rows, not {res.layouts[mm.args[0].name]}"
    s = batch_symbol(g)
    split = node(g, lambda n: n not in bwd and target(n) == "aten.view.default" and n.meta["val"].dim() == 3
                 and isinstance(n.meta["val"].shape[1], torch.SymInt) and n.meta["val"].shape[1].node.expr == 2 * s)
    assert res.layouts[split.name] == Layout("batch", 1, 1, 2), f"the head split (T, N*H, d) should hold the batch in dim 1 with inner H=2, not {res.layouts[split.name]}"


def test_mha_batch_first_false_on_sequence_major_input_refused():
    """(T, N, E) fed as is: the wrapper's batch dim 0 is then the sequence, which attention mixes."""
    g, res = joint("mha_seq_first", lambda: MHA(batch_first=False, transpose=False), torch.randn(T, N, D))
    assert res.refusal is not None, "attention over a sequence-major input's batch dim mixes rows: it must be refused"
    assert "cross-example" in res.refusal, f"the refusal should call it row mixing: {res.refusal}"
    assert "attends over the batch" in res.refusal, f"the refusal should say attention runs over the batch: {res.refusal}"


def test_mha_batch_first_true_is_per_row_too():
    """batch_first=True only swaps dims at the boundary: nn.MultiheadAttention's Python path transposes
    to (T, N, E) and multiplies (T*N, E) rows, so its joint graph equals the batch_first=False one."""
    g, res = joint("mha_bf_true", lambda: MHA(batch_first=True, transpose=False), _tokens())
    assert res.refusal is None, f"MHA with batch_first=True is per row, yet refused: {res.refusal}"
    assert_saved_gatherable(g, res)
    g2, res2 = joint("mha_bf_false", lambda: MHA(batch_first=False, transpose=True), _tokens())
    assert [target(n) for n in g.nodes] == [target(n) for n in g2.nodes], "batch_first=True should give the same joint graph as a transposed batch_first=False"


# ------------------------------------------------------------------------------------------
# row mixing


@pytest.mark.parametrize("name,f,op,extra", [
    ("roll", lambda h: h + torch.roll(h, 1, 0), "aten.index.Tensor", "torch.roll"),  # roll -> iota/index
    ("sort", lambda h: torch.sort(h, dim=0)[0], "aten.sort.default", "along the batch"),
    ("cumsum", lambda h: h.cumsum(0), "aten.cumsum.default", "along the batch"),
    ("perm", lambda h: h[torch.randperm(h.shape[0])], "aten.index.Tensor", "indexes along the batch"),
    ("center", lambda h: h - h.mean(0), "aten.mean.dim", "reduces over the batch"),
    ("gram", lambda h: (h @ h.T) @ h, "aten.mm.default", "pairs rows"),
    ("flip_cat", lambda h: torch.cat([h, h.flip(0)]), "prims.rev.default", "along the batch"),
    ("gather", lambda h: torch.gather(h, 0, torch.zeros_like(h, dtype=torch.long)), "aten.gather", "gathers"),
    ("slice", lambda h: F.pad(h[1:], (0, 0, 0, 1)), "aten.slice.Tensor", "slices"),
    ("global_max", lambda h: h / h.abs().max(), "aten.max.default", "reduces over the batch"),
    ("outer", lambda h: (h[:, None, :] * h[None, :, :]).sum(1), "aten.mul.Tensor", "different layouts"),
])
def test_row_mixing_refused_naming_the_op(name, f, op, extra):
    g, res = joint(name, lambda: Fn(f), _x())
    assert res.refusal is not None, f"{name} mixes rows: it must be refused"
    assert res.refusal.startswith("cross-example op in the forward"), f"the {name} refusal should say row mixing first: {res.refusal}"
    assert op in res.refusal, f"the {name} refusal should name the op {op}: {res.refusal}"
    assert extra in res.refusal, f"the {name} refusal should say how it mixes ({extra!r}): {res.refusal}"
    assert res.node is not None, f"the {name} refusal should carry the node it refused at"
    assert target(res.node).startswith(op), f"the {name} refusal should be located at {op}, not at {target(res.node)}"


def _row_indexed_mask(rows):
    """HF's padding mask: ``mask[arange(N)[:, None], arange(T)[None, :]]`` (masking_utils), ``rows`` the row index."""
    def f(h):
        mask = h > 0
        b = rows(h.shape[0])[:, None]
        return h * mask[b, torch.arange(h.shape[1])[None, :]]
    return f


def test_row_index_from_arange_is_not_mixing():
    g, res = joint("row_index", lambda: Fn(_row_indexed_mask(lambda n: torch.arange(n))), _x())
    assert res.refusal is None, f"indexing rows by arange(N) reads row b from row b, yet refused: {res.refusal}"
    idx = node(g, lambda n: target(n) == "aten.index.Tensor")
    assert res.layouts[idx.name] == Layout("batch", 0), f"the mask indexed by the row index should be batch-major, not {res.layouts[idx.name]}"
    assert_saved_gatherable(g, res)


@pytest.mark.parametrize("name,rows", [
    ("shifted", lambda n: (torch.arange(n) + 1) % n),  # a roll of the rows
    ("from1", lambda n: torch.arange(1, n + 1) % n),
    ("reversed", lambda n: torch.arange(n - 1, -1, -1)),
    ("flipped", lambda n: torch.arange(n).flip(0)),
])
def test_other_row_indices_are_mixing(name, rows):
    g, res = joint(f"row_index_{name}", lambda: Fn(_row_indexed_mask(rows)), _x())
    assert res.refusal is not None, f"a {name} row index permutes rows: it must be refused"
    assert res.refusal.startswith("cross-example op in the forward"), f"the {name} refusal should say row mixing: {res.refusal}"


def test_batch_cat_output_is_refused_naming_the_cat():
    # cat along the batch stacks the batch as slabs (outer 2); the Linear reads it per row, but the (2N, 2)
    # output is token-major: its tangent would be gathered batch-major from its sizes, so refused
    g, res = joint("cat_batch", lambda: Fn(lambda h: torch.cat([h, 2 * h])), _x())
    assert res.refusal is not None, "a token-major output (cat along the batch) must be refused"
    assert "aten.cat.default" in res.refusal, f"the refusal should name the cat that made the output token-major: {res.refusal}"
    assert "token-major" in res.refusal, f"the refusal should say the output is token-major: {res.refusal}"
    assert "output of the forward" in res.refusal, f"the refusal should say the value is an output: {res.refusal}"
    cat = node(g, lambda n: target(n) == "aten.cat.default")
    assert res.layouts[cat.name] == Layout("batch", 0, 2, 1), f"cat of two batch values along the batch is two slabs (outer 2), not {res.layouts[cat.name]}"
    assert res.node is cat, f"the token-major output's refusal should point at the cat that made it so, not {res.node}"


def test_batchnorm_train_mode_refused_as_cross_example():
    g, res = joint("bn_train", lambda: BN(train=True), _x())
    assert res.refusal is not None, "BatchNorm in train mode mixes rows: it must be refused"
    assert "cross-example" in res.refusal, f"the refusal should call it row mixing: {res.refusal}"
    assert "BatchNorm" in res.refusal, f"the refusal should name BatchNorm: {res.refusal}"
    assert "var_mean" in res.refusal, f"the refusal should name the var_mean op: {res.refusal}"


def test_batch_size_used_as_a_value_refused():
    g, res = joint("scale", lambda: Fn(lambda h: h / h.shape[0]), _x())
    assert res.refusal is not None, "dividing by the batch size makes a row depend on N: it must be refused"
    assert "uses the batch size as a value" in res.refusal, f"the refusal should say the batch size is used as a value: {res.refusal}"


def test_unknown_op_refused_only_where_it_matters():
    g, res = joint("mystery", lambda: Fn(mystery), _x())
    m = node(g, lambda n: "mystery" in target(n))
    assert res.layouts[m.name].kind == "unknown", f"an op the analysis does not model should be unknown, not {res.layouts[m.name]}"
    assert "mystery" in res.layouts[m.name].why, f"the unknown layout should name the op that lost it: {res.layouts[m.name].why!r}"
    assert res.refusal is not None, "an unknown value saved for the backward must be refused"
    assert "unknown" in res.refusal, f"the refusal should say the layout is unknown: {res.refusal}"
    assert "saved for the backward" in res.refusal, f"the refusal should say the value is saved for the backward: {res.refusal}"
    assert res.node is m, f"the refusal should point at the op that lost the layout ({m.name}), not at {res.node}"
    assert res.layouts[m.name].origin is None, (
        "the returned layouts should hold no graph node: graph records keep them after the joint graph is gone")
    # an unknown value nobody reads: no refusal
    gm = _trace(lambda x: (mystery(x), x * 2)[1], torch.randn(N, D))
    res2 = analyze(gm.graph, batch_symbol(gm.graph))
    m2 = node(gm.graph, lambda n: "mystery" in target(n))
    assert res2.layouts[m2.name].kind == "unknown", f"an op the analysis does not model should be unknown, not {res2.layouts[m2.name]}"
    assert res2.refusal is None, f"an unknown value nobody reads should not refuse the graph: {res2.refusal}"


def test_refusal_naming_no_op_still_locates_the_value():
    """An input with the batch in dim 1 is unknown from the start: the message names no op (no
    ``name (target)``), yet the refusal carries the op of the value that matters, for its source line."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from capskip_fx.passes.insert_select import prove_layout
    from capskip_fx.records import RefusalKind, Refused
    y = torch.randn(D, N)  # made outside the fake mode: a real tensor to fake
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = mode.from_tensor(y, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC]))
        gm = make_fx(lambda y: y.sin(), tracing_mode="fake")(fake)
    sym = fake.shape[1].node.expr
    sin = node(gm.graph, lambda n: target(n) == "aten.sin.default")
    res = analyze(gm.graph, sym)
    assert res.refusal is not None, "an output whose batch layout is unknown must be refused"
    assert f"{sin.name} ({sin.target})" not in res.refusal, f"the message should name no op here: {res.refusal}"
    assert res.node is sin, f"the refusal should point at the output value {sin.name}, not at {res.node}"
    with pytest.raises(Refused) as caught:
        prove_layout(gm.graph, sym)
    refusal = caught.value.refusal
    assert refusal.kind is RefusalKind.BATCH_LAYOUT, f"an unknown output is a batch-layout refusal, not {refusal.kind}"
    assert refusal.op == "aten.sin.default", f"the refusal should name the output's op, got {refusal.op!r}"


def test_layout_api():
    assert Layout("free").gatherable, "a free value is the same for every row: gatherable"
    assert Layout("batch", 2, 1, 7).gatherable, "a batch-major value is gathered along its batch dim"
    assert Layout("batch", 0, 3, 1).gatherable, "a token-major value is gathered at the middle axis of (outer, N, inner)"
    assert not Layout("unknown", why="x").gatherable, "an unknown layout gives no dim to gather"
    assert Layout("batch", 2, 1, 7).batch_major, "outer 1 is batch-major, whatever the inner factor"
    assert not Layout("batch", 0, 3, 1).batch_major, "outer 3 is token-major"
    assert Layout("batch", 0, sympy.Integer(2), 1, why="cat") == Layout("batch", 0, 2, 1), "why is a note: layouts equal in dim, outer and inner are equal"
    with pytest.raises(ValueError):
        analyze(torch.fx.Graph(), None)


# ------------------------------------------------------------------------------------------
# the reshape rule and random programs


def _regroup(fine: list, cuts: list) -> list:
    out, acc = [], sympy.Integer(1)
    for i, e in enumerate(fine):
        acc = acc * e
        if i + 1 in cuts or i == len(fine) - 1:
            out.append(acc)
            acc = sympy.Integer(1)
    return out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 4), max_size=4), st.data())
def test_reshape_layout_regroupings(dims, data):
    """Any two groupings of one fine shape (with s somewhere): the layout is found, and it is right."""
    s = sympy.Symbol("s", positive=True, integer=True)
    p = data.draw(st.integers(0, len(dims)))
    fine = [sympy.Integer(d) for d in dims[:p]] + [s] + [sympy.Integer(d) for d in dims[p:]]
    cuts_in = data.draw(st.sets(st.integers(1, len(fine) - 1))) if len(fine) > 1 else set()
    cuts_out = data.draw(st.sets(st.integers(1, len(fine) - 1))) if len(fine) > 1 else set()
    shape_in, shape_out = _regroup(fine, cuts_in), _regroup(fine, cuts_out)
    lay_in = reshape_layout(Layout("batch", p), fine, shape_in, s)
    lay = reshape_layout(lay_in, shape_in, shape_out, s)
    assert lay is not None, f"regrouping {shape_in} as {shape_out} keeps the batch index whole, yet no layout was found"
    assert lay.kind == "batch", f"a reshape of a batch value should stay a batch value, not {lay}"
    n = 3  # check on a real tensor whose values are the batch index
    real = [int(e.subs(s, n)) for e in fine]
    x = torch.arange(n).reshape([1] * p + [n] + [1] * (len(fine) - p - 1)).expand(real)
    y = x.reshape([int(e.subs(s, n)) for e in shape_out]).movedim(lay.dim, 0)
    y = y.reshape(int(lay.outer), n, int(lay.inner), -1)
    assert (y == torch.arange(n).view(1, n, 1, 1)).all(), f"layout {lay} of {shape_out} does not put row b's elements at index b of its middle axis"


def test_reshape_layout_refuses_non_layouts():
    s = sympy.Symbol("s", positive=True, integer=True)
    flat = Layout("batch", 0, sympy.Integer(2), sympy.Integer(3))  # (2*s*3,): index (o*s + b)*3 + r
    assert reshape_layout(flat, [6 * s], [sympy.Integer(6), s], s) is None, "(6, s) mixes the batch index with o and r: no layout"
    assert reshape_layout(flat, [6 * s], [sympy.Integer(2), 3 * s], s) == Layout("batch", 1, 1, 3), "(2, 3*s): the outer factor becomes dim 0, the batch dim 1 with inner 3"
    assert reshape_layout(flat, [6 * s], [2 * s, sympy.Integer(3)], s) == Layout("batch", 0, 2, 1), "(2*s, 3): the inner factor becomes dim 1, the batch stays token-major in dim 0"


def _trace(f, x):
    """make_fx of ``f`` with x's dim 0 symbolic (a forward-only graph: no tangents)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)))
        return make_fx(f, tracing_mode="fake")(fake)


def _static_part(size, s):
    e = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
    return int(e / s) if s in e.free_symbols else int(e)


def _draw_op(data, shape, s):
    """One random op valid for ``shape`` (dims with the batch have symbolic sizes)."""
    nd = len(shape)
    i = data.draw(st.integers(0, nd - 1))
    j = data.draw(st.integers(0, nd - 1))
    kind = data.draw(st.sampled_from(["permute", "flatten", "unflatten", "transpose", "pointwise", "sum", "softmax",
                                      "cumsum", "matmul", "cat", "roll", "unsqueeze_expand", "chunk", "stack",
                                      "flip", "gram", "combine"]))
    last = None if isinstance(shape[-1], torch.SymInt) and s in shape[-1].node.expr.free_symbols else int(shape[-1])
    if kind == "permute":
        perm = data.draw(st.permutations(range(nd)))
        return lambda h: h.permute(*perm)
    if kind == "flatten" and nd >= 2:
        i = min(i, nd - 2)
        return lambda h: h.flatten(i, i + 1)
    if kind == "unflatten" and nd <= 4:
        k = _static_part(shape[i], s)
        divisors = [d for d in range(2, k + 1) if k % d == 0]
        if divisors:
            d = data.draw(st.sampled_from(divisors))
            front = data.draw(st.booleans())
            return lambda h: h.unflatten(i, (d, -1) if front else (-1, d))
    if kind == "transpose":
        return lambda h: h.transpose(i, j)
    if kind == "pointwise":
        with unset_fake_temporarily():
            w = torch.randn(last) if last is not None else torch.randn(())
        return lambda h: (h * w + 1).sin()
    if kind == "sum":
        keep = data.draw(st.booleans())
        return lambda h: h.sum(i, keepdim=keep)
    if kind == "softmax":
        return lambda h: h.softmax(i)
    if kind == "cumsum":
        return lambda h: h.cumsum(i)
    if kind == "matmul" and last is not None:
        with unset_fake_temporarily():
            w = torch.randn(last, 3)
        return lambda h: h @ w
    if kind == "cat":
        return lambda h: torch.cat([h, h * 2], i)
    if kind == "roll":
        return lambda h: torch.roll(h, 1, i)
    if kind == "unsqueeze_expand" and nd <= 4:
        return lambda h: h.unsqueeze(i).expand(*h.shape[:i], 2, *h.shape[i:])
    if kind == "chunk" and _static_part(shape[i], s) % 2 == 0:
        return lambda h: h.chunk(2, i)[1]
    if kind == "stack" and nd <= 4:
        return lambda h: torch.stack([h, h.cos()], i)
    if kind == "flip":
        return lambda h: h.flip(i)
    if kind == "gram" and nd >= 2:
        return lambda h: h @ h.transpose(-1, -2)
    if kind == "combine":
        return lambda h: h * h.sum(i, keepdim=True)
    return None


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
@pytest.mark.heavy
def test_random_programs_layouts_are_true(data):
    """Perturbing input row b changes only the elements each claimed layout gives to row b."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    n = 5
    shape0 = (n, data.draw(st.sampled_from([2, 3, 4])), data.draw(st.sampled_from([2, 3, 4])))
    ops = []
    mode = FakeTensorMode(shape_env=ShapeEnv())  # shapes with the batch symbolic, to pick valid ops
    h = mode.from_tensor(torch.randn(shape0), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC]))
    s = h.shape[0].node.expr
    with mode:
        for _ in range(data.draw(st.integers(1, 5))):
            op = _draw_op(data, h.shape, s)
            if op is None:
                continue
            try:
                h2 = op(h)
            except Exception:
                continue
            if h2.numel() == 0 or h2.dim() > 5:
                continue
            ops.append(op)
            h = h2

    def program(x):
        for op in ops:
            x = op(x)
        return x

    gm = _trace(program, torch.randn(shape0))
    sym = batch_symbol(gm.graph)
    # torch 2.11's make_fx (not Dynamo) specializes a batched `@`'s batch dim: no symbol, nothing to claim
    assume(sym is not None)
    res = analyze(gm.graph, sym)

    def values(x):
        interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
        interp.run(x)
        return interp.env

    x0 = torch.randn(shape0, dtype=torch.float64)
    with torch.no_grad():
        base = values(x0.float())
        for b in range(n):
            x1 = x0.clone()
            x1[b] += 1.0 + torch.rand(shape0[1:], dtype=torch.float64)
            pert = values(x1.float())
            for nd_, v0 in base.items():
                lay = res.layouts.get(nd_.name)
                if lay is None or lay.kind == "unknown" or not isinstance(v0, torch.Tensor):
                    continue
                v1 = pert[nd_]
                changed = (v0 != v1) if not v0.is_floating_point() else (v0 - v1).abs() > 1e-5 * (1 + v0.abs())
                if lay.kind == "free":
                    assert not changed.any(), f"{nd_.name} is claimed free, yet changes when row {b} of the input does"
                    continue
                size = v0.shape[lay.dim]
                assert size == int(lay.outer) * n * int(lay.inner), f"{nd_.name} of shape {tuple(v0.shape)}: its batch dim is not outer*N*inner of {lay}"
                owner = (torch.arange(size) // int(lay.inner)) % n
                mine = (owner == b).view([-1 if d == lay.dim else 1 for d in range(v0.dim())]).expand(v0.shape)
                assert not (changed & ~mine).any(), f"{nd_.name} ({lay}): perturbing row {b} changed elements other rows own; program: {[str(o) for o in gm.graph.nodes]}"
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    if res.refusal is None:
        for o in out:
            assert res.layouts[o.name].kind != "unknown", f"unrefused, yet output {o.name}'s layout is unknown"
            assert res.layouts[o.name].batch_major, f"unrefused, yet output {o.name} is not batch-major: {res.layouts[o.name]}"
    assert sym is not None, "the traced program should keep its symbolic batch size"


# ------------------------------------------------------------------------------------------
# a per-row gather: x[arange(N), j] with j one index per row (a decoder classifier's last token)


def _last_token(h):
    """j: the last position whose first feature is positive (a padding-mask's last real token), per row."""
    return ((h[..., 0] > 0).long() * torch.arange(h.shape[1])).argmax(-1)


class LastToken(nn.Module):
    def __init__(self, pick):
        super().__init__()
        self.lin, self.head, self.pick = nn.Linear(D, D), nn.Linear(D, 3), pick

    def forward(self, x):
        return self.pick(self.head(self.lin(x).relu()), x)


def _per_row_pick(kind):
    return {
        "index": lambda z, x: z[torch.arange(z.shape[0]), _last_token(x)],
        "gather": lambda z, x: z.gather(1, _last_token(x)[:, None, None].expand(-1, 1, z.shape[-1])).squeeze(1),
    }[kind]


# (torch.take_along_dim specialises the batch size while Dynamo traces it: gather is the dynamic spelling)
@pytest.mark.parametrize("kind", ["index", "gather"])
def test_per_row_gather_is_row_separable(kind):
    from capskip_fx.passes.row_index import recompute_row_indices
    g, res = joint(f"per_row_{kind}", lambda: LastToken(_per_row_pick(kind)), _tokens())
    out = next(iter(g.find_nodes(op="output"))).args[0][0]
    if kind != "index":
        assert res.refusal is None, f"a per-row {kind} of the last token is row-separable, yet refused: {res.refusal}"
        assert res.layouts[out.name] == Layout("batch", 0), f"the per-row pick should be batch-major, not {res.layouts[out.name]}"
        return
    # the backward's index_put reads arange(N): gathered at the kept rows it would be wrong, so it is refused
    # until the pass gives the backward its own arange
    assert res.refusal is not None, "a row index read by the backward must be refused until the pass recomputes it"
    assert "row index" in res.refusal, f"the refusal should name the row index: {res.refusal}"
    assert "read by the backward" in res.refusal, f"the refusal should say the backward reads it: {res.refusal}"
    sym = batch_symbol(g)
    recomputed = recompute_row_indices(g, sym)
    assert recomputed == 1, f"the pass should give the backward its own arange for the one row index, did {recomputed}"
    res2 = analyze(g, sym)
    assert res2.refusal is None, f"with the backward's own arange the graph is row-separable, yet refused: {res2.refusal}"
    idx = node(g, lambda n: target(n) == "aten.index.Tensor" and n.args[0].meta["val"].dim() == 3)
    assert res2.layouts[idx.name] == Layout("batch", 0), f"x[arange(N), j] should be batch-major, not {res2.layouts[idx.name]}"
    assert_saved_gatherable(g, res2)
    recomputed = recompute_row_indices(g, sym)
    assert recomputed == 0, f"a second run of the pass should change nothing (idempotent), yet it recomputed {recomputed}"


@pytest.mark.parametrize("name,pick", [
    ("row_as_column", lambda z, x: z[torch.arange(z.shape[0]), torch.arange(z.shape[0]) % z.shape[1]]),
    ("shifted_rows", lambda z, x: z[(torch.arange(z.shape[0]) + 1) % z.shape[0], _last_token(x)]),
    ("other_rows_j", lambda z, x: z[torch.arange(z.shape[0]), _last_token(x).roll(1, 0)]),
    ("free_rows", lambda z, x: z[torch.zeros(z.shape[0], dtype=torch.long), _last_token(x)]),
])
def test_per_row_gather_with_a_wrong_index_is_refused(name, pick):
    g, res = joint(f"per_row_bad_{name}", lambda: LastToken(pick), _tokens())
    assert res.refusal is not None, f"the {name} pick reads other rows: it must be refused"


_ROWS = {"arange": lambda n: torch.arange(n), "shift": lambda n: (torch.arange(n) + 1) % n,
         "flip": lambda n: torch.arange(n).flip(0), "zeros": lambda n: torch.zeros(n, dtype=torch.long),
         "clamped": lambda n: torch.arange(n).clamp(max=n - 2)}
_COLS = {"own": lambda x, rows: _last_token(x), "rolled": lambda x, rows: _last_token(x).roll(1, 0),
         "const": lambda x, rows: torch.ones(x.shape[0], dtype=torch.long),
         "from_rows": lambda x, rows: rows % x.shape[1], "other_rows": lambda x, rows: _last_token(x)[rows]}


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(_ROWS)), st.sampled_from(sorted(_COLS)), st.booleans())
def test_any_index_pattern_is_per_row_or_refused(rows_kind, cols_kind, unsqueeze):
    """x[rows, cols] with any row and column index: refused, or every output row depends on its own input
    row only (checked by perturbing one input row at a time); the per-row pattern is never refused."""
    n = 5

    def program(x):
        rows = _ROWS[rows_kind](x.shape[0])
        cols = _COLS[cols_kind](x, rows)
        z = (x * 2).sin()
        return z[rows[:, None], cols[:, None]] if unsqueeze else z[rows, cols]

    gm = _trace(program, torch.randn(n, T, D))
    res = analyze(gm.graph, batch_symbol(gm.graph))
    if rows_kind == "arange" and cols_kind in ("own", "const"):
        assert res.refusal is None, f"x[arange(N), {cols_kind}] is the per-row pattern and must not be refused: {res.refusal}"
    if res.refusal is not None:
        return
    x0 = torch.randn(n, T, D)
    x0[..., 0] = x0[..., 0].abs() * torch.where(torch.rand(n, T) < 0.5, 1.0, -1.0)
    y0 = gm(x0)
    for b in range(n):
        x1 = x0.clone()
        x1[b] = torch.randn(T, D)
        changed = (gm(x1) != y0).flatten(1).any(1)
        assert not changed[torch.arange(n) != b].any(), f"unrefused x[{rows_kind}, {cols_kind}] (unsqueeze={unsqueeze}): perturbing row {b} changed other rows' outputs"


def test_the_op_table_in_the_design_doc_is_the_registry():
    """docs/design.md's table of ops is generated from the placement registry (regenerate it with
    ``placement.op_table_markdown()`` when a rule or an op is added)."""
    import pathlib

    from capskip_fx.placement import op_table_markdown
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    table = doc.split("<!-- op-table: generated -->\n", 1)[1].split("<!-- /op-table -->", 1)[0]
    assert table == op_table_markdown(), "docs/design.md's op table is stale: regenerate it from the registry"
