#!/usr/bin/env python3
"""Helpers for scripts/bench-safetensors (run on the GPU machine; torch required).

  make DIR              a ~4 GiB bf16 checkpoint, 320 tensors: DIR/one/model.safetensors and the
                        same tensors as 4 shards with an index in DIR/sharded/
  load PEER PATH        one load in this (fresh) process, CUDA initialised before the clock;
                        prints one JSON line {peer, seconds, gbps, bytes, tensors} or {peer, error}.
                        PEER: torch | instanttensor[:BACKEND] | fastsafetensors | runai
                        (BACKEND: INSTANTTENSOR_BACKEND value, e.g. MMAP, BUFFERED)
  h2d                   pinned host -> device copy limit (best of 10 x 1 GiB): {gbps}
  rawread FILE          best O_DIRECT read of FILE over thread/block variants, caches dropped
                        before each, then the best variant RAW_REPEATS (4) times more: {gbps
                        (median of the best variant's samples), best, samples, variants}
  rawwrite FILE MIB     the same for an O_DIRECT write of MIB MiB with one fsync at the end
  table JSONL           the markdown table from the results bench-safetensors collected

Peers' APIs were read from their sources (InstantTensor safe_open / tests/test.py, fastsafetensors
SafeTensorsFileLoader, runai SafetensorsStreamer); each is called defensively: a peer that fails
prints its error and the table says so.
"""
import glob
import json
import mmap
import os
import statistics
import sys
import threading
import time

GiB = 1 << 30
# The raw limits: the best thread x block variant (one sample each) is run this many times more
# and its median is the limit, as bench-oneshot does: the best of single samples of a disk
# whose rate moves between runs (1.1-1.9 GB/s on the H200 machine) is biased upward.
RAW_REPEATS = int(os.environ.get("RAW_REPEATS", "4"))


def out(**kw):
    print(json.dumps(kw), flush=True)


def files_of(path):
    if os.path.isdir(path):
        fs = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not fs:
            raise RuntimeError(f"no .safetensors in {path}")
        return fs
    return [path]


def make(d):
    import torch
    from safetensors.torch import save_file
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = {}
    for layer in range(64):
        for k, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
            t = torch.randint(-32768, 32767, (2048, 4096), generator=g, device="cuda", dtype=torch.int32)
            tensors[f"model.layers.{layer}.{name}.weight"] = t.to(torch.int16).view(torch.bfloat16).cpu()
        n = torch.randint(-32768, 32767, (4096,), generator=g, device="cuda", dtype=torch.int32)
        tensors[f"model.layers.{layer}.norm.weight"] = n.to(torch.int16).view(torch.bfloat16).cpu()
    os.makedirs(os.path.join(d, "one"), exist_ok=True)
    os.makedirs(os.path.join(d, "sharded"), exist_ok=True)
    save_file(tensors, os.path.join(d, "one", "model.safetensors"), metadata={"format": "pt"})
    names = list(tensors)
    weight_map = {}
    for k in range(4):
        fname = f"model-{k + 1:05d}-of-00004.safetensors"
        part = {n: tensors[n] for n in names[k * 80:(k + 1) * 80]}
        save_file(part, os.path.join(d, "sharded", fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(d, "sharded", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    out(tensors=len(tensors), bytes=total)


def load(peer, path):
    t_import = time.perf_counter()
    try:
        import torch
        torch.cuda.init()
        torch.empty(1, device="cuda:0")
        torch.cuda.synchronize()
        files = files_of(path)
        name, _, backend = peer.partition(":")
        if name == "instanttensor" and backend:
            os.environ["INSTANTTENSOR_BACKEND"] = backend  # before the import reads it
        if name == "instanttensor":
            import inspect
            from instanttensor import safe_open
            kw = {}
            if "copy" in inspect.signature(safe_open.__init__).parameters:
                kw["copy"] = True
        elif name == "fastsafetensors":
            from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        elif name == "runai":
            from runai_model_streamer import SafetensorsStreamer
        elif name == "torch":
            from safetensors.torch import load_file
        else:
            raise ValueError(f"unknown peer {peer}")
        t0 = time.perf_counter()
        result = {}
        if name == "torch":
            for f in files:
                result.update(load_file(f, device="cuda:0"))
        elif name == "instanttensor":
            src = files if len(files) > 1 else files[0]
            with safe_open(src, framework="pt", device=0, **kw) as f:
                if hasattr(f, "tensors"):
                    it = f.tensors()
                else:
                    it = ((k, f.get_tensor(k)) for k in f.keys())
                for k, t in it:
                    result[k] = t if kw.get("copy") else t.clone()
        elif name == "fastsafetensors":
            loader = SafeTensorsFileLoader(SingleGroup(), torch.device("cuda:0"), nogds=True)
            loader.add_filenames({0: files})
            fb = loader.copy_files_to_device()
            for k in list(loader.get_keys()):
                result[k] = fb.get_tensor(k)
        elif name == "runai":
            with SafetensorsStreamer() as s:
                try:
                    s.stream_files(files, device="cuda:0")
                except TypeError:
                    s.stream_files(files)
                for k, t in s.get_tensors():
                    result[k] = t.to("cuda:0") if t.device.type != "cuda" else t.clone()
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in result.values())
        out(peer=peer, seconds=secs, gbps=nbytes / secs / 1e9, bytes=nbytes, tensors=len(result),
            setup_seconds=t0 - t_import)
    except Exception as e:  # the row says why
        out(peer=peer, error=f"{type(e).__name__}: {e}"[:300])


def h2d():
    import torch
    n = GiB
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h.fill_(7)
    d = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    best = 0.0
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t0) / 1e9)
    out(gbps=best)


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def direct_io(path, size, threads, block, write):
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o644)
    chunks = list(range(0, size, block))
    lock = threading.Lock()
    errors = []

    def work():
        buf = mmap.mmap(-1, block)
        if write:
            buf.write(os.urandom(4096) * (block // 4096))
        while True:
            with lock:
                if not chunks:
                    return
                off = chunks.pop()
            n = min(block, size - off)
            try:
                if write:
                    os.pwritev(fd, [memoryview(buf)[:n]], off)
                else:
                    os.preadv(fd, [buf], off)
            except OSError as e:
                errors.append(str(e))
                return

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if write:
        os.fsync(fd)
    secs = time.perf_counter() - t0
    os.close(fd)
    if errors:
        raise OSError(errors[0])
    return size / secs / 1e9


VARIANTS = [(1, 16 << 20), (4, 8 << 20), (8, 4 << 20), (16, 4 << 20), (32, 1 << 20)]


def rawread(path):
    size = os.path.getsize(path) // (1 << 20) * (1 << 20)
    res = {}
    for th, bl in VARIANTS:
        if not drop_caches():
            out(error="cannot write /proc/sys/vm/drop_caches (needs root): no cold numbers")
            return
        try:
            res[f"{th}x{bl >> 20}MiB"] = direct_io(path, size, th, bl, False)
        except OSError as e:
            res[f"{th}x{bl >> 20}MiB"] = str(e)
    nums = {k: v for k, v in res.items() if isinstance(v, float)}
    best = max(nums, key=nums.get) if nums else None
    samples = [nums[best]] if best else []
    for _ in range(RAW_REPEATS if best else 0):
        th, bl = VARIANTS[list(res).index(best)]
        if not drop_caches():
            break
        try:
            samples.append(direct_io(path, size, th, bl, False))
        except OSError as e:
            res[f"repeat {len(samples)}"] = str(e)
            break
    out(gbps=statistics.median(samples) if samples else 0.0, best=best, samples=samples, variants=res)


def rawwrite(path, mib):
    size = int(mib) << 20
    res = {}
    for th, bl in VARIANTS[:4]:
        try:
            if os.path.exists(path):
                os.unlink(path)
            res[f"{th}x{bl >> 20}MiB"] = direct_io(path, size, th, bl, True)
        except OSError as e:
            res[f"{th}x{bl >> 20}MiB"] = str(e)
    nums = {k: v for k, v in res.items() if isinstance(v, float)}
    best = max(nums, key=nums.get) if nums else None
    samples = [nums[best]] if best else []
    for _ in range(RAW_REPEATS if best else 0):
        th, bl = VARIANTS[list(res).index(best)]
        if os.path.exists(path):
            os.unlink(path)
        try:
            samples.append(direct_io(path, size, th, bl, True))
        except OSError as e:
            res[f"repeat {len(samples)}"] = str(e)
            break
    if os.path.exists(path):
        os.unlink(path)
    out(gbps=statistics.median(samples) if samples else 0.0, best=best, samples=samples, variants=res)


def table(jsonl):
    rows = [json.loads(l) for l in open(jsonl) if l.strip().startswith("{")]
    limits = {r["cond"]: r for r in rows if r.get("kind") == "limit"}
    runs = {}
    errors = {}
    for r in rows:
        if r.get("kind") != "run":
            continue
        key = (r["cond"], r["loader"])
        if "gbps" in r:
            runs.setdefault(key, []).append(r["gbps"])
        else:
            errors[key] = r.get("error", "no result")
    conds = ["warm", "tmpfs", "cold", "sharded-warm", "save"]
    loaders = []
    for r in rows:
        if r.get("kind") == "run" and r["loader"] not in loaders:
            loaders.append(r["loader"])
    print("| loader | " + " | ".join(conds) + " |")
    print("|---|" + "---|" * len(conds))
    med = {k: statistics.median(v) for k, v in runs.items()}
    for l in loaders:
        cells = []
        for c in conds:
            if (c, l) in med:
                cells.append(f"{med[(c, l)]:.2f} (n={len(runs[(c, l)])})")
            elif (c, l) in errors:
                cells.append("failed: " + errors[(c, l)][:80].replace("|", "/"))
            else:
                cells.append("")
        print(f"| {l} | " + " | ".join(cells) + " |")
    for c in conds:
        if c in limits:
            print(f"| limit: {limits[c]['name']} | " + " | ".join(
                f"{limits[c]['gbps']:.2f}" if x == c else "" for x in conds) + " |")
    print()
    print("Ratios (medians, GB/s):")
    for c in conds:
        peers = {l: v for (cc, l), v in med.items() if cc == c and not l.startswith("gpudirect")}
        best_peer = max(peers, key=peers.get) if peers else None
        lim = limits.get(c, {}).get("gbps")
        for l in loaders:
            if not l.startswith("gpudirect") or (c, l) not in med:
                continue
            v = med[(c, l)]
            parts = [f"- {c}, {l}: {v:.2f} GB/s"]
            if best_peer:
                parts.append(f"{v / peers[best_peer]:.2f}x the best peer ({best_peer} {peers[best_peer]:.2f})")
            if lim:
                parts.append(f"{v / lim:.2f}x {limits[c]['name']} ({lim:.2f})")
            print(", ".join(parts))
    one = med.get(("warm", "gpudirect one-allocation"))
    own = med.get(("warm", "gpudirect owned"))
    if one and own:
        print(f"- owned / one-allocation (warm): {own / one:.2f}")
    sh = med.get(("sharded-warm", "gpudirect one-allocation"))
    if one and sh:
        print(f"- sharded (4 files) / one file (warm): {sh / one:.2f}")
    print()
    print("Samples (GB/s, in run order):")
    for c in conds:
        for l in loaders:
            if (c, l) in runs:
                print(f"- {c}, {l}: " + ", ".join(f"{x:.2f}" for x in runs[(c, l)]))
    notes = [r for r in rows if r.get("kind") == "note"]
    if notes:
        print()
        print("Notes:")
        for r in notes:
            print(f"- {r.get('cond')}: {r.get('error')}")


if __name__ == "__main__":
    cmd, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    fns = {"make": make, "load": load, "h2d": h2d, "rawread": rawread, "rawwrite": rawwrite, "table": table}
    if cmd not in fns:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    fns[cmd](*args)
