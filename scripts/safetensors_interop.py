#!/usr/bin/env python3
"""Interop between gpudirect's safetensors room and torch / the safetensors Python package.

  python3 scripts/safetensors_interop.py write DIR   torch writes files into DIR (save_file: one
      file with mixed dtypes, 0-d scalars and empty tensors; a 3-shard model directory with
      model.safetensors.index.json), dumps every tensor's raw bytes, and writes DIR/expect.json
      {source: {name: {dtype, shape, raw}}} for gpudirect's test to compare against.
  python3 scripts/safetensors_interop.py check DIR   loads every source in DIR/expect.json (written
      by gpudirect) with safetensors.torch.load_file (CPU, and cuda:0 when there is a GPU) and
      compares dtype, shape and every byte with the raw dumps; prints "checked N tensors".

Run by tests/safetensors_gpu.rs (gpu_safetensors_torch_*) from the project root.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, attr):
        NAMES[getattr(torch, attr)] = name


def raw_bytes(t):
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def random_tensor(g, dtype, shape):
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool().reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.int32).to(torch.uint8)
    return b.view(dtype).reshape(shape)


def tensors(seed, n):
    g = torch.Generator().manual_seed(seed)
    dts = list(NAMES)
    shapes = [(), (0, 5), (3, 7), (1000,), (13,), (2, 3, 4)]
    out = {}
    for i in range(n):
        dt = dts[i % len(dts)]
        out[f"model.layers.{i}.{NAMES[dt].lower()}"] = random_tensor(g, dt, shapes[i % len(shapes)])
    return out


def write(d):
    expect = {}
    os.makedirs(os.path.join(d, "raw"), exist_ok=True)

    def dump(src, ts):
        e = expect.setdefault(src, {})
        for name, t in ts.items():
            raw = os.path.join("raw", f"{src.replace('/', '_')}-{name}.bin")
            with open(os.path.join(d, raw), "wb") as f:
                f.write(raw_bytes(t))
            e[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "raw": raw}

    single = tensors(1, 48)
    save_file(single, os.path.join(d, "single.safetensors"), metadata={"format": "pt"})
    dump("single.safetensors", single)
    shard_dir = os.path.join(d, "sharded")
    os.makedirs(shard_dir, exist_ok=True)
    all_ts = tensors(2, 36)
    names = sorted(all_ts)
    weight_map = {}
    for k in range(3):
        fname = f"model-{k + 1:05d}-of-00003.safetensors"
        part = {n: all_ts[n] for n in names[k::3]}
        save_file(part, os.path.join(shard_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(len(raw_bytes(t)) for t in all_ts.values())},
                   "weight_map": weight_map}, f)
    dump("sharded", all_ts)
    with open(os.path.join(d, "expect.json"), "w") as f:
        json.dump(expect, f)
    print(f"torch {torch.__version__} wrote {sum(len(v) for v in expect.values())} tensors in "
          f"{len(expect)} sources to {d}")


def check(d):
    with open(os.path.join(d, "expect.json")) as f:
        expect = json.load(f)
    devices = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
    n, bad = 0, []
    for src, ts in expect.items():
        for dev in devices:
            loaded = load_file(os.path.join(d, src), device=dev)
            if set(loaded) != set(ts):
                bad.append(f"{src} on {dev}: names differ: {sorted(set(loaded) ^ set(ts))}")
                continue
            for name, e in ts.items():
                t = loaded[name]
                with open(os.path.join(d, e["raw"]), "rb") as f:
                    raw = f.read()
                if NAMES.get(t.dtype) != e["dtype"] or list(t.shape) != e["shape"]:
                    bad.append(f"{src} {name} on {dev}: {t.dtype} {list(t.shape)}, expected {e['dtype']} {e['shape']}")
                elif raw_bytes(t) != raw:
                    bad.append(f"{src} {name} on {dev}: bytes differ")
                elif dev == "cpu":
                    n += 1
    for b in bad:
        print("MISMATCH", b)
    print(f"torch {torch.__version__}: checked {n} tensors on {', '.join(devices)}, {len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    sys.exit(write(sys.argv[2]) or 0 if sys.argv[1] == "write" else check(sys.argv[2]))
