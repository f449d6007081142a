"""Tests for dot: every implementation lands within the bound README.md derives.

Run with `python test.py` (or `nox -s dot` from the top). Without a GPU, torch runs on the CPU
and Triton under its interpreter; launching a CuTe kernel needs the GPU, and those tests say so
when they skip.
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
    from common.tolerance import (
        assert_matches_rounded,
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
except ImportError as error:  # no cute_impl.py yet, or no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# --- 1. Set-up and the bound model: README.md's forward error bound as code ---

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
# 0, 1, primes, 2**k +- 1 and the edges of the Triton block (4096 elements).
SIZES = [0, 1, 2, 3, 7, 31, 127, 128, 129, 1023, 1025, 4095, 4096, 4097, 8191, 8193, 65537]
U32 = unit_roundoff(torch.float32)


def entry_point(name):
    """The implementation's dot. CuTe's can be called without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl.dot if name == "cute" else modules[name].dot


def implementation(name):
    """The implementation's dot, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU")
    return entry_point(name)


def random_vector(n, dtype, step=1):
    return torch.randn(n * step, device=DEVICE).to(dtype)[::step]


def error_bound(impl, x, y, exact):
    """README.md's bound, |z_hat - z| <= u_s|z| + (1 + u_s)(g T + (1 + g) n e) + e_s.

    g = gamma_k of float32 with k roundings per term, T = sum |x_i y_i|, u_s the store's unit
    roundoff (0 for float32), e and e_s the absolute error of a float32 and of a storing
    rounding among the subnormals. k is what each kernel's file exports beside the code that
    fixes its tree (`roundings(n, dtype)`), read at each call, so a test that changes
    MAX_PROGRAMS gets the bound of the tree it runs; torch.dot adds in the BLAS's own
    undocumented order, so for it only what holds for every order of float32 additions: a
    product rounding and at most n - 1 additions per term, k = n."""
    n, dtype = x.numel(), x.dtype
    kernels = {"triton": triton_impl, "cute": cute_impl}
    g = gamma(n if impl == "torch" else kernels[impl].roundings(n, dtype), U32) if n else 0.0
    total = (x.cpu().double() * y.cpu().double()).abs().sum()  # products are exact in float64
    u_s, e, e_s = store_roundoff(dtype), underflow(torch.float32), underflow(dtype)
    return u_s * exact.abs() + (1 + u_s) * (g * total + (1 + g) * n * e) + e_s


def assert_within(z, exact, bound, what="result"):
    """assert_within_bound on 0-dim tensors, viewed as one element each."""
    assert_within_bound(z.reshape(1), exact.reshape(1), bound.reshape(1), what)


def check(impl, x, y):
    """Run impl on (x, y): a 0-dim result of x's dtype on x's device, within the bound."""
    exact = reference.dot(x.cpu(), y.cpu())
    z = implementation(impl)(x, y)
    assert z.shape == () and z.dtype == x.dtype and z.device == x.device
    assert_within(z, exact, error_bound(impl, x, y, exact), impl)
    return z


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_controls(dtype):
    """At n = 2**20 the Triton bound rejects a result that dropped or doubled one term (the
    largest, so that the bug is bigger than the rounding it hides in), which the serial bound
    gamma_n, the only one torch.dot's unknown order allows, would let through."""
    n = 2**20
    x, y = random_vector(n, dtype).cpu(), random_vector(n, dtype).cpu()
    # One term of 256: with every value random the largest term (about 20) hid in the bfloat16
    # rounding of a sum near 2**11 (a step of 16) in about 3 of 200 draws.
    x[0], y[0] = 16.0, 16.0
    exact = reference.dot(x, y)
    largest = (x.double() * y.double()).abs().argmax()
    term = x[largest].double() * y[largest].double()
    tree_bound, serial_bound = error_bound("triton", x, y, exact), error_bound("torch", x, y, exact)
    for wrong in (exact - term, exact + term):
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within(wrong.to(dtype), exact, tree_bound)
        assert_within(wrong.to(dtype), exact, serial_bound)


def test_tree_bound_is_far_below_serial():
    """k(n) grows like n / (MAX_PROGRAMS * BLOCK) instead of n: at 2**28 float32 elements the
    serial bound is void (n u >= 1) while the tree's k is 270."""
    for n in [2**20, 2**24, 2**28, 2**31 + 5]:
        assert triton_impl.roundings(n, torch.float32) < n / 1000
    assert triton_impl.roundings(2**28, torch.float32) == 1 + 248 + 11 + 10
    assert gamma(triton_impl.roundings(2**28, torch.float32), U32) < 2e-5
    with pytest.raises(ValueError, match="unbounded"):
        gamma(2**28, U32)  # the serial bound


# README.md's tables of k: (n, Triton's k, CuTe's k) for float32.
README_ROUNDINGS = [(4097, 14, 21), (2**20, 21, 21), (2**24, 36, 29), (2**28, 270, 147),
                    (2**31 + 5, 2007, 1015)]  # fmt: skip


def test_readme_tables_match_the_exported_counts():
    """The k columns of README.md's tables are what the kernels' files export."""
    for n, triton_k, cute_k in README_ROUNDINGS:
        assert triton_impl.roundings(n, torch.float32) == triton_k, n
        if cute_impl is not None:
            assert cute_impl.roundings(n, torch.float32) == cute_k, n


# --- 2. The contract, over every implementation ---


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(impl, dtype, n):
    check(impl, random_vector(n, dtype), random_vector(n, dtype))


def operand(n, dtype, step, margin=64):
    """n random values with the given step, inside a NaN-filled buffer: reading any element that
    is not part of the vector makes z NaN. Step 0 broadcasts one value."""
    if step == 0:
        return random_vector(1, dtype).expand(n)
    buffer = torch.full((2 * margin + n * step,), float("nan"), device=DEVICE, dtype=dtype)
    view = buffer[margin : margin + n * step : step]
    view.copy_(random_vector(n, dtype))
    return view


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step_x, step_y", [(3, 1), (1, 2), (5, 7), (0, 1), (1, 0), (0, 0)])
def test_strided_inside_guard(impl, dtype, step_x, step_y):
    """Strided and stride-0 operands, each a view into NaN: nothing outside them is read."""
    n = 8193
    check(impl, operand(n, dtype, step_x), operand(n, dtype, step_y))


@pytest.mark.parametrize("impl", IMPLS)
def test_overlapping_operands(impl):
    """x and y are only read: the same vector (a sum of squares) or overlapping views are fine."""
    buffer = random_vector(10001, torch.float32)
    check(impl, buffer[:10000], buffer[:10000])
    check(impl, buffer[:10000], buffer[1:])


def special_case(name, dtype):
    """(x, y) of 5000 random values with special values planted in the second block."""
    x, y = random_vector(5000, dtype), random_vector(5000, dtype)
    values = {
        "nan": ([float("nan")], [1.0]),
        "inf": ([float("inf")], [1.0]),
        "inf-inf": ([float("inf"), -float("inf")], [1.0, 1.0]),
        "inf*0": ([float("inf")], [0.0]),
        "subnormal": ([torch.finfo(dtype).tiny / 4] * 3, [0.5, -3.0, torch.finfo(dtype).tiny]),
    }
    planted_x, planted_y = values[name]
    at = slice(4100, 4100 + len(planted_x))
    x[at] = torch.tensor(planted_x, dtype=dtype, device=DEVICE)
    y[at] = torch.tensor(planted_y, dtype=dtype, device=DEVICE)
    return x, y


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["nan", "inf", "inf-inf", "inf*0", "subnormal"])
def test_special_values(impl, dtype, case):
    """NaN and infinities propagate as IEEE says (the exact result must come back exactly);
    subnormal products stay within the bound's underflow term."""
    check(impl, *special_case(case, dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_accumulates_in_float32(impl, dtype):
    """One 1 and 4095 terms of a quarter ulp of 1: a 16-bit accumulator rounds every addition
    back to 1, while float32 holds each partial sum exactly (a multiple of the term below 2**4),
    so z must be the exact sum rounded once. This is the measurement behind torch_impl's claim."""
    n, term = 4096, torch.finfo(dtype).eps / 4
    x = torch.full((n,), term, device=DEVICE, dtype=dtype)
    x[0] = 1.0
    z = implementation(impl)(x, torch.ones_like(x))
    assert_matches_rounded(z.reshape(1).cpu(), torch.tensor([1 + (n - 1) * term]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeatability(impl, dtype):
    """Two runs on the same inputs give the same bits: the reduction tree depends only on n."""
    dot = implementation(impl)
    x, y = random_vector(65537, dtype), random_vector(65537, dtype)
    assert_same_bits(dot(x, y).reshape(1), dot(x, y).reshape(1))


def bad_inputs():
    """(x, y, expected error, words the message must contain)"""
    f32 = lambda n: torch.randn(n, device=DEVICE)  # noqa: E731
    yield [1.0, 2.0], f32(2), TypeError, "x must be a torch.Tensor"
    yield f32(2), 3.0, TypeError, "y must be a torch.Tensor"
    yield f32(4).reshape(2, 2), f32(4), ValueError, "x must be a 1-D"
    yield f32(1), f32(1)[0], ValueError, "y must be a 1-D"
    yield f32(4), f32(5), ValueError, "5 elements"
    yield f32(4).double(), f32(4).double(), TypeError, "supported"
    yield f32(4).to(torch.int32), f32(4).to(torch.int32), TypeError, "supported"
    yield f32(4), f32(4).half(), TypeError, "does not convert"
    if ON_GPU:
        yield f32(4), torch.randn(4), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, the first thing every implementation calls."""
    x, y, error, words = case
    with pytest.raises(error, match=words):
        entry_point(impl)(x, y)


# --- 3. Triton-specific: the tree's shapes, the empty call, the kernel outside test.py ---


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [3 * 4096 - 1, 3 * 4096 + 1, 7 * 4096 + 5, 40000])
def test_many_blocks_per_program(dtype, n, monkeypatch):
    """With at most 3 programs, each lane adds up to 4 blocks in series: the path the H200
    takes for n beyond MAX_PROGRAMS * BLOCK (2.2 million), at sizes the interpreter can run."""
    monkeypatch.setattr(triton_impl, "MAX_PROGRAMS", 3)
    check("triton", random_vector(n, dtype), random_vector(n, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_more_blocks_than_max_programs(dtype):
    """The real MAX_PROGRAMS, one element past what it covers with a block each: two blocks per
    program and a pass 2 over 265 partials."""
    n = triton_impl.MAX_PROGRAMS * triton_impl.BLOCK + 1
    check("triton", random_vector(n, dtype), random_vector(n, dtype))


def test_empty_launches_nothing(monkeypatch):
    """n = 0 returns the empty sum without touching either kernel."""
    monkeypatch.setattr(triton_impl, "partial_dots_kernel", None)
    monkeypatch.setattr(triton_impl, "sum_partials_kernel", None)
    empty = torch.empty(0, device=DEVICE, dtype=torch.bfloat16)
    assert_same_bits(triton_impl.dot(empty, empty), torch.zeros((), dtype=torch.bfloat16))


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = {}
for dtype in (torch.bfloat16, torch.float32):
    x, y = torch.randn(2, 9000).to(dtype)
    calls[str(dtype)] = {"x": x.tolist(), "y": y.tolist(), "z": triton_impl.dot(x, y).item()}
print(json.dumps(calls))
"""


def test_triton_kernel_runs_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included, no test.py, no common/) runs both kernels on CPU tensors, bfloat16 and
    float32, three programs and a partial last block, inside README.md's bound: the README's
    laptop command works."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_CALL], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for dtype, call in json.loads(child.stdout).items():
        dtype = getattr(torch, dtype.removeprefix("torch."))
        x, y = (torch.tensor(call[name], dtype=dtype) for name in ("x", "y"))
        z, exact = torch.tensor(call["z"], dtype=dtype), reference.dot(x, y)
        assert_within(z, exact, error_bound("triton", x, y, exact), f"{dtype}")


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
    """The CuTe kernels build for sm_90a with 128-bit vector loads on the fast path (none in
    the any-stride build) and the warp-shuffle reduction README.md counts."""
    vector, scalar = cute_impl.ptx_of(dtype, contiguous=True), cute_impl.ptx_of(dtype, False)
    assert "ld.global.v4" in vector and "ld.global.v4" not in scalar
    assert "shfl.sync.bfly" in vector and "shfl.sync.bfly" in scalar


# --- 5. GPU only: CUDA graphs, and sizes past 2**31 with their float64 stand-in ---


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph (as a decode loop would run it), the call replays on fresh data
    with the bits of an eager call: the launcher works on the stream torch has current and does
    nothing outside it that a capture would miss. The captured call allocates its partials and
    z from the graph's memory pool, and every replay writes the same z."""
    dot = implementation(impl)
    x, y = random_vector(65537, dtype), random_vector(65537, dtype)
    dot(x, y)  # the first call compiles and loads the kernels, which a capture cannot
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = dot(x, y)
    x.copy_(random_vector(65537, dtype))
    y.copy_(random_vector(65537, dtype))
    replayed.fill_(float("nan"))
    graph.replay()
    eager = dot(x, y)
    torch.cuda.synchronize()
    assert_same_bits(replayed.reshape(1), eager.reshape(1))


def float64_dot_in_chunks(x, y, chunk=2**26):
    """The stand-in for reference.dot where Python is too slow: float64 products (exact) summed
    by torch in float64, chunk by chunk so that the float64 copies stay small."""
    partials = [
        (x[s : s + chunk].double() * y[s : s + chunk].double()).sum()
        for s in range(0, x.numel(), chunk)
    ]
    return torch.stack(partials).sum().cpu() if partials else torch.zeros((), dtype=torch.float64)


@pytest.mark.parametrize("n", [0, 1, 4097, 100003])
def test_stand_in_matches_reference(n):
    """float64_dot_in_chunks agrees with reference.dot within float64's own serial bound."""
    x, y = random_vector(n, torch.bfloat16), random_vector(n, torch.bfloat16)
    exact = reference.dot(x.cpu(), y.cpu())
    stand_in = float64_dot_in_chunks(x, y, chunk=4096)
    total = (x.cpu().double() * y.cpu().double()).abs().sum()
    bound = gamma(n, unit_roundoff(torch.float64)) * total
    assert_within(stand_in, exact, bound)


@pytest.mark.skipif(not ON_GPU, reason="2**31 elements need a GPU (8 GiB of data)")
@pytest.mark.parametrize("impl", IMPLS)
def test_more_than_2_to_31_elements(impl):
    """Offsets past 2**31 elements: a 32-bit index would wrap. Every 256th x_i is +-1 and the
    last five are +-4096, the rest 0, and y_i = +-1. Then every partial sum of any order is an
    integer below 2**24, which float32 holds exactly: the only rounding left is the store, so
    the result must be the stand-in's exact z rounded to bfloat16, and a wrapped index, which
    would lose or repeat the +-4096 terms past 2**31, cannot hide."""
    n, dtype = 2**31 + 5, torch.bfloat16

    def signs(m):
        return (torch.randint(0, 2, (m,), device=DEVICE, dtype=torch.int8) * 2 - 1).to(dtype)

    x, y = torch.zeros(n, device=DEVICE, dtype=dtype), signs(n)
    x[::256] = signs(x[::256].numel())
    x[-5:] = 4096 * signs(5)
    exact = float64_dot_in_chunks(x, y)
    z = implementation(impl)(x, y)
    assert_matches_rounded(z.reshape(1).cpu(), exact.reshape(1))


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
