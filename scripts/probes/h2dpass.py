# The h2d probes' shared start (h2d-ramp.py, h2d-contend.py; python puts the script's directory
# on sys.path): a 4 GiB page-locked host buffer `h` (torch pin_memory, filled) and a 4 GiB device
# buffer `d`, made at import, and `one_pass()`: 128 copies of 32 MiB on stream `s`, an event
# after each.
import time

import torch

MiB = 1 << 20
chunk, n = 32 * MiB, 128
h = torch.empty(chunk * n, dtype=torch.uint8, pin_memory=True)
h.fill_(7)
d = torch.empty(chunk * n, dtype=torch.uint8, device="cuda:0")
s = torch.cuda.Stream()
torch.cuda.synchronize()


def one_pass():
    """One pass: (GB/s over the pass by the events, GB/s per group of 8 copies, host wall s)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        ev[0].record(s)
        for i in range(n):
            d[i * chunk:(i + 1) * chunk].copy_(h[i * chunk:(i + 1) * chunk], non_blocking=True)
            ev[i + 1].record(s)
    s.synchronize()
    wall = time.perf_counter() - t0
    rates = [8 * chunk / ev[g].elapsed_time(ev[g + 8]) / 1e6 for g in range(0, n, 8)]
    return chunk * n / ev[0].elapsed_time(ev[n]) / 1e6, rates, wall
