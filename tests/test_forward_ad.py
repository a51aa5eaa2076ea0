"""Forward-mode AD is refused with a clear error by the Python functions and
modules of fused_ops: the ops have no forward derivative, and without the
check torch.func.jvp would get a zero tangent back, silently.  Calls on
plain tensors inside forward-AD contexts still work.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_ops
from op_cases import small_calls

# (Python function, inputs, extra scalar arguments)
CASES = small_calls()
MESSAGE = "does not support forward-mode AD"


def _first(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("which", [0, -1], ids=["first-input", "last-input"])
def test_dual_tensor_input_raises(name, which, device):
    fn, make, scalars = CASES[name]
    args = list(make(device))
    with fwAD.dual_level():
        args[which] = fwAD.make_dual(args[which], torch.ones_like(args[which]))
        with pytest.raises(RuntimeError, match=MESSAGE):
            fn(*args, *scalars)


@pytest.mark.parametrize("name", list(CASES))
def test_dual_tensor_with_requires_grad_raises(name, device):
    # Forward over reverse: the inputs also require grad (on the CPU the VAE
    # then takes its training-op route).
    fn, make, scalars = CASES[name]
    args = [a.requires_grad_() for a in make(device)]
    with fwAD.dual_level():
        args[0] = fwAD.make_dual(args[0], torch.ones_like(args[0]))
        with pytest.raises(RuntimeError, match=MESSAGE):
            fn(*args, *scalars)


@pytest.mark.parametrize("name", list(CASES))
def test_func_jvp_raises(name, device):
    fn, make, scalars = CASES[name]
    args = list(make(device))

    def f(first):
        return _first(fn(first, *args[1:], *scalars))

    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.func.jvp(f, (args[0],), (torch.ones_like(args[0]),))


@pytest.mark.parametrize("name", list(CASES))
def test_jvp_of_vmap_raises(name, device):
    # Under vmap inside jvp the tangents cannot be inspected: refused.
    fn, make, scalars = CASES[name]
    args = list(make(device))
    batch = torch.stack([args[0], args[0]])

    def f(first):
        return _first(fn(first, *args[1:], *scalars))

    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.func.jvp(torch.func.vmap(f), (batch,), (torch.ones_like(batch),))


@pytest.mark.parametrize("name", list(CASES))
def test_plain_inputs_inside_forward_ad_work(name, device):
    fn, make, scalars = CASES[name]
    args = list(make(device))
    want = fn(*args, *scalars)
    with fwAD.dual_level():
        got = fn(*args, *scalars)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)
    # Inside torch.func.jvp, a call whose inputs do not depend on the primal.
    ones = torch.ones(2, device=device)
    out, tangent = torch.func.jvp(lambda p: p * 2 + _first(fn(*args, *scalars)).sum(), (ones,), (ones,))
    assert torch.equal(tangent, torch.full((2,), 2.0, device=device))


def test_module_with_dual_input_raises(device):
    vae = fused_ops.nn.VAE(6, 5, 3).to(device)
    x = torch.rand(4, 6, device=device)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match=MESSAGE):
            vae(fwAD.make_dual(x, torch.ones_like(x)), eps=torch.zeros(4, 3, device=device))
