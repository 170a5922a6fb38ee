"""Compile a Triton kernel for sm_90 on a GPU-less machine and print the SASS instruction mix of its loop."""
import sys, re, collections
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, ".")
from sparsefocus.kernels import topk_select as ts

def compile_kernel(fn, signature, constexprs, num_warps=4, num_stages=3):
    names = fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*") or n in ("N", "M")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))

def mix(k, name):
    sass = k.asm.get("sass")
    if sass is None:
        import subprocess, tempfile, os
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"]); path = f.name
        nvd = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
        sass = subprocess.run([nvd, "-c", path], capture_output=True, text=True).stdout
    open(f".ab/{name}.sass", "w").write(sass)
    open(f".ab/{name}.ttgir", "w").write(k.asm["ttgir"])
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))
    print(name, "regs", k.n_regs if hasattr(k,'n_regs') else '?', "total", sum(ops.values()))
    print(ops.most_common(40))

common_sig = {}
if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "collect"
    if which == "collect":
        sig = {"Q": "*bf16", "K": "*bf16", "PAD": "*i32", "BOUND": "*fp32", "NENT": "*i32", "ENT": "*i64", "N": "i32", "M": "i32", "HQ": "i32", "GROUP": "i32",
               "D": "constexpr", "CAP": "constexpr", "CAUSAL": "constexpr", "HAS_PAD": "constexpr", "PRECISION": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "ASM": "constexpr"}
        ce = {"D": 64, "CAP": 64, "CAUSAL": True, "HAS_PAD": False, "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 64, "ASM": True}
        k = compile_kernel(getattr(ts, sys.argv[2] if len(sys.argv) > 2 else "_collect_kernel"), sig, ce)
        mix(k, which)
    else:
        sig = {"Q": "*bf16", "K": "*bf16", "PAD": "*i32", "BOUND": "*fp32", "N": "i32", "M": "i32", "HQ": "i32", "GROUP": "i32",
               "D": "constexpr", "KK": "constexpr", "TOP": "constexpr", "STEPS": "constexpr", "CAUSAL": "constexpr", "HAS_PAD": "constexpr", "PRECISION": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "ASM": "constexpr"}
        ce = {"D": 64, "KK": 32, "TOP": 1, "STEPS": 16, "CAUSAL": True, "HAS_PAD": False, "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 64}
        k = compile_kernel(ts._bound_kernel, sig, ce)
        mix(k, which)
