"""The backward of fused_ops.vae_elbo where only the VAE has something to
check: float32 gradients at saturated logits (p == 0 or 1 exactly, the BCE
backward's clamp, +-inf gradients of x where the reference has them), the
gradcheck input filter itself, gradients through the module with batch
shapes, a compiled training step against the reference's, and the
training pair (vae_elbo_train keeps the activations, vae_elbo_train_backward
reads them instead of recomputing the forward; CPU and CUDA).

gradcheck, float64 / float32 gradients against the reference's autograd,
opcheck, double backward and the backward op's own contract are
test_contract.py's, over op_cases.VAE_ELBO.
"""

import pytest
import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import VAE_ARG_NAMES as ARG_NAMES, make_vae_inputs as make_inputs, requires_cuda
from op_cases import (
    VAE_ELBO,
    vae_assert_grads_close,
    vae_clear_of_relu_kinks as clear_of_relu_kinks,
    vae_gradcheck_inputs,
    vae_preactivations as reference_preactivations,
    vae_reference as reference_outputs,
)

BWD = torch.ops.fused_ops.vae_elbo_backward.default
OUT_NAMES = ("elbo", "recon", "kl")


def fused(*args):
    return fused_ops.vae_elbo(*args)


def assert_grads_close(got, want):
    vae_assert_grads_close(ARG_NAMES, got, want)


def grads(fn, args, upstream):
    """Gradients of fn(*args) for every input with the given upstream
    gradients (a dict output name -> tensor; missing outputs are not used)."""
    outs = dict(zip(OUT_NAMES, fn(*args)))
    names = [n for n in OUT_NAMES if n in upstream]
    return torch.autograd.grad([outs[n] for n in names], args, [upstream[n] for n in names],
                               allow_unused=True, materialize_grads=True)


def saturate(args, x_exact=True):
    """Decoder biases that drive whole columns of logits to p == 1.0 (+40,
    +20) and p == 0.0 (-120) exactly in float32, and into the BCE backward's
    clamp (-30: 0 < p (1 - p) < 1e-12); x exactly 0 and 1 in some columns.

    Every bias keeps its logits several units from a float32 edge (p rounds
    to 1.0 above a = 16.64, exp(-a) overflows below a = -88.7): a logit
    within rounding of an edge saturates in one summation order and not in
    another, and at p == 1.0 PyTorch's BCE backward switches from (p - x) to
    0, so the fused and reference gradients would differ by O(1) there."""
    x, b2 = args[0], args[11]
    with torch.no_grad():
        n = b2.shape[0] // 6
        for k, v in enumerate((40.0, 20.0, -120.0, -30.0)):
            b2[k * n:(k + 1) * n] = v
        if x_exact:
            I = x.shape[1]
            x[:, ::3] = 0.0
            x[:, 1::3] = 1.0
            x[::2, : I // 2] = 1.0 - x[::2, : I // 2].round()
    return args


def test_gradcheck_inputs_reject_saturated_logits():
    # A seed whose first draw at this size has a decoder logit of 19.3, where
    # finite differences of log(1 - p) fail: the helper must not hand such
    # inputs to gradcheck.
    torch.manual_seed(4429908851)
    args = vae_gradcheck_inputs(VAE_ELBO, (70, 4, 3, 2), "cpu")
    logits = reference_preactivations(args)[2]
    assert logits.abs().max().item() <= 8.0


F32_CASES = [
    pytest.param(128, 784, 256, 32, id="B128-784-256-32"),
    pytest.param(37, 1000, 130, 17, id="B37-1000-130-17"),
]
UPSTREAMS = [
    pytest.param(("elbo", "recon", "kl"), id="all"),
    pytest.param(("elbo",), id="elbo"),
    pytest.param(("recon",), id="recon"),
    pytest.param(("kl",), id="kl"),
]


@pytest.mark.parametrize("B,I,H,L", F32_CASES)
@pytest.mark.parametrize("used", UPSTREAMS)
def test_float32_saturated_matches_reference_autograd(B, I, H, L, used, device):
    args = clear_of_relu_kinks(
        lambda: saturate(make_inputs(B, I, H, L, device=device, requires_grad=True)))
    p = torch.sigmoid(reference_preactivations(args)[2])
    assert (p == 1.0).any() and (p == 0.0).any() and ((p * (1 - p) < 1e-12) & (p > 0)).any()
    up = {n: torch.randn(B, device=device) for n in used}
    got = grads(fused, args, up)
    want = grads(reference_outputs, args, up)
    # x's gradient is +-inf exactly where the reference's is (p == 0 or 1 with
    # a nonzero recon upstream); no NaN appears on either side.
    assert not any(g.isnan().any() for g in got)
    assert torch.equal(got[0].isinf(), want[0].isinf())
    if "elbo" in used or "recon" in used:
        assert got[0].isinf().any()
    assert_grads_close(got, want)


def test_grads_through_module_and_batch_shape(device):
    torch.manual_seed(0)
    ref = reference.VAE(20, 16, 4).to(device)
    fm = fused_ops.nn.VAE(20, 16, 4).to(device)
    fm.load_state_dict(ref.state_dict())
    x = torch.rand(2, 5, 20, device=device)
    eps = torch.randn(2, 5, 4, device=device)
    for m in (ref, fm):
        elbo, recon, kl = m(x, eps)
        (-elbo.mean() + 0.1 * kl.sum()).backward()
    for (n, a), b in zip(fm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_compile_training_step_matches_reference(device):
    torch._dynamo.reset()
    torch.manual_seed(1)
    ref = reference.VAE(64, 48, 8).to(device)
    fm = fused_ops.nn.VAE(64, 48, 8).to(device)
    fm.load_state_dict(ref.state_dict())
    x = torch.rand(32, 64, device=device)
    x[:, :4] = 1.0
    x[:, 4:8] = 0.0
    eps = torch.randn(32, 8, device=device)

    def loss_fn(model, x, eps):
        elbo, recon, kl = model(x, eps)
        return -elbo.mean() + 0.01 * recon.sum() - 0.1 * kl.mean()

    compiled = torch.compile(lambda x, eps: loss_fn(fm, x, eps), fullgraph=True)
    opt_f = torch.optim.SGD(fm.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt_f.zero_grad()
        opt_r.zero_grad()
        lf = compiled(x, eps)
        lr = loss_fn(ref, x, eps)
        torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-5)
        lf.backward()
        lr.backward()
        for (n, a), b in zip(fm.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"grad {n}: {m}")
        opt_f.step()
        opt_r.step()
        for (n, a), b in zip(fm.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------------------
# The training pair: vae_elbo_train keeps the activations,
# vae_elbo_train_backward reads them instead of recomputing the forward
# ---------------------------------------------------------------------------

TRAIN = torch.ops.fused_ops.vae_elbo_train.default
TRAIN_BWD = torch.ops.fused_ops.vae_elbo_train_backward.default
CUDA = pytest.param("cuda", marks=requires_cuda)
# B = 2085 at 784-256-32: the CUDA train table's wgmma path (a partial last
# tile of 64 rows) and vae_elbo_backward's cuBLAS side of the route.
LARGE = (2085, 784, 256, 32)


def _route(args):
    return type(fused(*args)[0].grad_fn).__name__


def test_cpu_calls_that_need_grad_take_the_training_pair():
    args = make_inputs(5, 6, 7, 3, requires_grad=True)
    assert "vae_elbo_train" in _route(args)
    with torch.no_grad():
        assert fused(*args)[0].grad_fn is None
    plain = [a.detach() for a in args]
    assert fused(*plain)[0].grad_fn is None


@requires_cuda
def test_cuda_calls_take_the_training_pair_where_the_backward_would_use_cublas():
    # B H (6 I + 8 L) <= 1.5e9: the one-launch recomputing backward; above: the pair.
    small = make_inputs(1181, 784, 256, 32, device="cuda", requires_grad=True)
    name = _route(small)
    assert "vae_elbo" in name and "vae_elbo_train" not in name, name
    assert "vae_elbo_train" in _route(make_inputs(1182, 784, 256, 32, device="cuda", requires_grad=True))
    with torch.no_grad():
        assert fused(*make_inputs(*LARGE, device="cuda"))[0].grad_fn is None


def _pair_cases():
    cpu = [("cpu", size, dt) for size in [(130, 784, 256, 32), (1, 5, 7, 3), (67, 33, 16, 5)]
           for dt in (torch.float32, torch.float64)]
    cuda = [("cuda", LARGE, torch.float32), ("cuda", (130, 784, 256, 32), torch.float32),
            ("cuda", (67, 33, 16, 5), torch.float64)]
    return [pytest.param(d, *size, dt, id=f"{d}-{'-'.join(map(str, size))}-{str(dt)[6:]}",
                         marks=[requires_cuda] if d == "cuda" else [])
            for d, size, dt in cpu + cuda]


@pytest.mark.parametrize("device,B,I,H,L,dtype", _pair_cases())
def test_train_pair_matches_recomputing_backward(device, B, I, H, L, dtype):
    # Same losses as vae_elbo (bitwise where both run one kernel: the CPU,
    # and CUDA's wgmma at LARGE; the CUDA training op's cublas chain below it
    # against vae_elbo's cluster or general path, to rounding), and the
    # gradients of vae_elbo_backward, which recomputes what the pair saves.
    args = make_inputs(B, I, H, L, dtype=dtype, device=device)
    ups = [torch.randn(B, dtype=dtype, device=device) for _ in range(3)]
    *losses, saved = TRAIN(*args)
    assert saved.shape == (B * (2 * H + 3 * L + I),)
    same_kernel = device == "cpu" or (B, I, H, L) == LARGE
    for n, a, b in zip(OUT_NAMES, losses, torch.ops.fused_ops.vae_elbo.default(*args)):
        if same_kernel:
            assert torch.equal(a, b), n
        else:
            torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-4,
                                       msg=lambda m, n=n: f"{n}: {m}")
    got = TRAIN_BWD(*ups, *args, saved, True)
    want = BWD(*ups, *args)
    if dtype == torch.float64:
        tol = dict(rtol=1e-12, atol=1e-12)
    elif device == "cpu":
        tol = dict(rtol=1e-5, atol=1e-6)
    else:  # 3xTF32 (wgmma) or cuBLAS activations against cuBLAS's recomputed ones
        tol = dict(rtol=1e-4, atol=1e-5)
    for n, a, b in zip(ARG_NAMES, got, want):
        scale = max(b.abs().max().item(), 1.0)
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")


@requires_cuda
def test_cuda_train_paths_agree():
    # The wgmma kernel's stores and the cublas chain's buffer: each path's
    # losses bitwise those of vae_elbo's path of the same name, activations
    # to float32 rounding, each call repeated bitwise.
    from fused_ops import _paths

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path needs compute capability 9.0")
    args = make_inputs(*LARGE, device="cuda")
    runs = {}
    for path in ("wgmma", "cublas"):
        with _paths.force("vae_elbo_train", path):
            runs[path] = TRAIN(*args)
            assert _paths.last("vae_elbo_train") == path
            again = TRAIN(*args)
        for a, b in zip(runs[path], again):
            assert torch.equal(a, b), path
        with _paths.force("vae_elbo", path):
            for n, a, b in zip(OUT_NAMES, runs[path][:3], torch.ops.fused_ops.vae_elbo.default(*args)):
                assert torch.equal(a, b), (path, n)
    torch.testing.assert_close(runs["wgmma"][3], runs["cublas"][3], rtol=1e-5, atol=1e-5)


@requires_cuda
def test_a_forced_path_keeps_training_calls_on_its_op():
    # fused_ops._paths: a forced vae_elbo or vae_elbo_backward path keeps a
    # call that would take the training pair on vae_elbo and its backward.
    from fused_ops import _paths

    args = make_inputs(*LARGE, device="cuda", requires_grad=True)
    for op, path in (("vae_elbo", "tiled"), ("vae_elbo_backward", "cublas")):
        with _paths.force(op, path):
            out = fused(*args)
            name = type(out[0].grad_fn).__name__
            assert "vae_elbo" in name and "vae_elbo_train" not in name, (op, name)
            torch.autograd.grad(out[0].sum(), args[2:])
            assert _paths.last(op) == path
    assert "vae_elbo_train" in _route(args)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_train_backward_without_grad_x(device):
    # compute_grad_x=False: grad_x comes back empty, the rest bitwise as with it.
    args = make_inputs(70, 20, 16, 4, device=device)
    ups = [torch.randn(70, device=device) for _ in range(3)]
    saved = TRAIN(*args)[3]
    with_x = TRAIN_BWD(*ups, *args, saved, True)
    without_x = TRAIN_BWD(*ups, *args, saved, False)
    assert without_x[0].shape == (0,) and with_x[0].shape == (70, 20)
    for n, a, b in zip(ARG_NAMES[1:], without_x[1:], with_x[1:]):
        assert torch.equal(a, b), n
    x = args[0].clone().requires_grad_(False)
    params = [a.clone().requires_grad_() for a in args[2:]]
    elbo = fused(x, args[1], *params)[0]
    grads = torch.autograd.grad(elbo.sum(), params)
    want = BWD(torch.ones(70, device=device), None, None, *args)[2:]
    for n, a, b in zip(ARG_NAMES[2:], grads, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(b.abs().max().item(), 1.0),
                                   msg=lambda m, n=n: f"{n}: {m}")


@requires_cuda
def test_cuda_training_step_through_the_pair_matches_the_reference():
    # A module-style step at LARGE (the wgmma stores, no x gradient): the
    # parameters' gradients against the reference's autograd in float32 and
    # a float64 run (the float32 criterion of the op cases).
    args = make_inputs(*LARGE, device="cuda")
    params = [a.clone().requires_grad_() for a in args[2:]]
    elbo = fused(args[0], args[1], *params)[0]
    assert "vae_elbo_train" in type(elbo.grad_fn).__name__
    got = torch.autograd.grad(elbo.sum(), params)
    want = torch.autograd.grad(reference_outputs(args[0], args[1], *params)[0].sum(), params)
    p64 = [p.detach().double().requires_grad_() for p in params]
    exact = torch.autograd.grad(reference_outputs(args[0].double(), args[1].double(), *p64)[0].sum(), p64)
    for n, g, w, e in zip(ARG_NAMES[2:], got, want, exact):
        err, err_ref = (g.double() - e).abs().max().item(), (w.double() - e).abs().max().item()
        assert err <= 4 * err_ref + 1e-6 * max(e.abs().max().item(), 1.0), (n, err, err_ref)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_train_backward_rejects_a_wrong_saved_buffer(device):
    args = make_inputs(4, 6, 5, 3, device=device)
    saved = TRAIN(*args)[3]
    with pytest.raises(RuntimeError, match=r"saved must hold .* = 100 elements"):
        TRAIN_BWD(torch.ones(4, device=device), None, None, *args, saved[:-1], True)
    with pytest.raises(RuntimeError, match="saved must have the same dtype"):
        TRAIN_BWD(torch.ones(4, device=device), None, None, *args, saved.double(), True)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("compute_grad_x", [True, False])
def test_opcheck_train_pair(device, compute_grad_x):
    args = make_inputs(6, 5, 7, 3, dtype=torch.float64, device=device, requires_grad=True)
    result = torch.library.opcheck(TRAIN, tuple(args))
    assert all(v == "SUCCESS" for v in result.values()), result
    plain = [a.detach() for a in args]
    saved = TRAIN(*plain)[3]
    g = torch.randn(6, dtype=torch.float64, device=device)
    result = torch.library.opcheck(TRAIN_BWD, (g, None, g, *plain, saved, compute_grad_x))
    assert all(v == "SUCCESS" for v in result.values()), result


# ---------------------------------------------------------------------------
# NaN through the backward, and invalid targets on CUDA
# ---------------------------------------------------------------------------


class _BCE(torch.autograd.Function):
    """binary_cross_entropy(p, x, reduction="none") without its range check
    (which refuses NaN p on the CPU and asserts on the device), with its
    backward formula, so NaN flows as in the reference's autograd."""

    @staticmethod
    def forward(ctx, p, x):
        ctx.save_for_backward(p, x)
        return -(x * torch.log(p).clamp_min(-100) + (1 - x) * torch.log1p(-p).clamp_min(-100))

    @staticmethod
    def backward(ctx, g):
        p, x = ctx.saved_tensors
        gp = g * (p - x) / ((1 - p) * p).clamp_min(1e-12)
        gx = g * (torch.log1p(-p).clamp_min(-100) - torch.log(p).clamp_min(-100))
        return gp, gx


def _nan_honest_reference_grads(args):
    """float64 gradients of sum(elbo) by autograd of the reference formula."""
    a = [t.detach().double().requires_grad_(True) for t in args]
    x, eps, w_enc, b_enc, w_mu, b_mu, w_lv, b_lv, w_d1, b_d1, w_d2, b_d2 = a
    h = torch.relu(x @ w_enc.T + b_enc)
    mu, logvar = h @ w_mu.T + b_mu, h @ w_lv.T + b_lv
    z = mu + torch.exp(0.5 * logvar) * eps
    p = torch.sigmoid(torch.relu(z @ w_d1.T + b_d1) @ w_d2.T + b_d2)
    recon = _BCE.apply(p, x).sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
    (-(recon + kl)).sum().backward()
    return [t.grad for t in a]


def _fused_grads(args):
    a = [t.detach().clone().requires_grad_(True) for t in args]
    fused(*a)[0].sum().backward()
    return [t.grad for t in a]


def _rows_clear_of_relu_kinks(args, margin=1e-4, tries=20):
    """``args`` with the rows of x and eps whose ReLU pre-activations lie
    within ``margin`` of 0 redrawn (the weights kept) until none does.

    Near a kink the float32 kernel and the float64 reference may fall on
    either side, and that row's gradients (and the weights' sums over rows)
    then differ by O(1).  At B=2048 a draw always has such units
    (clear_of_relu_kinks would redraw forever), so only their rows are
    redrawn."""
    x, eps, *weights = args
    for _ in range(tries):
        pre_enc, pre_dec, _ = reference_preactivations([x, eps, *weights])
        near = (pre_enc.abs() <= margin).any(-1) | (pre_dec.abs() <= margin).any(-1)
        if not near.any():
            return [x, eps, *weights]
        fresh_x, fresh_eps = torch.rand_like(x), torch.randn_like(eps)
        x, eps = torch.where(near[:, None], fresh_x, x), torch.where(near[:, None], fresh_eps, eps)
    raise AssertionError(f"rows still within {margin} of a ReLU kink after {tries} redraws")


NAN_SITES = [("eps", (2, 0)), ("b_dec1", (0,)), ("w_enc", (1, 3)), ("w_dec2", (5, 2)), ("b_logvar", (1,)),
             ("x", (1, 3))]


@pytest.mark.parametrize("site,index", NAN_SITES, ids=[s for s, _ in NAN_SITES])
@pytest.mark.parametrize("B,I,H,L", [(9, 12, 16, 3), (2048, 64, 256, 8)], ids=["small", "B2048"])
def test_nan_input_gives_nan_gradients_like_autograd(B, I, H, L, site, index, device):
    # PyTorch's ReLU backward passes the gradient where the activation is NaN
    # (threshold_backward zeroes it only where the activation is <= 0): every
    # gradient that depends on the NaN is NaN, and the rest stays finite and
    # equal to the reference's.  A NaN target is not a probability: the CPU
    # raises for it (test_vae_elbo.py), so it is checked on CUDA only.
    if site == "x" and torch.device(device).type == "cpu":
        pytest.skip("the CPU kernel refuses a NaN target")
    args = _rows_clear_of_relu_kinks(make_inputs(B, I, H, L, device=device))
    i = ARG_NAMES.index(site)
    args[i] = args[i].detach().clone()
    args[i][index] = float("nan")
    got, want = _fused_grads(args), _nan_honest_reference_grads(args)
    for name, g, w in zip(ARG_NAMES, got, want):
        assert torch.isnan(w).any() or name == "x", f"test set-up: no NaN reaches grad {name}"
        assert torch.equal(torch.isnan(g), torch.isnan(w)), (
            f"grad {name}: {int((torch.isnan(g) != torch.isnan(w)).sum())} elements NaN in one and not the other")
        keep = ~torch.isnan(w)
        torch.testing.assert_close(g[keep], w[keep].to(g.dtype), rtol=2e-3, atol=2e-3)
