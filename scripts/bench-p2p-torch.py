#!/usr/bin/env python3
"""torch copy_ GPU0 -> GPU1, the baseline for benches/p2p.rs (same methodology: 1 GiB copies,
COPIES copies per sample timed with CUDA events on the stream torch copies on (the source
device's current stream), median of REPS samples). Prints one JSON line last.

Usage: python3 scripts/bench-p2p-torch.py  (GPUDIRECT_BENCH_BYTES overrides the size)
"""
import json
import os
import statistics

import torch

REPS = int(os.environ.get("GPUDIRECT_BENCH_REPS", "7"))
COPIES = int(os.environ.get("GPUDIRECT_BENCH_COPIES", "4"))


def main():
    n = int(os.environ.get("GPUDIRECT_BENCH_BYTES", str(1 << 30)))
    if torch.cuda.device_count() < 2:
        print(json.dumps({"error": "torch sees fewer than 2 GPUs"}))
        return
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)  # warm-up; torch enables peer access here
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(b.cpu(), a.cpu())
    s0 = torch.cuda.current_stream(0)
    samples = []
    for _ in range(REPS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(0):
            start.record(s0)
            for _ in range(COPIES):
                b.copy_(a)
            end.record(s0)
        end.synchronize()
        torch.cuda.synchronize(1)
        ms = start.elapsed_time(end)
        samples.append(n * COPIES / (ms / 1e3) / 1e9)
    print(json.dumps({
        "torch_version": torch.__version__,
        "bytes": n,
        "copies_per_sample": COPIES,
        "samples_gbps": samples,
        "torch_one_way_gbps": statistics.median(samples),
    }))


if __name__ == "__main__":
    main()
