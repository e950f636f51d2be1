"""Does host memory traffic slow a pinned host-to-device copy, and how fast?

One 4 GiB pass of 32 MiB pinned H2D copies (rates per 256 MiB, as h2d-ramp.py) while `k`
threads copy 32 MiB host buffers in a loop (numpy releases the GIL while it copies), the way the
engine's workers copy page cache into the ring; for k in the arguments (default 0 4 8 16).
Also prints the threads' host copy rate. Usage: python3 scripts/probes/h2d-contend.py [k ...]
"""
import sys
import threading
import time

import numpy as np

from h2dpass import chunk, one_pass

ks = [int(x) for x in sys.argv[1:]] or [0, 4, 8, 16]


for k in ks:
    stop = threading.Event()
    moved = [0] * k

    def spin(j):
        a = np.ones(chunk, dtype=np.uint8)
        b = np.empty(chunk, dtype=np.uint8)
        while not stop.is_set():
            np.copyto(b, a)
            moved[j] += chunk

    th = [threading.Thread(target=spin, args=(j,)) for j in range(k)]
    for t in th:
        t.start()
    time.sleep(0.05)
    m0, t0 = sum(moved), time.perf_counter()
    total, rates, _ = one_pass()
    host = (sum(moved) - m0) / (time.perf_counter() - t0) / 1e9
    stop.set()
    for t in th:
        t.join()
    print(f"{k:2d} host copy threads ({host:6.1f} GB/s copied): H2D {total:6.2f} GB/s; per 256 MiB: "
          + " ".join(f"{r:.1f}" for r in rates), flush=True)
    time.sleep(0.3)
