# What does a 4 GiB device buffer cost, allocated and freed the way read_to_gpu could, in a fresh
# process and in a loop? Each step timed on the host (ms): cuMemAlloc / cuMemAllocAsync (the
# device's default pool, as cudarc's stream.alloc), a memset that writes it all (the read's
# copies), cuMemFreeAsync (as cudarc frees a CudaSlice) and the stream sync after it (where the
# pool gives memory back: release threshold 0 by default). Three rounds per way.
# Run on the GPU machine: python3 scripts/probes/alloc4.py [pool-first]
import ctypes as C, sys, time
from cudactx import cu, ck, new_stream
S = new_stream()
N = 4 << 30
def ms(f):
    t = time.perf_counter(); f(); return 1e3 * (time.perf_counter() - t)
def rnd(label, alloc):
    p = C.c_uint64()
    a = ms(lambda: ck(alloc(p), "alloc"))
    a2 = ms(lambda: ck(cu.cuStreamSynchronize(S), "sync"))
    w = ms(lambda: (ck(cu.cuMemsetD8Async(p, C.c_ubyte(1), C.c_size_t(N), S), "memset"), ck(cu.cuStreamSynchronize(S), "sync")))
    f = ms(lambda: ck(cu.cuMemFreeAsync(C.c_uint64(p.value), S), "free"))
    f2 = ms(lambda: ck(cu.cuStreamSynchronize(S), "sync"))
    print(f"{label:16s} alloc {a:7.2f} + sync {a2:6.2f}, memset 4 GiB {w:6.2f}, cuMemFreeAsync {f:7.2f} + sync {f2:6.2f}", flush=True)
mem = lambda p: cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(N))
pool = lambda p: cu.cuMemAllocAsync(C.byref(p), C.c_size_t(N), S)
ways = [("pool", pool), ("cuMemAlloc", mem)]
if len(sys.argv) < 2 or sys.argv[1] != "pool-first":
    ways.reverse()
for label, f in ways:
    for _ in range(3):
        rnd(label, f)
