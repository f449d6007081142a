"""Tests for copy: every implementation reproduces x bit for bit.

Run with `python test.py` (or `nox -s copy` from the top). Without a GPU, torch runs on the CPU,
Triton under its interpreter, and the CuTe kernels are compiled for sm_90a and their PTX checked;
launching them needs the GPU, and those tests say so when they skip.
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
# 0, 1, primes, 2**k +- 1 and the edges of the Triton block (4096 float32 / 8192 16-bit elements).
SIZES = [0, 1, 2, 3, 7, 31, 127, 128, 129, 1023, 1025, 4095, 4096, 4097, 8191, 8193, 65537]


def entry_point(name):
    """The implementation's copy. CuTe's can be called without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {
        "reference": reference,
        "torch": torch_impl,
        "triton": triton_impl,
        "cute": cute_impl,
    }
    return modules[name].copy


def implementation(name):
    """The implementation's copy, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return entry_point(name)


def random_vector(n, dtype, step=1):
    """n fresh random values (a step > 1 gives a strided view into a larger buffer)."""
    return torch.randn(n * step, device=DEVICE).to(dtype)[::step]


def alias(t):
    """The elements of t through a second storage that starts at t's first element, as DLPack
    imports and numpy views make them: unless t starts its own storage, a check by storage
    identity misses that the two share memory."""
    other = torch.from_dlpack(t)
    assert other.untyped_storage().data_ptr() == t.data_ptr()
    return other


def poisoned(n, dtype, step=1, margin=64):
    """A view of n elements inside a buffer filled with NaN, for catching stray writes."""
    buffer = torch.full((2 * margin + n * step,), float("nan"), device=DEVICE, dtype=dtype)
    return buffer, buffer[margin : margin + n * step : step]


def test_negative_control():
    """The bitwise check rejects a copy that read one element from its neighbour."""
    x = random_vector(1000, torch.bfloat16)
    # Elements 500 and 501 apart: two of random_vector's bfloat16 values were equal in 18 of
    # 20000 draws, and then the copy of the neighbour could not be told from the element.
    x[500], x[501] = 1.0, -1.0
    wrong = x.clone()
    wrong[500] = x[501]
    with pytest.raises(AssertionError, match="1 of 1000 elements differ"):
        assert_same_bits(wrong, x)


# --- 2. The contract, over every implementation ---


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(impl, dtype, n):
    copy = implementation(impl)
    x, y = random_vector(n, dtype), random_vector(n, dtype)
    expected = reference.copy(x.cpu(), y.cpu())
    assert copy(x, y) is y
    assert_matches_rounded(y, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step_x, step_y", [(3, 1), (1, 2), (5, 7), (0, 1)])
def test_strided_inside_guard(impl, dtype, step_x, step_y):
    """Strided (and stride-0, broadcast) inputs, the output a strided view in a NaN-filled buffer:
    every element of the view is written and nothing between or around them is touched."""
    copy = implementation(impl)
    n = 4097
    x = random_vector(n, dtype, max(step_x, 1)) if step_x else random_vector(1, dtype).expand(n)
    buffer, y = poisoned(n, dtype, step_y)
    copy(x, y)
    assert_same_bits(y, x)
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[64 : 64 + n * step_y : step_y] = False
    assert buffer[untouched].isnan().all(), "an element outside y was written"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_and_repeatability(impl, dtype):
    """NaN, infinities, signed zeros and subnormals travel unchanged, and two runs agree bitwise."""
    copy = implementation(impl)
    tiny = torch.finfo(dtype).tiny
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, tiny / 4, -tiny / 2]
    x = random_vector(3001, dtype)
    x[: len(special)] = torch.tensor(special, dtype=dtype, device=DEVICE)
    first, second = copy(x, torch.empty_like(x)), copy(x, torch.empty_like(x))
    assert_same_bits(first, x)
    assert_same_bits(second, first)


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_onto_itself(impl):
    copy = implementation(impl)
    x = random_vector(1000, torch.float32)
    before = x.clone()
    assert copy(x, x) is x
    assert_same_bits(x, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_onto_itself_through_another_storage(impl):
    """y the very same elements as x through another storage: 'same', nothing changes."""
    copy = implementation(impl)
    x = random_vector(2001, torch.float32)[1::2]
    y = alias(x)
    before = x.clone()
    assert reference.overlap(x, y) == "same"
    assert copy(x, y) is y
    assert_same_bits(y, before)


def bad_inputs():
    """(x, y, expected error, words the message must contain)"""
    f32 = lambda n, **kw: torch.randn(n, device=DEVICE, **kw)  # noqa: E731
    buffer = f32(20)
    yield [1.0, 2.0], f32(2), TypeError, "x must be a torch.Tensor"
    yield f32(4).reshape(2, 2), f32(4), ValueError, "x must be a 1-D"
    yield f32(4), f32(5), ValueError, "5 elements"
    yield f32(4), f32(4).double(), TypeError, "supported"
    yield f32(4).to(torch.int32), f32(4).to(torch.int32), TypeError, "supported"
    yield f32(4), f32(4).half(), TypeError, "does not convert"
    yield f32(4), f32(1).expand(4), ValueError, "stride 0"
    yield buffer[0:10], buffer[5:15], ValueError, "partially overlap"
    yield buffer[0:10], alias(buffer[5:15]), ValueError, "x and y partially"
    if ON_GPU:
        yield f32(4), torch.randn(4), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[3])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    copy = entry_point(impl)
    x, y, error, words = case
    before = y.clone()
    with pytest.raises(error, match=words):
        copy(x, y)
    assert_same_bits(y, before, "y after a rejected call")


def test_interleaved_views_are_not_an_overlap():
    buffer = random_vector(2000, torch.float32)
    x, y = buffer[0::2], buffer[1::2]
    expected = x.clone()
    torch_impl.copy(x, y)
    assert_same_bits(y, expected)


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
    x = torch.randn(5000).to(dtype)
    calls[str(dtype)] = {"x": x.tolist(), "y": triton_impl.copy(x, torch.empty_like(x)).tolist()}
print(json.dumps(calls))
"""


def test_triton_kernel_runs_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included, no test.py, no common/) runs the kernel on CPU tensors, bfloat16 and float32,
    and gets the bits of x: the README's laptop command works."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_CALL], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for dtype, call in json.loads(child.stdout).items():
        dtype = getattr(torch, dtype.removeprefix("torch."))
        x, y = (torch.tensor(call[name], dtype=dtype) for name in ("x", "y"))
        assert_same_bits(y, x, f"{dtype} y")


# The sm_90 PTX of the Triton kernel, compiled (not interpreted) in a process without
# TRITON_INTERPRET: the specialisations a GPU launch makes for a unit stride, 16-byte-aligned
# pointers and n divisible by 16 or not.
TRITON_PTX = """
import json, re, triton, triton_impl
from triton.backends.compiler import GPUTarget
accesses = {}
for n_divisible in (True, False):
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    if n_divisible:
        attrs[(2,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(
        triton_impl.copy_kernel,
        {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "stride_x": "constexpr",
         "stride_y": "constexpr", "BLOCK": "constexpr"},
        {"stride_x": 1, "stride_y": 1, "BLOCK": triton_impl.BLOCK_BYTES // 4},
        attrs=attrs,
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": triton_impl.NUM_WARPS})
    accesses[str(n_divisible)] = sorted(set(re.findall(r"[ls][dt][.]global[.][a-z0-9.]+",
                                                       kernel.asm["ptx"])))
print(json.dumps(accesses))
"""


def test_triton_ptx_vectors_need_n_a_multiple_of_16():
    """README.md's "triton_impl.py": unit strides give 128-bit loads and stores only when n is
    a multiple of 16 as well; otherwise the mask makes every access one element."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", TRITON_PTX], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    accesses = json.loads(child.stdout)
    assert accesses["True"] == ["ld.global.v4.b32", "st.global.v4.b32"]
    assert accesses["False"] == ["ld.global.b32", "st.global.b32"]


@pytest.mark.skipif(not ON_GPU, reason="the direct launch runs compiled kernels: a GPU")
def test_triton_direct_launch_never_reuses_another_specialisation():
    """triton_impl.launch runs a compiled kernel directly only under the key it was compiled
    for. Calls alternate between views that change one specialised property each (the address
    2 bytes off 16, n not a multiple of 16, a stride of 2; n past 2**31 is
    test_more_than_2_to_31_elements): a kernel compiled for 128-bit accesses on aligned
    addresses, reused on the view 2 bytes further, would fault or copy the wrong elements."""
    buffer = random_vector(2 * 8192 + 64, torch.bfloat16)
    views = [buffer[:8192], buffer[1:8193], buffer[:8191], buffer[::2]]
    triton_impl.COMPILED.clear()
    for _ in range(2):  # the second round launches each view directly, under its own key
        for x in views:
            y = torch.full_like(x, float("nan"))
            triton_impl.copy(x, y)
            assert_same_bits(y, x, f"a view of {x.numel()} elements, stride {x.stride(0)}")
    assert len(triton_impl.COMPILED) == len(views)


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
    copy = implementation(impl)
    x = random_vector(4099, dtype)
    eager, replayed = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    copy(x, replayed)  # the first call compiles and loads the kernel, which a capture cannot
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy(x, replayed)
    x.copy_(random_vector(4099, dtype))
    replayed.fill_(float("nan"))
    graph.replay()
    copy(x, eager)
    torch.cuda.synchronize()
    assert_same_bits(replayed, eager)
    assert_same_bits(eager, x)


@pytest.mark.skipif(not ON_GPU, reason="2**31 elements need a GPU (8 GiB of data)")
@pytest.mark.parametrize("impl", IMPLS)
def test_more_than_2_to_31_elements(impl):
    """Offsets past 2**31 elements: a 32-bit index would wrap and overwrite the start."""
    copy = implementation(impl)
    n = 2**31 + 5
    x = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    copy(x, y)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
