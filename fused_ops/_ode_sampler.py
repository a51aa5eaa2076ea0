"""``fused_ops.nn.ODESampler``: the fused fixed-grid ODE sampler built from a
user's own velocity network (``nn.Sequential`` of ``nn.Linear`` layers and
one kind of activation), sharing its parameters."""

import torch
from torch import nn

from .ops import _dtypes, _ode

__all__ = ["ODESampler"]


def _activation_of(m):
    """(name, parameter) of a supported activation module, else None."""
    if isinstance(m, nn.SiLU):
        return "silu", None
    if isinstance(m, nn.ReLU):
        return "relu", None
    if isinstance(m, nn.LeakyReLU):
        return "leaky_relu", float(m.negative_slope)
    if isinstance(m, nn.SELU):
        return "selu", None
    if isinstance(m, nn.ELU):
        return "elu", float(m.alpha)
    if isinstance(m, nn.GELU):
        return ("gelu" if m.approximate == "none" else "gelu_tanh"), None
    if isinstance(m, nn.Softplus):
        if m.threshold != 20:
            raise ValueError(f"ODESampler: nn.Softplus with threshold {m.threshold} is not supported (only 20, "
                             "the default)")
        return "softplus", float(m.beta)
    if isinstance(m, nn.Tanh):
        return "tanh", None
    if isinstance(m, nn.Sigmoid):
        return "sigmoid", None
    return None


_SUPPORTED = "nn.Linear and one activation after every hidden layer (SiLU, ReLU, LeakyReLU, ELU, SELU, GELU, " \
             "Softplus, Tanh, Sigmoid)"


def parse_velocity(layers):
    """``(linears, activation, activation_param)`` of a chain ``Linear (act Linear)*``,
    or a ValueError naming the first layer that does not fit."""
    layers = list(layers)
    linears, act, expect_linear = [], None, True
    for i, m in enumerate(layers):
        if isinstance(m, nn.Linear):
            if not expect_linear:
                raise ValueError(f"ODESampler: layer {i} (Linear) follows a Linear with no activation between; "
                                 f"supported: {_SUPPORTED}")
            linears.append(m)
            expect_linear = False
            continue
        a = _activation_of(m)
        if a is None:
            raise ValueError(f"ODESampler: layer {i} ({type(m).__name__}) is not supported; supported: {_SUPPORTED}")
        if expect_linear:
            raise ValueError(f"ODESampler: layer {i} ({type(m).__name__}) must follow a Linear")
        if act is not None and a != act:
            raise ValueError(f"ODESampler: layer {i} ({type(m).__name__}) differs from the activation of the layers "
                             f"before ({act[0]}); the same activation must follow every hidden layer")
        act, expect_linear = a, True
    if not linears:
        raise ValueError("ODESampler: the velocity network has no Linear layer")
    if expect_linear:
        raise ValueError(f"ODESampler: layer {len(layers) - 1} ({type(layers[-1]).__name__}): the last layer must be "
                         "a Linear (the velocity)")
    if len(linears) > _ode.MAX_LAYERS:
        raise ValueError(f"ODESampler: {len(linears)} Linear layers, at most {_ode.MAX_LAYERS} are supported")
    name, param = act if act is not None else ("silu", None)
    return linears, name, param


class ODESampler(nn.Module):
    r"""Samples ``dy/dt = velocity(input(t, y, cond))`` with torchdiffeq's
    fixed-grid solvers, fused (:func:`fused_ops.odeint_mlp`).

    - ``velocity``: an ``nn.Sequential`` (or a list of its layers) of
      ``nn.Linear`` layers with the same activation after every hidden one;
      kept as the submodule ``velocity`` (its parameters are shared, so
      training the sampler trains the model).  Anything else is refused with
      an error naming the layer.
    - ``time``: where the time features sit in the first layer's input:
      ``"last"`` (``[y, cond, emb(t)]``), ``"first"`` (``[emb(t), y, cond]``)
      or ``"none"``; ``time_embedding``: None (raw ``t``) or a callable /
      module ``times [E] -> [E, F]`` (a module is registered as a submodule).
    - ``method``: euler, midpoint, heun2, heun3, rk4; the grid: ``num_steps``
      equal steps from ``t0`` to ``t1``, or ``step_size`` (torchdiffeq's grid).

    ``forward(x0, t=None, cond=None)``: with ``t`` (1-D, the output times), the
    states at every time of ``t`` ``[len(t), B, D]`` as ``torchdiffeq.odeint``
    returns them (its grid is read on the host, as torchdiffeq reads it);
    without, the state at ``t1`` ``[B, D]``, with no host synchronisation
    (``torch.compile(fullgraph=True)`` traces it).  ``cond [B, C]``:
    per-sample conditioning features (after ``y`` in the input).
    """

    def __init__(self, velocity, *, time="last", time_embedding=None, method="euler", num_steps=None,
                 step_size=None, t0=0.0, t1=1.0):
        super().__init__()
        if not isinstance(velocity, nn.Sequential):
            velocity = nn.Sequential(*velocity)
        linears, self.activation, self.activation_param = parse_velocity(velocity)
        self.velocity = velocity
        self._linears = tuple(linears)  # the Sequential's own modules (a tuple: not registered twice)
        if time not in ("first", "last", "none"):
            raise ValueError(f"time must be 'first', 'last' or 'none', got {time!r}")
        _ode._check_method(method)
        if num_steps is not None and step_size is not None:
            raise ValueError("give num_steps or step_size, not both")
        if num_steps is None and step_size is None:
            num_steps = 1
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
        if step_size is not None and not step_size > 0:
            raise ValueError(f"step_size must be a positive number, got {step_size!r}")
        self.time, self.time_embedding, self.method = time, time_embedding, method
        self.num_steps, self.step_size, self.t0, self.t1 = num_steps, step_size, float(t0), float(t1)
        # (dtype, device, grid settings) -> (t_grid, times): see _grid_times.
        self._grids = {}

    def forward(self, x0, t=None, cond=None):
        weights, biases = [m.weight for m in self._linears], [m.bias for m in self._linears]
        if t is not None:
            return _ode.odeint_mlp(
                x0, t, weights, biases, method=self.method, activation=self.activation,
                activation_param=self.activation_param, time=self.time, time_embedding=self.time_embedding,
                cond=cond, step_size=self.step_size)
        # Lower precision as odeint_mlp: float32 with autocast off.
        x0, weights, biases, cond, out_dtype = _ode.compute_dtype_args(x0, weights, biases, cond)
        with torch.autocast(x0.device.type, enabled=False):
            t_grid, times = self._grid_times(x0)
            act, p = _ode._act(self.activation, self.activation_param)
            states = _ode.integrate_at(x0, t_grid, times, weights, biases, self.method, act, p, self.time,
                                       self.time_embedding, cond, torch.is_grad_enabled())
        return _dtypes.from_compute_dtype(states[-1], out_dtype)

    def _grid_times(self, x0):
        """``(t_grid, times)`` (``_ode.grid_times``) of the constructor's grid
        in ``x0``'s dtype and on its device, built without reading a tensor:
        no host synchronisation, and torch.compile(fullgraph=True) traces it.
        Outside compilation, CUDA-graph capture and torch.func transforms they
        are built once per dtype, device and grid settings and kept (a few
        small kernels and ~10 host ops fewer per call); built outside
        inference mode, so that a later training call can save them."""
        key = (x0.dtype, x0.device, self.method, self.t0, self.t1, self.num_steps, self.step_size)
        cacheable = (type(x0) is torch.Tensor and not x0.is_meta and not torch.compiler.is_compiling()
                     and not torch._C._are_functorch_transforms_active()
                     and not (x0.is_cuda and torch.cuda.is_current_stream_capturing()))
        if cacheable:
            hit = self._grids.get(key)
            if hit is not None:
                return hit
        with torch.inference_mode(False):
            grid, reverse = _ode.host_grid(self.t0, self.t1, self.num_steps, self.step_size, x0.dtype, x0.device)
            out = _ode.grid_times(grid, reverse, self.method)
        if cacheable:
            if len(self._grids) >= 8:
                self._grids.clear()
            self._grids[key] = out
        return out

    def extra_repr(self):
        grid = f"num_steps={self.num_steps}" if self.step_size is None else f"step_size={self.step_size}"
        return f"method={self.method!r}, time={self.time!r}, activation={self.activation!r}, {grid}"
