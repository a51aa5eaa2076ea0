"""Fused ``nn.Module`` drop-in replacements for the reference modules.

Each fused module has the reference's constructor arguments and the same
parameter/buffer names, shapes and creation order, so under one seed both
construct identical tensors and ``fused.load_state_dict(ref.state_dict())``
works strictly.  :func:`convert` swaps reference modules inside a model tree
for fused ones.  Users keep their own copies of the reference classes, so
reference modules are recognised by structure (attribute names, shapes),
never by class.
"""

import math
import struct

import torch
from torch import nn

from . import _eager, _vae_layouts, ops, reference
from ._ode_sampler import ODESampler

__all__ = ["ImportanceSampler", "MixtureImportanceSampler", "SNIS", "FlowODE", "VAE", "ODESampler", "convert"]


# The fused modules' forwards read their submodules and parameters from the
# modules' own dictionaries: each nn.Module attribute lookup (__getattr__
# searching _parameters, _buffers, _modules) is a Python call of the order of
# a microsecond, and VAE.forward needs seventeen of them around a kernel of a
# few tens of microseconds at the default size.  A name missing from the
# dictionary (e.g. a weight under torch.nn.utils.parametrize, which becomes a
# property) falls back to the attribute.


def _entry(module, table, name):
    """``getattr(module, name)``, read from ``module.<table>`` (``_modules``,
    ``_parameters`` or ``_buffers``) when it is there."""
    value = getattr(module, table).get(name)
    return value if value is not None else getattr(module, name)


def _submodules(module, paths):
    """The submodules of ``module`` at ``paths`` (tuples of child names, such
    as ``("encoder", "0")``), read as :func:`_entry` reads them.  One loop
    rather than a helper call per name: one Python call fewer per name on
    every forward."""
    found = []
    for path in paths:
        m = module
        for name in path:
            child = m._modules.get(name)
            m = child if child is not None else getattr(m, name)
        found.append(m)
    return found


def _buffers_of(module, names):
    return [_entry(module, "_buffers", name) for name in names]


def _round_to(value, dtype):
    """The Python float ``value`` rounded to ``dtype`` (float32 or float64),
    as a tensor of that dtype would hold it."""
    if dtype == torch.float32:
        try:
            return struct.unpack("f", struct.pack("f", value))[0]
        except OverflowError:  # beyond float32's range: inf, as the tensor's cast gives
            return math.copysign(math.inf, value)
    return value


def _transforms_active():
    """Whether a torch.func transform is active (a tensor's value cannot be
    read then); True when the private test is unavailable."""
    return not _eager.enabled or torch._C._are_functorch_transforms_active()


def _linear_params(linears):
    """(weight, bias) of each linear layer, flattened in order, read as
    :func:`_entry` reads them."""
    params = []
    for layer in linears:
        table = layer._parameters
        weight, bias = table.get("weight"), table.get("bias")
        params += (weight if weight is not None else layer.weight, bias if bias is not None else layer.bias)
    return params


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
        return ops.importance_sampling(samples, *_buffers_of(self, self._buffer_names))

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


def _positive_int(value, name):
    """``value`` if it is a positive int (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class MixtureImportanceSampler(nn.Module):
    r"""A trainable importance sampler: diagonal Gaussian-mixture target ``p``
    and proposal ``q`` (``Kq`` components), ``batch_shape`` independent
    problems, one fused :func:`fused_ops.importance_sampling` call per forward.

    Parameters (buffers with ``trainable=False``), in this order::

        logits     [*batch, K]      target weights  softmax(logits)
        mus        [*batch, K, D]   target means
        log_stds   [*batch, K, D]   target stds     exp(log_stds)
        q_logits   [*batch, Kq]     proposal weights softmax(q_logits)
        q_mus      [*batch, Kq, D]  proposal means
        q_log_stds [*batch, Kq, D]  proposal stds   exp(q_log_stds)

    Initialisation: uniform weights (logits zero), target means drawn from
    ``N(0, 2^2)`` and unit stds (as :class:`ImportanceSampler`); proposal
    means drawn from ``N(0, 0.5^2)`` and stds 3, a broad proposal covering
    such a target.  The proposal's means are drawn, not zero, because
    components equal in every parameter receive equal density gradients.

    ``forward(samples [*batch, N, D]) -> (weighted_mean [*batch, D],
    ess [*batch], log_weights [*batch, N], log_evidence [*batch])``, the op's
    batched outputs (``log_weights`` normalised,
    ``log_evidence = logsumexp(log p - log q) - log N``).  The op takes
    ``log w`` of the weights it is given as they are, without normalising
    them (as :func:`fused_ops.reference.importance_sampling` does), so
    unnormalised weights would leave the normalised log weights, mean and
    ESS unchanged but shift the evidence by ``log sum w``; the module passes
    ``softmax(logits)`` and ``softmax(q_logits)``, normalised, so ``p`` and
    ``q`` are densities and ``log_evidence`` estimates ``log`` of ``p``'s
    integral, 0.  For samples drawn from ``q`` its expectation is at most 0
    (Jensen), equal only when ``q = p``: maximising it (an
    importance-weighted bound) fits the proposal to the target.  A logit
    more than about 100 (float32; 740 in float64) below its problem's
    largest gives a weight of 0, a component that no longer counts.

    The proposal is always passed in the mixture form (``q_weights``), also
    for ``Kq = 1``: ``importance_sampling`` turns a Gaussian proposal into
    one component of weight 1 and runs the same two kernels
    (``importance_log_weights``, ``snis``), and ``softmax`` of one logit is
    exactly 1, so both forms give the same values; the mixture form costs one
    ``softmax`` of ``[*batch, 1]`` (and its backward) more and gives
    ``q_logits`` a gradient (exactly zero) like every other parameter.

    :meth:`sample` draws from the proposal, reparameterised; see there.
    :meth:`from_distributions` copies torch.distributions objects.
    """

    _names = ("logits", "mus", "log_stds", "q_logits", "q_mus", "q_log_stds")

    def __init__(self, num_components, dim, proposal_components=1, batch_shape=(), *, trainable=True):
        super().__init__()
        k = _positive_int(num_components, "num_components")
        d = _positive_int(dim, "dim")
        kq = _positive_int(proposal_components, "proposal_components")
        if isinstance(batch_shape, int) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                   for s in _iter_or_none(batch_shape)):
            raise ValueError(f"batch_shape must be a tuple of positive ints (the independent problems), "
                             f"got {batch_shape!r}")
        if not isinstance(trainable, bool):
            raise ValueError(f"trainable must be a bool, got {trainable!r}")
        b = tuple(batch_shape)
        self._set_tensors(trainable, (
            torch.zeros(*b, k), torch.randn(*b, k, d) * 2.0, torch.zeros(*b, k, d),
            torch.zeros(*b, kq), torch.randn(*b, kq, d) * 0.5, torch.full((*b, kq, d), math.log(3.0))))

    def _set_tensors(self, trainable, tensors):
        for name, t in zip(self._names, tensors):
            if trainable:
                self.register_parameter(name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)
        self.trainable = trainable
        self._table = "_parameters" if trainable else "_buffers"
        self.num_components, self.dim = tensors[1].shape[-2:]
        self.proposal_components = tensors[3].shape[-1]
        self.batch_shape = tuple(tensors[0].shape[:-1])

    def _tensors(self):
        table = self._table
        return [_entry(self, table, name) for name in self._names]

    def forward(self, samples):
        logits, mus, log_stds, q_logits, q_mus, q_log_stds = self._tensors()
        self._check_samples(samples)
        return ops.importance_sampling(
            samples, torch.softmax(logits, -1), mus, log_stds.exp(), q_mus, q_log_stds.exp(),
            q_weights=torch.softmax(q_logits, -1), return_evidence=True)

    def _check_samples(self, samples):
        batch, d = self.batch_shape, self.dim
        if (not isinstance(samples, torch.Tensor) or samples.dim() != len(batch) + 2
                or tuple(samples.shape[:-2]) != batch or samples.shape[-1] != d):
            got = f"shape {list(samples.shape)}" if isinstance(samples, torch.Tensor) else type(samples).__name__
            raise ValueError(f"samples must be [*batch_shape, N, D] = {[*batch, 'N', d]} (batch_shape {batch}, "
                             f"dim {d}), got {got}")

    def sample(self, n, generator=None):
        """``n`` draws of each problem's proposal, ``[*batch, n, D]``:
        ``x = q_mus[c] + exp(q_log_stds[c]) * eps`` with ``eps ~ N(0, I)``
        (``torch.randn``) and the component ``c`` drawn by
        ``torch.multinomial`` from ``softmax(q_logits)`` (no draw for
        ``Kq = 1``); both from ``generator`` when given.  Reparameterised:
        gradients reach ``q_mus`` and ``q_log_stds``.  The choice of ``c`` is
        not differentiable: ``q_logits`` get no gradient through the draw,
        only through ``q``'s density in :meth:`forward`, so their gradient
        of a loss of these samples lacks the score-function term of the
        choice and is biased (maximising the evidence with it moves weight
        away from the components that draw the large weights).  Fit the
        proposal's means and stds this way and keep ``q_logits`` fixed, or
        add that term yourself."""
        n = _positive_int(n, "n")
        _, _, _, q_logits, q_mus, q_log_stds = self._tensors()
        batch, kq, d = self.batch_shape, self.proposal_components, self.dim
        eps = torch.randn(*batch, n, d, generator=generator, dtype=q_mus.dtype, device=q_mus.device)
        if kq == 1:
            return q_mus + q_log_stds.exp() * eps
        b = math.prod(batch)
        probs = torch.softmax(q_logits.detach().reshape(b, kq), -1)
        comp = torch.multinomial(probs, n, replacement=True, generator=generator)[..., None].expand(b, n, d)
        mu = q_mus.reshape(b, kq, d).gather(1, comp).reshape(*batch, n, d)
        log_std = q_log_stds.reshape(b, kq, d).gather(1, comp).reshape(*batch, n, d)
        return mu + log_std.exp() * eps

    def extra_repr(self):
        return (f"num_components={self.num_components}, dim={self.dim}, "
                f"proposal_components={self.proposal_components}, batch_shape={self.batch_shape}, "
                f"trainable={self.trainable}")

    @classmethod
    def from_distributions(cls, target, proposal, *, trainable=True):
        """A module holding copies of the parameters of ``target``, a
        ``MixtureSameFamily(Categorical, Independent(Normal, 1))``, and
        ``proposal``, one of those or an ``Independent(Normal, 1)`` (then
        ``Kq = 1``, ``q_logits`` zero).  ``logits`` are the Categoricals'
        (normalised) logits, ``log_stds`` the Normals' ``log(scale)``;
        ``batch_shape`` is the two distributions' batch shapes broadcast,
        dtype and device the target's (the proposal's must agree)."""
        import torch.distributions as dist

        logits, mus, stds = _mixture_parts(target, "target", dist)
        if isinstance(proposal, dist.Independent):
            q_mus, q_stds = _normal_parts(proposal, "proposal", dist)
            q_mus, q_stds = q_mus[..., None, :], q_stds[..., None, :]
            q_logits = q_mus.new_zeros(q_mus.shape[:-1])
        else:
            q_logits, q_mus, q_stds = _mixture_parts(proposal, "proposal", dist)
        if q_mus.shape[-1] != mus.shape[-1]:
            raise ValueError(f"proposal's event shape [{q_mus.shape[-1]}] differs from target's [{mus.shape[-1]}]")
        if (q_mus.dtype, q_mus.device) != (mus.dtype, mus.device):
            raise ValueError(f"proposal's parameters are {q_mus.dtype} on {q_mus.device}, target's "
                             f"{mus.dtype} on {mus.device}: they must agree")
        try:
            batch = torch.broadcast_shapes(mus.shape[:-2], q_mus.shape[:-2])
        except RuntimeError:
            raise ValueError(f"proposal's batch shape {list(q_mus.shape[:-2])} does not broadcast with target's "
                             f"{list(mus.shape[:-2])}") from None
        parts = [(logits, 1), (mus, 2), (stds.log(), 2), (q_logits, 1), (q_mus, 2), (q_stds.log(), 2)]
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._set_tensors(trainable, [t.detach().expand(*batch, *t.shape[t.dim() - r:]).clone() for t, r in parts])
        return module


def _iter_or_none(value):
    """``value``'s items, or ``[None]`` (a failing item) when it is not iterable."""
    try:
        return list(value)
    except TypeError:
        return [None]


def _normal_parts(d, name, dist):
    """``(loc [..., D], scale [..., D])`` of an ``Independent(Normal, 1)``."""
    if (not isinstance(d, dist.Independent) or not isinstance(d.base_dist, dist.Normal)
            or d.reinterpreted_batch_ndims != 1):
        raise ValueError(f"{name} must be an Independent(Normal, 1) (a diagonal Gaussian), got {d!r}")
    return d.base_dist.loc, d.base_dist.scale


def _mixture_parts(d, name, dist):
    """``(logits [..., K], mus [..., K, D], stds [..., K, D])`` of a
    ``MixtureSameFamily(Categorical, Independent(Normal, 1))``, at its batch shape."""
    if not (isinstance(d, dist.MixtureSameFamily) and isinstance(d.mixture_distribution, dist.Categorical)
            and isinstance(d.component_distribution, dist.Independent)
            and isinstance(d.component_distribution.base_dist, dist.Normal)
            and d.component_distribution.reinterpreted_batch_ndims == 1):
        raise ValueError(f"{name} must be a MixtureSameFamily(Categorical, Independent(Normal, 1)) "
                         f"(a diagonal Gaussian mixture), got {d!r}")
    mus, stds = _normal_parts(d.component_distribution, name, dist)
    k, dim = mus.shape[-2:]
    batch = tuple(d.batch_shape)
    return (d.mixture_distribution.logits.expand(*batch, k), mus.expand(*batch, k, dim),
            stds.expand(*batch, k, dim))


class FlowODE(reference.FlowODE):
    """Fused probability-flow ODE sampler (``num_steps`` Euler steps of an MLP
    velocity field in one :func:`fused_ops.flow_euler` call).

    Built by the reference's constructor, so the parameters
    (``velocity.0/2/4.weight``, ``.bias``), the ``dt`` buffer, their names,
    creation order and, under one seed, values are the reference's.
    ``forward(x0 [B, D]) -> x [B, D]``.

    It computes what the reference module computes from its state at the
    call: ``num_steps`` steps at times ``t = (k + 0.5) / num_steps``, each
    ``x = x + dt * v`` with the ``dt`` buffer (in x0's dtype, as the
    reference's product rounds it) -- also after ``num_steps`` or ``dt`` is
    edited or a checkpoint with another ``dt`` is loaded.

    The fused op steps with ``1 / num_steps`` rounded to x0's dtype.  When
    ``dt`` is exactly that (a module as constructed, or loaded from a
    checkpoint with the same ``num_steps``, in float32), the op runs as it
    is.  Otherwise (edited ``num_steps`` or ``dt``, a float64 module, whose
    ``dt`` buffer holds the float32 rounding of ``1 / num_steps``) the last
    layer's weight and bias go to the op scaled by ``dt * num_steps``, so
    that its step ``(1 / num_steps) * v_scaled`` is ``dt * v`` up to
    rounding (a few units in the last place of the step; two small products
    more per call, differentiable, also in ``dt``).  A non-finite ``dt`` runs
    the reference's own loop on the module's layers.

    Which case applies is decided on the host: a ``dt`` on the CPU is read
    at every call; one on a GPU is read (one synchronisation) only when it
    may have changed -- another tensor, a new version of it (in-place
    writes, ``load_state_dict``), another ``num_steps`` or input dtype.  A
    write that PyTorch does not version (through ``.data``, or a NumPy or
    DLPack view) is not seen: change ``dt`` in place or through
    ``load_state_dict``.  Under ``torch.compile`` (and ``torch.export``),
    ``torch.func`` transforms, or when ``dt`` requires grad (or is on the
    ``meta`` device), nothing is read:
    the scale is computed on the device at every call (exactly 1 when ``dt``
    is the op's step, so the results are the unscaled op's bitwise; a
    non-finite ``dt`` then gives NaN where the reference may give inf).
    """

    _linear_paths = (("velocity", "0"), ("velocity", "2"), ("velocity", "4"))

    def forward(self, x0):
        weights = _linear_params(_submodules(self, self._linear_paths))
        num_steps = self.num_steps
        dt = _entry(self, "_buffers", "dt")
        op_dt = 1.0 / num_steps if isinstance(num_steps, int) else None
        if op_dt is None:  # let the op name the bad num_steps
            return ops.flow_euler(x0, *weights, num_steps)
        # dt in the dtype the op computes in (x0's; float32 for bfloat16/float16
        # x0 and under autocast); the cast only where it changes something: an
        # exported graph would otherwise assert dt's device.
        dtype = ops._dtypes.compute_dtype(x0.dtype, x0.device.type)
        dt_x = dt if dt.dtype == dtype else dt.to(dtype)
        if torch.compiler.is_compiling() or dt.requires_grad or dt.is_meta or _transforms_active():
            scale = torch.where(dt_x == op_dt, 1.0, dt_x / op_dt)
        else:
            step = self._dt_on_host(dt, num_steps, dtype)
            if step == _round_to(op_dt, dtype):
                return ops.flow_euler(x0, *weights, num_steps)
            if not math.isfinite(step):
                return reference.FlowODE.forward(self, x0)
            scale = dt_x / op_dt
        # The op steps with op_dt: the last layer scaled by dt / op_dt makes that step dt * v.
        weights[4], weights[5] = weights[4] * scale, weights[5] * scale
        return ops.flow_euler(x0, *weights, num_steps)

    def _dt_on_host(self, dt, num_steps, dtype):
        """``dt`` rounded to ``dtype``, as a Python float: read from a CPU
        tensor every call, from a GPU tensor only when it may have changed
        (see the class docstring)."""
        if dt.is_cpu:
            return _round_to(float(dt), dtype)
        try:
            key = (dt._version, num_steps, dtype)
        except RuntimeError:  # an inference tensor has no version counter
            return _round_to(float(dt), dtype)
        cached = self.__dict__.get("_dt_host")
        if cached is not None and cached[0] is dt and cached[1] == key:
            return cached[2]
        step = _round_to(float(dt), dtype)
        self.__dict__["_dt_host"] = (dt, key, step)
        return step

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


class VAE(reference.VAE):
    """Fused VAE forward pass (``fused_ops.vae_elbo``).

    Built by the reference's constructor ``(input_dim, hidden_dim,
    latent_dim)``, so the submodules ``encoder = Sequential(Linear(I, H),
    ReLU())``, ``fc_mu``, ``fc_logvar``, ``decoder = Sequential(Linear(L, H),
    ReLU(), Linear(H, I), Sigmoid())``, their parameter names, creation order
    and, under one seed, values are the reference's.  Also built from the
    user's own layers, sharing their parameters (the user's optimiser and
    checkpoints keep working): :meth:`from_reference`, :meth:`from_modules`,
    :meth:`from_pytorch_examples` (whose module keeps pytorch/examples'
    parameter names, ``fc1.weight`` ...).

    ``forward(x, eps=None) -> (elbo, recon, kl)``.  ``x`` is either
    ``[..., I]`` (the reference's batch shapes: each result is ``[...]``) or,
    when its last dimension is not I, ``[B, ...]`` with I elements per sample
    (an image batch ``[B, 1, 28, 28]`` for I = 784), flattened as
    ``x.view(B, -1)``: each result is ``[B]``.  Any other shape is a
    ValueError naming x and I.  Without ``eps`` it draws ``torch.randn_like``
    of the latent mean's shape, dtype and device -- the one random call of
    the reference's forward -- so a seeded run equals a seeded run of the
    reference.  :meth:`forward_with_outputs` also returns the decoder's
    probabilities, mu and logvar.
    """

    _linear_paths = (("encoder", "0"), ("fc_mu",), ("fc_logvar",), ("decoder", "0"), ("decoder", "2"))
    # fused_ops.vae_elbo's likelihood (from_modules sets another).
    _likelihood = "bernoulli"
    # The general layout (fused_ops/_vae_layouts.py's MlpLayout), run by
    # fused_ops.vae_mlp_elbo; None: the one-hidden-layer ReLU layout of vae_elbo.
    _mlp = None

    def __init__(self, input_dim, hidden_dim, latent_dim, *, activation="relu", head="split",
                 likelihood="bernoulli"):
        """``hidden_dim``: an int (one hidden layer) or a list of 1 to 4
        encoder widths (the decoder mirrors them); ``activation``: one of
        relu, leaky_relu, elu, silu, gelu, gelu_tanh, tanh (torch.nn's
        default parameters); ``head``: "split" (``fc_mu``, ``fc_logvar``) or
        "joint" (one ``fc_mu = Linear(H, 2L)`` giving ``[mu | logvar]``);
        ``likelihood``: a :data:`fused_ops.LIKELIHOODS` name ("bernoulli" and
        "gaussian_sigmoid" end the decoder in a Sigmoid).  The defaults build
        the reference exactly (names, creation order, values under one seed)."""
        widths = [hidden_dim] if isinstance(hidden_dim, int) else list(hidden_dim)
        if (activation, head, likelihood, len(widths)) == ("relu", "split", "bernoulli", 1):
            super().__init__(input_dim, widths[0], latent_dim)
            return
        nn.Module.__init__(self)
        self.encoder, self.fc_mu, self.fc_logvar, self.decoder = _vae_layouts.build_mlp(
            input_dim, widths, latent_dim, activation, head, likelihood)
        self._mlp = _vae_layouts.mlp_layout(self.encoder, self.fc_mu, self.fc_logvar, self.decoder)
        self._likelihood = likelihood

    def _mlp_args(self):
        """The op's weight lists of the general layout (a split head concatenated)."""
        lay = self._mlp
        enc = _linear_params(_submodules(self, lay.enc))
        head = _linear_params(_submodules(self, lay.head))
        dec = _linear_params(_submodules(self, lay.dec))
        if len(head) == 4:
            head = [torch.cat([head[0], head[2]]), torch.cat([head[1], head[3]])]
        return enc[0::2], enc[1::2], head[0], head[1], dec[0::2], dec[1::2]

    def _mlp_forward(self, x, eps):
        ew, eb, wh, bh, dw, db = self._mlp_args()
        x2, eps2, batch_shape = self._flatten_to(x, eps, ew[0].shape[1], wh.shape[0] // 2, self._mlp.enc[0])
        elbo, recon, kl = ops.vae_mlp_elbo(x2, eps2, ew, eb, wh, bh, dw, db, activation=self._mlp.activation,
                                           act_param=self._mlp.act_param, likelihood=self._likelihood,
                                           dec_logvar=self._dec_logvar())
        return elbo.reshape(batch_shape), recon.reshape(batch_shape), kl.reshape(batch_shape)

    def forward(self, x, eps=None):
        if self._mlp is not None:
            return self._mlp_forward(x, eps)
        weights = _linear_params(_submodules(self, self._linear_paths))
        if x.dim() == 2 and x.shape[1] == weights[0].shape[1] and (eps is None or eps.dim() == 2):
            if eps is None:
                # The reference calls torch.randn_like(mu) with mu [B, L] of x's dtype and device.
                eps = torch.randn_like(x.new_empty((x.shape[0], weights[2].shape[0])))
            return ops.vae_elbo(x, eps, *weights, likelihood=self._likelihood,
                                dec_logvar=self._parameters.get("dec_logvar"))
        x2, eps2, batch_shape = self._flatten(x, eps, weights)
        elbo, recon, kl = ops.vae_elbo(x2, eps2, *weights, likelihood=self._likelihood,
                                       dec_logvar=self._dec_logvar())
        return elbo.reshape(batch_shape), recon.reshape(batch_shape), kl.reshape(batch_shape)

    def forward_with_outputs(self, x, eps=None):
        """``(elbo, recon, kl, recon_x, mu, logvar)``: :meth:`forward`'s results
        and the decoder's output (``recon_x``, in x's shape: an image batch
        gives images), ``mu`` and ``logvar`` (``[..., L]``), detached
        (``fused_ops.vae_elbo(..., return_outputs=True)``; for the general
        layout the outputs come from PyTorch on the same weights)."""
        if self._mlp is not None:
            return self._mlp_forward_with_outputs(x, eps)
        weights = _linear_params(_submodules(self, self._linear_paths))
        x2, eps2, batch_shape = self._flatten(x, eps, weights)
        elbo, recon, kl, probs, mu, logvar = ops.vae_elbo(x2, eps2, *weights, likelihood=self._likelihood,
                                                          return_outputs=True, dec_logvar=self._dec_logvar())
        latent = batch_shape + (mu.shape[-1],)
        return (elbo.reshape(batch_shape), recon.reshape(batch_shape), kl.reshape(batch_shape),
                probs.reshape(x.shape), mu.reshape(latent), logvar.reshape(latent))

    def _mlp_forward_with_outputs(self, x, eps):
        ew, eb, wh, bh, dw, db = self._mlp_args()
        l_ = wh.shape[0] // 2
        x2, eps2, batch_shape = self._flatten_to(x, eps, ew[0].shape[1], l_, self._mlp.enc[0])
        elbo, recon, kl = self._mlp_forward(x2, eps2)
        with torch.no_grad():
            out, mu, logvar = _vae_layouts.mlp_outputs(self._mlp, self._likelihood, x2, eps2, ew, eb, wh, bh, dw, db)
        latent = batch_shape + (l_,)
        return (elbo.reshape(batch_shape), recon.reshape(batch_shape), kl.reshape(batch_shape),
                out.reshape(x.shape), mu.reshape(latent), logvar.reshape(latent))

    def _dec_logvar(self):
        """The learned per-dimension log-variance (from_modules' dec_logvar), or None."""
        return self._parameters.get("dec_logvar")

    def _flatten(self, x, eps, weights):
        """``(x [N, I], eps [N, L], batch shape)`` for the op (the class docstring's two input forms)."""
        return self._flatten_to(x, eps, weights[0].shape[1], weights[2].shape[0], self._linear_paths[0])

    @staticmethod
    def _flatten_to(x, eps, i, l_, first_path):
        if x.dim() >= 1 and x.shape[-1] == i:
            batch_shape = x.shape[:-1]
        elif x.dim() >= 2 and math.prod(x.shape[1:]) == i:
            batch_shape = x.shape[:1]
        else:
            first = ".".join(first_path)
            raise ValueError(
                f"x must be [..., {i}] or [B, ...] with {i} elements per sample ({i} = {first}.in_features), "
                f"got shape {list(x.shape)}")
        if eps is None:
            eps = torch.randn_like(x.new_empty(batch_shape + (l_,)))
        return x.reshape(-1, i), eps.reshape(-1, eps.shape[-1]), batch_shape

    def extra_repr(self):
        if self._mlp is not None:
            return f"activation={self._mlp.activation}, likelihood={self._likelihood}"
        first, head = _submodules(self, self._linear_paths[:2])
        h, i = first.weight.shape
        extra = "" if self._likelihood == "bernoulli" else f", likelihood={self._likelihood}"
        return f"input_dim={i}, hidden_dim={h}, latent_dim={head.weight.shape[0]}{extra}"

    @classmethod
    def from_modules(cls, encoder, fc_mu, fc_logvar, decoder, likelihood="bernoulli", dec_logvar=None):
        """A fused module running the user's own layers, sharing them (no
        copies): ``encoder = Sequential([Flatten(),] Linear(I, H), ReLU())``,
        ``fc_mu`` and ``fc_logvar`` ``Linear(H, L)``, ``decoder =
        Sequential(Linear(L, H), ReLU(), Linear(H, I)[, Sigmoid()])``, all
        with biases.  Its parameter names are ``encoder.<k>.weight``,
        ``fc_mu.bias`` ... (the reference's when the encoder has no Flatten).

        ``likelihood``: "bernoulli" -- the BCE of the decoder's Sigmoid
        output, or BCE-with-logits of its last Linear when it has no Sigmoid
        -- or "gaussian": ``mse_loss(decoder(z), x, reduction="sum")`` per
        sample, the decoder's output (Sigmoid or Linear) being the mean
        (``fused_ops.vae_elbo``'s likelihoods).  ``dec_logvar``: the user's
        ``nn.Parameter [I]``, a learned per-dimension log-variance of a
        Gaussian with the Linear output as its mean (registered, shared, as
        ``dec_logvar``; the term is then ``-Normal(mean, exp(0.5 *
        dec_logvar)).log_prob(x).sum(-1)``).

        Deeper or other MLPs run through ``fused_ops.vae_mlp_elbo``: an
        encoder of 1 to 4 ``(Linear, activation)`` pairs, the decoder's 1 to 4
        pairs then its output Linear (and optional Sigmoid), one activation
        of ReLU, LeakyReLU, ELU, SiLU, GELU (either form), Tanh across both;
        and ``fc_logvar=None`` with ``fc_mu`` one ``Linear(H, 2L)`` giving
        ``[mu | logvar]``.  Any other layer, activation, depth or width
        mismatch raises a ValueError naming the layer
        (fused_ops/_vae_layouts.py)."""
        if likelihood not in ("bernoulli", "gaussian"):
            raise ValueError(f"likelihood must be 'bernoulli' or 'gaussian', got {likelihood!r}")
        try:  # the one-hidden-layer ReLU layout: fused_ops.vae_elbo's kernels
            paths, sigmoid = _vae_layouts.from_modules_paths(encoder, fc_mu, fc_logvar, decoder)
            layout = None
        except ValueError:  # else the general layout (fused_ops.vae_mlp_elbo), or its error
            layout = _vae_layouts.mlp_layout(encoder, fc_mu, fc_logvar, decoder)
            paths, sigmoid = layout.paths, layout.sigmoid
        if dec_logvar is not None:
            out = ".".join(paths[-1])
            i = _submodules(decoder, [paths[-1][1:]])[0].weight.shape[0]
            if likelihood != "gaussian" or sigmoid:
                raise ValueError("dec_logvar (a learned per-dimension log-variance) needs likelihood='gaussian' "
                                 "and a decoder ending in its Linear (the mean), without Sigmoid")
            if not isinstance(dec_logvar, nn.Parameter) or tuple(dec_logvar.shape) != (i,):
                raise ValueError(f"dec_logvar must be an nn.Parameter [I] (I = {i}, "
                                 f"{out}'s outputs), got {type(dec_logvar).__name__} of shape "
                                 f"{list(getattr(dec_logvar, 'shape', []))}")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.encoder, fused.fc_mu, fused.fc_logvar, fused.decoder = encoder, fc_mu, fc_logvar, decoder
        if dec_logvar is not None:
            fused.dec_logvar = dec_logvar
        fused._linear_paths = paths
        fused._mlp = layout
        fused._likelihood = {("bernoulli", True): "bernoulli", ("bernoulli", False): "bernoulli_logits",
                             ("gaussian", True): "gaussian_sigmoid", ("gaussian", False): "gaussian"}[
                                 likelihood, sigmoid]
        fused.training = encoder.training
        return fused

    @classmethod
    def from_pytorch_examples(cls, model):
        """A fused module sharing the layers of a model in the layout of
        pytorch/examples' ``vae/main.py`` (``fc1`` I -> H, ``fc21`` / ``fc22``
        H -> L for mu / logvar, ``fc3`` L -> H, ``fc4`` H -> I; ReLU hidden
        layers, sigmoid output; 784-400-20 there, any sizes here).

        Its state_dict has the model's names (``fc1.weight`` ...), so the
        model's checkpoints load into it strictly and the model's optimiser
        trains it.  ``-fused(data)[0].sum()`` is the example's
        ``loss_function(*model(data), data)`` (BCE summed + KLD), ``data``
        the ``[B, 1, 28, 28]`` batch itself; ``forward_with_outputs`` also
        gives ``recon_batch`` (as ``probs``, in data's shape), mu and logvar.
        A model with other layers or parameters raises a ValueError naming
        them."""
        paths = _vae_layouts.pytorch_examples_paths(model)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        for (name,) in paths:
            setattr(fused, name, getattr(model, name))
        fused._linear_paths = paths
        fused.training = model.training
        return fused

    _children = ("encoder", "fc_mu", "fc_logvar", "decoder")

    @staticmethod
    def matches(module):
        """True if ``module`` is structurally a VAE reference module: exactly
        the children ``encoder = Sequential(Linear, ReLU)``, ``fc_mu``,
        ``fc_logvar`` (Linear), ``decoder = Sequential(Linear, ReLU, Linear,
        Sigmoid)``, all Linear layers with biases and shapes that chain
        ``I -> H -> L -> H -> I``, and nothing else."""
        children = dict(module.named_children())
        if list(children) != list(VAE._children):
            return False
        if list(module.named_parameters(recurse=False)) or list(module.named_buffers(recurse=False)):
            return False
        enc, mu, lv, dec = (children[n] for n in VAE._children)
        kinds = lambda seq: [type(m) for m in seq] if isinstance(seq, nn.Sequential) else None  # noqa: E731
        if kinds(enc) != [nn.Linear, nn.ReLU] or kinds(dec) != [nn.Linear, nn.ReLU, nn.Linear, nn.Sigmoid]:
            return False
        if type(mu) is not nn.Linear or type(lv) is not nn.Linear:
            return False
        linears = (enc[0], mu, lv, dec[0], dec[2])
        if any(m.bias is None for m in linears):
            return False
        for m in linears:
            if list(m.named_buffers()) or list(m.children()):
                return False
        h, i = enc[0].weight.shape
        l_ = mu.weight.shape[0]
        return (
            tuple(mu.weight.shape) == (l_, h)
            and tuple(lv.weight.shape) == (l_, h)
            and tuple(dec[0].weight.shape) == (h, l_)
            and tuple(dec[2].weight.shape) == (i, h)
        )

    @classmethod
    def from_reference(cls, module):
        """A fused module sharing ``module``'s submodules (and so its
        parameters: no copies)."""
        if not cls.matches(module):
            raise ValueError(
                f"{type(module).__name__} is not a VAE reference module: expected exactly the "
                "children encoder = Sequential(Linear(I, H), ReLU()), fc_mu = Linear(H, L), "
                "fc_logvar = Linear(H, L), decoder = Sequential(Linear(L, H), ReLU(), "
                "Linear(H, I), Sigmoid()), all with biases"
            )
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        for name in cls._children:
            setattr(fused, name, getattr(module, name))
        fused.train(module.training)
        return fused


_FUSED_MODULES = (ImportanceSampler, FlowODE, VAE)


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


class SNIS(reference.SNIS):
    """Drop-in replacement for :class:`fused_ops.reference.SNIS`: one
    :func:`fused_ops.snis` call (self-normalised importance sampling of
    given log weights, batched)."""

    def forward(self, log_weights, samples=None):
        return ops.snis(log_weights, samples, self.moments)

    @classmethod
    def from_reference(cls, module):
        return cls(moments=module.moments)
