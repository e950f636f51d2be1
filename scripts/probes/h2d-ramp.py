"""Does a fresh process's first large host-to-device copy run at the warm rate from its start?

A 4 GiB page-locked host buffer (torch pin_memory, filled) and a 4 GiB device buffer are made
first; then, after the GPU sat idle, one pass of 128 copies of 32 MiB on one stream, with an
event after each, prints the rate of each group of 8 copies (GB/s). Cases, each after an idle
gap: cold (the process's first copies), again at once (warm), after the GPU computed for
~30 ms (clocks up), and with a 64 KiB copy every 0.1 ms for 20 ms first (the link kept busy).
Usage: python3 scripts/probes/h2d-ramp.py [idle_s]
"""
import sys
import time

import torch

from h2dpass import chunk, d, h, n, s
from h2dpass import one_pass as timed_pass

idle = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5


def one_pass(label):
    total, rates, wall = timed_pass()
    print(f"{label:28s} total {total:6.2f} GB/s (wall {chunk * n / wall / 1e9:6.2f}); per 256 MiB: "
          + " ".join(f"{r:.1f}" for r in rates), flush=True)


time.sleep(idle)
one_pass("cold (first copies)")
one_pass("again at once")
time.sleep(idle)
one_pass(f"after {idle}s idle")
time.sleep(idle)
a = torch.randn(4096, 4096, device="cuda:0")
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.03:
    a = a @ a
    a = a / a.norm()
    torch.cuda.synchronize()
one_pass("after 30 ms of matmul")
time.sleep(idle)
small = h[:64 * 1024]
t0 = time.perf_counter()
with torch.cuda.stream(s):
    while time.perf_counter() - t0 < 0.02:
        d[:64 * 1024].copy_(small, non_blocking=True)
        time.sleep(0.0001)
one_pass("after 20 ms of small copies")
time.sleep(2.0)
one_pass("after 2 s idle")
