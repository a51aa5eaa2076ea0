"""Users' own modules for the module tests (test_nn.py): copies of the
reference modules under other names (which the fused modules accept) and
near-copies that are not reference modules (which they must refuse), and
model trees that hold them."""

import torch
from torch import nn

from fused_ops import reference


class UserSampler(nn.Module):
    """A user's own copy of the reference module under another name: same
    buffers, created in the same order, its own forward."""

    def __init__(self, dim, num_components=3):
        super().__init__()
        self.register_buffer("mix_weights", torch.ones(num_components) / num_components)
        self.register_buffer("mix_mus", torch.randn(num_components, dim) * 2.0)
        self.register_buffer("mix_stds", torch.ones(num_components, dim))
        self.register_buffer("q_mu", torch.zeros(dim))
        self.register_buffer("q_std", torch.ones(dim) * 3.0)

    def forward(self, samples):
        x = samples
        diff = (x[:, None, :] - self.mix_mus[None]) / self.mix_stds[None]
        log_comp = (-0.5 * diff**2 - torch.log(self.mix_stds)[None]).sum(-1)
        log_p = torch.logsumexp(log_comp + torch.log(self.mix_weights)[None], dim=-1)
        log_q = (-0.5 * ((x - self.q_mu) / self.q_std) ** 2 - torch.log(self.q_std)).sum(-1)
        log_w = log_p - log_q
        w = torch.softmax(log_w, 0)
        return (w[:, None] * x).sum(0), 1.0 / (w**2).sum()


class ExtraParamSampler(UserSampler):
    """Same buffers plus a learnable parameter: not a reference module."""

    def __init__(self, dim, num_components=3):
        super().__init__(dim, num_components)
        self.temperature = nn.Parameter(torch.ones(()))


class WrongShapeSampler(nn.Module):
    """Same buffer names, inconsistent shapes (mix_mus has D+1 columns)."""

    def __init__(self, dim, num_components=3):
        super().__init__()
        self.register_buffer("mix_weights", torch.ones(num_components) / num_components)
        self.register_buffer("mix_mus", torch.randn(num_components, dim + 1))
        self.register_buffer("mix_stds", torch.ones(num_components, dim))
        self.register_buffer("q_mu", torch.zeros(dim))
        self.register_buffer("q_std", torch.ones(dim))


class WrongRankSampler(WrongShapeSampler):
    def __init__(self, dim, num_components=3):
        super().__init__(dim, num_components)
        self.mix_mus = torch.randn(num_components, dim)
        self.mix_weights = torch.ones(1, num_components)  # [1, K] instead of [K]


class MissingBufferSampler(nn.Module):
    def __init__(self, dim, num_components=3):
        super().__init__()
        self.register_buffer("mix_weights", torch.ones(num_components) / num_components)
        self.register_buffer("mix_mus", torch.randn(num_components, dim))
        self.register_buffer("mix_stds", torch.ones(num_components, dim))
        self.register_buffer("q_mu", torch.zeros(dim))


class ExtraBufferSampler(UserSampler):
    def __init__(self, dim, num_components=3):
        super().__init__(dim, num_components)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))


class ChildSampler(UserSampler):
    def __init__(self, dim, num_components=3):
        super().__init__(dim, num_components)
        self.post = nn.Identity()


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.sampler = UserSampler(dim, 2)
        self.decoy = WrongShapeSampler(dim, 2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.blocks = nn.Sequential(Block(4), Block(4))  # samplers two levels down
        self.head = reference.ImportanceSampler(4, 3)
        self.extra = ExtraParamSampler(4, 2)
        self.table = nn.ModuleDict({"ref": reference.ImportanceSampler(3, 1), "lin": nn.Linear(2, 2)})


def randomise(module):
    """Non-default buffer values, so equality checks have something to check."""
    with torch.no_grad():
        module.mix_weights.copy_(torch.rand_like(module.mix_weights) + 0.1)
        module.mix_stds.copy_(torch.rand_like(module.mix_stds) + 0.5)
        module.q_mu.copy_(torch.randn_like(module.q_mu))
        module.q_std.copy_(torch.rand_like(module.q_std) + 2.0)
    return module


class UserFlow(nn.Module):
    """A user's own copy of the reference module (another class, same structure)."""

    def __init__(self, dim, num_steps, hidden=None):
        super().__init__()
        hidden = hidden or 4 * dim
        self.velocity = nn.Sequential(
            nn.Linear(dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim)
        )
        self.num_steps = num_steps
        self.register_buffer("dt", torch.tensor(1.0 / num_steps))

    forward = reference.FlowODE.forward


class ReluFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.velocity[1] = nn.ReLU()


class NoBiasFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.velocity[4] = nn.Linear(4 * dim, dim, bias=False)


class ExtraParamFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.scale = nn.Parameter(torch.ones(()))


class WrongShapeFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.velocity[4] = nn.Linear(4 * dim, dim + 1)


class UserVAE(nn.Module):
    """A user's own copy of the reference VAE under another name."""

    def __init__(self, i, h, l_):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(i, h), nn.ReLU())
        self.fc_mu = nn.Linear(h, l_)
        self.fc_logvar = nn.Linear(h, l_)
        self.decoder = nn.Sequential(nn.Linear(l_, h), nn.ReLU(), nn.Linear(h, i), nn.Sigmoid())

    forward = reference.VAE.forward


class TanhVAE(UserVAE):
    def __init__(self, i, h, l_):
        super().__init__(i, h, l_)
        self.encoder[1] = nn.Tanh()


class WrongShapeVAE(UserVAE):
    def __init__(self, i, h, l_):
        super().__init__(i, h, l_)
        self.fc_logvar = nn.Linear(h, l_ + 1)


class NoBiasVAE(UserVAE):
    def __init__(self, i, h, l_):
        super().__init__(i, h, l_)
        self.fc_mu = nn.Linear(h, l_, bias=False)


class ExtraVAE(UserVAE):
    def __init__(self, i, h, l_):
        super().__init__(i, h, l_)
        self.beta = nn.Parameter(torch.ones(()))
