# Page-locking a read-only file mapping in place, continued (pin.py found it works: 42 GB/s to
# lock on one thread, 55 GB/s H2D from it). Run on the GPU machine:
#   python3 scripts/probes/pin2.py FILE [TMPFS_DIR]   (FILE: page-cached, >= 2 GiB)
# Prints: (a) threads x chunk size: lock chunks of a 2 GiB mapping and copy each from it, the
# wall time and GB/s, then unlocking them on the same threads; (b) the same on tmpfs; (c) while
# another stream is held by a host function, does cuMemHostUnregister on one thread hold up
# other threads' driver calls (event/stream create, async copy, pool alloc, register)?
import ctypes as C, os, sys, time, threading
from cudactx import cu, ck, ctx, new_stream
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
libc.munmap.argtypes = [C.c_void_p, C.c_size_t]
MiB = 1 << 20; RO = 8
path = sys.argv[1]; shm = sys.argv[2] if len(sys.argv) > 2 else "/dev/shm"
G = 2048 * MiB
dptr = C.c_uint64(); ck(cu.cuMemAlloc_v2(C.byref(dptr), C.c_size_t(G)), "alloc")
errs = []
def bind():
    ck(cu.cuCtxSetCurrent(ctx), "setcurrent")
def pipeline(fd, T, CH, n=G):
    m = libc.mmap(None, n, 1, 1, fd, 0); assert m != C.c_void_p(-1).value
    nch = n // CH; regt = [0.0] * T
    def w(t):
        try:
            bind(); s = new_stream()
            for i in range(t, nch, T):
                a = time.perf_counter()
                ck(cu.cuMemHostRegister_v2(C.c_void_p(m + i * CH), C.c_size_t(CH), RO), "reg")
                regt[t] += time.perf_counter() - a
                ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(dptr.value + i * CH), C.c_void_p(m + i * CH), C.c_size_t(CH), s), "h2d")
            ck(cu.cuStreamSynchronize(s), "sync")
        except BaseException as e: errs.append(repr(e))
    def u(t):
        try:
            bind()
            for i in range(t, nch, T): ck(cu.cuMemHostUnregister(C.c_void_p(m + i * CH)), "unreg")
        except BaseException as e: errs.append(repr(e))
    t0 = time.perf_counter(); th = [threading.Thread(target=w, args=(t,)) for t in range(T)]
    [x.start() for x in th]; [x.join() for x in th]; wall = time.perf_counter() - t0
    t0 = time.perf_counter(); th = [threading.Thread(target=u, args=(t,)) for t in range(T)]
    [x.start() for x in th]; [x.join() for x in th]; uw = time.perf_counter() - t0
    libc.munmap(m, n)
    return wall, max(regt), uw
fd = os.open(path, os.O_RDONLY)
for T, CH in ((1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (8, 8), (8, 4), (16, 8), (4, 128)):
    wall, reg, uw = pipeline(fd, T, CH * MiB)
    print(f"cached file, {T} threads x {CH} MiB chunks: lock+copy 2 GiB {1e3*wall:.2f} ms ({G/wall/1e9:.1f} GB/s; busiest thread locked for {1e3*reg:.2f} ms); unlock {1e3*uw:.2f} ms  errors {errs}")
# tmpfs
tp = os.path.join(shm, "gpudirect-pin2"); 
with open(path, "rb") as src, open(tp, "wb") as dst:
    left = G
    while left: b = src.read(min(left, 64 * MiB)); dst.write(b); left -= len(b)
tfd = os.open(tp, os.O_RDONLY)
for T, CH in ((1, 32), (8, 32), (16, 8)):
    wall, reg, uw = pipeline(tfd, T, CH * MiB)
    print(f"tmpfs file, {T} threads x {CH} MiB chunks: lock+copy 2 GiB {1e3*wall:.2f} ms ({G/wall/1e9:.1f} GB/s; busiest {1e3*reg:.2f} ms); unlock {1e3*uw:.2f} ms  errors {errs}")
h = C.create_string_buffer(4096); ck(cu.cuMemcpyDtoH_v2(h, C.c_uint64(dptr.value + G - 4096), C.c_size_t(4096)), "d2h")
print(f"tmpfs content at the end matches: {h.raw == os.pread(fd, 4096, G - 4096)}")
os.unlink(tp)
# (c) does an unregister waiting on a held stream hold up other threads' calls?
A = new_stream(); B = new_stream()
HOSTFN = C.CFUNCTYPE(None, C.c_void_p)
cb = HOSTFN(lambda _: time.sleep(0.3))
m1 = libc.mmap(None, 32 * MiB, 3, 0x22, -1, 0); C.memset(m1, 1, 32 * MiB)
m2 = libc.mmap(None, 32 * MiB, 3, 0x22, -1, 0); C.memset(m2, 1, 32 * MiB)
ck(cu.cuMemHostRegister_v2(C.c_void_p(m1), C.c_size_t(32 * MiB), 0), "reg1")
pin = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(pin), C.c_size_t(1 * MiB), 0), "hostalloc")
ck(cu.cuLaunchHostFunc(A, cb, None), "hostfn"); time.sleep(0.01)
ut = []
def unreg():
    bind(); a = time.perf_counter(); ck(cu.cuMemHostUnregister(C.c_void_p(m1)), "unreg"); ut.append(time.perf_counter() - a)
y = threading.Thread(target=unreg); y.start(); time.sleep(0.05)
def timed(label, f):
    a = time.perf_counter(); r = f(); print(f"  while another thread's unregister waits: {label}: {1e3*(time.perf_counter()-a):.2f} ms (rc {r})")
ev = C.c_void_p(); s3 = C.c_void_p(); dp = C.c_uint64()
timed("cuEventCreate", lambda: cu.cuEventCreate(C.byref(ev), 0))
timed("cuStreamCreate", lambda: cu.cuStreamCreate(C.byref(s3), 1))
timed("cuMemcpyHtoDAsync 1 MiB on B", lambda: cu.cuMemcpyHtoDAsync_v2(dptr, pin, C.c_size_t(MiB), B))
timed("cuEventRecord on B", lambda: cu.cuEventRecord(ev, B))
timed("cuMemAllocAsync 1 MiB on B", lambda: cu.cuMemAllocAsync(C.byref(dp), C.c_size_t(MiB), B))
timed("cuMemHostRegister 32 MiB", lambda: cu.cuMemHostRegister_v2(C.c_void_p(m2), C.c_size_t(32 * MiB), 0))
timed("cuStreamSynchronize(B)", lambda: cu.cuStreamSynchronize(B))
y.join(); print(f"  the unregister took {1e3*ut[0]:.2f} ms")
ck(cu.cuStreamSynchronize(A), "syncA")
