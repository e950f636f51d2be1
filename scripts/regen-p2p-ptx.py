#!/usr/bin/env python3
# Regenerates src/p2p/kernels.ptx from src/p2p/kernels.cu with NVRTC (pip install nvidia-cuda-nvrtc-cu12).
# Usage, from the repository root: python3 scripts/regen-p2p-ptx.py [path/to/libnvrtc.so.12]
import ctypes, re, sys
lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else 'libnvrtc.so.12')
src = open('src/p2p/kernels.cu','rb').read()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"gd_p2p.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=compute_70", b"--std=c++17"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)); log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log); print(log.value.decode(), file=sys.stderr)
assert rc == 0, rc
lib.nvrtcGetPTXSize(prog, ctypes.byref(n)); ptx = ctypes.create_string_buffer(n.value); lib.nvrtcGetPTX(prog, ptx)
text = re.sub(r'^\.version .*$', '.version 7.0', ptx.value.decode(), count=1, flags=re.M)
open('src/p2p/kernels.ptx', 'w').write(text)
