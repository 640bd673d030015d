#!/usr/bin/env python3
"""PyTorch-eager baseline for pshard's CUDA GPT: forward+backward tokens/s.

This builds the same GPT-2 model as pshard's GPT (pre-LayerNorm blocks, tanh
GELU, biased block linears, an untied bias-free lm_head, byte vocabulary) in
plain PyTorch and times eager forward+backward of one micro-batch: no
torch.compile, no optimizer step, gradients zeroed with set_to_none each
iteration. The baseline is "PyTorch eager, bf16 weights,
scaled_dot_product_attention"; on a torch without
scaled_dot_product_attention (< 2.0) an explicit masked-softmax attention is
used instead and the JSON says "attention": "manual".

bench/README.md's GPU section runs this next to pshard's `gpu_compute_bench`,
which prints a JSON object with the same keys for the same configuration;
the comparison is the ratio of their tokens_per_s (and mfu, computed from the
same FLOP formula as pshard's GptModelFlops). Human-readable lines go to
stderr; the last line of stdout is one JSON object.

Example (H200, GPT-2 124M defaults):
  python3 bench/gpu/torch_gpt.py --batch 16 --seq_len 1024 --iters 20
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class Block(nn.Module):
    def __init__(self, c, heads, context):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(c, eps=1e-5)
        self.qkv = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c, eps=1e-5)
        self.fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)
        if not HAS_SDPA:
            mask = torch.ones(context, context, dtype=torch.bool).triu(1)
            self.register_buffer("mask", mask, persistent=False)

    def attention(self, x):
        b, t, c = x.shape
        # q, k, v side by side, each split into heads of c / heads: [B, H, T, D].
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        if HAS_SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            att = att.masked_fill(self.mask[:t, :t], float("-inf"))
            y = att.softmax(dim=-1) @ v
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, c, heads, context, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(context, c)
        self.blocks = nn.ModuleList(Block(c, heads, context) for _ in range(layers))
        self.lnf = nn.LayerNorm(c, eps=1e-5)
        self.lm_head = nn.Linear(c, vocab, bias=False)  # not tied to wte
        proj_std = 0.02 / math.sqrt(2 * layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("lnf."):
                nn.init.ones_(p)
            elif name == "wpe.weight":
                nn.init.normal_(p, std=0.01)
            elif name.endswith(("attn_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, std=proj_std)
            else:  # wte, qkv, fc, lm_head
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.lnf(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def model_flops(layers, c, vocab, batch, seq_len):
    """pshard's GptModelFlops: model FLOPs of one forward+backward."""
    tokens = batch * seq_len
    matmul_weights = layers * 12 * c * c + vocab * c
    attention = 12 * layers * batch * seq_len * seq_len * c
    return 6 * matmul_weights * tokens + attention


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--peak_tflops", type=float, default=989.0,
                   help="peak rate for MFU (default: H200 bf16 dense datasheet)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for name in ("layers", "d_model", "heads", "context", "vocab", "batch", "seq_len", "iters"):
        if getattr(a, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.peak_tflops <= 0:
        p.error(f"--peak_tflops must be positive, got {a.peak_tflops}")
    if a.seq_len > a.context:
        p.error(f"--seq_len {a.seq_len} exceeds --context {a.context}")
    if a.d_model % a.heads:
        p.error(f"--d_model {a.d_model} is not divisible by --heads {a.heads}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device} requested but CUDA is not available")
    try:
        torch.device(a.device)
    except RuntimeError as e:
        p.error(f"--device {a.device}: {e}")
    return a


def main():
    a = parse_args()
    log = lambda *s: print(*s, file=sys.stderr, flush=True)  # noqa: E731
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    model = GPT(a.layers, a.d_model, a.heads, a.context, a.vocab)
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    idx = torch.randint(a.vocab, (a.batch, a.seq_len), device=device)
    targets = torch.randint(a.vocab, (a.batch, a.seq_len), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        loss.backward()
        return loss.detach()

    attention = "sdpa" if HAS_SDPA else "manual"
    params = sum(p.numel() for p in model.parameters())
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    log(f"torch {torch.__version__} eager on {a.device} ({device_name}), {a.dtype}, "
        f"attention={attention}" + ("" if HAS_SDPA else " (no scaled_dot_product_attention)"))
    log(f"GPT {a.layers} x {a.d_model}, {a.heads} heads, context {a.context}, vocab {a.vocab}: "
        f"{params / 1e6:.1f}M parameters; batch {a.batch} x {a.seq_len}")

    for _ in range(a.warmup):
        step()
    times_ms = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(a.iters)]
        for start, end in events:
            start.record()
            loss = step()
            end.record()
        torch.cuda.synchronize(device)
        times_ms = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(a.iters):
            t0 = time.perf_counter()
            loss = step()
            times_ms.append((time.perf_counter() - t0) * 1e3)

    ms = sum(times_ms) / len(times_ms)
    flops = model_flops(a.layers, a.d_model, a.vocab, a.batch, a.seq_len)
    tokens_per_s = a.batch * a.seq_len / (ms / 1e3)
    tflops = flops / (ms / 1e3) / 1e12
    max_mem = torch.cuda.max_memory_allocated(device) if cuda else None
    result = {
        "impl": "torch-eager", "torch_version": torch.__version__, "device": a.device,
        "device_name": device_name, "dtype": a.dtype, "attention": attention,
        "layers": a.layers, "d_model": a.d_model, "heads": a.heads, "context": a.context,
        "vocab": a.vocab, "batch": a.batch, "seq_len": a.seq_len, "iters": a.iters,
        "ms_per_iter": ms, "best_ms": min(times_ms), "tokens_per_s": tokens_per_s,
        "tflops": tflops, "mfu": tflops / a.peak_tflops, "peak_tflops": a.peak_tflops,
        "flops_per_iter": flops, "max_memory_bytes": max_mem, "loss": float(loss.item()),
    }
    log(f"forward+backward: {ms:.2f} ms/iter (best {min(times_ms):.2f} ms, {a.iters} iters), "
        f"{tokens_per_s:,.0f} tokens/s")
    log(f"  {flops / 1e9:.3f} GFLOP/iter -> {tflops:.4g} TFLOP/s, "
        f"MFU {100 * result['mfu']:.3g}% of {a.peak_tflops:g} TFLOP/s")
    if max_mem is not None:
        log(f"  max memory allocated {max_mem / 2**30:.2f} GiB")
    log(f"  last loss {result['loss']:.4f}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
