"""Probe: static SASS instruction counts of the top-k selection's sweep loops, compiled for sm_90
on a machine without a GPU (Triton's own ptxas and cuobjdump).

Run with the Triton of the GPU machine first on the path (PYTHONPATH=TRITON_DIR python
benchmarks/probes/sass_loops.py OUT). Each loop is a backward branch of the SASS; per loop: its
instructions, their opcodes, and instructions per score (tile scores / threads per iteration).
Pointers and N, M are compiled as 16-divisible, as Triton specialises them at launch."""

import collections
import json
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparsefocus.kernels import topk_select as ts

COMMON = dict(D=64, CAUSAL=True, HAS_PAD=False, PRECISION="tf32", BLOCK_D=64)
KERNELS = {
    "bound": (
        ts._bound_kernel,
        {"Q": "*bf16", "K": "*bf16", "PAD": "*i32", "BOUND": "*fp32", "N": "i32", "M": "i32", "HQ": "i32", "GROUP": "i32"},
        dict(COMMON, KK=32, TOP=1, STEPS=16, BLOCK_M=64, BLOCK_N=128),
    ),
    "collect": (
        ts._collect_kernel,
        {
            "Q": "*bf16",
            "K": "*bf16",
            "PAD": "*i32",
            "BOUND": "*fp32",
            "NENT": "*i32",
            "ENT": "*i64",
            "N": "i32",
            "M": "i32",
            "HQ": "i32",
            "GROUP": "i32",
        },
        dict(COMMON, CAP=64, BLOCK_M=64, BLOCK_N=32, ASM=True),
    ),
}


def sass(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> tuple[str, str]:
    names = list(signature) + list(constexprs)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*") or n in ("N", "M")}
    src = ASTSource(fn=fn, signature=signature | {n: "constexpr" for n in constexprs}, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    tools = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with open("/tmp/sass_probe.cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    text = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "-sass", "/tmp/sass_probe.cubin"], capture_output=True, text=True
    ).stdout
    usage = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "-res-usage", "/tmp/sass_probe.cubin"], capture_output=True, text=True
    ).stdout
    return text, usage


def loops(text: str) -> list[dict]:
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    found = []
    for addr, op in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            body = [o for a, o in ins if int(m.group(1), 16) <= a <= addr]
            names = collections.Counter((o.split()[1] if o.startswith("@") else o.split()[0]).split(".")[0] for o in body)
            found.append(dict(start=m.group(1), end=hex(addr), instructions=len(body), opcodes=dict(names.most_common())))
    return found


if __name__ == "__main__":
    out = {"triton": triton.__version__, "target": "sm_90 (H100/H200), compiled without a GPU", "kernels": {}}
    for name, (fn, signature, constexprs) in KERNELS.items():
        text, usage = sass(fn, signature, constexprs)
        scores_per_thread = constexprs["BLOCK_M"] * constexprs["BLOCK_N"] / (32 * 4)
        found = loops(text)
        for loop in found:
            loop["instructions_per_score"] = round(loop["instructions"] / scores_per_thread, 2)
        regs = re.search(r"REG:(\d+)", usage)
        out["kernels"][name] = dict(
            constexprs=constexprs,
            scores_per_thread_per_iteration=scores_per_thread,
            registers=int(regs.group(1)) if regs else None,
            loops=found,
        )
        print(
            name,
            "registers",
            out["kernels"][name]["registers"],
            [(x["instructions"], x["instructions_per_score"]) for x in found],
        )
    with open(os.path.join(sys.argv[1], "sass_loops.json"), "w") as f:
        json.dump(out, f, indent=1)
