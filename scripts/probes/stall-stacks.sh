#!/usr/bin/env bash
# Where does a transfer wait while another stream is held? Runs the stall_buffers test binary
# (staged in .device/) until the order "write test, then ring test" makes the ring test stall,
# and samples every thread's kernel wait channel and (when gdb is there) user stacks 5 s in,
# inside the stall. Output under ${OUT:-/tmp/g}: st<i>.txt (test output), wchan<i>.txt, gdb<i>.txt.
set -uo pipefail
O=${OUT:-/tmp/g}; mkdir -p "$O"
T=.device/tests/gpudirect--test--storage_gpu_stall_buffers
command -v gdb eu-stack > "$O/tools.txt" 2>&1
for i in 1 2 3 4 5 6; do
  "$T" --include-ignored > "$O/st$i.txt" 2>&1 &
  pid=$!
  sleep 5
  for t in /proc/$pid/task/*; do echo "$(cat "$t/comm" 2>/dev/null) $(cat "$t/wchan" 2>/dev/null) $(head -c 300 "$t/stack" 2>/dev/null | tr '\n' '|')"; done > "$O/wchan$i.txt"
  if command -v gdb >/dev/null; then timeout 60 gdb -p $pid -batch -ex "thread apply all bt 12" > "$O/gdb$i.txt" 2>&1; fi
  wait $pid
  if grep -q FAILED "$O/st$i.txt"; then echo "stalled in run $i"; break; fi
done
