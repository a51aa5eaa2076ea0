"""CPU emulation of the flow wgmma kernel's index arithmetic (packing, chunk consumption by wgmma
descriptors, accumulator -> column mapping, x/h placement), in float64, against the reference.
Checks the layouts, not the hardware: the descriptor reading (LBO 128 B along K, SBO 256 B along
rows) and the accumulator layout are the ones bench/wgmma_probe.cu confirmed."""
import numpy as np

kS, kStages = 4, 3
kBlock = 64 * 8
def chunk_floats(np_): return 2 * kS * np_ * 8
def core_offset(r, k): return (r // 8) * 64 + (k // 4) * 32 + (r % 8) * 4 + (k % 4)

def pack(w0, ld, rows, K, np_, n_start, passes, kchunks, kshift=0):
    """pack_core_kernel (single source), float64, big plane = value, small plane = 0."""
    cf = chunk_floats(np_); plane = cf // 2
    out = np.zeros(passes * kchunks * cf)
    w = w0.reshape(-1)
    for chunk in range(passes * kchunks):
        q, c = divmod(chunk, kchunks)
        for o in range(plane):
            s, o3 = divmod(o, np_ * 8)
            col = (o3 // 64) * 8 + (o3 % 32) // 4
            k = ((c + kshift) % kchunks * kS + s) * 8 + ((o3 % 64) // 32) * 4 + o3 % 4
            row = n_start + q * np_ + col
            v = w[row * ld + k] if (row < rows and k < K) else 0.0
            out[chunk * cf + o] = v
    return out

def wgmma(smem_a, a_off, stage, b_off, N):
    """One k-step: D[64 x N] from A block at a_off and B block at b_off (core layout)."""
    D = np.zeros((64, N))
    for m in range(64):
        for n in range(N):
            D[m, n] = sum(smem_a[a_off + core_offset(m, k)] * stage[b_off + core_offset(n, k)] for k in range(8))
    return D

def run(B=64, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    D_, H = 64, 256
    x0 = rng.standard_normal((B, D_))
    w1 = rng.uniform(-1, 1, (H, D_ + 1)) / 8; b1 = rng.uniform(-1, 1, H) / 8
    w2 = rng.uniform(-1, 1, (H, H)) / 16; b2 = rng.uniform(-1, 1, H) / 16
    w3 = rng.uniform(-1, 1, (D_, H)) / 16; b3 = rng.uniform(-1, 1, D_) / 16
    silu = lambda z: z / (1 + np.exp(-z))
    # reference
    x = x0.copy(); dt = 1.0 / steps
    for k in range(steps):
        t = (k + 0.5) / steps
        h = silu(np.concatenate([x, np.full((B, 1), t)], 1) @ w1.T + b1)
        h = silu(h @ w2.T + b2)
        x = x + dt * (h @ w3.T + b3)
    want = x
    # emulation (one tile of 64 rows, both ranks)
    kNp12, kNp3, kChunks1, kChunks23 = 128, 32, 2, 8
    kHPlane = H // 8 * kBlock
    packed = {}
    for r in range(2):
        # rank r's own half of each layer's K first (kshift, as launch_wgmma packs)
        p1 = pack(w1, D_ + 1, H, D_, kNp12, r * kNp12, 1, kChunks1, r * kChunks1 // 2)
        p2 = pack(w2, H, H, H, kNp12, r * kNp12, 1, kChunks23, r * kChunks23 // 2)
        p3 = pack(w3, H, D_, H, kNp3, r * kNp3, 1, kChunks23, r * kChunks23 // 2)
        packed[r] = (np.concatenate([p1, p2]), p3)
    hsm = {r: np.zeros(2 * kHPlane) for r in range(2)}   # each CTA's copy (big plane only used)
    def store(r_cta, row, k, v):
        hsm[r_cta][(k // 8) * kBlock + core_offset(row, k % 8)] = v
    for r in range(2):
        for row in range(64):
            for k in range(D_):
                store(r, row, k, x0[row, k])
    xm = x0.copy()
    for k in range(steps):
        t = (k + 0.5) / steps
        for layer, (nchunks, Np, K) in enumerate([(kChunks1, kNp12, D_), (kChunks23, kNp12, H), (kChunks23, kNp3, H)]):
            outs = {}
            for r in range(2):
                src1, src2 = packed[r]
                base_chunk = 0 if layer == 0 else (kChunks1 if layer == 1 else None)
                acc = np.zeros((64, Np))
                for c in range(nchunks):
                    if layer < 2:
                        stage = src1[(base_chunk + c) * chunk_floats(kNp12):][:chunk_floats(kNp12)]
                    else:
                        stage = src2[c * chunk_floats(kNp3):][:chunk_floats(kNp3)]
                    # layers 1-2: each warpgroup half of the chunk's columns; layer 3
                    # (split K): warpgroup c % 2 all of chunk c's columns
                    for wgi, N, b, col0 in ([(0, Np // 2, 0, 0), (1, Np // 2, Np * 4, Np // 2)] if layer < 2
                                            else [(c % 2, Np, 0, 0)]):
                        for s in range(kS):
                            a_off = ((c + r * (nchunks // 2)) % nchunks * kS + s) * kBlock  # a_of(c)
                            acc[:, col0:col0 + N] += wgmma(hsm[r], a_off, stage, b + s * Np * 8, N)
                outs[r] = acc
            for r in range(2):
                for n_local in range(outs[r].shape[1]):
                    n = r * outs[r].shape[1] + n_local
                    for row in range(64):
                        v = outs[r][row, n_local]
                        if layer == 0:
                            v = silu(v + t * w1[n, D_] + b1[n])
                        elif layer == 1:
                            v = silu(v + b2[n])
                        else:
                            xm[row, n] = xm[row, n] + dt * (v + b3[n]); v = xm[row, n]
                        store(0, row, n, v); store(1, row, n, v)
    err = np.abs(xm - want).max()
    print(f"emulated flow-wgmma (B=64, {steps} steps) vs float64 reference: max abs err {err:.2e}")
    return err

if __name__ == "__main__":
    assert run() < 1e-9
