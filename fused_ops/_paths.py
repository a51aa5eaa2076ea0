"""Kernel-path debug hook: which kernel an op call takes, and forcing one.

Each op's CUDA dispatch is a table of paths (``csrc/common/dispatch.h``; the
tables live in ``csrc/cuda/<op>/dispatch.cu``).  For tests, sanitizer runs and
benchmarks of one path::

    from fused_ops import _paths
    _paths.table("flow_euler")            # [(name, when, why), ...] in order
    with _paths.force("flow_euler", "tiled"):
        fused_ops.flow_euler(x0, ...)     # takes "tiled", or raises saying why not
    _paths.last("flow_euler")             # "tiled"

``FUSED_OPS_FORCE_PATH="flow_euler=tiled,vae_elbo=general"`` in the
environment forces paths for the whole process (read when fused_ops loads).
A forced path whose condition does not hold raises; nothing unsafe runs.
The state is global to the process; ``last`` reports the latest call on any
thread.  Private: names and tables may change with the kernels.
"""

import contextlib
import importlib
import os

_C = importlib.import_module("fused_ops._C")


def tables():
    """Every (op, device) that has a kernel-path table in this build."""
    return [tuple(t) for t in _C._tables()]


def table(op, device="cuda"):
    """The paths of ``op`` on ``device``: [(name, when, why), ...], in the order tried."""
    return [tuple(p) for p in _C._paths(op, device)]


def names(op, device="cuda"):
    return [p[0] for p in table(op, device)]


def last(op, device="cuda"):
    """The path the latest call of ``op`` on ``device`` took (None before the first)."""
    return _C._last_path(op, device)


_forced = {}  # (op, device) -> the forced path, as set here


def clear_last():
    """Forget every table's latest path (``last`` is None until the next call)."""
    _C._clear_last_paths()


def set_forced(op, path, device="cuda"):
    """Force ``path`` for later calls of ``op`` (None: back to the table's choice)."""
    _C._force_path(op, device, path)
    if path is None:
        _forced.pop((op, device), None)
    else:
        _forced[(op, device)] = path


def forced(op, device="cuda"):
    """The path forced for ``op`` (None: the table chooses).  A Python
    function with routes of its own keeps a call on the route whose op has a
    forced path (``fused_ops.vae_elbo``: a forced ``vae_elbo`` or
    ``vae_elbo_backward`` path keeps training calls off the training pair)."""
    return _forced.get((op, device))


@contextlib.contextmanager
def force(op, path, device="cuda"):
    """Within the block, calls of ``op`` on ``device`` take ``path`` (or raise)."""
    set_forced(op, path, device)
    try:
        yield
    finally:
        set_forced(op, None, device)


def _force_from_environment():
    spec = os.environ.get("FUSED_OPS_FORCE_PATH", "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        op, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"FUSED_OPS_FORCE_PATH: expected op=path (or op:device=path), got {item!r}")
        op, _, device = op.partition(":")
        set_forced(op.strip(), path.strip(), device.strip() or "cuda")


_force_from_environment()
