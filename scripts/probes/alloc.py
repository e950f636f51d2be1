# Fresh-process allocation probe: cuMemAlloc vs cuMemAllocAsync for a 4 GiB destination, and the
# first H2D pass into it. Usage: python3 alloc.py sync|async|freecheck
# Run on the GPU machine: python3 scripts/probes/alloc.py sync|async|freecheck (one mode per process).
import ctypes as C, sys, time
from cudactx import cu, ck, new_stream
stream = new_stream()
N = 4 << 30; CH = 32 << 20
host = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(host), C.c_size_t(CH), 0), "hostalloc")
C.memset(host, 7, CH)
free0 = C.c_size_t(); tot = C.c_size_t(); ck(cu.cuMemGetInfo_v2(C.byref(free0), C.byref(tot)), "info")
mode = sys.argv[1]
p = C.c_uint64()
t0 = time.perf_counter()
if mode in ("sync", "freecheck"):
    ck(cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(N)), "cuMemAlloc")
else:
    ck(cu.cuMemAllocAsync(C.byref(p), C.c_size_t(N), stream), "cuMemAllocAsync")
    ck(cu.cuStreamSynchronize(stream), "sync")
t1 = time.perf_counter()
def sweep():
    s = time.perf_counter()
    for off in range(0, N, CH):
        ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(p.value + off), host, C.c_size_t(CH), stream), "h2d")
    ck(cu.cuStreamSynchronize(stream), "sync")
    return time.perf_counter() - s
a = sweep(); b = sweep()
print(f"{mode}: alloc {1e3*(t1-t0):.3f} ms, first pass {N/a/1e9:.2f} GB/s ({1e3*a:.1f} ms), second {N/b/1e9:.2f} GB/s; alloc+first {N/(a+t1-t0)/1e9:.2f} GB/s")
if mode == "freecheck":
    r = cu.cuMemFreeAsync(C.c_uint64(p.value), stream)
    r2 = cu.cuStreamSynchronize(stream)
    f1 = C.c_size_t(); ck(cu.cuMemGetInfo_v2(C.byref(f1), C.byref(tot)), "info")
    print(f"freecheck: cuMemFreeAsync on cuMemAlloc memory -> {r}, sync -> {r2}; free before alloc {free0.value>>20} MiB, after free {f1.value>>20} MiB")
    # and the same memory is not double-freed: a cuMemFree now must fail
    print(f"freecheck: cuMemFree after -> {cu.cuMemFree_v2(C.c_uint64(p.value))} (nonzero expected)")
