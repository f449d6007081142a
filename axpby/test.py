"""Tests for axpby: every implementation lands within the bound README.md derives.

Run with `python test.py` (or `nox -s axpby` from the top). Without a GPU, torch runs on the CPU,
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
    from common.tolerance import (
        assert_same_bits,
        assert_within_bound,
        gamma,
        store_roundoff,
        underflow,
        unit_roundoff,
    )
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not beside "
        f"this folder: copy the course's common/ folder beside it, to {HERE.parent / 'common'}"
    ) from error

try:
    import cute_impl
except ImportError as error:  # the CuTe DSL is absent: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"the CuTe DSL is not installed ({error})"

# --- 1. Set-up and the bound model: README.md's forward error bound as code ---

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
SIZES = [0, 1, 2, 3, 7, 31, 127, 128, 129, 1023, 1025, 4095, 4096, 4097, 8191, 8193, 65537]
SCALARS = [(0.3, -1.7), (2.0, 0.5), (1.0, 1.0), (-1e-3, 7.0)]


def entry_point(name):
    """The implementation's axpby. CuTe's runs without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl.axpby if name == "cute" else modules[name].axpby


def implementation(name):
    """The implementation's axpby, for tests that launch it."""
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


def error_bound(alpha, x, beta, y, exact):
    """README.md's bound, |y_hat - z| <= u_s|z| + (1 + u_s)(c (|a x| + |b y|) + 2 e) + e_s.

    u_s is the store's unit roundoff (0 for float32 data), c = gamma_2 of float32 for a product
    and the sum; e and e_s are the absolute errors of a float32 and of a storing rounding among
    the subnormals. Every implementation, torch_impl included, makes these roundings and no
    others (torch_impl does its arithmetic on float32 tensors)."""
    u32, u_s = unit_roundoff(torch.float32), store_roundoff(y.dtype)
    c = gamma(2, u32)
    a32, b32 = reference.to_float32(alpha), reference.to_float32(beta)
    zeros = torch.zeros(x.numel(), dtype=torch.float64)
    abs_ax = abs(a32) * x.cpu().double().abs() if a32 != 0 else zeros
    abs_by = abs(b32) * y.cpu().double().abs() if b32 != 0 else zeros
    e, e_s = underflow(torch.float32), underflow(y.dtype)
    return u_s * exact.abs() + (1 + u_s) * (c * (abs_ax + abs_by) + 2 * e) + e_s


def check(impl, alpha, x, beta, y):
    """Run impl on (x, y) and check the result against the reference within the bound."""
    exact = reference.axpby(alpha, x.cpu(), beta, y.cpu())
    bound = error_bound(alpha, x, beta, y, exact)
    result = implementation(impl)(alpha, x, beta, y)
    assert result is y
    assert_within_bound(y, exact, bound, f"{impl} alpha={alpha} beta={beta}")


def test_negative_controls():
    """The bound rejects an element read from its neighbour, and it is tight enough to reject
    one extra rounding in bfloat16: beta*y stored in y's dtype before the add, as eager torch
    does on 16-bit tensors."""
    n, alpha, beta = 10000, 0.3, -1.7
    x, y = random_vector(n, torch.bfloat16).cpu(), random_vector(n, torch.bfloat16).cpu()
    # Elements 500 and 501 far apart (-1.4 and 1.4): with random values they were sometimes
    # within the bound of each other, and the neighbour control passed.
    x[500], y[500], x[501], y[501] = 1.0, 1.0, -1.0, -1.0
    exact = reference.axpby(alpha, x, beta, y)
    fused_bound = error_bound(alpha, x, beta, y, exact)
    neighbour = exact.to(torch.bfloat16)
    neighbour[500] = neighbour[501]
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(neighbour, exact, fused_bound)
    beta_y_stored = (beta * y.float()).bfloat16().float()
    rounded_twice = (reference.to_float32(alpha) * x.float() + beta_y_stored).bfloat16()
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(rounded_twice, exact, fused_bound)


# --- 2. The contract, over every implementation ---


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(impl, dtype, n):
    for alpha, beta in SCALARS:
        check(impl, alpha, random_vector(n, dtype), beta, random_vector(n, dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step_x, step_y", [(3, 1), (1, 2), (5, 7), (0, 1)])
def test_strided_inside_guard(impl, dtype, step_x, step_y):
    """Strided (and stride-0) x, y a strided view in a NaN-filled buffer: every element of y is
    written and nothing between or around them is touched."""
    n, margin = 4097, 64
    x = random_vector(n, dtype, max(step_x, 1)) if step_x else random_vector(1, dtype).expand(n)
    buffer = torch.full((2 * margin + n * step_y,), float("nan"), device=DEVICE, dtype=dtype)
    y = buffer[margin : margin + n * step_y : step_y]
    y.copy_(random_vector(n, dtype))
    check(impl, 0.3, x, -1.7, y)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[margin : margin + n * step_y : step_y] = False
    assert buffer[untouched].isnan().all(), "an element outside y was written"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zero", [0.0, 1e-50, -1e-46])
def test_zero_scalars_do_not_read(impl, dtype, zero):
    """beta == 0 ignores NaN in y, alpha == 0 ignores NaN in x, both zero gives zeros; a scalar
    that rounds to 0 (or -0) in float32 is a zero."""
    n = 5000
    poisoned = torch.full((n,), float("nan"), device=DEVICE, dtype=dtype)
    check(impl, 0.3, random_vector(n, dtype), zero, poisoned.clone())
    check(impl, zero, poisoned.clone(), -1.7, random_vector(n, dtype))
    y = poisoned.clone()
    implementation(impl)(zero, poisoned.clone(), zero, y)
    assert_same_bits(y, torch.zeros_like(y))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["broadcast", "off the 16-byte grid", "strided"])
def test_x_not_read_may_have_any_layout(impl, dtype, layout):
    """alpha == 0 with y contiguous and aligned: x is not read, so an x no vector build could
    load (step 0, a start off the 16-byte grid, a step of 3) does not stop the fast path."""
    n = 4097
    nan = torch.full((3 * n + 1,), float("nan"), device=DEVICE, dtype=dtype)
    views = {"broadcast": nan[:1].expand(n), "off the 16-byte grid": nan[1 : n + 1]}
    views["strided"] = nan[: 3 * n : 3]
    check(impl, 0.0, views[layout], -1.7, random_vector(n, dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "alpha, x_scale, beta, y_scale",
    [
        (1e5, 1e-2, 1.0, 1.0),
        (1e-8, 100.0, 1.0, 1.0),
        (1e-6, 1e3, 3e-8, 1e4),
        (-3e-8, 1e4, 1e5, 1e-2),
    ],
)
def test_scalars_a_16_bit_type_cannot_hold(impl, dtype, alpha, x_scale, beta, y_scale):
    """Scalars float16 cannot hold (1e5 overflows it, the others are subnormal or 0 there), on
    x and y scaled so the results stay inside its range: still float32's scalars, in the bound."""
    x = (random_vector(4097, torch.float32) * x_scale).to(dtype)
    y = (random_vector(4097, torch.float32) * y_scale).to(dtype)
    check(impl, alpha, x, beta, y)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_and_repeatability(impl, dtype):
    """NaN and infinities in read operands propagate as IEEE says; two runs give the same bits."""
    x, y = random_vector(3001, dtype), random_vector(3001, dtype)
    specials = [float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 4]
    x[: len(specials)] = torch.tensor(specials, dtype=dtype, device=DEVICE)
    y[1 : 1 + len(specials)] = torch.tensor(specials, dtype=dtype, device=DEVICE)
    first = y.clone()
    check(impl, 0.3, x, -1.7, first)
    second = y.clone()
    implementation(impl)(0.3, x, -1.7, second)
    assert_same_bits(second, first)


@pytest.mark.parametrize("impl", IMPLS)
def test_x_and_y_the_same_vector(impl):
    """axpby(a, y, b, y) = (a + b) y: each element is read before it is written."""
    y = random_vector(10000, torch.float32)
    check(impl, 0.3, y, -1.7, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_x_and_y_the_same_memory_through_two_storages(impl):
    """y the very same elements as x through another storage: 'same', (a + b) y as above."""
    x = random_vector(20001, torch.float32)[1::2]
    y = alias(x)
    check(impl, 0.3, x, -1.7, y)
    assert reference.overlap(x, y) == "same"


def bad_inputs():
    """(alpha, x, beta, y, expected error, words the message must contain)"""
    f32 = lambda n: torch.randn(n, device=DEVICE)  # noqa: E731
    buffer = f32(20)
    yield 1.0, [1.0, 2.0], 1.0, f32(2), TypeError, "x must be a torch.Tensor"
    yield torch.tensor(1.0), f32(4), 1.0, f32(4), TypeError, "alpha must be a real"
    yield 1.0, f32(4), None, f32(4), TypeError, "beta must be a real"
    yield 10**400, f32(4), 1.0, f32(4), ValueError, "alpha is beyond the range"
    yield 1.0, f32(4), -(10**400), f32(4), ValueError, "beta is beyond the range"
    yield 1.0, f32(4), 1.0, f32(4).reshape(2, 2), ValueError, "y must be a 1-D"
    yield 1.0, f32(4), 1.0, f32(3), ValueError, "3 elements"
    yield 1.0, f32(4).half(), 1.0, f32(4), TypeError, "does not convert"
    yield 1.0, f32(4).double(), 1.0, f32(4).double(), TypeError, "supported"
    yield 1.0, f32(4), 1.0, f32(1).expand(4), ValueError, "stride 0"
    yield 1.0, buffer[0:10], 1.0, buffer[5:15], ValueError, "partially overlap"
    yield 1.0, buffer[0:10], 1.0, alias(buffer[5:15]), ValueError, "x and y partially"
    if ON_GPU:
        yield 1.0, f32(4), 1.0, torch.randn(4), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    axpby = entry_point(impl)
    *operands, error, words = case
    y = operands[3]
    before = y.clone()
    with pytest.raises(error, match=words):
        axpby(*operands)
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
    call["alpha x + beta y"] = triton_impl.axpby(0.3, x, -1.7, y).tolist()
    calls[str(dtype)] = call
print(json.dumps(calls))
"""


def test_triton_kernel_runs_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included, no test.py, no common/) runs the kernel on CPU tensors, bfloat16 and float32,
    inside README.md's bound: the README's laptop command works."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_CALL], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for dtype, call in json.loads(child.stdout).items():
        dtype = getattr(torch, dtype.removeprefix("torch."))
        x, y, result = (torch.tensor(call[k], dtype=dtype) for k in ("x", "y", "alpha x + beta y"))
        exact = reference.axpby(0.3, x, -1.7, y)
        assert_within_bound(result, exact, error_bound(0.3, x, -1.7, y, exact), f"{dtype}")


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
@pytest.mark.parametrize("alpha, beta", [(0.3, -1.7), (0.0, -1.7), (0.3, 0.0)])
def test_cuda_graph_replays_the_eager_call(impl, dtype, alpha, beta):
    """Captured in a CUDA graph (as a decode loop would run it), the call replays on fresh data
    with the bits of an eager call: the launcher works on the stream torch has current and does
    nothing outside it that a capture would miss. The zero scalars capture the builds that
    leave x or y unread."""
    axpby = implementation(impl)
    x, y = random_vector(4099, dtype), random_vector(4099, dtype)
    axpby(alpha, x, beta, y)  # the first call compiles and loads the kernel, which a capture cannot
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        axpby(alpha, x, beta, y)
    x.copy_(random_vector(4099, dtype))
    y.copy_(random_vector(4099, dtype))
    eager = y.clone()
    graph.replay()
    axpby(alpha, x, beta, eager)
    torch.cuda.synchronize()
    assert_same_bits(y, eager)


@pytest.mark.skipif(not ON_GPU, reason="2**31 elements need a GPU (12 GiB with the reference)")
@pytest.mark.parametrize("impl", IMPLS)
def test_more_than_2_to_31_elements(impl):
    """Offsets past 2**31 elements: a 32-bit index would wrap and update the start twice. Halving
    and doubling bfloat16 values is exact, so the float32 torch result is the exact answer."""
    n = 2**31 + 5
    x = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    expected = (0.5 * x.float() + 2.0 * y.float()).bfloat16()
    implementation(impl)(0.5, x, 2.0, y)
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
