"""Train a VAE with the fused ELBO (fused_ops.nn.VAE) on synthetic binary images.

The data: noisy copies of a few random binary prototypes (no download).  Each
step draws a batch, computes the per-sample ELBO in one fused op, and takes an
Adam step on -ELBO.  --amp runs the step under torch.autocast (bfloat16 on the
CPU, float16 with a GradScaler on CUDA): the fused op computes in float32.

    python examples/train_vae.py --steps 300
    python examples/train_vae.py --device cuda --compile --amp
"""

import argparse

import torch

import fused_ops


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--sizes", type=int, nargs=3, default=(784, 256, 32), metavar=("I", "H", "L"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the loss (fullgraph)")
    p.add_argument("--amp", action="store_true", help="autocast (+ GradScaler on CUDA)")
    a = p.parse_args()
    torch.manual_seed(0)
    I, H, L = a.sizes
    prototypes = (torch.rand(10, I, device=a.device) < 0.3).float()

    def batch():
        x = prototypes[torch.randint(0, 10, (a.batch,), device=a.device)]
        flip = torch.rand_like(x) < 0.05
        return torch.where(flip, 1 - x, x)

    model = fused_ops.nn.VAE(I, H, L).to(a.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp_dtype = torch.bfloat16 if a.device == "cpu" else torch.float16
    scaler = torch.amp.GradScaler(a.device, enabled=a.amp and a.device != "cpu")

    def loss_fn(x):
        with torch.autocast(a.device, dtype=amp_dtype, enabled=a.amp):
            return -model(x)[0].mean()

    if a.compile:
        loss_fn = torch.compile(loss_fn, fullgraph=True)
    for step in range(a.steps):
        loss = loss_fn(batch())
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step == 0 or (step + 1) % max(a.steps // 5, 1) == 0:
            print(f"step {step + 1:5d}  -ELBO {loss.item():9.3f}")
    with torch.no_grad():
        elbo, recon, kl = model(batch())
    print(f"final: ELBO {elbo.mean().item():.3f}  (reconstruction {recon.mean().item():.3f}, KL {kl.mean().item():.3f})")


if __name__ == "__main__":
    main()
