"""An export read outside pshard: a small torch GPT written from docs/gpt.md
(not from pshard's code) loads the weights `pshard export` wrote, with a
safetensors reader written here from the format's description, and its
greedy continuation is the one `pshard sample --temperature=0` prints, each
token with the log-probability pshard gives it (`--logprobs`) to within
float rounding.

Run with the bridge on the path: PYTHONPATH=build/python python3 -m unittest
tests/python/gpt_export_test.py (ctest does).
"""
import json
import math
import os
import struct
import subprocess
import tempfile
import unittest

import numpy as np
import torch

from pshard._paths import BIN_DIR

PSHARD = os.path.join(BIN_DIR, "pshard")
PROMPT = "The shard "
TOKENS = 48
# Log-probabilities agree to float32 rounding of sums taken in another
# order (measured: at most 1.4e-6 over the 48 tokens). Read wrongly, the
# docs move them far more: GELU by erf instead of tanh 1.5e-4, LayerNorm
# eps 1e-3 0.4, the attention scaled by 1/sqrt(d_model) 0.12, k and q
# swapped 0.69, heads interleaved instead of contiguous 1.6.
TOLERANCE = 2e-5


def read_safetensors(path):
    """(tensors by name, metadata): an 8-byte little-endian header length,
    a JSON header, then the raw little-endian data."""
    with open(path, "rb") as f:
        raw = f.read()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    metadata = header.pop("__metadata__", {})
    data = raw[8 + length:]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "F32", entry["dtype"]
        tensors[name] = torch.from_numpy(np.frombuffer(data[begin:end], dtype="<f4").copy()).view(entry["shape"])
    return tensors, metadata


class DocGpt(torch.nn.Module):
    """The GPT of docs/gpt.md, from its sizes in the export's metadata."""

    def __init__(self, w, meta):
        super().__init__()
        self.w = w
        self.layers = int(meta["gpt.layers"])
        self.d = int(meta["gpt.d_model"])
        self.heads = int(meta["gpt.heads"])
        self.context = int(meta["gpt.context"])
        self.eps = float(meta["gpt.layer_norm_eps"])

    def norm(self, x, prefix):
        return torch.nn.functional.layer_norm(x, (self.d,), self.w[prefix + ".w"], self.w[prefix + ".b"], self.eps)

    def forward(self, tokens):
        t = tokens.shape[0]
        w, d, h = self.w, self.d, self.heads
        x = w["embed.wte"][tokens] + w["embed.wpe"][:t]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for layer in range(self.layers):
            p = f"block{layer}."
            qkv = self.norm(x, p + "ln1") @ w[p + "attn.qkv.w"].T + w[p + "attn.qkv.b"]
            q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
            split = lambda m: m.view(t, h, d // h).transpose(0, 1)  # heads contiguous: [h, t, d/h]
            scores = split(q) @ split(k).transpose(1, 2) / math.sqrt(d // h)
            att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            y = (att @ split(v)).transpose(0, 1).reshape(t, d)
            x = x + y @ w[p + "attn.proj.w"].T + w[p + "attn.proj.b"]
            hidden = self.norm(x, p + "ln2") @ w[p + "mlp.fc.w"].T + w[p + "mlp.fc.b"]
            hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
            x = x + hidden @ w[p + "mlp.proj.w"].T + w[p + "mlp.proj.b"]
        return self.norm(x, "head.lnf") @ w["head.lm_head.w"].T  # untied, no bias


class ExportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="pshard-export-")
        job = ["--servers=2", "--trainers=1", "--layers=2", "--d_model=48", "--heads=4", "--context=32",
               "--seq_len=32", "--steps=300", "--log_every=0", "--encoding=fp32", "--metrics_port_base=0",
               f"--run_dir={cls.dir}/run", f"--checkpoint_dir={cls.dir}/ckpt"]
        subprocess.run([PSHARD, "local"] + job, check=True, capture_output=True, timeout=300)
        cls.file = os.path.join(cls.dir, "model.safetensors")
        subprocess.run([PSHARD, "export", f"--from={cls.dir}/ckpt", f"--to={cls.file}"], check=True,
                       capture_output=True, timeout=60)

    def sample(self, source, logprobs=None):
        extra = [f"--logprobs={logprobs}"] if logprobs else []
        out = subprocess.run([PSHARD, "sample", f"--from={source}", f"--prompt={PROMPT}", f"--tokens={TOKENS}",
                              "--temperature=0"] + extra, check=True, capture_output=True, timeout=60)
        return out.stdout.decode("latin-1")[:-1]  # the text, less the newline sample ends it with

    def test_the_metadata_says_the_architecture(self):
        _, meta = read_safetensors(self.file)
        for key, value in [("gpt.layers", "2"), ("gpt.d_model", "48"), ("gpt.heads", "4"), ("gpt.context", "32"),
                           ("gpt.vocab", "256"), ("gpt.layer_norm_eps", "1e-05"), ("step", "300")]:
            self.assertEqual(meta.get(key), value, key)
        for words in ("pre-norm", "tanh", "[q; k; v]", "untied", "no bias", "learned positions"):
            self.assertIn(words, meta["architecture"])
        self.assertEqual(json.loads(meta["layout"])["model"], meta["model"])

    def test_pshard_samples_the_export_as_it_samples_the_checkpoint(self):
        self.assertEqual(self.sample(self.file), self.sample(os.path.join(self.dir, "ckpt")))

    def test_a_torch_model_written_from_the_docs_continues_the_prompt_the_same_way(self):
        weights, meta = read_safetensors(self.file)
        model = DocGpt(weights, meta)
        scores = os.path.join(self.dir, "logprobs.tsv")
        expected = self.sample(self.file, scores)
        self.assertEqual(len(expected), len(PROMPT) + TOKENS)
        with open(scores) as f:
            theirs = [line.split("\t") for line in f.read().splitlines()]
        self.assertEqual(len(theirs), TOKENS)
        tokens = list(PROMPT.encode())
        worst = 0.0
        with torch.no_grad():
            for i in range(TOKENS):
                position, token, logprob = int(theirs[i][0]), int(theirs[i][1]), float(theirs[i][2])
                self.assertEqual((position, token), (len(tokens), ord(expected[len(tokens)])))
                window = torch.tensor(tokens[-model.context:])
                mine = torch.log_softmax(model(window)[-1].double(), dim=0)
                # The same distribution: the token pshard drew has the same
                # log-probability here, and it is the most likely one (a
                # near tie aside: float sums in another order).
                worst = max(worst, abs(float(mine[token]) - logprob))
                self.assertLess(float(mine.max() - mine[token]), 1e-4, f"token {i}")
                tokens.append(token)
        self.assertLess(worst, TOLERANCE)
        # A model that had learnt nothing would make this check weak.
        self.assertGreater(len(set(expected[len(PROMPT):])), 4, expected)

if __name__ == "__main__":
    unittest.main()
