#!/usr/bin/python3
"""Reference vectors for the block-quantized encodings, computed with numpy
from their description in docs/levers.md alone:

  a slice is cut into blocks of B elements from its first element (the last
  block may be shorter); a block travels as its fp32 scale s = max|x| / Q
  (Q = 127 for int8, 7 for int4) and one code per element,
  q = x * Q / max|x| rounded half to even; it decodes to q * s. int4 codes
  go two to a byte, the earlier element in the low nibble. A block of zeros,
  or one holding an infinity or a NaN, has scale 0 and codes 0.

The codes are computed in float64 (x * Q is exact there, the division is
rounded once) and rounded with numpy.rint (half to even); the scale is the
float32 nearest to max|x| / Q. Writes one case per block-quantized slice:

  case <name> bits=<8|4> block=<B> n=<elements>
  x <float32 bit patterns, hex>
  bytes <the encoded slice, hex>

Usage: block_quant_oracle.py OUT (tests/data/block_quant_vectors.txt).
"""
import sys

import numpy as np


def encode(x, bits, block):
    q_max = 127 if bits == 8 else 7
    out = bytearray()
    for start in range(0, len(x), block):
        blk = x[start:start + block]
        wide = blk.astype(np.float64)
        if not np.all(np.isfinite(wide)) or np.max(np.abs(wide)) == 0:
            scale = np.float32(0)
            codes = np.zeros(len(blk), dtype=np.int64)
        else:
            m = np.max(np.abs(wide))
            scale = np.float32(np.float32(m) / np.float32(q_max))
            codes = np.clip(np.rint(wide * q_max / m), -q_max, q_max).astype(np.int64)
        out += scale.tobytes()
        if bits == 8:
            out += codes.astype(np.int8).tobytes()
        else:
            nibbles = [int(c) & 0xF for c in codes]
            for i in range(0, len(nibbles), 2):
                low = nibbles[i]
                high = nibbles[i + 1] if i + 1 < len(nibbles) else 0
                out.append(low | (high << 4))
    return bytes(out)


def cases():
    rng = np.random.default_rng(20261203)
    f32 = np.float32
    # Ties: a block whose largest magnitude is Q codes x = k + 0.5 exactly
    # half way; half to even picks the even neighbour.
    yield "ties_int8", 8, 8, np.array([127, 0.5, 1.5, 2.5, -2.5, -3.5, 126.5, -0.5], dtype=f32)
    yield "ties_int4", 4, 8, np.array([7, 0.5, 1.5, 2.5, -2.5, 3.5, -6.5, 5.5], dtype=f32)
    yield "zeros", 8, 4, np.zeros(6, dtype=f32)
    yield "non_finite_block", 4, 4, np.array([1, np.inf, 2, 3, 0.25, -0.5, 1, 2], dtype=f32)
    yield "nan_block", 8, 4, np.array([0.1, 0.2, np.nan, 0.3, -0.7, 0.1, 0.9, 0.4], dtype=f32)
    yield "tiny", 8, 64, np.array([1e-38, -3e-39, 2e-38], dtype=f32)
    for bits in (8, 4):
        for block, n in ((64, 64 * 5 + 17), (48, 48 * 3), (7, 50), (1, 5)):
            x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2)).astype(f32)
            yield f"normal_b{block}_n{n}", bits, block, x
        x = rng.integers(-300, 300, size=200).astype(f32) / f32(4)
        yield "quarters", bits, 64, x
        x = (rng.standard_normal(130) * np.where(rng.random(130) < 0.1, 1000.0, 0.01)).astype(f32)
        yield "outliers", bits, 64, x


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: block_quant_oracle.py OUT")
    lines = []
    for name, bits, block, x in cases():
        suffix = "" if bits == 8 else "_4"
        lines.append(f"case {name}{suffix if not name.endswith('int4') else ''} bits={bits} block={block} n={len(x)}")
        lines.append("x " + " ".join(f"{v:08x}" for v in x.view(np.uint32)))
        lines.append("bytes " + encode(x, bits, block).hex())
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
