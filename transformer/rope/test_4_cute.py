"""RoPE tests, section (4): the CuTe builds, dispatch, entry checks and PTX (sm_90a, on the CPU).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from test import ON_GPU, angle_sources, cute_impl, random_heads

import reference

# (4) CuTe builds, dispatch and PTX ---------------------------------------------------------

cute_installed = pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
cpu_only_cute = pytest.mark.skipif(cute_impl is None or ON_GPU,
                                   reason="CPU only (the CuTe DSL installed): on a GPU the "
                                   "contract tests launch these builds")  # fmt: skip


@cute_installed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("table_dtype", [torch.float32, None], ids=["table", "inv_freq"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_cute_ptx(dtype, table_dtype, interleaved):
    """The kernel builds for sm_90a: per head branch (q, k) two 128-bit loads and two 128-bit
    stores (the thread's two runs) and no other store; the angles in registers (no bar.sync,
    no shared memory); libdevice's cosf/sinf, no approximate instruction; `.local` only in the
    computed angles' Payne-Hanek reduction (libdevice's, for |theta| > 105615)."""
    ptx = cute_impl.ptx_of(dtype, table_dtype, torch.int64, interleaved)
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert count(r"ld\.global\.v4") == count(r"st\.global\.v4") == count(r"st\.global") == 4
    assert count(r"bar\.sync") == count(r"\.shared") == count(r"\.approx") == 0
    assert (count(r"\.local") == 0) == (table_dtype is not None)
    assert len(ptx) < 100_000, "the PTX grew: registers replicated or the loops unrolled twice"


@cute_installed
@pytest.mark.parametrize("dtype, table_dtype, positions, head_dim, tokens, interleaved, loads", [
    (torch.bfloat16, torch.bfloat16, None, 128, 2, False, 8),  # bench.py's call: 128-bit angles
    (torch.bfloat16, torch.float32, torch.int64, 128, 1, False, 12),  # 32 bytes: two each
    (torch.float32, torch.float32, torch.int32, 128, 1, False, 8),
    (torch.bfloat16, torch.bfloat16, torch.int64, 64, 4, True, 12),  # two 8-byte pieces each
])  # fmt: skip
def test_cute_table_path_ptx(dtype, table_dtype, positions, head_dim, tokens, interleaved, loads):
    """rope_table_kernel builds for sm_90a: per head branch (q, k) the head's two 128-bit loads
    come before the position's load and the angles' loads (16 bytes or the whole piece each),
    two 128-bit stores and no other store, no barrier, no local memory; and ptxas gives it at
    most 64 registers (README.md, tuning log), where the general kernel took 58."""
    ptx = cute_impl.ptx_of(dtype, table_dtype, positions, interleaved, False, (head_dim, tokens))
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert count(r"ld\.global\.v4") == loads
    assert count(r"ld\.global") == loads + 2 * (positions is not None)
    assert count(r"st\.global\.v4") == count(r"st\.global") == 4
    assert count(r"bar\.sync") == count(r"\.shared") == count(r"\.local") == 0
    accesses = re.findall(r"ld\.global\S*", ptx)
    heads = [i for i, a in enumerate(accesses) if a.endswith(".v4.b32")][:2]
    assert heads == [0, 1], accesses  # the head's runs first (a bf16 table piece is .v4.b16)
    registers = ptxas_registers(ptx)  # skips (the PTX checks above done) where it cannot count
    assert registers <= 64, registers


def ptxas_registers(ptx):
    """Registers ptxas -v reports for the PTX's kernel on sm_90a; the test skips, saying why,
    without ptxas or where ptxas is older than the PTX the CuTe DSL writes (the H200 machine's)."""
    import shutil
    import tempfile

    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas (CUDA toolkit) to count registers")
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(source), "-o", os.devnull],
                             capture_output=True, text=True)  # fmt: skip
    if "Unsupported .version" in run.stderr:
        pytest.skip(f"this ptxas cannot read the CuTe DSL's PTX: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    return int(re.search(r"Used (\d+) registers", run.stderr).group(1))


@cute_installed
def test_cute_table_path_dispatch():
    """The table kernel takes a table whose (P, D/2) rows are contiguous on 16-byte boundaries,
    Hugging Face's (P, D) read through its first half included, with every operand inside 32-bit
    offsets; not inv_freq, a column step (the HF table's even columns), a row stride or a start
    off 16 bytes, nor an operand or a stride past 2**31 - 1 elements."""
    fits, ok = cute_impl.table_path_fits, cute_impl.fits_int32
    q = torch.empty(2, 40, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    views, positions = [q, q[:, :, :8]], torch.zeros(2, 16, dtype=torch.long)
    hf = torch.empty(16, 128, dtype=torch.bfloat16)
    half = reference.table_half(hf, 64, False)
    assert fits(views, half, half, None) and fits(views, half, half, positions)
    table = torch.empty(16, 64)
    assert fits(views, table, table, positions.expand(2, 16))
    assert not fits(views, None, None, None)  # inv_freq: the general kernel computes the angles
    even = reference.table_half(hf, 64, True)
    assert not fits(views, even, even, None)
    wide = torch.empty(16, 68, dtype=torch.bfloat16)[:, :64]  # rows 136 bytes apart
    assert not fits(views, wide, wide, None)
    shifted = torch.empty(16 * 64 + 1, dtype=torch.bfloat16)[1:].view(16, 64)
    assert not fits(views, half, shifted, None)
    assert ok(torch.empty(2**31, dtype=torch.int8, device="meta"))
    assert not ok(torch.empty(2**31 + 1, dtype=torch.int8, device="meta"))
    assert not ok(torch.empty_strided((1, 2), (2**31, 1), device="meta"))
    huge = torch.empty(4, 2**17, 40, 128, dtype=torch.bfloat16, device="meta")  # 2**34 elements
    assert not fits([huge, *views[1:]], half, half, None)


@cute_installed
def test_cute_dispatch():
    """The vector build takes heads of whole 16-byte runs on 16-byte boundaries: Llama's shape
    in either layout and q, k sliced from a fused qkv projection; not a column step in D, a
    half of odd length in bf16 (D = 130), nor a start mid-run."""
    friendly = cute_impl.is_vector_friendly
    qkv = torch.empty(2, 3, 32 + 2 * 8, 128, dtype=torch.bfloat16)
    assert friendly(qkv[:, :, :32]) and friendly(qkv[:, :, 32:40])
    assert friendly(torch.empty(2, 32, 3, 128).transpose(1, 2))
    assert not friendly(torch.empty(2, 3, 4, 256, dtype=torch.bfloat16)[..., ::2])
    assert not friendly(torch.empty(2, 3, 4, 130, dtype=torch.bfloat16))
    assert not friendly(torch.empty(2, 3, 4, 136, dtype=torch.bfloat16)[..., 4:132])
    assert not friendly(torch.empty(2, 3, 4, 129)[..., 1:])


@cute_installed
def test_cute_tokens_past_int32_go_to_torch():
    """rope_kernel indexes tokens in Int32: B S past TOKENS_MAX (2**31 + 3 tokens of one
    head, 64 GiB of q in bf16, in meta tensors) goes to torch's rotation, which any size
    takes, and so do unfriendly strides; TOKENS_MAX tokens, whole runs, to the kernels."""
    heads = lambda tokens: torch.empty(1, tokens, 1, 16, dtype=torch.bfloat16, device="meta")  # noqa: E731
    limit = cute_impl.TOKENS_MAX
    assert cute_impl.kernels_take([heads(limit)] * 4)
    assert not cute_impl.kernels_take([heads(2**31 + 3)] * 4)
    assert not cute_impl.kernels_take([heads(limit + 1)] * 4)
    assert not cute_impl.kernels_take([heads(4)[..., 1:9]] * 4)


@cute_installed
def test_cute_block_threads():
    """A block's threads are a multiple of R, at most MAX_THREADS when R is smaller, and
    share the heads out evenly: Llama's 40 heads in one pass in bf16 (R = 8), two in fp32."""
    for heads, runs in ((40, 8), (40, 16), (1, 1), (3, 4), (200, 8), (7, 1024)):
        threads = cute_impl.block_threads(heads, runs)
        passes = -(-heads * runs // threads)
        assert threads % runs == 0 and threads <= max(cute_impl.MAX_THREADS, runs)
        assert (passes - 1) * threads < heads * runs <= passes * threads
    assert cute_impl.block_threads(40, 8) == 320 and cute_impl.block_threads(40, 16) == 320
    for heads, runs, tokens in ((40, 8, 2), (40, 4, 4), (3, 8, 2), (7, 32, 1)):
        threads = cute_impl.block_threads(heads, runs, tokens)
        passes = -(-heads * runs * tokens // threads)
        assert threads % (runs * tokens) == 0
        assert threads <= max(cute_impl.MAX_THREADS, runs * tokens)
        assert (passes - 1) * threads < heads * runs * tokens <= passes * threads
    assert cute_impl.block_threads(40, 8, 2) == 320  # bf16 (B, H, S, D): 2 tokens, 2 passes


@cute_installed
def test_cute_tokens_per_block():
    """One token a block where a token's heads lie together; where a head's tokens do, enough
    tokens that a block's piece of each head is HEAD_PIECE_BYTES (bf16 D = 128: 2)."""
    bshd = torch.empty(2, 16, 40, 128, dtype=torch.bfloat16)
    bhsd = torch.empty(2, 40, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert cute_impl.tokens_per_block(bshd) == 1
    assert cute_impl.tokens_per_block(bhsd) == cute_impl.HEAD_PIECE_BYTES // 256 == 2
    assert cute_impl.tokens_per_block(bhsd.float()) == 1  # float32 of D = 128: 512 bytes
    assert cute_impl.tokens_per_block(bhsd[..., :64]) == 4


@pytest.mark.skipif(cute_impl is None or ON_GPU, reason="CPU tensors: checked where no GPU is")
def test_cute_refuses_cpu_tensors():
    """Valid operands on the CPU: a clear error before any compilation or launch."""
    q, k = random_heads(1, 3, 2, 8, torch.float32), random_heads(1, 3, 1, 8, torch.float32)
    q_out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.rope_forward(q, k, q_out, torch.empty_like(k), **angle_sources(8, "inv_freq"))
    assert not q_out.any()


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


@cpu_only_cute
@pytest.mark.parametrize("source", ["table", "hf_table", "inv_freq"])
@pytest.mark.parametrize("positions", ["none", "broadcast (S,)", "int32 (B, S)"])
def test_cute_entry_takes_each_operands_layout(source, positions):
    """TVM-FFI checks every operand before the launch; q from a fused qkv in (B, H, S, D),
    outputs in either layout, a table as given (the HF one read through its first half) or
    inv_freq, and positions absent, broadcast or int32 pass those checks and reach the
    launch, which fails here without a driver."""
    batch, seq, heads, heads_k, head_dim = 2, 5, 4, 2, 16
    qkv = torch.randn(batch, heads + 2 * heads_k, seq, head_dim, dtype=torch.bfloat16)
    q, k = qkv[:, :heads].transpose(1, 2), qkv[:, heads : heads + heads_k].transpose(1, 2)
    k_out = torch.empty(batch, heads_k, seq, head_dim, dtype=torch.bfloat16).transpose(1, 2)
    angles = {n: t.to(torch.bfloat16) if source == "hf_table" else t
              for n, t in angle_sources(head_dim, source).items()}  # fmt: skip
    cos, sin = (reference.table_half(angles[n], 8, False) if n in angles else None
                for n in ("cos", "sin"))  # fmt: skip
    position_ids = {"none": None, "broadcast (S,)": torch.arange(seq).expand(batch, seq),
                    "int32 (B, S)": torch.zeros(batch, seq, dtype=torch.int32)}  # fmt: skip
    position_ids = position_ids[positions]
    kernel = cute_impl.compile_kernel(torch.bfloat16, None if cos is None else cos.dtype,
                                      None if position_ids is None else position_ids.dtype,
                                      False, False)  # fmt: skip
    operands = [q, k, torch.empty_like(q), k_out, cos, sin, angles.get("inv_freq"), position_ids]
    labelled = [None if t is None else cuda_labelled(t) for t in operands]
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*labelled, 1, 1, cute_impl.block_threads(heads + heads_k, 1))


@cpu_only_cute
def test_cute_entry_refuses_misaligned_heads():
    """The negative control of the test above: the entry refuses q starting mid-run, the case
    is_vector_friendly sends to torch's rotation."""
    q = torch.randn(4 + 2 * 5 * 4 * 16, dtype=torch.bfloat16)[4:].view(2, 5, 4, 16)  # 8 bytes in
    k = torch.randn(2, 5, 2, 16, dtype=torch.bfloat16)
    assert not cute_impl.is_vector_friendly(q)
    kernel = cute_impl.compile_kernel(torch.bfloat16, None, None, False, False)
    operands = [q, k, torch.empty(q.shape, dtype=q.dtype), torch.empty_like(k)]
    with pytest.raises(ValueError, match="Misaligned"):
        kernel(*(cuda_labelled(t) for t in operands), None, None,
               cuda_labelled(torch.ones(8)), None, 1, 1, 8)  # fmt: skip


@cpu_only_cute
@pytest.mark.parametrize("positions", [None, torch.int64, torch.int32], ids=str)
def test_cute_table_entry(positions):
    """The table kernel's TVM-FFI entry takes bench.py's call (q, k in (B, H, S, D), the HF table
    read through its first half) with positions absent or given, and reaches the launch, which
    fails here without a driver; the negative control: a table starting mid-row is refused."""
    batch, seq, heads, heads_k, head_dim = 2, 6, 4, 2, 64
    q, k = (random_heads(batch, seq, h, head_dim, torch.bfloat16, "bhsd").transpose(1, 2)
            for h in (heads, heads_k))  # fmt: skip
    hf = angle_sources(head_dim, "hf_table")["cos"].to(torch.bfloat16)
    table = reference.table_half(hf, head_dim // 2, False)
    ids = None if positions is None else torch.zeros(batch, seq, dtype=positions)
    assert cute_impl.table_path_fits([q, k], table, table, ids)
    tokens = cute_impl.tokens_per_block(q)
    kernel = cute_impl.compile_kernel(torch.bfloat16, torch.bfloat16, positions, False, False,
                                      (head_dim, tokens))  # fmt: skip
    threads = cute_impl.block_threads(heads + heads_k, 4, tokens)
    operands = [q, k, torch.empty_like(q), torch.empty_like(k), table, table]
    labelled = [cuda_labelled(t) for t in operands] + [None if ids is None else cuda_labelled(ids)]
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*labelled, threads)
    rows = hf.shape[0] - 1
    shifted = hf.flatten()[4 : 4 + rows * head_dim].view(rows, head_dim)[:, : head_dim // 2]
    shifted = cuda_labelled(shifted)  # 8 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="Misaligned"):
        kernel(*labelled[:4], shifted, labelled[5], labelled[6], threads)
