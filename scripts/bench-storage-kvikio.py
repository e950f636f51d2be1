#!/usr/bin/env python3
"""KvikIO side of gpudirect's storage benchmark (benches/storage.rs runs it once per round).

Measures KvikIO (26.10: wheels kvikio-cu13, libkvikio-cu13, rapids-logger) on the same file:
page-cached read into GPU memory at KvikIO's default settings and at each thread count, and
writes from GPU memory (durable = fsync included; non-durable beside it). Prints one JSON line
per measurement: {"name": ..., "gbps": ..., "note": ...} (GB/s = 1e9 bytes/s).

    python3 scripts/bench-storage-kvikio.py --file F --wfile W --size BYTES \
        [--reps 1] [--threads 1,2,4,8,16,32,64] [--device 0]

Needs a CUDA GPU, kvikio and cupy (torch is used when cupy is missing).
"""
import argparse
import json
import os
import sys
import time


def emit(name, gbps, note=None):
    print(json.dumps({"name": name, "gbps": gbps, "note": note}), flush=True)


def set_threads(kvikio, n):
    d = kvikio.defaults
    for attempt in (
        lambda: d.set({"num_threads": n}),
        lambda: d.set("num_threads", n),
        lambda: d.num_threads_reset(n),
    ):
        try:
            attempt()
            return
        except (AttributeError, TypeError):
            continue
    raise RuntimeError("cannot set KvikIO's thread count with this KvikIO version")


def get_threads(kvikio):
    d = kvikio.defaults
    for attempt in (lambda: d.get("num_threads"), lambda: d.get_num_threads(), lambda: d.num_threads()):
        try:
            return attempt()
        except (AttributeError, TypeError):
            continue
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--wfile", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", default="1,2,4,8,16,32,64")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--no-writes", action="store_true", help="read rows only")
    a = ap.parse_args()

    import kvikio
    import kvikio.defaults

    try:
        import cupy

        cupy.cuda.Device(a.device).use()
        buf = cupy.empty(a.size, dtype=cupy.uint8)
        sync = cupy.cuda.runtime.deviceSynchronize
        lib = "cupy " + cupy.__version__
    except ImportError:
        import torch

        torch.cuda.set_device(a.device)
        buf = torch.empty(a.size, dtype=torch.uint8, device="cuda")
        sync = torch.cuda.synchronize
        lib = "torch " + torch.__version__

    version = getattr(kvikio, "__version__", "?")
    try:
        compat = str(kvikio.defaults.get("compat_mode"))
    except Exception:  # noqa: BLE001 - older KvikIO spells it differently
        try:
            compat = str(kvikio.defaults.compat_mode())
        except Exception as e:  # noqa: BLE001 - report, don't fail
            compat = f"? ({e})"
    default_threads = get_threads(kvikio)
    note = f"kvikio {version}, compat_mode={compat}, {lib}"
    sweep = [int(x) for x in a.threads.split(",") if x.strip()]

    def read_once():
        sync()
        t0 = time.perf_counter()
        with kvikio.CuFile(a.file, "r") as f:
            n = f.read(buf)
        sync()
        dt = time.perf_counter() - t0
        if n != a.size:
            raise RuntimeError(f"short read {n} of {a.size}")
        return a.size / dt / 1e9

    def write_once(durable):
        sync()
        t0 = time.perf_counter()
        with kvikio.CuFile(a.wfile, "w") as f:
            n = f.write(buf)
        if durable:
            fd = os.open(a.wfile, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        dt = time.perf_counter() - t0
        if n != a.size:
            raise RuntimeError(f"short write {n} of {a.size}")
        return a.size / dt / 1e9

    for _ in range(a.reps):
        set_threads(kvikio, default_threads or 1)
        emit("kvikio_read_cached_default", read_once(), f"{note}, threads={default_threads}")
        for n in sweep:
            set_threads(kvikio, n)
            emit(f"kvikio_read_cached_t{n}", read_once())
        set_threads(kvikio, default_threads or 1)
        if a.no_writes:
            continue
        emit("kvikio_write_durable_default", write_once(True), f"threads={default_threads}")
        emit("kvikio_write_nondurable_default", write_once(False))
        for n in [n for n in sweep if n in (16, 32)]:
            set_threads(kvikio, n)
            emit(f"kvikio_write_durable_t{n}", write_once(True))
        set_threads(kvikio, default_threads or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
