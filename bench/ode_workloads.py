"""The ODE-sampler workloads (``fused_ops.nn.ODESampler``) at real-model shapes:

- ``ode_torchcfm``: torchcfm's ``models.MLP`` (D=2, four Linear layers of 64,
  SELU, time last), Euler over 100 steps, as its tutorials sample;
- ``ode_fm``: facebookresearch/flow_matching's 2-D example (D=2, five Linear
  layers of 512, SiLU, time last), midpoint with ``step_size=0.05`` (20 steps);
- ``flow_ode``: the seed's flow program (``reference.FlowODE``) expressed
  through the sampler: Euler with the time feature shifted to the step's
  midpoint (beside ``flow_euler``, which computes it with its own kernels).

Each has B=1024 ("default") and B=65536 ("large") (``flow_ode``: the seed's 8
and 4096).  The reference is the same integration as a plain PyTorch loop
(what ``eager`` and the ``compile`` variants run); the peer is
``torchdiffeq.odeint`` on the same network.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import nn



class OdeLoop(nn.Module):
    """``dy/dt = net([y, t])`` by ``steps`` fixed steps of ``method`` (euler or
    midpoint) over [0, 1], torchdiffeq's expressions; returns the final state."""

    def __init__(self, dim, width, depth, act, method, steps, t_shift=0.0):
        super().__init__()
        dims = [dim + 1] + [width] * (depth - 1) + [dim]
        layers = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(a, b))
            if i + 2 < len(dims):
                layers.append(act())
        self.net = nn.Sequential(*layers)
        self.method, self.steps, self.t_shift = method, steps, t_shift

    def velocity(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([y, y.new_full((y.shape[0], 1), t + self.t_shift)], dim=-1))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        y, dt = x0, 1.0 / self.steps
        for k in range(self.steps):
            t0 = k * dt
            if self.method == "euler":
                y = y + dt * self.velocity(t0, y)
            else:
                f0 = self.velocity(t0, y)
                y = y + dt * self.velocity(t0 + 0.5 * dt, y + f0 * (0.5 * dt))
        return y


def _sampler(ref: OdeLoop):
    import fused_ops

    shift = ref.t_shift
    emb = (lambda t: t[:, None] + shift) if shift else None
    return fused_ops.nn.ODESampler(ref.net, method=ref.method, num_steps=ref.steps, time_embedding=emb)


def _torchdiffeq(ref: OdeLoop) -> Callable:
    import torchdiffeq

    grid = torch.linspace(0.0, 1.0, ref.steps + 1, device=ref.net[0].weight.device)

    def func(t, y):
        return ref.net(torch.cat([y, (t + ref.t_shift).to(y.dtype).expand(y.shape[0], 1)], dim=-1))

    return lambda x0: torchdiffeq.odeint(func, x0, grid, method=ref.method)[-1]


def _inputs(p):
    return (torch.randn(p["B"], p["D"]),)


def _loss(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean()


def _workload(name, sizes, width, depth, act, method, steps, t_shift=0.0):
    from .workloads import Peer, Workload  # here: workloads.py imports this module

    def make_reference(p) -> nn.Module:
        return OdeLoop(p["D"], width, depth, act, method, steps, t_shift)

    return Workload(
        name=name, op="ode_mlp", fused_name="ODESampler", sizes=sizes, make_reference=make_reference,
        make_inputs=_inputs, make_fused=_sampler, peers={"torchdiffeq": Peer(requires="torchdiffeq", make=_torchdiffeq)},
        train_loss=_loss)


def _sizes(small, large, dim=2, **extra) -> Dict[str, Dict[str, int]]:
    return {"default": {"B": small, "D": dim, **extra}, "large": {"B": large, "D": dim, **extra}}


def make_ode_workloads():
    """The workloads of this module (built on call: bench/workloads.py imports this module)."""
    return (
        _workload("ode_torchcfm", _sizes(1024, 65536, H=64, depth=4, steps=100), 64, 4, nn.SELU, "euler", 100),
        _workload("ode_fm", _sizes(1024, 65536, H=512, depth=5, steps=20), 512, 5, nn.SiLU, "midpoint", 20),
        _workload("flow_ode", _sizes(8, 4096, dim=64, H=256, depth=3, steps=32), 256, 3, nn.SiLU, "euler", 32,
                  t_shift=0.5 / 32),
    )
