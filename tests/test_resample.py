"""What only resample has (the op-table contract is test_contract.py's): the
distribution of the indices for each method, the stratified/systematic
count bound, sizes beyond torch.multinomial's 2**24 categories, batched
against looped calls, the generator and determinism, invariance to the
normalisation, zero weights, integer outputs without gradients, and the
CUDA kernels' -1 for a problem without a positive weight."""

import pytest
import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import outputs_per_thread_count, requires_cuda

METHODS = ("multinomial", "stratified", "systematic")
INF = float("inf")


def _p_value_chi2(stat, dof):
    """Upper tail of the chi-square distribution (no scipy needed)."""
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def _counts(idx, n):
    """Per-problem counts [B, n] of indices [B, M]."""
    return torch.zeros(idx.shape[0], n, dtype=torch.float64, device=idx.device).scatter_add_(
        1, idx, torch.ones_like(idx, dtype=torch.float64))


def _weights(device):
    w = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0125, 0.4875], dtype=torch.float64)
    return w.log().to(device), w


def _check_counts(counts, w, M, method):
    """Counts [B, K] of B independent draws of M indices from weights w [K]."""
    B, mean = counts.shape[0], M * w
    assert counts[:, w == 0].sum() == 0, "an index of zero weight was drawn"
    pos = w > 0
    # Pooled counts: chi-square against B * M * w (every method is unbiased).
    total = counts.sum(0)
    stat = ((total[pos] - B * mean[pos]) ** 2 / (B * mean[pos])).sum().item()
    assert _p_value_chi2(stat, int(pos.sum()) - 1) > 1e-4, (method, total, B * mean)
    if method == "multinomial":
        # Each draw is Multinomial(M, w): the per-draw chi-square statistics
        # sum to a chi-square with B * (K - 1) degrees of freedom.  Stratified
        # and systematic counts vary far less, and would fail this.
        stat = ((counts[:, pos] - mean[pos]) ** 2 / mean[pos]).sum().item()
        assert _p_value_chi2(stat, B * (int(pos.sum()) - 1)) > 1e-4
        assert 1 - _p_value_chi2(stat, B * (int(pos.sum()) - 1)) > 1e-4
    else:
        # Every draw's count of index i is within one of M * w_i.
        assert ((counts - mean).abs() < 1 + 1e-9).all(), (method, (counts - mean).abs().max())


@pytest.mark.parametrize("method", METHODS)
def test_distribution_of_counts(method, device):
    # 4000 independent problems of the same weights, M = 40 samples each.
    lw, w = _weights(device)
    B, M = 4000, 40
    idx = fused_ops.resample(lw.float().expand(B, -1), M, method)
    _check_counts(_counts(idx, len(w)).cpu(), w, M, method)


@requires_cuda
@pytest.mark.parametrize("method", METHODS)
def test_cuda_multiblock_distribution_of_counts(method):
    # The weights of _weights spread over N = 70001 log weights (the rest
    # -inf), so the categories fall in different chunks of "multiblock"
    # (chunks of 2048): 64 problems (its limit), M = 3000 samples each.
    from fused_ops import _paths

    lw6, w = _weights("cuda")
    where = torch.tensor([3, 2100, 2101, 30000, 51234, 70000], device="cuda")
    lw = torch.full((64, 70001), -INF, device="cuda")
    lw[:, where] = lw6.float()
    M = 3000
    with _paths.force("resample", "multiblock"):
        idx = fused_ops.resample(lw, M, method)
    torch.cuda.synchronize()
    assert bool((idx[:, 1:] >= idx[:, :-1]).all()), "indices are ascending"
    assert bool(torch.isin(idx, where).all()), "an index of zero weight was drawn"
    _check_counts(_counts(torch.searchsorted(where, idx), len(w)).cpu(), w, M, method)


def test_beyond_2_24_categories_and_samples():
    # N and M past 2**24 (torch.multinomial's limit, and float32's exact
    # integers): float32 log weights, one heavy weight past index 2**24.
    N, M = (1 << 24) + 3, (1 << 24) + 5
    lw = torch.zeros(N)
    lw[-2] = 20.0  # weight e^20: about M * e^20 / (N + e^20) = 4.2e6 of the samples
    lw[5] = -INF
    idx = fused_ops.resample(lw, M, "systematic")
    assert idx.shape == (M,) and idx.dtype == torch.int64
    assert bool((idx[1:] >= idx[:-1]).all()) and int(idx[0]) >= 0 and int(idx[-1]) < N
    counts = torch.bincount(idx, minlength=N).double()
    w = torch.ones(N, dtype=torch.float64)
    w[-2], w[5] = torch.tensor(20.0, dtype=torch.float64).exp(), 0.0
    assert ((counts - M * w / w.sum()).abs() < 1 + 1e-6).all()


@pytest.mark.parametrize("method", ["stratified", "systematic"])
@pytest.mark.parametrize("B", [None, 2])
def test_cpu_problem_spread_over_threads_gives_the_serial_indices(method, B):
    # With fewer problems than threads, a stratified/systematic problem of
    # N >= 2**16 spreads its chunks over the threads; one thread runs it
    # serially.  The sums are the same, so the indices are bitwise equal.
    lead = () if B is None else (B,)
    lw = torch.randn(*lead, 300007) * 3
    lw[..., 5000:9000] = -INF  # chunks of zero weight: they own no target
    u = torch.rand(*lead, 1 if method == "systematic" else 200003, dtype=torch.float64)
    results = outputs_per_thread_count(lambda: fused_ops.resample(lw, 200003, method, uniforms=u), (1, 2, 3))
    for idx in results.values():
        assert torch.equal(idx, results[1])
    assert torch.equal(results[1], reference.resample(lw, u, 200003, method))


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_looped(method, device):
    lw = torch.randn(5, 3, 777, device=device) * 3
    lw[1, 2, :700] = -INF
    M = 500
    u = torch.rand(5, 3, 1 if method == "systematic" else M, dtype=torch.float64, device=device)
    got = fused_ops.resample(lw, M, method, uniforms=u)
    for b in range(5):
        for c in range(3):
            assert torch.equal(got[b, c], fused_ops.resample(lw[b, c], M, method, uniforms=u[b, c]))


@pytest.mark.parametrize("method", METHODS)
def test_generator_is_the_uniforms_drawn_in_float64(method, device):
    lw = torch.randn(4, 300, device=device)
    g = torch.Generator(device=device).manual_seed(123)
    got = fused_ops.resample(lw, 200, method, generator=g)
    g.manual_seed(123)
    u = torch.rand(4, 1 if method == "systematic" else 200, dtype=torch.float64, device=device, generator=g)
    assert torch.equal(got, fused_ops.resample(lw, 200, method, uniforms=u))
    g.manual_seed(123)
    assert torch.equal(got, fused_ops.resample(lw, 200, method, generator=g))  # same draw, same indices
    assert not torch.equal(got, fused_ops.resample(lw, 200, method, generator=g))  # a fresh draw


@pytest.mark.parametrize("method", METHODS)
def test_log_weights_in_the_thousands_and_unnormalised(method, device):
    # Shifting every log weight by a constant changes nothing (values on a
    # 2**-20 grid, so the shift is exact).
    lw = (torch.randn(3, 2000, dtype=torch.float64, device=device) * 4 * 2**20).round() / 2**20
    u = torch.rand(3, 1 if method == "systematic" else 1500, dtype=torch.float64, device=device)
    base = fused_ops.resample(lw, 1500, method, uniforms=u)
    for shift in (4096.0, -4096.0):
        assert torch.equal(fused_ops.resample(lw + shift, 1500, method, uniforms=u), base)
    assert torch.equal(base, reference.resample(lw, u, 1500, method))


@pytest.mark.parametrize("method", METHODS)
def test_one_positive_weight(method, device):
    lw = torch.full((2, 5000), -INF, device=device)
    lw[0, 4321] = 3.0
    lw[1, 0] = -700.0  # tiny, but the only one: exp(lw - max) = 1
    idx = fused_ops.resample(lw, 777, method)
    assert bool((idx[0] == 4321).all()) and bool((idx[1] == 0).all())


def test_default_num_samples_and_method():
    lw = torch.randn(3, 17)
    idx = fused_ops.resample(lw)
    assert idx.shape == (3, 17)
    g = torch.Generator().manual_seed(5)
    assert torch.equal(fused_ops.resample(lw, generator=g), fused_ops.resample(
        lw, 17, "systematic", uniforms=torch.rand(3, 1, dtype=torch.float64, generator=g.manual_seed(5))))


def test_python_argument_errors():
    lw = torch.randn(10)
    with pytest.raises(RuntimeError, match=r"method must be .*got 'residual'"):
        fused_ops.resample(lw, method="residual")
    with pytest.raises(RuntimeError, match=r"num_samples must be >= 0, got -2"):
        fused_ops.resample(lw, -2)
    with pytest.raises(TypeError, match="num_samples"):
        fused_ops.resample(lw, True)
    with pytest.raises(RuntimeError, match=r"log_weights must be a 1-D tensor .*got None"):
        fused_ops.resample(None, 3)


def test_not_differentiable():
    lw = torch.randn(50, requires_grad=True)
    idx = fused_ops.resample(lw, 20, "multinomial")
    assert idx.dtype == torch.int64 and not idx.requires_grad and idx.grad_fn is None
    # The gradient flows through what the indices select.
    lw.exp().gather(0, idx).sum().backward()
    assert lw.grad is not None and lw.grad.count_nonzero() > 0


def test_compile_drawing_inside_the_graph():
    torch._dynamo.reset()
    fn = torch.compile(lambda lw: fused_ops.resample(lw, 64, "stratified"), fullgraph=True)
    lw = torch.randn(4, 100)
    lw[:, ::2] = -INF
    idx = fn(lw)
    assert idx.shape == (4, 64) and bool((idx % 2 == 1).all())


@requires_cuda
@pytest.mark.parametrize("path", ["block", "multiblock"])
def test_cuda_problem_without_positive_weight_gives_minus_one(path):
    from fused_ops import _paths

    lw = torch.randn(4, 70000, device="cuda")  # multiblock takes N >= 65536
    lw[1] = -INF
    lw[2, 17] = float("nan")
    lw[3, 5] = INF
    u = torch.rand(4, 100, dtype=torch.float64, device="cuda")
    with _paths.force("resample", path):
        idx = fused_ops.resample(lw, 100, "stratified", uniforms=u)
    torch.cuda.synchronize()
    assert bool((idx[1:] == -1).all())
    assert torch.equal(idx[0].cpu(), fused_ops.resample(lw[0].cpu(), 100, "stratified", uniforms=u[0].cpu()))
