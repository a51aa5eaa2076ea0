"""Tests of the fused backward of flow_euler (torch.ops.fused_ops.flow_euler_backward,
wired as flow_euler's autograd formula): gradcheck, float32 gradients against
the reference's autograd, opcheck, double-backward error, and a compiled
training step of fused_ops.nn.FlowODE against the reference module's step.

The backward has two modes on both devices (csrc/flow_euler_backward.h):
"resident" (num_steps * B <= 512 and the activations of all steps fit 4 Mi
elements: kept from the trajectory pass, weight gradients as one product over
all steps) and "streaming" (per-step recompute and weight-gradient products).
The sizes below reach both, and on CUDA one column-sum chunk (B <= 256) and
several (B = 300, 4096: ragged last chunk, 16 chunks), column tiles not
multiples of 32 (D, H = 1, 3, 5, 20, 37, 100, 130), float32 and float64, and
B = 0.  Resident: (8, 64, 256, 32), (1, 1, 3, 1), (33, 5, 20, 7), (64, 3, 11, 8),
gradcheck sizes; streaming: (129, 100, 130, 7), (300, 3, 37, 5), (4096, 64,
256, 3), (65, 3, 11, 8), (8, 4, 2100, 30).
"""

import pytest
import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import requires_cuda, sync

FWD = torch.ops.fused_ops.flow_euler.default
BWD = torch.ops.fused_ops.flow_euler_backward.default
NAMES = ("x0", "w1", "b1", "w2", "b2", "w3", "b3")
F32_ULP = 2.0**-23


def make_args(B, D, H, dtype=torch.float32, device="cpu", requires_grad=True):
    """``(x0, w1, b1, w2, b2, w3, b3)`` drawn like nn.Linear's initialisation on
    the CPU (so a seed gives the same values on every device), then moved."""

    def linear(out_f, in_f):
        bound = 1.0 / in_f**0.5
        return (torch.rand(out_f, in_f, dtype=dtype) * 2 - 1) * bound, (torch.rand(out_f, dtype=dtype) * 2 - 1) * bound

    x0 = torch.randn(B, D, dtype=dtype)
    w1, b1 = linear(H, D + 1)
    w2, b2 = linear(H, H)
    w3, b3 = linear(D, H)
    args = [t.to(device) for t in (x0, w1, b1, w2, b2, w3, b3)]
    return [t.requires_grad_(requires_grad) for t in args]


def grads(fn, args, steps, upstream):
    return torch.autograd.grad(fn(*args, steps), args, upstream)


def case(B, D, H, steps, **kw):
    return pytest.param(B, D, H, steps, id=f"B{B}-D{D}-H{H}-S{steps}", **kw)


# ---------------------------------------------------------------------------
# gradcheck (float64)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 3])
def test_gradcheck_every_input(steps, device):
    args = make_args(3, 2, 5, dtype=torch.float64, device=device)
    assert torch.autograd.gradcheck(lambda *a: FWD(*a, steps), args, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("which", range(7), ids=NAMES)
def test_gradcheck_each_input_alone(which, device):
    # Only one input requires grad: the others enter as constants.
    args = make_args(4, 3, 6, dtype=torch.float64, device=device, requires_grad=False)
    args[which].requires_grad_()

    def f(t):
        a = list(args)
        a[which] = t
        return FWD(*a, 2)

    assert torch.autograd.gradcheck(f, (args[which],), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_float64_matches_reference_autograd(device):
    args = make_args(37, 6, 30, dtype=torch.float64, device=device)
    c = torch.randn(37, 6, dtype=torch.float64, device=device)
    for name, a, b in zip(NAMES, grads(FWD, args, 9, c), grads(reference.flow_euler, args, 9, c)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize(
    "B,D,H,steps",
    [
        case(64, 3, 11, 8),  # 512 stacked rows: resident, the largest
        case(65, 3, 11, 8),  # 520 rows: streaming
        case(8, 4, 2100, 30),  # 240 rows but 6 n B H > 4 Mi elements: streaming
    ],
)
def test_resident_and_streaming_modes_float64(B, D, H, steps, device):
    args = make_args(B, D, H, dtype=torch.float64, device=device)
    c = torch.randn(B, D, dtype=torch.float64, device=device)
    for name, a, b in zip(NAMES, grads(FWD, args, steps, c), grads(reference.flow_euler, args, steps, c)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")


# ---------------------------------------------------------------------------
# float32 gradients vs the reference's autograd
# ---------------------------------------------------------------------------

F32_CASES = [
    case(8, 64, 256, 32),  # the default size
    case(1, 1, 3, 1),
    case(33, 5, 20, 7),
    case(129, 100, 130, 7),
    case(300, 3, 37, 5),  # CUDA: two column-sum chunks, the last ragged
    case(4096, 64, 256, 3),  # the large-batch default (CUDA: 16 chunks); few steps to keep CPU time low
]


@pytest.mark.parametrize("B,D,H,steps", F32_CASES)
def test_float32_grads_match_reference(B, D, H, steps, device):
    args = make_args(B, D, H, device=device)
    c = torch.randn(B, D, device=device)
    got = grads(FWD, args, steps, c)
    want = grads(reference.flow_euler, args, steps, c)
    args64 = [a.detach().double().requires_grad_() for a in args]
    exact = grads(reference.flow_euler, args64, steps, c.double())
    for name, g, w, e in zip(NAMES, got, want, exact):
        assert g.shape == w.shape and g.dtype == torch.float32 and g.device == w.device
        # The float32 contract against the float32 reference ...
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad {n}: {m}")
        # ... and no further from the float64 gradient than the float32
        # reference (2x), with a floor of 8 float32 ulps of the largest entry.
        fused_err = (g.double() - e).abs().max().item()
        eager_err = (w.double() - e).abs().max().item()
        floor = 8 * F32_ULP * e.abs().max().item()
        assert fused_err <= max(2 * eager_err, floor), (name, fused_err, eager_err, floor)


def test_grad_with_expanded_upstream_gradient(device):
    # out.sum() hands the backward a stride-0 expanded grad_x.
    args = make_args(5, 4, 9, device=device)
    got = torch.autograd.grad(FWD(*args, 3).sum(), args)
    want = torch.autograd.grad(reference.flow_euler(*args, 3).sum(), args)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


def test_backward_op_direct_and_layouts(device):
    args = make_args(7, 5, 11, dtype=torch.float64, device=device, requires_grad=False)
    g = torch.randn(5, 7, dtype=torch.float64, device=device).t()  # non-contiguous grad_x
    out = BWD(g, *args, 4)
    assert len(out) == 7
    for o, a in zip(out, args):
        assert o.shape == a.shape and o.dtype == a.dtype and o.device == a.device and o.is_contiguous()
    leaves = [a.clone().requires_grad_() for a in args]
    want = torch.autograd.grad(reference.flow_euler(*leaves, 4), leaves, g)
    for name, a, b in zip(NAMES, out, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")
    # Non-contiguous inputs give bitwise the same result.
    odd = [a.t().contiguous().t() if a.dim() == 2 else a for a in args]
    for a, b in zip(BWD(g.contiguous(), *odd, 4), out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("B,D,H,steps", [case(8, 64, 256, 8), case(300, 3, 37, 3)])
def test_backward_deterministic(B, D, H, steps, device):
    args = make_args(B, D, H, device=device, requires_grad=False)
    g = torch.randn(B, D, device=device)
    first = BWD(g, *args, steps)
    for _ in range(2):
        for a, b in zip(BWD(g, *args, steps), first):
            assert torch.equal(a, b)


def test_backward_empty_batch(device):
    args = make_args(0, 3, 7, device=device, requires_grad=False)
    out = BWD(torch.empty(0, 3, device=device), *args, 2)
    assert out[0].shape == (0, 3)
    for o, a in zip(out[1:], args[1:]):
        assert o.shape == a.shape and torch.equal(o, torch.zeros_like(a))


def test_backward_bad_grad_shape():
    args = make_args(4, 3, 7, requires_grad=False)
    with pytest.raises(RuntimeError, match="grad_x must have the shape of x0"):
        BWD(torch.zeros(4, 2), *args, 2)
    with pytest.raises(RuntimeError, match="grad_x must have the same dtype as x0"):
        BWD(torch.zeros(4, 3, dtype=torch.float64), *args, 2)
    with pytest.raises(RuntimeError, match="num_steps must be at least 1"):
        BWD(torch.zeros(4, 3), *args, 0)


@requires_cuda
def test_backward_device_mix():
    args = make_args(4, 3, 7, device="cuda", requires_grad=False)
    with pytest.raises(RuntimeError, match="grad_x must be on the same device as x0"):
        BWD(torch.zeros(4, 3), *args, 2)


# ---------------------------------------------------------------------------
# opcheck, double backward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("B,D,H,steps", [case(1, 1, 3, 1), case(5, 3, 10, 3)])
def test_opcheck_backward_op(B, D, H, steps, dtype, device):
    args = make_args(B, D, H, dtype=dtype, device=device, requires_grad=False)
    g = torch.randn(B, D, dtype=dtype, device=device)
    result = torch.library.opcheck(BWD, (g, *args, steps))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_opcheck_forward_requires_grad_float32(device):
    # (test_flow_euler.py runs the float64 requires_grad opcheck.)
    args = make_args(5, 3, 10, device=device)
    result = torch.library.opcheck(FWD, (*args, 3))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_double_backward_is_a_clear_error(device):
    args = make_args(3, 2, 5, dtype=torch.float64, device=device)
    (gx,) = torch.autograd.grad(FWD(*args, 2).square().sum(), args[:1], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        gx.square().sum().backward()


def test_backward_op_under_no_grad_needs_nothing(device):
    # First-order gradients with create_graph=False do not build a graph.
    args = make_args(3, 2, 5, device=device)
    (gx,) = torch.autograd.grad(FWD(*args, 2).sum(), args[:1])
    assert gx.grad_fn is None and not gx.requires_grad


# ---------------------------------------------------------------------------
# A compiled training step of the fused module vs the reference module's step
# ---------------------------------------------------------------------------


def _flow_pair(device, dim=6, steps=4):
    ref_module = reference.FlowODE(dim, steps).to(device)
    fused = fused_ops.nn.FlowODE(dim, steps).to(device)
    fused.load_state_dict(ref_module.state_dict())
    return ref_module, fused


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _assert_same_params(fused, ref_module, what, attr=None, rtol=1e-4, atol=1e-5):
    for (name, p), q in zip(fused.named_parameters(), ref_module.parameters()):
        a, b = (p, q) if attr is None else (getattr(p, attr), getattr(q, attr))
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_compiled_training_step_matches_reference(optimizer, device):
    # Forward + loss compiled with fullgraph=True (the fused op and, in the
    # compiled backward graph, the fused backward op), backward, and a compiled
    # optimizer step (torch's optimizers break the graph on purpose before
    # step(), so that part cannot be fullgraph); against the reference
    # module's eager step.
    torch._dynamo.reset()
    ref_module, fused = _flow_pair(device)
    x0 = torch.randn(16, 6, device=device)
    target = torch.randn(16, 6, device=device)

    def make_opt(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-2, eps=1e-3)

    opt_ref, opt_fused = make_opt(ref_module.parameters()), make_opt(fused.parameters())
    compiled_loss = torch.compile(_loss, fullgraph=True)  # raises on a graph break
    compiled_opt_step = torch.compile(opt_fused.step)

    for it in range(3):
        opt_ref.zero_grad(set_to_none=True)
        loss_ref = _loss(ref_module, x0, target)
        loss_ref.backward()
        opt_ref.step()

        opt_fused.zero_grad(set_to_none=True)
        loss = compiled_loss(fused, x0, target)
        loss.backward()
        _assert_same_params(fused, ref_module, f"step {it} grad", attr="grad", atol=1e-6)
        compiled_opt_step()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    sync(device)
    _assert_same_params(fused, ref_module, "param")


def test_compiled_training_step_one_graph(device):
    # The whole step (forward, loss.backward(), SGD update) in ONE fullgraph
    # compile: needs Dynamo's trace_autograd_ops (newer torch releases).
    if "trace_autograd_ops" not in torch._dynamo.config.get_config_copy():
        pytest.skip("this torch's Dynamo cannot trace Tensor.backward() (no trace_autograd_ops)")
    torch._dynamo.reset()
    ref_module, fused = _flow_pair(device)
    x0 = torch.randn(16, 6, device=device)
    target = torch.randn(16, 6, device=device)
    opt_ref = torch.optim.SGD(ref_module.parameters(), lr=0.05)
    lr = 0.05

    @torch.compile(fullgraph=True)
    def train_step(x, y):
        loss = _loss(fused, x, y)
        loss.backward()
        with torch.no_grad():
            for p in fused.parameters():
                p.sub_(lr * p.grad)
                p.grad = None
        return loss.detach()

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for _ in range(3):
            opt_ref.zero_grad(set_to_none=True)
            loss_ref = _loss(ref_module, x0, target)
            loss_ref.backward()
            opt_ref.step()
            loss = train_step(x0, target)
            torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-6)
    sync(device)
    _assert_same_params(fused, ref_module, "param")
