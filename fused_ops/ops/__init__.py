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
from ._importance_log_weights import importance_log_weights, importance_log_weights_backward
from ._resample import resample
from ._vae_elbo import LIKELIHOODS, vae_elbo
from ._vae_iwae import vae_iwae, vae_mlp_iwae
from ._vae_mlp import vae_mlp_elbo
from ._snis import snis, snis_backward
from ._ode import ode_mlp, ode_mlp_backward, odeint_fixed, odeint_mlp
from ._dtypes import register_autocast_rules as _register_autocast_rules
from . import _matmul  # noqa: F401  (the private test op's fake)

_register_autocast_rules()  # float32 under torch.autocast, every forward op, CPU and CUDA (_dtypes.py)

__all__ = [
    "importance_sampling",
    "importance_sampling_backward",
    "flow_euler",
    "flow_euler_backward",
    "vae_elbo",
    "snis",
    "snis_backward",
    "resample",
    "LIKELIHOODS",
    "vae_iwae",
    "vae_mlp_elbo",
    "vae_mlp_iwae",
    "ode_mlp",
    "ode_mlp_backward",
    "odeint_fixed",
    "odeint_mlp",
    "importance_log_weights",
    "importance_log_weights_backward",
]
