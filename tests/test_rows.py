"""The row gather and scatter (rows.gather_rows, rows.scatter_rows) against explicit per-position loops, for
batch-major, token-major and factored layouts; the fused gather (rows.gather_all) against gather_rows on
random strided views of shared buffers (qkv-style splits, channel slices, permutes, token-flattened rows)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capskip_fx.rows import gather_all, gather_rows, scatter_rows
from capskip_fx.symbolic import Spec


def _positions(outer: int, n: int, factor: int, rows: list) -> list:
    """Along the batch dim, position ``(o * n + b) * factor + r`` holds row b's r-th slice in block o; listed
    block by block, then row by row in ``rows``' order (the layout of the gathered tensor)."""
    return [(o * n + b) * factor + r for o in range(outer) for b in rows for r in range(factor)]


@st.composite
def _layouts(draw):
    """(x, spec, kept rows in gather order, target strides' dim order): rank 1-4, the batch in any dim,
    batch-major (outer 1) or token-major (outer > 1), factor >= 1."""
    rank = draw(st.integers(1, 4))
    d = draw(st.integers(0, rank - 1))
    n, outer, factor = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(rank)]
    sizes[d] = outer * n * factor
    rows = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=n, unique=True))  # any order, none too
    order = draw(st.permutations(range(rank)))  # the compiled graph's expected strides: any dim order
    x = torch.arange(float(torch.Size(sizes).numel()), dtype=torch.float64).reshape(sizes)
    if draw(st.booleans()):  # a strided source (a transposed view)
        x = x.transpose(0, rank - 1).contiguous().transpose(0, rank - 1)
    return x, Spec("batch", dim=d, factor=factor, outer=outer), rows, order


def _strides_in_order(sizes, order):
    """Contiguous strides for ``sizes`` laid out with ``order[-1]`` innermost."""
    strides, step = [0] * len(sizes), 1
    for i in reversed(order):
        strides[i] = step
        step *= sizes[i]
    return tuple(strides)


@settings(max_examples=200, deadline=None)
@given(_layouts())
def test_gather_and_scatter_rows_match_explicit_positions(layout):
    x, spec, rows, order = layout
    d, n = spec.dim, x.shape[spec.dim] // (spec.outer * spec.factor)
    idx = torch.tensor(rows, dtype=torch.long)
    pos = _positions(spec.outer, n, spec.factor, rows)
    sizes = list(x.shape)
    sizes[d] = len(pos)
    strides = _strides_in_order(sizes, order)
    y = gather_rows(x, spec, idx, n, tuple(sizes), strides)
    assert tuple(y.shape) == tuple(sizes) and y.stride() == strides, (
        f"{spec}: gathered rows should have the graph's sizes {sizes} and strides {strides}, got {tuple(y.shape)} {y.stride()}")
    for i, p in enumerate(pos):
        assert torch.equal(y.select(d, i), x.select(d, p)), (
            f"{spec}, rows {rows}: gathered position {i} should hold source position {p}")
    g = torch.randn(sizes, dtype=torch.float64)
    full = scatter_rows(g, spec, idx, n)
    want = torch.zeros(x.shape, dtype=torch.float64)
    for i, p in enumerate(pos):
        want.select(d, p).copy_(g.select(d, i))
    assert torch.equal(full, want), (
        f"{spec}, rows {rows}: scattered rows should land at their source positions, every other row zero")


def test_token_major_gather_reads_each_token_block():
    """(T*N, E) token-major, T=2, N=3, rows [2, 0]: the gather takes rows 2, 0 of token 0, then of token 1."""
    x = torch.arange(1., 7.).repeat_interleave(2).view(6, 2)  # position p holds p + 1
    y = gather_rows(x, Spec("batch", outer=2), torch.tensor([2, 0]), 3, (4, 2), (2, 1))
    assert y[:, 0].tolist() == [3, 1, 6, 4], f"token-major rows [2, 0] of N=3 should be positions 2, 0, 5, 3, got {y[:, 0].tolist()}"
    full = scatter_rows(y, Spec("batch", outer=2), torch.tensor([2, 0]), 3)
    assert full[:, 0].tolist() == [1, 0, 3, 4, 0, 6], f"the scatter should put them back, row 1 zero: {full[:, 0].tolist()}"


def _views(buf: torch.Tensor, kind: str):
    """(views, factors) of one batch-major buffer (n, T, C)."""
    n, t, c = buf.shape
    if kind == "qkv":  # (n, T, 3*h*d) -> three (n, h, T, d) views, as attention saves them
        h, d = 2, c // 6
        v = buf.view(n, t, 3, h, d).permute(2, 0, 3, 1, 4)
        return [v[0], v[1], v[2]], [1, 1, 1]
    if kind == "slice":  # one channel slice: a small part of each row
        return [buf[:, :, 1:3]], [1]
    if kind == "flat":  # token rows (n*T, C): the batch with a factor
        return [buf.reshape(n * t, c)], [t]
    if kind == "transpose":
        return [buf.transpose(1, 2)], [1]
    return [buf], [1]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 6), t=st.integers(1, 4), kinds=st.lists(st.sampled_from(["qkv", "slice", "flat", "transpose", "whole"]),
       min_size=1, max_size=3), keep=st.data(), contiguous_target=st.booleans())
def test_gather_all_equals_reference(n, t, kinds, keep, contiguous_target):
    args, specs, lays = [], [], []
    idx = torch.tensor(sorted(keep.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    kb = idx.numel()
    for kind in kinds:
        buf = torch.randn(n, t, 12, dtype=torch.float64)
        views, factors = _views(buf, kind)
        for v, f in zip(views, factors):
            sizes = (kb * f,) + tuple(v.shape[1:])
            strides = torch.empty(sizes).stride() if contiguous_target else v.stride()
            args.append(v)
            specs.append(Spec("batch", factor=f))
            lays.append((sizes, strides))
    out = gather_all(args, specs, idx, n, lays)
    for o, a, s, (sizes, strides) in zip(out, args, specs, lays):
        ref = gather_rows(a, s, idx, n, sizes, strides)
        assert torch.equal(o, ref), f"gather_all should gather the kept rows {idx.tolist()} of a {s} view as gather_rows does"
        assert tuple(o.shape) == tuple(sizes), f"gathered rows should have the target sizes {sizes}, got {tuple(o.shape)}"
        assert o.stride() == tuple(strides), f"gathered rows should have the target strides {strides}, got {o.stride()}"
        assert o.untyped_storage().data_ptr() != a.untyped_storage().data_ptr(), (
            "the gathered rows should be a copy: the source activation may be freed")


def test_qkv_views_share_one_gathered_buffer():
    buf = torch.randn(4, 3, 12)
    views, _ = _views(buf, "qkv")
    idx = torch.tensor([0, 2])
    lays = [((2,) + tuple(v.shape[1:]), v.stride()) for v in views]
    out = gather_all(views, [Spec("batch")] * 3, idx, 4, lays)
    buffers = len({o.untyped_storage().data_ptr() for o in out})
    assert buffers == 1, f"q, k and v views of one buffer should be gathered into one buffer, not {buffers}"
