"""Tests for swap: every implementation exchanges x and y bit for bit.

Run with `python test.py` (or `nox -s swap` from the top). Without a GPU, torch runs on the CPU,
Triton under its interpreter, and the CuTe kernel is compiled for sm_90a and its PTX checked;
launching it needs the GPU, and those tests say so when they skip.
"""

import json
import os
import random
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

# --- 1. Set-up and the bound model: bitwise equality (README.md, "The error bound") ---

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
SIZES = [0, 1, 2, 3, 7, 31, 127, 128, 129, 1023, 1025, 4095, 4096, 4097, 8191, 8193, 65537]


def entry_point(name):
    """The implementation's swap. CuTe's can be called without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl.swap if name == "cute" else modules[name].swap


def implementation(name):
    """The implementation's swap, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return entry_point(name)


def random_vector(n, dtype, step=1):
    return torch.randn(n * step, device=DEVICE).to(dtype)[::step]


def alias(t):
    """The elements of t through a second storage that starts at t's first element, as DLPack
    imports and numpy views make them: unless t starts its own storage, a check by storage
    identity misses that the two share memory."""
    other = torch.from_dlpack(t)
    assert other.untyped_storage().data_ptr() == t.data_ptr()
    return other


def poisoned(n, dtype, step, margin=64):
    """A view of n random elements inside a buffer filled with NaN, and the mask of the rest."""
    buffer = torch.full((2 * margin + n * step,), float("nan"), device=DEVICE, dtype=dtype)
    view = buffer[margin : margin + n * step : step]
    view.copy_(random_vector(n, dtype))
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[margin : margin + n * step : step] = False
    return buffer, view, outside


def test_negative_control():
    """The bitwise check rejects a swap that left one element of y unexchanged."""
    x, y = random_vector(1000, torch.float16), random_vector(1000, torch.float16)
    wrong_y = x.clone()
    wrong_y[999] = y[999]
    with pytest.raises(AssertionError, match="1 of 1000 elements differ"):
        assert_same_bits(wrong_y, x)


# --- 2. The contract, over every implementation ---


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(impl, dtype, n):
    swap = implementation(impl)
    x, y = random_vector(n, dtype), random_vector(n, dtype)
    new_x, new_y = reference.swap(x.cpu(), y.cpu())
    result = swap(x, y)
    assert result[0] is x and result[1] is y
    assert_matches_rounded(x, new_x, "x")
    assert_matches_rounded(y, new_y, "y")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step_x, step_y", [(1, 3), (2, 1), (5, 7)])
def test_strided_inside_guard(impl, dtype, step_x, step_y):
    """Both operands strided views in NaN-filled buffers: every element of each is exchanged and
    nothing between or around them is touched."""
    swap = implementation(impl)
    n = 4097
    buffer_x, x, outside_x = poisoned(n, dtype, step_x)
    buffer_y, y, outside_y = poisoned(n, dtype, step_y)
    old_x, old_y = x.clone(), y.clone()
    swap(x, y)
    assert_same_bits(x, old_y, "x")
    assert_same_bits(y, old_x, "y")
    assert buffer_x[outside_x].isnan().all(), "an element outside x was written"
    assert buffer_y[outside_y].isnan().all(), "an element outside y was written"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_and_repeatability(impl, dtype):
    """NaN, infinities, signed zeros and subnormals travel unchanged; swapping twice restores."""
    swap = implementation(impl)
    tiny = torch.finfo(dtype).tiny
    special = torch.tensor([float("nan"), float("inf"), -0.0, tiny / 4], dtype=dtype)
    x, y = random_vector(3001, dtype), random_vector(3001, dtype)
    x[:4], y[-4:] = special.to(DEVICE), special.to(DEVICE)
    old_x, old_y = x.clone(), y.clone()
    swap(x, y)
    assert_same_bits(x, old_y, "x")
    assert_same_bits(y, old_x, "y")
    swap(x, y)
    assert_same_bits(x, old_x, "x after two swaps")
    assert_same_bits(y, old_y, "y after two swaps")


@pytest.mark.parametrize("impl", IMPLS)
def test_swap_with_itself_and_interleaved(impl):
    """swap(x, x) changes nothing; the even and odd elements of one buffer exchange cleanly."""
    swap = implementation(impl)
    x = random_vector(1000, torch.float32)
    before = x.clone()
    swap(x, x)
    assert_same_bits(x, before)
    evens, odds = x[0::2], x[1::2]
    swap(evens, odds)
    assert_same_bits(evens, before[1::2], "evens")
    assert_same_bits(odds, before[0::2], "odds")


@pytest.mark.parametrize("impl", IMPLS)
def test_swap_with_itself_through_another_storage(impl):
    """y the very same elements as x through another storage: 'same', nothing changes."""
    swap = implementation(impl)
    x = random_vector(2001, torch.float32)[1::2]
    y = alias(x)
    before = x.clone()
    assert reference.overlap(x, y) == "same"
    swap(x, y)
    assert_same_bits(x, before, "x")
    assert_same_bits(y, before, "y")


def bad_inputs():
    """(x, y, expected error, words the message must contain)"""
    f32 = lambda n: torch.randn(n, device=DEVICE)  # noqa: E731
    buffer = f32(20)
    yield [1.0, 2.0], f32(2), TypeError, "x must be a torch.Tensor"
    yield f32(4), f32(4).reshape(2, 2), ValueError, "y must be a 1-D"
    yield f32(4), f32(5), ValueError, "5 elements"
    yield f32(4).double(), f32(4).double(), TypeError, "supported"
    yield f32(4), f32(4).bfloat16(), TypeError, "does not convert"
    yield f32(1).expand(4), f32(4), ValueError, "x has stride 0"
    yield buffer[0:10], buffer[5:15], ValueError, "partially overlap"
    yield buffer[0:10], alias(buffer[5:15]), ValueError, "x and y partially"
    if ON_GPU:
        yield f32(4), torch.randn(4), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[3])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    swap = entry_point(impl)
    x, y, error, words = case
    before = y.clone()
    with pytest.raises(error, match=words):
        swap(x, y)
    assert_same_bits(y, before, "y after a rejected call")


def small_view(buffer, step):
    """A random view of buffer (start 0..8, length 0..6), half of them through another storage."""
    view = buffer.as_strided((random.randrange(7),), (step,), random.randrange(9))
    return torch.from_dlpack(view) if random.random() < 0.5 else view


def element_offsets(view, buffer):
    """Where view's elements sit in buffer, in order, judged by their addresses."""
    first = (view.data_ptr() - buffer.data_ptr()) // view.element_size()
    return [first + i * view.stride(0) for i in range(view.numel())]


def test_overlap_against_brute_force():
    """reference.overlap against the memory two small random views cover: 'none' means no
    element in common, 'same' the same addresses in the same order, and two views of one
    step > 0 that share no element (interleaved ones) are exactly 'none'."""
    buffer, seen = random_vector(64, torch.float32), set()
    for _ in range(5000):
        step = random.randrange(5)
        a = small_view(buffer, step)
        b = small_view(buffer, random.choice([step, random.randrange(5)]))
        answer = reference.overlap(a, b)
        at_a, at_b = element_offsets(a, buffer), element_offsets(b, buffer)
        disjoint = not set(at_a) & set(at_b)  # float32 views of one buffer: whole elements
        where = f"{answer} for elements {at_a} and {at_b}, steps {a.stride(0)} and {b.stride(0)}"
        assert answer != "none" or disjoint, where
        assert answer != "same" or at_a == at_b, where
        if 0 < a.stride(0) == b.stride(0) and disjoint:
            assert answer == "none", where
        seen.add(answer)
    assert seen == {"none", "same", "partial"}


# --- 3. Triton-specific: the kernel outside test.py ---


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = {}
for dtype in (torch.bfloat16, torch.float32):
    x, y = torch.randn(2, 5000).to(dtype)
    call = {"x": x.tolist(), "y": y.tolist()}
    triton_impl.swap(x, y)
    calls[str(dtype)] = {**call, "x after": x.tolist(), "y after": y.tolist()}
print(json.dumps(calls))
"""


def test_triton_kernel_runs_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included, no test.py, no common/) runs the kernel on CPU tensors, bfloat16 and float32,
    and x and y trade their bits: the README's laptop command works."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_CALL], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for dtype, call in json.loads(child.stdout).items():
        dtype = getattr(torch, dtype.removeprefix("torch."))
        x, y, x_after, y_after = (
            torch.tensor(call[name], dtype=dtype) for name in ("x", "y", "x after", "y after")
        )
        assert_same_bits(x_after, y, f"{dtype} x")
        assert_same_bits(y_after, x, f"{dtype} y")


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
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph (as a decode loop would run it), the call replays on fresh data
    with the bits of an eager call: the launcher works on the stream torch has current and does
    nothing outside it that a capture would miss."""
    swap = implementation(impl)
    x, y = random_vector(4099, dtype), random_vector(4099, dtype)
    swap(x, y)  # the first call compiles and loads the kernel, which a capture cannot
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        swap(x, y)
    x.copy_(random_vector(4099, dtype))
    y.copy_(random_vector(4099, dtype))
    eager_x, eager_y = x.clone(), y.clone()
    graph.replay()
    swap(eager_x, eager_y)
    torch.cuda.synchronize()
    assert_same_bits(x, eager_x, "x")
    assert_same_bits(y, eager_y, "y")


@pytest.mark.skipif(not ON_GPU, reason="2**31 elements need a GPU (16 GiB with the copies)")
@pytest.mark.parametrize("impl", IMPLS)
def test_more_than_2_to_31_elements(impl):
    """Offsets past 2**31 elements: a 32-bit index would wrap and exchange the start twice."""
    swap = implementation(impl)
    n = 2**31 + 5
    x = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    old_x, old_y = x.clone(), y.clone()
    swap(x, y)
    assert torch.equal(x.view(torch.int16), old_y.view(torch.int16))
    assert torch.equal(y.view(torch.int16), old_x.view(torch.int16))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
