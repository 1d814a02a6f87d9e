#!/usr/bin/env python3
"""sass.py — a kernel module's SASS without a GPU: NVRTC (the pip wheel scripts/ci_nvrtc.sh installs)
compiles crates/cuda/kernels/<module>.cu with the prelude, as the backend does, and nvdisasm prints it;
then, per loop (a backward branch), the instruction count and the most frequent opcodes.

  export LD_LIBRARY_PATH=$(scripts/ci_nvrtc.sh | tail -1)
  NVDISASM=/path/to/nvdisasm scripts/sass.py attention sm_90 -DHD=256 -DGQA_GROUP=6 -DPF_BK=32 -DPF_PSPLIT=0 -DPF_HPB=6
  scripts/sass.py w4a16 sm_90 --function w4p_hsh --dump      # the whole listing of one kernel

nvdisasm: from NVIDIA's `nvidia-cuda-nvdisasm` wheel or a CUDA toolkit (the device machines have one). The
-D defines are the ones `KernelDims::defines` / `AttnTiling::defines` pass (src/nvrtc.rs). Used in session 8
to find a 32-bit division per tile in attn_prefill and to count the int4 GEMV's unpack instructions.
"""
import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "cuda", "kernels")


def compile_cubin(module, arch, defines):
    lib = ctypes.CDLL("libnvrtc.so.13")
    src = open(os.path.join(ROOT, "prelude.cuh")).read() + "\n" + open(os.path.join(ROOT, module + ".cu")).read()
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), (module + ".cu").encode(), 0, None, None)
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--device-as-default-execution-space"] + defines
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    if rc != 0:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"nvrtc failed ({rc}):\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw


def opcode(line):
    m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    return m.group(1).split(".")[0] if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module")
    ap.add_argument("arch")
    ap.add_argument("--function", help="only this kernel")
    ap.add_argument("--dump", action="store_true", help="print the listing, not the loop summary")
    args, defines = ap.parse_known_args()
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        sys.exit("no nvdisasm: set NVDISASM (pip install nvidia-cuda-nvdisasm, or a CUDA toolkit's bin/)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compile_cubin(args.module, args.arch, defines))
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    funcs = re.split(r"^\.text\.(\w+):", sass, flags=re.M)
    for name, body in zip(funcs[1::2], funcs[2::2]):
        if args.function and name != args.function:
            continue
        lines = body.split("\n")
        if args.dump:
            print(f"== {name}")
            print("\n".join(lines))
            continue
        labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", l.strip()))}
        print(f"== {name}: {sum(1 for l in lines if opcode(l))} instructions")
        for i, l in enumerate(lines):
            m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", l)
            if m and labels.get(m.group(1), i) < i:
                ops = [o for o in map(opcode, lines[labels[m.group(1)] : i + 1]) if o]
                hist = {}
                for o in ops:
                    hist[o] = hist.get(o, 0) + 1
                top = ", ".join(f"{k} {v}" for k, v in sorted(hist.items(), key=lambda kv: -kv[1])[:10])
                print(f"  loop of {len(ops)} instructions: {top}")


if __name__ == "__main__":
    main()
