# Does a fresh device allocation slow the first host-to-device copies into it (the driver
# preparing / scrubbing its pages beside the copies), and does waiting after the allocation or
# reusing memory the process freed avoid it? The pattern of the storage engine's first call: a
# 96 MiB page-locked ring of three 32 MiB slots, 128 copies of 32 MiB into a new 4 GiB
# cuMemAlloc allocation on one stream, an event after each. Cases, in this order, in one
# process: A = new allocation, copies at once; again into A; B = new allocation, then
# cuCtxSynchronize and 300 ms of sleep, copies; C = A freed, a new allocation (the freed
# memory), copies at once; D = new cuMemAllocAsync pool allocation, copies at once.
# Run on the GPU machine:  python3 scripts/probes/fresh-dst.py   (one fresh process per run)
# Prints per case: the pass's GB/s by events, and GB/s per group of 8 copies.
import ctypes as C, time
from cudactx import cu, ck, new_stream
MiB = 1 << 20
chunk, n, slots = 32 * MiB, 128, 3
ring = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(ring), C.c_size_t(chunk * slots), 0), "hostalloc")
C.memset(ring, 7, chunk * slots)
s = new_stream()
ev = [C.c_void_p() for _ in range(n + 1)]
for e in ev: ck(cu.cuEventCreate(C.byref(e), 0), "evcreate")
ck(cu.cuCtxSynchronize(), "sync")
def alloc():
    d = C.c_uint64(); t = time.perf_counter()
    ck(cu.cuMemAlloc_v2(C.byref(d), C.c_size_t(chunk * n)), "alloc")
    return d, 1e3 * (time.perf_counter() - t)
def one_pass(label, d, note=""):
    ck(cu.cuEventRecord(ev[0], s), "rec")
    for i in range(n):
        ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(d.value + i * chunk), C.c_void_p(ring.value + (i % slots) * chunk), C.c_size_t(chunk), s), "copy")
        ck(cu.cuEventRecord(ev[i + 1], s), "rec")
    ck(cu.cuStreamSynchronize(s), "ssync")
    ms = C.c_float()
    def el(a, b):
        ck(cu.cuEventElapsedTime(C.byref(ms), ev[a], ev[b]), "elapsed"); return ms.value
    rates = [8 * chunk / el(g, g + 8) / 1e6 for g in range(0, n, 8)]
    print(f"{label:44s} {chunk * n / el(0, n) / 1e6:6.2f} GB/s {note}; per 256 MiB: " + " ".join(f"{r:.1f}" for r in rates), flush=True)
a, ta = alloc(); one_pass("A: new cuMemAlloc, copies at once", a, f"(alloc {ta:.2f} ms)")
one_pass("A again", a)
b, tb = alloc(); ck(cu.cuCtxSynchronize(), "sync"); time.sleep(0.3)
one_pass("B: new cuMemAlloc, sync + 300 ms, copies", b, f"(alloc {tb:.2f} ms)")
ck(cu.cuMemFree_v2(a), "free")
c, tc = alloc(); one_pass("C: A freed, new cuMemAlloc, copies at once", c, f"(alloc {tc:.2f} ms)")
d = C.c_uint64(); t = time.perf_counter()
ck(cu.cuMemAllocAsync(C.byref(d), C.c_size_t(chunk * n), s), "allocasync")
one_pass("D: new cuMemAllocAsync (pool), copies at once", d, f"(alloc {1e3 * (time.perf_counter() - t):.2f} ms)")
