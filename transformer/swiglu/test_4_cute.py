"""SwiGLU tests, section (4): the CuTe builds, their dispatch and their PTX (sm_90a, on the CPU).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import re

import pytest
import torch
from test import ON_GPU, cute_impl

import reference
from common.tolerance import assert_same_bits

# (4) CuTe builds, dispatch and PTX ---------------------------------------------------------

cute_installed = pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
PASS_OPERANDS = {"forward": (2, 1), "backward": (3, 2)}  # (inputs, outputs) of each pass


@cute_installed
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "any stride"])
def test_cute_ptx(direction, dtype, vectorized):
    """The CuTe kernels build for sm_90a. Vector build: each operand's TILE_VECTORS runs per
    thread move as 128-bit accesses; any-stride build: one access per element, none of 128
    bits. Both: per element one mul.f32 by -log2 e (in float32: the two argument roundings of
    EXP_ARGUMENT_ROUNDINGS), one ex2.approx.ftz and one correctly rounded reciprocal (rcp.rn,
    what 1 / x compiles to); no other flushing (a flushed product would break the bound) or
    approximate instruction, no spills. Row offsets in 64 bits (M N may pass 2**31): the row
    widened once, then row * stride + column a mad.lo.s64 per operand, none in 32 bits."""
    inputs, outputs = PASS_OPERANDS[direction]
    per_thread = cute_impl.TILE_VECTORS * cute_impl.VECTOR_BYTES // dtype.itemsize
    ptx = cute_impl.ptx_of(direction, dtype, vectorized)
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    accesses = cute_impl.TILE_VECTORS if vectorized else per_thread
    assert count(r"ld\.global") == inputs * accesses
    assert count(r"st\.global") == outputs * accesses
    assert count(r"ld\.global\.v4") == (inputs * accesses if vectorized else 0)
    assert count(r"mul\.f32\s+%r\d+, %r\d+, 0fBFB8AA3B") == per_thread
    assert count(r"ex2\.approx\.ftz\.f32") == per_thread == count(r"rcp\.rn\.f32")
    assert count(r"ftz") == count(r"\.approx") == per_thread
    assert count(r"\.local") == 0
    assert count(r"cvt\.s64\.s32") == 1 and count(r"mad\.lo\.s64") >= inputs + outputs
    assert count(r"mad\.lo\.s32") == 0
    assert cute_impl.EXP_ARGUMENT_ROUNDINGS == 2


@cute_installed
def test_cute_dispatch():
    """The vector build takes rows of whole 16-byte runs on 16-byte boundaries: the fused
    tensor's halves at a model's width, not an odd width (the up half starts mid-run) nor a
    column step."""
    gu = torch.empty(4, 2 * 4096, dtype=torch.bfloat16)
    assert all(cute_impl.is_vector_friendly(half) for half in reference.halves(gu))
    gu_odd = torch.empty(4, 2 * 4100, dtype=torch.bfloat16)  # the up half 8200 bytes in
    assert not cute_impl.is_vector_friendly(reference.halves(gu_odd)[1])
    assert not cute_impl.is_vector_friendly(torch.empty(4, 8, dtype=torch.bfloat16)[:, :7])
    assert not cute_impl.is_vector_friendly(torch.empty(4, 16)[:, ::2])


@pytest.mark.skipif(cute_impl is None or ON_GPU, reason="CPU tensors: checked where no GPU is")
def test_cute_refuses_cpu_tensors():
    """Valid operands on the CPU: a clear error before any compilation or launch."""
    g, u, y = (torch.randn(2, 8) for _ in range(3))
    before = y.clone()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.swiglu_forward(g, u, y)
    assert_same_bits(y, before)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.swiglu_backward(g, None, torch.randn(2, 4), torch.empty(2, 8))


def cuda_labelled(t):
    """t, a CPU tensor, as a TVM-FFI tensor whose DLPack header says CUDA device 0: a compiled
    CuTe entry checks it (dtype, shape, strides, alignment) as it checks a GPU operand, and
    only the launch after the checks needs the GPU."""
    import ctypes

    import tvm_ffi

    class Relabelled:
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA, device 0

        def __dlpack__(self, *args, **kwargs):
            capsule = torch.utils.dlpack.to_dlpack(t)
            get = ctypes.pythonapi.PyCapsule_GetPointer
            get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
            header = get(capsule, b"dltensor")  # DLTensor: void *data, then the device type
            ctypes.c_int32.from_address(header + ctypes.sizeof(ctypes.c_void_p)).value = 2
            return capsule

    return tvm_ffi.from_dlpack(Relabelled())


def entry_operands(direction, vectorized, m=5, n=1024):
    """float32 (m, n) operands, no two laid out alike: the fused tensor's halves, a row slice
    and contiguous rows for the vector build; a column step, a transposed matrix and a row
    slice at an odd offset for the any-stride build."""
    if vectorized:
        gate, up = reference.halves(torch.randn(m, 2 * n))
        layouts = [gate, up, torch.randn(m, n + 16)[:, :n], torch.empty(m, n)]
    else:
        layouts = [torch.randn(m, 2 * n)[:, ::2], torch.randn(n, m).t(),
                   torch.randn(m, n + 13)[:, 3 : 3 + n]]  # fmt: skip
    inputs, outputs = PASS_OPERANDS[direction]
    return [layouts[k % len(layouts)] for k in range(inputs + outputs)]


@pytest.mark.skipif(cute_impl is None or ON_GPU,
                    reason="CPU only (the CuTe DSL installed): on a GPU the contract tests call "
                    "these builds")  # fmt: skip
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("vectorized", [False, True], ids=["any stride", "vector"])
def test_cute_entry_takes_each_operands_layout(direction, vectorized):
    """TVM-FFI checks every operand before the launch; operands in unlike layouts pass those
    checks and reach the launch, which fails here without a driver."""
    kernel = cute_impl.compile_kernel(direction, torch.float32, vectorized)
    operands = entry_operands(direction, vectorized)
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*(cuda_labelled(t) for t in operands))


@pytest.mark.skipif(cute_impl is None or ON_GPU, reason="CPU only (the CuTe DSL installed)")
def test_cute_vector_entry_refuses_misaligned_rows():
    """The negative control of the test above: the vector build's entry refuses rows that start
    mid-run, the case is_vector_friendly sends to the any-stride build."""
    kernel = cute_impl.compile_kernel("forward", torch.float32, True)
    operands = [torch.randn(5, 1030)[:, 1:1025], torch.randn(5, 1024), torch.empty(5, 1024)]
    assert not cute_impl.is_vector_friendly(operands[0])
    with pytest.raises(ValueError, match="alignment"):
        kernel(*(cuda_labelled(t) for t in operands))


PAST_INT32_ROWS = 2**31 + 3  # an Int32 M would keep 3 of these rows


@cute_installed
@pytest.mark.parametrize("m, n, launches", [(PAST_INT32_ROWS, 2, 3), (2**24 + 1, 262144, 2)])
def test_cute_launches_row_slices(m, n, launches):
    """Past BLOCKS_PER_LAUNCH blocks (M x tiles_n) the compiled launcher runs once a slice of
    the rows that many blocks take: views of every operand (the fused g and u halves of one
    (M, 2N) matrix included) covering the rows once and in order (meta tensors, sized but never
    allocated, stand in for the GPU's and a recorder for the launcher). Up to it, one launch on
    the operands themselves."""
    gu = torch.empty(m, 2 * n, dtype=torch.bfloat16, device="meta")
    operands = (*reference.halves(gu), torch.empty(m, n, dtype=torch.bfloat16, device="meta"))
    tiles_n = -(-n // cute_impl.run_of(16)[1])
    recorded = []
    cute_impl.launch_on_row_slices(lambda *rows: recorded.append(rows), operands)
    assert len(recorded) == launches
    start = 0
    for rows in recorded:
        count = rows[0].shape[0]
        assert 0 < count * tiles_n <= cute_impl.BLOCKS_PER_LAUNCH
        for row_slice, whole in zip(rows, operands, strict=True):
            assert row_slice.shape == (count, n) and row_slice.stride() == whole.stride()
            offset = whole.storage_offset() + start * whole.stride(0)
            assert row_slice.storage_offset() == offset
        start += count
    assert start == m
    recorded.clear()
    rows = cute_impl.BLOCKS_PER_LAUNCH // tiles_n
    at_limit = tuple(t[:rows] for t in operands)
    cute_impl.launch_on_row_slices(lambda *rows: recorded.append(rows), at_limit)
    assert len(recorded) == 1 and all(a is b for a, b in zip(recorded[0], at_limit, strict=True))
