#!/usr/bin/python3
"""Reference vectors for the optimizer, made by torch (1.13, CPU):
torch.optim.AdamW (the single-tensor path, foreach=False) over two
tensors, one with weight decay (a matrix) and one without (a bias), for 6
steps, with torch.nn.utils.clip_grad_norm_ over both and the learning rate
of each step set as the schedule in docs (linear warm-up from lr/W to lr
over W steps, then a cosine decay to min_lr at the last step).

Writes, for the C++ suite (tests/unit/common/optimizer_oracle_test.cc):

  config lr min_lr warmup total beta1 beta2 eps weight_decay max_norm
  tensor <name> decay=<0|1> <initial values, float32 bit patterns, hex>
  step <t> lr <lr as %.17g> norm <torch's total norm> clip <torch's factor, float32 hex>
  grad <name> <hex>
  after <name> param <hex> m <hex> v <hex>

Usage: torch_adamw_oracle.py OUT (tests/data/torch_adamw_vectors.txt).
"""
import math
import struct
import sys

import torch

LR, MIN_LR, WARMUP, TOTAL = 1e-2, 1e-3, 2, 6
BETAS, EPS, WEIGHT_DECAY, MAX_NORM = (0.9, 0.95), 1e-8, 0.1, 0.5


def hexes(t):
    return " ".join(f"{struct.unpack('<I', struct.pack('<f', float(v)))[0]:08x}" for v in t.flatten().tolist())


def schedule(step):  # 0-based step, as docs/levers.md and the README give it
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    if step >= TOTAL:
        return MIN_LR
    progress = (step - WARMUP) / (TOTAL - WARMUP)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: torch_adamw_oracle.py OUT")
    torch.manual_seed(20261203)
    matrix = torch.nn.Parameter(torch.randn(37) * 0.2)
    bias = torch.nn.Parameter(torch.randn(11) * 0.05)
    tensors = [("matrix", matrix, 1), ("bias", bias, 0)]
    opt = torch.optim.AdamW([{"params": [matrix], "weight_decay": WEIGHT_DECAY},
                             {"params": [bias], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, foreach=False)
    lines = [f"config {LR!r} {MIN_LR!r} {WARMUP} {TOTAL} {BETAS[0]!r} {BETAS[1]!r} {EPS!r} {WEIGHT_DECAY!r} {MAX_NORM!r}"]
    for name, t, decay in tensors:
        lines.append(f"tensor {name} decay={decay} {hexes(t.detach())}")
    for step in range(TOTAL):
        # Gradients of changing sizes: early steps are clipped, later not.
        scale = 3.0 if step < 3 else 0.02
        grads = {name: torch.randn(t.shape) * scale for name, t, _ in tensors}
        for name, t, _ in tensors:
            t.grad = grads[name].clone()
        norm = torch.nn.utils.clip_grad_norm_([matrix, bias], MAX_NORM)
        # The factor the gradients were multiplied by, as clip_grad_norm_
        # computes it (float32 tensors).
        clip = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        clip32 = struct.unpack("<I", struct.pack("<f", float(clip)))[0]
        lr = schedule(step)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        lines.append(f"step {step} lr {lr:.17g} norm {float(norm):.17g} clip {clip32:08x}")
        for name, _, _ in tensors:
            lines.append(f"grad {name} {hexes(grads[name])}")
        for name, t, _ in tensors:
            state = opt.state[t]
            lines.append(f"after {name} param {hexes(t.detach())} m {hexes(state['exp_avg'])} "
                         f"v {hexes(state['exp_avg_sq'])}")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
