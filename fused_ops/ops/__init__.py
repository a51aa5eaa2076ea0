"""The documented Python functions of the fused ops, one module per op.

Each ``_<op>.py`` holds the op's function (shapes and math in its docstring),
the fake (meta) implementations ``torch.compile`` needs and the autograd
registration, torchvision-style.  The kernels themselves are registered from
C++ (``csrc/``) when ``fused_ops._C`` loads; the registrations here are what
``torch.ops.fused_ops.<op>`` called directly uses too.  The functions call
the ops through :mod:`fused_ops._eager`.  The modules are private (their
names would clash with the functions); import the functions from here or
from :mod:`fused_ops`.
"""

from ._flow_euler import flow_euler, flow_euler_backward
from ._importance_sampling import importance_sampling, importance_sampling_backward
from ._vae_elbo import vae_elbo
from ._ode import ode_mlp, ode_mlp_backward, odeint_fixed, odeint_mlp

__all__ = [
    "importance_sampling",
    "importance_sampling_backward",
    "flow_euler",
    "flow_euler_backward",
    "vae_elbo",
    "ode_mlp",
    "ode_mlp_backward",
    "odeint_fixed",
    "odeint_mlp",
]
