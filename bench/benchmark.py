"""Benchmark driver for ``fused_ops`` (protocol: DESIGN.md section 5).

For every workload and size it times, in one process and one run:

* ``eager``       the reference module (``fused_ops.reference``),
* ``compile``     ``torch.compile(reference)`` (default mode),
* ``compile_ro``  ``torch.compile(reference, mode="reduce-overhead")`` (CUDA only),
* peers           other implementations where installed (``torchdiffeq`` for flow),
* ``fused``       the fused module, called eagerly (no CUDA graph),

all under ``torch.no_grad()``.  Each callable is warmed up, then timed with
``torch.utils.benchmark.Timer.blocked_autorange`` (back-to-back calls with an
accelerator synchronisation around each block); the reported figure is the
median microseconds per call.  Before timing, every variant's outputs are
compared with the eager reference (``atol = rtol = 1e-4``).

The table goes to stdout; ``--save`` also writes it to
``bench/results/<device_slug>.{json,md,png}`` (``--out DIR``: to ``DIR``).
The JSON records the device, torch and CUDA versions, the commit and the
date, and for each fused row the kernel path it took (``fused_ops._paths``,
CUDA).

Training-step rows (``--train``; written to ``<out>/<device_slug>-train.*``,
workloads ``vae_train``, ``flow_train``, ``importance_sampling_train``) time a
training step instead of a forward call, at the same sizes.  A step is::

    for p in params: p.grad = None          # zero_grad(set_to_none=True)
    loss = loss_fn(module(*inputs))         # forward + scalar loss
    loss.backward()
    optimizer.step()                        # only with --optimizer sgd|adam

with the default ``--optimizer none`` timing forward + backward (the part the
fused ops change; an optimizer step costs every variant the same).  Each
variant trains its own deep copy of one seeded reference module, so all start
from the same parameters.  Variants: ``eager`` (the reference module),
``compile`` / ``compile_ro`` (``torch.compile`` of the forward + loss function,
default / ``reduce-overhead`` mode; its backward is the AOTAutograd-compiled
backward, run by the eager ``loss.backward()`` call; the zero_grad and
optimizer step stay eager), peers, and ``fused`` (the fused module's forward
with its registered autograd backward).  The losses are ``-elbo.mean()``
(VAE), ``x.square().mean()`` of the ODE's output (flow) and
``weighted_mean.square().sum() - log(ess)`` (importance sampling, whose
``q_mu``, ``q_std`` and mixture tensors become ``nn.Parameter``s on both
modules).  Every variant's loss and parameter gradients of its first step are
checked against eager's (atol = rtol = 1e-3).  The VAE rows carry the issue's
relative targets (``x eager`` / ``x compile_ro`` of the fused step).

Usage, from the repository root::

    python -m bench.benchmark                      # all workloads, all sizes; prints the table
    python -m bench.benchmark --save               # ... and writes bench/results/<device>.{json,md,png}
    python -m bench.benchmark --device cpu --quick # smoke test
    python -m bench.benchmark --ops flow --sizes default --no-compile
    python -m bench.benchmark --train                      # training-step rows
    python -m bench.benchmark --train --optimizer adam --ops vae
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

if __package__ in (None, ""):
    # Run as ``python bench/benchmark.py``: make ``bench`` and an uninstalled
    # ``fused_ops`` checkout importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Re-exported names (F401) are the benchmark's API for tools/ and tests.
from bench.measure import (as_tuple, compare, measure_variant, snapshot, synchronize,  # noqa: E402,F401
                           time_callable, warn_mismatch)
from bench.report import (build_table, collect_metadata, format_markdown, format_text_table,  # noqa: E402,F401
                          format_us, ordered_variants, write_outputs)
from bench.workloads import (COMPILE, COMPILE_RO, DEFAULT_OUT, EAGER, FUSED, FUSED_RO,  # noqa: E402,F401
                             FUSED_VARIANTS, IS_TENSORS, OPTIMIZERS, QUICK_MIN_RUN_TIME, SEED, TABLE_LEGEND,
                             TRAIN_ATOL, TRAIN_RTOL, TRAIN_SUFFIX, WORKLOADS, Workload, make_train_step,
                             shape_label)


# ----------------------------------------------------------------------------
# Running one workload/size
# ----------------------------------------------------------------------------


def compile_variants(
    compiled: Callable[..., Callable[[], Callable]], device: torch.device, use_compile: bool
) -> List[Tuple[str, Optional[Callable[[], Callable]], str]]:
    """The ``compile`` and ``compile_ro`` entries of a variant list, built by
    ``compiled(**torch_compile_kwargs)``; reduce-overhead (CUDA graphs) is
    CUDA only."""
    if not use_compile:
        return [(COMPILE, None, "disabled by --no-compile"), (COMPILE_RO, None, "disabled by --no-compile")]
    if device.type != "cuda":
        return [(COMPILE, compiled(), ""), (COMPILE_RO, None, "CUDA only")]
    return [(COMPILE, compiled(), ""), (COMPILE_RO, compiled(mode="reduce-overhead"), "")]


def variant_builders(
    workload: Workload, reference: torch.nn.Module, device: torch.device, use_compile: bool, fused_ok: bool
) -> List[Tuple[str, Optional[Callable[[], Callable]], str]]:
    """The variants of one case in display order: ``(name, build, skip_reason)``.

    ``build`` is ``None`` (and ``skip_reason`` set) for a variant that does
    not apply to this run.  Compiled variants reset dynamo first, so every
    case compiles from scratch, with static shapes.
    """

    def compiled_of(make: Callable[[], Callable], **kwargs: Any) -> Callable[[], Callable]:
        def build() -> Callable:
            torch._dynamo.reset()
            return torch.compile(make(), **kwargs)

        return build

    def compiled(**kwargs: Any) -> Callable[[], Callable]:
        return compiled_of(lambda: reference, **kwargs)

    variants: List[Tuple[str, Optional[Callable[[], Callable]], str]] = [(EAGER, lambda: reference, "")]
    variants += compile_variants(compiled, device, use_compile)
    for peer_name, peer in workload.peers.items():
        if peer.available():
            variants.append((peer_name, (lambda p=peer: p.make(reference)), ""))
        else:
            variants.append((peer_name, None, f"{peer.requires} not installed"))
    if fused_ok:
        variants.append((FUSED, lambda: workload.build_fused(reference), ""))
        if use_compile and device.type == "cuda":
            variants.append((FUSED_RO, compiled_of(lambda: workload.build_fused(reference), mode="reduce-overhead"), ""))
    else:
        variants.append((FUSED, None, f"fused_ops.nn.{workload.fused_name} not implemented"))
    return variants


def train_variant_builders(
    workload: Workload,
    reference: torch.nn.Module,
    device: torch.device,
    use_compile: bool,
    fused_ok: bool,
    optimizer: str,
) -> List[Tuple[str, Optional[Callable[[], Callable]], str]]:
    """Like :func:`variant_builders`, for training steps: each build trains
    its own deep copy of ``reference`` (made trainable), so every variant
    starts from the same parameters."""
    loss_fn = workload.train_loss
    assert loss_fn is not None

    def fresh() -> torch.nn.Module:
        return workload.build_trainable(copy.deepcopy(reference))

    def plain(
        make_forward: Callable[[torch.nn.Module], Callable], compile_kwargs: Optional[Dict[str, Any]] = None
    ) -> Callable[[], Callable]:
        def build() -> Callable:
            module = fresh()
            return make_train_step(make_forward(module), module.parameters(), loss_fn, optimizer, compile_kwargs)

        return build

    def compiled(**kwargs: Any) -> Callable[[], Callable]:
        return plain(lambda m: m, dict(kwargs))

    variants: List[Tuple[str, Optional[Callable[[], Callable]], str]] = [(EAGER, plain(lambda m: m), "")]
    variants += compile_variants(compiled, device, use_compile)
    for peer_name, peer in workload.peers.items():
        if peer.available():
            variants.append((peer_name, plain(peer.make), ""))
        else:
            variants.append((peer_name, None, f"{peer.requires} not installed"))
    if fused_ok:
        variants.append((FUSED, plain(workload.build_fused_trainable), ""))
        if use_compile and device.type == "cuda":
            variants.append((FUSED_RO, plain(workload.build_fused_trainable, {"mode": "reduce-overhead"}), ""))
    else:
        variants.append((FUSED, None, f"fused_ops.nn.{workload.fused_name} not implemented"))
    return variants


def run_case(
    workload: Workload,
    size: str,
    device: torch.device,
    min_run_time: float,
    use_compile: bool,
    train: bool = False,
    optimizer: str = "none",
) -> Dict[str, Any]:
    """Time every variant of ``workload`` at ``size``; return the result row.

    With ``train`` the variants are training steps (see the module
    docstring) and the row's workload is named ``<name>_train``.
    """
    params = workload.sizes[size]
    name_ = workload.name + (TRAIN_SUFFIX if train else "")
    label = f"{name_}/{size}"
    fused_ok = workload.fused_available()
    row: Dict[str, Any] = {
        "workload": name_,
        "size": size,
        "shape": shape_label(params),
        "params": dict(params),
        "fused_available": fused_ok,
        "variants": {},
    }
    if train:
        row["mode"] = "train"
        row["optimizer"] = optimizer
    print(f"[{label}] {row['shape']} on {device}", flush=True)

    try:
        torch.manual_seed(SEED)
        reference = workload.make_reference(params).to(device)
        reference = reference.train() if train else reference.eval()
        inputs = tuple(t.to(device) for t in workload.make_inputs(params))
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"    !! {label}: could not build the reference or inputs: {row['error']}", flush=True)
        return row

    if train:
        builders = train_variant_builders(workload, reference, device, use_compile, fused_ok, optimizer)
        context: Any = contextlib.nullcontext()
        check = {"check_first_call": optimizer != "none", "tolerance": (TRAIN_ATOL, TRAIN_RTOL)}
    else:
        builders = variant_builders(workload, reference, device, use_compile, fused_ok)
        context = torch.no_grad()
        check = {} if workload.tolerance is None else {"tolerance": workload.tolerance}
    exact = workload.exact(reference, inputs) if workload.exact is not None and not train else None
    expected: Optional[Tuple[torch.Tensor, ...]] = None
    with context:
        for name, build, skip_reason in builders:
            if build is None:
                row["variants"][name] = {"status": "skipped", "reason": skip_reason}
                continue
            unchecked = name in workload.peers and not workload.peers[name].checked
            if name == FUSED:
                clear_kernel_paths()  # so that the report names only what this variant ran
            result, outputs = measure_variant(name, build, inputs, device, None if unchecked else expected,
                                              min_run_time, label, **check)
            if name == EAGER:
                expected = outputs
            if name == FUSED and result["status"] == "ok":
                paths = kernel_paths(workload, device, train)
                if paths:
                    result["kernel_paths"] = paths
            if exact is not None and outputs is not None:
                result["err_vs_float64"] = [(o.double() - e.to(o.device)).abs().max().item()
                                            for o, e in zip(as_tuple(outputs), exact)]
            row["variants"][name] = result
            if result["status"] == "ok":
                errs = result.get("err_vs_float64")
                note = "  (err vs float64: " + ", ".join(f"{e:.3g}" for e in errs) + ")" if errs else ""
                print(f"    {name:<12} {format_us(result['median_us']):>10} us{note}", flush=True)
            free_memory(device)

    fused_res = row["variants"].get(FUSED, {})
    if workload.bytes_moved is not None and fused_res.get("status") == "ok":
        row["fused_gb_per_s"] = workload.bytes_moved(params) / (fused_res["median_us"] * 1e-6) / 1e9
        print(f"    fused moves {workload.bytes_moved(params) / 1e6:.1f} MB: {row['fused_gb_per_s']:.3g} GB/s",
              flush=True)
    row["match"] = row["variants"][FUSED].get("match")
    row["speedup"] = speedups(row)
    del reference, inputs, expected, exact
    free_memory(device)
    return row


def clear_kernel_paths() -> None:
    """Forget the paths earlier calls took (a build without the hook: nothing)."""
    try:
        from fused_ops import _paths

        _paths.clear_last()
    except (ImportError, AttributeError):
        pass


def kernel_paths(workload: Workload, device: torch.device, train: bool) -> Dict[str, str]:
    """The kernel path the latest fused call took, per op (``fused_ops._paths``):
    the forward op's, and with ``train`` the backward op's and those of the
    op's training pair (``<op>_train``, ``<op>_train_backward``) where it has
    one; only the ops the variant ran (clear_kernel_paths before it).  Empty
    where the build or the device has no path tables (the CPU kernels have
    one path)."""
    if not workload.op:
        return {}
    try:
        from fused_ops import _paths
    except ImportError:  # a build without the debug hook (tools/compare_builds.py)
        return {}
    try:
        known = {op for op, dev in _paths.tables() if dev == device.type}
    except AttributeError:  # a build whose library has no path tables
        return {}
    ops = [workload.op] + ([workload.op + s for s in ("_backward", "_train", "_train_backward")] if train else [])
    found = {op: _paths.last(op, device.type) for op in ops if op in known}
    return {op: path for op, path in found.items() if path is not None}


def free_memory(device: torch.device) -> None:
    """Drop compiled graphs and cached blocks between variants and cases."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def speedups(row: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """``baseline_time / fused_time`` for every baseline timed in ``row``."""
    fused = row["variants"].get(FUSED, {})
    result: Dict[str, Optional[float]] = {}
    for name, res in row["variants"].items():
        if name in FUSED_VARIANTS or res.get("status") != "ok":
            continue
        result[name] = res["median_us"] / fused["median_us"] if fused.get("status") == "ok" else None
    return result


def add_targets(row: Dict[str, Any], workload: Workload) -> None:
    """Attach the DESIGN.md section 7 target (CUDA runs only) to ``row``.

    Training rows carry the workload's relative targets instead:
    ``speedup_targets`` {baseline: minimum speed-up of the fused step},
    ``meets_target`` (``None`` when a baseline was not timed) and
    ``target_misses`` (the baselines whose target was missed or not timed).
    """
    if row.get("mode") == "train":
        targets = workload.train_speedup_targets.get(row["size"])
        if not targets or "speedup" not in row:
            return
        row["speedup_targets"] = dict(targets)
        misses = []
        unknown = False
        for baseline, minimum in targets.items():
            ratio = row["speedup"].get(baseline)
            if ratio is None:
                unknown = True
                misses.append(f"{baseline} not timed")
            elif ratio < minimum:
                misses.append(f"{ratio:.2f}x {baseline}")
        row["target_misses"] = misses
        row["meets_target"] = None if unknown else not misses
        return
    target = workload.targets_us.get(row["size"])
    if target is None:
        return
    row["target_us"] = target
    fused = row["variants"].get(FUSED, {})
    if fused.get("status") == "ok":
        row["fused_over_target"] = fused["median_us"] / target
        row["meets_target"] = fused["median_us"] <= target


# ----------------------------------------------------------------------------
# Device
# ----------------------------------------------------------------------------


def resolve_device(choice: str) -> torch.device:
    """Map ``--device`` to a ``torch.device`` (``auto``: CUDA when available)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda, but torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(choice)



# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.benchmark",
        description="Time the fused_ops operators against eager PyTorch and torch.compile.",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device to run on (auto: cuda if available)")
    parser.add_argument("--ops", default=None,
                        help="comma-separated workloads (%s) or 'all'; default: every workload "
                             "with a fused implementation. Named workloads without one run the "
                             "baselines only." % ", ".join(WORKLOADS))
    parser.add_argument("--sizes", choices=("default", "large", "all"), default="all",
                        help="problem sizes to run (default: all)")
    parser.add_argument("--batch", type=int, default=None, metavar="B",
                        help="time each selected size at batch size B instead of its own (e.g. "
                             "--sizes default --batch 1024 for one row at B=1024)")
    parser.add_argument("--save", action="store_true",
                        help="write the results to bench/results/<device>[-train].{json,md,png} "
                             "(default: print the table only)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write the results to DIR/<device>[-train].{json,md,png} instead")
    parser.add_argument("--name", default=None, metavar="SUFFIX",
                        help="with --save/--out: files <device>[-train]-SUFFIX.* (a run of some workloads "
                             "kept beside the full table)")
    parser.add_argument("--min-run-time", type=float, default=None, metavar="SECONDS",
                        help="minimum timed seconds per variant (default: 1.0 on cuda, 0.5 on cpu; "
                             "overrides --quick)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile variants (quick checks)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny minimum run time ({QUICK_MIN_RUN_TIME:g} s) for smoke tests")
    parser.add_argument("--train", action="store_true",
                        help="time training steps (forward + loss + backward [+ optimizer step]) instead "
                             "of forward calls: rows <workload>_train, written to <slug>-train.*")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                        help="with --train: optimizer step included in the training step (default: none, "
                             "i.e. forward + backward)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.ops is not None:
        # Accept the training rows' names: "vae_train" is "vae" with --train.
        names = [n.strip() for n in args.ops.split(",") if n.strip()]
        if any(n.endswith(TRAIN_SUFFIX) for n in names):
            if not all(n.endswith(TRAIN_SUFFIX) for n in names):
                parser.error("--ops: do not mix training rows (*_train) and forward rows in one run")
            args.train = True
            args.ops = ",".join(n[: -len(TRAIN_SUFFIX)] for n in names)
    if args.optimizer != "none" and not args.train:
        parser.error("--optimizer needs --train")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be positive, got {args.batch}")
    return args


def select_workloads(spec: Optional[str]) -> List[Workload]:
    """Workloads named by ``--ops`` (default: those with a fused module)."""
    if spec is None:
        return [w for w in WORKLOADS.values() if w.fused_available()]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"error: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in dict.fromkeys(names)]


def at_batch(workloads: List[Workload], batch: int) -> List[Workload]:
    """``--batch``: the workloads whose sizes have a batch size ``B``, each
    size at ``B = batch``, without the sizes' targets (set for their own B)."""
    return [dataclasses.replace(w, sizes={k: {**v, "B": batch} for k, v in w.sizes.items()},
                                targets_us={}, train_speedup_targets={})
            for w in workloads if all("B" in v for v in w.sizes.values())]


def import_fused_ops() -> None:
    """Import the package, or exit with a hint on how to build it."""
    try:
        import fused_ops  # noqa: F401
        import fused_ops.nn  # noqa: F401
        import fused_ops.reference  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or the loader's RuntimeError
        raise SystemExit(
            f"error: cannot import fused_ops ({type(exc).__name__}: {exc}).\n"
            "Build it first: pip install --no-build-isolation -e ."
        ) from exc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    import_fused_ops()

    if args.min_run_time is not None:
        min_run_time = args.min_run_time
    elif args.quick:
        min_run_time = QUICK_MIN_RUN_TIME
    else:
        min_run_time = 1.0 if device.type == "cuda" else 0.5
    sizes = ("default", "large") if args.sizes == "all" else (args.sizes,)

    workloads = select_workloads(args.ops)
    if args.batch is not None:
        workloads = at_batch(workloads, args.batch)
    if not workloads:
        print("No workload has a fused implementation yet; name some with --ops.", file=sys.stderr)
        return 1
    skipped = [w.name for w in WORKLOADS.values() if w not in workloads and not w.fused_available()]
    if args.ops is None and skipped:
        print(f"(skipping {', '.join(skipped)}: no fused implementation yet; name them in --ops "
              "to time the baselines)", flush=True)

    if args.train:
        no_train = [w.name for w in workloads if w.train_loss is None]
        workloads = [w for w in workloads if w.train_loss is not None]
        if no_train:
            print(f"(skipping {', '.join(no_train)}: no training step defined)", flush=True)
    meta = collect_metadata(device, args, min_run_time)
    print(f"device: {meta['device']} | torch {meta['torch_version']} (CUDA {meta['cuda_version']}) | "
          f"threads {meta['num_threads']} | min_run_time {min_run_time:g}s", flush=True)
    if meta["load_avg_1m"] is not None and meta["load_avg_1m"] >= 1.0:
        print(f"warning: load average {meta['load_avg_1m']:.2f}: other processes are running, "
              "timings (CPU ones especially) will be noisy", flush=True)

    out_dir = args.out if args.out is not None else DEFAULT_OUT if args.save else None
    rows = []
    for workload in workloads:
        for size in sizes:
            if size not in workload.sizes:  # e.g. snis_batched has one size
                continue
            row = run_case(workload, size, device, min_run_time, use_compile=not args.no_compile,
                           train=args.train, optimizer=args.optimizer)
            if device.type == "cuda":
                add_targets(row, workload)
            rows.append(row)
            if out_dir is not None:  # the rows so far, so a run stopped at a time limit keeps them
                write_outputs(meta, rows, out_dir, plot=False)

    headers, cells = build_table(rows, device.type == "cuda")
    print(f"\n{TABLE_LEGEND}\n")
    print(format_text_table(headers, cells))
    mismatches = [f"{r['workload']}/{r['size']}" for r in rows if r.get("match") is False]
    if mismatches:
        print(f"\n!! fused output MISMATCH for: {', '.join(mismatches)}")
    if out_dir is not None:
        for path in write_outputs(meta, rows, out_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
