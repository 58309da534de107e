"""What a kernel's hot loops compile to, without a GPU: nvcc builds one template instance of a cuda/
module for sm_90a, cuobjdump (with nvdisasm) prints its SASS, and this lists every loop (a backward
branch) with its instruction count and the units it uses, and every named-barrier window (bar.sync to
the next bar.arrive: the attention's turns, which the warpgroups queue on). With --ref COMMIT the same
instance of that commit's sources is listed beside it, so a change's cost shows before device time is
spent on it.

    python tools/sass_loops.py attention_sm90 "flash_fwd_sm90<4, 4>" [--ref COMMIT]

Needs nvcc, and cuobjdump + nvdisasm on PATH (or CUDA_BIN): not in every CUDA install; the
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels carry them (pip download, unzip, bin/).
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = ("HGMMA", "MUFU", "FFMA", "FADD", "FMUL", "FMNMX", "F2FP", "SHFL", "LDS", "R2UR", "BAR", "SYNCS")


def tool(name):
    path = shutil.which(name, path=os.environ.get("CUDA_BIN", "") + os.pathsep + os.environ.get("PATH", ""))
    if path is None:
        sys.exit(f"{name} not found on PATH or CUDA_BIN: see this script's docstring for where to get it")
    return path


def sass(cuda_dir, module, instance):
    """The SASS text of `instance` (a kernel template instance) of cuda_dir/module.cu."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "instance.cu")
        with open(src, "w") as f:  # taking the instance's address makes nvcc instantiate it
            f.write(f'#include "{module}.cu"\nvoid* instance_address() {{ return (void*)&{instance}; }}\n')
        cubin = os.path.join(tmp, "k.cubin")
        r = subprocess.run([tool("nvcc"), "-arch=sm_90a", "-cubin", "-std=c++17", f"-I{cuda_dir}", "-o", cubin, src],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"nvcc could not build {instance} of {cuda_dir}/{module}.cu:\n{r.stderr}")
        env = dict(os.environ, PATH=os.path.dirname(tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
        return subprocess.run([tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True, text=True,
                              env=env).stdout


def instructions(text):
    """[(address, instruction text)] in order."""
    out = []
    for ln in text.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(ins):
    toks = ins.split()
    return toks[1] if toks[0].startswith("@") else toks[0]


def report(name, text):
    ins = instructions(text)
    print(f"\n{name}: {len(ins)} instructions")
    loops = []
    for a, i in ins:
        m = re.match(r"@!?U?P\w+\s+BRA\s+(0x[0-9a-f]+)", i)
        if m and int(m.group(1), 16) < a:  # a conditional backward branch closes a loop (an mbarrier
            # wait's retry stub, placed after the function's body, jumps back unconditionally)
            body = [opcode(x) for b, x in ins if int(m.group(1), 16) <= b <= a]
            loops.append((int(m.group(1), 16), a, body))
    # The hot loops: those with MMAs or exps and no smaller such loop inside.
    hot = [lp for lp in loops if any(o.startswith(("HGMMA", "MUFU", "HMMA")) for o in lp[2])]
    hot = [lp for lp in hot if not any(q is not lp and lp[0] <= q[0] and q[1] <= lp[1] for q in hot)]
    print("| hot loop (start-end) | instructions | " + " | ".join(UNITS) + " |")
    print("|---|---|" + "---|" * len(UNITS))
    for start, end, body in hot:
        count = collections.Counter(o.split(".")[0] for o in body)
        print(f"| {start:#06x}-{end:#06x} | {len(body)} | " + " | ".join(str(count[u]) for u in UNITS) + " |")
    windows = []
    for k, (a, i) in enumerate(ins):
        if opcode(i).startswith("BAR.SYNC") and not i.endswith(" 0x0"):  # not __syncthreads
            end = next((j for j in range(k + 1, len(ins)) if opcode(ins[j][1]).startswith("BAR.ARV")), None)
            if end is not None:
                windows.append(f"{a:#06x}: {end - k} instructions")
    if windows:
        print("named-barrier windows (bar.sync to the next bar.arrive): " + "; ".join(windows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module")
    ap.add_argument("instance")
    ap.add_argument("--ref", help="a commit whose cuda/ sources to list beside this tree's")
    args = ap.parse_args()
    report(f"{args.instance} (this tree)", sass(os.path.join(ROOT, "cuda"), args.module, args.instance))
    if args.ref:
        with tempfile.TemporaryDirectory() as tmp:
            files = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", args.ref, "cuda/"], check=True,
                                   capture_output=True, text=True).stdout.split()
            for f in files:
                with open(os.path.join(tmp, os.path.basename(f)), "w") as out:
                    out.write(subprocess.run(["git", "-C", ROOT, "show", f"{args.ref}:{f}"], check=True,
                                             capture_output=True, text=True).stdout)
            report(f"{args.instance} ({args.ref})", sass(tmp, args.module, args.instance))


if __name__ == "__main__":
    main()
