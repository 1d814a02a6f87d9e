#!/usr/bin/env python3
"""sass.py — a kernel module's SASS without a GPU: NVRTC (the pip wheel scripts/ci_nvrtc.sh installs)
compiles crates/cuda/kernels/<module>.cu with the prelude, as the backend does, and nvdisasm prints it;
then, per loop (a backward branch), the instruction count and the most frequent opcodes.

  export LD_LIBRARY_PATH=$(scripts/ci_nvrtc.sh | tail -1)
  NVDISASM=/path/to/nvdisasm scripts/sass.py attention sm_90 -DHD=256 -DGQA_GROUP=6 -DPF_BK=32 -DPF_PSPLIT=0 -DPF_HPB=6
  scripts/sass.py w4a16 sm_90 --function w4p_hsh --dump      # the whole listing of one kernel
  scripts/sass.py w4a16 sm_90 --function w4p_hsb --against /tmp/base   # loops vs another checkout's build
  scripts/sass.py w4a16 sm_90 --function w4pf_sb --against /tmp/base --against-function w4p_hsb

nvdisasm: from NVIDIA's `nvidia-cuda-nvdisasm` wheel or a CUDA toolkit (a GPU machine with the CUDA toolkit has one). The
-D defines are the ones `KernelDims::defines` / `AttnTiling::defines` pass (src/nvrtc.rs). It shows, e.g., a
32-bit division per tile in a kernel's loop, or how many instructions the int4 GEMV spends unpacking weights.
--against TREE compiles TREE's kernels too (without the -D defines) and, per loop of each kernel, counts the
instructions a sequence diff of the opcodes (registers, predicates and constants normalised) finds placed
differently: code a kernel never runs can still change ptxas's schedule of another kernel's main loop.
"""
import argparse
import ctypes
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KERNELS = os.path.join("crates", "cuda", "kernels")


def module_files(module, root=ROOT):
    """The kernel files a module's source is made of, in order, as crates/cuda/src/nvrtc/sources.rs
    concatenates them (e.g. w4_tile.cuh then w4_gemm.cu); [module.cu] when it names none."""
    sources = open(os.path.join(root, "crates", "cuda", "src", "nvrtc", "sources.rs")).read()
    m = re.search(r'module:\s*"' + re.escape(module) + r'",(.*?)functions:', sources, flags=re.S)
    files = re.findall(r'include_str!\("\.\./\.\./kernels/([\w.]+)"\)', m.group(1)) if m else []
    return files or [module + ".cu"]


def compile_cubin(module, arch, defines, root=ROOT):
    lib = ctypes.CDLL("libnvrtc.so.13")
    kdir = os.path.join(root, KERNELS)
    parts = [open(os.path.join(kdir, f)).read() for f in ["prelude.cuh"] + module_files(module, root)]
    src = "\n".join(parts)
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
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    return m.group(1).split(".")[0] if m else None


def disassemble(nvdisasm, cubin):
    """{kernel name: listing lines}"""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    funcs = re.split(r"^\.text\.(\w+):", sass, flags=re.M)
    return {name: body.split("\n") for name, body in zip(funcs[1::2], funcs[2::2])}


def loops(lines):
    """Each loop (a backward branch) as its listing lines, in program order."""
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", l.strip()))}
    out = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", l)
        if m and labels.get(m.group(1), i) < i:
            out.append(lines[labels[m.group(1)] : i + 1])
    return out


def normalised(lines):
    out = []
    for l in lines:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", l)
        if m:
            t = re.sub(r"\.L_x_\d+", "L", m.group(1))
            t = re.sub(r"\bU?R\d+\b", "R", t)
            t = re.sub(r"\bU?P\d\b", "P", t)
            out.append(re.sub(r"0x[0-9a-f]+", "K", t))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module")
    ap.add_argument("arch")
    ap.add_argument("--function", help="only this kernel")
    ap.add_argument("--dump", action="store_true", help="print the listing, not the loop summary")
    ap.add_argument("--against", metavar="TREE", help="compare each kernel's loops with TREE's build")
    ap.add_argument("--against-function", metavar="NAME", help="with --function: compare with TREE's NAME")
    args, defines = ap.parse_known_args()
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        sys.exit("no nvdisasm: set NVDISASM (pip install nvidia-cuda-nvdisasm, or a CUDA toolkit's bin/)")
    funcs = disassemble(nvdisasm, compile_cubin(args.module, args.arch, defines))
    other = disassemble(nvdisasm, compile_cubin(args.module, args.arch, [], args.against)) if args.against else {}
    for name, lines in funcs.items():
        if args.function and name != args.function:
            continue
        if args.dump:
            print(f"== {name}")
            print("\n".join(lines))
            continue
        print(f"== {name}: {sum(1 for l in lines if opcode(l))} instructions")
        theirs = loops(other.get(args.against_function or name, []))
        used = set()
        for k, loop in enumerate(loops(lines)):
            ops = [o for o in map(opcode, loop) if o]
            hist = {}
            for o in ops:
                hist[o] = hist.get(o, 0) + 1
            top = ", ".join(f"{k} {v}" for k, v in sorted(hist.items(), key=lambda kv: -kv[1])[:10])
            line = f"  loop of {len(ops)} instructions: {top}"
            # Its counterpart: the first unmatched loop of TREE's kernel with as many instructions.
            match = next((j for j, t in enumerate(theirs) if j not in used and len(normalised(t)) == len(ops)), None)
            if match is not None:
                used.add(match)
                a, b = normalised(theirs[match]), normalised(loop)
                sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
                moved = sum(max(i2 - i1, j2 - j1) for t, i1, i2, j1, j2 in sm.get_opcodes() if t != "equal")
                line += f"; vs {args.against}: {moved} placed differently"
            elif args.against:
                line += f"; no loop of that length in {args.against}"
            print(line)


if __name__ == "__main__":
    main()
