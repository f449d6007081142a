"""RMSNorm tests, section (4): the CuTe maps, builds, registers and PTX (sm_90a, on the CPU).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import os
import re
import shutil
import subprocess

import pytest
import torch
from test import DTYPES, ON_GPU, cute_impl

# (4) CuTe builds and PTX ---------------------------------------------------------------------


# N = 1, 7, 1024, 2048, 4096, 8193: forward_map's threads a row and forward_path's K (log2 V +
# tiles + log2 threads + 1; V = 16 in bf16 and fp16, 8 in float32): a warp holds 1024 elements
# in every dtype (32 values a thread), 2 and 4 warps 2048 and 4096; 8193 is streamed by a block.
CUTE_FORWARD_MAPS = {
    torch.bfloat16: [(32, 11), (32, 11), (32, 12), (64, 13), (128, 14), (256, 16)],
    torch.float16: [(32, 11), (32, 11), (32, 12), (64, 13), (128, 14), (256, 16)],
    torch.float32: [(32, 10), (32, 10), (32, 13), (64, 14), (128, 15), (256, 17)],
}


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_forward_map(dtype):
    """The fewest warps whose registers hold the row, a block streaming longer rows;
    forward_path counts the tree of that map (backward_path: a block a row at every N)."""
    for n, (threads, path) in zip([1, 7, 1024, 2048, 4096, 8193], CUTE_FORWARD_MAPS[dtype],
                                  strict=True):  # fmt: skip
        assert cute_impl.forward_map(n, dtype)[0] == threads
        assert cute_impl.forward_path(n, dtype) == path
        assert cute_impl.backward_path(n, dtype) == cute_impl.row_sum_path(n, dtype, 256)
    maps = [cute_impl.forward_map(n, dtype) for n, dtype in [
        (1, torch.bfloat16), (1024, torch.bfloat16), (2048, torch.float16), (4000, torch.bfloat16),
        (4096, torch.float32), (8192, torch.bfloat16), (8191, torch.float32),
        (8193, torch.bfloat16)]]  # fmt: skip
    assert maps == [(32, 1, False), (32, 2, True), (64, 2, True), (128, 2, False),
                    (128, 4, True), (256, 2, True), (256, 4, False), (256, 0, False)]  # fmt: skip


# The CuTe builds: the forward on forward_map's (threads a row, tiles held, whole tiles) (a
# warp's row held, 4 warps' partial tiles, a block's whole tiles, a block streaming), the
# backward on backward_map's (tiles held, whole tiles) (the columns path, partial and whole).
CUTE_BUILDS = [("forward", (32, 2, True)), ("forward", (128, 2, False)),
               ("forward", (256, 2, True)), ("forward", (256, 0, False)), ("backward", (0, False)),
               ("backward", (1, False)), ("backward", (2, True))]  # fmt: skip


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("direction, shape", CUTE_BUILDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(direction, shape, dtype):
    """The CuTe kernels build for sm_90a (N is symbolic: one build serves every N of its map):
    128-bit loads and stores on the vector path (none in the any-stride build), warp shuffles,
    div.rn for the means, no spills; in the forward the rsqrt.approx README.md's bound counts
    and the barriers of its map (none for a warp's row, the row's own named one for 2-4 warps,
    bar.sync 0 for a block's); the backward's whole-tile vector build stages rows by cp.async."""
    vector = cute_impl.ptx_of(direction, dtype, True, True, shape)
    scalar = cute_impl.ptx_of(direction, dtype, False, False, shape)
    for ptx in (vector, scalar):
        assert "shfl.sync.bfly" in ptx and "div.rn.f32" in ptx and "div.approx" not in ptx
        assert "ld.local" not in ptx
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "ld.global.v4" not in scalar
    staged = direction == "backward" and shape[1]
    assert ("cp.async.cg.shared.global" in vector) == staged
    assert "cp.async" not in scalar
    if direction == "forward":
        assert "rsqrt.approx.ftz.f32" in vector
        threads = shape[0]
        barriers = re.findall(r"\bbar\.sync\s+[^;]*;|\bbarrier\.sync[^;]*;", vector)
        block_wide = [bool(re.fullmatch(r"bar\.sync\s+0;", bar)) for bar in barriers]
        assert block_wide == [threads == 256] * (0 if threads == 32 else 1), barriers


# bf16 and float32 rows of the headline sizes, forward and backward.
HEADLINE_BUILDS = [(torch.bfloat16, 4096), (torch.bfloat16, 8192), (torch.float32, 4096),
                   (torch.float32, 8192)]  # fmt: skip


@pytest.mark.skipif(
    cute_impl is None or shutil.which("ptxas") is None,
    reason="needs the CuTe DSL and ptxas (CUDA toolkit) to count registers",
)
@pytest.mark.parametrize("dtype, n", HEADLINE_BUILDS, ids=str)
def test_cute_registers(dtype, n, tmp_path):
    """ptxas -v on the sm_90a PTX of the headline builds: the forward (plain and fused) at
    most 64 registers a thread, four blocks of 256 threads an SM (README.md's tuning log counts
    on it), and so the staged backward at one 16-bit tile (STAGED_ONE_TILE_BLOCKS_PER_SM); the
    plain forward and both backwards spill nothing (ptxas puts 8 bytes of the fused bf16 8192
    forward on the stack at 48 registers, under any limit: its choice, so not held)."""
    four_blocks = 65536 // (4 * cute_impl.THREADS_PER_BLOCK)
    for direction, fused in [("forward", False), ("forward", True), ("backward", False),
                             ("backward", True)]:  # fmt: skip
        shape = (cute_impl.forward_map if direction == "forward" else cute_impl.backward_map)(
            n, dtype
        )
        ptx = tmp_path / f"{direction}.ptx"
        ptx.write_text(cute_impl.ptx_of(direction, dtype, True, fused, shape))
        run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True)  # fmt: skip
        if "Unsupported .version" in run.stderr:  # the H200 machine's ptxas is older than the DSL
            pytest.skip(f"this ptxas cannot read the CuTe DSL's PTX: {run.stderr.strip()}")
        assert run.returncode == 0, run.stderr
        for entry in run.stderr.split("Compiling entry function")[1:]:
            assert (fused and direction == "forward") or "0 bytes spill stores" in entry, entry
            registers = int(re.search(r"Used (\d+) registers", entry).group(1))
            hinted = "rows_kernel" in entry and cute_impl.rows_kernel_blocks_per_sm(
                dtype.itemsize * 8, shape[0], shape[1], fused
            )
            if direction == "forward" or hinted:
                assert registers <= four_blocks, entry


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
def test_cute_groups():
    """Rows of up to ROW_REGISTERS_MAX values a thread go to the rows kernel (8192 elements in
    every dtype), longer ones to the columns path; at most GROUPS_MAX blocks (the columns
    kernel's over all its tiles), every row in a group."""
    tiles = [cute_impl.row_tiles_of(n, dtype) for n, dtype in [
        (1, torch.bfloat16), (4096, torch.bfloat16), (4097, torch.float16),
        (8192, torch.bfloat16), (8193, torch.bfloat16), (2048, torch.float32),
        (8192, torch.float32), (8193, torch.float32)]]  # fmt: skip
    assert tiles == [1, 1, 2, 2, 0, 1, 4, 0]
    assert cute_impl.groups_of(32768, 4096, torch.bfloat16) == (64, 512)
    assert cute_impl.groups_of(32768, 8192, torch.bfloat16) == (64, 512)  # one block a row
    assert cute_impl.groups_of(32768, 16384, torch.bfloat16) == (256, 128)  # four tiles
    assert cute_impl.groups_of(7, 65536, torch.bfloat16) == (1, 7)


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
    """CPU operands for a float32 build, no two (M, N) or (N,) ones laid out alike: slices of
    wider rows, a column step and a broadcast where the build takes any stride; row slices whose
    rows stay whole 16-byte vectors where it is the vector build."""
    wide = (lambda: torch.randn(m, n + 16)[:, :n]) if vectorized else (
        lambda: torch.randn(m, n + 13)[:, 3 : 3 + n])  # fmt: skip
    step = (lambda k: torch.randn(k)) if vectorized else (lambda k: torch.randn(2 * k)[::2])
    stat = lambda: torch.empty(m, 3)[:, 1]  # noqa: E731
    if direction == "forward":  # x, residual, w, y, rstd, h, eps
        return wide(), torch.randn(m, n), step(n), torch.empty(m, n), stat(), wide(), 1e-6
    dy = torch.randn(m, n + 8)[:, :n] if vectorized else torch.randn(1, n).expand(m, n)
    partials = torch.empty(1, n + 8)[:, :n]
    return (wide(), torch.randn(n), stat(), dy, torch.randn(m, n), torch.empty(m, n), stat(),
            partials, step(n), m)  # fmt: skip


@pytest.mark.skipif(cute_impl is None or ON_GPU,
                    reason="CPU only (the CuTe DSL installed): on a GPU the contract tests call "
                    "these builds")  # fmt: skip
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("vectorized", [False, True], ids=["any stride", "vector"])
def test_cute_entry_takes_each_operands_layout(direction, vectorized):
    """TVM-FFI checks every operand before the launch; operands in unlike layouts pass those
    checks and reach the launch, which fails here without a driver (when operands shared one
    fake tensor's stride symbols, a ValueError 'Mismatched res.strides[0]', on the H200 too)."""
    shape = cute_impl.forward_map(1024, torch.float32) if direction == "forward" else (1, True)
    kernel = cute_impl.compile_kernel(
        direction, torch.float32, torch.float32, vectorized, True, shape
    )
    operands = entry_operands(direction, vectorized)
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*(cuda_labelled(t) if isinstance(t, torch.Tensor) else t for t in operands))
