"""What only importance_sampling has (DESIGN.md section 2.1): exact results
at N=1, a zero mixture weight, NaN / inf propagation, a property test of its
outputs' invariants (normalised log weights, 1 <= ess <= N, the mean inside
the samples' range), and a dynamic batch under torch.compile.

The contract it shares with the other ops (reference match, float32
accuracy, layouts, opcheck, autograd, determinism, bad inputs, CUDA streams
and graphs) is test_contract.py's, over op_cases.IMPORTANCE_SAMPLING.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_ops
from fused_ops import reference
from fused_test_utils import ARG_NAMES, DEVICE_PARAMS, DTYPES, describe, make_inputs, requires_cuda, tol

OUT_NAMES = ("weighted_mean", "ess", "log_weights")


def fused(*args):
    return fused_ops.importance_sampling(*args)


def assert_outputs_close(got, want, **kw):
    for name, g, w in zip(OUT_NAMES, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}", **kw)


def assert_outputs_equal(got, want):
    for name, g, w in zip(OUT_NAMES, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name} differs bitwise: max |diff| = {(g - w).abs().max().item()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_single_sample_is_exact(dtype, device):
    # N=1: the only weight is 1, so log_weights == [0], ess == 1 and the mean
    # is the sample itself, exactly (no rounding is involved in x * 1 / 1).
    args = make_inputs(1, 9, 4, dtype=dtype, device=device)
    mean, ess, lw = fused(*args)
    assert torch.equal(lw, torch.zeros_like(lw))
    assert ess.item() == 1.0
    assert torch.equal(mean, args[0][0])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_zero_weight_component(dtype, device):
    # A zero mixture weight gives log w_k = -inf: the component drops out of
    # the logsumexp, as in the reference, and nothing turns NaN.
    args = list(make_inputs(500, 6, 4, dtype=dtype, device=device))
    args[1][1] = 0.0
    want = reference.importance_sampling(*args)
    got = fused(*args)
    assert all(torch.isfinite(t).all() for t in want)
    assert_outputs_close(got, want, **tol(dtype))
    # ... and equals the mixture with that component removed.
    keep = torch.tensor([0, 2, 3], device=device)
    reduced = [args[0], args[1][keep], args[2][keep], args[3][keep], args[4], args[5]]
    assert_outputs_close(got, fused(*reduced), **tol(dtype))


def test_compile_dynamic_batch_no_recompile(device):
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    module = fused_ops.nn.ImportanceSampler(8, 3).to(device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(module.forward_with_log_weights, backend=counter, fullgraph=True, dynamic=True)
    params = [getattr(module, n) for n in ARG_NAMES[1:]]
    for i, N in enumerate((64, 1000, 4097)):
        x = torch.randn(N, 8, device=device) * 3
        if i == 0:
            got = compiled(x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                got = compiled(x)
        assert got[2].shape == (N,)
        assert_outputs_equal(got, fused(x, *params))
        assert_outputs_close(got, reference.importance_sampling(x, *params), **tol(torch.float32))
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize(
    "N,where",
    [(7, "samples:0"), (7, "samples:last"), (1000, "samples:0"), (1000, "samples:mid"),
     (1000, "samples:last"), (1000, "mix_mus"), (1000, "mix_stds"), (1000, "q_mu"), (1000, "q_std"),
     (1000, "mix_weights")],
)
def test_nan_propagates(N, where, dtype, device):
    args = list(make_inputs(N, 5, 3, dtype=dtype, device=device))
    target, _, pos = where.partition(":")
    i = ARG_NAMES.index(target)
    row = {"0": 0, "mid": N // 2 + 1, "last": N - 1, "": 0}[pos]
    args[i] = args[i].clone()
    args[i].view(-1)[row * (args[i].shape[-1] if i == 0 else 1) + (2 if i == 0 else 0)] = float("nan")
    want = reference.importance_sampling(*args)
    for name, t in zip(OUT_NAMES, want):  # the behaviour the op must reproduce
        assert torch.isnan(t).all(), f"reference {name} is not all-NaN"
    got = fused(*args)
    for name, t in zip(OUT_NAMES, got):
        assert torch.isnan(t).all(), f"{name}: {int((~torch.isnan(t)).sum())} non-NaN elements"


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_inf_sample_propagates_like_reference(value, device):
    args = list(make_inputs(600, 4, 3, device=device))
    args[0] = args[0].clone()
    args[0][300, 1] = value
    want = reference.importance_sampling(*args)
    got = fused(*args)
    for name, g, w in zip(OUT_NAMES, got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w)), name
        assert torch.equal(torch.isinf(g), torch.isinf(w)), name
        finite = torch.isfinite(w)
        torch.testing.assert_close(g[finite], w[finite], **tol(torch.float32))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    N=st.integers(1, 300),
    D=st.integers(1, 40),
    K=st.integers(1, 6),
    scale=st.floats(0.1, 10.0),
    std_lo=st.floats(0.2, 2.0),
    std_span=st.floats(0.0, 3.0),
    q_std_lo=st.floats(0.5, 5.0),
    gen_seed=st.integers(0, 2**32 - 1),
)
def test_property_matches_reference(device, N, D, K, scale, std_lo, std_span, q_std_lo, gen_seed):
    g = torch.Generator().manual_seed(gen_seed)
    args = make_inputs(N, D, K, dtype=torch.float64, device=device, generator=g, scale=scale,
                       std_range=(std_lo, std_lo + std_span), q_std_range=(q_std_lo, 2 * q_std_lo))
    x = args[0]
    mean, ess, lw = got = fused(*args)
    want = reference.importance_sampling(*args)
    xmax = x.abs().max().item()
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9 * (1 + xmax))
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[2], want[2], rtol=1e-9, atol=1e-9)
    assert torch.isfinite(lw).all() and (lw <= 1e-9).all()
    assert abs(torch.logsumexp(lw, 0).item()) <= 1e-9
    assert 1 - 1e-9 <= ess.item() <= N * (1 + 1e-9), describe(args)
    eps = 1e-9 * (1 + xmax)
    assert (mean >= x.min(0).values - eps).all() and (mean <= x.max(0).values + eps).all()


# ---------------------------------------------------------------------------
# Log weights without a normaliser, subnormal stds, huge identical samples:
# on the CPU, and on CUDA with every kernel path forced.
# ---------------------------------------------------------------------------


def _path_params():
    from op_cases import IMPORTANCE_SAMPLING

    params = [pytest.param("cpu", None, (1000, 5, 3), id="cpu")]
    seen = set()
    for pc in IMPORTANCE_SAMPLING.paths:
        N, D, K = pc.size
        size = (min(N, 4096), D, K)
        if (pc.path, size) not in seen:
            seen.add((pc.path, size))
            params.append(pytest.param("cuda", pc.path, size, id=f"cuda-{pc.path}-{'x'.join(map(str, size))}",
                                       marks=requires_cuda))
    return params


PATHS = _path_params()


def run_on(device, path, args):
    if path is None:
        return fused(*args)
    from fused_ops import _paths

    with _paths.force("importance_sampling", path):
        out = fused(*args)
    assert _paths.last("importance_sampling") == path
    return out


def _no_normaliser(case, args, dtype):
    x, w, mus, stds, q_mu, q_std = [a.clone() for a in args]
    if case == "all_weights_zero":  # every log weight -inf
        w.zero_()
    elif case == "inf_weight":  # every log weight +inf
        w[0] = float("inf")
    elif case == "inf_q_mu":  # log q = -inf: every log weight +inf
        q_mu[1] = float("inf")
    elif case == "inf_q_std":
        q_std[0] = float("inf")
    elif case == "tiny_std_overflow":  # ((x - mu) / std)^2 overflows for every sample and density
        tiny = 1e-30 if dtype == torch.float32 else 1e-300
        stds.fill_(tiny)
        q_std.fill_(tiny)
    elif case == "nan_log_weight":  # one sample's log weight NaN
        x[3, 0] = float("nan")
    elif case == "inf_and_finite":  # +inf log weights beside one finite one
        q_std[0] = 1e-30 if dtype == torch.float32 else 1e-300
        x[:, 0] = q_mu[0] + 1.0
        x[7, 0] = q_mu[0]
        mus[:, 0] = q_mu[0] + 1.0
        stds[:, 0] = 1.0
    return [x, w, mus, stds, q_mu, q_std]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize(
    "case",
    ["all_weights_zero", "inf_weight", "inf_q_mu", "inf_q_std", "tiny_std_overflow", "nan_log_weight",
     "inf_and_finite"],
)
@pytest.mark.parametrize("device,path,size", PATHS)
def test_no_normaliser_gives_nan(device, path, size, case, dtype):
    # A NaN or +inf log weight, or all of them -inf: the reference's mean and
    # ESS are NaN (its exp(lw - logsumexp) is NaN at those weights); so are
    # the op's, and all its log weights, instead of the plain sample mean and
    # ess = N that weights of exp(inf - inf) := 1 would give.
    args = _no_normaliser(case, make_inputs(*size, dtype=dtype, device=device), dtype)
    want = reference.importance_sampling(*args)
    assert torch.isnan(want[0]).all() and torch.isnan(want[1]).all(), "the reference is not NaN"
    got = run_on(device, path, args)
    for name, t in zip(OUT_NAMES, got):
        assert torch.isnan(t).all(), f"{name}: {int((~torch.isnan(t)).sum())} non-NaN elements"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("where", ["mix_stds", "q_std"])
@pytest.mark.parametrize("device,path,size", PATHS)
def test_subnormal_std_with_a_sample_at_the_mean(device, path, size, where, dtype):
    # 1 / std overflows for a subnormal std; (x - mu) * inf would be NaN for a
    # sample exactly at the mean, where the reference's (x - mu) / std is 0.
    # The result equals the float64 evaluation of the same values.
    N, D, K = size
    tiny = 1e-40 if dtype == torch.float32 else 1e-310
    x, w, mus, stds, q_mu, q_std = [a.clone() for a in make_inputs(*size, dtype=dtype, device=device)]
    # Every sample at the mean 0 in dimension 0, one three stds away.
    if where == "mix_stds":
        stds[1, 0] = tiny
        mus[1, 0] = 0.0
    else:
        q_std[0] = tiny
        q_mu[0] = 0.0
    x[:, 0] = 0.0
    x[5, 0] = tiny * 3
    args = [x, w, mus, stds, q_mu, q_std]
    want = reference.importance_sampling(*args)
    assert all(torch.isfinite(t).all() for t in want), "the reference is not finite"
    got = run_on(device, path, args)
    for name, t in zip(OUT_NAMES, got):
        assert torch.isfinite(t).all(), f"{name}: {int((~torch.isfinite(t)).sum())} non-finite elements"
    exact = reference.importance_sampling(*[a.double() for a in args])
    # Within 1e-4 of the float64 evaluation, or twice the float32 reference's
    # own error where that is larger: at D=1024 a log weight is a difference
    # of sums of a thousand terms, and float32 rounding alone reaches 1e-4.
    for name, g, w, e in zip(OUT_NAMES, got, want, exact):
        err, ref_err = (g.double() - e).abs(), (w.double() - e).abs()
        bound = 1e-4 + 1e-4 * e.abs() + 2 * ref_err
        assert (err <= bound).all(), f"{name}: error {float((err - bound).max()):.3g} over its bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("value", [1e10, -3e9])
@pytest.mark.parametrize("device,path,size", PATHS)
def test_identical_huge_samples(device, path, size, value, dtype):
    # N identical samples of magnitude 1e10: every normalised log weight is
    # exactly -log N (the maximum comes off before log(sum exp) is added; the
    # other way round it rounds away against |lw| ~ 1e19), the ESS N and the
    # mean the sample.  The float32 reference's mean is itself off (6.4e11 for
    # 1e10): the op matches the exact answer.
    N, D, K = size
    args = list(make_inputs(*size, dtype=dtype, device=device))
    args[0] = torch.full((N, D), value, dtype=dtype, device=device)
    mean, ess, lw = run_on(device, path, args)
    torch.testing.assert_close(lw, torch.full_like(lw, -math.log(N)), rtol=1e-6, atol=0)
    torch.testing.assert_close(ess, torch.tensor(float(N), dtype=dtype, device=device), rtol=1e-5, atol=0)
    torch.testing.assert_close(mean, torch.full_like(mean, value), rtol=1e-6, atol=0)
