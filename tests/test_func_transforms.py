"""torch.func's reverse-mode transforms through the fused ops' Python
functions and modules: grad and vjp give torch.autograd's gradients, vmap of
grad gives per-sample gradients (also of a module through functional_call,
equal to the reference module's), jacrev the reference's Jacobian, and a
second derivative is refused with the ops' double-backward error.

They work because eager calls of the Python functions run each op, and its
backward op, as a torch.autograd.Function with a setup_context staticmethod
and a vmap rule, which functorch requires; the Function that
torch.library.register_autograd generates has neither, so torch refuses
torch.ops.fused_ops.* called directly under torch.func.grad.
"""

import pytest
import torch

import fused_ops
import fused_ops.nn
import fused_ops.reference
from fused_test_utils import make_inputs
from op_cases import as_tuple as _outputs
from op_cases import small_calls

CASES = small_calls()  # (Python function, inputs, extra scalar arguments)


def _loss(fn, scalars, upstream):
    """A scalar that weights every output of ``fn`` by a fixed random tensor."""

    def loss(*args):
        return sum((o * u).sum() for o, u in zip(_outputs(fn(*args, *scalars)), upstream))

    return loss


def _autograd_grads(loss, args):
    leaves = [a.detach().requires_grad_() for a in args]
    return torch.autograd.grad(loss(*leaves), leaves)


@pytest.mark.parametrize("name", list(CASES))
def test_func_grad_equals_autograd(name, device):
    fn, make, scalars = CASES[name]
    args = make(device)
    upstream = [torch.randn_like(o) for o in _outputs(fn(*args, *scalars))]
    loss = _loss(fn, scalars, upstream)
    got = torch.func.grad(loss, argnums=tuple(range(len(args))))(*args)
    expected = _autograd_grads(loss, args)
    assert len(got) == len(args)
    for a, g, e in zip(args, got, expected):
        assert g.shape == a.shape and torch.isfinite(g).all()
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_func_vjp_equals_autograd(name, device):
    fn, make, scalars = CASES[name]
    args = make(device)
    out, vjp_fn = torch.func.vjp(lambda *a: fn(*a, *scalars), *args)
    for o, e in zip(_outputs(out), _outputs(fn(*args, *scalars))):
        torch.testing.assert_close(o, e, rtol=0, atol=0)
    upstream = [torch.randn_like(o) for o in _outputs(out)]
    got = vjp_fn(tuple(upstream) if isinstance(out, tuple) else upstream[0])
    expected = _autograd_grads(_loss(fn, scalars, upstream), args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_func_grad_of_grad_raises(name, device):
    fn, make, scalars = CASES[name]
    args = make(device)
    upstream = [torch.randn_like(o) for o in _outputs(fn(*args, *scalars))]
    first = torch.func.grad(_loss(fn, scalars, upstream))
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.func.grad(lambda *a: first(*a).sum())(*args)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's per-sample loop fallback
@pytest.mark.parametrize("name", list(CASES))
def test_vmap_of_grad_gives_per_sample_gradients(name, device):
    # Per-sample gradients: a batch of three independent problems, each
    # input perturbed differently per problem (a convex mix with a draw from
    # [0, 1), so the VAE's targets stay in [0, 1] and stds stay positive).
    fn, make, scalars = CASES[name]
    args = make(device)
    batched = [0.99 * a + 0.01 * torch.rand(3, *a.shape, dtype=a.dtype, device=a.device) for a in args]
    upstream = [torch.randn_like(o) for o in _outputs(fn(*args, *scalars))]
    grad = torch.func.grad(_loss(fn, scalars, upstream), argnums=tuple(range(len(args))))
    got = torch.func.vmap(grad)(*batched)
    for j in range(3):
        expected = _autograd_grads(_loss(fn, scalars, upstream), [b[j] for b in batched])
        for g, e in zip(got, expected):
            torch.testing.assert_close(g[j], e, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_per_sample_gradients_of_the_vae_module_match_the_reference(device):
    # The usual recipe (e.g. for DP-SGD): vmap over the batch of grad of a
    # functional_call of the module, here on the fused module and on the
    # reference with the same parameters, in float64.
    torch.manual_seed(0)
    fused = fused_ops.nn.VAE(6, 5, 3).double().to(device)
    ref = fused_ops.reference.VAE(6, 5, 3).double().to(device)
    ref.load_state_dict(fused.state_dict())
    params = {k: v.detach() for k, v in fused.named_parameters()}
    x = torch.rand(4, 6, dtype=torch.float64, device=device)
    eps = torch.randn(4, 3, dtype=torch.float64, device=device)

    def per_sample(model):
        def loss(p, xi, ei):
            return -torch.func.functional_call(model, p, (xi[None], ei[None]))[0].sum()

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, eps)

    got, expected = per_sample(fused), per_sample(ref)
    assert got.keys() == expected.keys()
    for name in got:
        assert got[name].shape == (4, *params[name].shape)
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_jacrev_of_importance_sampling_matches_the_reference(device):
    samples, *rest = make_inputs(9, 3, 2, dtype=torch.float64, device=device)
    jac = torch.func.jacrev(lambda s: fused_ops.importance_sampling(s, *rest)[0])(samples)
    expected = torch.func.jacrev(lambda s: fused_ops.reference.importance_sampling(s, *rest)[0])(samples)
    assert jac.shape == (3, 9, 3)
    torch.testing.assert_close(jac, expected, rtol=1e-9, atol=1e-12)
