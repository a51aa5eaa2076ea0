"""Mixed precision, over the op table: the autocast rule of every forward op
(float32 under ``torch.autocast``, ``torch.ops`` and the Python functions),
each module fed by an autocast ``nn.Linear``, a training step with a
GradScaler, and bfloat16/float16 inputs of the Python functions (computed
in float32, returned in the inputs' dtype), whose error against float64 is
bounded by the plain PyTorch program's own error in that dtype (2x).

See fused_ops/ops/_dtypes.py for the rules.  CUDA variants skip without a GPU.
"""


import pytest
import torch

from contract_helpers import assert_equal, each_op, params
from fused_ops.ops import _dtypes
from fused_test_utils import check_error_names, check_low_precision, sync
from op_cases import CASES, SMALL_SIZES, as_tuple

LOW = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "f16"]


def _small(case, device, dtype=torch.float32, requires_grad=False):
    size = SMALL_SIZES[case.name]
    return size, case.inputs(size, dtype=dtype, device=device, requires_grad=requires_grad)


def _float32(args):
    return [a.detach().float() if a.dtype in LOW else a.detach() for a in args]


def _each_module(differentiable=False):
    """One param per op with a module (and gradients, if ``differentiable``)."""
    return params(lambda c: [("",)] if c.module and (c.differentiable or not differentiable) else [])


def _each_op_with_float_args(count):
    """One param per op with at least ``count`` arguments in the inputs' dtype."""
    return params(lambda c: [("",)] if len(c.float_args or c.arg_names) >= count else [])


def test_every_forward_op_has_an_autocast_rule():
    # Every op of the namespace but the backward ops, new ones included;
    # and every op of the table among them.
    names = _dtypes.forward_op_names()
    assert {f"fused_ops::{c.name}" for c in CASES.values()} <= set(names)
    for name in names:
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("entry", ["torch.ops", "wrapper"])
@pytest.mark.parametrize("case", each_op())
def test_autocast_runs_in_float32(case, entry, dtype, device):
    # Under autocast, lower-precision inputs (here the first one, as an
    # autocast layer would give it) are cast to float32; the result is the
    # float32 op's on the rounded values, bitwise, and float32.
    size, args = _small(case, device)
    args[0] = args[0].to(dtype)
    fn = case.packet if entry == "torch.ops" else case.fn
    with torch.autocast(torch.device(device).type, dtype=dtype):
        got = case.call(fn, args, size)
    assert_equal(case.out_names, got, case.call(case.fn, _float32(args), size))


@pytest.mark.parametrize("case", each_op())
def test_autocast_under_compile(case, device):
    # A graph traced under autocast records the float32 computation.
    torch._dynamo.reset()
    size, args = _small(case, device)
    args[0] = args[0].bfloat16()
    compiled = torch.compile(lambda *a: case.call(case.fn, a, size), fullgraph=True)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        got = compiled(*args)
    assert_equal(case.out_names, got, case.call(case.fn, _float32(args), size))


@pytest.mark.parametrize("case", each_op())
def test_autocast_leaves_float64_alone(case, device):
    size, args = _small(case, device, dtype=torch.float64)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        got = case.call(case.packet, args, size)
    want = case.out_dtypes(torch.float64) if case.out_dtypes is not None else [torch.float64] * len(got)
    assert [o.dtype for o in got] == want


def _identity_linear(n, device):
    lin = torch.nn.Linear(n, n, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(n))
        lin.bias.zero_()
    return lin


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("case", _each_module())
def test_module_fed_by_autocast_linear(case, dtype, device):
    # An identity nn.Linear under autocast hands the module its input in
    # `dtype`; the module (float32 parameters) computes in float32: what it
    # computes outside autocast from the rounded input, bitwise.
    module, _, inputs = case.module(device)
    x, *rest = inputs
    lin = _identity_linear(x.shape[-1], device)
    with torch.autocast(torch.device(device).type, dtype=dtype):
        fed = lin(x)
        assert fed.dtype == dtype
        torch.manual_seed(0)  # the VAE draws eps
        got = as_tuple(module(fed, *rest))
    torch.manual_seed(0)
    want = as_tuple(module(fed.float(), *rest))
    assert_equal(case.out_names, got, want)


@pytest.mark.parametrize("case", _each_module(differentiable=True))
def test_training_step_with_grad_scaler(case, device):
    # linear -> fused module -> loss under autocast, scaled backward,
    # unscale, step.  The gradients of the module's parameters and of its
    # (autocast) input are those of the same loss without autocast on the
    # rounded input (the scale is a power of two), every gradient is finite,
    # and the step moves every parameter.
    dev = torch.device(device).type
    dtype = torch.bfloat16 if dev == "cpu" else torch.float16
    module, _, inputs = case.module(device)
    x, *rest = inputs
    lin = _identity_linear(x.shape[-1], device)
    params_ = list(lin.parameters()) + list(module.parameters())
    opt = torch.optim.SGD(params_, lr=1e-2)
    # A small initial scale: float16 gradients of the input times 2**16 would
    # overflow.  Where even this one overflows (the SNIS ops' gradients grow
    # with N), the step is skipped and the scale halved, as in a training
    # loop, until a backward pass is finite.
    scaler = torch.amp.GradScaler(dev, init_scale=2.0**7)

    def loss_of(outs):  # weighted: the VAE's elbo + recon + kl is zero
        return sum((i + 1) * o.float().sum() for i, o in enumerate(outs))

    for _ in range(16):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=dtype):
            fed = lin(x)
            fed.retain_grad()
            torch.manual_seed(0)
            loss = loss_of(as_tuple(module(fed, *rest)))
        assert loss.dtype == torch.float32
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if all(torch.isfinite(t).all() for t in [fed.grad] + [p.grad for p in params_]):
            break
        scaler.step(opt)  # skipped: the gradients hold an inf
        scaler.update()
    else:
        raise AssertionError(f"no finite backward pass down to scale {scaler.get_scale()}")
    got = {n: p.grad.clone() for n, p in module.named_parameters()}
    got_fed = fed.grad / scaler.get_scale()

    plain = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
    fed32 = fed.detach().float().requires_grad_()
    torch.manual_seed(0)
    outs = torch.func.functional_call(module, plain, (fed32, *rest))
    *want, want_fed = torch.autograd.grad(loss_of(as_tuple(outs)), [*plain.values(), fed32])
    for (name, g), w in zip(got.items(), want):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}")
    # One rounding to `dtype` of the scaled gradient, relative down to the
    # smallest normal number of `dtype` (below it, subnormal spacing).
    atol = torch.finfo(dtype).smallest_normal / scaler.get_scale()
    torch.testing.assert_close(got_fed.float(), want_fed, rtol=torch.finfo(dtype).eps, atol=atol)
    assert all(torch.isfinite(p.grad).all() for p in params_)

    before = [p.detach().clone() for p in params_]
    scaler.step(opt)
    scaler.update()
    moved = [not torch.equal(b, p) for b, p in zip(before, params_)]
    assert all(moved), moved


# ---------------------------------------------------------------------------
# bfloat16 / float16 inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("case", each_op())
def test_low_precision_inputs_computed_in_float32(case, dtype, device):
    # All inputs in `dtype` (those of the op's float_args): the float32 op on
    # the same values, floating outputs rounded to `dtype` (bitwise), integer
    # ones as they are; gradients come back in the inputs' dtype.
    size, args = _small(case, device)
    args = [a.requires_grad_(case.differentiable) for a in case.in_dtype(args, dtype)]
    got = case.fused(args, size)
    want = case.fused(_float32(args), size)
    assert_equal(case.out_names, got, tuple(w.to(dtype) if w.is_floating_point() else w for w in want))
    if not case.differentiable:
        return
    grads = torch.autograd.grad(sum(o.float().sum() for o in got), args)
    assert all(g.dtype == dtype and g.shape == a.shape for g, a in zip(grads, args))


# Ops whose torch.ops entry takes all-bfloat16 inputs itself (a bfloat16
# kernel path, else the float32 kernels on float32 copies inside the op).
TAKES_BFLOAT16 = {"vae_elbo"}


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("case", each_op())
def test_torch_ops_refuse_low_precision(case, dtype):
    # torch.ops.fused_ops.* keeps the kernels' rule: float32 or float64
    # (bfloat16 too for the ops of TAKES_BFLOAT16: the float32 op's results
    # on the same values, rounded, on the CPU).
    size, args = _small(case, "cpu")
    low = case.in_dtype(args, dtype)
    if dtype == torch.bfloat16 and case.name in TAKES_BFLOAT16:
        got = case.call(case.packet, low, size)
        want = case.call(case.packet, _float32(low), size)
        assert_equal(case.out_names, got, tuple(w.to(dtype) for w in want))
        return
    with pytest.raises(RuntimeError) as excinfo:
        case.call(case.packet, low, size)
    check_error_names(excinfo, case.arg_names[0], "float32 or float64")


@pytest.mark.parametrize("case", _each_op_with_float_args(2))
def test_mixed_low_precision_refused_by_name(case):
    size, args = _small(case, "cpu")
    args = case.in_dtype(args, torch.bfloat16)
    last = (case.float_args or case.arg_names)[-1]
    i = case.arg_names.index(last)
    args[i] = args[i].half()
    with pytest.raises(RuntimeError) as excinfo:
        case.fused(args, size)
    check_error_names(excinfo, last, "same dtype")


def _accuracy_params():
    """The first accuracy row of each op, in each lower-precision dtype."""
    return params(lambda c: [(f"{c.size_id(c.accuracy[0].size)}-{i}", d, c.accuracy[0])
                             for i, d in zip(LOW_IDS, LOW)])


@pytest.mark.parametrize("case,dtype,acc", _accuracy_params())
def test_low_precision_accuracy_vs_float64(case, dtype, acc, device):
    # flash-attention's rule: the fused op fed `dtype` inputs is no further
    # from a float64 run on the same values than the plain PyTorch program
    # run in `dtype` (2x), plus one ulp of `dtype` of each output's scale
    # (the final rounding alone costs half of one).  Outputs and gradients.
    eps = torch.finfo(dtype).eps
    grad = case.differentiable
    args = case.in_dtype(case.inputs(acc.size, dtype=torch.float64, device=device, **acc.make_kw), dtype)
    exact_in = [a.double().requires_grad_(grad) for a in args]
    exact = case.ref(exact_in, acc.size)
    low_in = [a.clone().requires_grad_(grad) for a in args]
    plain = case.ref(low_in, acc.size)
    fused_in = [a.clone().requires_grad_(grad) for a in args]
    fused = case.fused(fused_in, acc.size)
    out_dtypes = case.out_dtypes(dtype) if case.out_dtypes is not None else [dtype] * len(fused)
    assert [o.dtype for o in fused] == out_dtypes
    sync(device)
    check_low_precision(case.out_names, fused, plain, exact, eps, acc.scale_min)
    if not grad:
        return

    # Gradients of a loss over every output (upstream drawn in float64, rounded).
    ups = [torch.randn(e.shape, dtype=torch.float64, device=device).to(dtype) for e in exact]

    def grads(outs, inputs):
        return torch.autograd.grad(outs, inputs, [u.to(o.dtype) for u, o in zip(ups, outs)], allow_unused=True,
                                   materialize_grads=True)

    g_exact, g_plain, g_fused = grads(exact, exact_in), grads(plain, low_in), grads(fused, fused_in)
    check_low_precision(case.arg_names, g_fused, g_plain, g_exact, eps, acc.scale_min, what="grad ")

