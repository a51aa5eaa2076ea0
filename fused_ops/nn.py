"""Fused ``nn.Module`` drop-in replacements for the reference modules.

Each fused module has the reference's constructor arguments and the same
parameter/buffer names, shapes and creation order, so under one seed both
construct identical tensors and ``fused.load_state_dict(ref.state_dict())``
works strictly.  :func:`convert` swaps reference modules inside a model tree
for fused ones.  Users keep their own copies of the reference classes, so
reference modules are recognised by structure (attribute names, shapes),
never by class.
"""

from torch import nn

from . import ops, reference

__all__ = ["ImportanceSampler", "FlowODE", "convert"]


class ImportanceSampler(reference.ImportanceSampler):
    """Fused self-normalised importance sampler.

    Built by the reference's constructor, so the buffers (``mix_weights [K]``,
    ``mix_mus [K, D]``, ``mix_stds [K, D]``, ``q_mu [D]``, ``q_std [D]``), their
    names, creation order and, under one seed, values are the reference's.
    ``forward(samples [N, D]) -> (weighted_mean [D], ess [])``; the normalised
    log weights are available from :meth:`forward_with_log_weights`.
    """

    _buffer_names = ("mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std")

    def forward_with_log_weights(self, samples):
        """``(weighted_mean [D], ess [], log_weights [N])``."""
        return ops.importance_sampling(
            samples, self.mix_weights, self.mix_mus, self.mix_stds, self.q_mu, self.q_std
        )

    def forward(self, samples):
        weighted_mean, ess, _ = self.forward_with_log_weights(samples)
        return weighted_mean, ess

    def extra_repr(self):
        k, d = self.mix_mus.shape
        return f"dim={d}, num_components={k}"

    @staticmethod
    def matches(module):
        """True if ``module`` is structurally an importance-sampling reference
        module: exactly the five buffers with consistent shapes, no parameters,
        no submodules."""
        buffers = dict(module.named_buffers(recurse=False))
        if set(buffers) != set(ImportanceSampler._buffer_names):
            return False
        if list(module.parameters()) or list(module.children()):
            return False
        w, mu, sd, qm, qs = (buffers[n] for n in ImportanceSampler._buffer_names)
        if w.dim() != 1 or mu.dim() != 2 or sd.shape != mu.shape or qm.dim() != 1 or qs.shape != qm.shape:
            return False
        return mu.shape == (w.shape[0], qm.shape[0])

    @classmethod
    def from_reference(cls, module):
        """A fused module sharing ``module``'s buffers (no copies)."""
        if not cls.matches(module):
            raise ValueError(
                f"{type(module).__name__} is not an importance-sampling reference module: expected "
                "buffers mix_weights [K], mix_mus [K, D], mix_stds [K, D], q_mu [D], q_std [D] "
                "and no parameters or submodules"
            )
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        for name in cls._buffer_names:
            fused.register_buffer(name, getattr(module, name))
        fused.train(module.training)
        return fused


class FlowODE(reference.FlowODE):
    """Fused probability-flow ODE sampler (``num_steps`` Euler steps of an MLP
    velocity field in one :func:`fused_ops.flow_euler` call).

    Built by the reference's constructor, so the parameters
    (``velocity.0/2/4.weight``, ``.bias``), the ``dt`` buffer, their names,
    creation order and, under one seed, values are the reference's.
    ``forward(x0 [B, D]) -> x [B, D]``.

    The step size is ``1 / num_steps`` in the input's dtype; the ``dt`` buffer
    is kept for checkpoint compatibility.  (The reference's buffer is created in
    float32, so a reference module converted to float64 steps with
    ``float64(float32(1 / num_steps))``; the fused one with the float64 value.)
    """

    def forward(self, x0):
        l1, l2, l3 = self.velocity[0], self.velocity[2], self.velocity[4]
        return ops.flow_euler(
            x0, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias, self.num_steps
        )

    def extra_repr(self):
        l1 = self.velocity[0]
        return f"dim={l1.in_features - 1}, hidden={l1.out_features}, num_steps={self.num_steps}"

    @staticmethod
    def matches(module):
        """True if ``module`` is structurally a flow-ODE reference module: an
        int ``num_steps >= 1``, exactly one buffer ``dt`` (0-d), no direct
        parameters, and exactly one child ``velocity`` that is
        ``Sequential(Linear(D+1, H), SiLU(), Linear(H, H), SiLU(), Linear(H, D))``
        with biases."""
        steps = getattr(module, "num_steps", None)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            return False
        buffers = dict(module.named_buffers(recurse=False))
        if set(buffers) != {"dt"} or buffers["dt"].dim() != 0:
            return False
        if list(module.parameters(recurse=False)):
            return False
        children = dict(module.named_children())
        if set(children) != {"velocity"}:
            return False
        seq = children["velocity"]
        if not isinstance(seq, nn.Sequential) or len(seq) != 5:
            return False
        kinds = (nn.Linear, nn.SiLU, nn.Linear, nn.SiLU, nn.Linear)
        if not all(type(m) is kind for m, kind in zip(seq, kinds)):
            return False
        l1, l2, l3 = seq[0], seq[2], seq[4]
        if any(l.bias is None for l in (l1, l2, l3)):
            return False
        d, h = l1.in_features - 1, l1.out_features
        return d >= 1 and (l2.in_features, l2.out_features) == (h, h) and (l3.in_features, l3.out_features) == (h, d)

    @classmethod
    def from_reference(cls, module):
        """A fused module sharing ``module``'s parameters and buffer (no copies)."""
        if not cls.matches(module):
            raise ValueError(
                f"{type(module).__name__} is not a flow-ODE reference module: expected an int "
                "num_steps >= 1, a 0-d buffer dt and a child velocity = Sequential(Linear(D+1, H), "
                "SiLU(), Linear(H, H), SiLU(), Linear(H, D)) with biases"
            )
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.velocity = module.velocity
        fused.num_steps = module.num_steps
        fused.register_buffer("dt", module.dt)
        fused.train(module.training)
        return fused


_FUSED_MODULES = (ImportanceSampler, FlowODE)


def _fused_for(module):
    if isinstance(module, _FUSED_MODULES):
        return None
    for cls in _FUSED_MODULES:
        if cls.matches(module):
            return cls.from_reference(module)
    return None


def convert(model):
    """Replace every reference module inside ``model`` by its fused
    equivalent, sharing parameters and buffers; anything else is left as it
    is.  Works in place and returns the model (or the fused module, when
    ``model`` itself is a reference module)."""
    fused = _fused_for(model)
    if fused is not None:
        return fused
    for name, child in model.named_children():
        setattr(model, name, convert(child))
    return model
