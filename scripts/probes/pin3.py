# Does cuMemHostRegister wait for another stream's work? Stream A is held by a host function
# (300 ms); each registration below is timed while it is held. Run on the GPU machine:
#   python3 scripts/probes/pin3.py
# (a) a fresh mapping, (b) extending a registration in the same mapping (the range right after
# it), (c) the next slot of a mapping whose first slot is registered, (d) after a gap.
import ctypes as C, time
from cudactx import cu, ck, new_stream
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
MiB = 1 << 20
A = new_stream()
HOSTFN = C.CFUNCTYPE(None, C.c_void_p)
cb = HOSTFN(lambda _: time.sleep(0.3))
def mapping(n):
    m = libc.mmap(None, n, 3, 0x22, -1, 0); C.memset(m, 1, n); return m
def reg(p, n):
    ck(cu.cuMemHostRegister_v2(C.c_void_p(p), C.c_size_t(n), 0), "reg")
def held(label, f):
    ck(cu.cuLaunchHostFunc(A, cb, None), "hostfn"); time.sleep(0.01)
    t = time.perf_counter(); f(); dt = time.perf_counter() - t
    ck(cu.cuStreamSynchronize(A), "syncA")
    print(f"{label}: {1e3*dt:.2f} ms while another stream is held")
a = mapping(32 * MiB); held("(a) register a fresh 32 MiB mapping", lambda: reg(a, 32 * MiB))
b = mapping(64 * MiB); reg(b, 8 * MiB); held("(b) register [8, 32) MiB right after [0, 8) of the same mapping", lambda: reg(b + 8 * MiB, 24 * MiB))
c = mapping(96 * MiB); reg(c, 32 * MiB); held("(c) register [32, 64) MiB after [0, 32) of the same mapping", lambda: reg(c + 32 * MiB, 32 * MiB))
d = mapping(96 * MiB); reg(d, 8 * MiB); held("(d) register [16, 32) MiB after [0, 8) (a gap)", lambda: reg(d + 16 * MiB, 16 * MiB))
e = mapping(32 * MiB); held("(e) register another fresh 32 MiB mapping", lambda: reg(e, 32 * MiB))
