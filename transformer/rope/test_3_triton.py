"""RoPE tests, section (3): the Triton build for sm_90 and its PTX, a fresh interpreter.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test import HERE, ON_GPU, rope_bounds

import reference
from common.tolerance import assert_within_bound

# (3) Triton: the build for sm_90 and its PTX ----------------------------------------------------

# A child process: under TRITON_INTERPRET=1 the kernel cannot be compiled. The launch's own
# specialisation: unit strides as constants, the rest divisible by 16 (D = 128, bfloat16).
TRITON_PTX_SCRIPT = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl as t

kernel, names = t.rope_kernel, [p.name for p in t.rope_kernel.params]
units = {n: 1 for n in names if n.startswith("stride") and n[-1] in "dif"}
for table in (False, True):
    for interleaved in (False, True):
        consts = dict(units, HEADS=8, HALF_BLOCK=64, TABLE=table, POSITIONS=True,
                      INTERLEAVED=interleaved, INVERSE=False)
        kinds = {n: "constexpr" if n in consts else "*i64" if n == "pos_ptr" else
                 "*fp32" if n in ("cos_ptr", "sin_ptr", "freq_ptr") else
                 "*bf16" if n.endswith("_ptr") else "i64" for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if kinds[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride")
                                                 or n == "half")}
        built = triton.compile(ASTSource(kernel, kinds, {(names.index(n),): v for n, v in
                               consts.items()}, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 2})
        ptx = built.asm["ptx"]
        print(table, interleaved, len(re.findall(r"ld\\.global[.\\w]*\\.v4", ptx)),
              len(re.findall(r"st\\.global[.\\w]*\\.v4", ptx)), "cos.approx" in ptx,
              len(re.findall(r"bar\\.sync", ptx)))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the contract tests launch the kernel")
def test_triton_ptx_has_128_bit_loads():
    """The kernel builds for sm_90 in every variant; with D = 128 in bfloat16 every thread moves
    its part of each half with one 16-byte load and one 16-byte store (two per branch, q and
    k), and cos/sin are libdevice's full-range ones, not cos.approx. With rotate-half a table's
    row is read in the heads' layout, 8 values of cos and of sin a thread, and needs no barrier
    (README.md, tuning log); computed angles and interleaved's are moved through shared memory."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", TRITON_PTX_SCRIPT], cwd=HERE, env=env,
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    for line in child.stdout.split("\n")[:-1]:
        table, interleaved, loads, stores, approx, barriers = line.split()
        row_layout = table == "True" and interleaved == "False"
        table_loads = 8 if row_layout else 0  # float32 cos and sin: 32 bytes a thread per branch
        assert (int(loads), int(stores), approx) == (4 + table_loads, 4, "False"), line
        assert (barriers == "0") == row_layout, line


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    q, dq, k, dk = (torch.randn(2, 5, h, 8).to(dtype) for h in (3, 3, 1, 1))
    theta = torch.rand(5, 4) * 6.28  # a (positions, D/2) table of angles in [0, 2 pi)
    angles = dict(cos=theta.cos(), sin=theta.sin())
    q_out, k_out = triton_impl.rope_forward(q, k, torch.empty_like(q), torch.empty_like(k),
                                            **angles)
    dq_out, dk_out = triton_impl.rope_backward(dq, dk, torch.empty_like(q), torch.empty_like(k),
                                               **angles)
    outputs = dict(q=q, k=k, dq=dq, dk=dk, q_out=q_out, k_out=k_out, dq_out=dq_out, dk_out=dk_out)
    calls.append({name: (str(t.dtype), t.tolist()) for name, t in {**outputs, **angles}.items()})
print(json.dumps(calls))
"""


def fresh_interpreter_calls(script):
    """Run script in a fresh process under TRITON_INTERPRET=1 in this folder (no test.py, no
    common/); returns its printed calls, each a {name: tensor} dict rebuilt with its dtype."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", script], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return [
        {name: torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")))
         for name, (dtype, values) in call.items()}
        for call in json.loads(child.stdout)
    ]  # fmt: skip


def test_triton_kernels_run_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included) runs the forward and the backward on CPU tensors, bfloat16 and float32,
    within their bounds: the README's laptop command works."""
    for t in fresh_interpreter_calls(FRESH_CALL):
        angles = {"cos": t["cos"], "sin": t["sin"]}
        for direction, (a, b) in (("forward", ("q", "k")), ("backward", ("dq", "dk"))):
            exact = getattr(reference, f"rope_{direction}")(t[a], t[b], **angles)
            for name, want in zip((a, b), exact, strict=True):
                bound = rope_bounds(t[name], want, angles, None, False, "bshd")
                assert_within_bound(t[f"{name}_out"], want, bound, f"fresh {direction} {name}")
