"""The table's building blocks: the ``OpCase`` row type and its parts
(``Accuracy``, ``Bad``, ``BwdBad``, ``PathCase``), small helpers, and the
layout transforms the entries use.  See op_cases.py for what an entry holds."""

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

F32_ULP = 2.0**-23
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def subset_id(names, subset):
    return "+".join(names[i] for i in subset)


def all_subsets(n):
    """Every non-empty subset of range(n), smallest first."""
    return [s for r in range(1, n + 1) for s in itertools.combinations(range(n), r)]


def max_abs(t):
    return t.abs().max().item() if t.numel() else 0.0


# ---------------------------------------------------------------------------
# Table rows
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Accuracy:
    """float32 against a float64 run of the reference, errors summed over
    ``trials`` fresh draws: fused <= bound * reference + floor, where floor is
    ``floor_ulps`` float32 ulps of the summed scales (an output's scale: its
    largest magnitude, at least ``scale_min``).  ``combine="max"`` asks for
    fused <= max(bound * reference, floor) instead."""

    size: tuple
    trials: int = 1
    bound: float = 2.0
    floor_ulps: float = 1.0
    combine: str = "sum"
    scale_min: float = 1.0
    make_kw: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Bad:
    """A broken call: ``modify(args) -> args``; the error must name ``arg`` and
    match ``expected``.  ``scalars`` replaces the op's scalar arguments.
    ``cpu_only``: an error only the CPU kernel raises (a check of the
    values, which CUDA does not make: it would cost a host synchronisation
    per call)."""

    id: str
    modify: Callable
    arg: str
    expected: str
    scalars: Optional[tuple] = None
    cpu_only: bool = False


@dataclass(frozen=True)
class BwdBad:
    """A broken call of the backward op: ``modify(bwd_args) -> bwd_args``, the
    error matches ``match``; ``cuda_only``: needs CUDA inputs."""

    id: str
    modify: Callable
    match: str
    cuda_only: bool = False


@dataclass(frozen=True)
class PathCase:
    """A size at which the CUDA path ``path`` applies (for the forced test)
    or is the natural choice (for the natural-choice test)."""

    path: str
    size: tuple
    dtype: Any = torch.float32
    note: str = ""
    bound: float = 2.0  # float32 error against float64, in units of the float32 reference's
    # (bfloat16 rows: the error against float64 is held to 2x the plain
    # bfloat16 program's plus one bfloat16 ulp, test_cuda_paths.py)


@dataclass(frozen=True)
class OpCase:
    name: str
    fn: Callable  # fused_ops.<op>
    packet: Any  # torch.ops.fused_ops.<op>
    reference: Callable  # reference(*tensors, *scalars) -> outputs
    make: Callable  # make(size, dtype=, device=, requires_grad=, **kw) -> [tensors]
    arg_names: tuple
    out_names: tuple
    out_shapes: Callable  # size -> [shape per output]
    # Arguments the Python function also takes as None (with a meaning of its
    # own: resample draws its uniforms); None there is refused by torch.ops only.
    optional_args: tuple = ()
    # What the tests of the backward op's paths differentiate (None: fn):
    # the function where a route of its own would bypass <op>_backward.
    bwd_fn: Optional[Callable] = None
    # dtype of the inputs -> [dtype per output]; None: every output has the inputs' dtype.
    out_dtypes: Optional[Callable] = None
    # The arguments in the inputs' floating dtype (what bfloat16/float16 inputs
    # are: tests/test_mixed_precision.py); None: every one.  Others keep a
    # dtype of their own (resample's float64 uniforms).
    float_args: Optional[tuple] = None
    # False for an op without gradients (integer outputs): the autograd
    # contract (test_contract_autograd.py) and its table fields do not apply.
    differentiable: bool = True
    scalars: Callable = lambda size: ()
    # False for an op whose Python function has no torch.func (vmap, grad,
    # jvp) support: test_func_transforms.py and test_forward_ad.py skip it.
    func_transforms: bool = True
    # The entries of a size that are tensor dimensions (None: every one): what
    # the dynamic-shape test grows; the others (a method, resample's
    # num_samples: int arguments of the schema) stay.
    tensor_dims: Optional[tuple] = None
    size_id: Callable = lambda size: "x".join(map(str, size))
    # A fresh value of the first input with the maker's distribution (graph replays).
    fresh_first: Callable = torch.randn_like
    # -- forward numerics
    match_sizes: tuple = ()
    match_skip: Callable = lambda size, dtype, device: None  # -> reason or None
    match_check: Optional[Callable] = None  # (case, got, want, args, dtype) -> None; default: tol(dtype)
    single_run_check: Optional[Callable] = None  # (case, got, want, args, dtype) -> None; after match_check
    float64_tight: tuple = ()  # ((size, tol), ...)
    accuracy: tuple = ()
    invariants: Optional[Callable] = None  # (out, args, dtype) -> None; op-specific output properties
    # -- memory and layouts
    poison_sizes: tuple = ()
    poison_numels: Callable = lambda size: ()
    layouts: dict = field(default_factory=dict)  # name -> (args -> views, "noncontig" | "misaligned")
    layout_sizes: tuple = ()
    cpu_rounding_layouts: frozenset = frozenset()  # layouts the CPU BLAS rounds differently
    expanded: Optional[Callable] = None  # device -> (size, args with stride-0 views)
    expanded_bitwise: bool = True
    empty_size: Optional[tuple] = None
    # -- opcheck / meta / compile / determinism / bad inputs
    opcheck_sizes: tuple = ()
    meta_size: tuple = ()
    module: Optional[Callable] = None  # device -> (fused module, reference module, inputs)
    compile_size: tuple = ()
    compile_loss: Optional[Callable] = None  # outputs -> scalar
    compile_tol: dict = field(default_factory=dict)
    determinism_sizes: tuple = ()
    thread_size: tuple = ()
    bad_size: tuple = ()
    bad_inputs: tuple = ()
    cpu_cuda_mix_args: Optional[tuple] = None  # default: every argument
    # -- CUDA specifics
    stream_sizes: tuple = ()
    graph_sizes: tuple = ()
    cuda_cpu_float64: tuple = ()  # ((size, rtol, atol), ...)
    isa_sizes: tuple = ()
    isa_prepare: Optional[str] = None  # Python source run on `args` in the child (see test)
    # -- autograd
    gradcheck_sizes: tuple = ()  # ((size, fast_mode), ...)
    gradcheck_inputs: Optional[Callable] = None  # (case, size, device) -> float64 args requiring grad
    gradcheck_tol: dict = field(default_factory=dict)
    gradcheck_alone_size: tuple = ()
    grad64_sizes: tuple = ()  # ((size, subsets, make_kw), ...)
    grad64_tol: tuple = (1e-10, 1e-12)  # rtol, atol relative to max(|reference grad|, 1)
    grad32_sizes: tuple = ()  # ((size, subset), ...)
    grad32_inputs: Optional[Callable] = None  # (case, size, device) -> float32 args requiring grad
    grad32_upstream: Optional[Callable] = None  # (outs, size) -> [upstream per output]
    grad32_check: Optional[Callable] = None  # (case, got, ref32, exact, ctx) -> None
    # A term nonlinear in the outputs for a gradcheck loss (outputs -> scalar).
    nonlinear_loss: Callable = lambda outs: 0.3 * sum(o.square().sum() for o in outs)
    double_backward_match: str = "does not support double backward"
    # -- the backward op
    bwd: Any = None  # torch.ops.fused_ops.<op>_backward.default
    bwd_args: Optional[Callable] = None  # (case, size, dtype, device, grads) -> tuple
    bwd_grad_names: tuple = ()  # the backward op's upstream gradients, in order
    bwd_upstream_index: int = 0  # an upstream gradient in bwd_args (produced on a side stream)
    bwd_opcheck_sizes: tuple = ()
    bwd_opcheck_grads: tuple = ((True,),)
    bwd_meta_size: tuple = ()
    bwd_determinism_sizes: tuple = ()
    bwd_thread_size: Optional[tuple] = None
    bwd_bad_size: tuple = ()
    bwd_bad: tuple = ()
    bwd_empty_size: Optional[tuple] = None
    bwd_linearity_size: Optional[tuple] = None
    bwd_stream_size: tuple = ()
    bwd_graph_size: tuple = ()
    bwd_cuda_cpu_sizes: tuple = ()
    bwd_accuracy: tuple = ()  # ((size, grads), ...): float32 backward given float64 forward values
    # -- CUDA kernel paths (fused_ops._paths)
    paths: tuple = ()  # PathCase per path: forced on a size where it applies
    natural: tuple = ()  # PathCase: the path the table picks by itself at that size
    refused: tuple = ()  # PathCase: a forced path that does not apply -> RuntimeError
    bwd_paths: tuple = ()
    bwd_natural: tuple = ()
    # The CUDA path table's names in order of preference (fixed: tools and
    # docs name them), and the paths that need compute capability 9.0.
    path_names: tuple = ()
    bwd_path_names: tuple = ()
    sm90_paths: frozenset = frozenset()

    # -- calling
    @property
    def op(self):
        return self.packet.default

    def inputs(self, size, dtype=F32, device="cpu", requires_grad=False, **kw):
        return list(self.make(size, dtype=dtype, device=device, requires_grad=requires_grad, **kw))

    def in_dtype(self, args, dtype):
        """``args`` with the :attr:`float_args` cast to ``dtype``, the others as they are."""
        names = self.arg_names if self.float_args is None else self.float_args
        return [a.to(dtype) if n in names else a for n, a in zip(self.arg_names, args)]

    def op_args(self, args, size, scalars=None):
        """The op's arguments for the table's ``args`` (an op whose schema groups
        tensors into lists regroups them here)."""
        return (*args, *(self.scalars(size) if scalars is None else scalars))

    def call(self, fn, args, size, scalars=None):
        return as_tuple(fn(*self.op_args(args, size, scalars)))

    def fused(self, args, size):
        return self.call(self.fn, args, size)

    def fused_for_backward(self, args, size):
        """The outputs whose gradients run ``<op>_backward`` (bwd_fn's)."""
        return self.call(self.bwd_fn or self.fn, args, size)

    def ref(self, args, size):
        return self.call(self.reference, args, size)

    def bwd_op_args(self, a):
        """The backward op's arguments for the table's ``bwd_args`` (see op_args)."""
        return tuple(a)

    def bwd_call(self, a):
        return self.bwd(*self.bwd_op_args(a))

    def __repr__(self):
        return self.name


# ---------------------------------------------------------------------------
# Layouts: the same values in other memory
# ---------------------------------------------------------------------------


def transposed(t):  # same values, column-major strides
    return t.t().contiguous().t() if t.dim() == 2 else t


def row_step(t):  # every other row (1-D: element) of a NaN-filled buffer
    big = t.new_full((2 * t.shape[0],) + tuple(t.shape[1:]), float("nan"))
    big[::2] = t
    return big[::2]


def col_step(t):
    big = t.new_full((t.shape[0], 3 * t.shape[1]), float("nan"))
    big[:, ::3] = t
    return big[:, ::3]


def offset_view(t):  # storage offset and padded rows
    big = t.new_full((t.shape[0] + 1, t.shape[1] + 2), float("nan"))
    big[1:, 2:] = t
    return big[1:, 2:]


def strided(t):  # every tensor a strided slice of a larger one
    return torch.stack([t, torch.full_like(t, float("nan"))], -1)[..., 0]


def misaligned(t):  # contiguous, one element into a buffer: not 16-byte aligned
    return torch.cat([t.new_full((1,), float("nan")), t.flatten()])[1:].view_as(t)


def per_arg(**fns_by_index):
    """A layout that replaces argument i by fns_by_index['a<i>'](argument)."""
    table = {int(k[1:]): f for k, f in fns_by_index.items()}
    return lambda args: [table[i](a) if i in table else a for i, a in enumerate(args)]


def every(fn):
    return lambda args: [fn(a) for a in args]


def set_arg(i, fn):
    """A modifier of a backward op's arguments that replaces argument i by fn(args)."""

    def apply(a):
        a = list(a)
        a[i] = fn(a)
        return tuple(a)

    return apply
