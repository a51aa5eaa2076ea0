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

__all__ = ["ImportanceSampler", "convert"]


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


_FUSED_MODULES = (ImportanceSampler,)


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
