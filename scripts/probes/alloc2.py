# Allocation cost vs size and count, fresh process per mode; and what cuMemFreeAsync does with
# cuMemAlloc memory (does the host wait? is the memory back?). python3 alloc2.py MODE
# Run on the GPU machine: python3 scripts/probes/alloc2.py size-sync|size-async|many-sync|many-async|free.
import ctypes as C, sys, time
from cudactx import cu, ck, new_stream
st = new_stream()
def info():
    f = C.c_size_t(); t = C.c_size_t(); ck(cu.cuMemGetInfo_v2(C.byref(f), C.byref(t)), "info"); return f.value
mode = sys.argv[1]
def alloc(n, how):
    p = C.c_uint64()
    if how == "sync": ck(cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(n)), "alloc")
    else: ck(cu.cuMemAllocAsync(C.byref(p), C.c_size_t(n), st), "allocasync")
    return p.value
if mode.startswith("size-"):
    how = mode.split("-")[1]
    out = []
    for mib in [2, 16, 64, 256, 1024]:
        t = time.perf_counter(); p = alloc(mib << 20, how); ck(cu.cuStreamSynchronize(st), "sync"); out.append(f"{mib} MiB {1e3*(time.perf_counter()-t):.3f} ms")
    print(f"{how} first allocation of each size (all kept): " + ", ".join(out))
elif mode.startswith("many-"):
    how = mode.split("-")[1]
    t = time.perf_counter()
    for i in range(320): alloc(13 << 20, how)
    ck(cu.cuStreamSynchronize(st), "sync")
    print(f"{how} 320 x 13 MiB: {1e3*(time.perf_counter()-t):.2f} ms")
elif mode == "free":
    N = 4 << 30
    host = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(host), C.c_size_t(N), 0), "hostalloc")
    a = alloc(N, "sync"); b = alloc(64 << 20, "sync")
    f0 = info()
    ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(a), host, C.c_size_t(N), st), "h2d")  # ~78 ms on the stream
    t = time.perf_counter(); r = cu.cuMemFreeAsync(C.c_uint64(b), st); t1 = time.perf_counter()
    q = cu.cuStreamQuery(st)
    ck(cu.cuStreamSynchronize(st), "sync"); t2 = time.perf_counter()
    print(f"free: cuMemFreeAsync(cuMemAlloc'd 64 MiB) behind a 4 GiB copy -> {r}, returned after {1e3*(t1-t):.2f} ms, stream then {'busy' if q else 'idle'}, sync after {1e3*(t2-t):.2f} ms; free memory {(info()-f0)>>20:+d} MiB")
    # the same on another stream, nothing queued there
    st2 = C.c_void_p(); ck(cu.cuStreamCreate(C.byref(st2), 1), "stream2")
    c = alloc(64 << 20, "sync")
    ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(a), host, C.c_size_t(N), st), "h2d")
    t = time.perf_counter(); r = cu.cuMemFreeAsync(C.c_uint64(c), st2); t1 = time.perf_counter()
    q = cu.cuStreamQuery(st)
    print(f"free: cuMemFreeAsync on an idle stream while another copies -> {r}, returned after {1e3*(t1-t):.2f} ms, the copying stream then {'busy' if q else 'idle'}")
    ck(cu.cuStreamSynchronize(st), "sync")
    t = time.perf_counter(); r = cu.cuMemFreeAsync(C.c_uint64(a), st); ck(cu.cuStreamSynchronize(st), "s"); print(f"free: 4 GiB cuMemAlloc'd via cuMemFreeAsync -> {r} in {1e3*(time.perf_counter()-t):.2f} ms")
