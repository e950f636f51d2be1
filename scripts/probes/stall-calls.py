# Which driver calls wait while another thread is in cuMemHostUnregister behind a held stream?
# (The storage engine's gates recorded events; tests/storage_gpu_stall_events.rs found
# cuEventRecord waiting there like cuEventCreate, H200, driver 580. Its probe timed the calls one
# after another on one thread, so the calls after the first that waited said nothing.) Here every
# call runs on its own thread, all started together once the unregister waits, each bound to the
# context beforehand, except cuCtxSetCurrent's, which binds it while the unregister waits (a
# non-blocking gpudirect call on a thread with another context current makes that call; this
# line was added after the first run). Run on the GPU machine:
#   python3 scripts/probes/stall-calls.py [ROUNDS]
# Prints one line per round: each call's time in ms, and the unregister's.
import ctypes as C, sys, threading, time
from cudactx import cu, ck, ctx, new_stream
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
MiB = 1 << 20
HOLD = 1.5
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
HOSTFN = C.CFUNCTYPE(None, C.c_void_p)
hold_cb = HOSTFN(lambda _: time.sleep(HOLD))
noop_cb = HOSTFN(lambda _: None)
dptr = C.c_uint64(); ck(cu.cuMemAlloc_v2(C.byref(dptr), C.c_size_t(MiB)), "alloc")
pin = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(pin), C.c_size_t(MiB), 0x02), "hostalloc")  # DEVICEMAP
flag = C.c_uint64(); ck(cu.cuMemHostGetDevicePointer_v2(C.byref(flag), pin, 0), "devptr")
A = new_stream()
for r in range(rounds):
    B = [new_stream() for _ in range(12)]
    evs = [C.c_void_p() for _ in range(12)]
    for e in evs: ck(cu.cuEventCreate(C.byref(e), 2), "evcreate")  # DISABLE_TIMING
    for i, e in enumerate(evs): ck(cu.cuEventRecord(e, B[i]), "evrecord")
    ck(cu.cuCtxSynchronize(), "sync")
    m = libc.mmap(None, 32 * MiB, 3, 0x22, -1, 0); C.memset(m, 1, 32 * MiB)
    ck(cu.cuMemHostRegister_v2(C.c_void_p(m), C.c_size_t(32 * MiB), 0), "reg")
    ck(cu.cuLaunchHostFunc(A, hold_cb, None), "hold"); time.sleep(0.02)
    ut = []
    def unreg():
        ck(cu.cuCtxSetCurrent(ctx), "bind"); a = time.perf_counter()
        ck(cu.cuMemHostUnregister(C.c_void_p(m)), "unreg"); ut.append(time.perf_counter() - a)
    st = C.c_int(); cur = C.c_void_p(); ne = C.c_void_p(); ns = C.c_void_p()
    calls = {
        "cuEventCreate": lambda i: cu.cuEventCreate(C.byref(ne), 2),
        "cuEventRecord": lambda i: cu.cuEventRecord(evs[i], B[i]),
        "cuStreamWaitEvent": lambda i: cu.cuStreamWaitEvent(B[i], evs[(i + 1) % 12], 0),
        "cuEventQuery": lambda i: cu.cuEventQuery(evs[i]),
        "cuStreamQuery": lambda i: cu.cuStreamQuery(B[i]),
        "cuStreamIsCapturing": lambda i: cu.cuStreamIsCapturing(B[i], C.byref(st)),
        "cuStreamWriteValue32": lambda i: cu.cuStreamWriteValue32_v2(B[i], flag, C.c_uint32(7), 0),
        "cuLaunchHostFunc": lambda i: cu.cuLaunchHostFunc(B[i], noop_cb, None),
        "cuMemcpyHtoDAsync 4 KiB": lambda i: cu.cuMemcpyHtoDAsync_v2(dptr, pin, C.c_size_t(4096), B[i]),
        "cuCtxGetCurrent": lambda i: cu.cuCtxGetCurrent(C.byref(cur)),
        # Its thread has no context current beforehand (see `one`): a real bind.
        "cuCtxSetCurrent": lambda i: cu.cuCtxSetCurrent(ctx),
        "cuStreamCreate": lambda i: cu.cuStreamCreate(C.byref(ns), 1),
    }
    go = threading.Event(); res = {}
    def one(i, name, f):
        ck(cu.cuCtxSetCurrent(None if name == "cuCtxSetCurrent" else ctx), "bind"); go.wait()
        a = time.perf_counter(); rc = f(i); res[name] = (1e3 * (time.perf_counter() - a), rc)
    th = [threading.Thread(target=one, args=(i, n, f)) for i, (n, f) in enumerate(calls.items())]
    [t.start() for t in th]
    y = threading.Thread(target=unreg); y.start(); time.sleep(0.05)
    go.set(); [t.join() for t in th]; y.join()
    ck(cu.cuStreamSynchronize(A), "syncA")
    print(f"round {r}: unregister {1e3 * ut[0]:.1f} ms; " +
          ", ".join(f"{n} {t:.2f} ms (rc {rc})" for n, (t, rc) in res.items()), flush=True)
