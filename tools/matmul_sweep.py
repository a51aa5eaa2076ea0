"""The float32 products under the kernels on CUDA: each ``matmul`` path forced
(``tf32x3``: 3xTF32 wgmma tensor-core products; ``cublas``: cuBLAS's float32
SIMT products through aten::mm) over the shapes the ops run -- the VAE
forward and backward at B=8192, the ODE sampler's layers at large batch -- and
over a grid around dispatch.cu's size threshold, beside cuBLAS in TF32
(``allow_tf32``, one TF32 product: faster, not float32-accurate) for scale.

    python -m tools.matmul_sweep --out DIR     # CUDA; writes DIR/matmul-sweep.{md,json}

Times: median us per product (torch.utils.benchmark, blocked_autorange) through
``torch.ops.fused_ops._matmul``.  Errors: the largest |C - C64| over the
largest |C64| against a float64 product of the same operands.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tb

import fused_ops  # noqa: F401  (loads the library)
from fused_ops import _paths

PATHS = ("tf32x3", "cublas")
# (what, m, n, k, a transposed, b transposed): a [m, k] @ b [k, n]; "transposed"
# is the view layout the kernels pass (a weight gradient reads G^T, a forward
# Linear reads W^T).
SHAPES = (
    ("VAE 784-256-32 B=8192: x @ w_enc^T", 8192, 256, 784, False, True),
    ("VAE 784-256-32 B=8192: g @ w_dec2^T", 8192, 784, 256, False, True),
    ("VAE 784-256-32 B=8192: grad w_dec2 = G^T h", 784, 256, 8192, True, False),
    ("VAE 784-256-32 B=8192: grad g = G w_dec2", 8192, 256, 784, False, False),
    ("VAE 784-256-32 B=8192: grad w_enc = G^T x", 256, 784, 8192, True, False),
    ("VAE 784-256-32 B=8192: grad w_dec1 = G^T z", 256, 32, 8192, True, False),
    ("VAE 784-400-20 B=8192: grad w_dec2", 784, 400, 8192, True, False),
    ("VAE 784-400-20 B=8192: grad w_enc", 400, 784, 8192, True, False),
    ("VAE 784-400-20 B=8192: g @ w_dec2^T", 8192, 784, 400, False, True),
    ("VAE 784-512-256-64 B=8192: x @ w1^T", 8192, 512, 784, False, True),
    ("VAE 784-512-256-64 B=8192: grad w1", 512, 784, 8192, True, False),
    ("ODE H=512 B=65536: hidden layer", 65536, 512, 512, False, True),
    ("ODE H=512 B=65536: grad W", 512, 512, 65536, True, False),
    ("ODE H=512 B=1024: hidden layer", 1024, 512, 512, False, True),
    ("ODE H=128 B=65536: hidden layer", 65536, 128, 128, False, True),
    ("grid", 64, 64, 4096, False, False),
    ("grid", 128, 128, 1024, False, False),
    ("grid", 256, 256, 256, False, False),
    ("grid", 512, 512, 64, False, False),
    ("grid", 256, 256, 1024, False, False),
    ("grid", 512, 512, 512, False, False),
    ("grid", 1024, 1024, 1024, False, False),
    ("grid", 4096, 4096, 4096, False, False),
)


def operand(rows, cols, transposed):
    if transposed:
        return torch.randn(cols, rows, device="cuda").t()
    return torch.randn(rows, cols, device="cuda")


def timed(fn, min_run_time):
    fn()
    torch.cuda.synchronize()
    return tb.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-run-time", type=float, default=0.1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    op = torch.ops.fused_ops._matmul
    rows = []
    for what, m, n, k, ta, tb_ in SHAPES:
        a, b = operand(m, k, ta), operand(k, n, tb_)
        want = a.double() @ b.double()
        scale = want.abs().max().item()
        row = {"what": what, "m": m, "n": n, "k": k, "a": "T" if ta else "N", "b": "T" if tb_ else "N"}
        for path in PATHS:
            try:
                with _paths.force("matmul", path):
                    row[path] = timed(lambda: op(a, b), args.min_run_time)
                    row[path + "_error"] = (op(a, b).double() - want).abs().max().item() / scale
            except RuntimeError:
                row[path] = row[path + "_error"] = None
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            row["cublas_tf32"] = timed(lambda: a @ b, args.min_run_time)
            row["cublas_tf32_error"] = ((a @ b).double() - want).abs().max().item() / scale
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        op(a, b)
        row["natural"] = _paths.last("matmul")
        rows.append(row)
        cells = "  ".join(f"{p} {row[p]:9.1f}" if row[p] else f"{p} {'-':>9}" for p in PATHS + ("cublas_tf32",))
        print(f"{m:6d}x{n:5d}x{k:6d} {row['a']}{row['b']}  {cells}  natural {row['natural']}  {what}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    from bench.report import git_state

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "git_commit": git_state()[0],
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": "float32", "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    (args.out / "matmul-sweep.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    cols = PATHS + ("cublas_tf32",)
    lines = [f"# The float32 products under the kernels, each matmul path forced: {meta['device']}", "",
             f"torch {meta['torch']}, commit {meta['git_commit']}, {meta['date_utc']}; a [m, k] @ b [k, n], "
             "N: row-major, T: a transposed view; median us per product; error: max |C - C64| / max |C64|. "
             "cublas_tf32 is cuBLAS with allow_tf32 (one TF32 product), for scale: it is not float32-accurate.", "",
             "| product | m | n | k | layout | " + " | ".join(cols) + " | tf32x3 speed-up over cublas | "
             "tf32x3 error | cublas error | cublas_tf32 error | natural |",
             "|---|---:|---:|---:|---|" + "---:|" * (len(cols) + 4) + "---|"]
    for r in rows:
        cells = " | ".join(f"{r[p]:,.1f}" if r[p] else "-" for p in cols)
        speed = f"{r['cublas'] / r['tf32x3']:.2f}x" if r["tf32x3"] and r["cublas"] else "-"
        errs = " | ".join(f"{r[p + '_error']:.1e}" if r[p + "_error"] is not None else "-" for p in cols)
        lines.append(f"| {r['what']} | {r['m']} | {r['n']} | {r['k']} | {r['a']}{r['b']} | {cells} | {speed} | "
                     f"{errs} | {r['natural']} |")
    (args.out / "matmul-sweep.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
