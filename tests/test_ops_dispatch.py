"""The Python functions of fused_ops.ops skip the Python autograd kernel that
torch.library.register_autograd installs when no gradient can flow, and only
then (fused_ops.ops._call_op): same results, gradients and errors as calling
torch.ops.fused_ops.* directly.
"""

import contextlib
import sys

import pytest
import torch

import fused_ops
from fused_ops import ops
from fused_test_utils import make_inputs
from test_flow_euler import make_args as make_flow_args
from test_vae_elbo import make_inputs as make_vae_inputs


def _is_args(device, requires_grad=False):
    return make_inputs(37, 5, 3, device=device, requires_grad=requires_grad)


def _flow_args(device, requires_grad=False):
    return make_flow_args(3, 4, 9, device=device, requires_grad=requires_grad)


def _vae_args(device, requires_grad=False):
    return make_vae_inputs(4, 6, 5, 3, device=device, requires_grad=requires_grad)


# (Python function, the op it calls, inputs, extra scalar arguments)
CASES = {
    "importance_sampling": (fused_ops.importance_sampling, torch.ops.fused_ops.importance_sampling.default,
                            _is_args, ()),
    "flow_euler": (fused_ops.flow_euler, torch.ops.fused_ops.flow_euler.default, _flow_args, (3,)),
    "vae_elbo": (fused_ops.vae_elbo, torch.ops.fused_ops.vae_elbo.default, _vae_args, ()),
}


@contextlib.contextmanager
def autograd_kernel_calls():
    """Records the Python frames run from torch's custom-op autograd module
    (torch/_library/autograd.py: the kernel register_autograd installs)."""
    seen = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith("_library/autograd.py"):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("name", list(CASES))
def test_no_grad_calls_skip_the_autograd_kernel_with_identical_results(name, device):
    fn, op, make, extra = CASES[name]
    args = make(device)
    with torch.no_grad():
        expected = _outputs(op(*args, *extra))  # through the autograd kernel
        with autograd_kernel_calls() as seen:
            got = _outputs(fn(*args, *extra))
    assert seen == [], seen
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
        assert not g.requires_grad


@pytest.mark.parametrize("name", list(CASES))
def test_plain_inputs_in_grad_mode_skip_it_too(name, device):
    fn, _, make, extra = CASES[name]
    with autograd_kernel_calls() as seen:
        out = _outputs(fn(*make(device), *extra))
    assert seen == [] and all(o.grad_fn is None for o in out)


@pytest.mark.parametrize("name", list(CASES))
def test_calls_that_need_grad_go_through_autograd(name, device):
    # Also the check that autograd_kernel_calls() sees the kernel at all: if
    # torch moved it, this test fails instead of the two above passing
    # vacuously.  (vae_elbo on the CPU takes the vae_elbo_train op.)
    fn, _, make, extra = CASES[name]
    args = make(device, requires_grad=True)
    with autograd_kernel_calls() as seen:
        out = _outputs(fn(*args, *extra))
    assert seen, "the autograd kernel was not entered"
    assert out[0].grad_fn is not None
    grads = torch.autograd.grad(sum(o.sum() for o in out if o.dtype.is_floating_point), args)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_under_grad_mode_off_inputs_that_require_grad_give_plain_outputs(device):
    args = _vae_args(device, requires_grad=True)
    with torch.no_grad(), autograd_kernel_calls() as seen:
        elbo, _, _ = fused_ops.vae_elbo(*args)
    assert seen == [] and elbo.grad_fn is None and not elbo.requires_grad


def test_inference_mode(device):
    args = _vae_args(device)
    with torch.inference_mode():
        got = fused_ops.vae_elbo(*args)
    expected = torch.ops.fused_ops.vae_elbo.default(*args)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_call_op_is_not_used_while_compiling(monkeypatch):
    # Under torch.compile the op itself must appear in the graph: the
    # dispatcher context of the fast path is not traceable.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    args = _vae_args("cpu")
    with torch.no_grad(), autograd_kernel_calls() as seen:
        ops._call_op(torch.ops.fused_ops.vae_elbo.default, tuple(args))
    assert seen
