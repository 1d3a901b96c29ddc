"""The ops the placement proof knows, as data: sets of qualified op names (``"aten::mm"``), not packet objects,
so that ops registered after this module is imported (Inductor's ``prims._low_memory_max_pool_*``) are known
too, and names this torch build lacks are harmless.  Each table is registered to its rule in an ``ops_*``
module (registry.rule); ``torch.Tag.pointwise`` marks the pointwise ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

aten = torch.ops.aten
prims = torch.ops.prims


def packets(ns, names: str) -> frozenset:
    return frozenset(f"{ns.name}::{nm}" for nm in names.split())


def packet_of(n: fx.Node) -> Optional[str]:
    """The qualified name of the node's op ("aten::mm"), the key of the op tables."""
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None)


# one tensor input; the batch dim survives intact (possibly moved): found again as the output's s-dim
MOVE_OPS = packets(aten, """permute transpose t unsqueeze squeeze expand expand_as movedim alias clone
    contiguous detach lift_fresh lift_fresh_copy _to_copy to type_as repeat permute_copy transpose_copy
    t_copy unsqueeze_copy squeeze_copy alias_copy detach_copy expand_copy fill zero zeros_like ones_like
    full_like empty_like rand_like randn_like randint_like bernoulli native_dropout dropout
    feature_dropout alpha_dropout _conj resolve_conj resolve_neg positive""") | packets(
    prims, "squeeze transpose view_of clone")
# reshapes: the batch dim's position in the flattened tensor decides the new layout
RESHAPE_OPS = packets(aten, "view reshape _unsafe_view _reshape_alias view_copy flatten unflatten") | packets(
    prims, "reshape collapse_view collapse split_dim")
# reductions: (dim arg index); a missing/None/[] dim means all dims
REDUCE_OPS = {p: i for names, i in (
    ("sum mean amax amin var std var_mean std_mean logsumexp any all prod max min argmax argmin nansum "
     "count_nonzero median nanmedian aminmax", 1), ("linalg_vector_norm norm", 2)) for p in packets(aten, names)}
REDUCE_OPS.update({p: 1 for p in packets(prims, "sum amax amin prod var xor_sum")})
# ops along one dim (shape kept or resized there): (dim arg index, default dim or None = all dims)
ALONG_OPS = {p: spec for names, spec in (
    ("softmax _softmax log_softmax _log_softmax cumsum cumprod logcumsumexp cummax cummin flip", (1, None)),
    ("sort argsort mode glu", (1, -1)), ("topk kthvalue", (2, -1)), ("roll", (2, None)), ("msort", (None, 0)),
) for p in packets(aten, names)}
ALONG_OPS.update({p: (1, None) for p in packets(prims, "rev")})
# slicing-like ops: along the batch they are row mixing unless they are no-ops: (dim arg index, default)
SLICE_OPS = {p: spec for names, spec in (
    ("slice slice_copy", (1, 0)), ("select select_copy narrow narrow_copy", (1, None)),
    ("split split_with_sizes unsafe_split unsafe_split_with_sizes chunk tensor_split split_copy "
     "split_with_sizes_copy", (2, 0)), ("unbind unbind_copy", (1, 0)),
) for p in packets(aten, names)}
INDEX_SELECT_OPS = packets(aten, "index_select")
CAT_OPS = packets(aten, "cat concat concatenate") | packets(prims, "cat")
STACK_OPS = packets(aten, "stack")
INDEX_OPS = packets(aten, "index _unsafe_index")
MASKED_INDEX_OPS = packets(aten, "_unsafe_masked_index")
INDEX_PUT_OPS = packets(aten, "index_put index_put_ _unsafe_index_put _index_put_impl")
MASKED_INDEX_PUT_OPS = packets(aten, "_unsafe_masked_index_put_accumulate")
GATHER_OPS = packets(aten, "gather take_along_dim")
SCATTER_OPS = packets(aten, "scatter scatter_add scatter_reduce")
INDEX_UPDATE_OPS = packets(aten, "index_add index_copy index_fill index_reduce")
SCATTER_SLICE_OPS = {p: spec for names, spec in (
    ("slice_scatter", (2, 0)), ("select_scatter", (2, None))) for p in packets(aten, names)}
EMBEDDING_OPS = packets(aten, "embedding")
MATMUL_OPS = packets(aten, "mm bmm matmul mv dot vdot _int_mm")
ADD_MATMUL_OPS = packets(aten, "addmm baddbmm addmv _addmm_activation")
# per-sample ops: every batch input has the batch in dim 0 with one layout; so do the outputs
PER_SAMPLE_OPS = packets(aten, """convolution _convolution conv1d conv2d conv3d conv_transpose1d
    conv_transpose2d conv_transpose3d cudnn_convolution cudnn_convolution_transpose mkldnn_convolution
    convolution_overrideable max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
    max_pool3d_with_indices
    avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
    _adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d
    upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d _upsample_nearest_exact2d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d upsample_bicubic2d upsample_trilinear3d
    _upsample_bilinear2d_aa _upsample_bicubic2d_aa native_group_norm group_norm grid_sampler grid_sampler_2d
    grid_sampler_3d im2col col2im reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d
    replication_pad2d replication_pad3d""") | packets(prims, "_low_memory_max_pool_with_offsets _low_memory_max_pool_offsets_to_indices")
# attention(q, k, v, ...): q (..., L, E), k (..., S, E), v (..., S, Ev); tuple outputs (out, logsumexp, ...)
ATTENTION_OPS = packets(aten, """_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention
    _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention scaled_dot_product_attention
    _scaled_dot_product_attention_math _scaled_dot_product_fused_attention_overrideable""")
LAYER_NORM_OPS = packets(aten, "native_layer_norm layer_norm rms_norm _fused_rms_norm")
BATCH_NORM_OPS = packets(aten, """native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional
    _native_batch_norm_legit_no_training batch_norm cudnn_batch_norm miopen_batch_norm _batch_norm_with_update
    _batch_norm_with_update_functional _batch_norm_no_update""")
# factories: rows are constant or i.i.d. random, so a batch-sized one fits any layout
NEW_OPS = packets(aten, "new_zeros new_ones new_full new_empty new_empty_strided")
FACTORY_OPS = NEW_OPS | packets(aten, """full zeros ones empty empty_strided empty_permuted rand randn randint
    normal scalar_tensor""") | packets(prims, "full empty_strided empty_permuted scalar_tensor normal uniform")
PAD_OPS = packets(aten, "constant_pad_nd")
# ---- backward-only ops (passes/validate.py walks the backward that runs)
# reductions that add the rows up (a parameter gradient); the others over the batch are mixing there too
SUM_OPS = packets(aten, "sum nansum") | packets(prims, "sum")
# per-sample backwards: input gradients keep the batch in dim 0, weight gradients sum over the rows
PER_SAMPLE_BACKWARD_OPS = packets(aten, """convolution_backward convolution_backward_overrideable
    max_pool2d_with_indices_backward max_pool3d_with_indices_backward avg_pool2d_backward avg_pool3d_backward
    _adaptive_avg_pool2d_backward _adaptive_avg_pool3d_backward adaptive_max_pool2d_backward
    adaptive_max_pool3d_backward upsample_nearest1d_backward upsample_nearest2d_backward upsample_nearest3d_backward
    _upsample_nearest_exact1d_backward _upsample_nearest_exact2d_backward _upsample_nearest_exact3d_backward
    upsample_linear1d_backward upsample_bilinear2d_backward upsample_bicubic2d_backward upsample_trilinear3d_backward
    reflection_pad1d_backward reflection_pad2d_backward reflection_pad3d_backward replication_pad1d_backward
    replication_pad2d_backward replication_pad3d_backward grid_sampler_2d_backward grid_sampler_3d_backward
    native_group_norm_backward native_batch_norm_backward""")
LAYER_NORM_BACKWARD_OPS = packets(aten, "native_layer_norm_backward _fused_rms_norm_backward")
SOFTMAX_BACKWARD_OPS = packets(aten, "_softmax_backward_data _log_softmax_backward_data")
# attention backwards: (grad_out, q, k, v, ...) -> (dq, dk, dv, ...); the fused kernels with dropout regenerate
# their mask from a seed and offset (the batch rows 0..k-1's masks at k gathered rows)
ATTENTION_BACKWARD_OPS = packets(aten, """_scaled_dot_product_flash_attention_for_cpu_backward
    _scaled_dot_product_flash_attention_backward _scaled_dot_product_efficient_attention_backward
    _scaled_dot_product_cudnn_attention_backward _scaled_dot_product_fused_attention_overrideable_backward
    _flash_attention_backward _efficient_attention_backward""")
EMBEDDING_BACKWARD_OPS = packets(aten, "embedding_dense_backward embedding_backward")
# activation backwards torch does not tag pointwise
ACTIVATION_BACKWARD_OPS = packets(aten, """hardtanh_backward leaky_relu_backward elu_backward softplus_backward
    mish_backward hardswish_backward hardsigmoid_backward log_sigmoid_backward softshrink_backward
    hardshrink_backward rrelu_with_noise_backward""")
# random numbers drawn from a seed the graph holds (Inductor's RNG, functionalised RNG, checkpoint's replay)
RNG_OPS = packets(prims, "inductor_random inductor_seeds inductor_lookup_seed inductor_randint philox_rand")
RNG_HOPS = frozenset({"run_with_rng_state", "run_and_save_rng_state", "graphsafe_run_with_rng_state"})
# ``arange(N)``: row b holds the value b (a row index, as HF's masks build with ``torch.arange(batch_size)``)
ARANGE_OPS = packets(aten, "arange") | packets(prims, "iota")
# ops whose output elements are copies of input elements (views, slices, copies, casts): a row index stays
# one through them where the walk keeps its layout batch-major with inner 1 (element at row b from row b)
VALUE_KEEPING_OPS = packets(aten, """slice slice_copy select narrow permute transpose t unsqueeze squeeze expand expand_as movedim alias clone
    contiguous detach lift_fresh lift_fresh_copy _to_copy to type_as view reshape _unsafe_view _reshape_alias
    view_copy flatten permute_copy transpose_copy t_copy unsqueeze_copy squeeze_copy alias_copy detach_copy
    expand_copy""") | packets(prims, "squeeze transpose view_of clone reshape convert_element_type")
AS_STRIDED_OPS = packets(aten, "as_strided") | packets(prims, "as_strided")  # a reshape when contiguous
# functional copies of a tensor into another's shape: pointwise in effect
POINTWISE_EXTRA = packets(aten, "copy copy_ fill_ masked_fill where _masked_scale lerp clamp") | packets(
    prims, "where copy_to")

