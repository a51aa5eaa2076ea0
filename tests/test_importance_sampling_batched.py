"""What only importance_sampling's batched, mixture-proposal and evidence
calls have (they run importance_log_weights, then snis): agreement with
torch.distributions MixtureSameFamily target and proposal in float64, batched
against a loop of 2-D calls (the plain 2-D call stays the existing op, bitwise),
the log evidence, broadcasting, the -inf / NaN rules per problem, gradients
through the composition, torch.compile, and errors naming the caller's
arguments.

The contract of the importance_log_weights op itself is test_contract*.py's
(op_table/importance_log_weights.py); snis' is op_table/snis.py's.
"""

import math
import re

import pytest
import torch
from torch import distributions as dist

import fused_ops
from fused_ops import reference
from fused_test_utils import DEVICE_PARAMS, make_inputs, tol
from op_table.importance_log_weights import make_ilw_inputs

F64 = torch.float64


def _normalised(size, dtype, device):
    """make_ilw_inputs with mixture weights that sum to 1 (the distributions'
    Categorical normalises them; the op takes log w as given)."""
    x, mw, mm, ms, qw, qm, qs = make_ilw_inputs(size, dtype=dtype, device=device)
    return x, mw / mw.sum(-1, keepdim=True), mm, ms, qw / qw.sum(-1, keepdim=True), qm, qs


def _mixture(w, mus, stds):
    return dist.MixtureSameFamily(dist.Categorical(probs=w), dist.Independent(dist.Normal(mus, stds), 1))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("size", [(3, 500, 4, 3, 2), (1, 2000, 2, 5, 1), (16, 64, 8, 2, 3)],
                         ids=lambda s: "B{}-N{}-D{}-K{}-Kq{}".format(*s))
def test_against_distributions_mixture_target_and_proposal_in_float64(size, device):
    # Samples drawn from the mixture proposal; p and q as torch.distributions;
    # all four outputs against plain float64 code on their log_prob.
    b, n, d, k, kq = size
    _, mw, mm, ms, qw, qm, qs = _normalised(size, F64, device)
    p, q = _mixture(mw, mm, ms), _mixture(qw, qm, qs)
    x = q.sample((n,)).transpose(0, 1).contiguous()  # [B, N, D]
    mean, ess, lnw, logz = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)
    xt = x.transpose(0, 1)  # [N, B, D]: the distributions' batch shape is [B]
    lw = (p.log_prob(xt) - q.log_prob(xt)).transpose(0, 1)  # [B, N]
    lse = torch.logsumexp(lw, -1)
    w = torch.exp(lw - lse[:, None])
    torch.testing.assert_close(lnw, lw - lse[:, None], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logz, lse - math.log(n), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ess, 1 / (w**2).sum(-1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mean, (w[..., None] * x).sum(-2), rtol=1e-10, atol=1e-10)
    # Samples from q, a normalised p: the evidence estimates log 1 = 0.
    assert (logz.abs() < 10 / math.sqrt(ess.min().item())).all(), logz


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_gaussian_proposal_batched_matches_a_loop_of_2d_calls(device):
    # One problem per row: the batched call against the plain 2-D op, which
    # keeps its own kernels (so float32 agreement, not bitwise).
    B, N, D, K = 6, 1000, 5, 3
    calls = [make_inputs(N, D, K, device=device) for _ in range(B)]
    stacked = [torch.stack(a) for a in zip(*calls)]
    got = fused_ops.importance_sampling(*stacked)
    assert [t.shape for t in got] == [(B, D), (B,), (B, N)]
    for i, args in enumerate(calls):
        want = fused_ops.importance_sampling(*args)
        for name, g, w in zip(("weighted_mean", "ess", "log_weights"), got, want):
            torch.testing.assert_close(g[i], w, **tol(torch.float32), msg=lambda m, n=name: f"{n}[{i}]: {m}")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_plain_2d_call_is_the_existing_op(device):
    # No batch, a Gaussian proposal, no evidence: the existing op, bitwise;
    # with return_evidence=True the batched route adds the evidence.
    args = make_inputs(4096, 16, 3, device=device)
    plain = fused_ops.importance_sampling(*args)
    direct = torch.ops.fused_ops.importance_sampling(*args)
    assert len(plain) == 3
    for a, b in zip(plain, direct):
        assert torch.equal(a, b)
    with_z = fused_ops.importance_sampling(*args, return_evidence=True)
    assert len(with_z) == 4 and with_z[3].shape == ()
    for name, a, b in zip(("weighted_mean", "ess", "log_weights"), with_z, plain):
        torch.testing.assert_close(a, b, **tol(torch.float32), msg=lambda m, n=name: f"{n}: {m}")
    x, mw, mm, ms, qm, qs = (a.double() for a in args)
    lw = reference.mixture_log_density(x, mw, mm, ms) - reference.mixture_log_density(
        x, torch.ones(1, dtype=F64, device=device), qm[None], qs[None])
    torch.testing.assert_close(with_z[3].double(), torch.logsumexp(lw, 0) - math.log(4096), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_log_evidence_against_float64_reference(dtype, device):
    size = (8, 3000, 6, 4, 2)
    args = make_ilw_inputs(size, dtype=dtype, device=device)
    x, mw, mm, ms, qw, qm, qs = args
    logz = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)[3]
    lw = reference.importance_log_weights(*(a.double() for a in args))
    want = torch.logsumexp(lw, -1) - math.log(size[1])
    t = 1e-10 if dtype == F64 else 2e-5
    torch.testing.assert_close(logz.double(), want, rtol=t, atol=t)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_broadcast_batch_shapes(device):
    # Leading dimensions broadcast: samples [2, 3, N, D], one target for
    # every problem, a proposal per row of the first dimension.
    N, D, K = 200, 3, 2
    x = torch.randn(2, 3, N, D, device=device) * 2
    mw = torch.rand(K, device=device) + 0.2
    mm, ms = torch.randn(K, D, device=device), torch.rand(K, D, device=device) + 0.6
    qm, qs = torch.randn(2, 1, D, device=device) * 0.3, torch.rand(2, 1, D, device=device) + 2
    mean, ess, lnw, logz = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, return_evidence=True)
    assert (mean.shape, ess.shape, lnw.shape, logz.shape) == ((2, 3, D), (2, 3), (2, 3, N), (2, 3))
    for i in range(2):
        for j in range(3):
            want = fused_ops.importance_sampling(x[i, j], mw, mm, ms, qm[i, 0], qs[i, 0], return_evidence=True)
            for g, w in zip((mean[i, j], ess[i, j], lnw[i, j], logz[i, j]), want):
                torch.testing.assert_close(g, w, **tol(torch.float32))
    # Samples shared by every problem (no batch dimension of their own).
    targets = torch.randn(4, K, D, device=device)
    out = fused_ops.importance_sampling(x[0, 0], mw, targets, ms, qm[0, 0], qs[0, 0])
    assert out[2].shape == (4, N)
    torch.testing.assert_close(out[2][1], fused_ops.importance_sampling(x[0, 0], mw, targets[1], ms, qm[0, 0],
                                                                         qs[0, 0])[2], **tol(torch.float32))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_non_finite_problems_follow_the_documented_rules(device):
    # Problem 1: every target weight zero (all log weights -inf): NaN
    # outputs, log evidence -inf.  Problem 2: a NaN sample: NaN everywhere.
    # Problems 0 and 3 are untouched by their neighbours.
    size = (4, 300, 3, 3, 2)
    x, mw, mm, ms, qw, qm, qs = make_ilw_inputs(size, device=device)
    clean = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)
    mw, x = mw.clone(), x.clone()
    mw[1] = 0
    x[2, 17, 1] = float("nan")
    mean, ess, lnw, logz = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)
    for t in (mean[1], ess[1], lnw[1]):
        assert torch.isnan(t).all()
    assert logz[1].item() == -math.inf
    for t in (mean[2], ess[2], lnw[2], logz[2]):
        assert torch.isnan(t).all()
    for b in (0, 3):
        for g, c in zip((mean, ess, lnw, logz), clean):
            assert torch.equal(g[b], c[b])
    # The plain op's rule for the same all-zero target: NaN outputs too.
    plain = fused_ops.importance_sampling(x[1], mw[1], mm[1], ms[1], qm[1, 0], qs[1, 0])
    assert all(torch.isnan(t).all() for t in plain)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("gaussian", [False, True], ids=["mixture_proposal", "gaussian_proposal"])
def test_gradcheck_through_the_batched_route(gaussian, device):
    size = (2, 6, 2, 2, 2)
    x, mw, mm, ms, qw, qm, qs = make_ilw_inputs(size, dtype=F64, device=device, scale=1.5)
    if gaussian:
        qm, qs = qm[:, 0].contiguous(), qs[:, 0].contiguous()
    args = [t.requires_grad_() for t in (x, mw, mm, ms, qm, qs, qw)]

    def fn(x, mw, mm, ms, qm, qs, qw=None):
        mean, ess, lnw, logz = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=None if gaussian else qw,
                                                             return_evidence=True)
        return mean, ess, lnw, logz, (lnw.exp() ** 2).sum()

    assert torch.autograd.gradcheck(fn, args[:6] if gaussian else args, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_gradients_match_reference_in_float64(device):
    size = (3, 400, 4, 3, 2)
    args = make_ilw_inputs(size, dtype=F64, device=device, requires_grad=True)
    x, mw, mm, ms, qw, qm, qs = args

    def loss(outs):
        mean, ess, lnw, logz = outs
        return mean.square().sum() + 0.1 * ess.sum() + (lnw.exp() ** 2).sum() + logz.sum()

    got = torch.autograd.grad(loss(fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw,
                                                                 return_evidence=True)), args)
    want = torch.autograd.grad(loss(reference.importance_sampling_batched(x, mw, mm, ms, qw, qm, qs)), args)
    for g, w in zip(got, want):
        scale = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11 * scale)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_compile_fullgraph_dynamic_no_recompile(device):
    # The batched route (broadcast Gaussian proposal, and a mixture proposal
    # with the evidence) under torch.compile(fullgraph=True, dynamic=True):
    # the eager results, and one graph each for three sizes.
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def mixture(x, mw, mm, ms, qm, qs, qw):
        return fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)

    def gaussian(x, mw, mm, ms, qm, qs):  # one target for every problem, a proposal per problem
        return fused_ops.importance_sampling(x, mw[0], mm[0], ms[0], qm[:, 0], qs[:, 0])

    fns = [(f, torch.compile(f, backend=counter, dynamic=True, fullgraph=True)) for f in (mixture, gaussian)]
    for by in (0, 1, 3):
        x, mw, mm, ms, qw, qm, qs = make_ilw_inputs((3 + by, 30 + by, 4 + by, 2 + by, 2 + by), device=device)
        for (eager, compiled), args in zip(fns, ((x, mw, mm, ms, qm, qs, qw), (x, mw, mm, ms, qm, qs))):
            for g, e in zip(compiled(*args), eager(*args)):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 2, f"{counter.frame_count} compiles of 2 functions at 3 sizes"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_low_precision_inputs_return_their_dtype(device):
    size = (3, 200, 4, 2, 2)
    args = make_ilw_inputs(size, device=device)
    x, mw, mm, ms, qw, qm, qs = (a.bfloat16() for a in args)
    outs = fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    want = fused_ops.importance_sampling(*(a.float() for a in (x, mw, mm, ms, qm, qs)), q_weights=qw.float(),
                                         return_evidence=True)
    for o, w in zip(outs, want):
        assert torch.equal(o, w.bfloat16())


def _bad_calls():
    """(id, keyword changes to a valid batched mixture-proposal call, the argument named, a regex)."""
    return [
        ("q_mu_rank", dict(q_mu=lambda t: t[0, 0]), "q_mu", r"2-D tensor \[Kq, D\]"),
        ("q_std_D", dict(q_std=lambda t: t[..., :2]), "q_std", r"\bD\b"),
        ("q_mu_Kq", dict(q_mu=lambda t: t[:, :1]), "q_mu", r"\bKq\b"),
        ("q_weights_batch", dict(q_weights=lambda t: t[:2]), "q_weights", r"broadcast"),
        ("mix_mus_batch", dict(mix_mus=lambda t: t[:2]), "mix_mus", r"broadcast"),
        ("samples_N_0", dict(samples=lambda t: t[:, :0]), "samples", r"N >= 1"),
        ("mix_weights_K_0", dict(mix_weights=lambda t: t[:, :0], mix_mus=lambda t: t[:, :0],
                                 mix_stds=lambda t: t[:, :0]), "mix_weights", r"K >= 1"),
        ("q_std_float64", dict(q_std=lambda t: t.double()), "q_std", r"same dtype"),
        ("samples_int64", dict(samples=lambda t: t.long()), "samples", r"float32 or float64"),
        ("q_weights_None_mixture_q_mu", dict(q_weights=lambda t: None), "q_mu", r"does not broadcast|broadcast"),
    ]


@pytest.mark.parametrize("meta", [False, True], ids=["cpu", "meta"])
@pytest.mark.parametrize("bad", _bad_calls(), ids=lambda b: b[0])
def test_bad_batched_calls_name_the_argument(bad, meta):
    _, changes, arg, expected = bad
    x, mw, mm, ms, qw, qm, qs = make_ilw_inputs((3, 6, 4, 3, 2), device="meta" if meta else "cpu")
    kw = dict(samples=x, mix_weights=mw, mix_mus=mm, mix_stds=ms, q_mu=qm, q_std=qs, q_weights=qw)
    for name, change in changes.items():
        kw[name] = change(kw[name])
    with pytest.raises(RuntimeError) as excinfo:
        fused_ops.importance_sampling(kw.pop("samples"), kw.pop("mix_weights"), kw.pop("mix_mus"),
                                      kw.pop("mix_stds"), kw.pop("q_mu"), kw.pop("q_std"), **kw,
                                      return_evidence=True)
    msg = str(excinfo.value)
    assert arg in msg and re.search(expected, msg), msg
