# The probes' shared start: libcuda through ctypes, device 0's primary context made current.
# Imported by alloc.py, alloc2.py and alloc3.py (python puts the script's directory on sys.path).
import ctypes as C
cu = C.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0: raise SystemExit(f"{what} -> CUresult {r}")
ck(cu.cuInit(0), "cuInit")
dev = C.c_int(); ck(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
ctx = C.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "setcurrent")
def new_stream():
    """A new non-blocking stream."""
    s = C.c_void_p(); ck(cu.cuStreamCreate(C.byref(s), 1), "cuStreamCreate"); return s
