"""Lower-precision inputs and autocast for the fused ops.

The kernels compute in float32 or float64.  Two rules make the ops usable
from mixed-precision programs without bfloat16/float16 kernels:

- **Autocast** (:func:`register_autocast_rules`): every forward op of the
  ``fused_ops`` namespace (every op whose name does not end in
  ``_backward``) has an autocast rule on the CPU and on CUDA that casts its
  bfloat16/float16/float32 tensor inputs to float32 (float64 ones are left
  alone, as torch's own float32-policy ops leave them) and runs the op with
  autocast off: outputs are float32, as for ``torch.autocast``'s float32
  list (``softmax``, ``binary_cross_entropy``...).  This covers
  ``torch.ops.fused_ops.*`` called directly and graphs (``torch.compile``,
  ``torch.export``) recorded under autocast.
- **bfloat16/float16 inputs** (:func:`to_compute_dtype`), in the Python
  functions (``fused_ops.<op>``) and so in the ``fused_ops.nn`` modules: when
  every tensor input is bfloat16 (or every one float16), the function casts
  them to float32, the op computes in float32 (its state, log-sum-exps,
  losses) and the outputs are cast back to the inputs' dtype.  The casts are
  ordinary differentiable ``Tensor.to`` calls, so gradients flow back in the
  inputs' dtype.  ``torch.ops.fused_ops.*`` called directly keeps the
  kernels' rule (float32 or float64) and refuses bfloat16/float16 by name,
  except ``vae_elbo`` and ``vae_elbo_backward``, which take all-bfloat16
  inputs themselves (a CUDA bfloat16 path, else float32 copies made in C++:
  csrc/common/low_precision.h); ``fused_ops.vae_elbo`` hands them over as
  they are.

Under autocast the Python functions cast the same way the rule does before
calling the op, so the autograd node they record sees float32 inputs.
"""

import torch

from ._checks import dtype_str

__all__ = ["LOW_PRECISION", "compute_dtype", "to_compute_dtype", "from_compute_dtype", "register_autocast_rules"]

#: Input dtypes computed in float32.
LOW_PRECISION = (torch.bfloat16, torch.float16)

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_on(device_type):
    """Whether autocast is on for ``device_type`` (CPU or CUDA)."""
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def compute_dtype(dtype, device_type):
    """The dtype an op computes in for inputs of ``dtype`` on ``device_type``:
    float32 for bfloat16/float16 inputs and for anything but float64 under
    autocast, else ``dtype``."""
    if dtype in LOW_PRECISION or (dtype != torch.float64 and autocast_on(device_type)):
        return torch.float32
    return dtype


def _autocast_cast(t, device_type):
    # torch.library.register_autocast's rule: floating tensors on the
    # autocast device, except float64, go to float32.
    if t is not None and t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64:
        return t.float()
    return t


def to_compute_dtype(names, tensors):
    """``(tensors in the dtype the kernels compute in, the outputs' dtype or None)``.

    Under autocast: float32 copies of the eligible inputs, outputs float32
    (None: left as they come).  All inputs bfloat16 (or all float16):
    float32 copies and that dtype for the outputs.  A bfloat16/float16
    first input with another dtype elsewhere raises, naming the argument.
    Anything else passes unchanged (the op's own checks judge it).
    """
    first = tensors[0]
    if first is None:
        return tensors, None  # the op names the missing argument
    device_type = first.device.type
    if autocast_on(device_type):
        return tuple(_autocast_cast(t, device_type) for t in tensors), None
    if first.dtype not in LOW_PRECISION:
        return tensors, None
    for t, name in zip(tensors[1:], names[1:]):
        if t is not None and t.dtype != first.dtype:
            raise RuntimeError(
                f"{name} must have the same dtype as {names[0]} ({dtype_str(first.dtype)}), got "
                f"{dtype_str(t.dtype)} (mixed dtypes are cast to float32 only under torch.autocast)"
            )
    return tuple(None if t is None else t.float() for t in tensors), first.dtype


def from_compute_dtype(outputs, dtype):
    """``outputs`` (a tensor or a tuple of them) cast to ``dtype`` (None:
    unchanged); integer outputs (indices) keep their dtype."""
    if dtype is None:
        return outputs
    if isinstance(outputs, tuple):
        return tuple(_cast_output(o, dtype) for o in outputs)
    return _cast_output(outputs, dtype)


def _cast_output(o, dtype):
    return o.to(dtype) if o.is_floating_point() else o


def forward_op_names():
    """The registered forward ops of the ``fused_ops`` namespace (qualified names)."""
    return sorted(
        name for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("fused_ops::") and not name.endswith("_backward")
    )


def register_autocast_rules():
    """The autocast rule (float32) of every forward op, on the CPU and CUDA."""
    for name in forward_op_names():
        for device_type in _AUTOCAST_DEVICES:
            if torch.amp.is_autocast_available(device_type):
                torch.library.register_autocast(name, device_type, torch.float32)
