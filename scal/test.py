"""Tests for scal: every implementation agrees bit for bit with the definition in reference.py.

Run with `python test.py` (or `nox -s scal` from the top). Without a GPU, torch runs on the CPU,
Triton under its interpreter, and the CuTe kernel is compiled for sm_90a and its PTX checked;
launching it needs the GPU, and those tests say so when they skip.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import reference
import torch_impl
import triton_impl

try:
    from common.tolerance import assert_matches_rounded, assert_same_bits
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not beside "
        f"this folder: copy the course's common/ folder beside it, to {HERE.parent / 'common'}"
    ) from error

try:
    import cute_impl
except ImportError as error:  # the CuTe DSL is absent: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"the CuTe DSL is not installed ({error})"

# --- 1. Set-up and the bound model: the reference's two roundings, bit for bit ---

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
SIZES = [0, 1, 2, 3, 7, 31, 127, 128, 129, 1023, 1025, 4095, 4096, 4097, 8191, 8193, 65537]
ALPHAS = [0.3, -2.5, 1.0, 1e-3, 3.0e38]  # 0.3 and 1e-3 are not float32 numbers; 3e38 overflows


def entry_point(name):
    """The implementation's scal. CuTe's can be called without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl.scal if name == "cute" else modules[name].scal


def implementation(name):
    """The implementation's scal, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return entry_point(name)


def random_vector(n, dtype, step=1):
    return torch.randn(n * step, device=DEVICE).to(dtype)[::step]


def test_reference_rounds_like_float32():
    """The reference's one rounding is float32's: checked against torch's float32 multiply."""
    y = random_vector(10000, torch.float32)
    assert_same_bits(reference.scal(0.3, y.cpu()).float(), y.cpu() * 0.3)


def test_negative_control():
    """The bitwise check rejects a result off by one unit in the last place, and an element
    taken from its neighbour."""
    y = random_vector(1000, torch.bfloat16)
    # Elements 500 and 501 apart: two of random_vector's bfloat16 values were equal in 31 of
    # 20000 draws (8 bits of significand), and then the neighbour control would pass.
    y[500], y[501] = 1.0, -1.0
    expected = reference.scal(0.3, y.cpu())
    one_ulp_off = expected.to(torch.bfloat16)
    one_ulp_off.view(torch.int16)[10] += 1  # the next bfloat16 away from zero
    with pytest.raises(AssertionError, match="1 of 1000 elements differ"):
        assert_matches_rounded(one_ulp_off, expected)
    neighbour = expected.to(torch.bfloat16)
    neighbour[500] = neighbour[501]
    with pytest.raises(AssertionError, match="differ"):
        assert_matches_rounded(neighbour, expected)


# --- 2. The contract, over every implementation ---


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(impl, dtype, n):
    scal = implementation(impl)
    for alpha in ALPHAS:
        y = random_vector(n, dtype)
        expected = reference.scal(alpha, y.cpu())
        assert scal(alpha, y) is y
        assert_matches_rounded(y, expected, f"alpha={alpha}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step", [2, 7])
def test_strided_inside_guard(impl, dtype, step):
    """y a strided view in a NaN-filled buffer: every element of y is scaled, nothing else moves."""
    scal = implementation(impl)
    n, margin = 4097, 64
    buffer = torch.full((2 * margin + n * step,), float("nan"), device=DEVICE, dtype=dtype)
    y = buffer[margin : margin + n * step : step]
    y.copy_(random_vector(n, dtype))
    expected = reference.scal(-0.7, y.cpu())
    scal(-0.7, y)
    assert_matches_rounded(y, expected)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[margin : margin + n * step : step] = False
    assert buffer[untouched].isnan().all(), "an element outside y was written"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_and_repeatability(impl, dtype):
    """NaN and infinities propagate, subnormals are not flushed, signed zeros keep IEEE signs,
    and two runs give the same bits."""
    scal = implementation(impl)
    tiny = torch.finfo(dtype).tiny
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, tiny / 4, -tiny, 3 * tiny]
    y = random_vector(3001, dtype)
    y[: len(special)] = torch.tensor(special, dtype=dtype, device=DEVICE)
    expected = reference.scal(-0.75, y.cpu())
    first, second = scal(-0.75, y.clone()), scal(-0.75, y.clone())
    assert_matches_rounded(first, expected)
    assert_same_bits(second, first)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha", [0.0, 1e-50, -1e-46])
def test_alpha_zero_does_not_read_y(impl, dtype, alpha):
    """alpha32 == 0 writes +0 without reading y: alpha 0, or one that rounds to 0 (or -0) in
    float32."""
    scal = implementation(impl)
    y = random_vector(5000, dtype)
    y[::3] = float("nan")
    y[1::3] = float("inf")
    expected = reference.scal(alpha, y.cpu())
    scal(alpha, y)
    assert_matches_rounded(y, expected)  # +0 everywhere


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha, scale", [(1e5, 1e-2), (1e-8, 1e4), (3e-8, 1e4), (-1e-6, 1e3)])
def test_alpha_a_16_bit_type_cannot_hold(impl, dtype, alpha, scale):
    """alphas float16 cannot hold (1e5 overflows it, the others are subnormal or 0 there), on
    y scaled so the results stay inside its range: still float32's alpha, bit for bit."""
    scal = implementation(impl)
    y = (random_vector(4097, torch.float32) * scale).to(dtype)
    expected = reference.scal(alpha, y.cpu())
    scal(alpha, y)
    assert_matches_rounded(y, expected, f"alpha={alpha}")


def bad_inputs():
    """(alpha, y, expected error, words the message must contain)"""
    f32 = torch.randn(4, device=DEVICE)
    yield 2.0, [1.0, 2.0], TypeError, "y must be a torch.Tensor"
    yield torch.tensor(2.0), f32, TypeError, "alpha must be a real"
    yield 1j, f32, TypeError, "alpha must be a real"
    yield 10**400, f32, ValueError, "alpha is beyond the range"
    yield 2.0, f32.reshape(2, 2), ValueError, "y must be a 1-D"
    yield 2.0, f32.double(), TypeError, "supported"
    yield 2.0, f32.to(torch.int32), TypeError, "supported"
    yield 2.0, f32[:1].expand(4), ValueError, "stride 0"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[3])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    scal = entry_point(impl)
    alpha, y, error, words = case
    before = y.clone() if isinstance(y, torch.Tensor) else None
    with pytest.raises(error, match=words):
        scal(alpha, y)
    if before is not None:
        assert_same_bits(y, before, "y after a rejected call")


# --- 3. Triton-specific: the kernel outside test.py ---


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = {}
for dtype in (torch.bfloat16, torch.float32):
    y = torch.randn(5000).to(dtype)
    calls[str(dtype)] = {"y": y.tolist(), "alpha * y": triton_impl.scal(0.3, y).tolist()}
print(json.dumps(calls))
"""


def test_triton_kernel_runs_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included, no test.py, no common/) runs the kernel on CPU tensors, bfloat16 and float32,
    and gets the reference's bits: the README's laptop command works. Without the patch, bfloat16
    stores would truncate instead of rounding to nearest even."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_CALL], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for dtype, call in json.loads(child.stdout).items():
        dtype = getattr(torch, dtype.removeprefix("torch."))
        y, scaled = (torch.tensor(call[name], dtype=dtype) for name in ("y", "alpha * y"))
        assert_matches_rounded(scaled, reference.scal(0.3, y), f"{dtype} alpha * y")


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


# --- 4. CuTe: builds and PTX ---


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(dtype):
    """The CuTe kernel builds for sm_90a with 128-bit vector loads and stores on the fast path."""
    vector, scalar = cute_impl.ptx_of(dtype, contiguous=True), cute_impl.ptx_of(dtype, False)
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "ld.global.v4" not in scalar


# --- 5. GPU only: CUDA graphs and sizes past 2**31 ---


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha", [-0.7, 0.0])
def test_cuda_graph_replays_the_eager_call(impl, dtype, alpha):
    """Captured in a CUDA graph (as a decode loop would run it), the call replays on fresh data
    with the bits of an eager call: the launcher works on the stream torch has current and does
    nothing outside it that a capture would miss. alpha 0 captures the build that reads no y."""
    scal = implementation(impl)
    y = random_vector(4099, dtype)
    scal(alpha, y)  # the first call compiles and loads the kernel, which a capture cannot
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scal(alpha, y)
    y.copy_(random_vector(4099, dtype))
    eager = y.clone()
    graph.replay()
    scal(alpha, eager)
    torch.cuda.synchronize()
    assert_same_bits(y, eager)


@pytest.mark.skipif(not ON_GPU, reason="2**31 elements need a GPU (4 GiB of data)")
@pytest.mark.parametrize("impl", IMPLS)
def test_more_than_2_to_31_elements(impl):
    """Offsets past 2**31 elements: a 32-bit index would wrap and scale the start twice."""
    scal = implementation(impl)
    n = 2**31 + 5
    y = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    expected = (y.float() * -0.5).bfloat16()  # exact: halving a bfloat16 needs no rounding
    scal(-0.5, y)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


if __name__ == "__main__":
    sys.exit(
        pytest.main(
            [
                __file__,
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore::RuntimeWarning",
                *sys.argv[1:],
            ]
        )
    )
