"""The host-side floor of a training step through a ``torch.library`` custom
op with ``register_autograd``.

The VAE training step of ``python -m bench.benchmark --train`` (grads set to
None, forward + loss, backward) is timed three ways on the same parameters
and inputs:

* ``eager``: the reference module;
* ``fused``: ``fused_ops.nn.VAE`` (the fused forward and backward ops);
* ``floor``: a Python custom op with the same signature as
  ``fused_ops::vae_elbo`` (12 tensors in, three [B] tensors out), registered
  the same way (``register_fake``, ``register_autograd`` with a
  ``setup_context`` that saves the 12 inputs), whose forward and backward
  allocate their outputs and compute nothing.

``floor`` is what any op registered through ``torch.library`` pays on this
host before doing any work (the Python autograd wrapper, the engine, the
loss, gradient accumulation, allocation); when ``fused`` is close to it, the
step is host-bound and faster kernels cannot shorten it.

    python -m bench.autograd_floor                 # default sizes, CUDA if present
    python -m bench.autograd_floor --batch 128 --out bench/results/x.md
"""

import argparse
import copy
import datetime
import sys
from pathlib import Path
from typing import List, Sequence

import torch
import torch.utils.benchmark as tb
from torch import Tensor

from bench.benchmark import WORKLOADS, make_train_step


@torch.library.custom_op("fused_ops_floor::vae_elbo_noop", mutates_args=())
def vae_elbo_noop(x: Tensor, eps: Tensor, w_enc: Tensor, b_enc: Tensor, w_mu: Tensor, b_mu: Tensor,
                  w_logvar: Tensor, b_logvar: Tensor, w_dec1: Tensor, b_dec1: Tensor, w_dec2: Tensor,
                  b_dec2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b = x.shape[0]
    return x.new_empty(b), x.new_empty(b), x.new_empty(b)


@vae_elbo_noop.register_fake
def _(x, eps, *weights):
    b = x.shape[0]
    return x.new_empty(b), x.new_empty(b), x.new_empty(b)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_elbo, grad_recon, grad_kl):
    return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


vae_elbo_noop.register_autograd(_backward, setup_context=_setup_context)


class FloorVAE(torch.nn.Module):
    """Calls the no-op with the parameters of ``reference`` (shared, same order as the fused op's)."""

    def __init__(self, reference: torch.nn.Module):
        super().__init__()
        self.reference = reference

    def forward(self, x: Tensor, eps: Tensor):
        return vae_elbo_noop(x, eps, *self.reference.parameters())


def time_steps(batch: int, device: torch.device, min_run_time: float) -> List[tuple]:
    import fused_ops.nn

    workload = WORKLOADS["vae"]
    params = dict(workload.sizes["default"], B=batch)
    torch.manual_seed(0)
    reference = workload.make_reference(params).to(device).train()
    inputs = tuple(t.to(device) for t in workload.make_inputs(params))
    rows = []
    for name in ("eager", "fused", "floor"):
        trainable = workload.build_trainable(copy.deepcopy(reference))
        module = {"eager": lambda m: m, "fused": fused_ops.nn.VAE.from_reference, "floor": FloorVAE}[name](trainable)
        step = make_train_step(module, trainable.parameters(), workload.train_loss, "none")
        for _ in range(5):
            step(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        m = tb.Timer("step(*x)", globals={"step": step, "x": inputs}).blocked_autorange(min_run_time=min_run_time)
        rows.append((name, m.median * 1e6))
    return rows


def format_report(device: torch.device, batch: int, rows: Sequence[tuple]) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t = dict(rows)
    lines = [
        f"# Host floor of a torch.library training step: VAE B={batch} on {name}",
        "",
        f"- torch {torch.__version__}, date (UTC) {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}",
        "- median us per training step (grads set to None, forward + loss, backward), "
        "`blocked_autorange` after 5 warm-up steps; `floor`: a no-op custom op with "
        "fused_ops::vae_elbo's signature and registrations (`python -m bench.autograd_floor`)",
        "",
        "| variant | us/step | x eager |",
        "|---|---:|---:|",
    ]
    lines += [f"| {n} | {us:,.1f} | {t['eager'] / us:.2f}x |" for n, us in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = format_report(device, args.batch, time_steps(args.batch, device, args.min_run_time))
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
