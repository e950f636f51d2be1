# Where does a fresh process's staging cost go, and can page-cache pages be DMA'd in place?
# Run on the GPU machine: python3 scripts/probes/pin.py FILE   (FILE: a page-cached file >= 1 GiB)
# Prints: THP settings; first-touch pread cost per 2 MiB into anonymous memory (default,
# MADV_HUGEPAGE, MADV_NOHUGEPAGE) against a second pread; MADV_POPULATE_WRITE; cuMemHostRegister
# of touched / untouched memory; cuMemHostAlloc; and cuMemHostRegister of a read-only file mmap
# (flag READ_ONLY), its H2D speed and content, one thread and 8 at once.
import ctypes as C, os, sys, time, threading
from cudactx import cu, ck, new_stream
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
libc.munmap.argtypes = [C.c_void_p, C.c_size_t]
libc.madvise.argtypes = [C.c_void_p, C.c_size_t, C.c_int]
libc.pread.restype = C.c_ssize_t
libc.pread.argtypes = [C.c_int, C.c_void_p, C.c_size_t, C.c_long]
PROT_READ, PROT_WRITE = 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_ANON, MAP_NORESERVE, MAP_POPULATE = 1, 2, 0x20, 0x4000, 0x8000
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23
MiB = 1 << 20
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY); fsize = os.fstat(fd).st_size
for f in ("enabled", "defrag", "khugepaged/defrag"):
    try: print(f"thp {f}: {open('/sys/kernel/mm/transparent_hugepage/' + f).read().strip()}")
    except OSError as e: print(f"thp {f}: {e}")
for l in open("/proc/meminfo"):
    if l.split(":")[0] in ("MemFree", "Cached", "AnonHugePages", "HugePages_Total", "Hugepagesize"): print(l.strip())
print(os.uname().release)

def anon(n, adv=None):
    p = libc.mmap(None, n + 2 * MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON | MAP_NORESERVE, -1, 0)
    assert p not in (None, C.c_void_p(-1).value), C.get_errno()
    b = (p + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
    if adv is not None: assert libc.madvise(b, n, adv) == 0, C.get_errno()
    return p, b

def huge_kb(b, n):
    # AnonHugePages of the smaps entry that holds b
    cur = None
    for l in open("/proc/self/smaps"):
        f = l.split()
        if "-" in f[0] and len(f) >= 5 and all(c in "0123456789abcdef-" for c in f[0]):
            lo, hi = (int(x, 16) for x in f[0].split("-")); cur = lo <= b < hi
        elif cur and f[0] == "AnonHugePages:": return int(f[1])
    return -1

N = 64 * MiB
for label, adv in (("default", None), ("MADV_HUGEPAGE", MADV_HUGEPAGE), ("MADV_NOHUGEPAGE", MADV_NOHUGEPAGE)):
    p, b = anon(N, adv)
    t = []
    for i in range(N // (2 * MiB)):
        t0 = time.perf_counter(); r = libc.pread(fd, b + i * 2 * MiB, 2 * MiB, i * 2 * MiB); t.append(time.perf_counter() - t0); assert r == 2 * MiB
    w = []
    for i in range(N // (2 * MiB)):
        t0 = time.perf_counter(); libc.pread(fd, b + i * 2 * MiB, 2 * MiB, i * 2 * MiB); w.append(time.perf_counter() - t0)
    t.sort(); w.sort()
    print(f"{label}: first-touch pread 2 MiB median {1e3*t[len(t)//2]:.3f} ms (max {1e3*t[-1]:.3f}); again {1e3*w[len(w)//2]:.3f} ms; AnonHugePages {huge_kb(b, N)} kB")
    t0 = time.perf_counter(); ck(cu.cuMemHostRegister_v2(C.c_void_p(b), C.c_size_t(32 * MiB), 0), "reg"); dt = time.perf_counter() - t0
    t0 = time.perf_counter(); ck(cu.cuMemHostUnregister(C.c_void_p(b)), "unreg"); du = time.perf_counter() - t0
    print(f"{label}: cuMemHostRegister 32 MiB touched {1e3*dt:.3f} ms, unregister {1e3*du:.3f} ms")
    libc.munmap(p, N + 2 * MiB)
    p, b = anon(N, adv)
    t0 = time.perf_counter(); ck(cu.cuMemHostRegister_v2(C.c_void_p(b), C.c_size_t(32 * MiB), 0), "reg"); dt = time.perf_counter() - t0
    print(f"{label}: cuMemHostRegister 32 MiB untouched {1e3*dt:.3f} ms; AnonHugePages {huge_kb(b, N)} kB")
    t0 = time.perf_counter(); r = libc.pread(fd, b, 2 * MiB, 0); print(f"{label}: pread 2 MiB into it {1e3*(time.perf_counter()-t0):.3f} ms")
    ck(cu.cuMemHostUnregister(C.c_void_p(b)), "unreg")
    t0 = time.perf_counter(); r = libc.madvise(b + 32 * MiB, 32 * MiB, MADV_POPULATE_WRITE); dt = time.perf_counter() - t0
    print(f"{label}: MADV_POPULATE_WRITE 32 MiB rc {r} errno {C.get_errno()} {1e3*dt:.3f} ms")
    libc.munmap(p, N + 2 * MiB)
hp = C.c_void_p()
t0 = time.perf_counter(); ck(cu.cuMemHostAlloc(C.byref(hp), C.c_size_t(32 * MiB), 0), "hostalloc"); print(f"cuMemHostAlloc 32 MiB {1e3*(time.perf_counter()-t0):.3f} ms")
t0 = time.perf_counter(); ck(cu.cuMemHostAlloc(C.byref(hp), C.c_size_t(96 * MiB), 0), "hostalloc"); print(f"cuMemHostAlloc 96 MiB {1e3*(time.perf_counter()-t0):.3f} ms")

# A read-only file mapping, page-locked and copied from in place.
R = 256 * MiB
dptr = C.c_uint64(); ck(cu.cuMemAlloc_v2(C.byref(dptr), C.c_size_t(8 * R)), "alloc")
host = C.create_string_buffer(4096)
def file_reg(off, n, flags):
    m = libc.mmap(None, n, PROT_READ, MAP_SHARED, fd, off)
    assert m != C.c_void_p(-1).value, C.get_errno()
    t0 = time.perf_counter(); r = cu.cuMemHostRegister_v2(C.c_void_p(m), C.c_size_t(n), flags); dt = time.perf_counter() - t0
    return m, r, dt
for flags, name in ((0, "flags 0"), (8, "READ_ONLY")):
    m, r, dt = file_reg(0, R, flags)
    print(f"file mmap {R>>20} MiB cuMemHostRegister {name}: rc {r} in {1e3*dt:.3f} ms ({R/dt/1e9:.1f} GB/s)")
    if r == 0:
        s = new_stream()
        t0 = time.perf_counter(); ck(cu.cuMemcpyHtoDAsync_v2(dptr, C.c_void_p(m), C.c_size_t(R), s), "h2d"); ck(cu.cuStreamSynchronize(s), "sync"); dt = time.perf_counter() - t0
        print(f"  H2D {R>>20} MiB from it: {1e3*dt:.3f} ms ({R/dt/1e9:.1f} GB/s)")
        ok = True
        for off in (0, 12345 * 4096 + 17, R - 4096):
            ck(cu.cuMemcpyDtoH_v2(host, C.c_uint64(dptr.value + off), C.c_size_t(4096 if off % 4096 == 0 else 100)), "d2h")
            k = 4096 if off % 4096 == 0 else 100
            ok &= host.raw[:k] == os.pread(fd, k, off)
        print(f"  content matches pread: {ok}")
        t0 = time.perf_counter(); ck(cu.cuMemHostUnregister(C.c_void_p(m)), "unreg"); print(f"  unregister {1e3*(time.perf_counter()-t0):.3f} ms")
    libc.munmap(m, R)
# 8 threads, each its own 256 MiB range: register, copy on its own stream, unregister.
res = [None] * 8
def worker(i):
    s = new_stream()
    m, r, dt = file_reg(i * R, R, 8)
    if r != 0: res[i] = (r,); return
    t0 = time.perf_counter(); ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(dptr.value + i * R), C.c_void_p(m), C.c_size_t(R), s), "h2d"); ck(cu.cuStreamSynchronize(s), "sync"); dc = time.perf_counter() - t0
    t0 = time.perf_counter(); ck(cu.cuMemHostUnregister(C.c_void_p(m)), "unreg"); du = time.perf_counter() - t0
    libc.munmap(m, R); res[i] = (0, dt, dc, du)
if fsize >= 8 * R:
    t0 = time.perf_counter()
    th = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    [x.start() for x in th]; [x.join() for x in th]
    wall = time.perf_counter() - t0
    print(f"8 threads x {R>>20} MiB file ranges register+H2D+unregister: wall {1e3*wall:.2f} ms ({8*R/wall/1e9:.1f} GB/s)")
    for i, r in enumerate(res): print(f"  t{i}: {r}")
# Chunked pipeline on one thread: register 32 MiB chunks of a file mapping and copy each.
m = libc.mmap(None, 8 * R, PROT_READ, MAP_SHARED, fd, 0)
s = new_stream(); CH = 32 * MiB; t0 = time.perf_counter(); treg = 0
for i in range(8 * R // CH):
    a = time.perf_counter(); ck(cu.cuMemHostRegister_v2(C.c_void_p(m + i * CH), C.c_size_t(CH), 8), "reg"); treg += time.perf_counter() - a
    ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(dptr.value + i * CH), C.c_void_p(m + i * CH), C.c_size_t(CH), s), "h2d")
ck(cu.cuStreamSynchronize(s), "sync"); wall = time.perf_counter() - t0
print(f"one thread, 32 MiB chunks of a 2 GiB file mapping registered then copied: {1e3*wall:.2f} ms ({8*R/wall/1e9:.1f} GB/s), registering {1e3*treg:.2f} ms")
t0 = time.perf_counter()
for i in range(8 * R // CH): ck(cu.cuMemHostUnregister(C.c_void_p(m + i * CH)), "unreg")
print(f"  unregistering the 64 chunks: {1e3*(time.perf_counter()-t0):.2f} ms")
