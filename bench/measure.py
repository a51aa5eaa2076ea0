"""Measuring one variant of a benchmark case: warm-up, the check of its
outputs against the eager reference, and the timing (median per call of
back-to-back calls, ``torch.utils.benchmark.Timer.blocked_autorange``).
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.utils.benchmark as torch_benchmark

from bench.workloads import ATOL, DEFAULT_WARMUP_CALLS, EAGER, RTOL, TRAIN_ATOL, TRAIN_SUFFIX, WARMUP_CALLS, Inputs


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def as_tuple(outputs: Any) -> Tuple[torch.Tensor, ...]:
    """Normalise a module's output (tensor or tuple of tensors) to a tuple."""
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def snapshot(outputs: Any) -> Tuple[torch.Tensor, ...]:
    """Detached copies of ``outputs``, safe from CUDA-graph buffer reuse."""
    return tuple(t.detach().clone() for t in as_tuple(outputs))


def compare(
    expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor], atol: float = ATOL, rtol: float = RTOL
) -> Tuple[bool, Optional[float], str]:
    """Check ``actual`` against ``expected`` output by output.

    Returns ``(match, max_abs_err, detail)``: ``match`` is true when every
    output has the same shape and is ``allclose`` (default atol = rtol =
    1e-4, NaNs equal); ``detail`` names the first offending output.
    """
    if len(expected) != len(actual):
        return False, None, f"{len(actual)} outputs, expected {len(expected)}"
    max_err = 0.0
    detail = ""
    match = True
    for i, (exp, act) in enumerate(zip(expected, actual)):
        if exp.shape != act.shape:
            return False, None, f"output {i}: shape {tuple(act.shape)}, expected {tuple(exp.shape)}"
        act = act.to(device=exp.device, dtype=exp.dtype)
        err = (act - exp).abs().nan_to_num(nan=0.0).max().item() if exp.numel() else 0.0
        max_err = max(max_err, err)
        if not torch.allclose(act, exp, atol=atol, rtol=rtol, equal_nan=True) and match:
            match = False
            detail = f"output {i}: max abs err {err:.3g}"
    return match, max_err, detail


def time_callable(fn: Callable, inputs: Inputs, min_run_time: float, label: str) -> Dict[str, Any]:
    """Median per-call time of ``fn(*inputs)`` via ``blocked_autorange``.

    The timer uses the current intra-op thread count (``Timer`` would default
    to one thread) and synchronises the accelerator around each block.
    """
    timer = torch_benchmark.Timer(
        stmt="fn(*inputs)",
        globals={"fn": fn, "inputs": inputs},
        num_threads=torch.get_num_threads(),
        label=label,
    )
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return {
        "median_us": measurement.median * 1e6,
        "iqr_us": measurement.iqr * 1e6,
        "mean_us": measurement.mean * 1e6,
        "blocks": len(measurement.times),
        "calls_per_block": measurement.number_per_run,
    }


def measure_variant(
    name: str,
    build: Callable[[], Callable],
    inputs: Inputs,
    device: torch.device,
    expected: Optional[Tuple[torch.Tensor, ...]],
    min_run_time: float,
    label: str,
    check_first_call: bool = False,
    tolerance: Tuple[float, float] = (ATOL, RTOL),
) -> Tuple[Dict[str, Any], Optional[Tuple[torch.Tensor, ...]]]:
    """Build, warm up, check and time one variant; never raises.

    Returns the variant's result record and (for use as the reference of the
    other variants) a snapshot of its outputs, or ``None`` on error.  The
    outputs checked are those of the call after warm-up, or with
    ``check_first_call`` (training steps that update the parameters) those of
    the first call.
    """
    result: Dict[str, Any] = {"status": "ok"}
    try:
        start = time.perf_counter()
        fn = build()
        warmup_calls = WARMUP_CALLS.get(name, DEFAULT_WARMUP_CALLS)
        first = snapshot(fn(*inputs)) if check_first_call else None
        for _ in range(warmup_calls - (1 if check_first_call else 0)):
            fn(*inputs)
        synchronize(device)
        result["warmup_s"] = round(time.perf_counter() - start, 3)  # includes compilation
        result["warmup_calls"] = warmup_calls

        outputs = first if first is not None else snapshot(fn(*inputs))
        if expected is not None and name != EAGER:
            match, max_err, detail = compare(expected, outputs, *tolerance)
            result.update(match=match, max_abs_err=max_err)
            if not match:
                result["mismatch"] = detail
                warn_mismatch(label, name, detail)

        result.update(time_callable(fn, inputs, min_run_time, f"{label} {name}"))
        return result, outputs
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the run
        message = f"{type(exc).__name__}: {exc}".strip()
        print(f"    !! {label} {name} failed: {message.splitlines()[0][:200]}", flush=True)
        return {
            "status": "error",
            "error": message,
            "traceback": traceback.format_exc(limit=8),
        }, None


def warn_mismatch(label: str, variant: str, detail: str) -> None:
    """Print a conspicuous warning that a variant disagrees with eager."""
    bar = "!" * 78
    tol = TRAIN_ATOL if label.split("/")[0].endswith(TRAIN_SUFFIX) else ATOL
    print(
        f"{bar}\n!! WARNING: {variant} output does NOT match the eager reference "
        f"(atol=rtol={tol:g})\n!!   {label}: {detail}\n{bar}",
        flush=True,
    )
