#!/usr/bin/env python3
"""One summary line for a compute-sanitizer log (memcheck, racecheck, synccheck).

    python3 scripts/sanitizer-summary.py LOG NAME TOOL RC

Each error record is attributed to the first host frame of its saved backtrace that is not in
libcuda: `ours` (a frame in one of our binaries, i.e. a file under .device/ or a gpudirect
symbol), `libcufile` (libcufile.so), or `other`. API errors ("Program hit CUDA_ERROR_... on CUDA
API call to X") are counted apart from memory and synchronisation errors and listed by call,
because some are deliberate probes (a CUDA call expected to fail). Exit status: 1 when a memory,
race or sync error is attributed to our code, else 0.
"""
import collections
import re
import sys

INFO = (
    "COMPUTE-SANITIZER",
    "ERROR SUMMARY",
    "RACECHECK SUMMARY",
    "LEAK SUMMARY",
    "Target application returned",
    "This tool",
    "Error: process didn't terminate successfully",
)


def records(lines):
    """Yields (headline, [detail lines]) for every error record."""
    head, body = None, []
    for line in lines:
        if not line.startswith("========="):
            continue
        text = line[len("=========") :]
        if text.startswith(" ") and not text.startswith("  ") and text.strip():
            # A headline: one space after the prefix.
            if head is not None:
                yield head, body
            head, body = text.strip(), []
            if head.startswith(INFO):
                head = None
        elif head is not None:
            body.append(text.strip())
    if head is not None:
        yield head, body


def origin(body):
    for line in body:
        if "Host Frame" not in line:
            continue
        m = re.search(r"\bin\s+(\S+)\s*$", line)
        module = m.group(1) if m else ""
        base = module.rsplit("/", 1)[-1]
        if base.startswith("libcuda.so"):
            continue
        if base.startswith("libcufile"):
            return "libcufile"
        if ".device/" in module or "gpudirect" in line or base.startswith("gpudirect"):
            return "ours"
        if base.startswith(("libc.so", "libpthread", "libstdc++", "ld-linux")):
            continue
        return "other"
    return "other"


def main():
    log, name, tool, rc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    try:
        lines = open(log, errors="replace").read().splitlines()
    except OSError as e:
        print(f"{tool} {name}: no log ({e})")
        return 1
    total = None
    for line in lines:
        m = re.search(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:errors|hazards)", line)
        if m:
            total = int(m.group(1))
    mem = collections.Counter()
    api = collections.defaultdict(collections.Counter)
    kinds = collections.Counter()
    for head, body in records(lines):
        where = origin(body)
        m = re.search(r"on CUDA API call to (\w+)", head)
        if head.startswith("Program hit") and m:
            api[where][m.group(1)] += 1
        else:
            mem[where] += 1
            kinds[(where, re.sub(r"0x[0-9a-f]+|\d+", "N", head)[:80])] += 1
    status = {"0": "tests passed", "124": "TIMED OUT"}.get(rc, f"exit status {rc}")
    api_txt = "; ".join(
        f"{w}: " + ", ".join(f"{c} x{n}" for c, n in sorted(calls.items()))
        for w, calls in sorted(api.items())
    )
    printed = sum(mem.values()) + sum(sum(c.values()) for c in api.values())
    print(
        f"{tool} {name}: {mem['ours']} errors in our code, {mem['libcufile']} inside libcufile, "
        f"{mem['other']} elsewhere; API errors: {api_txt or 'none'}; "
        f"sanitizer total {total if total is not None else '?'} ({printed} printed); {status}"
    )
    for (where, kind), n in sorted(kinds.items()):
        print(f"    {where}: {n} x {kind}")
    return 1 if mem["ours"] else 0


if __name__ == "__main__":
    sys.exit(main())
