"""Where a fused call's time goes on the GPU: kernel (device) time vs. the
time a back-to-back caller sees, for every workload and size of the
benchmark.

    python -m tools.kernel_timing                      # CUDA only, from the repository root
    python -m tools.kernel_timing --train --ops vae    # training steps (forward + backward)

Kernel time comes from torch.profiler (sum of the CUDA kernels one call
launches, averaged over calls); per-call time from torch.utils.benchmark, as
in bench.benchmark.  The gap between them is host work: argument checks,
allocation, the Python custom-op and autograd wrappers, the launch itself.
"""

import argparse
import collections
import contextlib
import sys

import torch
import torch.utils.benchmark as tb
from torch.profiler import ProfilerActivity, profile

from bench.benchmark import WORKLOADS, kernel_paths, make_train_step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true",
                        help="time the fused training step (forward + loss + backward, as bench.benchmark --train)")
    parser.add_argument("--ops", default=",".join(WORKLOADS), help="comma-separated workloads (default: all)")
    parser.add_argument("--cpu-ops", type=int, default=0, metavar="N",
                        help="also profile the host side and print the N ops with the most self CPU time")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel timing needs a CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    calls = 20
    grad_mode = contextlib.nullcontext if args.train else torch.no_grad
    for name in args.ops.split(","):
        workload = WORKLOADS[name]
        if not workload.fused_available():
            continue
        for size, params in workload.sizes.items():
            reference = workload.make_reference(params).cuda()
            if args.train:
                trainable = workload.build_trainable(reference.train())
                fused = make_train_step(workload.build_fused_trainable(trainable), trainable.parameters(),
                                        workload.train_loss, "none")
            else:
                fused = workload.build_fused(reference)
            inputs = tuple(t.cuda() for t in workload.make_inputs(params))
            with grad_mode():
                for _ in range(3):
                    fused(*inputs)
                torch.cuda.synchronize()
                wall = tb.Timer("f(*x)", globals={"f": fused, "x": inputs}).blocked_autorange(min_run_time=1)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(calls):
                        fused(*inputs)
                    torch.cuda.synchronize()
            kernels = collections.defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernels[event.name[:90]] += event.time_range.elapsed_us() / calls
            total = sum(kernels.values())
            paths = ", ".join(f"{op} {p}" for op, p in kernel_paths(workload, torch.device("cuda"), args.train).items())
            print(f"{workload.name}{'_train' if args.train else ''}/{size} {params}: per call {wall.median * 1e6:.1f} us, "
                  f"kernels {total:.1f} us/call" + (f" (paths: {paths})" if paths else ""))
            for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"    {us:9.1f} us  {name}")
            if args.cpu_ops:
                with grad_mode():
                    with profile(activities=[ProfilerActivity.CPU]) as host:
                        for _ in range(calls):
                            fused(*inputs)
                        torch.cuda.synchronize()
                print(f"  host side, {calls} calls (times include the profiler's own overhead):")
                print(host.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.cpu_ops,
                                                max_name_column_width=70))
            del reference, fused, inputs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
