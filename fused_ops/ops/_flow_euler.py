"""``fused_ops.flow_euler``: the probability-flow ODE sampler, Euler steps of
an MLP velocity field.

The function, its fused backward (the discrete adjoint), their fake (meta)
implementations and the autograd registration.  The kernels are registered
from C++ (``csrc/cuda/flow_euler/``, ``csrc/cpu/flow_euler/``).
"""

import torch
from torch import Tensor

from .. import _eager
from . import _dtypes
from ._checks import check, check_rank, check_same_float_dtype_and_device, check_size, shape_str

__all__ = ["flow_euler", "flow_euler_backward"]

_OP = torch.ops.fused_ops.flow_euler.default
_BACKWARD_OP = torch.ops.fused_ops.flow_euler_backward.default


def flow_euler(
    x0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    w3: Tensor,
    b3: Tensor,
    num_steps: int,
) -> Tensor:
    r"""Probability-flow ODE sampler: ``num_steps`` Euler steps of an MLP
    velocity field, fused: on CUDA all steps in one kernel launch, except on
    the general path (float64, sizes beyond the others: a launch per layer
    and step).

    Shapes: ``x0 [B, D]``, ``w1 [H, D+1]``, ``b1 [H]``, ``w2 [H, H]``,
    ``b2 [H]``, ``w3 [D, H]``, ``b3 [D]`` (the weights and biases of
    ``Linear(D+1, H)``, ``Linear(H, H)``, ``Linear(H, D)``, in ``nn.Linear``'s
    ``[out, in]`` layout); all float32 or all float64, on one device.  The
    hidden width ``H`` comes from the weights.  ``num_steps`` is an int (not
    a bool), ``1 <= num_steps <= 2**31 - 1`` on both devices.

    Dtypes: all float32 or all float64 (the kernels' rule, which
    ``torch.ops.fused_ops.*`` keeps); this function also takes all-bfloat16
    or all-float16 inputs, computes in float32 and returns its outputs in
    the inputs' dtype (gradients too).  Under ``torch.autocast`` (CPU, CUDA)
    lower-precision and float32 inputs run in float32 and the outputs are
    float32; float64 inputs stay float64 (``fused_ops/ops/_dtypes.py``).

    Math, with ``dt = 1 / num_steps``::

        x = x0
        for k in range(num_steps):
            t = (k + 0.5) / num_steps                      # midpoint time, the LAST input feature
            h = silu([x, t] @ w1.T + b1)
            h = silu(h @ w2.T + b2)
            x = x + dt * (h @ w3.T + b3)

    Returns ``x [B, D]`` (contiguous).  Results are bitwise reproducible for
    the same inputs on the same device (on the CPU also for the same
    alignment of the weights in memory: the BLAS rounds differently for a
    weight tensor that does not start on a 64-byte boundary).  ``dt`` and
    ``t`` are rounded from double to the tensors' dtype, as
    ``torch.tensor(1.0 / num_steps)`` rounds the reference module's ``dt``
    buffer in float32.

    On CUDA the kernel is one of several paths, picked from the sizes (and
    the build's architectures) by the op's dispatch table:
    ``fused_ops._paths.table("flow_euler")`` lists them with their conditions.

    Differentiable with respect to every tensor input through the fused
    :func:`flow_euler_backward` op, which recomputes the trajectory from
    ``x0`` and runs the steps in reverse (memory: ``O(num_steps * B * D)``
    plus ``O(B * H)``, or ``O(num_steps * B * H)`` for small problems; see
    there).  Double backward and forward-mode AD (``torch.func.jvp``, dual
    tensors) are not supported (clear errors).
    """
    _check_num_steps_type(num_steps)
    args, out_dtype = _dtypes.to_compute_dtype(_ARG_NAMES, (x0, w1, b1, w2, b2, w3, b3))
    return _dtypes.from_compute_dtype(_eager.call(_OP, args, num_steps), out_dtype)


_ARG_NAMES = ("x0", "w1", "b1", "w2", "b2", "w3", "b3")


# The largest num_steps, on both devices (csrc/flow_euler.h, kMaxFlowSteps).
MAX_STEPS = 2**31 - 1


def _check_num_steps_type(num_steps):
    """A bool is an int to Python and to the op's schema, and would run as 0
    or 1 steps: the Python functions refuse it (``torch.ops.fused_ops.*``
    receives it as the int it is)."""
    if isinstance(num_steps, bool):
        raise TypeError(f"num_steps must be an int (the number of Euler steps), got the bool {num_steps}")


def _check_args(x0, w1, b1, w2, b2, w3, b3, num_steps):
    """The argument rules of csrc/flow_euler.h's check_flow_euler_args, in its
    order and with its messages (fused_ops/ops/_checks.py); returns ``(B, D, H)``."""
    check((num_steps >= 1) & (num_steps <= MAX_STEPS), "num_steps must be at least 1 and at most 2147483647 (INT_MAX), got ",
          num_steps)
    check_rank(x0, "x0", 2, "[B, D]")
    check_rank(w1, "w1", 2, "[H, D + 1]")
    check_rank(b1, "b1", 1, "[H]")
    check_rank(w2, "w2", 2, "[H, H]")
    check_rank(b2, "b2", 1, "[H]")
    check_rank(w3, "w3", 2, "[D, H]")
    check_rank(b3, "b3", 1, "[D]")
    (b, d), h = x0.shape, w1.shape[0]
    check(d >= 1, "x0 must have at least one feature (D >= 1), got shape ", shape_str(x0))
    check(h >= 1, "w1 must have at least one hidden unit (H = w1.shape[0] >= 1), got shape ", shape_str(w1))
    check_size(w1, "w1", 1, d + 1, "D + 1: the features of x0 plus the time t")
    check_size(b1, "b1", 0, h, "H, the hidden width w1.shape[0]")
    check_size(w2, "w2", 0, h, "H, the hidden width w1.shape[0]")
    check_size(w2, "w2", 1, h, "H, the hidden width w1.shape[0]")
    check_size(b2, "b2", 0, h, "H, the hidden width w1.shape[0]")
    check_size(w3, "w3", 0, d, "D, the features of x0")
    check_size(w3, "w3", 1, h, "H, the hidden width w1.shape[0]")
    check_size(b3, "b3", 0, d, "D, the features of x0")
    check_same_float_dtype_and_device([(x0, "x0"), (w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"), (w3, "w3"),
                                       (b3, "b3")])
    return b, d, h


@torch.library.register_fake("fused_ops::flow_euler")
def _flow_euler_fake(x0, w1, b1, w2, b2, w3, b3, num_steps):
    b, d, _ = _check_args(x0, w1, b1, w2, b2, w3, b3, num_steps)
    return x0.new_empty((b, d))  # contiguous, like the kernels' output


def flow_euler_backward(
    grad_x: Tensor,
    x0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    w3: Tensor,
    b3: Tensor,
    num_steps: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""Fused backward of :func:`flow_euler` (the discrete adjoint through all
    Euler steps): given ``grad_x = dL/dx [B, D]`` and the forward's inputs,
    returns ``(grad_x0, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3)``,
    each contiguous with its input's shape.

    The trajectory ``x_0 .. x_{num_steps-1}`` is recomputed from ``x0``, then
    the steps run in reverse (``t_k = (k+0.5)/num_steps``, ``h1, h2`` and
    ``silu'(a1), silu'(a2)`` the hidden layers of step ``k`` at state ``x_k``)::

        g_v = dt * g;                gw3 += g_v^T h2;  gb3 += sum_rows g_v
        g_a2 = (g_v @ w3) * silu'(a2);  gw2 += g_a2^T h1;  gb2 += sum_rows g_a2
        g_a1 = (g_a2 @ w2) * silu'(a1); gw1 += g_a1^T [x_k, t_k];  gb1 += sum_rows g_a1
        g = g + g_a1 @ w1[:, :D]     # dL/dx_k; grad_x0 = g after step 0

    Two modes, picked from the sizes (memory in elements of the dtype, besides
    the outputs; n = num_steps):

    - resident (``n*B <= 512`` and ``6*n*B*H <= 4 Mi``, e.g. the default B=8,
      D=64, H=256, 32 steps): the trajectory pass keeps every step's hidden
      layers, nothing is recomputed, and each weight gradient is one product
      over all ``n*B`` rows.  Memory ``6*n*B*H + 2*n*B*D + 3*B*D`` (about
      1.7 MB in float32 at the default size).
    - streaming (otherwise): only the trajectory is kept and each reverse step
      recomputes its hidden layers from ``x_k``.  Memory ``(n-1)*B*D`` for the
      trajectory plus ``6*B*H + 4*B*D + 2*H*D + H*H`` that do not grow with
      ``n`` (62 MB in float32 at B=4096, D=64, H=256, 32 steps).

    CUDA, resident: one cooperative launch, the whole sequence as grid-
    synchronised phases of FMA product tiles with the elementwise work in
    their epilogues (plain float32/float64 arithmetic, never TF32).
    Otherwise products run as BLAS (CPU) or cuBLAS (CUDA, torch's current
    stream) calls over all rows, with fused epilogue kernels (bias/SiLU/SiLU',
    Euler update, gradient products with deterministic column sums) between
    them; there the CUDA float32 products follow
    ``torch.backends.cuda.matmul.allow_tf32``.  Results are bitwise
    reproducible for the same inputs on the same device.
    Not differentiable itself: double backward raises an error.
    """
    _check_num_steps_type(num_steps)
    return _eager.call(_BACKWARD_OP, (grad_x, x0, w1, b1, w2, b2, w3, b3), num_steps)


@torch.library.register_fake("fused_ops::flow_euler_backward")
def _flow_euler_backward_fake(grad_x, x0, w1, b1, w2, b2, w3, b3, num_steps):
    # csrc/flow_euler_backward.h's FlowEulerBackwardCall.
    b, d, _ = _check_args(x0, w1, b1, w2, b2, w3, b3, num_steps)
    check_rank(grad_x, "grad_x", 2, "[B, D], the shape of x0")
    check(grad_x.shape[0] == b and grad_x.shape[1] == d, "grad_x must have the shape of x0 ", shape_str(x0),
          ", got ", shape_str(grad_x))
    check_same_float_dtype_and_device([(x0, "x0"), (grad_x, "grad_x")])
    return tuple(t.new_empty(t.shape) for t in (x0, w1, b1, w2, b2, w3, b3))


# Autograd: the fused backward op, itself not differentiable.


def _flow_euler_setup_context(ctx, inputs, output):
    *tensors, num_steps = inputs
    ctx.num_steps = num_steps
    ctx.save_for_backward(*tensors)  # the inputs only: the backward recomputes the trajectory


def _flow_euler_backward(ctx, grad_x):
    grads = _eager.call(_BACKWARD_OP, (grad_x, *ctx.saved_tensors), ctx.num_steps)
    return (*grads, None)  # none for num_steps


_eager.forbid_double_backward(_BACKWARD_OP, "flow_euler", "fused_ops.reference.flow_euler")
_eager.register_autograd(_OP, _flow_euler_backward, _flow_euler_setup_context)
