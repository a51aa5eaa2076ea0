"""``fused_ops.ode_mlp`` and ``fused_ops.odeint_mlp``: fixed-grid Runge-Kutta
sampling of an MLP velocity field, with torchdiffeq's fixed-grid semantics.

- :func:`odeint_fixed`: torchdiffeq's fixed-grid ``odeint`` (methods
  ``euler``, ``midpoint``, ``heun2``, ``heun3``, ``rk4`` = the 3/8 rule; the
  time grid, ``step_size`` grids and linear interpolation of the outputs) for
  any ``func(t, y)``, in plain PyTorch: the semantics, and the reference the
  tests hold the fused op to.
- :func:`odeint_mlp`: the same integration of an MLP velocity field through
  the fused op; the time features (raw ``t`` or an embedding callable) and
  per-sample conditioning are folded into first-layer biases here, in
  PyTorch, so autograd reaches the embedding's parameters and the
  conditioning.
- :func:`ode_mlp`, :func:`ode_mlp_backward`: the ops themselves
  (``csrc/ode_mlp.h``), their fakes and autograd.
"""

import math
import struct

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _eager
from . import _dtypes
from ._checks import check, check_rank, check_same_float_dtype_and_device, check_size, shape_str

__all__ = ["METHODS", "ACTIVATIONS", "odeint_fixed", "odeint_mlp", "ode_mlp", "ode_mlp_backward", "mlp_velocity"]

_OP = torch.ops.fused_ops.ode_mlp.default
_BACKWARD_OP = torch.ops.fused_ops.ode_mlp_backward.default

#: Method name -> the op's code (csrc/ode_mlp.h, OdeMethod).
METHODS = {"euler": 0, "midpoint": 1, "heun2": 2, "heun3": 3, "rk4": 4}
_STAGES = {"euler": 1, "midpoint": 2, "heun2": 2, "heun3": 3, "rk4": 4}
#: Activation name -> the op's code (csrc/common/activations.h).
ACTIVATIONS = {"silu": 0, "relu": 1, "leaky_relu": 2, "elu": 3, "selu": 4, "gelu": 5, "gelu_tanh": 6,
               "softplus": 7, "tanh": 8, "sigmoid": 9}
_DEFAULT_PARAM = {"leaky_relu": 0.01, "elu": 1.0, "softplus": 1.0}
_TORCH_ACTS = {
    "silu": lambda a, p: F.silu(a), "relu": lambda a, p: F.relu(a),
    "leaky_relu": lambda a, p: F.leaky_relu(a, p), "elu": lambda a, p: F.elu(a, p),
    "selu": lambda a, p: F.selu(a), "gelu": lambda a, p: F.gelu(a),
    "gelu_tanh": lambda a, p: F.gelu(a, approximate="tanh"), "softplus": lambda a, p: F.softplus(a, p),
    "tanh": lambda a, p: torch.tanh(a), "sigmoid": lambda a, p: torch.sigmoid(a),
}
# code -> the torch.nn.functional form, as _TORCH_ACTS by name.
_TORCH_ACTS_BY_CODE = {ACTIVATIONS[name]: f for name, f in _TORCH_ACTS.items()}
MAX_LAYERS = 8

# ---------------------------------------------------------------------------
# torchdiffeq's fixed-grid semantics
# ---------------------------------------------------------------------------


def _step(method, func, t0, dt, t1, y0):
    """One step of torchdiffeq's fixed-grid solver (its expressions, in its order): ``dy``."""
    if method == "euler":
        return dt * func(t0, y0)
    if method == "midpoint":
        half_dt = 0.5 * dt
        f0 = func(t0, y0)
        return dt * func(t0 + half_dt, y0 + f0 * half_dt)
    if method == "heun2":
        k1 = func(t0, y0)
        k2 = func(t0 + dt * 1.0, y0 + dt * k1 * 1.0)
        return dt * (k1 * 0.5 + k2 * 0.5)
    if method == "heun3":
        k1 = func(t0, y0)
        k2 = func(t0 + dt * (1 / 3), y0 + dt * k1 * (1 / 3))
        k3 = func(t0 + dt * (2 / 3), y0 + dt * (k1 * 0.0 + k2 * (2 / 3)))
        return dt * (k1 * (1 / 4) + k2 * 0.0 + k3 * (3 / 4))
    k1 = func(t0, y0)  # rk4: the 3/8 rule (rk4_alt_step_func)
    k2 = func(t0 + dt * (1 / 3), y0 + dt * k1 * (1 / 3))
    k3 = func(t0 + dt * (2 / 3), y0 + dt * (k2 - k1 * (1 / 3)))
    k4 = func(t1, y0 + dt * (k1 - k2 + k3))
    return (k1 + 3 * (k2 + k3) + k4) * dt * 0.125


def _stage_times(method, t0, dt, t1):
    """The times at which ``_step`` evaluates ``func``, as it computes them: ``[S, stages]``."""
    if method == "euler":
        ts = [t0]
    elif method == "midpoint":
        ts = [t0, t0 + 0.5 * dt]
    elif method == "heun2":
        ts = [t0, t0 + dt * 1.0]
    elif method == "heun3":
        ts = [t0, t0 + dt * (1 / 3), t0 + dt * (2 / 3)]
    else:
        ts = [t0, t0 + dt * (1 / 3), t0 + dt * (2 / 3), t1]
    return torch.stack(ts, dim=1)


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def _check_t(t):
    """torchdiffeq's rules for ``t``; ``True`` when it is decreasing."""
    if not isinstance(t, Tensor) or t.dim() != 1:
        raise ValueError(f"t must be a 1-D tensor of times, got {t if not isinstance(t, Tensor) else shape_str(t)}")
    if t.numel() == 0:
        raise ValueError("t must hold at least one time, got an empty tensor")
    if not t.is_floating_point():
        raise ValueError(f"t must be a floating-point tensor, got {t.dtype}")
    reverse = t.numel() > 1 and bool(t[0] > t[1])
    if not torch.compiler.is_compiling():
        d = t[1:] - t[:-1]
        if not bool((d < 0).all() if reverse else (d > 0).all()):
            raise ValueError("t must be strictly increasing or strictly decreasing")
    return reverse


def time_grid(t, step_size=None):
    """torchdiffeq's solver grid for the output times ``t``, in the ascending
    frame (``-t`` for a decreasing ``t``, as torchdiffeq negates it): returns
    ``(grid, reverse)``.  With ``step_size``: ``arange(ceil((end - start) /
    step_size + 1)) * step_size + start`` with its last point set to the end."""
    reverse = _check_t(t)
    tt = -t if reverse else t
    if step_size is None:
        return tt, reverse
    if not (isinstance(step_size, (int, float)) and not isinstance(step_size, bool)) or not step_size > 0:
        raise ValueError(f"step_size must be a positive number, got {step_size!r}")
    niters = torch.ceil((tt[-1] - tt[0]) / step_size + 1).item()
    grid = torch.arange(0, niters, dtype=t.dtype, device=t.device) * step_size + tt[0]
    grid[-1] = tt[-1]
    return grid, reverse


def interpolate(states, grid, tt):
    """torchdiffeq's linear interpolation of the grid states ``[len(grid), ...]``
    at the times ``tt`` (ascending frame): for each ``tt[j]``, ``j >= 1``, the
    first grid interval ``(t0, t1]`` with ``t1 >= tt[j]``; ``y1`` when
    ``tt[j] == t1``, ``y0 + (tt[j] - t0) / (t1 - t0) * (y1 - y0)`` otherwise."""
    if states.shape[0] == tt.shape[0] and (grid.shape == tt.shape and bool((grid == tt).all())):
        return states
    i = torch.searchsorted(grid[1:].contiguous(), tt[1:].contiguous(), side="left") + 1
    t0, t1 = grid[i - 1], grid[i]
    y0, y1 = states[i - 1], states[i]
    shape = (-1,) + (1,) * (states.dim() - 1)
    slope = ((tt[1:] - t0) / (t1 - t0)).reshape(shape)
    out = torch.where((tt[1:] == t1).reshape(shape), y1,
                      torch.where((tt[1:] == t0).reshape(shape), y0, y0 + slope * (y1 - y0)))
    return torch.cat([states[:1], out], dim=0)


def odeint_fixed(func, y0, t, method="euler", step_size=None):
    r"""``torchdiffeq.odeint(func, y0, t, method=method, options={"step_size": step_size})``
    for the fixed-grid methods, in plain PyTorch: the same grid, the same
    step expressions, the same linear interpolation, so the results are
    bitwise torchdiffeq's.  ``func(t, y)`` gets a 0-d time tensor; ``t`` is
    1-D, strictly increasing or decreasing (a decreasing ``t`` runs in the
    negated frame, ``func`` called at ``-t`` and negated, as torchdiffeq does).
    Returns ``[len(t), *y0.shape]``."""
    _check_method(method)
    grid, reverse = time_grid(t, step_size)
    tt = -t if reverse else t
    f = (lambda s, y: -func(-s, y)) if reverse else func
    ys = [y0]
    y = y0
    for k in range(grid.shape[0] - 1):
        t0, t1 = grid[k], grid[k + 1]
        y = y + _step(method, f, t0, t1 - t0, t1, y)
        ys.append(y)
    return interpolate(torch.stack(ys), grid, tt)


# ---------------------------------------------------------------------------
# The MLP velocity field
# ---------------------------------------------------------------------------


def _act(activation, activation_param):
    """``(code, parameter)`` of an activation name (:data:`ACTIVATIONS`)."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    p = _DEFAULT_PARAM.get(activation, 0.0) if activation_param is None else float(activation_param)
    return ACTIVATIONS[activation], p


def _time_features(times, time_embedding):
    """``[E] -> [E, F]``: raw ``t`` (F = 1) or the embedding callable's output."""
    if time_embedding is None:
        return times[:, None]
    feats = time_embedding(times)
    if feats.dim() == 1:
        feats = feats[:, None]
    if feats.dim() != 2 or feats.shape[0] != times.shape[0]:
        raise ValueError(f"time_embedding must map times [E] to features [E, F], got shape {shape_str(feats)} "
                         f"for {times.shape[0]} times")
    return feats


def _split_first(w0, d, time, feats_width, cond_width):
    """Columns of the first layer's weight: (time, x, cond); the input is
    ``[t_feats, x, cond]`` (time first), ``[x, cond, t_feats]`` (last) or ``[x, cond]`` (none)."""
    f = feats_width if time != "none" else 0
    want = d + f + cond_width
    if w0.dim() != 2 or w0.shape[1] != want:
        raise ValueError(f"weights[0] must have {want} input columns (D = {d} state features"
                         + (f", {f} time features ({time})" if f else "")
                         + (f", {cond_width} conditioning features" if cond_width else "")
                         + f"), got shape {shape_str(w0)}")
    x0 = f if time == "first" else 0
    wt = w0[:, :f] if time == "first" else w0[:, d + cond_width:] if time == "last" else None
    return wt, w0[:, x0:x0 + d], w0[:, x0 + d:x0 + d + cond_width]


def mlp_velocity(weights, biases, activation="silu", activation_param=None, time="last", time_embedding=None,
                 cond=None):
    """The velocity field as a plain PyTorch ``func(t, y)`` (the program the
    fused op computes): ``nn.Linear`` layers ``weights[l] [out, in]``,
    ``biases[l] [out]`` or None, ``activation`` after every hidden layer, the
    input ``[emb(t), y, cond]`` / ``[y, cond, emb(t)]`` / ``[y, cond]``."""
    _, p = _act(activation, activation_param)
    act = _TORCH_ACTS[activation]

    def func(t, y):
        parts = [y] if cond is None else [y, cond]
        if time != "none":
            feats = _time_features(t.reshape(1).to(y.dtype), time_embedding).expand(y.shape[0], -1)
            parts = [feats] + parts if time == "first" else parts + [feats]
        h = torch.cat(parts, dim=-1)
        for l, (w, b) in enumerate(zip(weights, biases)):
            h = F.linear(h, w, b)
            if l + 1 < len(weights):
                h = act(h, p)
        return h

    return func


def odeint_mlp(x0, t, weights, biases, *, method="euler", activation="silu", activation_param=None, time="last",
               time_embedding=None, cond=None, step_size=None, return_all=True):
    r"""Integrate ``dy/dt = v(t, y)`` for an MLP velocity field ``v`` with
    torchdiffeq's fixed-grid semantics (:func:`odeint_fixed`), fused: on CUDA
    and on the CPU every step and stage runs in the fused op :func:`ode_mlp`.

    - ``x0 [B, D]``; ``t`` a 1-D tensor of output times (strictly increasing
      or decreasing, converted to ``x0``'s dtype and device), at least one.
    - ``weights``, ``biases``: the ``nn.Linear`` layers of ``v`` (1 to 8;
      ``[out, in]`` weights, ``[out]`` biases or None); the last gives ``D``
      outputs; ``activation`` (one of :data:`ACTIVATIONS`, with
      ``activation_param``: LeakyReLU's slope, ELU's alpha, Softplus's beta)
      after every hidden layer.
    - ``time``: ``"first"``, ``"last"`` or ``"none"``: where the time features
      enter the first layer's input ``[t_feats, x, cond]`` / ``[x, cond,
      t_feats]`` / ``[x, cond]``.  ``time_embedding``: None (the raw time, one
      feature) or a callable ``times [E] -> [E, F]`` (sinusoidal, Fourier, a
      small learned MLP), called once per call on every evaluation time.
    - ``cond [B, C]``: per-sample conditioning features, constant over time.
    - ``method``: one of :data:`METHODS`; ``step_size``: None (the grid is
      ``t``) or a positive number (torchdiffeq's grid, outputs linearly
      interpolated at ``t``).

    Returns ``[len(t), B, D]`` (``return_all``) or the state at ``t[-1]``
    ``[B, D]``.  All-bfloat16 (or all-float16) ``x0``, layers and ``cond``
    are integrated in float32 and the states returned in that dtype; under
    ``torch.autocast`` in float32 (``fused_ops/ops/_dtypes.py``).  Differentiable in ``x0``, every weight and bias, the
    embedding's parameters and ``cond`` (the fused discrete adjoint,
    :func:`ode_mlp_backward`; memory ``O(num_steps * B * D)``).
    """
    _check_method(method)
    act, p = _act(activation, activation_param)
    if time not in ("first", "last", "none"):
        raise ValueError(f"time must be 'first', 'last' or 'none', got {time!r}")
    weights, biases = list(weights), list(biases)
    if not 1 <= len(weights) <= MAX_LAYERS:
        raise ValueError(f"weights must hold 1 to {MAX_LAYERS} Linear weights, got {len(weights)}")
    if len(biases) != len(weights):
        raise ValueError(f"biases must hold one bias (or None) per layer ({len(weights)}), got {len(biases)}")
    check_rank(x0, "x0", 2, "[B, D]")
    x0, weights, biases, cond, out_dtype = compute_dtype_args(x0, weights, biases, cond)
    with torch.autocast(x0.device.type, enabled=False):
        t = torch.as_tensor(t).to(device=x0.device, dtype=x0.dtype)
        grid, reverse = time_grid(t, step_size)
        states = _integrate(x0, grid, reverse, weights, biases, method, act, p, time, time_embedding, cond,
                            return_all or torch.is_grad_enabled())
        out = states[-1] if not return_all else interpolate(states, grid, -t if reverse else t)
    return _dtypes.from_compute_dtype(out, out_dtype)


def compute_dtype_args(x0, weights, biases, cond):
    """``(x0, weights, biases, cond, out_dtype)`` in the dtype the integration
    computes in (``_dtypes.to_compute_dtype``: float32 for bfloat16/float16
    inputs and under autocast) and the states' dtype (None: as computed).
    The caller runs the whole integration, time features and bias folding
    included, with autocast off, so it is the float32 program on the rounded
    inputs, and casts the states back with ``_dtypes.from_compute_dtype``."""
    nw, nb = len(weights), len(biases)
    names = ("x0", *(f"weights[{i}]" for i in range(nw)), *(f"biases[{i}]" for i in range(nb)), "cond")
    args, out_dtype = _dtypes.to_compute_dtype(names, (x0, *weights, *biases, cond))
    return args[0], list(args[1:1 + nw]), list(args[1 + nw:1 + nw + nb]), args[-1], out_dtype


def _round(x, dtype):
    """The Python float ``x`` rounded to ``dtype`` (float32 arithmetic on
    rounded operands is the double result rounded once)."""
    return struct.unpack("f", struct.pack("f", x))[0] if dtype == torch.float32 else float(x)


def host_grid(t0, t1, num_steps, step_size, dtype, device):
    """:func:`time_grid` of ``linspace(t0, t1, num_steps + 1)`` (or of ``[t0, t1]``
    with ``step_size``) for Python floats, worked out without reading a tensor
    (no host synchronisation; traceable by ``torch.compile(fullgraph=True)``):
    ``(grid, reverse)``, the same values."""
    reverse = t1 < t0
    if step_size is None:
        t = torch.linspace(t0, t1, num_steps + 1, dtype=dtype, device=device)
        return (-t if reverse else t), reverse
    start, end = _round(t0, dtype), _round(t1, dtype)
    if reverse:
        start, end = -start, -end
    h = _round(step_size, dtype)
    niters = math.ceil(_round(_round(_round(end - start, dtype) / h, dtype) + 1.0, dtype))
    grid = torch.arange(0, niters, dtype=dtype, device=device) * step_size + start
    return torch.cat([grid[:-1], grid.new_full((1,), end)]), reverse


def grid_times(grid, reverse, method):
    """``(t_grid, times)`` of the ascending-frame ``grid``: the op's grid in
    the caller's frame and every evaluation time ``[S * stages]`` (the
    times :func:`_step` calls ``func`` at, negated back for a decreasing
    grid).  They depend on the grid and the method only, so a caller with a
    fixed grid computes them once (``fused_ops.nn.ODESampler``)."""
    times = _stage_times(method, grid[:-1], grid[1:] - grid[:-1], grid[1:]).reshape(-1)
    return (-grid, -times) if reverse else (grid, times)


def _integrate(x0, grid, reverse, weights, biases, method, act, p, time, time_embedding, cond, all_states):
    """The fused op over ``grid`` (ascending frame): :func:`integrate_at` of its :func:`grid_times`."""
    t_grid, times = grid_times(grid, reverse, method)
    return integrate_at(x0, t_grid, times, weights, biases, method, act, p, time, time_embedding, cond, all_states)


def integrate_at(x0, t_grid, times, weights, biases, method, act, p, time, time_embedding, cond, all_states):
    """:func:`ode_mlp` over ``t_grid`` with the evaluation times ``times``
    (:func:`grid_times`): the time and conditioning features folded into
    first-layer biases, in PyTorch (autograd reaches the embedding and
    ``cond``)."""
    d = x0.shape[1]
    w0 = weights[0]
    feats = _time_features(times, time_embedding) if time != "none" else None
    cw = 0 if cond is None else cond.shape[-1]
    wt, wx, wc = _split_first(w0, d, time, 0 if feats is None else feats.shape[1], cw)
    h0 = w0.shape[0]
    b0 = biases[0] if biases[0] is not None else w0.new_zeros(h0)
    num_evals = times.shape[0]
    time_bias = b0.expand(num_evals, h0) if feats is None else torch.addmm(b0, feats, wt.t())
    sample_bias = None if cond is None else cond @ wc.t()
    rest = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights[1:], biases[1:])]
    return ode_mlp(x0, t_grid, [wx] + list(weights[1:]), rest, time_bias, sample_bias, METHODS[method], act, p,
                   all_states)


# ---------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------


def ode_mlp(x0: Tensor, t_grid: Tensor, weights: list, biases: list, time_bias: Tensor, sample_bias, method: int,
            activation: int, act_param: float, all_states: bool) -> Tensor:
    r"""The fused op behind :func:`odeint_mlp`: ``S = len(t_grid) - 1``
    Runge-Kutta steps over the grid ``t_grid [S+1]`` of the MLP velocity field
    (``csrc/ode_mlp.h``)::

        a_0 = y @ weights[0].T + time_bias[e] (+ sample_bias)   # e = k * stages + i
        a_l = act(a_{l-1}) @ weights[l].T + biases[l-1]          # l = 1 .. L-1; v = a_{L-1}
        Y_i = y_k + dt_k * sum_j A[i][j] K_j;  K_i = v_e(Y_i);  y_{k+1} = y_k + dt_k * sum_i B[i] K_i

    ``weights[0] [H_0, D]`` (the state columns only), ``weights[l]
    [H_l, H_{l-1}]``, ``weights[L-1] [D, H_{L-2}]``; ``biases`` the L-1
    biases of layers 1 .. L-1; ``time_bias [S * stages, H_0]`` the first
    layer's bias per evaluation (its bias plus the time features' share),
    ``sample_bias [B, H_0]`` or None (the conditioning's share); ``method``
    and ``activation`` codes (:data:`METHODS`, :data:`ACTIVATIONS`).
    Returns ``[S+1, B, D]`` (every state; ``all_states``) or ``[1, B, D]``.

    Dtypes: all float32 or all float64 (the kernels' rule, which
    ``torch.ops.fused_ops.ode_mlp`` keeps); this function also takes
    all-bfloat16 or all-float16 tensors, computes in float32 and returns the
    states in that dtype (gradients too); under ``torch.autocast`` float32
    (``fused_ops/ops/_dtypes.py``).
    """
    weights, biases = list(weights), list(biases)
    names = ("x0", "t_grid", *(f"weights[{i}]" for i in range(len(weights))),
             *(f"biases[{i}]" for i in range(len(biases))), "time_bias", "sample_bias")
    args, out_dtype = _dtypes.to_compute_dtype(names, (x0, t_grid, *weights, *biases, time_bias, sample_bias))
    nw = len(weights)
    x0, t_grid, weights, biases = args[0], args[1], list(args[2:2 + nw]), list(args[2 + nw:-2])
    time_bias, sample_bias = args[-2:]
    states = _eager.call_no_grad(_OP, x0, t_grid, weights, biases, time_bias, sample_bias, method, activation,
                                 act_param, all_states)
    return _dtypes.from_compute_dtype(states, out_dtype)


def check_activation_code(activation):
    """csrc/common/activation_checks.h's check of an activation code, with its message."""
    check((activation >= 0) & (activation < 10),
          "activation must be 0 .. 9 (silu, relu, leaky_relu, elu, selu, gelu, gelu_tanh, softplus, tanh, sigmoid), "
          "got ", activation)


def _check_args(x0, t_grid, weights, biases, time_bias, sample_bias, method, activation):
    """csrc/ode_mlp.h's OdeMlpInputs checks, in its order and with its messages."""
    check((method >= 0) & (method < 5), "method must be 0 .. 4 (euler, midpoint, heun2, heun3, rk4), got ", method)
    check_activation_code(activation)
    check_rank(x0, "x0", 2, "[B, D]")
    check_rank(t_grid, "t_grid", 1, "[num_steps + 1]")
    (b, d), steps = x0.shape, t_grid.shape[0] - 1
    check(d >= 1, "x0 must have at least one feature (D >= 1), got shape ", shape_str(x0))
    check(steps >= 0, "t_grid must hold at least one time (the start), got shape ", shape_str(t_grid))
    n_layers = len(weights)
    check(1 <= n_layers <= MAX_LAYERS, "weights must hold 1 to 8 Linear weights, got ", n_layers)
    check(len(biases) == n_layers - 1, "biases must hold one bias per layer after the first (", n_layers - 1,
          "), got ", len(biases))
    width = d
    for l, w in enumerate(weights):
        name = f"weights[{l}]"
        check_rank(w, name, 2, "[out, in]")
        out = w.shape[0]
        check(out >= 1, name, " must have at least one output, got shape ", shape_str(w))
        check_size(w, name, 1, width, "D, the features of x0" if l == 0 else "the output width of the layer before")
        if l == n_layers - 1:
            check_size(w, name, 0, d, "D: the last layer gives the velocity")
        if l > 0:
            check_rank(biases[l - 1], f"biases[{l - 1}]", 1, "[out]")
            check_size(biases[l - 1], f"biases[{l - 1}]", 0, out, f"the output width of {name}")
        width = out
    h0 = weights[0].shape[0]
    stages = (1, 2, 2, 3, 4)[method]
    check_rank(time_bias, "time_bias", 2, "[num_steps * stages, H_0]")
    check_size(time_bias, "time_bias", 0, steps * stages, "num_steps * stages: one row per evaluation")
    check_size(time_bias, "time_bias", 1, h0, "H_0, the output width of weights[0]")
    if sample_bias is not None:
        check_rank(sample_bias, "sample_bias", 2, "[B, H_0]")
        check_size(sample_bias, "sample_bias", 0, b, "B, the rows of x0")
        check_size(sample_bias, "sample_bias", 1, h0, "H_0, the output width of weights[0]")
    check_same_float_dtype_and_device([(x0, "x0"), (t_grid, "t_grid")])
    for l, w in enumerate(weights):
        check_same_float_dtype_and_device([(x0, "x0"), (w, f"weights[{l}]")])
    for l, v in enumerate(biases):
        check_same_float_dtype_and_device([(x0, "x0"), (v, f"biases[{l}]")])
    check_same_float_dtype_and_device([(x0, "x0"), (time_bias, "time_bias")])
    if sample_bias is not None:
        check_same_float_dtype_and_device([(x0, "x0"), (sample_bias, "sample_bias")])
    return b, d, steps


@torch.library.register_fake("fused_ops::ode_mlp")
def _ode_mlp_fake(x0, t_grid, weights, biases, time_bias, sample_bias, method, activation, act_param, all_states):
    b, d, steps = _check_args(x0, t_grid, weights, biases, time_bias, sample_bias, method, activation)
    return x0.new_empty((steps + 1 if all_states else 1, b, d))


def ode_mlp_backward(grad_states, states, x0, t_grid, weights, biases, time_bias, sample_bias, method, activation,
                     act_param):
    """The fused discrete adjoint of :func:`ode_mlp` (``csrc/ode_mlp_backward.h``):
    given ``grad_states`` and the forward's ``states`` (both ``[S+1, B, D]``)
    returns ``[grad_x0, *grad_weights, *grad_biases, grad_time_bias]`` plus
    ``grad_sample_bias`` when ``sample_bias`` is given."""
    return _BACKWARD_OP(grad_states, states, x0, t_grid, weights, biases, time_bias, sample_bias, method, activation,
                        act_param)


@torch.library.register_fake("fused_ops::ode_mlp_backward")
def _ode_mlp_backward_fake(grad_states, states, x0, t_grid, weights, biases, time_bias, sample_bias, method,
                           activation, act_param):
    b, d, steps = _check_args(x0, t_grid, weights, biases, time_bias, sample_bias, method, activation)
    for t, name in ((grad_states, "grad_states"), (states, "states")):
        check_rank(t, name, 3, "[num_steps + 1, B, D]")
        check((t.shape[0] == steps + 1) & (t.shape[1] == b) & (t.shape[2] == d), name,
              " must have the shape [num_steps + 1, B, D] = [", steps + 1, ", ", b, ", ", d, "], got ", shape_str(t))
    check_same_float_dtype_and_device([(x0, "x0"), (grad_states, "grad_states"), (states, "states")])
    out = [x0.new_empty((b, d))] + [w.new_empty(w.shape) for w in weights] + [v.new_empty(v.shape) for v in biases]
    out.append(time_bias.new_empty(time_bias.shape))
    if sample_bias is not None:
        out.append(sample_bias.new_empty(sample_bias.shape))
    return out


def _setup_context(ctx, inputs, output):
    x0, t_grid, weights, biases, time_bias, sample_bias, method, activation, act_param, all_states = inputs
    ctx.n_layers, ctx.has_sample_bias = len(weights), sample_bias is not None
    ctx.scalars = (method, activation, act_param)
    ctx.all_states = all_states
    saved = [x0, t_grid, time_bias, *weights, *biases] + ([sample_bias] if sample_bias is not None else [])
    if all_states:
        saved.append(output)
    ctx.save_for_backward(*saved)


def _backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    x0, t_grid, time_bias = saved[:3]
    n = ctx.n_layers
    weights, biases = saved[3:3 + n], saved[3 + n:2 + 2 * n]
    sample_bias = saved[2 + 2 * n] if ctx.has_sample_bias else None
    if ctx.all_states:
        states = saved[-1]
    else:  # the states of every step, recomputed; the gradient reaches only the last
        states = _OP(x0, t_grid, weights, biases, time_bias, sample_bias, *ctx.scalars, True)
        grad = torch.cat([grad.new_zeros((states.shape[0] - 1, *grad.shape[1:])), grad])
    g = _BACKWARD_OP(grad, states, x0, t_grid, weights, biases, time_bias, sample_bias, *ctx.scalars)
    gs = g[2 * n + 1] if ctx.has_sample_bias else None
    return g[0], None, list(g[1:1 + n]), list(g[1 + n:2 * n]), g[2 * n], gs, None, None, None, None


torch.library.register_autograd("fused_ops::ode_mlp", _backward, setup_context=_setup_context)
_eager.forbid_double_backward(_BACKWARD_OP, "ode_mlp", "fused_ops.ops.odeint_fixed with fused_ops.ops.mlp_velocity")
