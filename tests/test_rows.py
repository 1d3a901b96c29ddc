"""The row gather (rows.gather_all) against the per-input reference gather, on random strided views of
shared buffers (qkv-style splits, channel slices, permutes, token-flattened rows)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capskip_fx.rows import gather_all, gather_rows
from capskip_fx.symbolic import Spec


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
