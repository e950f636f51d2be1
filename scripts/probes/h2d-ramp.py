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

idle = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
MiB = 1 << 20
chunk, n = 32 * MiB, 128
h = torch.empty(chunk * n, dtype=torch.uint8, pin_memory=True)
h.fill_(7)
d = torch.empty(chunk * n, dtype=torch.uint8, device="cuda:0")
s = torch.cuda.Stream()
torch.cuda.synchronize()


def one_pass(label):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        ev[0].record(s)
        for i in range(n):
            d[i * chunk:(i + 1) * chunk].copy_(h[i * chunk:(i + 1) * chunk], non_blocking=True)
            ev[i + 1].record(s)
    s.synchronize()
    wall = time.perf_counter() - t0
    rates = []
    for g in range(0, n, 8):
        ms = ev[g].elapsed_time(ev[g + 8])
        rates.append(8 * chunk / ms / 1e6)
    total = ev[0].elapsed_time(ev[n])
    print(f"{label:28s} total {chunk * n / total / 1e6:6.2f} GB/s (wall {chunk * n / wall / 1e9:6.2f}); per 256 MiB: "
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
