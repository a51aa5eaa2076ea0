"""The eager route of the fused ops' Python functions.

Each op is registered with ``torch.library.register_autograd`` (see
:func:`register_autograd`); ``torch.ops.fused_ops.*`` called directly and
``torch.compile`` use that registration.  Its autograd kernel is Python that
runs on every call: it boxes every argument into Python and redispatches,
and when a gradient can flow it also rebuilds the schema's argument list
(``fill_defaults``) for ``setup_context``.  For a 12-tensor op such as
``vae_elbo`` that costs as much host time as a small fused kernel, so the Python functions (``fused_ops.vae_elbo`` and the others)
take a shorter route in eager mode, through :func:`call`:

- no gradient can flow (grad mode off, or no input requires grad): the op is
  called below the Autograd dispatch key, which is what the registered kernel
  does in that case, minus its Python;
- a gradient can flow: the op runs as a ``torch.autograd.Function`` built from
  the same ``setup_context`` and backward.  Two Functions per op: a plain one
  (``setup_context`` called from its forward), and one with a
  ``setup_context`` staticmethod and a generated vmap rule, which torch.func
  transforms require but whose ``apply`` binds its arguments through
  ``inspect.signature`` on every call; it is used only while a torch.func
  transform is active.

On the H200 this takes about a quarter off a VAE training step at B=128,
which is host-bound (the three routes timed in alternating rounds:
docs/performance.md, "Eager route").  Results and gradients are bitwise
those of the registered route (tests/test_eager_route.py).

The route rests on private torch APIs, listed in :data:`PRIVATE_APIS` and
probed once at import.  If any is missing or misbehaves, :data:`enabled` is
False and every call is the plain ``op(*args)``: the registered autograd, as
for ``torch.ops.fused_ops.*`` called directly.  (torch.func transforms then
refuse the functions as they refuse those direct calls: the Function that
``register_autograd`` generates has no ``setup_context`` staticmethod.)

Forward-mode AD is refused on both routes (:func:`reject_forward_ad`): the
ops have no forward derivative, and their outputs would otherwise carry no
tangent, silently.
"""

import torch
import torch.autograd.forward_ad as _forward_ad

__all__ = [
    "PRIVATE_APIS", "enabled", "unavailable", "call", "call_no_grad", "needs_grad", "reject_forward_ad",
    "register_autograd", "forbid_double_backward", "functions",
]


def _any_requires_grad_works():
    f = torch._C._any_requires_grad
    return f(None, torch.empty(0)) is False and f(torch.empty(0), torch.empty(0, requires_grad=True)) is True


def _below_autograd_works():
    with torch._C._AutoDispatchBelowAutograd():
        pass
    return True


# The private torch APIs the fast route uses, each with a check that it is
# there and behaves as the route expects.
_CHECKS = {
    # One C++ test of a tuple of optional tensors.
    "torch._C._any_requires_grad": _any_requires_grad_works,
    # Calls the op past its autograd kernel.
    "torch._C._AutoDispatchBelowAutograd": _below_autograd_works,
    # Picks the torch.func Function.
    "torch._C._are_functorch_transforms_active": lambda: torch._C._are_functorch_transforms_active() is False,
    # Skips the tangent check outside forward AD.
    "torch.autograd.forward_ad._current_level": lambda: isinstance(_forward_ad._current_level, int),
}

#: The private torch APIs the fast route uses.
PRIVATE_APIS = tuple(_CHECKS)


def _probe():
    """The private APIs of :data:`PRIVATE_APIS` that are missing or do not
    behave as expected, each as ``"name: what is wrong"`` (empty: all usable)."""
    problems = []
    for name, works in _CHECKS.items():
        try:
            if not works():
                problems.append(f"{name}: unexpected result")
        except Exception as e:  # AttributeError when absent, TypeError for a changed signature
            problems.append(f"{name}: {type(e).__name__}: {e}")
    return problems


#: Why the fast route is off (empty when every private API works).
unavailable = _probe()

#: Whether the Python functions take the fast route (module global, read on
#: every call; tests set it to False to run the fallback).
enabled = not unavailable

# op -> (plain, transformable) torch.autograd.Functions, see register_autograd.
_FUNCTIONS = {}


def needs_grad(tensors) -> bool:
    """Whether autograd must record a call on ``tensors`` (None entries allowed)."""
    if not torch.is_grad_enabled():
        return False
    if enabled and not torch.compiler.is_compiling():  # torch.compile cannot trace the C++ test
        return torch._C._any_requires_grad(*tensors)
    return any(t is not None and t.requires_grad for t in tensors)


def reject_forward_ad(op, tensors) -> None:
    """Raises when forward-mode AD would differentiate this call of ``op``.

    Forward AD is on inside ``torch.autograd.forward_ad.dual_level()`` and
    ``torch.func.jvp``; only inputs that carry a tangent are refused, so a
    call on plain tensors inside them still works.  Under ``vmap`` inside
    ``jvp`` a tangent cannot be inspected (``unpack_dual`` has no batching
    rule), so such a call is refused.  ``torch.ops.fused_ops.*`` called
    directly is not checked: the registered autograd kernel drops tangents
    without a hook this layer could use.
    """
    if enabled and _forward_ad._current_level < 0:  # the common case: one module-global read
        return
    try:
        dual = any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    except RuntimeError:  # vmap inside jvp
        dual = True
    if dual:
        raise RuntimeError(
            f"fused_ops::{op._opname} does not support forward-mode AD (torch.func.jvp, "
            f"torch.autograd.forward_ad dual tensors): it has no forward derivative, and its outputs "
            f"would silently carry no tangent. Use reverse mode (backward, torch.autograd.grad, "
            f"torch.func.vjp), or fused_ops.reference for forward mode."
        )


def call(op, tensors, *scalars):
    """``op(*tensors, *scalars)`` for an op registered through
    :func:`register_autograd`, by the fast route when it is enabled.

    Under ``torch.compile`` the op is called as it is, so that the graph
    records the op itself (the dispatcher context below is not traceable).
    """
    if torch.compiler.is_compiling():
        return op(*tensors, *scalars)
    reject_forward_ad(op, tensors)
    if not enabled:
        return op(*tensors, *scalars)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*tensors):
        plain, transformable = _FUNCTIONS[op]
        function = transformable if torch._C._are_functorch_transforms_active() else plain
        return function.apply(*tensors, *scalars)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*tensors, *scalars)


def call_no_grad(op, *args):
    """``op(*args)``, below the Autograd key when no gradient can flow through
    the tensors of ``args`` (tensor-list arguments included): :func:`call`'s
    route for that case, for an op whose schema takes tensor lists (which a
    ``torch.autograd.Function`` cannot take as inputs).  Otherwise -- a
    gradient can flow, forward AD or a torch.func transform is active, under
    ``torch.compile``, or the route is disabled -- the registered autograd
    kernel, as ``op(*args)`` called directly."""
    if (not enabled or torch.compiler.is_compiling() or _forward_ad._current_level >= 0
            or torch._C._are_functorch_transforms_active()):
        return op(*args)
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)]
    if needs_grad(tensors):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def register_autograd(op, backward, setup_context):
    """``torch.library.register_autograd(op, backward, setup_context=...)``,
    plus the op's two eager ``torch.autograd.Function``s (named after the op)
    for :func:`call`.

    Both routes run the same ``setup_context`` and backward.  The Functions'
    forward calls the op below the Autograd key: inside it grad mode is off,
    and the registered kernel would otherwise be entered just to redispatch.
    """
    torch.library.register_autograd(op, backward, setup_context=setup_context)

    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    def forward_with_context(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    plain = type(
        op._opname,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward_with_context), "backward": staticmethod(backward)},
    )
    transformable = type(
        op._opname,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "generate_vmap_rule": True,
        },
    )
    _FUNCTIONS[op] = (plain, transformable)


def functions(op):
    """The ``(plain, transformable)`` Functions of ``op`` (for tests)."""
    return _FUNCTIONS[op]


def forbid_double_backward(backward_op, name, reference):
    """Registers autograd for the fused backward op ``backward_op`` that
    raises: the backward ops are not themselves differentiable, and a clear
    error beats a silently wrong second derivative."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"fused_ops.{name} does not support double backward: double backward through its "
            f"fused backward (fused_ops::{name}_backward; e.g. create_graph=True followed by "
            f"another backward) is not supported; use {reference} for higher-order derivatives"
        )

    def save_nothing(ctx, inputs, output):
        pass

    register_autograd(backward_op, backward, save_nothing)
