"""Tests of the fused modules fused_ops.nn.ImportanceSampler, FlowODE and VAE,
and of fused_ops.nn.convert (DESIGN.md section 3: same constructor, same
parameter and buffer names, checkpoints load strictly both ways, identical
construction under one seed, constructors from the user's own layers that
share their parameters, conversion of model trees).

Each module's own checks come first (the sampler's buffers and model-tree
conversion, the flow's and the VAE's parameter handling and batch shapes),
then those every module shares, over MODULES.  The users' modules they use
are in user_modules.py.
"""

import pytest
import torch
from torch import nn

import fused_ops
from fused_ops import reference
from fused_ops.nn import ImportanceSampler, convert
from fused_test_utils import DTYPES, Doubled, requires_cuda, tol
from user_modules import (
    ChildSampler,
    ExtraBufferSampler,
    ExtraParamFlow,
    ExtraParamSampler,
    ExtraVAE,
    MissingBufferSampler,
    Model,
    NoBiasFlow,
    NoBiasVAE,
    ReluFlow,
    TanhVAE,
    UserFlow,
    UserSampler,
    UserVAE,
    WrongRankSampler,
    WrongShapeFlow,
    WrongShapeSampler,
    WrongShapeVAE,
    randomise,
)


# ---------------------------------------------------------------------------
# ImportanceSampler
# ---------------------------------------------------------------------------

BUFFERS = ("mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std")
SIZES = [pytest.param(1, 1, id="D1-K1"), pytest.param(16, 3, id="D16-K3"), pytest.param(33, 8, id="D33-K8")]


SAMPLER_NON_MATCHING = {
    "linear": lambda: nn.Linear(4, 4),
    "extra_parameter": lambda: ExtraParamSampler(4, 2),
    "wrong_shapes": lambda: WrongShapeSampler(4, 2),
    "wrong_rank": lambda: WrongRankSampler(4, 2),
    "missing_buffer": lambda: MissingBufferSampler(4, 2),
    "extra_buffer": lambda: ExtraBufferSampler(4, 2),
    "submodule": lambda: ChildSampler(4, 2),
}


# --- construction and checkpoints --------------------------------------------


@pytest.mark.parametrize("dim,k", SIZES)
def test_sampler_buffers_and_repr(dim, k):
    fused = ImportanceSampler(dim, k)
    assert [n for n, _ in fused.named_buffers()] == list(BUFFERS)
    assert list(fused.parameters()) == []
    assert f"dim={dim}" in repr(fused) and f"num_components={k}" in repr(fused)


@pytest.mark.parametrize("dim,k", SIZES)
def test_sampler_state_dict_keys_identical_and_ordered(dim, k):
    ref_sd = reference.ImportanceSampler(dim, k).state_dict()
    fused_sd = ImportanceSampler(dim, k).state_dict()
    assert list(fused_sd) == list(ref_sd)
    for key in ref_sd:
        assert fused_sd[key].shape == ref_sd[key].shape and fused_sd[key].dtype == ref_sd[key].dtype


@pytest.mark.parametrize("dim,k", SIZES)
def test_sampler_load_state_dict_strict_both_ways(dim, k):
    ref = randomise(reference.ImportanceSampler(dim, k))
    fused = ImportanceSampler(dim, k)  # other random mix_mus, default rest
    result = fused.load_state_dict(ref.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name in BUFFERS:
        assert torch.equal(getattr(fused, name), getattr(ref, name)), name
    x = torch.randn(257, dim) * 3
    for f, r in zip(fused(x), ref(x)):
        torch.testing.assert_close(f, r, **tol(torch.float32))

    randomise(fused)
    back = reference.ImportanceSampler(dim, k)
    back.load_state_dict(fused.state_dict(), strict=True)
    for name in BUFFERS:
        assert torch.equal(getattr(back, name), getattr(fused, name)), name


def test_sampler_load_state_dict_strict_rejects_wrong_shape():
    fused = ImportanceSampler(4, 3)
    with pytest.raises(RuntimeError, match="mix_mus"):
        fused.load_state_dict(reference.ImportanceSampler(5, 3).state_dict(), strict=True)


# --- forward ------------------------------------------------------------------


@pytest.mark.parametrize("dim,k", SIZES)
def test_sampler_forward_matches_reference(dim, k, device):
    ref = randomise(reference.ImportanceSampler(dim, k)).to(device)
    fused = ImportanceSampler.from_reference(ref)
    x = torch.randn(4096, dim, device=device) * 3
    got, want = fused(x), ref(x)
    assert isinstance(got, tuple) and len(got) == 2
    assert got[0].shape == (dim,) and got[1].shape == ()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    mean, ess, lw = fused.forward_with_log_weights(x)
    want3 = reference.importance_sampling(x, *(getattr(ref, n) for n in BUFFERS))
    for g, w in zip((mean, ess, lw), want3):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    assert torch.equal(mean, got[0]) and torch.equal(ess, got[1])


def test_sampler_to_float64():
    ref = randomise(reference.ImportanceSampler(5, 3)).to(dtype=torch.float64)
    fused = randomise(ImportanceSampler(5, 3))
    fused = fused.to(dtype=torch.float64)
    assert all(getattr(fused, n).dtype == torch.float64 for n in BUFFERS)
    fused.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1000, 5, dtype=torch.float64) * 3
    got = fused(x)
    assert all(t.dtype == torch.float64 for t in got)
    for g, w in zip(got, ref(x)):
        torch.testing.assert_close(g, w, **tol(torch.float64))


@requires_cuda
def test_sampler_module_cuda():
    ref = randomise(reference.ImportanceSampler(16, 3))
    fused = ImportanceSampler(16, 3)
    fused.load_state_dict(ref.state_dict())
    fused = fused.cuda()
    ref = ref.cuda()
    assert all(getattr(fused, n).is_cuda for n in BUFFERS)
    x = torch.randn(4096, 16, device="cuda") * 3
    got = fused(x)
    assert all(t.is_cuda for t in got)
    for g, w in zip(got, ref(x)):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    # A converted CPU model moved to the GPU afterwards.
    model = convert(nn.Sequential(nn.Linear(16, 16), randomise(reference.ImportanceSampler(16, 3)))).cuda()
    assert isinstance(model[1], ImportanceSampler)
    y = model[0](x)
    for g, w in zip(model[1](y), reference.importance_sampling(y, *(getattr(model[1], n) for n in BUFFERS))[:2]):
        torch.testing.assert_close(g, w, **tol(torch.float32))


# --- from_reference / matches ----------------------------------------------------


def test_sampler_from_reference_shares_storage(device):
    ref = randomise(reference.ImportanceSampler(8, 3)).to(device)
    fused = ImportanceSampler.from_reference(ref)
    assert isinstance(fused, ImportanceSampler)
    for name in BUFFERS:
        assert getattr(fused, name).data_ptr() == getattr(ref, name).data_ptr(), name
    x = torch.randn(2000, 8, device=device) * 3
    before = fused(x)
    with torch.no_grad():
        ref.mix_mus.add_(0.75)
        ref.q_std.mul_(1.5)
    after = fused(x)
    assert not torch.equal(after[0], before[0])
    for g, w in zip(after, ref(x)):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    # ... and the other way round.
    with torch.no_grad():
        fused.mix_weights[0] = 5.0
    assert ref.mix_weights[0].item() == 5.0


def test_sampler_from_reference_user_copy_and_training_flag():
    user = randomise(UserSampler(6, 4)).eval()
    fused = ImportanceSampler.from_reference(user)
    assert not fused.training
    assert list(fused.state_dict()) == list(user.state_dict())
    x = torch.randn(500, 6) * 3
    for g, w in zip(fused(x), user(x)):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def test_sampler_matches_accepts_references():
    assert ImportanceSampler.matches(reference.ImportanceSampler(4, 2))
    assert ImportanceSampler.matches(UserSampler(7, 1))
    assert ImportanceSampler.matches(ImportanceSampler(3, 5))


# --- convert ---------------------------------------------------------------------------


def test_sampler_convert_model_tree():
    model = Model()
    for m in model.modules():
        if isinstance(m, (UserSampler, reference.ImportanceSampler)):
            randomise(m)
    sd_before = model.state_dict()
    ptrs_before = {k: v.data_ptr() for k, v in sd_before.items()}
    originals = dict(model.named_modules())
    x = torch.randn(300, 4) * 3
    outputs_before = {
        name: originals[name](x)
        for name in ("blocks.0.sampler", "blocks.1.sampler", "head")
    }

    converted = convert(model)
    assert converted is model
    modules = dict(model.named_modules())

    # Swapped: reference modules, including the user's own copy two levels down.
    for name in ("blocks.0.sampler", "blocks.1.sampler", "head", "table.ref"):
        assert isinstance(modules[name], ImportanceSampler), name
        assert not isinstance(originals[name], ImportanceSampler)
        for b in BUFFERS:
            assert getattr(modules[name], b).data_ptr() == getattr(originals[name], b).data_ptr()
    for name, want in outputs_before.items():
        for g, w in zip(modules[name](x), want):
            torch.testing.assert_close(g, w, **tol(torch.float32))

    # Untouched: everything else is the very same object.
    for name in ("", "encoder", "blocks", "blocks.0", "blocks.1", "blocks.0.proj", "blocks.0.decoy",
                 "blocks.1.decoy", "extra", "table", "table.lin"):
        assert modules[name] is originals[name], name
    assert type(model.blocks[0].decoy) is WrongShapeSampler
    assert type(model.extra) is ExtraParamSampler
    assert type(model.table["lin"]) is nn.Linear

    # The checkpoint is unchanged: same keys in the same order, same storage.
    sd_after = model.state_dict()
    assert list(sd_after) == list(sd_before)
    assert {k: v.data_ptr() for k, v in sd_after.items()} == ptrs_before
    Model().load_state_dict(sd_after, strict=True)


def test_sampler_convert_bare_reference_module(device):
    ref = randomise(reference.ImportanceSampler(5, 2)).to(device)
    fused = convert(ref)
    assert isinstance(fused, ImportanceSampler)
    for name in BUFFERS:
        assert getattr(fused, name).data_ptr() == getattr(ref, name).data_ptr()
    x = torch.randn(100, 5, device=device)
    for g, w in zip(fused(x), ref(x)):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def test_sampler_convert_leaves_non_matching_and_fused_alone():
    for kind, make in SAMPLER_NON_MATCHING.items():
        module = make()
        assert convert(module) is module, kind
    fused = ImportanceSampler(3, 2)
    assert convert(fused) is fused
    model = convert(convert(Model()))  # idempotent
    assert isinstance(model.head, ImportanceSampler)


def test_sampler_converted_model_under_compile():
    torch._dynamo.reset()
    model = convert(nn.Sequential(nn.Linear(4, 4), randomise(reference.ImportanceSampler(4, 3))))
    x = torch.randn(512, 4)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# FlowODE
# ---------------------------------------------------------------------------


FLOW_NON_MATCHING = {"relu": ReluFlow, "no_bias": NoBiasFlow, "extra_param": ExtraParamFlow, "wrong_shape": WrongShapeFlow}


@pytest.mark.parametrize("dim,steps", [(1, 1), (5, 3), (64, 32)])
def test_flow_forward_matches_reference(dim, steps, device):
    ref_module = reference.FlowODE(dim, steps).to(device)
    fused = fused_ops.nn.FlowODE.from_reference(ref_module)
    x = torch.randn(8, dim, device=device)
    torch.testing.assert_close(fused(x), ref_module(x), **tol(torch.float32))


def test_flow_follows_replaced_and_parametrized_weights():
    # The forward reads parameters from the layers' dictionaries (fused_ops/nn.py);
    # a replaced Parameter and a parametrized weight (a property, no longer in
    # the dictionary) must be what it computes with, as the reference's layers do.
    torch.manual_seed(0)
    fused = fused_ops.nn.FlowODE(5, 3)
    x = torch.randn(4, 5)
    fused.velocity[4].bias = nn.Parameter(torch.randn(5))
    nn.utils.parametrize.register_parametrization(fused.velocity[2], "weight", Doubled())
    want = reference.FlowODE.forward(fused, x)
    torch.testing.assert_close(fused(x), want, **tol(torch.float32))
    nn.utils.parametrize.remove_parametrizations(fused.velocity[2], "weight", leave_parametrized=False)
    assert not torch.allclose(fused(x), want)


def test_flow_from_reference_shares_parameters_and_user_copy(device):
    user = UserFlow(5, 3, hidden=13).to(device)
    fused = fused_ops.nn.FlowODE.from_reference(user)
    assert fused.velocity is user.velocity and fused.dt is user.dt and fused.num_steps == 3
    x = torch.randn(4, 5, device=device)
    torch.testing.assert_close(fused(x), user(x), **tol(torch.float32))
    with torch.no_grad():
        user.velocity[4].bias.add_(1.0)  # seen through the shared parameter
    torch.testing.assert_close(fused(x), user(x), **tol(torch.float32))


def test_flow_convert_model_tree(device):
    model = nn.Sequential(nn.Linear(5, 5), reference.FlowODE(5, 4), ReluFlow(5, 4)).to(device)
    x = torch.randn(3, 5, device=device)
    want = model(x)
    converted = fused_ops.nn.convert(model)
    assert isinstance(converted[1], fused_ops.nn.FlowODE)
    assert type(converted[2]) is ReluFlow  # not a reference module: left alone
    torch.testing.assert_close(converted(x), want, **tol(torch.float32))


# The reference module steps with its own dt buffer and num_steps as they
# are at the call; the fused one must too, after any change of either.
def _set_num_steps(m, ref):
    m.num_steps = ref.num_steps = 5


def _fill_dt(value):
    def change(m, ref):
        with torch.no_grad():
            m.dt.fill_(value)
            ref.dt.fill_(value)
    return change


def _replace_dt(m, ref):
    m.dt = torch.tensor(0.02, device=m.dt.device, dtype=m.dt.dtype)
    ref.dt = m.dt.clone()


def _load_other_dt(m, ref):
    # A checkpoint of a module built with 11 steps: dt = 1/11, num_steps stays.
    sd = reference.FlowODE(6, 11).to(device=m.dt.device, dtype=m.dt.dtype).state_dict()
    m.load_state_dict(sd)
    ref.load_state_dict(sd)


def _load_float64_dt(offset):
    # dt given as a float64 tensor (load_state_dict copies it into the
    # module's buffer, of the module's dtype).  With a tiny offset a float32
    # module's dt is the op's step again.
    def change(m, ref):
        sd = dict(m.state_dict(), dt=torch.tensor(1.0 / 7.0 + offset, dtype=torch.float64))
        m.load_state_dict(sd)
        ref.load_state_dict(sd)
    return change


def _float64_dt_beyond_float32(m, ref):
    # A float64 dt buffer beyond float32's range: inf in a float32 product.
    m.dt = torch.tensor(1e39, device=m.dt.device, dtype=torch.float64)
    ref.dt = m.dt.clone()


FLOW_STATE_CHANGES = {
    "as_built": lambda m, ref: None,
    "num_steps": _set_num_steps,
    "num_steps_and_dt": lambda m, ref: (_set_num_steps(m, ref), _fill_dt(0.3)(m, ref)),
    "dt": _fill_dt(0.37 / 7),
    "dt_zero": _fill_dt(0.0),
    "dt_negative": _fill_dt(-0.1),
    "dt_inf": _fill_dt(float("inf")),
    "dt_nan": _fill_dt(float("nan")),
    "dt_replaced": _replace_dt,
    "dt_float64_beyond_float32": _float64_dt_beyond_float32,
    "state_dict_other_dt": _load_other_dt,
    "state_dict_float64_dt": _load_float64_dt(1e-3),
    "state_dict_float64_dt_rounded": _load_float64_dt(1e-12),
}
# Changes after which the op stepping with 1 / num_steps is within the
# tolerance of the reference anyway.
FLOW_HARMLESS_CHANGES = ("as_built", "state_dict_float64_dt_rounded")


def _flow_pair_with(dtype, device):
    # num_steps = 7: 1/7 in float32 is not 1/7 in float64, so a float64
    # module's dt buffer (the float32 rounding) is not the op's float64 step.
    ref = reference.FlowODE(6, 7).to(device=device, dtype=dtype)
    fused = fused_ops.nn.FlowODE(6, 7).to(device=device, dtype=dtype)
    fused.load_state_dict(ref.state_dict())
    return fused, ref


@pytest.mark.parametrize("change", list(FLOW_STATE_CHANGES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_flow_follows_num_steps_and_dt(change, dtype, device):
    fused, ref = _flow_pair_with(dtype, device)
    x = torch.randn(9, 6, device=device, dtype=dtype)
    with torch.no_grad():
        fused(x)  # a call before the change: what it learnt of dt must not stick
        FLOW_STATE_CHANGES[change](fused, ref)
        want = ref(x)
        torch.testing.assert_close(fused(x), want, equal_nan=True, **tol(dtype))
        torch.testing.assert_close(fused(x), want, equal_nan=True, **tol(dtype))  # the repeat call
        if change not in FLOW_HARMLESS_CHANGES:
            # The change matters: the op stepping with 1 / num_steps is off.
            weights = [p for layer in (fused.velocity[0], fused.velocity[2], fused.velocity[4])
                       for p in (layer.weight, layer.bias)]
            plain = fused_ops.flow_euler(x, *weights, fused.num_steps)
            assert not torch.allclose(plain, want, equal_nan=True, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_flow_dt_of_the_op_runs_the_op_as_it_is(dtype, device):
    # dt equal to the op's step (float32 as built; float64 with a power-of-two
    # num_steps): the unscaled op, bitwise.
    steps = 7 if dtype == torch.float32 else 8
    fused = fused_ops.nn.FlowODE(6, steps).to(device=device, dtype=dtype)
    x = torch.randn(9, 6, device=device, dtype=dtype)
    weights = [p for layer in (fused.velocity[0], fused.velocity[2], fused.velocity[4])
               for p in (layer.weight, layer.bias)]
    assert torch.equal(fused(x), fused_ops.flow_euler(x, *weights, steps))


@pytest.mark.parametrize("change", ["as_built", "num_steps", "dt", "state_dict_other_dt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_flow_follows_dt_under_compile(change, dtype, device):
    torch._dynamo.reset()
    fused, ref = _flow_pair_with(dtype, device)
    FLOW_STATE_CHANGES[change](fused, ref)
    x = torch.randn(9, 6, device=device, dtype=dtype)
    with torch.no_grad():
        got = torch.compile(fused, fullgraph=True)(x)
        torch.testing.assert_close(got, ref(x), **tol(dtype))
        assert torch.equal(got, fused(x)) or change != "as_built"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_flow_trainable_dt(dtype, device):
    # dt made a parameter: its gradient and the others' are the reference's.
    fused, ref = _flow_pair_with(dtype, device)
    for m in (fused, ref):
        dt = m.dt.detach().clone() * 1.3
        del m.dt
        m.dt = nn.Parameter(dt)
    x = torch.randn(9, 6, device=device, dtype=dtype)
    got = torch.autograd.grad(fused(x).square().sum(), list(fused.parameters()))
    want = torch.autograd.grad(ref(x).square().sum(), list(ref.parameters()))
    assert len(got) == 7
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4 if dtype == torch.float32 else 1e-9, atol=1e-5)


def test_flow_follows_dt_under_torch_func(device):
    # functional_call with another dt, under grad: the reference's gradient.
    fused, ref = _flow_pair_with(torch.float64, device)
    x = torch.randn(9, 6, device=device, dtype=torch.float64)
    params = dict(fused.named_parameters())
    dt = torch.tensor(0.03, device=device, dtype=torch.float64)

    def loss(module, p):
        return torch.func.functional_call(module, {**p, "dt": dt}, (x,)).square().sum()

    got = torch.func.grad(lambda p: loss(fused, p))(params)
    want = torch.func.grad(lambda p: loss(ref, p))(dict(ref.named_parameters()))
    for name in params:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


def test_flow_backward(device):
    ref_module = reference.FlowODE(4, 3).to(device)
    fused = fused_ops.nn.FlowODE.from_reference(ref_module)
    x = torch.randn(5, 4, device=device)
    g_fused = torch.autograd.grad(fused(x).square().sum(), list(fused.parameters()))
    g_ref = torch.autograd.grad(ref_module(x).square().sum(), list(ref_module.parameters()))
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# VAE
# ---------------------------------------------------------------------------

VAE_OUT_NAMES = ("elbo", "recon", "kl")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_vae_seeded_forward_equals_reference(dtype, device, seed):
    ref = reference.VAE(30, 20, 5).to(device=device, dtype=dtype)
    mod = fused_ops.nn.VAE.from_reference(ref)
    x = torch.rand(17, 30, device=device, dtype=dtype)
    torch.manual_seed(seed)
    want = ref(x)
    after_ref = torch.rand(3, device=device)
    torch.manual_seed(seed)
    got = mod(x)
    assert torch.equal(torch.rand(3, device=device), after_ref)  # the same draws, no more
    for name, g, w in zip(VAE_OUT_NAMES, got, want):
        torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
    # Given eps, no draw at all.
    eps = torch.randn(17, 5, device=device, dtype=dtype)
    state = torch.get_rng_state()
    for g, w in zip(mod(x, eps), ref(x, eps)):
        torch.testing.assert_close(g, w, **tol(dtype))
    assert torch.equal(torch.get_rng_state(), state)


def test_vae_batch_shapes():
    mod = fused_ops.nn.VAE(6, 5, 2)
    x = torch.rand(3, 4, 6)
    eps = torch.randn(3, 4, 2)
    got = mod(x, eps)
    want = reference.VAE.forward(mod, x, eps)
    for g, w in zip(got, want):
        assert g.shape == (3, 4)
        torch.testing.assert_close(g, w, **tol(torch.float32))
    single = mod(x[0, 0], eps[0, 0])
    assert all(t.shape == () for t in single)
    torch.testing.assert_close(single[0], got[0][0, 0], **tol(torch.float32))


def test_vae_follows_replaced_and_parametrized_weights():
    # The forward reads parameters from the layers' dictionaries (fused_ops/nn.py);
    # a replaced Parameter and a parametrized weight (a property, no longer in
    # the dictionary) must be what it computes with, as the reference's layers do.
    torch.manual_seed(0)
    mod = fused_ops.nn.VAE(6, 5, 2)
    x, eps = torch.rand(3, 6), torch.randn(3, 2)
    mod.decoder[0].bias = nn.Parameter(torch.randn(5))
    nn.utils.parametrize.register_parametrization(mod.fc_mu, "weight", Doubled())
    want = reference.VAE.forward(mod, x, eps)
    for g, w in zip(mod(x, eps), want):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    nn.utils.parametrize.remove_parametrizations(mod.fc_mu, "weight", leave_parametrized=False)
    assert not torch.allclose(mod(x, eps)[2], want[2])


def test_vae_from_reference_shares_parameters():
    ref = UserVAE(12, 8, 3)
    mod = fused_ops.nn.VAE.from_reference(ref)
    assert mod.encoder[0].weight is ref.encoder[0].weight
    assert mod.decoder[2].bias is ref.decoder[2].bias
    with torch.no_grad():
        ref.fc_mu.bias.add_(1.0)
    x, eps = torch.rand(4, 12), torch.randn(4, 3)
    for g, w in zip(mod(x, eps), ref(x, eps)):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def test_vae_convert_model_tree():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(4, 4)
            self.vae = UserVAE(10, 8, 3)
            self.decoy = TanhVAE(10, 8, 3)
            self.sampler = reference.ImportanceSampler(4, 2)

    model = Model()
    vae = model.vae
    x, eps = torch.rand(5, 10), torch.randn(5, 3)
    want = vae(x, eps)
    fused_ops.nn.convert(model)
    assert isinstance(model.vae, fused_ops.nn.VAE)
    assert isinstance(model.sampler, fused_ops.nn.ImportanceSampler)
    assert type(model.decoy) is TanhVAE
    assert model.vae.fc_logvar.weight is vae.fc_logvar.weight
    for g, w in zip(model.vae(x, eps), want):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    assert isinstance(fused_ops.nn.convert(reference.VAE(5, 4, 2)), fused_ops.nn.VAE)


@requires_cuda
def test_vae_cuda_seeded():
    ref = reference.VAE(784, 256, 32).cuda()
    mod = fused_ops.nn.VAE.from_reference(ref)
    x = torch.rand(128, 784, device="cuda")
    torch.manual_seed(7)
    want = ref(x)
    torch.manual_seed(7)
    got = mod(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(torch.float32))


# ---------------------------------------------------------------------------
# Every module
# ---------------------------------------------------------------------------

# (id, reference class, fused class, constructor arguments)
MODULES = [
    ("ImportanceSampler-D1-K1", reference.ImportanceSampler, ImportanceSampler, (1, 1)),
    ("ImportanceSampler-D16-K3", reference.ImportanceSampler, ImportanceSampler, (16, 3)),
    ("ImportanceSampler-D33-K8", reference.ImportanceSampler, ImportanceSampler, (33, 8)),
    ("FlowODE-D6-S4", reference.FlowODE, fused_ops.nn.FlowODE, (6, 4)),
    ("VAE-20-16-4", reference.VAE, fused_ops.nn.VAE, (20, 16, 4)),
    ("VAE-784-256-32", reference.VAE, fused_ops.nn.VAE, (784, 256, 32)),
]


@pytest.mark.parametrize("ref_cls,fused_cls,ctor", [pytest.param(*m[1:], id=m[0]) for m in MODULES])
def test_construction_under_one_seed_equals_reference(ref_cls, fused_cls, ctor, seed):
    torch.manual_seed(seed)
    ref = ref_cls(*ctor)
    after_ref = torch.rand(8)  # the generator state construction left behind
    torch.manual_seed(seed)
    fused = fused_cls(*ctor)
    assert torch.equal(torch.rand(8), after_ref), "construction consumed different random numbers"
    ref_sd, fused_sd = ref.state_dict(), fused.state_dict()
    assert list(fused_sd) == list(ref_sd)
    for name in ref_sd:
        r, f = ref_sd[name], fused_sd[name]
        assert f.dtype == r.dtype and f.shape == r.shape, name
        assert torch.equal(f, r), name
    fused.load_state_dict(ref_sd, strict=True)
    ref.load_state_dict(fused_sd, strict=True)


NON_MATCHING = {
    **{f"ImportanceSampler-{k}": (ImportanceSampler, make, None) for k, make in SAMPLER_NON_MATCHING.items()},
    **{f"FlowODE-{k}": (fused_ops.nn.FlowODE, lambda c=c: c(4, 3), "flow-ODE reference module")
       for k, c in FLOW_NON_MATCHING.items()},
    **{f"VAE-{c.__name__}": (fused_ops.nn.VAE, lambda c=c: c(6, 5, 2), "not a VAE reference module")
       for c in (TanhVAE, WrongShapeVAE, NoBiasVAE, ExtraVAE)},
}


@pytest.mark.parametrize("kind", list(NON_MATCHING))
def test_from_reference_rejects_non_matching(kind):
    fused_cls, make, message = NON_MATCHING[kind]
    module = make()
    assert not fused_cls.matches(module)
    with pytest.raises(ValueError, match=message or type(module).__name__):
        fused_cls.from_reference(module)
