#!/usr/bin/env python3
"""Helpers for scripts/bench-safetensors-fanout (run on a multi-GPU machine; torch required).

  make DIR GIB SHARDS   a ~GIB GiB bf16 checkpoint: an embedding (cut across segments) and
                        layers of 4 projections + a norm; DIR/one/model.safetensors and the same
                        tensors as SHARDS shards with an index in DIR/sharded/
  h2d NGPU              pinned host -> device limits: each GPU alone, their sum, and all GPUs
                        at once (one thread per GPU, own pinned buffer): {per_gpu, sum, concurrent}
  hostbw                host memory bandwidth: a multi-threaded copy of 4 GiB (torch, all cores),
                        bytes copied per second (each byte read and written): {gbps, threads}
  dist PEER PATH        one distributed load; run under torchrun, one process per GPU, NCCL
                        process group set up (and warmed) before the clock, a barrier, then the
                        clock: rank 0 prints {peer, seconds (the last GPU), min_seconds, bytes,
                        gbps} where bytes is the checkpoint's and gbps bytes / seconds.
                        PEER: instanttensor | fastsafetensors | torch
  table JSONL LIMITS    the markdown table from the collected results

Peers' distributed APIs, read from their sources: InstantTensor `safe_open(files, framework="pt",
device=rank, process_group=WORLD)` then `f.tensors()` with `clone()` (README "Distributed
loading"); fastsafetensors `SafeTensorsFileLoader(pg, device, nogds=True)`, files spread over the
ranks with `add_filenames({rank: files})`, `copy_files_to_device()`, `get_tensor` per key (a
broadcast from the rank that read it); torch `safetensors.torch.load_file(f, device="cuda:RANK")`
in every process. Each peer is called defensively: one that fails prints its error and the table
says so.
"""
import glob
import inspect
import json
import os
import statistics
import sys
import threading
import time

GiB = 1 << 30


def out(**kw):
    print(json.dumps(kw), flush=True)


def files_of(path):
    if os.path.isdir(path):
        fs = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not fs:
            raise RuntimeError(f"no .safetensors in {path}")
        return fs
    return [path]


def make(d, gib, shards):
    import torch
    from safetensors.torch import save_file
    gib, shards = float(gib), int(shards)
    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        t = torch.randint(-32768, 32767, shape, generator=g, device="cuda", dtype=torch.int32)
        return t.to(torch.int16).view(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(152064, 4096)}
    size = tensors["model.embed_tokens.weight"].numel() * 2
    layer = 0
    while size < gib * GiB:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"model.layers.{layer}.{name}.weight"] = rand(4096, 4096)
        tensors[f"model.layers.{layer}.norm.weight"] = rand(4096)
        size += 4 * 4096 * 4096 * 2 + 4096 * 2
        layer += 1
    os.makedirs(os.path.join(d, "one"), exist_ok=True)
    os.makedirs(os.path.join(d, "sharded"), exist_ok=True)
    save_file(tensors, os.path.join(d, "one", "model.safetensors"), metadata={"format": "pt"})
    names = list(tensors)
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
        save_file(part, os.path.join(d, "sharded", fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(d, "sharded", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    out(tensors=len(tensors), bytes=total, shards=shards)


def h2d(ngpu):
    import torch
    n, ngpu = GiB, int(ngpu)
    hs = [torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(7) for _ in range(ngpu)]
    ds = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}") for i in range(ngpu)]

    def one(i, reps):
        best = 0.0
        with torch.cuda.device(i):
            for _ in range(reps):
                torch.cuda.synchronize(i)
                t0 = time.perf_counter()
                ds[i].copy_(hs[i], non_blocking=True)
                torch.cuda.synchronize(i)
                best = max(best, n / (time.perf_counter() - t0) / 1e9)
        return best

    per = [one(i, 5) for i in range(ngpu)]
    best_all = 0.0
    for _ in range(5):
        for i in range(ngpu):
            torch.cuda.synchronize(i)
        barrier = threading.Barrier(ngpu + 1)

        def run(i):
            barrier.wait()
            with torch.cuda.device(i):
                ds[i].copy_(hs[i], non_blocking=True)
                torch.cuda.synchronize(i)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(ngpu)]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        best_all = max(best_all, ngpu * n / (time.perf_counter() - t0) / 1e9)
    out(per_gpu=per, sum=sum(per), concurrent=best_all)


def hostbw():
    import torch
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    n = 4 * GiB
    a = torch.empty(n, dtype=torch.uint8).fill_(3)
    b = torch.empty(n, dtype=torch.uint8).fill_(0)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, n / (time.perf_counter() - t0) / 1e9)
    out(gbps=best, threads=threads, note="bytes copied per second (each read once and written once)")


def dist(peer, path):
    import torch
    import torch.distributed as dist_
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(local)
    dist_.init_process_group(backend="nccl")
    dist_.all_reduce(torch.zeros(1, device="cuda"))  # NCCL set up before the clock
    files = files_of(path)
    result = {}
    err = None
    try:
        if peer == "instanttensor":
            from instanttensor import safe_open
        elif peer == "fastsafetensors":
            import fastsafetensors as fst
        elif peer == "torch":
            from safetensors.torch import load_file
        else:
            raise ValueError(f"unknown peer {peer}")
    except Exception as e:
        err = f"{type(e).__name__}: {e}"[:300]
    torch.cuda.synchronize()
    dist_.barrier()
    t0 = time.perf_counter()
    if err is None:
        try:
            if peer == "instanttensor":
                src = files if len(files) > 1 else files[0]
                with safe_open(src, framework="pt", device=torch.cuda.current_device(),
                               process_group=dist_.GroupMember.WORLD) as f:
                    if hasattr(f, "tensors"):
                        it = f.tensors()
                    else:
                        it = ((k, f.get_tensor(k)) for k in f.keys())
                    for k, t in it:
                        result[k] = t.clone()
            elif peer == "fastsafetensors":
                pg = dist_.group.WORLD
                dev = torch.device(f"cuda:{local}")
                cls = fst.SafeTensorsFileLoader
                params = list(inspect.signature(cls.__init__).parameters)
                if len(params) > 1 and params[1] == "pg":
                    loader = cls(pg, dev, nogds=True)
                else:
                    loader = cls(device=str(dev), pg=pg, nogds=True)
                loader.add_filenames({r: files[r::world] for r in range(min(world, len(files)))})
                fb = loader.copy_files_to_device()
                keys = fb.get_keys() if hasattr(fb, "get_keys") else loader.get_keys()
                for k in sorted(keys):
                    result[k] = fb.get_tensor(k)
            elif peer == "torch":
                for f in files:
                    result.update(load_file(f, device=f"cuda:{local}"))
            torch.cuda.synchronize()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:300]
    secs = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in result.values())
    ok = torch.tensor([0 if err else 1], device="cuda")
    dist_.all_reduce(ok, op=dist_.ReduceOp.MIN)
    ts = [None] * world
    dist_.all_gather_object(ts, (secs, nbytes, err))
    if rank == 0:
        errs = [e for (_, _, e) in ts if e]
        if errs or not ok.item():
            out(peer=peer, error=errs[0] if errs else "a rank failed")
        else:
            last = max(s for s, _, _ in ts)
            held = [b for _, b, _ in ts]
            out(peer=peer, seconds=last, min_seconds=min(s for s, _, _ in ts), bytes=held[0],
                held_bytes=sum(held), gbps=held[0] / last / 1e9, world=world)
    dist_.barrier()
    dist_.destroy_process_group()


def table(jsonl, limits_json):
    rows = []
    for l in open(jsonl):
        try:
            rows.append(json.loads(l))
        except ValueError:
            pass
    lim = {}
    if os.path.exists(limits_json):
        for l in open(limits_json):
            if l.strip().startswith("{"):
                lim.update(json.loads(l))
    runs, errors, loaders = {}, {}, []
    for r in rows:
        if r.get("kind") != "run":
            continue
        key = (r["cond"], r["loader"])
        if r["loader"] not in loaders:
            loaders.append(r["loader"])
        if "seconds" in r and r.get("seconds"):
            runs.setdefault(key, []).append(r)
        else:
            errors[key] = r.get("error", "no result")
    conds = ["warm", "sharded-warm", "tmpfs", "cold"]
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in runs.items()}
    agg = {k: statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in v) for k, v in runs.items()}
    print("Time until the last GPU holds its tensors, seconds (median; aggregate GB/s = checkpoint bytes / time):")
    print()
    print("| loader | " + " | ".join(conds) + " |")
    print("|---|" + "---|" * len(conds))
    for l in loaders:
        cells = []
        for c in conds:
            if (c, l) in med:
                cells.append(f"{med[(c, l)]:.3f} s, {agg[(c, l)]:.1f} GB/s (n={len(runs[(c, l)])})")
            elif (c, l) in errors:
                cells.append("failed: " + str(errors[(c, l)])[:70].replace("|", "/"))
            else:
                cells.append("")
        print(f"| {l} | " + " | ".join(cells) + " |")
    print()
    h2d_sum = lim.get("h2d_sum")
    host = lim.get("host_gbps")
    if h2d_sum or host:
        print(f"Limits: sum of per-GPU pinned H2D {h2d_sum or 0:.1f} GB/s (all at once: "
              f"{lim.get('h2d_concurrent', 0):.1f}), host memory copy {host or 0:.1f} GB/s, "
              f"cold raw O_DIRECT read {lim.get('raw_read_gbps', 0):.1f} GB/s")
    bound = min(x for x in (h2d_sum, host) if x) if (h2d_sum or host) else None
    print()
    print("Targets (issue 13): gpudirect time <= InstantTensor time / 1.4; replicated aggregate >= 0.9 x min(sum pinned H2D, host memory bandwidth):")
    for c in conds:
        gd = med.get((c, "gpudirect replicated"))
        it = med.get((c, "instanttensor"))
        parts = []
        if gd and it:
            r = gd / it
            parts.append(f"gpudirect/InstantTensor time = {r:.3f} ({'MET' if r <= 1 / 1.4 else 'MISSED'} <= 0.714)")
        g = agg.get((c, "gpudirect replicated"))
        if g and bound and c != "cold":
            r = g / bound
            parts.append(f"aggregate {g:.1f} GB/s = {r:.2f} x min(H2D sum, host) ({'MET' if r >= 0.9 else 'MISSED'} >= 0.9)")
        if g and c == "cold" and lim.get("raw_read_gbps"):
            parts.append(f"aggregate {g:.1f} GB/s = {g / lim['raw_read_gbps']:.2f} x raw O_DIRECT read")
        if parts:
            print(f"- {c}: " + "; ".join(parts))


if __name__ == "__main__":
    cmd, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    fns = {"make": make, "h2d": h2d, "hostbw": hostbw, "dist": dist, "table": table}
    if cmd not in fns:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    fns[cmd](*args)
