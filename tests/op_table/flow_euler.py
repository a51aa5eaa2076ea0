"""op_cases entry of flow_euler: sizes (B, D, H, steps)."""

import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import FLOW_ARG_NAMES, arg_modifier, make_flow_args
from op_table.base import (
    F32,
    F32_ULP,
    F64,
    Accuracy,
    Bad,
    BwdBad,
    OpCase,
    PathCase,
    every,
    misaligned,
    set_arg,
    strided,
    transposed,
    max_abs,
)

# ---------------------------------------------------------------------------
# flow_euler
# ---------------------------------------------------------------------------


def _flow_make(s, **kw):
    B, D, H = s[:3]
    return make_flow_args(B, D, H, **kw)


def _flow_expanded(device):
    # x0 as a stride-0 broadcast of one row.  (Rows are not bitwise equal on
    # the CPU: the BLAS treats a row differently by its position in a block.)
    args = make_flow_args(1, 6, 20, device=device)
    args[0] = args[0].expand(5, 6)
    return (5, 6, 20, 3), args


def _flow_module(device):
    module = fused_ops.nn.FlowODE(16, 6).to(device)
    ref = reference.FlowODE(16, 6).to(device)
    ref.load_state_dict(module.state_dict())
    return module, ref, (torch.randn(10, 16, device=device),)


def _flow_gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, requires_grad=True)


def _flow_grad32_check(case, got, ref32, exact, ctx):
    """The float32 contract against the float32 reference, and no further
    from the float64 gradient than the float32 reference (2x), with a floor
    of 8 float32 ulps of the largest entry."""
    for name, g, w, e in zip(case.arg_names, got, ref32, exact):
        assert g.shape == w.shape and g.dtype == F32 and g.device == w.device, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad {n}: {m}")
        fused_err = (g.double() - e).abs().max().item()
        eager_err = (w.double() - e).abs().max().item()
        floor = 8 * F32_ULP * max_abs(e)
        assert fused_err <= max(2 * eager_err, floor), (name, fused_err, eager_err, floor)


def _flow_bwd_args(case, size, dtype, device, grads=(True,)):
    B, D, H, steps = size
    args = case.inputs(size, dtype=dtype, device=device)
    return (torch.randn(B, D, dtype=dtype, device=device), *args, steps)


def _flow_bad(**changes):
    return arg_modifier(FLOW_ARG_NAMES, **changes)


# (B, D, H, steps): every required B, D, steps value, hidden widths that are
# not multiples of 32, and sizes that reach each CUDA path (FLOW_NATURAL).
FLOW_SIZES = (
    (8, 64, 256, 32), (1, 64, 256, 1), (33, 64, 256, 2), (34, 64, 256, 2), (66, 64, 256, 2),
    (67, 64, 256, 2), (129, 64, 256, 3), (133, 64, 256, 2), (200, 64, 256, 1), (1, 1, 3, 1),
    (3, 5, 20, 2), (32, 100, 130, 7), (32, 64, 300, 3), (8, 64, 256, 100), (1, 100, 37, 32),
    (129, 100, 130, 7), (33, 5, 20, 2), (129, 1, 45, 100), (4096, 64, 256, 32), (129, 3, 300, 2),
    (8, 5, 1100, 2), (40, 3, 1100, 1),
)

FLOW_EULER = OpCase(
    name="flow_euler",
    fn=fused_ops.flow_euler,
    packet=torch.ops.fused_ops.flow_euler,
    reference=reference.flow_euler,
    make=_flow_make,
    arg_names=FLOW_ARG_NAMES,
    out_names=("x",),
    out_shapes=lambda s: [(s[0], s[1])],
    scalars=lambda s: (s[3],),
    size_id=lambda s: "B{}-D{}-H{}-S{}".format(*s),
    match_sizes=FLOW_SIZES,
    match_skip=lambda s, dtype, device: (
        "covered by the float32 run; float64 at this size is slow on CPU"
        if s[0] == 4096 and dtype == F64 and device == "cpu" else None),
    # A float32 computation in disguise would be ~1e-7 off.
    float64_tight=(((9, 6, 40, 10), 1e-12),),
    # A single run each; the floor of 4 float32 ulps of the largest |x|
    # covers sizes where both errors are a few roundings.
    accuracy=tuple(Accuracy(s, floor_ulps=4, combine="max", scale_min=0.0, make_kw=dict(x_scale=2.0)) for s in
                   ((8, 64, 256, 32), (32, 100, 130, 7), (4096, 64, 256, 32), (129, 100, 130, 100),
                    (8, 5, 1100, 2))),
    poison_sizes=((8, 64, 256, 3), (129, 100, 130, 2), (40, 3, 1100, 1)),
    poison_numels=lambda s: (s[0] * s[1], s[0] * s[2]),
    layouts={
        "transposed": (every(transposed), "noncontig"),
        "strided": (every(strided), "noncontig"),
        # The CUDA split and row paths read weights as float4s only where aligned.
        "misaligned": (every(misaligned), "misaligned"),
    },
    layout_sizes=((8, 64, 256, 4), (40, 64, 256, 4), (70, 64, 256, 4), (129, 5, 37, 4)),
    # The CPU's BLAS rounds differently for weights that do not start on a
    # 64-byte boundary (the op's docstring); the CUDA kernels do not.
    cpu_rounding_layouts=frozenset({"misaligned"}),
    expanded=_flow_expanded,
    expanded_bitwise=False,
    empty_size=(0, 4, 9, 3),
    opcheck_sizes=((1, 1, 3, 1), (5, 3, 10, 3)),
    meta_size=(11, 4, 9, 5),
    module=_flow_module,
    compile_size=(6, 4, 12, 3),
    compile_loss=lambda o: (o[0] ** 2).sum(),
    compile_tol=dict(rtol=1e-4, atol=1e-5),
    determinism_sizes=((8, 64, 256, 32), (4096, 64, 256, 4), (40, 3, 1100, 2)),
    thread_size=(300, 16, 40, 5),  # several CPU row blocks
    bad_size=(6, 4, 10, 2),
    bad_inputs=(
        Bad("steps_0", _flow_bad(), "num_steps", r"at least 1", scalars=(0,)),
        Bad("steps_negative", _flow_bad(), "num_steps", r"at least 1", scalars=(-3,)),
        # One bound on both devices (the CUDA kernels count steps in int32),
        # checked before anything is allocated.
        Bad("steps_int_max_plus_1", _flow_bad(), "num_steps", r"at most 2147483647 \(INT_MAX\), got 2147483648$",
            scalars=(2**31,)),
        Bad("steps_2_32_plus_1", _flow_bad(), "num_steps", r"at most 2147483647 \(INT_MAX\), got 4294967297$",
            scalars=(2**32 + 1,)),
        Bad("x0_1d", _flow_bad(x0=lambda t: t[0]), "x0", r"2-D"),
        Bad("x0_3d", _flow_bad(x0=lambda t: t[None]), "x0", r"2-D"),
        Bad("w1_1d", _flow_bad(w1=lambda t: t[0]), "w1", r"2-D"),
        Bad("w1_no_time_column", _flow_bad(w1=lambda t: t[:, :4]), "w1", r"\b5\b"),
        Bad("w1_extra_column", _flow_bad(w1=lambda t: torch.cat([t, t[:, :1]], 1)), "w1", r"\b5\b"),
        Bad("b1_size", _flow_bad(b1=lambda t: t[:9]), "b1", r"\b10\b"),
        Bad("b1_2d", _flow_bad(b1=lambda t: t[None]), "b1", r"1-D"),
        Bad("w2_rows", _flow_bad(w2=lambda t: t[:9]), "w2", r"\b10\b"),
        Bad("w2_cols", _flow_bad(w2=lambda t: t[:, :9]), "w2", r"\b10\b"),
        Bad("b2_size", _flow_bad(b2=lambda t: torch.cat([t, t])), "b2", r"\b10\b"),
        Bad("w3_rows", _flow_bad(w3=lambda t: t[:3]), "w3", r"\b4\b"),
        Bad("w3_cols", _flow_bad(w3=lambda t: t[:, :9]), "w3", r"\b10\b"),
        Bad("b3_size", _flow_bad(b3=lambda t: t[:3]), "b3", r"\b4\b"),
        Bad("b3_0d", _flow_bad(b3=lambda t: t[0]), "b3", r"1-D"),
        Bad("D_0", _flow_bad(x0=lambda t: t[:, :0], w1=lambda t: t[:, :1], w3=lambda t: t[:0],
                             b3=lambda t: t[:0]), "x0", r"D >= 1"),
        Bad("x0_int64", _flow_bad(x0=lambda t: t.long()), "x0", r"float"),
        Bad("all_int32", _flow_bad(**{n: (lambda t: t.int()) for n in FLOW_ARG_NAMES}), "x0", r"float32"),
        Bad("w2_float64", _flow_bad(w2=lambda t: t.double()), "w2", r"dtype"),
        Bad("x0_float64", _flow_bad(x0=lambda t: t.double()), "w1", r"dtype"),
    ),
    stream_sizes=((8, 64, 256, 4), (4096, 64, 256, 4)),
    graph_sizes=((8, 64, 256, 8), (4096, 64, 256, 8)),
    cuda_cpu_float64=(((50, 7, 33, 6), 1e-12, 1e-12),),
    isa_sizes=((3, 5, 37, 3), (70, 16, 40, 2)),
    gradcheck_sizes=(((3, 2, 5, 1), False), ((3, 2, 5, 3), False)),
    gradcheck_inputs=_flow_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-8, rtol=1e-6),
    gradcheck_alone_size=(4, 3, 6, 2),
    # The backward has two modes on both devices: "resident" (num_steps * B
    # <= 512 and the activations of all steps fit 4 Mi elements) and
    # "streaming" (per-step recompute).  (64, 3, 11, 8): 512 stacked rows,
    # resident, the largest; (65, 3, 11, 8): streaming; (8, 4, 2100, 30): 240
    # rows but 6 n B H > 4 Mi elements, streaming.
    grad64_sizes=tuple((s, ((0,),), {}) for s in
                       ((17, 6, 30, 8), (37, 6, 30, 9), (64, 3, 11, 8), (65, 3, 11, 8), (8, 4, 2100, 30))),
    grad64_tol=(1e-10, 1e-12),
    # (300, 3, 37, 5): two CUDA column-sum chunks, the last ragged; (4096, 64,
    # 256, 3): the large-batch default (16 chunks), few steps for CPU time.
    grad32_sizes=tuple((s, (0,)) for s in ((8, 64, 256, 32), (1, 1, 3, 1), (33, 5, 20, 7), (129, 100, 130, 7),
                                           (300, 3, 37, 5), (4096, 64, 256, 3))),
    grad32_check=_flow_grad32_check,
    double_backward_match="double backward .* is not supported",
    bwd=torch.ops.fused_ops.flow_euler_backward.default,
    bwd_args=_flow_bwd_args,
    bwd_grad_names=("grad_x",),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((1, 1, 3, 1), (5, 3, 10, 3)),
    bwd_meta_size=(11, 4, 9, 2),
    bwd_determinism_sizes=((8, 64, 256, 8), (300, 3, 37, 3)),
    # No bwd_thread_size: the CPU backward's products are torch's BLAS calls,
    # whose sums follow the thread count on some CPUs (MKL's AVX-512 sgemm
    # and dgemm at K = num_steps * B), so they differ in the last bits
    # between thread counts (bitwise repeatable at a fixed count).
    bwd_bad_size=(4, 3, 7, 2),
    bwd_bad=(
        BwdBad("grad_x-shape", set_arg(0, lambda a: a[0][:, :2].contiguous()), "grad_x must have the shape of x0"),
        BwdBad("grad_x-dtype", set_arg(0, lambda a: a[0].double()), "grad_x must have the same dtype as x0"),
        BwdBad("steps_0", set_arg(8, lambda a: 0), "num_steps must be at least 1"),
        BwdBad("steps_int_max_plus_1", set_arg(8, lambda a: 2**31),
               r"num_steps must be at least 1 and at most 2147483647 \(INT_MAX\), got 2147483648$"),
        BwdBad("steps_2_32_plus_1", set_arg(8, lambda a: 2**32 + 1),
               r"num_steps must be at least 1 and at most 2147483647 \(INT_MAX\), got 4294967297$"),
        BwdBad("grad_x-None", set_arg(0, lambda a: None), r"grad_x must be a 2-D tensor \[B, D\].*, got None$"),
        BwdBad("w2-None", set_arg(4, lambda a: None), r"w2 must be a 2-D tensor \[H, H\], got None$"),
        BwdBad("grad_x-device", set_arg(0, lambda a: a[0].cpu()), "grad_x must be on the same device as x0",
               cuda_only=True),
    ),
    bwd_empty_size=(0, 3, 7, 2),
    bwd_stream_size=(4096, 64, 256, 4),
    bwd_graph_size=(8, 64, 256, 8),
    bwd_cuda_cpu_sizes=((8, 64, 256, 8), (300, 3, 37, 3), (65, 3, 11, 8)),
    # Kernel paths on an H200 (132 SMs) with the sm_90a kernels built.
    paths=(
        PathCase("split", (8, 64, 256, 4), note="four blocks per row"),
        PathCase("split", (66, 64, 256, 2), note="two blocks per row, the most rows"),
        PathCase("row", (100, 64, 256, 2)),
        PathCase("cluster", (8, 32, 128, 4)),
        PathCase("cluster", (32, 64, 300, 3), note="long ragged k-segments"),
        PathCase("wgmma", (4096, 64, 256, 4)),
        PathCase("wgmma", (200, 64, 256, 1), note="one step: only the last exchange is waited for"),
        # 3xTF32 tensor-core products: within 4x the float32 reference's error.
        PathCase("tiled", (300, 16, 64, 3), bound=4),
        PathCase("tiled", (4096, 64, 256, 4), note="where the wgmma path would be chosen", bound=4),
        PathCase("general", (8, 64, 256, 4), F64),
        PathCase("general", (8, 64, 256, 4), note="the general path applies everywhere"),
    ),
    natural=(
        PathCase("split", (1, 64, 256, 1)), PathCase("split", (8, 64, 256, 32)), PathCase("split", (33, 64, 256, 2)),
        PathCase("split", (34, 64, 256, 2)), PathCase("split", (66, 64, 256, 2)),
        PathCase("row", (67, 64, 256, 2)), PathCase("row", (129, 64, 256, 3)), PathCase("row", (132, 64, 256, 2)),
        PathCase("wgmma", (133, 64, 256, 2)), PathCase("wgmma", (200, 64, 256, 1)),
        PathCase("wgmma", (4096, 64, 256, 32)),
        PathCase("cluster", (1, 1, 3, 1)), PathCase("cluster", (3, 5, 20, 2)), PathCase("cluster", (8, 32, 128, 4)),
        PathCase("cluster", (32, 100, 130, 7)), PathCase("cluster", (32, 64, 300, 3)),
        PathCase("tiled", (129, 100, 130, 7)), PathCase("tiled", (33, 5, 20, 2)), PathCase("tiled", (129, 1, 45, 4)),
        PathCase("tiled", (129, 3, 300, 2)), PathCase("tiled", (300, 16, 64, 3)),
        PathCase("general", (8, 5, 1100, 2)), PathCase("general", (40, 3, 1100, 1)),
        PathCase("general", (8, 64, 256, 4), F64), PathCase("general", (4096, 64, 256, 2), F64),
    ),
    refused=(PathCase("wgmma", (8, 64, 256, 2), F64), PathCase("split", (8, 32, 128, 2))),
    path_names=("split", "row", "cluster", "wgmma", "tiled", "general"),
    bwd_path_names=("resident", "streaming"),
    sm90_paths=frozenset({"split", "row", "cluster", "wgmma"}),
    bwd_paths=(
        PathCase("resident", (8, 64, 256, 32)),
        PathCase("resident", (64, 3, 11, 8), note="512 stacked rows, the largest"),
        PathCase("streaming", (65, 3, 11, 8)),
        PathCase("streaming", (129, 100, 130, 7)),
        PathCase("streaming", (8, 64, 256, 8), note="the streaming mode applies everywhere"),
    ),
    # resident: num_steps * B <= 512 and 6 num_steps B H <= 4 Mi elements.
    bwd_natural=(
        PathCase("resident", (8, 64, 256, 32)), PathCase("resident", (64, 3, 11, 8)),
        PathCase("streaming", (65, 3, 11, 8)), PathCase("streaming", (129, 100, 130, 7)),
        PathCase("streaming", (4096, 64, 256, 3)),
    ),
)
