"""geru tests, section (3): Triton's builds (the interpreter outside test.py, the PTX).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from test import (
    DEVICE,
    DTYPES,
    HERE,
    MARGIN,
    assert_within_bound,
    error_bound,
    view_in,
)

import reference
import triton_impl

# ---------------------------------------------------------------------------------------------
# 3. Triton's builds: the interpreter outside test.py, the PTX of both orientations

# A learner's call outside test.py: a fresh Python in this folder, TRITON_INTERPRET=1, no test.py
# set-up. It loads the operands test.py saved, runs triton_impl.geru on them in place and saves
# them back: triton_impl itself must make Triton 3.6's interpreter work under numpy 2.4.
FRESH_INTERPRETER_SCRIPT = """
import sys
import torch
import triton_impl
calls = torch.load(sys.argv[1])
for alpha, x, y, A in calls:
    triton_impl.geru(alpha, x, y, A)
torch.save(calls, sys.argv[1])
"""


def test_triton_in_a_fresh_interpreter(tmp_path):
    """triton_impl.geru runs on CPU tensors in a fresh interpreter process and lands within its
    bound: float32 row-major and bfloat16 column-major (exact bfloat16 conversions), each with
    full and edge tiles."""
    calls = []
    for m, n, dtype, layout in [(19, 517, torch.float32, "row"), (517, 19, torch.bfloat16, "col")]:
        A = view_in(torch.randn(m * n + 2 * MARGIN).to(dtype), m, n, layout)
        calls.append((0.3, torch.randn(m).to(dtype), torch.randn(n).to(dtype), A))
    path = tmp_path / "calls.pt"
    torch.save(calls, path)
    env = os.environ | {"TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_INTERPRETER_SCRIPT, str(path)],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    for (alpha, x, y, A), (_, _, _, A_hat) in zip(calls, torch.load(path), strict=True):
        exact = reference.geru(alpha, x, y, A)
        bound = error_bound("triton", alpha, x, y, exact)
        assert_within_bound(A_hat, exact, bound, f"fresh interpreter {A.dtype}")


TRITON_BUILDS = [
    (dtype, rows_contiguous, sizes_divisible)
    for dtype in DTYPES
    for rows_contiguous in (True, False)
    for sizes_divisible in (True, False)
]


@functools.cache
def triton_ptx():
    """{build: PTX} from triton_impl.ptx_of for every build. The interpreter's @triton.jit
    functions cannot be compiled, so under TRITON_INTERPRET=1 one fresh Python without it
    compiles them all."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return {build: triton_impl.ptx_of(*build) for build in TRITON_BUILDS}
    builds = [(str(dtype)[6:], rows, divisible) for dtype, rows, divisible in TRITON_BUILDS]
    program = (
        "import json, torch, triton_impl\n"
        f"builds = [(getattr(torch, d), r, s) for d, r, s in {builds}]\n"
        "print(json.dumps([triton_impl.ptx_of(*build) for build in builds]))"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return dict(zip(TRITON_BUILDS, json.loads(done.stdout), strict=True))


@pytest.mark.parametrize("build", TRITON_BUILDS, ids=lambda b: f"{b[0]}-rows{b[1]}-div16{b[2]}")
def test_triton_ptx(build):
    """One source, both orientations: 128-bit loads and stores of A, and the FMA. With m and n
    multiples of 16 every tile has them; otherwise the unmasked full tiles still do."""
    ptx = triton_ptx()[build]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert "fma.rn.f32" in ptx


@triton.jit
def whole_tile_probe(out_ptr, first_tile_m, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[p] = is_whole_tile(first_tile_m + p, 0, ...): tile indices in 32 bits, as geru_kernel's
    (program_id(0) % tiles_along)."""
    tile_m, tile_n = tl.program_id(0) + first_tile_m, tl.program_id(1)
    whole = triton_impl.is_whole_tile(tile_m, tile_n, m, n, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + tl.program_id(0), whole.to(tl.int32))


@pytest.mark.parametrize("m", [2**31 - 1, 2**31 + 100])
def test_whole_tile_near_2_to_31(m):
    """The last tile rows of an A of about 2**31 rows (column-major bfloat16: 512-row tiles):
    the tile ending at row 2**31 is whole only if m reaches it, the one after never; (tile + 1)
    * BLOCK_M in 32 bits wraps to -2**31 there and called both whole, so the kernel updated
    them without a mask, past A's last row. 2**31 - 1 rows is a 32-bit m, 2**31 + 100 a 64-bit
    one."""
    block_m, block_n = triton_impl.TILES[torch.bfloat16, False][:2]
    last_within = 2**31 // block_m - 1  # the tile that ends at row 2**31
    whole = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    whole_tile_probe[(3, 1)](whole, last_within - 1, m, block_n, block_m, block_n)
    assert whole.tolist() == [1, int(m >= 2**31), 0]


def test_specialisation_is_tritons():
    """triton_impl.specialisation(), which keys the direct launches (`launch`), tells two ints,
    or two tensors, apart exactly when Triton's binder (native_specialize_impl, for sm_90) does:
    1, multiples of 16 and not, on both sides of 2**31; each dtype at addresses 16-byte aligned
    and not. A key that missed one of these would launch a kernel compiled for another."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    ints = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 16, 2**62]
    buffer = torch.empty(64, device=DEVICE)
    tensors = [buffer.to(dtype)[offset:] for dtype in DTYPES for offset in (0, 1, 4, 8)]
    for values, ours in [
        (ints, lambda x: triton_impl.specialisation((x,), ())),
        (tensors, lambda t: triton_impl.specialisation((), (t,))),
    ]:
        theirs = lambda x: native_specialize_impl(backend, x, False, True, True)  # noqa: E731
        for x in values:
            for y in values:
                assert (ours(x) == ours(y)) == (theirs(x) == theirs(y)), (x, y)
