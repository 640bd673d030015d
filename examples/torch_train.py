#!/usr/bin/env python3
"""Trains a small PyTorch transformer language model through pshard: its
parameters live on shard servers (started here, on this machine), each
trainer fetches a layer just in time, pushes its gradient, and the servers
apply AdamW.

  PYTHONPATH=build/python python3 examples/torch_train.py --servers=3 --trainers=2 --steps=100

Any torch model works the same way: pshard.torch.write_job(model, ...)
writes the job (layout and initial weights), pshard-server serves it, and
pshard.torch.ShardedModule(model, ...) trains it.
"""
import argparse
import json
import math
import os
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F

import pshard.torch as pt


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP. The key projection has no
    bias: softmax ignores a constant added to every key, so its gradient
    would be zero."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TransformerLM(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and an
    untied head over `vocab` tokens."""

    def __init__(self, vocab=256, width=64, layers=2, heads=4, context=64):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model, tokens, targets):
    """Mean next-token cross-entropy of `model` (the ShardedModule: calls go
    through it)."""
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def wrap_policy(module):
    """A unit per block, one for the embeddings, and the root's own
    parameters (final norm and head) as the last."""
    return isinstance(module, (Block, nn.Embedding, TransformerLM))


def batch(text, step, rank, size, seq_len):
    """Micro-batch of trainer `rank` at `step`: a function of both alone,
    so a restarted trainer reads the same text."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, len(text) - seq_len - 1, (size,), generator=g)
    rows = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2, help="shard servers (N)")
    parser.add_argument("--trainers", type=int, default=2, help="trainers (M), threads of this process")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "README.md"),
                        help="training text (bytes are tokens)")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--encoding", default="bf16", help="wire encoding of weights and gradients")
    parser.add_argument("--fabric_group", type=int, default=1,
                        help="trainers per fabric group (1: none): a group splits each fetch and push")
    parser.add_argument("--secondary_shard", action="store_true",
                        help="each group member keeps its part of every unit for backward (needs --fabric_group)")
    parser.add_argument("--log_every", type=int, default=10)
    args = parser.parse_args()

    text = torch.tensor(list(open(args.data, "rb").read()), dtype=torch.long)
    torch.manual_seed(0)
    model = TransformerLM(context=args.seq_len)
    job_dir = tempfile.mkdtemp(prefix="pshard-torch-job-")
    layout, init = pt.write_job(model, job_dir, wrap_policy)
    params = sum(p.numel() for p in model.parameters())
    units = len(json.loads(pt.layout_of(model, wrap_policy))["units"])
    print(f"{type(model).__name__}: {params} parameters in {units} units, "
          f"{args.servers} servers, {args.trainers} trainers")
    with pt.LocalServers(args.servers, args.trainers, layout, init, lr=args.lr, min_lr=args.lr / 10,
                         warmup_steps=10, total_steps=args.steps, weight_decay=0.1, grad_clip=1.0) as servers:
        trainers = [pt.ShardedModule(TransformerLM(context=args.seq_len), servers.addresses, rank, wrap_policy,
                                     prefetch=args.prefetch, weight_encoding=args.encoding,
                                     grad_encoding=args.encoding, fabric_group=args.fabric_group,
                                     reshard_after_forward=args.fabric_group if args.secondary_shard else True)
                    for rank in range(args.trainers)]

        def train(rank):
            for step in range(args.steps):
                loss = lm_loss(trainers[rank], *batch(text, step, rank, args.batch, args.seq_len))
                loss.backward()
                report = trainers[rank].step(loss.item(), args.batch * args.seq_len)
                if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                    print(f"step {step}/{args.steps} | loss {loss.item():.3f} | "
                          f"{report['wall_s'] * 1000:.0f} ms (exposed comm {report['comm_exposed_s'] * 1000:.0f} ms)"
                          f" | fetched {report['bytes_fetched'] / 2**20:.2f} MiB", flush=True)

        started = time.time()
        pt.run_trainers(args.trainers, train)
        print(f"trained {args.steps} steps in {time.time() - started:.1f} s")


if __name__ == "__main__":
    main()
