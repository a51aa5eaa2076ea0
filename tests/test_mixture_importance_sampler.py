"""Tests of fused_ops.nn.MixtureImportanceSampler, the trainable module over
importance_sampling's batched, mixture-proposal, evidence call (the op itself
is covered by the op table and test_importance_sampling_batched.py): its
outputs and gradients against the same program written with
torch.distributions in float64, its reparameterised proposal draws, a fit of
the proposal by maximising the evidence, checkpoints, compile, construction
from torch.distributions objects, buffers, and its errors.
"""

import math

import pytest
import torch
import torch.distributions as dist

from fused_ops.nn import MixtureImportanceSampler
from fused_test_utils import DEVICE_PARAMS

F64 = torch.float64
NAMES = ("logits", "mus", "log_stds", "q_logits", "q_mus", "q_log_stds")
# (batch_shape, K, Kq): both batch forms, one and several components on either side.
SHAPES = [((), 1, 1), ((), 3, 2), ((3,), 1, 2), ((3,), 3, 1), ((2, 3), 2, 3)]


def shape_id(s):
    return f"b{'x'.join(map(str, s[0])) or '0'}-K{s[1]}-Kq{s[2]}"


def randomised(batch, k, kq, d, dtype=F64, device="cpu", trainable=True):
    """A module whose parameters are drawn away from the initialisation
    (uneven weights, spread stds), the proposal wider than the target."""
    m = MixtureImportanceSampler(k, d, kq, batch, trainable=trainable).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.logits.copy_(torch.randn_like(m.logits))
        m.mus.copy_(torch.randn_like(m.mus) * 1.5)
        m.log_stds.copy_(torch.randn_like(m.log_stds) * 0.3)
        m.q_logits.copy_(torch.randn_like(m.q_logits))
        m.q_mus.copy_(torch.randn_like(m.q_mus))
        m.q_log_stds.copy_(math.log(2.5) + torch.randn_like(m.q_log_stds) * 0.2)
    return m


def td_program(x, logits, mus, log_stds, q_logits, q_mus, q_log_stds):
    """The module's outputs as a user writes them with torch.distributions."""
    p = dist.MixtureSameFamily(dist.Categorical(logits=logits), dist.Independent(dist.Normal(mus, log_stds.exp()), 1))
    q = dist.MixtureSameFamily(dist.Categorical(logits=q_logits),
                               dist.Independent(dist.Normal(q_mus, q_log_stds.exp()), 1))
    xt = x.movedim(-2, 0)  # [N, *batch, D]: the sample dimension first, as log_prob wants
    lw = (p.log_prob(xt) - q.log_prob(xt)).movedim(0, -1)
    lse = torch.logsumexp(lw, -1, keepdim=True)
    lnw = lw - lse
    w = lnw.exp()
    return (w[..., None] * x).sum(-2), 1.0 / (w**2).sum(-1), lnw, lse[..., 0] - math.log(x.shape[-2])


def params(m):
    return [getattr(m, n) for n in NAMES]


def loss_of(outs):
    mean, ess, lnw, logz = outs
    return mean.square().sum() + 0.1 * ess.sum() + (lnw.exp() ** 2).sum() + logz.sum()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_outputs_match_torch_distributions_float64(shape, device):
    batch, k, kq = shape
    m = randomised(batch, k, kq, 4, device=device)
    x = m.sample(500).detach()
    got = m(x)
    want = td_program(x, *params(m))
    for name, g, w in zip(("weighted_mean", "ess", "log_weights", "log_evidence"), got, want):
        assert g.shape == w.shape and g.dtype == F64, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_gradients_reach_every_parameter_and_match_torch_distributions(shape, device):
    # The samples come from m.sample (not detached), so both losses also
    # carry the reparameterised path into q_mus and q_log_stds.
    batch, k, kq = shape
    m = randomised(batch, k, kq, 3, device=device)
    x = m.sample(300)
    got = torch.autograd.grad(loss_of(m(x)), params(m), retain_graph=True)
    want = torch.autograd.grad(loss_of(td_program(x, *params(m))), params(m))
    for name, g, w in zip(NAMES, got, want):
        scale = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10 * scale, msg=lambda s, n=name: f"{n}: {s}")
        if name == "q_logits" and kq == 1:
            assert torch.equal(g, torch.zeros_like(g)), "softmax of one logit is constant"
        elif name in ("logits",) and k == 1:
            assert torch.equal(g, torch.zeros_like(g)), "softmax of one logit is constant"
        else:
            assert g.abs().amax() > 0, f"{name} received no gradient"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("kq", [1, 3])
def test_sample_is_the_proposal_reparameterised(kq, device):
    # Components far apart (means 40 apart, stds near 1), so each draw's
    # component is the nearest mean: its frequency, its standardised moments
    # and the pathwise gradients of sum(x) (count of the component in q_mus,
    # sum of x - mu in q_log_stds) are checked per component.
    batch, d, n = (2,), 2, 20000
    m = MixtureImportanceSampler(1, d, kq, batch).to(device=device, dtype=F64)
    with torch.no_grad():
        m.q_logits.copy_(torch.tensor([0.0, 0.7, -0.4][:kq], dtype=F64))
        m.q_mus.copy_(40.0 * torch.arange(kq, dtype=F64)[:, None] + torch.randn(2, kq, d, dtype=F64))
        m.q_log_stds.copy_(torch.randn(2, kq, d, dtype=F64) * 0.2)
    g = torch.Generator(device=device).manual_seed(1234)
    x = m.sample(n, generator=g)
    assert x.shape == (*batch, n, d) and x.dtype == F64
    again = m.sample(n, generator=torch.Generator(device=device).manual_seed(1234))
    assert torch.equal(x, again), "the same generator state gives the same draw"
    gm, gs = torch.autograd.grad(x.sum(), [m.q_mus, m.q_log_stds])
    xd = x.detach()
    comp = (xd[..., None, :] - m.q_mus.detach()[:, None]).square().sum(-1).argmin(-1)  # [2, n]
    probs = torch.softmax(m.q_logits.detach(), -1)
    for b in range(2):
        for j in range(kq):
            mine = comp[b] == j
            count = mine.sum().item()
            p = probs[b, j].item()
            assert abs(count - n * p) < 5 * math.sqrt(n * p * (1 - p)) + 1e-9, (b, j, count, n * p)
            mu, log_std = m.q_mus[b, j].detach(), m.q_log_stds[b, j].detach()
            z = (xd[b][mine] - mu) / log_std.exp()
            assert z.mean(0).abs().max() < 5 / math.sqrt(count), z.mean(0)
            assert (z.std(0) - 1).abs().max() < 0.05, z.std(0)
            torch.testing.assert_close(gm[b, j], torch.full((d,), float(count), dtype=F64, device=device))
            torch.testing.assert_close(gs[b, j], (xd[b][mine] - mu).sum(0), rtol=1e-9, atol=1e-9)
    assert m.q_logits.grad is None
    with pytest.raises(RuntimeError, match="does not require grad|not have a grad_fn|unused"):
        torch.autograd.grad(m.sample(4).sum(), [m.q_logits])


def test_evidence_maximisation_fits_the_proposal_to_the_target():
    # Two problems, a fixed two-component target each; each proposal
    # component starts 2.5 away from a target component, std 1.  50 Adam
    # steps on -log_evidence of 16 fresh proposal draws, the proposal's means
    # and stds trained (its weights kept: sample's component choice gives
    # them no gradient, see MixtureImportanceSampler.sample; docs/
    # importance_sampling.md on this set-up).  Deterministic (its own
    # generators): the expected log evidence of 16 draws rises towards 0,
    # its value for q = p, and KL(p || q), estimated on 4000 draws of the
    # target, falls.
    g = torch.Generator().manual_seed(0)
    m = MixtureImportanceSampler(2, 2, 2, (2,)).double()
    with torch.no_grad():
        m.logits.copy_(torch.tensor([[0.0, 0.0], [0.5, -0.5]]))
        m.mus.copy_(torch.tensor([[[-2.0, -2.0], [2.0, 1.5]], [[0.0, 3.0], [1.0, -2.0]]]))
        m.log_stds.copy_(torch.log(torch.tensor([[[0.6, 0.8], [0.7, 0.5]], [[0.5, 0.5], [0.9, 0.6]]])))
        m.q_logits.zero_()
        offset = torch.nn.functional.normalize(torch.randn(2, 2, 2, generator=g, dtype=F64), dim=-1)
        m.q_mus.copy_(m.mus + 2.5 * offset)
        m.q_log_stds.zero_()
    target = dist.MixtureSameFamily(dist.Categorical(logits=m.logits.detach().clone()), dist.Independent(
        dist.Normal(m.mus.detach().clone(), m.log_stds.detach().exp()), 1))
    comp = torch.multinomial(torch.softmax(m.logits.detach(), -1), 4000, replacement=True, generator=g)  # [2, n]
    idx = comp[..., None].expand(2, 4000, 2)
    xp = (m.mus.detach().gather(1, idx) + m.log_stds.detach().exp().gather(1, idx)
          * torch.randn(2, 4000, 2, generator=g, dtype=F64)).movedim(1, 0)  # [n, 2, D] draws of the target

    def report():
        with torch.no_grad():
            ge = torch.Generator().manual_seed(7)
            logz = torch.stack([m(m.sample(16, generator=ge))[3] for _ in range(200)]).mean(0)
            q = dist.MixtureSameFamily(dist.Categorical(logits=m.q_logits), dist.Independent(
                dist.Normal(m.q_mus, m.q_log_stds.exp()), 1))
            return logz, (target.log_prob(xp) - q.log_prob(xp)).mean(0)

    (z0, kl0) = report()
    opt = torch.optim.Adam([m.q_mus, m.q_log_stds], lr=0.05)
    for _ in range(50):
        opt.zero_grad()
        (-m(m.sample(16, generator=g))[3].sum()).backward()
        opt.step()
    (z1, kl1) = report()
    assert (z1 > z0 + 0.5).all() and (z1 > -0.6).all(), (z0, z1)
    assert (kl1 < kl0 - 0.8).all(), (kl0, kl1)


@pytest.mark.parametrize("trainable", [True, False], ids=["parameters", "buffers"])
def test_state_dict_round_trip(trainable):
    a = randomised((3,), 2, 2, 4, dtype=torch.float32, trainable=trainable)
    sd = a.state_dict()
    assert list(sd) == list(NAMES)
    b = MixtureImportanceSampler(2, 4, 2, (3,), trainable=not trainable)  # other values; the other kind
    b.load_state_dict(sd, strict=True)
    for name in NAMES:
        assert torch.equal(getattr(b, name), sd[name]), name
    x = a.sample(64).detach()
    for g, w in zip(b(x), a(x)):
        assert torch.equal(g, w)
    with pytest.raises(RuntimeError, match="size mismatch for q_mus"):
        MixtureImportanceSampler(2, 4, 3, (3,)).load_state_dict(sd)


def test_trainable_false_holds_buffers_only():
    m = MixtureImportanceSampler(3, 2, 2, (4,), trainable=False)
    assert list(m.parameters()) == []
    assert [n for n, _ in m.named_buffers()] == list(NAMES)
    assert not any(b.requires_grad for b in m.buffers())
    x = m.sample(50)
    outs = m(x)
    assert not x.requires_grad and not any(o.requires_grad for o in outs)
    shapes = {n: tuple(b.shape) for n, b in m.named_buffers()}
    assert shapes == {"logits": (4, 3), "mus": (4, 3, 2), "log_stds": (4, 3, 2),
                      "q_logits": (4, 2), "q_mus": (4, 2, 2), "q_log_stds": (4, 2, 2)}
    assert repr(m) == ("MixtureImportanceSampler(num_components=3, dim=2, proposal_components=2, "
                       "batch_shape=(4,), trainable=False)")


def test_initialisation_is_the_documented_one():
    m = MixtureImportanceSampler(4, 3, 2, (5,))
    assert torch.equal(m.logits, torch.zeros(5, 4)) and torch.equal(m.q_logits, torch.zeros(5, 2))
    assert torch.equal(m.log_stds, torch.zeros(5, 4, 3))
    assert torch.equal(m.q_log_stds, torch.full((5, 2, 3), math.log(3.0)))
    assert 1.0 < m.mus.std().item() < 3.0 and 0.2 < m.q_mus.std().item() < 0.9  # N(0, 2^2), N(0, 0.5^2)
    assert m.mus.dtype == torch.float32 and all(isinstance(p, torch.nn.Parameter) for p in m.parameters())


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_compile_fullgraph_forward_and_backward(device):
    torch._dynamo.reset()
    m = randomised((3,), 2, 2, 4, dtype=torch.float32, device=device)
    x = m.sample(256).detach()
    compiled = torch.compile(m, fullgraph=True)
    got, want = compiled(x), m(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    gg = torch.autograd.grad(loss_of(got), params(m))
    gw = torch.autograd.grad(loss_of(want), params(m))
    for name, g, w in zip(NAMES, gg, gw):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * max(w.abs().max().item(), 1.0),
                                   msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("batch", [(), (3,)], ids=["b0", "b3"])
def test_from_distributions_copies_the_parameters(batch, device):
    k, kq, d = 3, 2, 4
    probs = torch.softmax(torch.randn(*batch, k, dtype=F64), -1).to(device)
    loc, scale = torch.randn(*batch, k, d, dtype=F64, device=device), torch.rand(*batch, k, d, dtype=F64,
                                                                                  device=device) + 0.5
    target = dist.MixtureSameFamily(dist.Categorical(probs=probs), dist.Independent(dist.Normal(loc, scale), 1))
    # A mixture proposal with no batch dimensions (broadcast to the target's), then a plain Gaussian one.
    q_logits = torch.randn(kq, dtype=F64, device=device)
    q_loc, q_scale = torch.randn(kq, d, dtype=F64, device=device), torch.full((kq, d), 2.5, dtype=F64, device=device)
    mix_q = dist.MixtureSameFamily(dist.Categorical(logits=q_logits), dist.Independent(dist.Normal(q_loc, q_scale), 1))
    gauss_q = dist.Independent(dist.Normal(q_loc[0], q_scale[0]), 1)
    for proposal, n_q in ((mix_q, kq), (gauss_q, 1)):
        m = MixtureImportanceSampler.from_distributions(target, proposal)
        assert (m.batch_shape, m.num_components, m.proposal_components, m.dim) == (batch, k, n_q, d)
        assert m.mus.dtype == F64 and m.mus.device.type == device
        torch.testing.assert_close(torch.softmax(m.logits, -1), probs)
        torch.testing.assert_close(m.log_stds.exp(), scale)
        assert torch.equal(m.mus, loc) and m.mus.data_ptr() != loc.data_ptr()
        assert m.q_mus.shape == (*batch, n_q, d)
        xt = proposal.sample((300, *batch))  # [N, *batch, D]
        lw = (target.log_prob(xt) - proposal.log_prob(xt)).movedim(0, -1)
        x = xt.movedim(0, -2)
        _, ess, lnw, logz = m(x)
        torch.testing.assert_close(lnw, lw - torch.logsumexp(lw, -1, keepdim=True), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(logz, torch.logsumexp(lw, -1) - math.log(300), rtol=1e-10, atol=1e-10)
    frozen = MixtureImportanceSampler.from_distributions(target, gauss_q, trainable=False)
    assert list(frozen.parameters()) == [] and len(list(frozen.buffers())) == 6


def _target(d=2, dtype=F64):
    return dist.MixtureSameFamily(dist.Categorical(logits=torch.zeros(2, dtype=dtype)),
                                  dist.Independent(dist.Normal(torch.zeros(2, d, dtype=dtype),
                                                               torch.ones(2, d, dtype=dtype)), 1))


@pytest.mark.parametrize("target,proposal,message", [
    pytest.param(lambda: dist.Independent(dist.Normal(torch.zeros(2), torch.ones(2)), 1), lambda: _target(),
                 r"^target must be a MixtureSameFamily", id="target_gaussian"),
    pytest.param(lambda: dist.MixtureSameFamily(dist.Categorical(logits=torch.zeros(2)), dist.Normal(
        torch.zeros(2), torch.ones(2))), lambda: _target(), r"^target must be a MixtureSameFamily", id="target_1d"),
    pytest.param(lambda: _target(), lambda: dist.Normal(torch.zeros(2), torch.ones(2)),
                 r"^proposal must be a MixtureSameFamily", id="proposal_normal"),
    pytest.param(lambda: _target(), lambda: dist.Independent(dist.Normal(torch.zeros(3, 2), torch.ones(3, 2)), 2),
                 r"^proposal must be an Independent\(Normal, 1\)", id="proposal_independent_2"),
    pytest.param(lambda: _target(), lambda: _target(d=3), r"^proposal's event shape \[3\]", id="proposal_D"),
    pytest.param(lambda: _target(), lambda: _target(dtype=torch.float32), r"^proposal's parameters are torch.float32",
                 id="proposal_dtype"),
])
def test_from_distributions_refuses_other_distributions(target, proposal, message):
    with pytest.raises(ValueError, match=message):
        MixtureImportanceSampler.from_distributions(target(), proposal())


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_components=0), "num_components"),
    (dict(num_components=2.0), "num_components"),
    (dict(num_components=True), "num_components"),
    (dict(dim=0), "dim"),
    (dict(dim=-3), "dim"),
    (dict(proposal_components=0), "proposal_components"),
    (dict(batch_shape=3), "batch_shape"),
    (dict(batch_shape=(0,)), "batch_shape"),
    (dict(batch_shape=(2, -1)), "batch_shape"),
    (dict(batch_shape=(2.0,)), "batch_shape"),
    (dict(batch_shape=None), "batch_shape"),
    (dict(trainable="yes"), "trainable"),
], ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_bad_constructor_arguments_name_the_argument(kwargs, name):
    args = dict(num_components=2, dim=3, proposal_components=1, batch_shape=())
    args.update(kwargs)
    trainable = args.pop("trainable", True)
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        MixtureImportanceSampler(**args, trainable=trainable)


@pytest.mark.parametrize("batch", [(), (3,)], ids=["b0", "b3"])
def test_wrong_samples_name_the_argument(batch):
    m = MixtureImportanceSampler(2, 4, 2, batch)
    good = m.sample(8).detach()
    assert m(good)[2].shape == (*batch, 8)
    wrong = [good[..., :3], good.unsqueeze(0), good[0] if batch else good[None].expand(2, 8, 4),
             torch.zeros(*batch, 8), good.tolist()]
    if batch:
        wrong.append(torch.zeros(2, 8, 4))  # a batch of another size
    for bad in wrong:
        with pytest.raises(ValueError, match=r"^samples must be \[\*batch_shape, N, D\]"):
            m(bad)
    with pytest.raises(RuntimeError, match=r"samples.*N >= 1"):  # the op's own check
        m(good[..., :0, :])
    for n in (0, -2, 3.0, None):
        with pytest.raises(ValueError, match=r"^n must be a positive int"):
            m.sample(n)
