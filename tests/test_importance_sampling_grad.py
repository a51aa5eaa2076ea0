"""The fused backward of importance_sampling in use: float64 gradients at a
large N (CUDA: more tiles than resident blocks), and a
torch.compile(fullgraph=True) training step that fits a mixture target and
its proposal through every input of the op, against the reference's step.

gradcheck over every combination of outputs, float32 gradients against the
reference's autograd, opcheck and the backward op's own contract
(determinism, layouts, bad inputs, CUDA streams and graphs) are
test_contract.py's, over op_cases.IMPORTANCE_SAMPLING.
"""

import math

import torch
from torch import nn

import fused_ops
from fused_ops import reference
from fused_test_utils import ARG_NAMES, make_inputs


def fused(*args):
    return fused_ops.importance_sampling(*args)


def grads_of(f, args, c, outputs):
    mean, ess, lw = f(*args)
    terms = [(mean * c[0]).sum(), ess * c[1], (lw * c[2]).sum()]
    return torch.autograd.grad(sum(terms[i] for i in outputs), args)


def test_grad_float64_large_n_vs_reference(device):
    # CUDA: ~4000 tiles of 256 samples, more than the resident blocks, so
    # blocks walk several tiles; CPU: 64 chunks.
    N, D, K = (1000003 if device == "cuda" else 70001), 5, 3
    args = make_inputs(N, D, K, dtype=torch.float64, device=device, requires_grad=True)
    c = (torch.randn(D, dtype=torch.float64, device=device), torch.randn((), dtype=torch.float64, device=device),
         torch.randn(N, dtype=torch.float64, device=device))
    for name, a, b in zip(ARG_NAMES, grads_of(fused, args, c, (0, 1, 2)),
                          grads_of(reference.importance_sampling, args, c, (0, 1, 2))):
        scale = max(b.abs().max().item(), 1.0)
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9 * scale, msg=lambda m, n=name: f"grad {n}: {m}")


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True) training step vs the reference's
# ---------------------------------------------------------------------------


class ProposalFit(nn.Module):
    """Fits a mixture target and its proposal by differentiating importance-
    sampling estimates.  The target's buffers come from an ImportanceSampler
    (fused or reference; the same under one seed) and are turned into
    trainable parameters (softmax logits, log std); the proposal is learnt
    through reparameterised samples x = q_mu + q_std * eps, so gradients flow
    into every input of the op, samples included."""

    def __init__(self, sampler, fn):
        super().__init__()
        k, d = sampler.mix_mus.shape
        self.fn = fn
        self.mix_logits = nn.Parameter(sampler.mix_weights.log().clone())
        self.mix_mus = nn.Parameter(sampler.mix_mus.clone())
        self.log_mix_stds = nn.Parameter(sampler.mix_stds.log().clone())
        self.q_mu = nn.Parameter(sampler.q_mu.clone())
        self.log_q_std = nn.Parameter(sampler.q_std.log().clone())

    def forward(self, eps, target_mean):
        q_std = self.log_q_std.exp()
        x = self.q_mu + q_std * eps
        mean, ess, lw = self.fn(
            x, self.mix_logits.softmax(0), self.mix_mus, self.log_mix_stds.exp(), self.q_mu, q_std
        )
        n = eps.shape[0]
        # Maximise the relative ESS, pull the estimate to a target, and a
        # term on the log weights (entropy-like) so all three outputs train.
        return -ess / n + ((mean - target_mean) ** 2).sum() - 0.1 * (lw.exp() * lw).sum() / math.log(n)


def test_compile_fullgraph_training_step_matches_reference(device):
    torch._dynamo.reset()
    D, K, N, steps = 16, 3, 4096, 3
    torch.manual_seed(1234)
    fused_sampler = fused_ops.nn.ImportanceSampler(D, K)
    torch.manual_seed(1234)
    ref_sampler = reference.ImportanceSampler(D, K)
    for name in ("mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std"):
        assert torch.equal(getattr(fused_sampler, name), getattr(ref_sampler, name))
    fused_model = ProposalFit(fused_sampler, fused_ops.importance_sampling).to(device)
    ref_model = ProposalFit(ref_sampler, reference.importance_sampling).to(device)
    # SGD with momentum: the step is linear in the gradient, so parameters
    # stay as close as the gradients are (Adam's first step, g / |g|, would
    # turn rounding noise in a near-zero gradient element into a full step).
    opt_f = torch.optim.SGD(fused_model.parameters(), lr=0.01, momentum=0.9)
    opt_r = torch.optim.SGD(ref_model.parameters(), lr=0.01, momentum=0.9)

    def ref_step(eps, target):
        opt_r.zero_grad(set_to_none=True)
        loss = ref_model(eps, target)
        loss.backward()
        return loss

    # The model's forward compiled with fullgraph=True: AOTAutograd traces
    # the fused backward op (through its fake impl) into the compiled
    # backward graph that loss.backward() runs.  The optimizer step is
    # compiled too (optimizer.step itself has a deliberate graph break, so
    # not fullgraph, as in PyTorch's compiled-optimizer recipe).
    compiled_loss = torch.compile(fused_model, fullgraph=True)
    compiled_opt_step = torch.compile(opt_f.step)
    target = torch.randn(D, device=device)
    param_atol = 1e-5
    for step in range(steps):
        eps = torch.randn(N, D, device=device)
        opt_f.zero_grad(set_to_none=True)
        loss_f = compiled_loss(eps, target)
        with torch.profiler.profile() as prof:
            loss_f.backward()
        if step == 0:
            # The compiled backward graph calls the fused backward op.
            names = {e.name for e in prof.events()}
            assert "fused_ops::importance_sampling_backward" in names, sorted(names)[:50]
        grads_f = [p.grad.clone() for p in fused_model.parameters()]
        compiled_opt_step()
        loss_r = ref_step(eps, target)
        grads_r = [p.grad.clone() for p in ref_model.parameters()]
        opt_r.step()
        torch.testing.assert_close(loss_f, loss_r, rtol=1e-4, atol=1e-5)
        # Absolute tolerance relative to the largest gradient element of all
        # parameters (mix_logits' gradient is tiny, rounding-level, here), at
        # the level test_grad_float32_vs_reference measures for float32.
        scale = max(g.abs().max().item() for g in grads_r)
        grad_atol = 5e-4 * scale
        param_atol += 0.01 * 10 * grad_atol  # lr * (1 + 0.9 + 0.9^2 + ...) per step's difference
        for (name, _), gf, gr in zip(fused_model.named_parameters(), grads_f, grads_r):
            torch.testing.assert_close(gf, gr, rtol=1e-3, atol=grad_atol,
                                       msg=lambda m, n=name: f"grad {n}: {m}")
        for (name, pf), pr in zip(fused_model.named_parameters(), ref_model.parameters()):
            # lr * (momentum-accumulated gradient differences) over the steps.
            torch.testing.assert_close(pf, pr, rtol=1e-4, atol=param_atol, msg=lambda m, n=name: f"param {n}: {m}")
    assert not torch.equal(fused_model.q_mu.detach().cpu(), fused_sampler.q_mu)  # it trained
