"""op_cases entry of snis: sizes (B, N, D): log_weights [B, N], samples
[B, N, D]; B = -1 means no leading dimension (log_weights [N], samples
[N, D]).  The table calls the op with moments=True, so all five outputs are
checked; calls without samples or moments are test_snis.py's."""

import math

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
    all_subsets,
    max_abs,
    per_arg,
    row_step,
    set_arg,
    transposed,
)

ARG_NAMES = ("log_weights", "samples")
OUT_NAMES = ("log_norm_weights", "ess", "log_evidence", "mean", "variance")


def batch_of(size):
    return () if size[0] == -1 else (size[0],)


def make_snis_inputs(size, dtype=torch.float32, device="cpu", requires_grad=False, scale=2.0, offset=0.0):
    """Log weights ~ scale * N(0, 1) + offset (a few samples dominate at scale 2),
    samples ~ 2 N(0, 1) + 1."""
    _, n, d = size
    batch = batch_of(size)
    lw = torch.randn(*batch, n, dtype=dtype, device=device) * scale + offset
    x = torch.randn(*batch, n, d, dtype=dtype, device=device) * 2 + 1
    return [lw.requires_grad_(requires_grad), x.requires_grad_(requires_grad)]


def _out_shapes(size):
    _, n, d = size
    b = batch_of(size)
    return [(*b, n), b, b, (*b, d), (*b, d)]


def _size_id(size):
    b, n, d = size
    return ("" if b == -1 else f"B{b}-") + f"N{n}-D{d}"


class _Snis(torch.nn.Module):
    """What a user's module around the op looks like (the table's module check)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, log_weights, samples):
        return self.fn(log_weights, samples, True)


def _module(device):
    args = make_snis_inputs((64, 1000, 8), device=device)
    return _Snis(fused_ops.snis), _Snis(reference.snis), tuple(args)


def _expanded(device):
    # One set of samples shared by every problem, one log-weight row for all.
    size = (5, 700, 3)
    lw = torch.randn(700, device=device).expand(5, 700)
    x = torch.randn(700, 3, device=device).expand(5, 700, 3)
    return size, [lw, x]


def _gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, scale=1.0, requires_grad=True)


def _grad32_check(case, got, ref32, exact, ctx):
    """The fused float32 gradients (double accumulation inside) are no
    further from float64 than twice the float32 reference's, plus 1e-6 of
    the largest gradient element (the float32 rounding of the inputs and
    outputs alone)."""
    gscale = max(max_abs(e) for e in exact)
    for name, a, b, e in zip(case.arg_names, got, ref32, exact):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err_fused = (a.double() - e).abs().max().item()
        err_ref = (b.double() - e).abs().max().item()
        assert err_fused <= 2 * err_ref + 1e-6 * gscale, (name, err_fused, err_ref, gscale)


def _bwd_args(case, size, dtype, device, grads=(True,) * 5):
    """Upstream gradients (None where not in ``grads``), then the forward's
    log_norm_weights, samples, mean and variance."""
    lw, x = case.inputs(size, dtype=dtype, device=device)
    outs = fused_ops.snis(lw, x, True)
    ups = tuple(torch.randn_like(o) if g else None for o, g in zip(outs, grads))
    return (*ups, outs[0], x, outs[3], outs[4])


def _bad(**changes):
    return arg_modifier(ARG_NAMES, **changes)


def _invariants(out, args, dtype):
    lnw, ess = out[0], out[1]
    assert torch.isfinite(lnw).all()
    assert (torch.logsumexp(lnw.double(), -1).abs() <= 1e-5).all()
    assert ((ess >= 1 - 1e-5) & (ess <= lnw.shape[-1] * (1 + 1e-5))).all()


SNIS = OpCase(
    name="snis",
    fn=fused_ops.snis,
    packet=torch.ops.fused_ops.snis,
    reference=reference.snis,
    make=make_snis_inputs,
    arg_names=ARG_NAMES,
    out_names=OUT_NAMES,
    out_shapes=_out_shapes,
    scalars=lambda size: (True,),
    size_id=_size_id,
    fresh_first=lambda t: torch.randn_like(t) * 2,
    match_sizes=((-1, 1, 1), (-1, 7, 3), (-1, 4096, 16), (-1, 100003, 2), (3, 5, 1), (64, 1000, 8),
                 (1000, 37, 4), (2, 10000, 33)),
    # float32 log weights of scale 2 (a few samples dominate): the
    # reference's float32 logsumexp and sums lose a few ulps per output; the
    # fused op sums in double and rounds once.
    accuracy=tuple(Accuracy(s, trials=8) for s in ((-1, 4096, 16), (64, 1000, 8), (-1, 100003, 2),
                                                   (-1, 1000, 4))),
    invariants=_invariants,
    poison_sizes=((-1, 1, 1), (-1, 4097, 3), (33, 129, 5), (-1, 300007, 2)),
    poison_numels=lambda s: [math.prod(batch_of(s)) * n for n in (s[1], 1, 1, s[2], s[2])],
    layouts={
        "log_weights_step": (per_arg(a0=lambda t: row_step(t.t()).t() if t.dim() == 2 else row_step(t)),
                             "noncontig"),
        "samples_transposed": (per_arg(a1=lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)),
                               "noncontig"),
        "all": (per_arg(a0=lambda t: transposed(t), a1=lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)),
                "noncontig"),
    },
    layout_sizes=((7, 257, 6), (3, 4099, 5)),
    expanded=_expanded,
    empty_size=(0, 5, 3),
    opcheck_sizes=((-1, 1, 1), (-1, 33, 5), (4, 17, 3)),
    meta_size=(-1, 11, 4),
    module=_module,
    compile_size=(4, 300, 5),
    compile_loss=lambda o: o[0].exp().square().sum() + 0.1 * o[1].sum() + o[2].sum() + o[3].sum() + o[4].sum(),
    compile_tol=dict(rtol=1e-4, atol=1e-5),
    determinism_sizes=((-1, 100003, 16), (256, 1000, 3)),
    thread_size=(-1, 100003, 7),  # 25 chunks of 4096
    bad_size=(-1, 6, 3),
    bad_inputs=(
        Bad("log_weights_0d", _bad(log_weights=lambda t: t[0]), "log_weights", r"1-D"),
        Bad("N_0", _bad(log_weights=lambda t: t[:0], samples=lambda t: t[:0]), "log_weights", r"N >= 1"),
        Bad("samples_1d", _bad(samples=lambda t: t[:, 0]), "samples", r"2-D"),
        Bad("samples_unbatched_for_batched_weights", _bad(log_weights=lambda t: t.expand(2, 6)), "samples", r"3-D"),
        Bad("samples_N", _bad(samples=lambda t: t[:-1]), "samples", r"shape\[0\] must be 6"),
        Bad("batch_mismatch", _bad(log_weights=lambda t: t.expand(2, 6), samples=lambda t: t.expand(3, 6, 3)),
            "samples", r"shape\[0\] must be 2 \(a batch dimension"),
        Bad("log_weights_int64", _bad(log_weights=lambda t: t.long()), "log_weights", r"float32 or float64"),
        Bad("samples_float64", _bad(samples=lambda t: t.double()), "samples", r"same dtype as log_weights"),
        Bad("moments_without_samples", _bad(samples=lambda t: None), "samples", r"moments=True"),
    ),
    stream_sizes=((-1, 1 << 20, 4),),
    graph_sizes=((-1, 1 << 18, 4), (256, 1000, 3)),
    cuda_cpu_float64=(((-1, 100003, 5), 1e-10, 1e-12), ((300, 999, 3), 1e-10, 1e-12)),
    isa_sizes=((-1, 1, 1), (3, 37, 2), (-1, 4099, 16)),
    gradcheck_sizes=(((-1, 5, 2), False), ((2, 4, 1), False), ((-1, 1, 2), False)),
    gradcheck_inputs=_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-6, rtol=1e-5),
    gradcheck_alone_size=(3, 5, 2),
    grad64_sizes=(((-1, 300, 4), all_subsets(5)[:5] + [tuple(range(5))], {}),
                  ((16, 50, 3), [tuple(range(5))], {})),
    grad32_sizes=tuple((s, sub) for s in ((-1, 4096, 16), (64, 1000, 3)) for sub in ((0, 1, 2, 3, 4), (1,), (4,))),
    grad32_check=_grad32_check,
    nonlinear_loss=lambda outs: (outs[0].exp() ** 2).sum() + 0.1 * outs[3].square().sum(),
    bwd=torch.ops.fused_ops.snis_backward.default,
    bwd_args=_bwd_args,
    bwd_grad_names=("grad_log_norm_weights", "grad_ess", "grad_log_evidence", "grad_mean", "grad_variance"),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((-1, 1, 1), (-1, 33, 5), (4, 17, 3)),
    bwd_opcheck_grads=((True,) * 5, (True, False, False, False, False), (False, True, True, True, True)),
    bwd_meta_size=(-1, 11, 4),
    bwd_determinism_sizes=((-1, 100003, 3), (128, 1000, 4)),
    bwd_thread_size=(-1, 30011, 5),
    bwd_bad_size=(-1, 9, 3),
    bwd_bad=(
        BwdBad("grad_lw-size", set_arg(0, lambda a: a[0][:-1]), r"grad_log_norm_weights\.shape\[0\] must be 9"),
        BwdBad("grad_ess-rank", set_arg(1, lambda a: a[1][None]), r"grad_ess must be a 0-D tensor"),
        BwdBad("grad_mean-dtype", set_arg(3, lambda a: a[3].double()), r"grad_mean must have the same dtype"),
        BwdBad("grad_variance-without-variance", set_arg(8, lambda a: a[8][:0]), r"grad_variance needs"),
        BwdBad("lnw-None", set_arg(5, lambda a: None), r"log_norm_weights must be a 1-D tensor .*got None$"),
        BwdBad("mean-size", set_arg(7, lambda a: a[7][:-1]), r"mean\.shape\[0\] must be 3"),
        BwdBad("samples-N", set_arg(6, lambda a: a[6][:-1]), r"samples\.shape\[0\] must be 9"),
    ),
    bwd_empty_size=(0, 5, 3),
    bwd_linearity_size=(3, 40, 3),
    bwd_stream_size=(-1, 1 << 18, 4),
    bwd_graph_size=(64, 1000, 4),
    bwd_cuda_cpu_sizes=((-1, 100003, 3), (300, 999, 5), (-1, 1, 1)),
    bwd_accuracy=tuple((s, g) for s in ((-1, 4096, 16), (64, 1000, 3))
                       for g in ((True,) * 5, (False, True, False, False, False))),
    paths=(
        PathCase("block", (1024, 4096, 4)),
        PathCase("block", (-1, 1 << 20, 3), note="one block for a whole large problem: correct, slow"),
        PathCase("split", (-1, 1 << 20, 3)),
        PathCase("split", (4, 100003, 16), note="several problems split into chunks"),
    ),
    natural=(
        PathCase("block", (1024, 4096, 4)),
        PathCase("block", (-1, 1000, 3)),
        PathCase("split", (-1, 1 << 20, 3)),
        PathCase("split", (8, 1 << 16, 2)),
    ),
    refused=(PathCase("split", (-1, 1000, 3)),),
    path_names=("split", "block"),
    bwd_path_names=("twopass",),
    bwd_paths=(PathCase("twopass", (64, 1000, 4)),),
    bwd_natural=(PathCase("twopass", (64, 1000, 4)), PathCase("twopass", (-1, 1 << 20, 3))),
)
