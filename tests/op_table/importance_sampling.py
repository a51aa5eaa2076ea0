"""op_cases entry of importance_sampling: sizes (N, D, K)."""

import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import (
    ARG_NAMES as IS_ARG_NAMES,
    TOL,
    arg_modifier,
    make_inputs as make_is_inputs,
    rounding_sensitivity,
    tol,
)
from op_table.base import (
    F64,
    Accuracy,
    Bad,
    BwdBad,
    OpCase,
    PathCase,
    col_step,
    offset_view,
    per_arg,
    row_step,
    set_arg,
    transposed,
    all_subsets,
    max_abs,
)

# ---------------------------------------------------------------------------
# importance_sampling
# ---------------------------------------------------------------------------


def _is_match_check(case, got, want, args, dtype):
    """Within atol=rtol=1e-4 of the reference, or, in float32 at large D,
    within that plus twice the first-order effect of rounding every log
    weight once in float32 (rounding_sensitivity).

    At large D a few samples dominate and the outputs are ill-conditioned in
    float32: the float32 reference itself moves by more than 1e-4 (in ~3% of
    draws at D=128) when only its summation order changes.  Implementations
    that differ only in rounding order use at most 0.3x this allowance, so it
    hides no real error; the accuracy test bounds the accuracy proper."""
    t = TOL[dtype]
    inside = all(bool(((g - w).abs() <= t + t * w.abs()).all()) for g, w in zip(got, want))
    if dtype == F64 or inside:
        for name, g, w in zip(case.out_names, got, want):
            torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
        return
    slack = rounding_sensitivity(args)
    for name, g, w, s in zip(case.out_names, got, want, slack):
        err = (g.double() - w.double()).abs()
        allowed = t + t * w.double().abs() + 2 * s
        bad = ~(err <= allowed)  # NaN counts as bad
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} elements outside atol=rtol=1e-4 + 2 x rounding sensitivity; "
            f"worst |diff| {err.max().item():.3e}, largest allowance {allowed.max().item():.3e}"
        )


def _is_invariants(out, args, dtype):
    # log_weights is normalised: an element never written (NaN, 0 or a stale
    # value) would break finiteness or logsumexp == 0.
    lw = out[2]
    assert torch.isfinite(lw).all()
    assert abs(torch.logsumexp(lw.double(), 0).item()) <= 10 * TOL[dtype]


def _is_expanded(device):
    # Zero strides (broadcast views): a shared std per dimension, one weight for all.
    N, D, K = 1000, 7, 4
    args = list(make_is_inputs(N, D, K, device=device))
    args[1] = torch.rand((), device=device).add(0.5).expand(K)
    args[3] = torch.rand(1, D, device=device).add(0.5).expand(K, D)
    args[5] = torch.rand((), device=device).add(2.0).expand(D)
    return (N, D, K), args


def _is_module(device):
    module = fused_ops.nn.ImportanceSampler(16, 3).to(device)
    ref = reference.ImportanceSampler(16, 3).to(device)
    ref.load_state_dict(module.state_dict())
    return module, ref, (torch.randn(4096, 16, device=device) * 3,)


def _is_gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, scale=1.5, requires_grad=True)


def _is_grad32_upstream(outs, size):
    mean, ess, lw = outs
    return [torch.randn_like(mean), torch.randn_like(ess), torch.randn_like(lw) / size[0] ** 0.5]


def _is_grad32_check(case, got, ref32, exact, ctx):
    """Nearly all of the fused float32 gradient's error comes from the float32
    forward outputs it is evaluated at (log_weights, ~3e-5 absolute at N=4096,
    D=16), not from the backward (test_contract's backward-op accuracy: ~1e-7
    of the scale given accurate forward outputs); sums like
    sum_i g_i (zq_i^2 - 1) amplify it, and the reference's float32 autograd
    happens to be hit less by its own forward error (the fused error exceeds
    twice the reference's by at most 1.25e-4 of the largest gradient element
    over many seeds and sizes).  So: the fused gradient is no further from
    float64 than twice the float32 reference's plus 3e-4 of the largest
    gradient element (of any input), and agrees with the float32 reference
    within rtol 1e-3 and 5e-4 of that scale plus 3x the reference's own error.

    With the ESS gradient alone and very peaked weights (N=333, D=33, K=7: ESS
    often within 1e-5 of 1) the whole gradient can be far below float32
    resolution: once float32 rounds the dominant weight to 1, d ess / d lw ~
    1 - w is lost to rounding, and the largest float64 gradient element can be
    1e-14.  So errors below 1e-6 |dL/d ess| count as float32 noise (the
    backward recomputes ess from log_weights for this reason)."""
    subset, upstream = ctx["subset"], ctx["upstream"]
    noise = 1e-6 * abs(upstream[1].item()) if 1 in subset else 0.0
    gscale = max(max_abs(e) for e in exact)
    for name, a, b, e in zip(case.arg_names, got, ref32, exact):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        err_fused = (a.double() - e).abs().max().item()
        err_ref = (b.double() - e).abs().max().item()
        assert err_fused <= 2 * err_ref + 3e-4 * gscale + noise, (name, err_fused, err_ref, gscale)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-4 * gscale + 3 * err_ref + noise,
                                   msg=lambda m, n=name: f"grad {n} vs float32 reference: {m}")


def _is_bwd_args(case, size, dtype, device, grads=(True, True, True)):
    """Upstream gradients (None where not in ``grads``), the forward's inputs
    and its outputs weighted_mean and log_weights (the backward recomputes
    ess from log_weights)."""
    N, D, K = size
    args = case.inputs(size, dtype=dtype, device=device)
    mean, _, lw = fused_ops.importance_sampling(*args)
    opts = dict(dtype=dtype, device=device)
    ups = (torch.randn(D, **opts), torch.randn((), **opts), torch.randn(N, **opts))
    ups = tuple(u if g else None for u, g in zip(ups, grads))
    return (*ups, *args, mean, lw)


def _is_bad(**changes):
    return arg_modifier(IS_ARG_NAMES, **changes)


def _is_all(change):
    return _is_bad(**{n: change for n in IS_ARG_NAMES})


def _is_size_params():
    return tuple((N, D, K) for N in (1, 7, 4096, 100003) for D in (1, 3, 16, 33, 128) for K in (1, 3, 8))


IMPORTANCE_SAMPLING = OpCase(
    name="importance_sampling",
    fn=fused_ops.importance_sampling,
    packet=torch.ops.fused_ops.importance_sampling,
    reference=reference.importance_sampling,
    make=lambda s, **kw: make_is_inputs(*s, **kw),
    arg_names=IS_ARG_NAMES,
    out_names=("weighted_mean", "ess", "log_weights"),
    out_shapes=lambda s: [(s[1],), (), (s[0],)],
    size_id=lambda s: "N{}-D{}-K{}".format(*s),
    fresh_first=lambda t: torch.randn_like(t) * 3,
    # The full cross product: on 2 CPU cores the largest case (float64
    # reference at N=100003, D=128, K=8, several 800 MB [N, K, D]
    # temporaries) takes ~4 s and runs once per dtype.
    match_sizes=_is_size_params(),
    match_check=_is_match_check,
    # One run's error is dominated by the float32 rounding of the few largest
    # log weights, a heavy-tailed random quantity for both implementations:
    # for an implementation as accurate as the reference one run exceeds the
    # 2x bound about once in 40, while errors summed over 32 fresh runs stay
    # below ~0.75 of it.  Summing keeps the test sensitive to a systematic
    # loss (a float32 sum over D=128 accumulated sequentially: ~3x the
    # reference's log-weight error).  The floor, one float32 ulp of each
    # run's scale, covers draws where one weight dominates and the float32
    # reference is exactly right (0 <= 2 * 0 would demand an error-free
    # result): far below the contract's 1e-4 and, for log_weights, below the
    # reference's own error.
    accuracy=tuple(Accuracy(s, trials=32) for s in
                   ((7, 3, 3), (1000, 33, 8), (4096, 16, 3), (1000, 128, 3), (100003, 3, 3))),
    invariants=_is_invariants,
    poison_sizes=((1, 1, 1), (7, 3, 2), (4097, 16, 3), (300007, 5, 3)),
    poison_numels=lambda s: (s[0], s[1], 1),
    layouts={
        "samples_transposed": (per_arg(a0=transposed), "noncontig"),
        "samples_col_step": (per_arg(a0=col_step), "noncontig"),
        "samples_row_step": (per_arg(a0=row_step), "noncontig"),
        "samples_offset": (per_arg(a0=offset_view), "noncontig"),
        "mix_mus_transposed": (per_arg(a2=transposed), "noncontig"),
        "mix_stds_col_step": (per_arg(a3=col_step), "noncontig"),
        "vectors_step": (per_arg(a1=row_step, a4=row_step, a5=row_step), "noncontig"),
        "all": (per_arg(a0=offset_view, a1=row_step, a2=transposed, a3=col_step, a4=row_step, a5=row_step),
                "noncontig"),
    },
    layout_sizes=((257, 6, 3), (4099, 6, 3)),
    expanded=_is_expanded,
    opcheck_sizes=((1, 1, 1), (33, 5, 3)),
    meta_size=(11, 4, 2),
    module=_is_module,
    compile_size=(300, 5, 3),
    compile_loss=lambda o: o[0].sum() + 0.1 * o[1] + o[2].logsumexp(0) + o[2].mean(),
    # Inductor fuses the backward's reductions and sums in another order;
    # some gradients (q_std's: sums over N that nearly cancel) then differ by
    # ~1e-4 relative in float32: compare at the float32 contract.
    compile_tol=dict(rtol=1e-4, atol=1e-4),
    determinism_sizes=((100003, 16, 3),),
    thread_size=(100003, 16, 3),  # ~390 chunks of 256 samples
    bad_size=(6, 4, 3),
    bad_inputs=(
        Bad("samples_1d", _is_bad(samples=lambda t: t[0]), "samples", r"2-D"),
        # Leading dimensions are batches for the function (broadcast against
        # each other), not for the 2-D op: bad for both when they do not broadcast.
        Bad("samples_3d_batch_mismatch", _is_bad(samples=lambda t: t[None].expand(2, -1, -1),
                                                 mix_weights=lambda t: t[None].expand(3, -1)),
            "samples", r"2-D|broadcast"),
        Bad("mix_weights_2d_batch_mismatch", _is_bad(mix_weights=lambda t: t[None].expand(2, -1),
                                                     mix_mus=lambda t: t[None].expand(3, -1, -1)),
            "mix_weights", r"1-D|broadcast"),
        Bad("mix_mus_1d", _is_bad(mix_mus=lambda t: t[0]), "mix_mus", r"2-D"),
        Bad("mix_stds_1d", _is_bad(mix_stds=lambda t: t[0]), "mix_stds", r"2-D"),
        Bad("q_mu_2d_batch_mismatch", _is_bad(q_mu=lambda t: t[None].expand(2, -1),
                                              q_std=lambda t: t[None].expand(3, -1)),
            "q_mu", r"1-D|broadcast"),
        Bad("q_std_0d", _is_bad(q_std=lambda t: t[0]), "q_std", r"1-D"),
        Bad("mix_mus_D", _is_bad(mix_mus=lambda t: torch.cat([t, t[:, :1]], 1)), "mix_mus", r"\b4\b"),
        Bad("mix_stds_D", _is_bad(mix_stds=lambda t: t[:, :3]), "mix_stds", r"\b4\b"),
        Bad("q_mu_D", _is_bad(q_mu=lambda t: torch.cat([t, t])), "q_mu", r"\b4\b"),
        Bad("q_std_D", _is_bad(q_std=lambda t: t[:1]), "q_std", r"\b4\b"),
        Bad("mix_mus_K", _is_bad(mix_mus=lambda t: torch.cat([t, t[:1]])), "mix_mus", r"\b3\b"),
        Bad("mix_stds_K", _is_bad(mix_stds=lambda t: t[:2]), "mix_stds", r"\b3\b"),
        Bad("mix_mus_and_stds_K_vs_weights", _is_bad(mix_mus=lambda t: t[:2], mix_stds=lambda t: t[:2]),
            "mix_mus", r"\b3\b"),
        Bad("samples_int64", _is_bad(samples=lambda t: t.long()), "samples", r"float"),
        Bad("samples_int32_all_int", _is_all(lambda t: t.int()), "samples", r"float"),
        Bad("all_int32", _is_all(lambda t: t.int()), "samples", r"float32|float"),
        Bad("mix_mus_float64", _is_bad(mix_mus=lambda t: t.double()), "mix_mus", r"dtype"),
        Bad("q_std_float64", _is_bad(q_std=lambda t: t.double()), "q_std", r"dtype"),
        Bad("samples_float64", _is_bad(samples=lambda t: t.double()), "mix_weights", r"dtype"),
        # D = 0 with q_mu None: named at its rank check, before any size or dtype is read.
        Bad("D_0_q_mu_None", _is_bad(samples=lambda t: t[:, :0], mix_mus=lambda t: t[:, :0],
                                     mix_stds=lambda t: t[:, :0], q_mu=lambda t: None, q_std=lambda t: t[:0]),
            "q_mu", r"q_mu must be a 1-D tensor \[D\], got None$"),
        Bad("N_0", _is_bad(samples=lambda t: t[:0]), "samples", r"N >= 1|at least one"),
        Bad("K_0", _is_bad(mix_weights=lambda t: t[:0], mix_mus=lambda t: t[:0], mix_stds=lambda t: t[:0]),
            "mix_weights", r"K >= 1|at least one"),
    ),
    stream_sizes=((1 << 20, 16, 3),),
    graph_sizes=((4096, 16, 3),),
    cuda_cpu_float64=(((2000, 8, 3), 1e-10, 1e-12),),
    isa_sizes=((1, 1, 1), (37, 3, 2), (4099, 16, 3), (300, 130, 5)),
    gradcheck_sizes=(((5, 3, 2), False), ((4, 1, 1), False), ((6, 4, 3), False)),
    gradcheck_inputs=_is_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-6, rtol=1e-5),
    gradcheck_alone_size=(5, 3, 2),
    grad64_sizes=(((300, 4, 3), all_subsets(3), dict(scale=1.5)),),
    grad64_tol=(1e-8, 1e-10),
    grad32_sizes=tuple(
        (s, sub) for s in ((4096, 16, 3), (1000, 5, 2), (333, 33, 7), (1, 3, 2),
                           (50, 2, 400))  # (50, 2, 400): CUDA keeps the coefficients in global memory
        for sub in ((0, 1, 2), (0,), (1,), (2,))
    ),
    grad32_upstream=_is_grad32_upstream,
    grad32_check=_is_grad32_check,
    # exp(lw)^2: the squared weights, as the ESS sees them; an exp of ess or
    # of the mean would make the loss too large for finite differences.
    nonlinear_loss=lambda outs: (outs[2].exp() ** 2).sum(),
    bwd=torch.ops.fused_ops.importance_sampling_backward.default,
    bwd_args=_is_bwd_args,
    bwd_grad_names=("grad_weighted_mean", "grad_ess", "grad_log_weights"),
    bwd_upstream_index=2,
    bwd_opcheck_sizes=((1, 1, 1), (33, 5, 3)),
    bwd_opcheck_grads=((True, True, True), (True, False, False), (False, True, True)),
    bwd_meta_size=(11, 4, 2),
    bwd_determinism_sizes=((20000, 16, 3),),
    bwd_thread_size=(30000, 7, 3),
    bwd_bad_size=(9, 3, 2),
    bwd_bad=(
        BwdBad("grad_mean-size", set_arg(0, lambda a: a[0][:-1]), r"grad_weighted_mean\.shape\[0\] must be"),
        BwdBad("grad_ess-rank", set_arg(1, lambda a: a[1][None]), r"grad_ess must be a 0-D tensor"),
        BwdBad("grad_lw-size", set_arg(2, lambda a: a[2][:-1]), r"grad_log_weights\.shape\[0\] must be"),
        BwdBad("grad_lw-dtype", set_arg(2, lambda a: a[2].double()),
               r"grad_log_weights must have the same dtype as samples"),
        BwdBad("mean-rank", set_arg(9, lambda a: a[9][None]), r"weighted_mean must be a 1-D tensor"),
        BwdBad("lw-size", set_arg(10, lambda a: a[10][:-1]), r"log_weights\.shape\[0\] must be"),
        BwdBad("mean-None", set_arg(9, lambda a: None), r"weighted_mean must be a 1-D tensor \[D\], got None$"),
        BwdBad("samples-None", set_arg(3, lambda a: None), r"samples must be a 2-D tensor \[N, D\], got None$"),
        BwdBad("samples-D", set_arg(3, lambda a: a[3][:, :-1]), r"mix_mus\.shape\[1\] must be"),
    ),
    bwd_linearity_size=(40, 3, 2),
    bwd_stream_size=(1 << 18, 16, 3),
    bwd_graph_size=(4096, 16, 3),
    # The CUDA backward's ways: entries split over sample slices, one thread
    # per entry for long rows, coefficients in global memory for large K.
    bwd_cuda_cpu_sizes=((4096, 16, 3), (129, 700, 3), (50, 2, 400), (1, 1, 1)),
    # (333, 33, 7) has very peaked weights (ESS ~ 1-2), where the ESS term
    # 2 w (S - w) / S^2 cancels at the dominant sample.
    bwd_accuracy=tuple((s, g) for s in ((4096, 16, 3), (333, 33, 7))
                       for g in ((True, True, True), (False, True, False))),
    paths=(
        # One run's error against float64 is heavy-tailed here (the few
        # largest log weights): 3x over eight runs, not the summed 32-run 2x.
        PathCase("fast", (4096, 16, 3), bound=3),
        PathCase("fast", (1 << 20, 16, 3), note="many blocks", bound=3),
        PathCase("general", (4096, 1024, 3), note="D above the fast path's register rows", bound=3),
        PathCase("general", (4096, 16, 3), note="the general path applies everywhere", bound=3),
    ),
    natural=(
        PathCase("fast", (4096, 16, 3)),
        PathCase("fast", (1 << 20, 16, 3)),
        PathCase("fast", (1000, 512, 3)),
        PathCase("general", (1000, 1024, 3)),
    ),
    refused=(PathCase("fast", (1000, 1024, 3)),),
    path_names=("fast", "general"),
    bwd_path_names=("tiled",),
    bwd_paths=(PathCase("tiled", (4096, 16, 3)),),
    bwd_natural=(PathCase("tiled", (4096, 16, 3)), PathCase("tiled", (1 << 20, 16, 3))),
)
