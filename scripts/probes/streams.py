# Does cuStreamCreate wait for another stream's work once a context has many streams? Stream A
# is held by a host function until a timer thread releases it (2 s); the main thread creates
# streams meanwhile and times each; after a creation that waited (the hold was released under
# it), A is held again, so every creation runs beside a held A. Run on the GPU machine:
#   python3 scripts/probes/streams.py [N]
# Prints each creation slower than 10 ms with the number of streams the context had, then the
# same after destroying half of them (do freed slots wait too?). (The seventh session's run: the 36th, 79th, 122nd, ... waited, every 42-43; freed slots did not. The sixth session's run, before
# the re-hold: only the 36th waited, and the later ones ran with A released.)
import ctypes as C, sys, threading, time
from cudactx import cu, ck, new_stream
N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
HOSTFN = C.CFUNCTYPE(None, C.c_void_p)
gate = threading.Event()
cb = HOSTFN(lambda _: gate.wait())
A = new_stream()
timer = [None]
def hold():
    ck(cu.cuStreamSynchronize(A), "syncA")
    if timer[0]: timer[0].cancel()
    gate.clear()
    ck(cu.cuLaunchHostFunc(A, cb, None), "hostfn"); time.sleep(0.01)
    timer[0] = threading.Timer(2.0, gate.set); timer[0].start()
def held(label, n, made):
    hold()
    t_start = time.perf_counter(); slow = []
    for i in range(n):
        t = time.perf_counter(); s = new_stream(); dt = time.perf_counter() - t
        made.append(s)
        if dt > 0.01:
            slow.append((len(made) + 1, round(dt * 1e3, 1), round((t - t_start) * 1e3, 1)))
            if gate.is_set(): hold()
    timer[0].cancel(); gate.set(); ck(cu.cuStreamSynchronize(A), "syncA")
    print(f"{label}: {n} streams created while A was held; slow (streams in context, ms, at ms): {slow}")
made = []
held("fresh context", N, made)
for s in made[: len(made) // 2]: ck(cu.cuStreamDestroy_v2(s), "destroy")
made = made[len(made) // 2 :]
held("after destroying half", N // 2, made)
