# Do allocation calls wait for other streams? Stream A is held by a host function (300 ms); on
# the main thread, each call below is timed. A call that takes ~300 ms waited for stream A.
# Run on the GPU machine: python3 scripts/probes/alloc3.py
import ctypes as C, time, mmap
from cudactx import cu, ck, new_stream
A = new_stream(); B = new_stream()
HOSTFN = C.CFUNCTYPE(None, C.c_void_p)
def hold(_): time.sleep(0.3)
cb = HOSTFN(hold)
N = 200 << 20
def gated(label, f):
    ck(cu.cuLaunchHostFunc(A, cb, None), "hostfn")
    time.sleep(0.01)
    t = time.perf_counter(); r = f(); dt = time.perf_counter() - t
    ck(cu.cuStreamSynchronize(A), "syncA")
    print(f"{label}: {1e3*dt:.2f} ms (rc {r})")
p = C.c_uint64()
gated("cuMemAlloc 200 MiB while A is held", lambda: cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(N)))
gated("cuMemFreeAsync(cuMemAlloc memory, B) while A is held", lambda: cu.cuMemFreeAsync(C.c_uint64(p.value), B))
ck(cu.cuStreamSynchronize(B), "syncB")
ck(cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(N)), "alloc")
gated("cuMemFree(cuMemAlloc memory) while A is held", lambda: cu.cuMemFree_v2(C.c_uint64(p.value)))
gated("cuMemAllocAsync 200 MiB on B while A is held", lambda: cu.cuMemAllocAsync(C.byref(p), C.c_size_t(N), B))
ck(cu.cuStreamSynchronize(B), "syncB")
gated("cuMemFreeAsync(pool memory, B) while A is held", lambda: cu.cuMemFreeAsync(C.c_uint64(p.value), B))
ck(cu.cuStreamSynchronize(B), "syncB")
buf = mmap.mmap(-1, 32 << 20); addr = C.addressof(C.c_char.from_buffer(buf))
C.memset(addr, 1, 32 << 20)
gated("cuMemHostRegister 32 MiB while A is held", lambda: cu.cuMemHostRegister_v2(C.c_void_p(addr), C.c_size_t(32 << 20), 0))
gated("cuMemHostUnregister 32 MiB while A is held", lambda: cu.cuMemHostUnregister(C.c_void_p(addr)))
