"""The fused backward of flow_euler (torch.ops.fused_ops.flow_euler_backward)
in training: a compiled training step of fused_ops.nn.FlowODE against the
reference module's step, with SGD and Adam, and the whole step in one graph.

gradcheck, float32 / float64 gradients against the reference's autograd
(both backward modes, "resident" and "streaming"), opcheck and the backward
op's own contract are test_contract.py's, over op_cases.FLOW_EULER.
"""

import pytest
import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import sync


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
