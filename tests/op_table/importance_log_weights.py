"""op_cases entry of importance_log_weights: sizes (B, N, D, K, Kq): samples
[B, N, D], target mix_weights [B, K], mix_mus / mix_stds [B, K, D],
proposal q_weights [B, Kq], q_mus / q_stds [B, Kq, D].  The batched,
mixture-proposal and evidence calls of importance_sampling that run this op
are test_importance_sampling_batched.py's."""

import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import arg_modifier
from op_table.base import (
    F64,
    Accuracy,
    Bad,
    BwdBad,
    OpCase,
    PathCase,
    max_abs,
    per_arg,
    row_step,
    set_arg,
)

ARG_NAMES = ("samples", "mix_weights", "mix_mus", "mix_stds", "q_weights", "q_mus", "q_stds")


def make_ilw_inputs(size, dtype=torch.float32, device="cpu", requires_grad=False, scale=2.0, generator=None):
    """Samples ~ scale * N(0, 1); unnormalised positive weights; target means
    ~ 1.5 N(0, 1), stds in [0.6, 1.6); a wider proposal (means ~ 0.5 N(0, 1),
    stds in [1.5, 3))."""
    b, n, d, k, kq = size
    g = dict(generator=generator, dtype=dtype)

    def uniform(shape, lo, hi):
        return torch.rand(shape, **g) * (hi - lo) + lo

    args = [torch.randn(b, n, d, **g) * scale, uniform((b, k), 0.2, 1.2), torch.randn(b, k, d, **g) * 1.5,
            uniform((b, k, d), 0.6, 1.6), uniform((b, kq), 0.2, 1.2), torch.randn(b, kq, d, **g) * 0.5,
            uniform((b, kq, d), 1.5, 3.0)]
    return [a.to(device).requires_grad_(requires_grad) for a in args]


def _size_id(size):
    return "B{}-N{}-D{}-K{}-Kq{}".format(*size)


class _LogWeights(torch.nn.Module):
    """What a user's module around the op looks like (the table's module check):
    the target and proposal as buffers, samples as the input."""

    def __init__(self, fn, params):
        super().__init__()
        self.fn = fn
        for name, t in zip(ARG_NAMES[1:], params):
            self.register_buffer(name, t)

    def forward(self, samples):
        return self.fn(samples, *(getattr(self, n) for n in ARG_NAMES[1:]))


def _module(device):
    args = make_ilw_inputs((16, 1000, 8, 3, 2), device=device)
    return _LogWeights(fused_ops.importance_log_weights, args[1:]), \
        _LogWeights(reference.importance_log_weights, args[1:]), (args[0],)


def _expanded(device):
    # One target and proposal for every problem (stride-0 batch dimension),
    # a std shared by the dimensions, samples shared by two problems.
    size = (4, 300, 5, 3, 2)
    args = make_ilw_inputs(size, device=device)
    args[0] = args[0][:1].expand(4, 300, 5)
    args[1] = args[1][:1].expand(4, 3)
    args[3] = args[3][:, :, :1].expand(4, 3, 5)
    args[5] = args[5][:1].expand(4, 2, 5)
    return size, args


def _gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, scale=1.5, requires_grad=True)


def _grad32_check(case, got, ref32, exact, ctx):
    """Float32 gradients (double coefficients and sums inside) no further
    from float64 than twice the float32 reference's, plus 1e-6 of the
    largest gradient element (the float32 rounding of the inputs alone)."""
    gscale = max(max_abs(e) for e in exact)
    for name, a, b, e in zip(case.arg_names, got, ref32, exact):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        err_fused = (a.double() - e).abs().max().item()
        err_ref = (b.double() - e).abs().max().item()
        assert err_fused <= 2 * err_ref + 1e-6 * gscale, (name, err_fused, err_ref, gscale)


def _bwd_args(case, size, dtype, device, grads=(True,)):
    args = case.inputs(size, dtype=dtype, device=device)
    b, n = size[0], size[1]
    return (torch.randn(b, n, dtype=dtype, device=device), *args)


def _bad(**changes):
    return arg_modifier(ARG_NAMES, **changes)


def _invariants(out, args, dtype):
    assert torch.isfinite(out[0]).all()  # every element written, and finite at these parameters


IMPORTANCE_LOG_WEIGHTS = OpCase(
    name="importance_log_weights",
    fn=fused_ops.importance_log_weights,
    packet=torch.ops.fused_ops.importance_log_weights,
    reference=reference.importance_log_weights,
    make=make_ilw_inputs,
    arg_names=ARG_NAMES,
    out_names=("log_weights",),
    out_shapes=lambda s: [(s[0], s[1])],
    size_id=_size_id,
    fresh_first=lambda t: torch.randn_like(t) * 2,
    match_sizes=((1, 1, 1, 1, 1), (1, 7, 3, 3, 1), (3, 37, 5, 3, 2), (64, 1000, 8, 3, 2), (2, 4099, 16, 3, 1),
                 (1000, 37, 4, 2, 2), (2, 300, 130, 5, 3), (1, 50, 2, 40, 30)),
    # Errors summed over fresh draws: one run's error is set by the few
    # largest squared distances, a heavy-tailed quantity for both sides.
    accuracy=tuple(Accuracy(s, trials=8) for s in ((4, 4096, 16, 3, 1), (64, 1000, 8, 3, 2), (2, 1000, 128, 3, 2),
                                                   (8, 100, 3, 40, 5))),
    invariants=_invariants,
    poison_sizes=((1, 1, 1, 1, 1), (3, 257, 5, 3, 2), (33, 129, 5, 2, 2), (1, 30007, 3, 3, 1)),
    poison_numels=lambda s: [s[0] * s[1]],
    layouts={
        "samples_transposed": (per_arg(a0=lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)),
                               "noncontig"),
        "mix_mus_transposed": (per_arg(a2=lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)),
                               "noncontig"),
        "weights_step": (per_arg(a1=lambda t: row_step(t.t()).t(), a4=lambda t: row_step(t.t()).t()), "noncontig"),
        "all": (per_arg(a0=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
                        a1=lambda t: row_step(t.t()).t(),
                        a3=lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
                        a6=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)), "noncontig"),
    },
    layout_sizes=((7, 257, 6, 3, 2), (3, 4099, 5, 2, 1)),
    expanded=_expanded,
    empty_size=(0, 5, 3, 2, 2),
    opcheck_sizes=((1, 1, 1, 1, 1), (3, 17, 5, 3, 2)),
    meta_size=(2, 11, 4, 3, 2),
    module=_module,
    compile_size=(4, 300, 5, 3, 2),
    compile_loss=lambda o: o[0].logsumexp(-1).sum() + 0.01 * o[0].square().mean(),
    compile_tol=dict(rtol=1e-4, atol=1e-4),
    determinism_sizes=((2, 100003, 16, 3, 1), (256, 1000, 3, 2, 2)),
    thread_size=(4, 30011, 7, 3, 2),
    bad_size=(3, 6, 4, 3, 2),
    bad_inputs=(
        Bad("samples_1d", _bad(samples=lambda t: t[0, 0]), "samples", r"2-D tensor \[N, D\]|3-D tensor \[B, N, D\]"),
        Bad("samples_batch", _bad(samples=lambda t: t[:2]), "samples", r"\b2\b"),
        Bad("mix_weights_0d", _bad(mix_weights=lambda t: t[0, 0]), "mix_weights", r"\[K\]|\[B, K\]"),
        Bad("mix_weights_batch", _bad(mix_weights=lambda t: t[:2]), "mix_weights", r"\b2\b"),
        Bad("mix_mus_K", _bad(mix_mus=lambda t: t[:, :2]), "mix_mus", r"\bK\b"),
        Bad("mix_stds_D", _bad(mix_stds=lambda t: t[..., :3]), "mix_stds", r"\bD\b"),
        Bad("q_weights_0d", _bad(q_weights=lambda t: t[0, 0]), "q_weights", r"\[Kq\]|\[B, Kq\]"),
        Bad("q_mus_Kq", _bad(q_mus=lambda t: torch.cat([t, t[:, :1]], 1)), "q_mus", r"\bKq\b"),
        Bad("q_stds_D", _bad(q_stds=lambda t: torch.cat([t, t[..., :1]], -1)), "q_stds", r"\bD\b"),
        Bad("q_stds_batch", _bad(q_stds=lambda t: t[:2]), "q_stds", r"\b2\b"),
        Bad("N_0", _bad(samples=lambda t: t[:, :0]), "samples", r"N >= 1"),
        Bad("K_0", _bad(mix_weights=lambda t: t[:, :0], mix_mus=lambda t: t[:, :0], mix_stds=lambda t: t[:, :0]),
            "mix_weights", r"K >= 1"),
        Bad("Kq_0", _bad(q_weights=lambda t: t[:, :0], q_mus=lambda t: t[:, :0], q_stds=lambda t: t[:, :0]),
            "q_weights", r"Kq >= 1"),
        Bad("samples_int64", _bad(samples=lambda t: t.long()), "samples", r"float32 or float64"),
        Bad("q_mus_float64", _bad(q_mus=lambda t: t.double()), "q_mus", r"same dtype as samples"),
    ),
    stream_sizes=((4, 1 << 18, 16, 3, 1),),
    graph_sizes=((256, 4096, 16, 3, 1),),
    cuda_cpu_float64=(((3, 20000, 8, 3, 2), 1e-10, 1e-12), ((300, 99, 3, 2, 1), 1e-10, 1e-12)),
    isa_sizes=((1, 1, 1, 1, 1), (3, 37, 2, 3, 2), (2, 4099, 16, 3, 1)),
    gradcheck_sizes=(((2, 5, 3, 2, 2), False), ((1, 4, 1, 1, 1), False), ((3, 6, 2, 3, 1), False)),
    gradcheck_inputs=_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-6, rtol=1e-5),
    gradcheck_alone_size=(2, 5, 3, 2, 2),
    grad64_sizes=(((4, 300, 4, 3, 2), [(0,)], dict(scale=1.5)),),
    grad64_tol=(1e-10, 1e-12),
    grad32_sizes=tuple((s, (0,)) for s in ((4, 4096, 16, 3, 1), (64, 1000, 3, 2, 2), (2, 50, 2, 150, 60))),
    grad32_upstream=lambda outs, size: [torch.randn_like(outs[0]) / size[1] ** 0.5],
    grad32_check=_grad32_check,
    nonlinear_loss=lambda outs: 0.01 * outs[0].square().sum(),
    bwd=torch.ops.fused_ops.importance_log_weights_backward.default,
    bwd_args=_bwd_args,
    bwd_grad_names=("grad_log_weights",),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((1, 1, 1, 1, 1), (3, 17, 5, 3, 2)),
    bwd_opcheck_grads=((True,),),
    bwd_meta_size=(2, 11, 4, 3, 2),
    bwd_determinism_sizes=((2, 100003, 3, 3, 1), (128, 1000, 4, 2, 2)),
    bwd_thread_size=(3, 30011, 5, 3, 2),
    bwd_bad_size=(3, 9, 3, 2, 2),
    bwd_bad=(
        BwdBad("grad_lw-size", set_arg(0, lambda a: a[0][:, :-1]), r"grad_log_weights\.shape\[1\] must be 9"),
        BwdBad("grad_lw-rank", set_arg(0, lambda a: a[0][0]), r"grad_log_weights must be a 2-D tensor"),
        BwdBad("grad_lw-dtype", set_arg(0, lambda a: a[0].double()), r"grad_log_weights must have the same dtype"),
        BwdBad("samples-None", set_arg(1, lambda a: None), r"samples must be a 3-D tensor \[B, N, D\], got None$"),
        BwdBad("q_stds-D", set_arg(7, lambda a: a[7][..., :-1]), r"q_stds\.shape\[2\] must be 3"),
    ),
    bwd_empty_size=(0, 5, 3, 2, 2),
    bwd_linearity_size=(3, 40, 3, 2, 2),
    bwd_stream_size=(4, 1 << 16, 4, 3, 1),
    bwd_graph_size=(64, 1000, 4, 3, 1),
    # The tile's ways: 256 rows in shared memory (J <= 16), fewer rows (J =
    # 40), 32 rows in global memory (J > 128); parameters in global memory
    # when they do not fit (D = 700); one problem over many blocks.
    bwd_cuda_cpu_sizes=((4, 4096, 16, 3, 1), (300, 99, 5, 2, 2), (2, 500, 4, 30, 10), (2, 300, 2, 100, 60),
                        (1, 300, 700, 3, 2), (1, 1, 1, 1, 1)),
    bwd_accuracy=(((4, 4096, 16, 3, 1), (True,)), ((64, 1000, 3, 2, 2), (True,))),
    paths=(
        PathCase("staged", (1024, 4096, 16, 3, 1)),
        PathCase("staged", (1, 1 << 20, 16, 3, 2), note="one problem over many blocks"),
        PathCase("global", (1024, 4096, 16, 3, 1), note="the global path applies everywhere"),
        PathCase("global", (4, 4096, 1024, 3, 3), note="parameters over 48 KB"),
    ),
    natural=(PathCase("staged", (1024, 4096, 16, 3, 1)), PathCase("staged", (3, 37, 5, 3, 2)),
             PathCase("global", (4, 4096, 1024, 3, 3))),
    refused=(PathCase("staged", (4, 4096, 1024, 3, 3)),),
    path_names=("staged", "global"),
    bwd_path_names=("tiled",),
    bwd_paths=(PathCase("tiled", (64, 1000, 4, 3, 2)), PathCase("tiled", (2, 300, 2, 100, 60))),
    bwd_natural=(PathCase("tiled", (64, 1000, 4, 3, 2)), PathCase("tiled", (1, 1 << 18, 3, 3, 1))),
)
