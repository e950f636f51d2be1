#!/usr/bin/env python3
"""Writes a few small valid safetensors files into DIR as the fuzzer's seed corpus."""
import json
import os
import struct
import sys

d = sys.argv[1]
os.makedirs(d, exist_ok=True)
seeds = [
    {"a": ("F32", [2], 8)},
    {"__metadata__": {"format": "pt"}, "w": ("BF16", [2, 3], 12), "s": ("F64", [], 8), "e": ("U8", [0], 0)},
    {"x": ("F8_E4M3", [5], 5), "y": ("I64", [1], 8), "z": ("BOOL", [3], 3), "q": ("F4", [4], 2)},
    {},
]
for i, s in enumerate(seeds):
    header, data, off = {}, b"", 0
    for k, v in s.items():
        if k == "__metadata__":
            header[k] = v
            continue
        dt, shape, n = v
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        data += bytes((off + j) * 7 % 256 for j in range(n))
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(d, f"seed{i}.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
