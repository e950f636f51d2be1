# Can a fresh process feed the copy engine from the page cache itself while its staging ring is
# still being faulted in? The first call of a 4 GiB read spends ~5 ms before its first copy
# (16 workers faulting the 96 MiB ring's fresh pages, the first slot's page-locking slowed by
# them). This probe page-locks the file's own page-cache pages in place (a read-only shared
# mapping, cuMemHostRegister READ_ONLY, chunk by chunk: the CPU never touches the mapping, so a
# truncated file makes the registration fail instead of raising SIGBUS) and copies each chunk
# as soon as it is locked, on the main thread; beside it (variant `both`) 16 threads fault a
# 96 MiB THP-advised ring in by 2 MiB preads of a later part of the file, as the engine's
# workers do. Run on the GPU machine, one fresh process per sample:
#   python3 scripts/probes/pcfeed.py make FILE            # 1 GiB file, written (page cached)
#   python3 scripts/probes/pcfeed.py feed|ring|both FILE [CHUNK_MIB] [FEED_MIB]
# Prints one JSON line: the feeder's per-chunk lock times, first copy issue time, its rate (by
# events, and wall to its end), the ring threads' faulting end and their read times.
import ctypes as C, json, os, sys, threading, time
MiB = 1 << 20
if sys.argv[1] == "make":
    with open(sys.argv[2], "wb") as f:
        blk = os.urandom(64 * MiB)
        for _ in range(16):
            f.write(blk)
    with open(sys.argv[2], "rb") as f:
        while f.read(64 * MiB):
            pass
    sys.exit(0)
from cudactx import cu, ck, new_stream
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
libc.pread.restype = C.c_ssize_t
libc.pread.argtypes = [C.c_int, C.c_void_p, C.c_size_t, C.c_long]
libc.madvise.argtypes = [C.c_void_p, C.c_size_t, C.c_int]
mode, path = sys.argv[1], sys.argv[2]
chunk = int(sys.argv[3]) * MiB if len(sys.argv) > 3 else 8 * MiB
feed_bytes = int(sys.argv[4]) * MiB if len(sys.argv) > 4 else 256 * MiB
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
s = new_stream()
dst = C.c_uint64(); ck(cu.cuMemAlloc_v2(C.byref(dst), C.c_size_t(size)), "alloc")
nch = feed_bytes // chunk
ev = [C.c_void_p() for _ in range(nch + 1)]
for e in ev: ck(cu.cuEventCreate(C.byref(e), 0), "evcreate")
ck(cu.cuCtxSynchronize(), "sync")
out = {"mode": mode, "chunk_mib": chunk // MiB, "feed_mib": feed_bytes // MiB}
go = threading.Event()
reads, ring_end = [], []
RING, WORKERS, PIECE = 96 * MiB, 16, 2 * MiB
def worker(k, ring, base):
    go.wait()
    for j in range(RING // PIECE // WORKERS):
        i = k + j * WORKERS
        t = time.perf_counter()
        n = libc.pread(fd, C.c_void_p(ring + i * PIECE), PIECE, base + i * PIECE)
        assert n == PIECE, n
        reads.append(time.perf_counter() - t)
    ring_end.append(time.perf_counter())
threads = []
if mode in ("ring", "both"):
    raw = libc.mmap(None, RING + 2 * MiB, 3, 0x22, -1, 0)
    ring = (raw + 2 * MiB - 1) & ~(2 * MiB - 1)
    libc.madvise(C.c_void_p(ring), RING, 14)  # MADV_HUGEPAGE
    base = feed_bytes if mode == "both" else 0
    threads = [threading.Thread(target=worker, args=(k, ring, base)) for k in range(WORKERS)]
    for t in threads: t.start()
time.sleep(0.05)
t0 = time.perf_counter(); go.set()
if mode in ("feed", "both"):
    m = libc.mmap(None, feed_bytes, 1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
    assert m not in (None, C.c_void_p(-1).value)
    locks, issued = [], []
    ck(cu.cuEventRecord(ev[0], s), "rec")
    for i in range(nch):
        t = time.perf_counter()
        ck(cu.cuMemHostRegister_v2(C.c_void_p(m + i * chunk), C.c_size_t(chunk), 8), "register ro")
        locks.append(time.perf_counter() - t)
        ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(dst.value + i * chunk), C.c_void_p(m + i * chunk), C.c_size_t(chunk), s), "copy")
        ck(cu.cuEventRecord(ev[i + 1], s), "rec")
        issued.append(time.perf_counter() - t0)
    ck(cu.cuStreamSynchronize(s), "ssync")
    t_end = time.perf_counter() - t0
    ms = C.c_float()
    ck(cu.cuEventElapsedTime(C.byref(ms), ev[0], ev[nch]), "elapsed")
    out.update(first_lock_ms=1e3 * locks[0], lock_median_ms=1e3 * sorted(locks)[len(locks) // 2],
               first_copy_issued_ms=1e3 * issued[0], last_issued_ms=1e3 * issued[-1],
               feed_wall_gbps=feed_bytes / t_end / 1e9, feed_events_gbps=feed_bytes / ms.value / 1e6,
               lock_gbps=chunk / (sorted(locks)[len(locks) // 2]) / 1e9, feed_end_ms=1e3 * t_end)
for t in threads: t.join()
if threads:
    r = sorted(reads)
    out.update(ring_faulted_ms=1e3 * (max(ring_end) - t0), read_median_ms=1e3 * r[len(r) // 2], read_p90_ms=1e3 * r[len(r) * 9 // 10])
print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
