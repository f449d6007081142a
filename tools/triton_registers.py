"""Registers, spills and barriers of a Triton kernel for sm_90a, counted on a machine without a GPU.

    cd transformer/layernorm
    python ../../tools/triton_registers.py triton_impl layernorm_forward_rows_kernel --warps 8 \\
        ROWS=1 BLOCK_N=8192 LOG2_BLOCK_N=13 HAS_WEIGHT=True HAS_BIAS=True

`triton.compile` builds the kernel for an H100/H200 (no driver needed) and ptxas -v reads its
PTX. What ptxas allocates decides how many programs fit an SM (65536 registers a thread's
count times the program's threads, in steps of 8), so it predicts occupancy before a GPU run.
The build must be specialised as the course's launchers are at aligned shapes, or the count
means nothing: without the 16-byte alignment of the pointers and N and the row strides known
to be multiples of 16, Triton issues scalar loads and ptxas reports two to three times the
registers (layernorm/README.md's tuning log was misled so once). So: every pointer is 16-byte
aligned, of --dtype unless named in --float32; `n` and every row stride (`stride_*m`) are
multiples of 16; every column stride (`stride_*n`) and `stride_w` is the constant 1, as the
launcher's specialisation() compiles a unit stride; `eps` and `inv_n` are float32; every int
is an i32 (all are under 2**31 at the sizes timed). --maxnreg caps the registers (Triton's
launch option) to see what a cap would spill.
"""

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

FLOAT_ARGS = ("eps", "inv_n")


def constant(text):
    """NAME=VALUE's value: an int, or True/False."""
    return {"True": True, "False": False}[text] if text in ("True", "False") else int(text)


def signature_of(kernel, dtype, float32_pointers, constants):
    """(signature, constants, names known to be multiples of 16) as the course's launcher
    specialises the kernel at aligned shapes."""
    signature, aligned, constants = {}, [], dict(constants)
    for name, param in zip(kernel.arg_names, kernel.params, strict=True):
        if param.is_constexpr:
            if name not in constants:
                raise SystemExit(f"give the constant {name}=...")
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in float32_pointers else f"*{dtype}"
            aligned.append(name)
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        elif name == "stride_w" or (name.startswith("stride") and name.endswith("n")):
            signature[name], constants[name] = "i32", 1  # a unit stride is compiled in as 1
        elif name == "n" or (name.startswith("stride") and name.endswith("m")):
            signature[name] = "i32"  # under 2**31: the launcher compiles it as an i32
            aligned.append(name)
        else:
            signature[name] = "i32"
    return signature, constants, aligned


def count(kernel, warps, dtype="bf16", float32_pointers=(), constants=None, maxnreg=None):
    """{registers, spill_bytes, barriers, v4_loads} of the sm_90a build, from ptxas -v."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, aligned = signature_of(kernel, dtype, float32_pointers, constants or {})
    attrs = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in aligned
        if name not in constants
    }
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        run = subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True
        )
    if run.returncode:
        raise RuntimeError(run.stderr)
    return {
        "registers": int(re.search(r"Used (\d+) registers", run.stderr).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", run.stderr).group(1)),
        "barriers": ptx.count("bar.sync"),
        "v4_loads": ptx.count("ld.global.v4"),
    }


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help="the kernel's module, imported from the current folder")
    parser.add_argument("kernel", help="the @triton.jit function's name")
    parser.add_argument("constants", nargs="*", help="NAME=VALUE of every tl.constexpr")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--dtype", default="bf16", help="the pointers' element type (Triton's)")
    parser.add_argument("--float32", default="", help="comma-separated float32 pointers")
    parser.add_argument("--maxnreg", type=int, default=None)
    args = parser.parse_intermixed_args(argv)
    sys.path.insert(0, os.getcwd())
    kernel = getattr(importlib.import_module(args.module), args.kernel)
    constants = {k: constant(v) for k, v in (c.split("=", 1) for c in args.constants)}
    counts = count(kernel, args.warps, args.dtype, args.float32.split(","), constants,
                   args.maxnreg)  # fmt: skip
    print(" ".join(f"{k}={v}" for k, v in counts.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
