"""Benchmark driver for ``fused_ops`` (protocol: DESIGN.md section 5).

For every workload and size it times, in one process and one run:

* ``eager``       the reference module (``fused_ops.reference``),
* ``compile``     ``torch.compile(reference)`` (default mode),
* ``compile_ro``  ``torch.compile(reference, mode="reduce-overhead")`` (CUDA only),
* peers           other implementations where installed (``torchdiffeq`` for flow),
* ``fused``       the fused module, called eagerly (no CUDA graph),

all under ``torch.no_grad()``.  Each callable is warmed up, then timed with
``torch.utils.benchmark.Timer.blocked_autorange`` (back-to-back calls with an
accelerator synchronisation around each block); the reported figure is the
median microseconds per call.  Before timing, every variant's outputs are
compared with the eager reference (``atol = rtol = 1e-4``).

Results go to stdout (a table) and to ``<out>/<device_slug>.{json,md,png}``.

Training-step rows (``--train``; written to ``<out>/<device_slug>-train.*``,
workloads ``vae_train``, ``flow_train``, ``importance_sampling_train``) time a
training step instead of a forward call, at the same sizes.  A step is::

    for p in params: p.grad = None          # zero_grad(set_to_none=True)
    loss = loss_fn(module(*inputs))         # forward + scalar loss
    loss.backward()
    optimizer.step()                        # only with --optimizer sgd|adam

with the default ``--optimizer none`` timing forward + backward (the part the
fused ops change; an optimizer step costs every variant the same).  Each
variant trains its own deep copy of one seeded reference module, so all start
from the same parameters.  Variants: ``eager`` (the reference module),
``compile`` / ``compile_ro`` (``torch.compile`` of the forward + loss function,
default / ``reduce-overhead`` mode; its backward is the AOTAutograd-compiled
backward, run by the eager ``loss.backward()`` call; the zero_grad and
optimizer step stay eager), peers, and ``fused`` (the fused module's forward
with its registered autograd backward).  The losses are ``-elbo.mean()``
(VAE), ``x.square().mean()`` of the ODE's output (flow) and
``weighted_mean.square().sum() - log(ess)`` (importance sampling, whose
``q_mu``, ``q_std`` and mixture tensors become ``nn.Parameter``s on both
modules).  Every variant's loss and parameter gradients of its first step are
checked against eager's (atol = rtol = 1e-3).  The VAE rows carry the issue's
relative targets (``x eager`` / ``x compile_ro`` of the fused step).

Usage, from the repository root::

    python -m bench.benchmark                      # all implemented workloads, all sizes
    python -m bench.benchmark --device cpu --quick # smoke test
    python -m bench.benchmark --ops flow --sizes default --no-compile
    python -m bench.benchmark --train                      # training-step rows
    python -m bench.benchmark --train --optimizer adam --ops vae
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.benchmark as torch_benchmark

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

if __package__ in (None, ""):
    # Run as ``python bench/benchmark.py``: make ``bench`` and an uninstalled
    # ``fused_ops`` checkout importable.
    sys.path.insert(0, str(REPO_ROOT))

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
        sizes: size name (``"default"``, ``"large"``) -> parameters.
        make_reference: parameters -> reference ``nn.Module`` (on CPU; the
            driver seeds torch first and moves it to the device).
        make_inputs: parameters -> tuple of CPU input tensors, passed
            positionally to every variant.
        make_fused: reference module (already on the device) -> fused module.
            Defaults to ``fused_ops.nn.<fused_name>.from_reference``.
        peers: other implementations timed as baselines, by name.
        targets_us: size name -> DESIGN.md section 7 target (H200, CUDA).
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

    def fused_available(self) -> bool:
        """Whether ``fused_ops.nn`` provides this workload's fused module."""
        import fused_ops.nn

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


WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="importance_sampling",
            fused_name="ImportanceSampler",
            sizes={
                "default": {"N": 4096, "D": 16, "K": 3},
                "large": {"N": 1_048_576, "D": 16, "K": 3},
            },
            make_reference=_is_reference,
            make_inputs=_is_inputs,
            targets_us={"default": 15.0, "large": 30.0},
            train_loss=_is_loss,
            make_trainable=_is_trainable,
            make_fused_trainable=_is_fused_trainable,
        ),
        Workload(
            name="flow",
            fused_name="FlowODE",
            sizes={
                "default": {"B": 8, "D": 64, "steps": 32},
                "large": {"B": 4096, "D": 64, "steps": 32},
            },
            make_reference=_flow_reference,
            make_inputs=_flow_inputs,
            peers={"torchdiffeq": Peer(requires="torchdiffeq", make=_flow_torchdiffeq)},
            targets_us={"default": 60.0, "large": 450.0},
            train_loss=_flow_loss,
        ),
        Workload(
            name="vae",
            fused_name="VAE",
            sizes={
                "default": {"B": 128, "I": 784, "H": 256, "L": 32},
                "large": {"B": 8192, "I": 784, "H": 256, "L": 32},
            },
            make_reference=_vae_reference,
            make_inputs=_vae_inputs,
            targets_us={"default": 20.0, "large": 120.0},
            train_loss=_vae_loss,
            # Issue 5: the fused training step >= 3x eager and faster than
            # compile reduce-overhead at B=128; >= 1.3x eager at B=8192.
            train_speedup_targets={
                "default": {EAGER: 3.0, COMPILE_RO: 1.0},
                "large": {EAGER: 1.3},
            },
        ),
    )
}


# ----------------------------------------------------------------------------
# Measuring one variant
# ----------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def as_tuple(outputs: Any) -> Tuple[torch.Tensor, ...]:
    """Normalise a module's output (tensor or tuple of tensors) to a tuple."""
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def snapshot(outputs: Any) -> Tuple[torch.Tensor, ...]:
    """Detached copies of ``outputs``, safe from CUDA-graph buffer reuse."""
    return tuple(t.detach().clone() for t in as_tuple(outputs))


def compare(
    expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor], atol: float = ATOL, rtol: float = RTOL
) -> Tuple[bool, Optional[float], str]:
    """Check ``actual`` against ``expected`` output by output.

    Returns ``(match, max_abs_err, detail)``: ``match`` is true when every
    output has the same shape and is ``allclose`` (default atol = rtol =
    1e-4, NaNs equal); ``detail`` names the first offending output.
    """
    if len(expected) != len(actual):
        return False, None, f"{len(actual)} outputs, expected {len(expected)}"
    max_err = 0.0
    detail = ""
    match = True
    for i, (exp, act) in enumerate(zip(expected, actual)):
        if exp.shape != act.shape:
            return False, None, f"output {i}: shape {tuple(act.shape)}, expected {tuple(exp.shape)}"
        act = act.to(device=exp.device, dtype=exp.dtype)
        err = (act - exp).abs().nan_to_num(nan=0.0).max().item() if exp.numel() else 0.0
        max_err = max(max_err, err)
        if not torch.allclose(act, exp, atol=atol, rtol=rtol, equal_nan=True) and match:
            match = False
            detail = f"output {i}: max abs err {err:.3g}"
    return match, max_err, detail


def time_callable(fn: Callable, inputs: Inputs, min_run_time: float, label: str) -> Dict[str, Any]:
    """Median per-call time of ``fn(*inputs)`` via ``blocked_autorange``.

    The timer uses the current intra-op thread count (``Timer`` would default
    to one thread) and synchronises the accelerator around each block.
    """
    timer = torch_benchmark.Timer(
        stmt="fn(*inputs)",
        globals={"fn": fn, "inputs": inputs},
        num_threads=torch.get_num_threads(),
        label=label,
    )
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return {
        "median_us": measurement.median * 1e6,
        "iqr_us": measurement.iqr * 1e6,
        "mean_us": measurement.mean * 1e6,
        "blocks": len(measurement.times),
        "calls_per_block": measurement.number_per_run,
    }


def measure_variant(
    name: str,
    build: Callable[[], Callable],
    inputs: Inputs,
    device: torch.device,
    expected: Optional[Tuple[torch.Tensor, ...]],
    min_run_time: float,
    label: str,
    check_first_call: bool = False,
    tolerance: Tuple[float, float] = (ATOL, RTOL),
) -> Tuple[Dict[str, Any], Optional[Tuple[torch.Tensor, ...]]]:
    """Build, warm up, check and time one variant; never raises.

    Returns the variant's result record and (for use as the reference of the
    other variants) a snapshot of its outputs, or ``None`` on error.  The
    outputs checked are those of the call after warm-up, or with
    ``check_first_call`` (training steps that update the parameters) those of
    the first call.
    """
    result: Dict[str, Any] = {"status": "ok"}
    try:
        start = time.perf_counter()
        fn = build()
        warmup_calls = WARMUP_CALLS.get(name, DEFAULT_WARMUP_CALLS)
        first = snapshot(fn(*inputs)) if check_first_call else None
        for _ in range(warmup_calls - (1 if check_first_call else 0)):
            fn(*inputs)
        synchronize(device)
        result["warmup_s"] = round(time.perf_counter() - start, 3)  # includes compilation
        result["warmup_calls"] = warmup_calls

        outputs = first if first is not None else snapshot(fn(*inputs))
        if expected is not None and name != EAGER:
            match, max_err, detail = compare(expected, outputs, *tolerance)
            result.update(match=match, max_abs_err=max_err)
            if not match:
                result["mismatch"] = detail
                warn_mismatch(label, name, detail)

        result.update(time_callable(fn, inputs, min_run_time, f"{label} {name}"))
        return result, outputs
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the run
        message = f"{type(exc).__name__}: {exc}".strip()
        print(f"    !! {label} {name} failed: {message.splitlines()[0][:200]}", flush=True)
        return {
            "status": "error",
            "error": message,
            "traceback": traceback.format_exc(limit=8),
        }, None


def warn_mismatch(label: str, variant: str, detail: str) -> None:
    """Print a conspicuous warning that a variant disagrees with eager."""
    bar = "!" * 78
    tol = TRAIN_ATOL if label.split("/")[0].endswith(TRAIN_SUFFIX) else ATOL
    print(
        f"{bar}\n!! WARNING: {variant} output does NOT match the eager reference "
        f"(atol=rtol={tol:g})\n!!   {label}: {detail}\n{bar}",
        flush=True,
    )


# ----------------------------------------------------------------------------
# Running one workload/size
# ----------------------------------------------------------------------------


def compile_variants(
    compiled: Callable[..., Callable[[], Callable]], device: torch.device, use_compile: bool
) -> List[Tuple[str, Optional[Callable[[], Callable]], str]]:
    """The ``compile`` and ``compile_ro`` entries of a variant list, built by
    ``compiled(**torch_compile_kwargs)``; reduce-overhead (CUDA graphs) is
    CUDA only."""
    if not use_compile:
        return [(COMPILE, None, "disabled by --no-compile"), (COMPILE_RO, None, "disabled by --no-compile")]
    if device.type != "cuda":
        return [(COMPILE, compiled(), ""), (COMPILE_RO, None, "CUDA only")]
    return [(COMPILE, compiled(), ""), (COMPILE_RO, compiled(mode="reduce-overhead"), "")]


def variant_builders(
    workload: Workload, reference: torch.nn.Module, device: torch.device, use_compile: bool, fused_ok: bool
) -> List[Tuple[str, Optional[Callable[[], Callable]], str]]:
    """The variants of one case in display order: ``(name, build, skip_reason)``.

    ``build`` is ``None`` (and ``skip_reason`` set) for a variant that does
    not apply to this run.  Compiled variants reset dynamo first, so every
    case compiles from scratch, with static shapes.
    """

    def compiled_of(make: Callable[[], Callable], **kwargs: Any) -> Callable[[], Callable]:
        def build() -> Callable:
            torch._dynamo.reset()
            return torch.compile(make(), **kwargs)

        return build

    def compiled(**kwargs: Any) -> Callable[[], Callable]:
        return compiled_of(lambda: reference, **kwargs)

    variants: List[Tuple[str, Optional[Callable[[], Callable]], str]] = [(EAGER, lambda: reference, "")]
    variants += compile_variants(compiled, device, use_compile)
    for peer_name, peer in workload.peers.items():
        if peer.available():
            variants.append((peer_name, (lambda p=peer: p.make(reference)), ""))
        else:
            variants.append((peer_name, None, f"{peer.requires} not installed"))
    if fused_ok:
        variants.append((FUSED, lambda: workload.build_fused(reference), ""))
        if use_compile and device.type == "cuda":
            variants.append((FUSED_RO, compiled_of(lambda: workload.build_fused(reference), mode="reduce-overhead"), ""))
    else:
        variants.append((FUSED, None, f"fused_ops.nn.{workload.fused_name} not implemented"))
    return variants


# --- training steps -------------------------------------------------------------

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


def train_variant_builders(
    workload: Workload,
    reference: torch.nn.Module,
    device: torch.device,
    use_compile: bool,
    fused_ok: bool,
    optimizer: str,
) -> List[Tuple[str, Optional[Callable[[], Callable]], str]]:
    """Like :func:`variant_builders`, for training steps: each build trains
    its own deep copy of ``reference`` (made trainable), so every variant
    starts from the same parameters."""
    loss_fn = workload.train_loss
    assert loss_fn is not None

    def fresh() -> torch.nn.Module:
        return workload.build_trainable(copy.deepcopy(reference))

    def plain(
        make_forward: Callable[[torch.nn.Module], Callable], compile_kwargs: Optional[Dict[str, Any]] = None
    ) -> Callable[[], Callable]:
        def build() -> Callable:
            module = fresh()
            return make_train_step(make_forward(module), module.parameters(), loss_fn, optimizer, compile_kwargs)

        return build

    def compiled(**kwargs: Any) -> Callable[[], Callable]:
        return plain(lambda m: m, dict(kwargs))

    variants: List[Tuple[str, Optional[Callable[[], Callable]], str]] = [(EAGER, plain(lambda m: m), "")]
    variants += compile_variants(compiled, device, use_compile)
    for peer_name, peer in workload.peers.items():
        if peer.available():
            variants.append((peer_name, plain(peer.make), ""))
        else:
            variants.append((peer_name, None, f"{peer.requires} not installed"))
    if fused_ok:
        variants.append((FUSED, plain(workload.build_fused_trainable), ""))
        if use_compile and device.type == "cuda":
            variants.append((FUSED_RO, plain(workload.build_fused_trainable, {"mode": "reduce-overhead"}), ""))
    else:
        variants.append((FUSED, None, f"fused_ops.nn.{workload.fused_name} not implemented"))
    return variants


def run_case(
    workload: Workload,
    size: str,
    device: torch.device,
    min_run_time: float,
    use_compile: bool,
    train: bool = False,
    optimizer: str = "none",
) -> Dict[str, Any]:
    """Time every variant of ``workload`` at ``size``; return the result row.

    With ``train`` the variants are training steps (see the module
    docstring) and the row's workload is named ``<name>_train``.
    """
    params = workload.sizes[size]
    name_ = workload.name + (TRAIN_SUFFIX if train else "")
    label = f"{name_}/{size}"
    fused_ok = workload.fused_available()
    row: Dict[str, Any] = {
        "workload": name_,
        "size": size,
        "shape": shape_label(params),
        "params": dict(params),
        "fused_available": fused_ok,
        "variants": {},
    }
    if train:
        row["mode"] = "train"
        row["optimizer"] = optimizer
    print(f"[{label}] {row['shape']} on {device}", flush=True)

    try:
        torch.manual_seed(SEED)
        reference = workload.make_reference(params).to(device)
        reference = reference.train() if train else reference.eval()
        inputs = tuple(t.to(device) for t in workload.make_inputs(params))
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"    !! {label}: could not build the reference or inputs: {row['error']}", flush=True)
        return row

    if train:
        builders = train_variant_builders(workload, reference, device, use_compile, fused_ok, optimizer)
        context: Any = contextlib.nullcontext()
        check = {"check_first_call": optimizer != "none", "tolerance": (TRAIN_ATOL, TRAIN_RTOL)}
    else:
        builders = variant_builders(workload, reference, device, use_compile, fused_ok)
        context = torch.no_grad()
        check = {}
    expected: Optional[Tuple[torch.Tensor, ...]] = None
    with context:
        for name, build, skip_reason in builders:
            if build is None:
                row["variants"][name] = {"status": "skipped", "reason": skip_reason}
                continue
            result, outputs = measure_variant(name, build, inputs, device, expected, min_run_time, label, **check)
            if name == EAGER:
                expected = outputs
            row["variants"][name] = result
            if result["status"] == "ok":
                print(f"    {name:<12} {format_us(result['median_us']):>10} us", flush=True)
            release_memory(device)

    row["match"] = row["variants"][FUSED].get("match")
    row["speedup"] = speedups(row)
    del reference, inputs, expected
    release_memory(device)
    return row


def release_memory(device: torch.device) -> None:
    """Drop compiled graphs and cached blocks between variants and cases."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def speedups(row: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """``baseline_time / fused_time`` for every baseline timed in ``row``."""
    fused = row["variants"].get(FUSED, {})
    result: Dict[str, Optional[float]] = {}
    for name, res in row["variants"].items():
        if name in FUSED_VARIANTS or res.get("status") != "ok":
            continue
        result[name] = res["median_us"] / fused["median_us"] if fused.get("status") == "ok" else None
    return result


def add_targets(row: Dict[str, Any], workload: Workload) -> None:
    """Attach the DESIGN.md section 7 target (CUDA runs only) to ``row``.

    Training rows carry the workload's relative targets instead:
    ``speedup_targets`` {baseline: minimum speed-up of the fused step},
    ``meets_target`` (``None`` when a baseline was not timed) and
    ``target_misses`` (the baselines whose target was missed or not timed).
    """
    if row.get("mode") == "train":
        targets = workload.train_speedup_targets.get(row["size"])
        if not targets or "speedup" not in row:
            return
        row["speedup_targets"] = dict(targets)
        misses = []
        unknown = False
        for baseline, minimum in targets.items():
            ratio = row["speedup"].get(baseline)
            if ratio is None:
                unknown = True
                misses.append(f"{baseline} not timed")
            elif ratio < minimum:
                misses.append(f"{ratio:.2f}x {baseline}")
        row["target_misses"] = misses
        row["meets_target"] = None if unknown else not misses
        return
    target = workload.targets_us.get(row["size"])
    if target is None:
        return
    row["target_us"] = target
    fused = row["variants"].get(FUSED, {})
    if fused.get("status") == "ok":
        row["fused_over_target"] = fused["median_us"] / target
        row["meets_target"] = fused["median_us"] <= target


# ----------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------


def resolve_device(choice: str) -> torch.device:
    """Map ``--device`` to a ``torch.device`` (``auto``: CUDA when available)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda, but torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(choice)


def device_name(device: torch.device) -> str:
    """Human-readable device name: the GPU's name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_slug(device: torch.device) -> str:
    """File stem for the results: ``cpu``, or e.g. ``nvidia-h200`` on CUDA."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "cuda"


def git_state() -> Tuple[Optional[str], Optional[bool]]:
    """``(short commit, working tree dirty)`` of the repository, if available."""
    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
            )
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    if os.environ.get("FUSED_OPS_GIT_COMMIT"):
        # A copy of the tree on a remote GPU machine, whose .git (if any) may
        # not match the files: the caller names the commit it copied.
        return os.environ["FUSED_OPS_GIT_COMMIT"], None
    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def collect_metadata(device: torch.device, args: argparse.Namespace, min_run_time: float) -> Dict[str, Any]:
    """Environment and run settings recorded with the results."""
    import fused_ops

    commit, dirty = git_state()
    meta: Dict[str, Any] = {
        "device": device_name(device),
        "device_type": device.type,
        "device_slug": device_slug(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fused_ops_version": getattr(fused_ops, "__version__", None),
        "min_run_time_s": min_run_time,
        "compile": not args.no_compile,
        "sizes": args.sizes,
        "timer": "torch.utils.benchmark.Timer.blocked_autorange, median per call",
        "tolerance": {"atol": ATOL, "rtol": RTOL},
        "seed": SEED,
        "argv": list(args.argv),
    }
    if getattr(args, "train", False):
        meta["mode"] = "train"
        meta["optimizer"] = args.optimizer
        meta["train_lr"] = TRAIN_LR
        meta["tolerance"] = {"atol": TRAIN_ATOL, "rtol": TRAIN_RTOL}
    if device.type == "cuda":
        meta["device_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return meta


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------


def format_us(value: float) -> str:
    """Microseconds with precision that suits the magnitude."""
    if value < 10:
        return f"{value:.2f}"
    if value < 1000:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def ordered_variants(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """All variant names seen in ``rows``: eager, compile variants, peers, fused."""
    seen: List[str] = []
    for row in rows:
        for name in row["variants"]:
            if name not in seen:
                seen.append(name)
    peers = [n for n in seen if n not in BASE_VARIANTS and n not in FUSED_VARIANTS]
    return [n for n in BASE_VARIANTS if n in seen] + peers + [n for n in FUSED_VARIANTS if n in seen]


def variant_cell(row: Dict[str, Any], name: str) -> str:
    """Table cell for one variant: time, ``error``, ``n/a`` or ``-``."""
    res = row["variants"].get(name)
    if res is None:
        return "-"
    if res["status"] == "ok":
        cell = format_us(res["median_us"])
        return cell + " (MISMATCH)" if res.get("match") is False else cell
    return "error" if res["status"] == "error" else "n/a"


def build_table(rows: Sequence[Dict[str, Any]], cuda: bool) -> Tuple[List[str], List[List[str]]]:
    """Headers and cells shared by the stdout and markdown tables."""
    variants = ordered_variants(rows)
    baselines = [n for n in variants if n not in FUSED_VARIANTS]
    headers = ["workload", "size", "shape"] + list(variants)
    headers += [f"x {n}" for n in baselines]
    if cuda:
        headers += ["target", "fused/target"]
    cells = []
    for row in rows:
        line = [row["workload"], row["size"], row["shape"]]
        if "error" in row:
            line += ["error"] * (len(variants) + len(baselines))
        else:
            line += [variant_cell(row, n) for n in variants]
            for n in baselines:
                ratio = row["speedup"].get(n)
                line.append(f"{ratio:.2f}x" if ratio is not None else "-")
        if cuda and "speedup_targets" in row:
            line.append(", ".join(f">={v:g}x {k}" for k, v in row["speedup_targets"].items()))
            met = row.get("meets_target")
            misses = ", ".join(row["target_misses"])
            line.append(f"n/a ({misses})" if met is None else "met" if met else f"missed ({misses})")
        elif cuda:
            target = row.get("target_us")
            line.append(f"{target:g}" if target is not None else "-")
            over = row.get("fused_over_target")
            line.append("-" if over is None else f"{over:.2f} ({'met' if over <= 1 else 'missed'})")
        cells.append(line)
    return headers, cells


def format_text_table(headers: List[str], cells: List[List[str]]) -> str:
    """Plain aligned table for stdout."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)] if cells else [
        len(h) for h in headers
    ]
    left = {0, 1, 2}

    def fmt(line: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(c) for c in cells])


def format_markdown(meta: Dict[str, Any], rows: Sequence[Dict[str, Any]]) -> str:
    """The markdown report: metadata header, the table, then notes."""
    headers, cells = build_table(rows, meta["device_type"] == "cuda")
    commit = meta["git_commit"] or "unknown"
    if meta.get("git_dirty"):
        commit += " (uncommitted changes)"
    train = meta.get("mode") == "train"
    if train:
        timing = (
            f"- timing: back-to-back training steps (grads set to None, forward + loss, backward"
            + ("" if meta.get("optimizer", "none") == "none" else f", {meta['optimizer']} step")
            + f"), `blocked_autorange(min_run_time={meta['min_run_time_s']:g})`, after warm-up;"
            " `compile*` compile forward + loss (backward compiled by AOTAutograd); `fused` is eager"
            " (no CUDA graph), `fused_compile_ro` the fused module's forward + loss under"
            " torch.compile(mode=\"reduce-overhead\") (CUDA graphs of forward and backward)"
        )
        checked = f"first-step loss and parameter gradients checked against eager with atol = rtol = {TRAIN_ATOL:g}"
    else:
        timing = (
            f"- timing: back-to-back calls, `blocked_autorange(min_run_time={meta['min_run_time_s']:g})`,"
            " under `torch.no_grad()`, after warm-up; `fused` is an eager call (no CUDA graph),"
            " `fused_compile_ro` the fused module under torch.compile(mode=\"reduce-overhead\")"
        )
        checked = f"outputs checked against eager with atol = rtol = {ATOL:g}"
    lines = [
        f"# fused_ops {'training-step ' if train else ''}benchmark: {meta['device']}",
        "",
        f"- device: {meta['device']} ({meta['device_type']}"
        + (f", compute capability {meta['device_capability']}" if "device_capability" in meta else "")
        + ")",
        f"- torch {meta['torch_version']}, CUDA {meta['cuda_version']}, Python {meta['python_version']}",
        f"- date (UTC): {meta['date_utc']}",
        f"- git commit: {commit}",
        f"- CPU threads: {meta['num_threads']} of {meta['cpu_count']} cores; load average at start: "
        + (f"{meta['load_avg_1m']:.2f}" if meta["load_avg_1m"] is not None else "n/a")
        + f"; float32 matmul precision: {meta['float32_matmul_precision']}",
        timing,
        f"- {TABLE_LEGEND}; {checked}",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    if meta["device_type"] == "cuda" and train:
        lines += ["", "Targets: issue 5 (H200), minimum speed-up of the fused training step over the named "
                  "baseline (VAE rows only)."]
    elif meta["device_type"] == "cuda":
        lines += ["", "Targets: DESIGN.md section 7 (H200)."]
    notes = []
    for row in rows:
        for name, res in row["variants"].items():
            if res["status"] == "error":
                notes.append(f"- {row['workload']}/{row['size']} {name}: error: {res['error'].splitlines()[0]}")
            elif res.get("match") is False:
                notes.append(f"- {row['workload']}/{row['size']} {name}: output mismatch ({res['mismatch']})")
        if "error" in row:
            notes.append(f"- {row['workload']}/{row['size']}: {row['error']}")
    if notes:
        lines += ["", "Problems:", ""] + notes
    return "\n".join(lines) + "\n"


def write_outputs(meta: Dict[str, Any], rows: List[Dict[str, Any]], out_dir: Path) -> List[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (with matplotlib) ``<stem>.png``;
    ``<stem>`` is the device slug, plus ``-train`` for training rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / (meta["device_slug"] + ("-train" if meta.get("mode") == "train" else ""))
    data = {"metadata": meta, "results": rows}
    written = []
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    written.append(json_path)
    md_path = stem.with_suffix(".md")
    md_path.write_text(format_markdown(meta, rows))
    written.append(md_path)

    try:
        from bench.plot import plot_results
    except ImportError as exc:  # matplotlib missing
        print(f"warning: not drawing the chart ({exc})", file=sys.stderr)
    else:
        png_path = stem.with_suffix(".png")
        try:
            plot_results(data, png_path)
            written.append(png_path)
        except Exception as exc:  # noqa: BLE001 - a plotting problem must not lose the results
            print(f"warning: could not draw {png_path}: {exc}", file=sys.stderr)
    return written


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.benchmark",
        description="Time the fused_ops operators against eager PyTorch and torch.compile.",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device to run on (auto: cuda if available)")
    parser.add_argument("--ops", default=None,
                        help="comma-separated workloads (%s) or 'all'; default: every workload "
                             "with a fused implementation. Named workloads without one run the "
                             "baselines only." % ", ".join(WORKLOADS))
    parser.add_argument("--sizes", choices=("default", "large", "all"), default="all",
                        help="problem sizes to run (default: all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output directory (default: bench/results)")
    parser.add_argument("--min-run-time", type=float, default=None, metavar="SECONDS",
                        help="minimum timed seconds per variant (default: 1.0 on cuda, 0.5 on cpu; "
                             "overrides --quick)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile variants (quick checks)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny minimum run time ({QUICK_MIN_RUN_TIME:g} s) for smoke tests")
    parser.add_argument("--train", action="store_true",
                        help="time training steps (forward + loss + backward [+ optimizer step]) instead "
                             "of forward calls: rows <workload>_train, written to <slug>-train.*")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                        help="with --train: optimizer step included in the training step (default: none, "
                             "i.e. forward + backward)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.ops is not None:
        # Accept the training rows' names: "vae_train" is "vae" with --train.
        names = [n.strip() for n in args.ops.split(",") if n.strip()]
        if any(n.endswith(TRAIN_SUFFIX) for n in names):
            if not all(n.endswith(TRAIN_SUFFIX) for n in names):
                parser.error("--ops: do not mix training rows (*_train) and forward rows in one run")
            args.train = True
            args.ops = ",".join(n[: -len(TRAIN_SUFFIX)] for n in names)
    if args.optimizer != "none" and not args.train:
        parser.error("--optimizer needs --train")
    return args


def select_workloads(spec: Optional[str]) -> List[Workload]:
    """Workloads named by ``--ops`` (default: those with a fused module)."""
    if spec is None:
        return [w for w in WORKLOADS.values() if w.fused_available()]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"error: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in dict.fromkeys(names)]


def import_fused_ops() -> None:
    """Import the package, or exit with a hint on how to build it."""
    try:
        import fused_ops  # noqa: F401
        import fused_ops.nn  # noqa: F401
        import fused_ops.reference  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or the loader's RuntimeError
        raise SystemExit(
            f"error: cannot import fused_ops ({type(exc).__name__}: {exc}).\n"
            "Build it first: pip install --no-build-isolation -e ."
        ) from exc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    import_fused_ops()

    if args.min_run_time is not None:
        min_run_time = args.min_run_time
    elif args.quick:
        min_run_time = QUICK_MIN_RUN_TIME
    else:
        min_run_time = 1.0 if device.type == "cuda" else 0.5
    sizes = ("default", "large") if args.sizes == "all" else (args.sizes,)

    workloads = select_workloads(args.ops)
    if not workloads:
        print("No workload has a fused implementation yet; name some with --ops.", file=sys.stderr)
        return 1
    skipped = [w.name for w in WORKLOADS.values() if w not in workloads and not w.fused_available()]
    if args.ops is None and skipped:
        print(f"(skipping {', '.join(skipped)}: no fused implementation yet; name them in --ops "
              "to time the baselines)", flush=True)

    if args.train:
        no_train = [w.name for w in workloads if w.train_loss is None]
        workloads = [w for w in workloads if w.train_loss is not None]
        if no_train:
            print(f"(skipping {', '.join(no_train)}: no training step defined)", flush=True)
    meta = collect_metadata(device, args, min_run_time)
    print(f"device: {meta['device']} | torch {meta['torch_version']} (CUDA {meta['cuda_version']}) | "
          f"threads {meta['num_threads']} | min_run_time {min_run_time:g}s", flush=True)
    if meta["load_avg_1m"] is not None and meta["load_avg_1m"] >= 1.0:
        print(f"warning: load average {meta['load_avg_1m']:.2f}: other processes are running, "
              "timings (CPU ones especially) will be noisy", flush=True)

    rows = []
    for workload in workloads:
        for size in sizes:
            row = run_case(workload, size, device, min_run_time, use_compile=not args.no_compile,
                           train=args.train, optimizer=args.optimizer)
            if device.type == "cuda":
                add_targets(row, workload)
            rows.append(row)

    headers, cells = build_table(rows, device.type == "cuda")
    print(f"\n{TABLE_LEGEND}\n")
    print(format_text_table(headers, cells))
    mismatches = [f"{r['workload']}/{r['size']}" for r in rows if r.get("match") is False]
    if mismatches:
        print(f"\n!! fused output MISMATCH for: {', '.join(mismatches)}")
    for path in write_outputs(meta, rows, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
