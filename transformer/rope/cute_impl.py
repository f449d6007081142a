"""RoPE forward and backward in the CuTe DSL: a block rotates all q and k heads of T tokens.

    y_a = x_a cos(theta) - x_b sin(theta)     y_b = x_b cos(theta) + x_a sin(theta)

The map (README.md, "CuTe", draws it): a head's D elements are 2R runs of 16 bytes. Thread t
owns run j = t % R of the first half and run R + j of the second, of token (t // R) % T, in
head t // (R T), then in every (threads / (R T))-th head after it, through q's heads and then
k's. T is 1, or more in the (B, H, S, D) layout, where a head's consecutive tokens are
neighbours in memory (`tokens_per_block`). The block size is a multiple of R T, so a thread's
token and run, and with them its angles, are the same in every head it visits: it computes
them once, in its own registers (no shared memory, no barrier). Rotate-half pairs the
two runs element by element; interleaved pairs neighbours inside each run. The backward is the
same kernel with sin negated.

`rope_table_kernel` ("the table kernel" in README.md) takes tables with contiguous rows where
32-bit offsets reach every operand (`table_path_fits`): one head of one token a thread, its
loads out before the angles'. Both move each run with one 128-bit access and need whole runs on
16-byte boundaries (`is_vector_friendly`); any other operand (a column step in D, D/2 not a
multiple of the run, an odd offset) goes through torch_impl's rotation: correct, several passes.
cos and sin of computed angles are libdevice's full-range cosf and sinf, as in README's bound.
"""

import functools
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

import torch_impl
from reference import canonical, check_rope, table_half
from torch_impl import model_plumbing

VECTOR_BYTES = 16  # the widest access a thread can issue: 128 bits
# Threads of a block, at most, when a token has more (head, run) pairs than this: the threads
# then visit several heads each. 512 holds Llama 3 8B's 40 bf16 heads (R = 8) in one pass.
MAX_THREADS = 512
# In the (B, H, S, D) layout a block takes consecutive tokens until each head's piece of it is
# this long: one bf16 token of D = 128 (256 bytes a head, 40 pieces 8 MB apart) ran at 55% of
# copy, float32's 512-byte pieces at 92%.
HEAD_PIECE_BYTES = 512
# rope_kernel indexes tokens (B S of them, and a block's T <= 16 past the last) in Int32.
TOKENS_MAX = 2**31 - 2**10

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}
POSITION_TYPES = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}


@cute.jit
def run_angles(cos, sin, inv_freq, position, j, runs_per_half, run: cutlass.Constexpr[int],
               interleaved: cutlass.Constexpr[bool], inverse: cutlass.Constexpr[bool]):  # fmt: skip
    """cos and sin, in float32, of the angles of the pairs in this thread's two runs (j and
    R + j): rotate-half's run pairs i = j * run + e with element e of both runs; interleaved's
    runs hold run/2 pairs each, the first run's then the second's. From the table's row
    (NaN outside it) or of theta = float32(p) * inv_freq, rounded once."""
    c = cute.make_rmem_tensor((run,), cutlass.Float32)
    s = cute.make_rmem_tensor((run,), cutlass.Float32)
    pairs = run // 2
    for e in cutlass.range_constexpr(run):
        i = j * run + e
        if cutlass.const_expr(interleaved):
            i = j * pairs + e if e < pairs else (runs_per_half + j) * pairs + e - pairs
        if cutlass.const_expr(inv_freq is None):
            if position >= 0 and position < cute.size(cos, mode=[0]):
                c[e] = cos[position, i].to(cutlass.Float32)
                s[e] = sin[position, i].to(cutlass.Float32)
            else:
                c[e], s[e] = cutlass.Float32(float("nan")), cutlass.Float32(float("nan"))
        else:
            theta = position.to(cutlass.Float32) * inv_freq[i]
            c[e], s[e] = cute.math.cos(theta), cute.math.sin(theta)
        if cutlass.const_expr(inverse):
            s[e] = -s[e]
    return c, s


@cute.jit
def vector_copy(src, dst):
    """src to dst in a single access of all their bytes (16 or fewer; the operands' layouts
    guarantee the alignment)."""
    bits = cute.size(src) * src.element_type.width
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), src.element_type,
                               num_bits_per_copy=bits)  # fmt: skip
    cute.copy(atom, src, dst)


@cute.jit
def load_runs(x, j, runs_per_half, run: cutlass.Constexpr[int]):
    """This thread's two runs (j and R + j) of one head x, as loaded: widening them waits for
    the loads, so rotate_store does it, after whatever else the caller issues meanwhile."""
    raws = []
    for index in (j, runs_per_half + j):
        raw = cute.make_rmem_tensor((run,), x.element_type)
        vector_copy(cute.local_tile(x, (run,), (index,)), raw)
        raws.append(raw)
    return raws


@cute.jit
def rotate_store(raws, out, j, runs_per_half, c, s, run: cutlass.Constexpr[int],
                 interleaved: cutlass.Constexpr[bool]):  # fmt: skip
    """Rotate the two runs load_runs gave and store them into out, the head's D elements."""
    values = []
    for raw in raws:
        wide = cute.make_rmem_tensor((run,), cutlass.Float32)
        for e in cutlass.range_constexpr(run):
            wide[e] = raw[e].to(cutlass.Float32)
        values.append(wide)
    if cutlass.const_expr(interleaved):  # pair m of run r: elements 2m, 2m + 1
        for r in cutlass.range_constexpr(2):
            v = values[r]
            for m in cutlass.range_constexpr(run // 2):
                a, b = v[2 * m], v[2 * m + 1]
                cm, sm = c[r * (run // 2) + m], s[r * (run // 2) + m]
                v[2 * m], v[2 * m + 1] = a * cm - b * sm, b * cm + a * sm
    else:  # pair e: element e of each run
        first, second = values
        for e in cutlass.range_constexpr(run):
            a, b = first[e], second[e]
            first[e], second[e] = a * c[e] - b * s[e], b * c[e] + a * s[e]
    for wide, index in zip(values, (j, runs_per_half + j), strict=True):
        rounded = cute.make_rmem_tensor((run,), out.element_type)
        for e in cutlass.range_constexpr(run):
            rounded[e] = wide[e].to(out.element_type)
        vector_copy(rounded, cute.local_tile(out, (run,), (index,)))


@cute.kernel
def rope_kernel(
    q: cute.Tensor, k: cute.Tensor, q_out: cute.Tensor, k_out: cute.Tensor, cos, sin, inv_freq,
    positions, runs_per_half: cutlass.Int32, tokens_per_block: cutlass.Int32,
    run: cutlass.Constexpr[int], interleaved: cutlass.Constexpr[bool],
    inverse: cutlass.Constexpr[bool],
):  # fmt: skip
    block, _, _ = cute.arch.block_idx()
    thread, _, _ = cute.arch.thread_idx()
    threads, _, _ = cute.arch.block_dim()
    seq = cutlass.Int32(cute.size(q, mode=[1]))  # B S and the head counts fit 32 bits
    # Thread t's slot t // R is (head row, token): token slot % T of the block's T tokens.
    slot = thread // runs_per_half
    token = block * tokens_per_block + slot % tokens_per_block
    if token < cutlass.Int32(cute.size(q, mode=[0])) * seq:
        b, s = token // seq, token % seq
        position = cutlass.Int64(s)
        if cutlass.const_expr(positions is not None):
            position = positions[b, s].to(cutlass.Int64)
        j = thread % runs_per_half  # the same in every head this thread visits
        c, sn = run_angles(cos, sin, inv_freq, position, j, runs_per_half, run, interleaved,
                           inverse)  # fmt: skip
        heads_q = cutlass.Int32(cute.size(q, mode=[2]))
        heads = heads_q + cutlass.Int32(cute.size(k, mode=[2]))
        head_step = threads // runs_per_half // tokens_per_block
        for head in cutlass.range(slot // tokens_per_block, heads, head_step):
            # both loads before any store: out may be x itself
            if head < heads_q:
                raws = load_runs(q[b, s, head, None], j, runs_per_half, run)
                rotate_store(raws, q_out[b, s, head, None], j, runs_per_half, c, sn, run,
                             interleaved)  # fmt: skip
            else:
                h = head - heads_q
                raws = load_runs(k[b, s, h, None], j, runs_per_half, run)
                rotate_store(raws, k_out[b, s, h, None], j, runs_per_half, c, sn, run,
                             interleaved)  # fmt: skip


@cute.jit
def launch_rope(
    q: cute.Tensor, k: cute.Tensor, q_out: cute.Tensor, k_out: cute.Tensor, cos, sin, inv_freq,
    positions, runs_per_half: cutlass.Int32, tokens_per_block: cutlass.Int32,
    threads: cutlass.Int32, stream: cuda.CUstream, interleaved: cutlass.Constexpr[bool],
    inverse: cutlass.Constexpr[bool],
):  # fmt: skip
    run = VECTOR_BYTES * 8 // q.element_type.width
    tokens = cute.size(q, mode=[0]) * cute.size(q, mode=[1])
    blocks = (tokens + tokens_per_block - 1) // tokens_per_block
    rope_kernel(q, k, q_out, k_out, cos, sin, inv_freq, positions, runs_per_half,
                tokens_per_block, run, interleaved, inverse).launch(
        grid=[blocks, 1, 1], block=[threads, 1, 1], stream=stream)  # fmt: skip


@cute.jit
def table_run_angles(cos, sin, position, j, runs_per_half, run: cutlass.Constexpr[int],
                     interleaved: cutlass.Constexpr[bool],
                     inverse: cutlass.Constexpr[bool]):  # fmt: skip
    """run_angles for a table whose rows are contiguous and 16-byte aligned: the thread's
    angles are one piece of `run` columns (rotate-half, j * run on) or two of run / 2
    (interleaved: run j's pairs, then run R + j's), each moved in accesses of up to 16 bytes,
    all issued before any is widened. The row is compared in the position's own type, so
    an int64 position past 2**31 is outside the table, not wrapped into it."""
    inside = position >= 0 and position < cute.size(cos, mode=[0])
    row = cutlass.Int32(0)  # an address inside the table, whatever the position
    if inside:
        row = cutlass.Int32(position)
    width = run // 2 if cutlass.const_expr(interleaved) else run
    starts = (j, runs_per_half + j) if cutlass.const_expr(interleaved) else (j,)
    chunk = min(width, VECTOR_BYTES * 8 // cos.element_type.width)  # elements an access
    raws = []
    for table in (cos, sin):
        for start in starts:  # piece `start` holds columns start * width .. + width - 1
            for part in cutlass.range_constexpr(width // chunk):
                raw = cute.make_rmem_tensor((chunk,), table.element_type)
                index = start * (width // chunk) + part
                vector_copy(cute.local_tile(table[row, None], (chunk,), (index,)), raw)
                raws.append(raw)
    c = cute.make_rmem_tensor((run,), cutlass.Float32)
    s = cute.make_rmem_tensor((run,), cutlass.Float32)
    for e in cutlass.range_constexpr(run):
        c[e] = raws[e // chunk][e % chunk].to(cutlass.Float32)
        s[e] = raws[(run + e) // chunk][e % chunk].to(cutlass.Float32)
        if cutlass.const_expr(inverse):
            s[e] = -s[e]
    if not inside:
        for e in cutlass.range_constexpr(run):
            c[e], s[e] = cutlass.Float32(float("nan")), cutlass.Float32(float("nan"))
    return c, s


@cute.jit
def rotate_head_from_table(x, out, cos, sin, positions, b, s, j, runs_per_half,
                           run: cutlass.Constexpr[int], interleaved: cutlass.Constexpr[bool],
                           inverse: cutlass.Constexpr[bool]):  # fmt: skip
    """One head's two runs: their loads, then the position's and the angles' (all in flight)."""
    raws = load_runs(x, j, runs_per_half, run)
    position = s
    if cutlass.const_expr(positions is not None):
        position = positions[b, s]
    c, sn = table_run_angles(cos, sin, position, j, runs_per_half, run, interleaved, inverse)
    rotate_store(raws, out, j, runs_per_half, c, sn, run, interleaved)


@cute.kernel
def rope_table_kernel(
    q: cute.Tensor, k: cute.Tensor, q_out: cute.Tensor, k_out: cute.Tensor, cos, sin, positions,
    run: cutlass.Constexpr[int], tokens_per_block: cutlass.Constexpr[int],
    interleaved: cutlass.Constexpr[bool], inverse: cutlass.Constexpr[bool],
):  # fmt: skip
    """The fast path: 32-bit indices, D static, one head of one token per thread (no loop, so
    nothing to keep live across one). Block (x, y) takes tokens x T .. x T + T - 1 and its
    threads' share of the heads, the y-th; thread t: run t % R, token (t // R) % T, head
    t // (R T) of the share, q's heads then k's."""
    block, share, _ = cute.arch.block_idx()
    thread, _, _ = cute.arch.thread_idx()
    threads, _, _ = cute.arch.block_dim()
    runs_per_half = cute.size(q, mode=[3]) // (2 * run)  # static: D is
    slot = thread // runs_per_half
    token = block * tokens_per_block + slot % tokens_per_block
    head = share * (threads // (runs_per_half * tokens_per_block)) + slot // tokens_per_block
    seq, heads_q = cute.size(q, mode=[1]), cute.size(q, mode=[2])
    if token < cute.size(q, mode=[0]) * seq and head < heads_q + cute.size(k, mode=[2]):
        b, s = token // seq, token % seq
        j = thread % runs_per_half
        if head < heads_q:
            rotate_head_from_table(q[b, s, head, None], q_out[b, s, head, None], cos, sin,
                                   positions, b, s, j, runs_per_half, run, interleaved,
                                   inverse)  # fmt: skip
        else:
            h = head - heads_q
            rotate_head_from_table(k[b, s, h, None], k_out[b, s, h, None], cos, sin, positions,
                                   b, s, j, runs_per_half, run, interleaved, inverse)  # fmt: skip


@cute.jit
def launch_rope_table(
    q: cute.Tensor, k: cute.Tensor, q_out: cute.Tensor, k_out: cute.Tensor, cos, sin, positions,
    threads: cutlass.Int32, stream: cuda.CUstream, tokens_per_block: cutlass.Constexpr[int],
    interleaved: cutlass.Constexpr[bool], inverse: cutlass.Constexpr[bool],
):  # fmt: skip
    run = VECTOR_BYTES * 8 // q.element_type.width
    width = cute.size(q, mode=[3]) // (2 * run) * tokens_per_block  # threads a head takes
    heads = cute.size(q, mode=[2]) + cute.size(k, mode=[2])
    shares = (heads * width + threads - 1) // threads
    blocks = (cute.size(q, mode=[0]) * cute.size(q, mode=[1]) - 1) // tokens_per_block + 1
    rope_table_kernel(q, k, q_out, k_out, cos, sin, positions, run, tokens_per_block,
                      interleaved, inverse).launch(
        grid=[blocks, shares, 1], block=[threads, 1, 1], stream=stream)  # fmt: skip


def fake_tensor(element, shape, index_width, step=None, align=None):
    """A symbolic operand for cute.compile, shape as given (None: symbolic) and indices of
    index_width bits: any strides (step None), or a unit last stride (D, a table's columns)
    and the others multiples of step."""
    stride = tuple(cute.sym_int(index_width, divisibility=step or 1) for _ in shape)
    if step is not None:
        stride = (*stride[:-1], 1)
    shape = tuple(cute.sym_int(index_width) if n is None else n for n in shape)
    return cute.runtime.make_fake_tensor(
        element, shape, stride=stride, assumed_align=align or max(1, element.width // 8)
    )


def build(dtype, table_dtype, position_dtype, interleaved, inverse, table_path=None, options=""):
    """cute.compile a launcher for TVM-FFI calls on torch tensors, on torch's current stream.
    q, q_out and k, k_out are (B, S, heads, D) with their own strides: D contiguous, the others
    whole runs, on 16-byte boundaries; positions (B, S) of position_dtype with any strides (0 for
    a broadcast), or None (the position is s). table_path None: rope_kernel, 64-bit indices,
    the angles a (P, D/2) table of table_dtype with any strides or (table_dtype None) a float32
    inv_freq. table_path (D, T): rope_table_kernel for that D and T tokens a block, 32-bit
    indices, the table's rows contiguous and 16-byte aligned (`table_path_fits`)."""
    run = VECTOR_BYTES // dtype.itemsize
    width = 64 if table_path is None else 32
    head_dim = None if table_path is None else table_path[0]
    batch, seq, heads_q, heads_k = (cute.sym_int(width) for _ in range(4))
    q, q_out = (fake_tensor(TORCH_TO_CUTLASS[dtype], (batch, seq, heads_q, head_dim), width, run,
                            VECTOR_BYTES) for _ in range(2))  # fmt: skip
    k, k_out = (fake_tensor(TORCH_TO_CUTLASS[dtype], (batch, seq, heads_k, head_dim), width, run,
                            VECTOR_BYTES) for _ in range(2))  # fmt: skip
    half = cute.sym_int(width) if table_path is None else head_dim // 2
    cos = sin = inv_freq = positions = None
    if table_dtype is None:
        inv_freq = fake_tensor(cutlass.Float32, (half,), width)
    else:
        rows, table_type = cute.sym_int(width), TORCH_TO_CUTLASS[table_dtype]
        if table_path is None:
            cos, sin = (fake_tensor(table_type, (rows, half), width) for _ in range(2))
        else:
            chunk = VECTOR_BYTES // table_dtype.itemsize  # rows start on 16-byte boundaries
            cos, sin = (fake_tensor(table_type, (rows, half), width, chunk, VECTOR_BYTES)
                        for _ in range(2))  # fmt: skip
    if position_dtype is not None:
        positions = fake_tensor(POSITION_TYPES[position_dtype], (batch, seq), width)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi {options}"
    if table_path is None:
        operands = (q, k, q_out, k_out, cos, sin, inv_freq, positions)
        return cute.compile(launch_rope, *operands, 1, 1, 1, stream, interleaved, inverse,
                            options=options)  # fmt: skip
    operands = (q, k, q_out, k_out, cos, sin, positions)
    return cute.compile(launch_rope_table, *operands, 1, stream, table_path[1], interleaved,
                        inverse, options=options)  # fmt: skip


@functools.cache
def compile_kernel(dtype, table_dtype, position_dtype, interleaved, inverse, table_path=None):
    """The compiled launcher, built once per specialisation and cached."""
    return build(dtype, table_dtype, position_dtype, interleaved, inverse,
                 table_path).__tvm_ffi_object__()  # fmt: skip


def ptx_of(dtype, table_dtype, position_dtype, interleaved, inverse=False, table_path=None):
    """The sm_90a PTX of a build: what the tests read for 128-bit accesses and cosf/sinf."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(dtype, table_dtype, position_dtype, interleaved, inverse, table_path,
                     options).__ptx__  # fmt: skip


def is_vector_friendly(t):
    """A (B, S, heads, D) operand of whole 16-byte runs on 16-byte boundaries: D contiguous,
    D/2 and every other stride multiples of the run, a 16-byte aligned start."""
    run = VECTOR_BYTES // t.element_size()
    return (
        t.data_ptr() % VECTOR_BYTES == 0
        and t.stride(3) == 1
        and t.shape[3] % (2 * run) == 0
        and all(stride % run == 0 for stride in t.stride()[:3])
    )


def kernels_take(views):
    """The kernels take whole 16-byte runs (`is_vector_friendly`) of at most TOKENS_MAX
    tokens."""
    tokens = views[0].shape[0] * views[0].shape[1]
    return tokens <= TOKENS_MAX and all(is_vector_friendly(t) for t in views if t.numel())


def tokens_per_block(view):
    """T, the tokens a block rotates: 1 when a token's heads lie together (B, S, H, D); where
    a head's tokens do (B, H, S, D), enough that a block's piece of each head is HEAD_PIECE_BYTES
    of consecutive memory (one token's head in bf16 with D = 128 is only 256)."""
    if view.stride(1) >= view.stride(2):
        return 1
    return max(1, HEAD_PIECE_BYTES // (view.shape[3] * view.element_size()))


def fits_int32(t):
    """Every element offset of t and every stride below 2**31, for 32-bit indices: t's storage
    holds fewer elements than that (cheaper than t's span, on every call)."""
    return (t.untyped_storage().nbytes() <= 2**31 * t.element_size()
            and max(t.stride(), default=0) < 2**31)  # fmt: skip


def table_path_fits(views, cos, sin, position_ids):
    """True when rope_table_kernel takes the call: a table (not inv_freq) whose (P, D/2) halves
    have contiguous rows on 16-byte boundaries (a (P, D) table read through its first half
    qualifies; its even columns, for interleaved, do not), and every operand reachable with
    32-bit indices. Positions are compared with the table in their own type in the kernel,
    so their values need no check here (none could be made without a synchronisation)."""
    if cos is None:
        return False
    chunk = VECTOR_BYTES // cos.element_size()  # table elements in 16 bytes
    aligned = all(t.stride(1) == 1 and t.stride(0) % chunk == 0
                  and t.data_ptr() % VECTOR_BYTES == 0 for t in (cos, sin))  # fmt: skip
    operands = [*views, cos, sin] + ([] if position_ids is None else [position_ids])
    return aligned and all(fits_int32(t) for t in operands)


def block_threads(heads, runs_per_half, tokens=1):
    """Threads of a block of `tokens` tokens: a multiple of R T, at most MAX_THREADS (or R T),
    split so that every thread visits the same number of heads, give or take one."""
    width = runs_per_half * tokens
    passes = -(-heads * width // max(MAX_THREADS, width))
    return -(-heads // passes) * width


def rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids, interleaved, layout,
                inverse):  # fmt: skip
    check_rope(q, k, q_out, k_out, cos=cos, sin=sin, inv_freq=inv_freq,
               position_ids=position_ids, layout=layout)  # fmt: skip
    if not q.is_cuda:
        raise ValueError(f"the operands are on {q.device}; the CuTe kernel needs CUDA tensors")
    views = [canonical(t, layout) for t in (q, k, q_out, k_out)]
    batch, seq, heads_q, head_dim = views[0].shape
    heads = heads_q + views[1].shape[2]
    if batch * seq * heads * head_dim == 0:  # nothing to rotate (D = 0 has no runs)
        return q_out, k_out
    runs_per_half = head_dim * q.element_size() // (2 * VECTOR_BYTES)
    if not kernels_take(views):  # torch's rotation, correct for any strides and sizes
        return torch_impl.rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids,
                                      interleaved, layout, -1.0 if inverse else 1.0)  # fmt: skip
    if cos is not None:
        cos, sin = (table_half(t, head_dim // 2, interleaved) for t in (cos, sin))
    if position_ids is not None:
        position_ids = position_ids.expand(batch, seq)
    # TVM-FFI launches on torch's current stream (capturable by a CUDA graph after a first call).
    tokens = tokens_per_block(views[0])
    threads = block_threads(heads, runs_per_half, tokens)
    specialisation = (q.dtype, None if cos is None else cos.dtype,
                      None if position_ids is None else position_ids.dtype, interleaved,
                      inverse)  # fmt: skip
    if table_path_fits(views, cos, sin, position_ids):
        kernel = compile_kernel(*specialisation, (head_dim, tokens))
        kernel(*views, cos, sin, position_ids, threads)
    else:
        kernel = compile_kernel(*specialisation)
        kernel(*views, cos, sin, inv_freq, position_ids, runs_per_half, tokens, threads)
    return q_out, k_out


def rope_forward(q, k, q_out, k_out, *, cos=None, sin=None, inv_freq=None, position_ids=None,
                 interleaved=False, layout="bshd"):  # fmt: skip
    return rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids, interleaved, layout,
                       False)  # fmt: skip


def rope_backward(dq, dk, dq_out, dk_out, *, cos=None, sin=None, inv_freq=None,
                  position_ids=None, interleaved=False, layout="bshd"):  # fmt: skip
    return rope_rotate(dq, dk, dq_out, dk_out, cos, sin, inv_freq, position_ids, interleaved,
                       layout, True)  # fmt: skip


_plumbing = model_plumbing("cute", rope_forward, rope_backward)
RoPEFunction, RotaryEmbedding = _plumbing.RoPEFunction, _plumbing.RotaryEmbedding
rope = _plumbing.rope
