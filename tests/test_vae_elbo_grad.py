"""Tests of the backward of fused_ops.vae_elbo (the custom op
fused_ops::vae_elbo_backward, wired with torch.library.register_autograd)
against the reference module's autograd (issue 5).

CUDA variants are parametrised with DEVICE_PARAMS and are skipped without a GPU.
"""

import pytest
import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import DEVICE_PARAMS, requires_cuda  # noqa: F401

from test_vae_elbo import ARG_NAMES, make_inputs, ref_module

BWD = torch.ops.fused_ops.vae_elbo_backward.default
OUT_NAMES = ("elbo", "recon", "kl")


def fused(*args):
    return fused_ops.vae_elbo(*args)


def reference_outputs(*args):
    """(elbo, recon, kl) of the reference module holding the weights of
    ``args``, as a differentiable function of ``args`` (functional_call)."""
    x, eps, *params = args
    m = ref_module([a.detach() for a in args])
    names = [n for n, _ in m.named_parameters()]
    return torch.func.functional_call(m, dict(zip(names, params)), (x, eps))


def grads(fn, args, upstream):
    """Gradients of fn(*args) for every input with the given upstream
    gradients (a dict output name -> tensor; missing outputs are not used)."""
    outs = dict(zip(OUT_NAMES, fn(*args)))
    names = [n for n in OUT_NAMES if n in upstream]
    return torch.autograd.grad([outs[n] for n in names], args, [upstream[n] for n in names],
                               allow_unused=True, materialize_grads=True)


def assert_grads_close(got, want, rtol=1e-4, atol_scale=1e-5):
    """Per-input comparison, atol relative to the largest finite reference
    gradient of that input (weight gradients are sums over the batch)."""
    for name, g, w in zip(ARG_NAMES, got, want):
        finite = w[torch.isfinite(w)]
        scale = finite.abs().max().item() if finite.numel() else 1.0
        torch.testing.assert_close(
            g, w, rtol=rtol, atol=atol_scale * max(scale, 1e-3),
            msg=lambda m, n=name: f"grad {n}: {m}",
        )


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


# ---------------------------------------------------------------------------
# gradcheck (float64)
# ---------------------------------------------------------------------------


def gradcheck_inputs(B, I, H, L, device, max_logit=8.0, margin=1e-4, tries=100):
    """float64 inputs on which finite differences are accurate: every decoder
    logit within +-max_logit and every ReLU input at least `margin` from 0.

    BCE is computed from p = sigmoid(logit), so near saturation 1 - p keeps
    few significant bits: at logit 19 (1 - p = 4e-9) a step of 1e-6 moves p
    by ~40 ulps of 1.0 and the finite difference of log1p(-p) is off by
    ~1e-2, far beyond gradcheck's atol (one draw in a few hundred at these
    sizes; the fused gradient then still equals the reference's autograd to
    1e-14, and gradcheck fails on the reference as well).  A ReLU input
    within the step of 0 crosses the kink."""
    for _ in range(tries):
        args = make_inputs(B, I, H, L, dtype=torch.float64, device=device)
        pre_enc, pre_dec, logits = reference_preactivations(args)
        if (logits.abs().max().item() <= max_logit
                and min(pre_enc.abs().min().item(), pre_dec.abs().min().item()) >= margin):
            return [t.requires_grad_() for t in args]
    raise AssertionError(f"no draw in {tries} kept the logits within {max_logit} and ReLU inputs off 0")


def test_gradcheck_all_outputs(device):
    args = gradcheck_inputs(3, 5, 7, 3, device)
    assert torch.autograd.gradcheck(fused, args, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("out", [0, 1, 2], ids=OUT_NAMES)
def test_gradcheck_single_output(out, device):
    args = gradcheck_inputs(3, 5, 7, 3, device)
    assert torch.autograd.gradcheck(lambda *a: fused(*a)[out], args, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_odd_sizes(device):
    # Several CPU row blocks (64 rows each) and a partial one.
    args = gradcheck_inputs(70, 4, 3, 2, device)
    assert torch.autograd.gradcheck(fused, args, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_gradcheck_inputs_reject_saturated_logits():
    # The draw that made test_gradcheck_odd_sizes fail (a logit of 19.3): the
    # helper must not hand such inputs to gradcheck.
    torch.manual_seed(4429908851)
    args = gradcheck_inputs(70, 4, 3, 2, "cpu")
    logits = reference_preactivations(args)[2]
    assert logits.abs().max().item() <= 8.0


# On CUDA the first two take the persistent one-launch path (the second with
# several tiles per block in most phases), the third the cuBLAS path
# (csrc/cuda/vae_elbo_backward.cu chooses by the number of multiply-adds).
@pytest.mark.parametrize("B,I,H,L", [(37, 50, 13, 4), (1000, 784, 256, 32), (2048, 784, 256, 32)],
                         ids=["B37", "B1000-persistent", "B2048-cublas"])
def test_float64_matches_reference_autograd(B, I, H, L, device):
    args = make_inputs(B, I, H, L, dtype=torch.float64, device=device, requires_grad=True)
    up = {n: torch.randn(B, dtype=torch.float64, device=device) for n in OUT_NAMES}
    assert_grads_close(grads(fused, args, up), grads(reference_outputs, args, up), rtol=1e-10,
                       atol_scale=1e-12)


# ---------------------------------------------------------------------------
# float32 against the reference's autograd
# ---------------------------------------------------------------------------

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


def clear_of_relu_kinks(make, margin=2e-5, tries=100):
    """Inputs from make() whose ReLU pre-activations (encoder and decoder
    hidden layer) all lie at least `margin` from 0 in the float32 reference.

    Near a kink, float32 rounding decides which side a pre-activation falls
    on, and the two sides' gradients differ by O(1) for that unit and row: no
    two summation orders can be compared there.  At 128 x 256 units a random
    draw has one within 1e-6 of 0 about 6% of the time (measured), so the
    float32 comparisons redraw until every unit is clear (~3 draws)."""
    for _ in range(tries):
        args = make()
        pre_enc, pre_dec, _ = reference_preactivations(args)
        if min(pre_enc.abs().min().item(), pre_dec.abs().min().item()) > margin:
            return args
    raise AssertionError(f"no draw in {tries} kept every ReLU input {margin} away from 0")


@pytest.mark.parametrize("B,I,H,L", F32_CASES)
@pytest.mark.parametrize("used", UPSTREAMS)
def test_float32_matches_reference_autograd(B, I, H, L, used, device):
    args = clear_of_relu_kinks(lambda: make_inputs(B, I, H, L, device=device, requires_grad=True))
    up = {n: torch.randn(B, device=device) for n in used}
    assert_grads_close(grads(fused, args, up), grads(reference_outputs, args, up))


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


def reference_outputs_z(args):
    x, eps, we, be, wm, bm, wl, bl = args[:8]
    h = torch.relu(torch.nn.functional.linear(x, we, be))
    return torch.nn.functional.linear(h, wm, bm) + torch.exp(0.5 * torch.nn.functional.linear(h, wl, bl)) * eps


def reference_preactivations(args):
    """(encoder ReLU input, decoder hidden ReLU input, decoder logits) of the
    reference at ``args``, without autograd."""
    with torch.no_grad():
        pre_enc = torch.nn.functional.linear(args[0], args[2], args[3])
        pre_dec = torch.nn.functional.linear(reference_outputs_z(args), args[8], args[9])
        logits = torch.nn.functional.linear(torch.relu(pre_dec), args[10], args[11])
    return pre_enc, pre_dec, logits


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


def test_deterministic(device):
    args = make_inputs(300, 100, 40, 8, device=device)
    up = [torch.randn(300, device=device) for _ in range(3)]
    a = BWD(*up, *args)
    b = BWD(*up, *args)
    for n, u, v in zip(ARG_NAMES, a, b):
        assert torch.equal(u, v), n


def test_backward_op_none_means_zero(device):
    args = make_inputs(9, 6, 5, 3, dtype=torch.float64, device=device)
    g = torch.randn(9, dtype=torch.float64, device=device)
    z = torch.zeros_like(g)
    for k in range(3):
        ups = [None, None, None]
        ups[k] = g
        full = [z, z, z]
        full[k] = g
        for n, a, b in zip(ARG_NAMES, BWD(*ups, *args), BWD(*full, *args)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    for n, a in zip(ARG_NAMES, BWD(None, None, None, *args)):
        assert torch.equal(a, torch.zeros_like(a)), n


def test_empty_batch(device):
    args = make_inputs(0, 6, 5, 3, device=device)
    out = BWD(torch.empty(0, device=device), None, None, *args)
    for n, a, t in zip(ARG_NAMES, out, args):
        assert a.shape == t.shape, n
        assert torch.equal(a, torch.zeros_like(a)), n


def test_backward_op_argument_errors(device):
    args = make_inputs(4, 6, 5, 3, device=device)
    with pytest.raises(RuntimeError, match=r"grad_recon.shape\[0\] must be 4"):
        BWD(None, torch.ones(5, device=device), None, *args)
    with pytest.raises(RuntimeError, match="grad_kl must have the same dtype"):
        BWD(None, None, torch.ones(4, dtype=torch.float64, device=device), *args)
    with pytest.raises(RuntimeError, match="grad_elbo must be a 1-D tensor"):
        BWD(torch.ones(4, 1, device=device), None, None, *args)


# ---------------------------------------------------------------------------
# opcheck, double backward, torch.compile training step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_opcheck_backward_op(dtype, device):
    args = make_inputs(6, 5, 7, 3, dtype=dtype, device=device)
    g = [torch.randn(6, dtype=dtype, device=device) for _ in range(3)]
    for ups in ((g[0], g[1], g[2]), (None, g[1], None), (g[0], None, None)):
        result = torch.library.opcheck(BWD, (*ups, *args))
        assert all(v == "SUCCESS" for v in result.values()), result


def test_opcheck_forward_requires_grad(device):
    args = make_inputs(6, 5, 7, 3, dtype=torch.float64, device=device, requires_grad=True)
    result = torch.library.opcheck(torch.ops.fused_ops.vae_elbo.default, tuple(args))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_double_backward_raises(device):
    args = make_inputs(4, 6, 5, 3, dtype=torch.float64, device=device, requires_grad=True)
    elbo, recon, kl = fused(*args)
    g = torch.autograd.grad(elbo.sum(), args, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(sum(t.sum() for t in g), args, allow_unused=True)


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
# The CPU training pair: vae_elbo_train keeps the activations,
# vae_elbo_train_backward reads them instead of recomputing the forward
# ---------------------------------------------------------------------------

TRAIN = torch.ops.fused_ops.vae_elbo_train.default
TRAIN_BWD = torch.ops.fused_ops.vae_elbo_train_backward.default


def test_cpu_calls_that_need_grad_take_the_training_pair():
    args = make_inputs(5, 6, 7, 3, requires_grad=True)
    assert "vae_elbo_train" in type(fused(*args)[0].grad_fn).__name__
    with torch.no_grad():
        assert fused(*args)[0].grad_fn is None
    plain = [a.detach() for a in args]
    assert fused(*plain)[0].grad_fn is None


@requires_cuda
def test_cuda_calls_keep_the_recomputing_backward():
    args = make_inputs(5, 6, 7, 3, device="cuda", requires_grad=True)
    name = type(fused(*args)[0].grad_fn).__name__
    assert "vae_elbo" in name and "vae_elbo_train" not in name, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("B,I,H,L", [(130, 784, 256, 32), (1, 5, 7, 3), (67, 33, 16, 5)])
def test_train_pair_matches_recomputing_backward(B, I, H, L, dtype):
    # Same losses as vae_elbo (bitwise: the same kernel), and the same
    # gradients as vae_elbo_backward, which recomputes what the pair saves.
    args = make_inputs(B, I, H, L, dtype=dtype)
    ups = [torch.randn(B, dtype=dtype) for _ in range(3)]
    *losses, saved = TRAIN(*args)
    assert saved.shape == (B * (2 * H + 3 * L + I),)
    for n, a, b in zip(OUT_NAMES, losses, torch.ops.fused_ops.vae_elbo.default(*args)):
        assert torch.equal(a, b), n
    got = TRAIN_BWD(*ups, *args, saved, True)
    want = BWD(*ups, *args)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for n, a, b in zip(ARG_NAMES, got, want):
        scale = max(b.abs().max().item(), 1.0)
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_train_backward_without_grad_x():
    # compute_grad_x=False: grad_x comes back empty, the rest bitwise as with it.
    args = make_inputs(70, 20, 16, 4)
    ups = [torch.randn(70) for _ in range(3)]
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
    want = BWD(torch.ones(70), None, None, *args)[2:]
    for n, a, b in zip(ARG_NAMES[2:], grads, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(b.abs().max().item(), 1.0),
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_train_backward_rejects_a_wrong_saved_buffer():
    args = make_inputs(4, 6, 5, 3)
    saved = TRAIN(*args)[3]
    with pytest.raises(RuntimeError, match=r"saved must hold .* = 100 elements"):
        TRAIN_BWD(torch.ones(4), None, None, *args, saved[:-1], True)
    with pytest.raises(RuntimeError, match="saved must have the same dtype"):
        TRAIN_BWD(torch.ones(4), None, None, *args, saved.double(), True)


@pytest.mark.parametrize("compute_grad_x", [True, False])
def test_opcheck_train_pair(compute_grad_x):
    args = make_inputs(6, 5, 7, 3, dtype=torch.float64, requires_grad=True)
    result = torch.library.opcheck(TRAIN, tuple(args))
    assert all(v == "SUCCESS" for v in result.values()), result
    plain = [a.detach() for a in args]
    saved = TRAIN(*plain)[3]
    g = torch.randn(6, dtype=torch.float64)
    result = torch.library.opcheck(TRAIN_BWD, (g, None, g, *plain, saved, compute_grad_x))
    assert all(v == "SUCCESS" for v in result.values()), result
