"""The benchmarked workloads: sizes, reference and fused modules, inputs, peers,
targets and training losses (the protocol of DESIGN.md section 5), and the
training step the ``--train`` rows time.

Sizes are the defaults of DESIGN.md section 1 and one large size per op; the
targets are DESIGN.md section 7's (H200) and the training targets issue 5's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

SEED = 0
ATOL = RTOL = 1e-4
# Training rows compare a scalar loss and parameter gradients (sums over the
# batch), which accumulate more rounding than a forward output.
TRAIN_ATOL = TRAIN_RTOL = 1e-3
TRAIN_SUFFIX = "_train"
OPTIMIZERS = ("none", "sgd", "adam")
DEFAULT_OUT = BENCH_DIR / "results"
QUICK_MIN_RUN_TIME = 0.01  # seconds
TABLE_LEGEND = (
    "times: median us per call; `x <baseline>` = baseline time / fused time (> 1: fused is faster)"
)

# Variant names in display order.  Peers (e.g. "torchdiffeq") sit between the
# torch.compile rows and "fused"; see ``ordered_variants``.  FUSED_RO is the
# fused module under torch.compile(mode="reduce-overhead") (CUDA only): what a
# user who also captures CUDA graphs gets.  It is shown beside "fused", not
# as a baseline; the speed-ups and targets are those of eager "fused".
EAGER, COMPILE, COMPILE_RO, FUSED, FUSED_RO = "eager", "compile", "compile_ro", "fused", "fused_compile_ro"
BASE_VARIANTS = (EAGER, COMPILE, COMPILE_RO)
FUSED_VARIANTS = (FUSED, FUSED_RO)

# Calls before timing.  reduce-overhead needs a warm-up call and a recording
# call before it replays its CUDA graph; the rest just need compilation,
# allocator and cuBLAS/cuDNN heuristics settled.
WARMUP_CALLS = {EAGER: 3, COMPILE: 3, COMPILE_RO: 5, FUSED_RO: 5}
DEFAULT_WARMUP_CALLS = 3

Params = Dict[str, int]
Inputs = Tuple[torch.Tensor, ...]


# ----------------------------------------------------------------------------
# Workload registry
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One benchmarked operator: everything the driver needs to time it.

    Attributes:
        name: workload name used by ``--ops`` and in the outputs.
        fused_name: class name in ``fused_ops.nn`` of the fused module; the
            workload counts as implemented when that attribute exists.
        op: the ``torch.ops.fused_ops`` op the fused module calls (its
            kernel-path table has that name; the backward's ``<op>_backward``).
        sizes: size name (``"default"``, ``"large"``) -> parameters.
        make_reference: parameters -> reference ``nn.Module`` (on CPU; the
            driver seeds torch first and moves it to the device).
        make_inputs: parameters -> tuple of CPU input tensors, passed
            positionally to every variant.
        make_fused: reference module (already on the device) -> fused module.
            Defaults to ``fused_ops.nn.<fused_name>.from_reference``.
        peers: other implementations timed as baselines, by name.
        targets_us: size name -> DESIGN.md section 7's per-call target in us
            (H200, CUDA); sizes whose target is relative to a CUDA-graph
            replay (IS N=4096, VAE B=128) have none here.
        train_loss: outputs of the module -> scalar loss of a training step
            (``--train``); ``None``: the workload has no training rows.
        make_trainable: reference module -> the module to train (in place;
            e.g. buffers turned into parameters).  Defaults to the module.
        make_fused_trainable: trainable reference -> fused module sharing its
            parameters.  Defaults to ``build_fused``.
        train_speedup_targets: size name -> {baseline variant: minimum
            ``baseline time / fused time``} of the training step (CUDA).
    """

    name: str
    fused_name: str
    op: str
    sizes: Dict[str, Params]
    make_reference: Callable[[Params], torch.nn.Module]
    make_inputs: Callable[[Params], Inputs]
    make_fused: Optional[Callable[[torch.nn.Module], Callable]] = None
    peers: Dict[str, Peer] = field(default_factory=dict)
    targets_us: Dict[str, float] = field(default_factory=dict)
    train_loss: Optional[Callable[[Any], torch.Tensor]] = None
    make_trainable: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None
    make_fused_trainable: Optional[Callable[[torch.nn.Module], Callable]] = None
    train_speedup_targets: Dict[str, Dict[str, float]] = field(default_factory=dict)
    # parameters -> the bytes a fused call must move at least (its inputs read
    # once, its outputs written once); the driver reports GB/s from it.
    bytes_moved: Optional[Callable[[Params], int]] = None
    # (atol, rtol) of the forward variants' check against eager; None: ATOL, RTOL.
    # Lower-precision workloads set it from the dtype's own rounding.
    tolerance: Optional[Tuple[float, float]] = None
    # (reference, inputs) -> the outputs of a float64 run on the same input
    # values: each variant's row then reports its max abs error against them
    # (``err_vs_float64``, per output), the accuracy of a lower-precision run.
    exact: Optional[Callable[[torch.nn.Module, Inputs], Tuple[torch.Tensor, ...]]] = None

    def fused_available(self) -> bool:
        """Whether ``fused_ops.nn`` provides this workload's fused module (or,
        for a workload with ``make_fused``, ``fused_ops`` its function)."""
        import fused_ops.nn

        if self.make_fused is not None and hasattr(fused_ops, self.fused_name):
            return True
        return hasattr(fused_ops.nn, self.fused_name)

    def build_fused(self, reference: torch.nn.Module) -> Callable:
        """The fused module for ``reference`` (sharing its parameters)."""
        if self.make_fused is not None:
            return self.make_fused(reference)
        import fused_ops.nn

        return getattr(fused_ops.nn, self.fused_name).from_reference(reference)

    def build_trainable(self, reference: torch.nn.Module) -> torch.nn.Module:
        """The module a training step trains, made from a fresh reference."""
        return reference if self.make_trainable is None else self.make_trainable(reference)

    def build_fused_trainable(self, trainable: torch.nn.Module) -> Callable:
        """The fused module sharing the parameters of ``trainable``."""
        if self.make_fused_trainable is not None:
            return self.make_fused_trainable(trainable)
        return self.build_fused(trainable)


@dataclass(frozen=True)
class Peer:
    """A third-party implementation of a workload, timed as another baseline.

    Attributes:
        requires: top-level module that must be importable (else skipped).
        make: reference module -> callable taking the workload's inputs.
    """

    requires: str
    make: Callable[[torch.nn.Module], Callable]
    # False: timed only, not compared with eager (another random draw of the same distribution).
    checked: bool = True

    def available(self) -> bool:
        """Whether the peer's library is installed."""
        return importlib.util.find_spec(self.requires) is not None


def shape_label(params: Params) -> str:
    """Compact ``"N=4096,D=16,K=3"`` label of a parameter dict."""
    return ",".join(f"{key}={value}" for key, value in params.items())


# --- importance sampling ----------------------------------------------------


def _is_reference(p: Params) -> torch.nn.Module:
    from fused_ops.reference import ImportanceSampler

    return ImportanceSampler(p["D"], num_components=p["K"])


def _is_inputs(p: Params) -> Inputs:
    return (torch.randn(p["N"], p["D"]) * 3.0,)


IS_TENSORS = ("mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std")


def _is_trainable(module: torch.nn.Module) -> torch.nn.Module:
    """Turn the sampler's five buffers into ``nn.Parameter``s (same names, values)."""
    for name in IS_TENSORS:
        value = getattr(module, name)
        delattr(module, name)
        module.register_parameter(name, torch.nn.Parameter(value.detach().clone()))
    return module


def _is_fused_trainable(trainable: torch.nn.Module) -> torch.nn.Module:
    """A ``fused_ops.nn.ImportanceSampler`` whose five tensors are ``trainable``'s parameters."""
    import fused_ops.nn

    num_components, dim = trainable.mix_mus.shape
    fused = fused_ops.nn.ImportanceSampler(dim, num_components=num_components).to(trainable.mix_mus.device)
    for name in IS_TENSORS:
        delattr(fused, name)
        fused.register_parameter(name, getattr(trainable, name))
    return fused


def _is_loss(outputs: Any) -> torch.Tensor:
    weighted_mean, ess = outputs
    return weighted_mean.square().sum() - ess.log()


# --- flow ODE -----------------------------------------------------------------


def _flow_reference(p: Params) -> torch.nn.Module:
    from fused_ops.reference import FlowODE

    return FlowODE(p["D"], p["steps"])


def _flow_inputs(p: Params) -> Inputs:
    return (torch.randn(p["B"], p["D"]),)


def _flow_loss(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean()


def _flow_torchdiffeq(reference: torch.nn.Module) -> Callable:
    """``torchdiffeq.odeint`` (fixed-grid Euler) computing what ``FlowODE`` computes.

    torchdiffeq's Euler evaluates the field at the start of each step, while
    the reference evaluates it at the step's midpoint time, so the ODE function
    shifts ``t`` by half a step.
    """
    import torchdiffeq

    steps = reference.num_steps
    velocity = reference.velocity
    half_step = 0.5 / steps
    grid = torch.linspace(0.0, 1.0, steps + 1, device=reference.dt.device, dtype=reference.dt.dtype)

    def func(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t_mid = (t + half_step).to(x.dtype).reshape(1, 1).expand(x.shape[0], 1)
        return velocity(torch.cat([x, t_mid], dim=-1))

    def solve(x0: torch.Tensor) -> torch.Tensor:
        return torchdiffeq.odeint(func, x0, grid, method="euler")[-1]

    return solve


# --- VAE ----------------------------------------------------------------------


def _vae_reference(p: Params) -> torch.nn.Module:
    from fused_ops.reference import VAE

    return VAE(p["I"], p["H"], p["L"])


def _vae_inputs(p: Params) -> Inputs:
    x = torch.rand(p["B"], p["I"])
    eps = torch.randn(p["B"], p["L"])
    return x, eps


def _vae_loss(outputs: Any) -> torch.Tensor:
    elbo = outputs[0]
    return -elbo.mean()


# The VAE in bfloat16 (parameters and inputs): eager and compiled bfloat16
# PyTorch against fused_ops' bfloat16 path (tiled_bf16 on CUDA at B >= 2048),
# each run's error against float64 on the same values reported.


def _vae_bf16_reference(p: Params) -> torch.nn.Module:
    return _vae_reference(p).to(torch.bfloat16)


def _vae_bf16_inputs(p: Params) -> Inputs:
    return tuple(t.to(torch.bfloat16) for t in _vae_inputs(p))


def _float64_run(reference: torch.nn.Module, inputs: Inputs) -> Tuple[torch.Tensor, ...]:
    import copy

    with torch.no_grad():
        return tuple(copy.deepcopy(reference).double()(*(t.double() for t in inputs)))


# pytorch/examples' VAE (vae/main.py): the model as the example writes it,
# with its loss terms per sample (the example's loss_function is their sum
# over the batch, -elbo.sum()); inputs are the example's MNIST batch shape.


class _ExamplesELBO(torch.nn.Module):
    """``(elbo, recon, kl)`` per sample of pytorch/examples' VAE (``model``)."""

    def __init__(self, p: Params):
        super().__init__()
        from fused_ops.reference import ExamplesVAE

        self.model = ExamplesVAE(p["I"], p["H"], p["L"])

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        recon_x, mu, logvar = self.model(x, eps)
        target = x.view(-1, recon_x.shape[-1])
        recon = torch.nn.functional.binary_cross_entropy(recon_x, target, reduction="none").sum(-1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
        return -(recon + kl), recon, kl


def _examples_inputs(p: Params) -> Inputs:
    return torch.rand(p["B"], 1, 28, 28), torch.randn(p["B"], p["L"])


def _examples_fused(reference: torch.nn.Module) -> Callable:
    import fused_ops.nn

    return fused_ops.nn.VAE.from_pytorch_examples(reference.model)


def _examples_loss(outputs: Any) -> torch.Tensor:
    return -outputs[0].sum()


# A Gaussian VAE with two hidden layers each side (784-512-256-64, ReLU), as
# the MSE VAEs users write it: their own layers and mse_loss(reduction="sum")
# per sample; fused through VAE.from_modules (fused_ops.vae_mlp_elbo).


class _GaussianMLPVAE(torch.nn.Module):
    """``(elbo, recon, kl)`` per sample of a two-hidden-layer Gaussian VAE."""

    def __init__(self, p: Params):
        super().__init__()
        nn = torch.nn
        i, h1, h2, l_ = p["I"], p["H1"], p["H2"], p["L"]
        self.encoder = nn.Sequential(nn.Linear(i, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU())
        self.fc_mu = nn.Linear(h2, l_)
        self.fc_logvar = nn.Linear(h2, l_)
        self.decoder = nn.Sequential(nn.Linear(l_, h2), nn.ReLU(), nn.Linear(h2, h1), nn.ReLU(), nn.Linear(h1, i))

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        h = self.encoder(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        recon_x = self.decoder(mu + torch.exp(0.5 * logvar) * eps)
        recon = torch.nn.functional.mse_loss(recon_x, x, reduction="none").sum(-1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
        return -(recon + kl), recon, kl


def _gaussian_mlp_fused(reference: torch.nn.Module) -> Callable:
    import fused_ops.nn

    r = reference
    return fused_ops.nn.VAE.from_modules(r.encoder, r.fc_mu, r.fc_logvar, r.decoder, likelihood="gaussian")


# --- SNIS of given log weights ------------------------------------------------


def _snis_reference(p: Params) -> torch.nn.Module:
    from fused_ops.reference import SNIS

    return SNIS(moments=p["D"] > 0)


def _snis_inputs(p: Params) -> Inputs:
    batch = (p["B"],) if p["B"] > 1 else ()
    lw = torch.randn(*batch, p["N"]) * 3.0
    return (lw,) if p["D"] == 0 else (lw, torch.randn(*batch, p["N"], p["D"]))


def _snis_bytes(p: Params) -> int:
    # Read: log weights (and samples); written: normalised log weights (and
    # the small per-problem outputs, counted too).
    n, b, d = p["N"], p["B"], p["D"]
    return 4 * (2 * b * n + b * n * d + b * (2 + 2 * d))


def _snis_loop(reference: torch.nn.Module) -> Callable:
    import fused_ops

    def loop(lw: torch.Tensor, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        outs = [fused_ops.snis(lw[i], x[i], reference.moments) for i in range(lw.shape[0])]
        return tuple(torch.stack(o) for o in zip(*outs))

    return loop


def _snis_vmap(reference: torch.nn.Module) -> Callable:
    from fused_ops.reference import snis

    return torch.vmap(lambda lw, x: snis(lw, x, reference.moments))
# --- importance sampling, batched, mixture proposal, evidence ------------------


class _ISBatched(torch.nn.Module):
    """B independent problems: a target mixture and a proposal mixture per
    problem (buffers); ``forward(samples [B, N, D])`` is the plain batched
    torch program (fused_ops.reference.importance_sampling_batched)."""

    def __init__(self, p: Params):
        super().__init__()
        b, d, k, kq = p["B"], p["D"], p["K"], p["Kq"]
        self.register_buffer("mix_weights", torch.softmax(torch.randn(b, k), -1))
        self.register_buffer("mix_mus", torch.randn(b, k, d) * 2.0)
        self.register_buffer("mix_stds", torch.rand(b, k, d) + 0.5)
        self.register_buffer("q_weights", torch.softmax(torch.randn(b, kq), -1))
        self.register_buffer("q_mus", torch.randn(b, kq, d) * 0.5)
        self.register_buffer("q_stds", torch.rand(b, kq, d) + 2.5)

    def params(self) -> Tuple[torch.Tensor, ...]:
        return (self.mix_weights, self.mix_mus, self.mix_stds, self.q_weights, self.q_mus, self.q_stds)

    def forward(self, samples: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        from fused_ops.reference import importance_sampling_batched

        return importance_sampling_batched(samples, *self.params())


def _isb_inputs(p: Params) -> Inputs:
    return (torch.randn(p["B"], p["N"], p["D"]) * 3.0,)


def _isb_fused(reference: torch.nn.Module) -> Callable:
    import fused_ops

    mw, mm, ms, qw, qm, qs = reference.params()
    return lambda x: fused_ops.importance_sampling(x, mw, mm, ms, qm, qs, q_weights=qw, return_evidence=True)


def _isb_loop(reference: torch.nn.Module) -> Callable:
    import fused_ops

    mw, mm, ms, qw, qm, qs = reference.params()

    def loop(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        outs = [fused_ops.importance_sampling(x[i], mw[i], mm[i], ms[i], qm[i], qs[i], q_weights=qw[i],
                                              return_evidence=True) for i in range(x.shape[0])]
        return tuple(torch.stack(o) for o in zip(*outs))

    return loop


def _isb_vmap(reference: torch.nn.Module) -> Callable:
    """torch.vmap over the problems of the per-problem program a user writes
    with torch.distributions (MixtureSameFamily target and proposal)."""
    import math

    from torch import distributions as dist

    def one(x, mw, mm, ms, qw, qm, qs):
        def mixture(w, mu, std):
            comp = dist.Independent(dist.Normal(mu, std, validate_args=False), 1, validate_args=False)
            return dist.MixtureSameFamily(dist.Categorical(probs=w, validate_args=False), comp, validate_args=False)

        lw = mixture(mw, mm, ms).log_prob(x) - mixture(qw, qm, qs).log_prob(x)
        lse = torch.logsumexp(lw, 0)
        w = torch.exp(lw - lse)
        return (w[:, None] * x).sum(0), 1.0 / (w**2).sum(), lw - lse, lse - math.log(x.shape[0])

    batched = torch.vmap(one)
    return lambda x: batched(x, *reference.params())


def _isb_bytes(p: Params) -> int:
    # Read: the samples (and the small parameters); written: the log weights
    # and the per-problem outputs.
    b, n, d, k, kq = p["B"], p["N"], p["D"], p["K"], p["Kq"]
    return 4 * (b * n * d + b * (k + kq) * (2 * d + 1) + b * n + b * (d + 2))


# --- resampling ---------------------------------------------------------------


class _Resample(torch.nn.Module):
    """``fn(log_weights, uniforms, N, method)``: indices [N] from log weights [N]."""

    def __init__(self, fn: Callable, method: str):
        super().__init__()
        self.fn, self.method = fn, method

    def forward(self, log_weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return self.fn(log_weights, uniforms, log_weights.shape[-1], self.method)


def _resample_reference(method: str) -> Callable[[Params], torch.nn.Module]:
    def make(p: Params) -> torch.nn.Module:
        from fused_ops.reference import resample  # cumsum + searchsorted in float64

        return _Resample(resample, method)

    return make


def _resample_inputs(method: str) -> Callable[[Params], Inputs]:
    def make(p: Params) -> Inputs:
        count = 1 if method == "systematic" else p["N"]
        return torch.randn(p["N"]) * 2, torch.rand(count, dtype=torch.float64)

    return make


def _resample_fused(reference: torch.nn.Module) -> Callable:
    import fused_ops

    return _Resample(lambda lw, u, m, method: fused_ops.resample(lw, m, method, uniforms=u), reference.method)


def _torch_multinomial(reference: torch.nn.Module) -> Callable:
    """``torch.multinomial`` of the weights, N draws with replacement (it
    refuses more than 2**24 categories)."""

    def draw(log_weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return torch.multinomial((log_weights - log_weights.max()).exp(), log_weights.shape[-1], replacement=True)

    return draw


_RESAMPLE_SIZES = {"default": {"N": 1 << 20}, "large": {"N": 1 << 26}}


WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="importance_sampling",
            op="importance_sampling",
            fused_name="ImportanceSampler",
            sizes={
                "default": {"N": 4096, "D": 16, "K": 3},
                "large": {"N": 1_048_576, "D": 16, "K": 3},
            },
            make_reference=_is_reference,
            make_inputs=_is_inputs,
            targets_us={"large": 25.0},
            train_loss=_is_loss,
            make_trainable=_is_trainable,
            make_fused_trainable=_is_fused_trainable,
        ),
        Workload(
            name="flow",
            op="flow_euler",
            fused_name="FlowODE",
            sizes={
                "default": {"B": 8, "D": 64, "steps": 32},
                "large": {"B": 4096, "D": 64, "steps": 32},
            },
            make_reference=_flow_reference,
            make_inputs=_flow_inputs,
            peers={"torchdiffeq": Peer(requires="torchdiffeq", make=_flow_torchdiffeq)},
            targets_us={"default": 40.0, "large": 250.0},
            train_loss=_flow_loss,
        ),
        Workload(
            name="vae",
            op="vae_elbo",
            fused_name="VAE",
            sizes={
                "default": {"B": 128, "I": 784, "H": 256, "L": 32},
                "large": {"B": 8192, "I": 784, "H": 256, "L": 32},
            },
            make_reference=_vae_reference,
            make_inputs=_vae_inputs,
            targets_us={"large": 80.0},
            train_loss=_vae_loss,
            # Issue 5: the fused training step >= 3x eager and faster than
            # compile reduce-overhead at B=128; >= 1.3x eager at B=8192.
            train_speedup_targets={
                "default": {EAGER: 3.0, COMPILE_RO: 1.0},
                "large": {EAGER: 1.3},
            },
        ),
        # The "VAE B=8192" in bfloat16 (784-256-32, Bernoulli).  Checked
        # against eager bfloat16 within the bfloat16 program's own error (1 +
        # 2^-4 relative: the recon sums of 784 terms are ~550, bfloat16's ulp there
        # is 4); the accuracy that matters is err_vs_float64.
        Workload(
            name="vae_bf16",
            op="vae_elbo",
            fused_name="VAE",
            sizes={
                "default": {"B": 2048, "I": 784, "H": 256, "L": 32},
                "large": {"B": 8192, "I": 784, "H": 256, "L": 32},
            },
            make_reference=_vae_bf16_reference,
            make_inputs=_vae_bf16_inputs,
            tolerance=(1.0, 2.0**-4),
            exact=_float64_run,
        ),
        Workload(
            name="vae_examples",
            op="vae_elbo",
            fused_name="VAE",
            sizes={
                "default": {"B": 128, "I": 784, "H": 400, "L": 20},
                "large": {"B": 8192, "I": 784, "H": 400, "L": 20},
            },
            make_reference=_ExamplesELBO,
            make_inputs=_examples_inputs,
            make_fused=_examples_fused,
            train_loss=_examples_loss,
        ),
        # Issue 29: a Gaussian 784-512-256-64 VAE (two hidden layers each
        # side), forward and training; target >= 2x compile reduce-overhead's
        # forward at B=128 on the H200.
        Workload(
            name="vae_mlp_gaussian",
            op="vae_mlp_elbo",
            fused_name="VAE",
            sizes={
                "default": {"B": 128, "I": 784, "H1": 512, "H2": 256, "L": 64},
                "large": {"B": 8192, "I": 784, "H1": 512, "H2": 256, "L": 64},
            },
            make_reference=_GaussianMLPVAE,
            make_inputs=_vae_inputs,
            make_fused=_gaussian_mlp_fused,
            train_loss=_vae_loss,
        ),
        # Issue 28: bandwidth-bound; >= 70% of the H200's measured read
        # bandwidth at N = 2^26 (reported as GB/s of bytes_moved).
        Workload(
            name="snis",
            op="snis",
            fused_name="SNIS",
            sizes={
                "default": {"B": 1, "N": 1 << 20, "D": 0},
                "large": {"B": 1, "N": 1 << 26, "D": 0},
            },
            make_reference=_snis_reference,
            make_inputs=_snis_inputs,
            bytes_moved=_snis_bytes,
        ),
        # 1024 independent problems in one call, against a Python loop of
        # fused calls and torch.vmap of the plain per-problem code (issue 28:
        # >= 20x the loop on the H200).
        Workload(
            name="snis_batched",
            op="snis",
            fused_name="SNIS",
            sizes={"default": {"B": 1024, "N": 4096, "D": 8}},
            make_reference=_snis_reference,
            make_inputs=_snis_inputs,
            peers={"loop": Peer(requires="torch", make=_snis_loop),
                   "vmap": Peer(requires="torch", make=_snis_vmap)},
            bytes_moved=_snis_bytes,
        ),
        # importance_sampling with B independent targets and mixture proposals
        # and the log evidence, against a Python loop of calls and torch.vmap
        # of the plain torch.distributions code (issue 28: >= 20x the loop).
        Workload(
            name="importance_sampling_batched",
            op="importance_log_weights",
            fused_name="importance_sampling",
            # "large" is the 1024 problems x N = 4096 (a CPU run of its
            # eager program takes seconds: the smoke test runs "default").
            sizes={"default": {"B": 64, "N": 4096, "D": 16, "K": 3, "Kq": 2},
                   "large": {"B": 1024, "N": 4096, "D": 16, "K": 3, "Kq": 2}},
            make_reference=_ISBatched,
            make_inputs=_isb_inputs,
            make_fused=_isb_fused,
            peers={"loop": Peer(requires="torch", make=_isb_loop),
                   "vmap": Peer(requires="torch", make=_isb_vmap)},
            bytes_moved=_isb_bytes,
        ),
        # Resampling N indices from N log weights (M = N); eager is the
        # cumsum + searchsorted program (fused_ops.reference.resample).
        Workload(
            name="resample",
            op="resample",
            fused_name="resample",
            sizes=_RESAMPLE_SIZES,
            make_reference=_resample_reference("systematic"),
            make_inputs=_resample_inputs("systematic"),
            make_fused=_resample_fused,
        ),
        Workload(
            name="resample_multinomial",
            op="resample",
            fused_name="resample",
            sizes=_RESAMPLE_SIZES,
            make_reference=_resample_reference("multinomial"),
            make_inputs=_resample_inputs("multinomial"),
            make_fused=_resample_fused,
            peers={"torch.multinomial": Peer(requires="torch", make=_torch_multinomial, checked=False)},
        ),
    )
}

# The ODE sampler at real-model shapes (bench/ode_workloads.py).
from .ode_workloads import make_ode_workloads  # noqa: E402

WORKLOADS.update((w.name, w) for w in make_ode_workloads())


# ----------------------------------------------------------------------------
# Training steps
# ----------------------------------------------------------------------------

# The benchmark times thousands of steps; a tiny learning rate keeps the
# parameters (positive scales of the importance sampler, say) where they were.
TRAIN_LR = 1e-6


def make_optimizer(name: str, params: Sequence[torch.nn.Parameter]) -> Optional[torch.optim.Optimizer]:
    """``--optimizer``: ``None`` for "none", else SGD or Adam (default foreach implementation)."""
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=TRAIN_LR)
    if name == "adam":
        return torch.optim.Adam(params, lr=TRAIN_LR)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def make_train_step(
    forward: Callable,
    params: Sequence[torch.nn.Parameter],
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: str,
    compile_kwargs: Optional[Dict[str, Any]] = None,
) -> Callable[..., Tuple[torch.Tensor, ...]]:
    """A training step ``(*inputs) -> (loss, *grads)`` of ``forward`` over ``params``.

    zero_grad (set to ``None``), forward + loss, ``loss.backward()`` and the
    optional optimizer step.  With ``compile_kwargs`` the forward + loss
    function is ``torch.compile``d (AOTAutograd compiles its backward too);
    backward and optimizer are called eagerly.  Under reduce-overhead every
    step starts with ``torch.compiler.cudagraph_mark_step_begin()``.
    """
    params = list(params)

    def forward_loss(*inputs: torch.Tensor) -> torch.Tensor:
        return loss_fn(forward(*inputs))

    if compile_kwargs is not None:
        torch._dynamo.reset()
        forward_loss = torch.compile(forward_loss, **compile_kwargs)
    cudagraphs = (compile_kwargs or {}).get("mode") == "reduce-overhead"
    opt = make_optimizer(optimizer, params)

    def step(*inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            p.grad = None
        loss = forward_loss(*inputs)
        loss.backward()
        if opt is not None:
            opt.step()
        return (loss.detach(), *(p.grad if p.grad is not None else torch.zeros_like(p) for p in params))

    return step

