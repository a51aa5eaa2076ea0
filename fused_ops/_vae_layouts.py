"""The users' layer layouts that :class:`fused_ops.nn.VAE` can run, besides
its own (the reference's ``encoder`` / ``fc_mu`` / ``fc_logvar`` /
``decoder``): the user's own four parts (``VAE.from_modules``) and the
``fc1`` / ``fc21`` / ``fc22`` / ``fc3`` / ``fc4`` model of pytorch/examples'
``vae/main.py`` (``VAE.from_pytorch_examples``).

The fused kernels compute one network: ``Linear(I, H), ReLU`` to the two
latent heads ``Linear(H, L)`` (mu, logvar), then ``Linear(L, H), ReLU,
Linear(H, I), Sigmoid`` with every Linear carrying a bias.  Each function
here checks that a layout is that network and returns where its five Linear
layers are (paths of child names, as ``fused_ops.nn`` reads them); anything
else raises a ValueError naming the first layer that does not fit and what
was expected there.
"""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["check_linear", "from_modules_paths", "pytorch_examples_paths", "EXAMPLES_LAYERS", "MlpLayout", "mlp_layout",
           "build_mlp", "mlp_outputs"]

#: pytorch/examples' layer names, in the order of the fused op's weights.
EXAMPLES_LAYERS = ("fc1", "fc21", "fc22", "fc3", "fc4")

# Parameter-free children a pytorch/examples-style model may hold beside its
# Linear layers (``self.relu = nn.ReLU()``): they are the kernels' own
# activations.
_EXAMPLES_ACTIVATIONS = (nn.ReLU, nn.Sigmoid)


def _flatten_prefix(enc):
    """1 when the encoder's layers start with ``nn.Flatten(start_dim=1)`` (the
    input ``[B, ...]`` flattened as the first Linear expects), else 0; any
    other Flatten there raises, naming it."""
    if enc and type(enc[0]) is nn.Flatten:
        if (enc[0].start_dim, enc[0].end_dim) != (1, -1):
            raise ValueError(f"encoder[0] must be Flatten(start_dim=1, end_dim=-1), got {enc[0]}")
        return 1
    return 0


def check_linear(layer, name, shape, what):
    """``layer`` is an ``nn.Linear`` with a bias whose weight is ``shape``
    (``(out_features, in_features)``); ``what`` says where the sizes come from."""
    if type(layer) is not nn.Linear:
        raise ValueError(f"{name} must be an nn.Linear {what}, got {type(layer).__name__}")
    if layer.bias is None:
        raise ValueError(f"{name} must have a bias (the fused kernels add one), got {layer}")
    out_f, in_f = layer.weight.shape
    if (out_f, in_f) != tuple(shape):
        raise ValueError(
            f"{name} must be Linear({shape[1]}, {shape[0]}) {what}, got Linear({in_f}, {out_f})")


def _check_kind(layer, name, kind, role):
    if type(layer) is not kind:
        raise ValueError(
            f"{name} is {type(layer).__name__}: the fused kernels apply {kind.__name__} there ({role}; "
            f"other activations and layers are not supported)")


def from_modules_paths(encoder, fc_mu, fc_logvar, decoder):
    """``(paths, sigmoid)``: the paths of the five Linear layers of
    ``encoder = Sequential([Flatten(),] Linear(I, H), ReLU())``, ``fc_mu``,
    ``fc_logvar`` (``Linear(H, L)``) and ``decoder = Sequential(Linear(L, H),
    ReLU(), Linear(H, I)[, Sigmoid()])`` held as the children ``encoder``,
    ``fc_mu``, ``fc_logvar``, ``decoder``, and whether the decoder ends in
    the Sigmoid."""
    if not isinstance(encoder, nn.Sequential):
        raise ValueError(f"encoder must be nn.Sequential(Linear(I, H), ReLU()), got {type(encoder).__name__}")
    if not isinstance(decoder, nn.Sequential):
        raise ValueError(
            f"decoder must be nn.Sequential(Linear(L, H), ReLU(), Linear(H, I)[, Sigmoid()]), "
            f"got {type(decoder).__name__}")
    enc = list(encoder)
    first = _flatten_prefix(enc)
    if len(enc) - first != 2:
        raise ValueError(
            f"encoder must hold Linear(I, H) and ReLU() (one hidden layer, the fused kernels' depth), "
            f"got {len(enc) - first} layers after the optional Flatten")
    lin = enc[first]
    if type(lin) is not nn.Linear:
        raise ValueError(f"encoder[{first}] must be an nn.Linear (the input layer), got {type(lin).__name__}")
    h, i = lin.weight.shape
    check_linear(lin, f"encoder[{first}]", (h, i), "(the input layer)")
    _check_kind(enc[first + 1], f"encoder[{first + 1}]", nn.ReLU, "the encoder's hidden layer")
    if type(fc_mu) is not nn.Linear:
        raise ValueError(f"fc_mu must be an nn.Linear (H -> L), got {type(fc_mu).__name__}")
    l_ = fc_mu.weight.shape[0]
    check_linear(fc_mu, "fc_mu", (l_, h), f"(H = {h}, the encoder's width, to L)")
    check_linear(fc_logvar, "fc_logvar", (l_, h), f"(H = {h} to L = {l_}, fc_mu's latent size)")
    dec = list(decoder)
    if len(dec) not in (3, 4):
        raise ValueError(
            f"decoder must be Sequential(Linear(L, H), ReLU(), Linear(H, I)[, Sigmoid()]) (one hidden layer, "
            f"the fused kernels' depth), got {len(dec)} layers")
    check_linear(dec[0], "decoder[0]", (h, l_), f"(L = {l_} to H = {h}, the encoder's width)")
    _check_kind(dec[1], "decoder[1]", nn.ReLU, "the decoder's hidden layer")
    check_linear(dec[2], "decoder[2]", (i, h), f"(H = {h} to I = {i}, the encoder's input size)")
    if len(dec) == 4:
        _check_kind(dec[3], "decoder[3]", nn.Sigmoid, "the decoder's output, if any")
    paths = (("encoder", str(first)), ("fc_mu",), ("fc_logvar",), ("decoder", "0"), ("decoder", "2"))
    return paths, len(dec) == 4


def pytorch_examples_paths(model):
    """Paths of ``model``'s ``fc1``, ``fc21``, ``fc22``, ``fc3``, ``fc4``:
    the layout of pytorch/examples' VAE (``h1 = relu(fc1(x))``, mu =
    ``fc21(h1)``, logvar = ``fc22(h1)``, ``sigmoid(fc4(relu(fc3(z))))``) at any sizes."""
    kind = type(model).__name__
    children = dict(model.named_children())
    for name in EXAMPLES_LAYERS:
        if name not in children:
            raise ValueError(
                f"{kind} has no layer {name}: expected pytorch/examples' VAE layout fc1 (I -> H), "
                f"fc21 and fc22 (H -> L: mu, logvar), fc3 (L -> H), fc4 (H -> I)")
    for name, child in children.items():
        if name not in EXAMPLES_LAYERS and not isinstance(child, _EXAMPLES_ACTIVATIONS):
            raise ValueError(
                f"{kind}.{name} ({type(child).__name__}) is not part of pytorch/examples' VAE layout "
                f"(fc1, fc21, fc22, fc3, fc4 and parameter-free ReLU/Sigmoid): not supported")
    for name, _ in model.named_parameters(recurse=False):
        raise ValueError(f"{kind}.{name} is a parameter outside pytorch/examples' layers fc1 .. fc4: not supported")
    fc1 = children["fc1"]
    if type(fc1) is not nn.Linear:
        raise ValueError(f"{kind}.fc1 must be an nn.Linear (the input layer), got {type(fc1).__name__}")
    h, i = fc1.weight.shape
    check_linear(fc1, f"{kind}.fc1", (h, i), "(the input layer)")
    fc21 = children["fc21"]
    if type(fc21) is not nn.Linear:
        raise ValueError(f"{kind}.fc21 must be an nn.Linear (H -> L, mu), got {type(fc21).__name__}")
    l_ = fc21.weight.shape[0]
    check_linear(fc21, f"{kind}.fc21", (l_, h), f"(H = {h}, fc1's width, to L: mu)")
    check_linear(children["fc22"], f"{kind}.fc22", (l_, h), f"(H = {h} to L = {l_}: logvar)")
    check_linear(children["fc3"], f"{kind}.fc3", (h, l_), f"(L = {l_} to H = {h})")
    check_linear(children["fc4"], f"{kind}.fc4", (i, h), f"(H = {h} to I = {i}, fc1's input size)")
    return tuple((name,) for name in EXAMPLES_LAYERS)


# ---------------------------------------------------------------------------
# The general layout: MLPs of 1 to 4 hidden layers (fused_ops.vae_mlp_elbo)
# ---------------------------------------------------------------------------

#: The activation layers the general layout takes, with the op's name of each
#: and its parameter (``fused_ops.ops._ode.ACTIVATIONS``).
_MLP_ACTIVATIONS = {
    nn.ReLU: lambda m: ("relu", None),
    nn.LeakyReLU: lambda m: ("leaky_relu", float(m.negative_slope)),
    nn.ELU: lambda m: ("elu", float(m.alpha)),
    nn.SiLU: lambda m: ("silu", None),
    nn.GELU: lambda m: ("gelu_tanh" if m.approximate == "tanh" else "gelu", None),
    nn.Tanh: lambda m: ("tanh", None),
}
_ACT_NAMES = "ReLU, LeakyReLU, ELU, SiLU, GELU, Tanh"
MAX_HIDDEN = 4


class MlpLayout:
    """Where the general layout's Linear layers are (paths of child names) and
    its activation: ``enc``, ``head`` (one path: a ``[mu | logvar]`` Linear;
    two: fc_mu, fc_logvar), ``dec`` (hidden layers, then the output layer),
    ``activation``, ``act_param``, ``sigmoid`` (the decoder ends in one)."""

    def __init__(self, enc, head, dec, activation, act_param, sigmoid):
        self.enc, self.head, self.dec = enc, head, dec
        self.activation, self.act_param, self.sigmoid = activation, act_param, sigmoid

    @property
    def paths(self):
        return self.enc + self.head + self.dec


def _activation_of(layer, name, want=None):
    """``(name, param)`` of an activation layer; ``want``: the network's activation so far."""
    kind = _MLP_ACTIVATIONS.get(type(layer))
    if kind is None:
        raise ValueError(f"{name} is {type(layer).__name__}: expected an activation layer ({_ACT_NAMES})")
    got = kind(layer)
    if want is not None and got != want:
        raise ValueError(f"{name} is {layer}: the layers before apply {want[0]}"
                         f"{'' if want[1] is None else f'({want[1]})'} (one activation across both networks)")
    return got


def _mlp_chain(layers, net, first, in_features, in_what, act):
    """Checks ``Linear, act, Linear, act, ...`` (pairs); returns (paths, width, act)."""
    paths, width = [], in_features
    for k in range(0, len(layers), 2):
        idx = first + k
        lin = layers[k]
        shape_out = lin.weight.shape[0] if type(lin) is nn.Linear else 0
        check_linear(lin, f"{net}[{idx}]", (shape_out, width), in_what if k == 0 else "(the layer before's outputs)")
        act = _activation_of(layers[k + 1], f"{net}[{idx + 1}]", act)
        paths.append((net, str(idx)))
        width = shape_out
    return paths, width, act


def mlp_layout(encoder, fc_mu, fc_logvar, decoder):
    """The :class:`MlpLayout` of ``encoder = Sequential([Flatten(),] Linear, act,
    ... )`` (1 to 4 hidden layers), the head -- ``fc_mu``, ``fc_logvar``
    ``Linear(H, L)``, or ``fc_mu`` alone ``Linear(H, 2L)`` giving ``[mu |
    logvar]`` when ``fc_logvar`` is None -- and ``decoder = Sequential(Linear,
    act, ..., Linear(G, I)[, Sigmoid()])`` (1 to 4 hidden layers), one
    activation of ReLU, LeakyReLU, ELU, SiLU, GELU, Tanh across both; every
    Linear with a bias.  Raises a ValueError naming the first layer that
    does not fit."""
    if not isinstance(encoder, nn.Sequential):
        raise ValueError(f"encoder must be nn.Sequential of (Linear, activation) pairs, got {type(encoder).__name__}")
    if not isinstance(decoder, nn.Sequential):
        raise ValueError(f"decoder must be nn.Sequential(Linear, activation, ..., Linear[, Sigmoid()]), "
                         f"got {type(decoder).__name__}")
    enc = list(encoder)
    first = _flatten_prefix(enc)
    body = enc[first:]
    if len(body) % 2 or not 1 <= len(body) // 2 <= MAX_HIDDEN:
        raise ValueError(f"encoder must hold 1 to {MAX_HIDDEN} (Linear, activation) pairs after the optional "
                         f"Flatten, got {len(body)} layers")
    if type(body[0]) is not nn.Linear:
        raise ValueError(f"encoder[{first}] must be an nn.Linear (the input layer), got {type(body[0]).__name__}")
    i = body[0].weight.shape[1]
    enc_paths, h, act = _mlp_chain(body, "encoder", first, i, "(the input layer)", None)
    if type(fc_mu) is not nn.Linear:
        raise ValueError(f"fc_mu must be an nn.Linear (H -> L, or H -> 2L [mu | logvar] without fc_logvar), "
                         f"got {type(fc_mu).__name__}")
    if fc_logvar is None:
        two_l = fc_mu.weight.shape[0]
        if two_l % 2:
            raise ValueError(f"fc_mu alone must be Linear({h}, 2L) giving [mu | logvar], got {two_l} outputs (odd)")
        l_ = two_l // 2
        check_linear(fc_mu, "fc_mu", (two_l, h), f"(H = {h}, the encoder's width, to 2L: [mu | logvar])")
        head = [("fc_mu",)]
    else:
        l_ = fc_mu.weight.shape[0]
        check_linear(fc_mu, "fc_mu", (l_, h), f"(H = {h}, the encoder's width, to L)")
        check_linear(fc_logvar, "fc_logvar", (l_, h), f"(H = {h} to L = {l_}, fc_mu's latent size)")
        head = [("fc_mu",), ("fc_logvar",)]
    dec = list(decoder)
    sigmoid = bool(dec) and type(dec[-1]) is nn.Sigmoid
    if dec and type(dec[-1]) not in (nn.Linear, nn.Sigmoid):
        raise ValueError(f"decoder[{len(dec) - 1}] is {type(dec[-1]).__name__}: the decoder must end in its output "
                         f"Linear(G, I), or a Sigmoid after it")
    body = dec[:-1] if sigmoid else dec
    if len(body) % 2 == 0 or not 1 <= len(body) // 2 <= MAX_HIDDEN:
        raise ValueError(f"decoder must be Sequential(Linear(L, G_1), activation, ..., Linear(G_k, I)[, Sigmoid()]) "
                         f"with 1 to {MAX_HIDDEN} hidden layers, got {len(dec)} layers")
    dec_paths, g, act = _mlp_chain(body[:-1], "decoder", 0, l_, f"(L = {l_}, the latent size, to the first width)",
                                   act)
    out = len(body) - 1
    check_linear(body[-1], f"decoder[{out}]", (i, g), f"(G = {g} to I = {i}, the encoder's input size)")
    return MlpLayout(enc_paths, head, dec_paths + [("decoder", str(out))], act[0], act[1], sigmoid)


_BUILD_ACTIVATIONS = {"relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "elu": nn.ELU, "silu": nn.SiLU, "gelu": nn.GELU,
                      "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "tanh": nn.Tanh}


def build_mlp(input_dim, widths, latent_dim, activation, head, likelihood):
    """``(encoder, fc_mu, fc_logvar, decoder)`` of ``VAE(I, [H_1, ...], L, ...)``'s
    general layout: the encoder ``Linear(I, H_1), act, ...``, the heads (``head``
    "split": ``fc_mu``, ``fc_logvar``; "joint": ``fc_mu = Linear(H, 2L)``, no
    ``fc_logvar``), the decoder mirroring the widths, ending in a Sigmoid for
    the likelihoods of a probability ("bernoulli", "gaussian_sigmoid")."""
    from .ops import LIKELIHOODS

    if activation not in _BUILD_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, _BUILD_ACTIVATIONS))}, got {activation!r}")
    if head not in ("split", "joint"):
        raise ValueError(f"head must be 'split' (fc_mu, fc_logvar) or 'joint' ([mu | logvar]), got {head!r}")
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {', '.join(map(repr, LIKELIHOODS))}, got {likelihood!r}")
    if not 1 <= len(widths) <= MAX_HIDDEN:
        raise ValueError(f"hidden_dim must hold 1 to {MAX_HIDDEN} widths, got {widths}")
    act = _BUILD_ACTIVATIONS[activation]
    enc, width = [], input_dim
    for w in widths:
        enc += [nn.Linear(width, w), act()]
        width = w
    fc_mu = nn.Linear(width, latent_dim * (2 if head == "joint" else 1))
    fc_logvar = nn.Linear(width, latent_dim) if head == "split" else None
    dec, width = [], latent_dim
    for w in reversed(widths):
        dec += [nn.Linear(width, w), act()]
        width = w
    dec.append(nn.Linear(width, input_dim))
    if likelihood in ("bernoulli", "gaussian_sigmoid"):
        dec.append(nn.Sigmoid())
    return nn.Sequential(*enc), fc_mu, fc_logvar, nn.Sequential(*dec)


def mlp_outputs(layout, likelihood, x, eps, ew, eb, wh, bh, dw, db):
    """``(decoder output, mu, logvar)`` of the general layout, in PyTorch:
    the decoder's output is the mean ``a`` for "gaussian", ``sigmoid(a)`` otherwise."""
    from .ops._ode import _TORCH_ACTS, ACTIVATIONS
    from .ops._vae_mlp import mlp_encode

    act, p = _TORCH_ACTS[layout.activation], layout.act_param
    mu, logvar = mlp_encode(x, ew, eb, wh, bh, ACTIVATIONS[layout.activation], p)
    g = mu + torch.exp(0.5 * logvar) * eps
    for w, b in zip(dw[:-1], db[:-1]):
        g = act(F.linear(g, w, b), p)
    a = F.linear(g, dw[-1], db[-1])
    return (a if likelihood == "gaussian" else torch.sigmoid(a)), mu, logvar
