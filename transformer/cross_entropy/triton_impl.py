"""cross-entropy forward and backward as Triton kernels, one program per row.

    lse = m + log sum_j exp(x_j - m)     loss = lse - x_t + eps (x_t - mean_j x_j)
    dx_j = dloss (exp(x_j - lse) - q_j),   q_j = (1 - eps) [j = t] + eps / V

A row of a vocabulary (V up to 262144) does not fit in registers, so
`cross_entropy_forward_kernel` streams it once in chunks of CHUNK lanes, each group of a 16-byte
load's lanes keeping an online max and sum of exp (and, with label smoothing, each lane the sum
of the logits), combines them in a fixed tree, and writes the row's float32 loss and lse: MN
elements read, the minimum.
`cross_entropy_backward_kernel` reads the row again with the saved lse and writes dx, in place
over the logits when asked: 2MN more. `reduce_loss` sums the M losses in one program over a
fixed tree (`loss_sum_kernel`), so the mean has the same bits every run (no atomics).
`row_loss_and_lse` and `write_row_gradient` are those two sweeps over one row.

The fused path (the default when autograd wants the gradient, README.md "The fused path"):
`cross_entropy_fused_kernel` runs both sweeps in one program, the gradient for dloss = 1 / count
('mean') or 1, into the logits' own buffer if asked; the backward (`scale_gradient_kernel`)
only multiplies by the incoming gradient, and leaves on the GPU where that is exactly 1.
`target_check_kernel` counts the kept rows and the bad targets, read back once per call.

exp(v) runs as exp2(v log2 e) (ex2.approx.ftz.f32), log(S) as log2(S) ln 2 (libdevice's
log2f, within 1 ulp: once a row, so the accurate one); README.md's bound uses both errors
and the rounding counts `forward_path` and `reduction_path` export.
"""

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

from reference import (
    REDUCTIONS,
    check_backward,
    check_dlogits,
    check_forward,
    check_reduction,
    check_target_range,
)
from torch_impl import (
    CrossEntropyLossModule,
    autograd_function,
    fused_when_differentiated,
    traceable_cross_entropy,
)

LOG2E = tl.constexpr(1.4426950408889634)  # exp(v) = exp2(v log2 e); rounded to float32
LN2 = tl.constexpr(0.6931471805599453)  # log(S) = log2(S) ln 2
# A chunk of 4096 float32 lanes over 8 warps is 16 values per thread for each lane statistic
# (max, sum, and the smoothing's sum of x): four 16-byte loads in flight, no spills.
CHUNK = 4096
CHUNK_WARPS = 8
# A group of the forward's lanes shares one running max: the elements of one 16-byte load, so
# that a group's max and sum stay in one thread's registers.
GROUP_BYTES = 16
SUM_CHUNK = 1024  # lanes of the loss sum: the M losses are read once by one program


@triton.jit
def pairwise_sum(values, LEVELS: tl.constexpr):
    """The sums of the rows of a [ROWS, 2**LEVELS] float32 block: add neighbours in pairs,
    LEVELS times, so each value passes through exactly LEVELS additions on the GPU and in the
    interpreter alike (tl.sum of a whole row would leave the tree to the compiler)."""
    for _ in tl.static_range(LEVELS):
        values = tl.sum(tl.reshape(values, [values.shape[0], values.shape[1] // 2, 2]), axis=2)
    return tl.sum(values, axis=1)  # one value per row is left: this adds nothing


@triton.jit
def exp_shifted(x, shift):
    """exp(x - shift) as exp2((x - shift) log2 e): subtract first, so the argument is exact up
    to a rounding relative to |x - shift|, whatever the size of x."""
    return tl.exp2((x - shift) * LOG2E)


@triton.jit
def finite_shift(row_max):
    """The shift for exp: the max, or 0 where the max is -inf (every logit so far masked): then
    exp(-inf - 0) = 0, and a row of -inf ends with log 0 = -inf, as the definition says."""
    return tl.where(row_max == float("-inf"), 0.0, row_max)


@triton.jit
def row_loss_and_lse(
    x_row, target, kept, n, stride_xn, label_smoothing, inverse_n, CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr, GROUP: tl.constexpr, LOG2_GROUP: tl.constexpr,
    SMOOTHING: tl.constexpr, EVICTION: tl.constexpr,
):  # fmt: skip
    """(loss, lse) of one row in float32, streaming it once; loss is 0 where not kept.
    EVICTION is the loads' L2 hint: "evict_last" when the row is read again right after."""
    offs = tl.arange(0, CHUNK).to(tl.int64)
    # Group g, GROUP adjacent lanes (a thread's 16-byte load), keeps the max and the sum of
    # exp(x - max) of the elements it has seen; a new max rescales the group's sum by
    # exp(old max - new max): one exp2 an element plus one a group, where a max per lane would
    # take two an element (the H200's exp unit would then take about as long as the row's
    # bytes). Lanes past n read -inf: they add 0.
    group_max = tl.full([CHUNK // GROUP], float("-inf"), tl.float32)
    group_sum = tl.zeros([CHUNK // GROUP], tl.float32)
    lane_total = tl.zeros([CHUNK], tl.float32)  # the sum of x, for label smoothing's mean
    for chunk in range(0, tl.cdiv(n, CHUNK)):
        cols = chunk * CHUNK + offs
        x = tl.load(
            x_row + cols * stride_xn, mask=cols < n, other=float("-inf"), eviction_policy=EVICTION
        ).to(tl.float32)
        groups = tl.reshape(x, [CHUNK // GROUP, GROUP])
        new_max = tl.maximum(group_max, tl.max(groups, axis=1))
        shift = finite_shift(new_max)
        terms = pairwise_sum(exp_shifted(groups, shift[:, None]), LOG2_GROUP)
        group_sum = group_sum * exp_shifted(group_max, shift) + terms
        group_max = new_max
        if SMOOTHING:
            lane_total += tl.where(cols < n, x, 0.0)
    shift = finite_shift(tl.max(group_max, axis=0))
    rescaled = group_sum * exp_shifted(group_max, shift)
    total_exp = tl.sum(pairwise_sum(rescaled[None, :], LOG2_CHUNK - LOG2_GROUP), axis=0)
    lse = shift + tl.log2(total_exp) * LN2
    # The target's logit, one more load of a line this program has just read (an ignored
    # row reads column 0 instead of its out-of-range target).
    target_logit = tl.load(x_row + tl.where(kept, target, 0) * stride_xn).to(tl.float32)
    loss = lse - target_logit
    if SMOOTHING:
        mean = tl.sum(pairwise_sum(lane_total[None, :], LOG2_CHUNK), axis=0) * inverse_n
        loss += label_smoothing * (target_logit - mean)
    return tl.where(kept, loss, 0.0), lse


@triton.jit
def write_row_gradient(
    x_row, dx_row, target, kept, lse, dloss, n, stride_xn, stride_dxn, smooth_weight,
    target_weight, CHUNK: tl.constexpr,
):  # fmt: skip
    """dx = dloss (exp(x - lse) - q) over one row, chunk by chunk from the last: after the
    forward's sweep, the row's most recently read chunks are the likeliest still in L2. x is
    read for the last time and dx not read here again: both marked first to leave L2. Each
    chunk is read before it is written, by this program alone: dx may be x itself."""
    offs, chunks = tl.arange(0, CHUNK).to(tl.int64), tl.cdiv(n, CHUNK)
    for chunk in range(0, chunks):
        cols = (chunks - 1 - chunk) * CHUNK + offs
        x = tl.load(
            x_row + cols * stride_xn, mask=cols < n, other=0.0, eviction_policy="evict_first"
        )
        q = tl.where(cols == target, target_weight, smooth_weight)
        # An ignored row writes exact zeros (its dloss may be 1/0 when every row is ignored).
        dx = tl.where(kept, (exp_shifted(x.to(tl.float32), lse) - q) * dloss, 0.0)
        dx = dx.to(dx_row.dtype.element_ty)
        tl.store(dx_row + cols * stride_dxn, dx, mask=cols < n, eviction_policy="evict_first")


@triton.jit
def cross_entropy_forward_kernel(
    x_ptr, target_ptr, loss_ptr, lse_ptr, n, stride_xm, stride_xn, stride_target, stride_loss,
    stride_lse, ignore_index, label_smoothing, inverse_n, CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    GROUP: tl.constexpr, LOG2_GROUP: tl.constexpr, SMOOTHING: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: M V passes 2**31 at a vocabulary
    target = tl.load(target_ptr + row * stride_target)
    loss, lse = row_loss_and_lse(
        x_ptr + row * stride_xm, target, target != ignore_index, n, stride_xn, label_smoothing,
        inverse_n, CHUNK, LOG2_CHUNK, GROUP, LOG2_GROUP, SMOOTHING, "",
    )  # fmt: skip
    tl.store(loss_ptr + row * stride_loss, loss)
    tl.store(lse_ptr + row * stride_lse, lse)


@triton.jit
def cross_entropy_backward_kernel(
    x_ptr, target_ptr, lse_ptr, dloss_ptr, dx_ptr, n, stride_xm, stride_xn, stride_target,
    stride_lse, stride_dloss, stride_dxm, stride_dxn, ignore_index, smooth_weight,
    target_weight, CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row * stride_target)
    write_row_gradient(
        x_ptr + row * stride_xm, dx_ptr + row * stride_dxm, target, target != ignore_index,
        tl.load(lse_ptr + row * stride_lse), tl.load(dloss_ptr + row * stride_dloss), n,
        stride_xn, stride_dxn, smooth_weight, target_weight, CHUNK,
    )  # fmt: skip


@triton.jit
def cross_entropy_fused_kernel(
    x_ptr, target_ptr, loss_ptr, lse_ptr, dx_ptr, n, stride_xm, stride_xn, stride_target,
    stride_loss, stride_lse, stride_dxm, stride_dxn, ignore_index, label_smoothing, inverse_n,
    divisor, smooth_weight, target_weight, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
    GROUP: tl.constexpr, LOG2_GROUP: tl.constexpr, SMOOTHING: tl.constexpr,
):  # fmt: skip
    """The forward, then at once the gradient for dloss = 1 / divisor (correctly rounded, as
    the unfused path's g / count for g = 1): the row's second sweep finds what L2 still holds
    of its first (README.md, "The fused path")."""
    row = tl.program_id(0).to(tl.int64)
    x_row, target = x_ptr + row * stride_xm, tl.load(target_ptr + row * stride_target)
    kept = target != ignore_index
    loss, lse = row_loss_and_lse(
        x_row, target, kept, n, stride_xn, label_smoothing, inverse_n, CHUNK, LOG2_CHUNK,
        GROUP, LOG2_GROUP, SMOOTHING, "evict_last",
    )  # fmt: skip
    tl.store(loss_ptr + row * stride_loss, loss)
    tl.store(lse_ptr + row * stride_lse, lse)
    # Every thread takes the stored lse back rather than its own: LLVM contracts the rescaling
    # products into the first adds of the warp's butterfly differently in different lanes, so
    # the lanes' lse may differ in the last bit, and dx must use the one the backward reads.
    tl.debug_barrier()  # the store is visible to the whole program
    lse = tl.load(lse_ptr + row * stride_lse)
    write_row_gradient(
        x_row, dx_ptr + row * stride_dxm, target, kept, lse, tl.math.div_rn(1.0, divisor), n,
        stride_xn, stride_dxn, smooth_weight, target_weight, CHUNK,
    )  # fmt: skip


@triton.jit
def scale_gradient_kernel(
    dx_ptr, target_ptr, grad_ptr, n, stride_dxm, stride_dxn, stride_target, stride_grad,
    ignore_index, CHUNK: tl.constexpr,
):  # fmt: skip
    """dx *= grad in place, row by row, where grad is not exactly 1 (loss.backward()'s grad is):
    then a program reads two scalars and leaves, and the row is never touched. Ignored rows
    stay exact zeros."""
    row = tl.program_id(0).to(tl.int64)
    grad = tl.load(grad_ptr + row * stride_grad).to(tl.float32)
    if (grad != 1.0) & (tl.load(target_ptr + row * stride_target) != ignore_index):
        dx_row, offs = dx_ptr + row * stride_dxm, tl.arange(0, CHUNK).to(tl.int64)
        for chunk in range(0, tl.cdiv(n, CHUNK)):
            cols = chunk * CHUNK + offs
            dx = tl.load(dx_row + cols * stride_dxn, mask=cols < n).to(tl.float32)
            dx = (dx * grad).to(dx_ptr.dtype.element_ty)
            tl.store(dx_row + cols * stride_dxn, dx, mask=cols < n)


@triton.jit
def target_check_kernel(
    target_ptr, counts_ptr, m, stride, ignore_index, n, CHUNK: tl.constexpr
):  # fmt: skip
    """counts = (rows kept, targets outside [0, n) that are not ignore_index): one program."""
    offs = tl.arange(0, CHUNK).to(tl.int64)
    kept_lanes, wrong_lanes = tl.zeros([CHUNK], tl.int32), tl.zeros([CHUNK], tl.int32)
    for chunk in range(0, tl.cdiv(m, CHUNK)):
        rows = chunk * CHUNK + offs
        target = tl.load(target_ptr + rows * stride, mask=rows < m, other=ignore_index)
        kept = target != ignore_index
        kept_lanes += kept.to(tl.int32)
        wrong_lanes += (kept & ((target < 0) | (target >= n))).to(tl.int32)
    tl.store(counts_ptr, tl.sum(kept_lanes, axis=0))
    tl.store(counts_ptr + 1, tl.sum(wrong_lanes, axis=0))


@triton.jit
def loss_sum_kernel(
    loss_ptr, total_ptr, m, stride, divisor, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr
):  # fmt: skip
    offs = tl.arange(0, CHUNK).to(tl.int64)
    lanes = tl.zeros([CHUNK], tl.float32)
    for chunk in range(0, tl.cdiv(m, CHUNK)):
        rows = chunk * CHUNK + offs
        lanes += tl.load(loss_ptr + rows * stride, mask=rows < m, other=0.0)
    total = tl.sum(pairwise_sum(lanes[None, :], LOG2_CHUNK), axis=0)
    # Correctly rounded (the mean's one u); the store rounds once more to total's dtype.
    total = tl.math.div_rn(total, divisor)
    tl.store(total_ptr, total.to(total_ptr.dtype.element_ty))


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes (see dot/triton_impl.py):
    numpy 2.4 refuses int() of a one-element array, which .item() does, and the interpreter's
    float32 <-> bfloat16 conversions truncate, which torch's exact conversions replace."""
    import numpy as np  # the interpreter's own dependency; the GPU path needs no numpy
    from triton.runtime import interpreter

    patch_tensor, convert = interpreter._patch_lang_tensor, interpreter._convert_float

    def patch_with_item(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

    def exact(values, src, dst, rounding_mode):
        values = np.ascontiguousarray(values)
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(values.view(np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy()
        if src == tl.bfloat16 and dst == tl.float32:
            return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16).float().numpy()
        return convert(values, src, dst, rounding_mode)

    interpreter._patch_lang_tensor, interpreter._convert_float = patch_with_item, exact


if INTERPRETED:
    patch_triton_interpreter()


def on_device_of(t):
    """Launch context for t: its GPU made current when it is not (the CPU under the interpreter)."""
    if t.is_cuda:
        if t.get_device() == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(t.device)
    if INTERPRETED:
        return contextlib.nullcontext()
    raise ValueError(
        f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}"
    )


def chunk_for(n):
    """The row chunk: CHUNK, or n's next power of two for shorter rows."""
    return min(CHUNK, 1 << (n - 1).bit_length())


def forward_path(n):
    """What README.md's bound counts on a term's way into the row's sum of exp: (exp2
    evaluations, float32 roundings after the exp): its own exp, a rescale per later chunk and
    one at the group combine; log2(group) levels of its group's tree, per later chunk a
    multiply and an add, the combine's multiply, then log2(chunk / group) levels: log2(chunk)
    tree levels in all, whatever the group. The smoothing's sum of x meets chunks - 1 + log2(chunk)
    additions (`tree_additions`)."""
    chunk = chunk_for(n)
    chunks = -(-n // chunk)
    return chunks + 1, 2 * (chunks - 1) + 1 + chunk.bit_length() - 1


def tree_additions(n, chunk):
    """Additions on a value's way into a lanes-then-tree sum of n values over chunk lanes."""
    return -(-n // chunk) - 1 + chunk.bit_length() - 1


def reduction_path(m):
    """Additions on a row loss's way into the sum over rows."""
    return tree_additions(m, SUM_CHUNK)


def kept_rows(logits, target, ignore_index):
    """The number of rows whose target is not ignore_index, read on the host from one kernel
    that also counts the targets outside [0, V): any of those raises here, before any other
    launch. The read is the call's one device-to-host sync (README.md, "Per-call cost")."""
    if target.shape[0] == 0:
        return 0
    counts = torch.empty(2, dtype=torch.int32, device=target.device)
    target_check_kernel[(1,)](
        target, counts, target.shape[0], target.stride(0), ignore_index, logits.shape[1],
        CHUNK=SUM_CHUNK,
    )  # fmt: skip
    kept, wrong = counts.tolist()
    if wrong:
        check_target_range(logits, target, ignore_index)  # the message names the first one
    return kept


def row_constants(logits, label_smoothing):
    """The constexprs of a kernel that computes the row's loss: chunk, group, smoothing."""
    chunk = chunk_for(logits.shape[1])
    group = min(GROUP_BYTES // logits.element_size(), chunk)
    return dict(
        CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, GROUP=group,
        LOG2_GROUP=group.bit_length() - 1, SMOOTHING=label_smoothing != 0, num_warps=CHUNK_WARPS,
    )  # fmt: skip


def q_values(label_smoothing, n):
    """q's two values, eps / V and 1 - eps + eps / V, each rounded once to float32 by the launch."""
    smooth_weight = label_smoothing / n
    return smooth_weight, 1.0 - label_smoothing + smooth_weight


def launch_rows(logits, target, ignore_index, label_smoothing, loss, lse, dlogits, divisor):
    """The forward kernel over every row, or with dlogits the fused one (dloss = 1 / divisor)."""
    (m, n), constants = logits.shape, row_constants(logits, label_smoothing)
    operands = (logits, target, loss, lse)
    strides = (*logits.stride(), target.stride(0), loss.stride(0), lse.stride(0))
    if m and dlogits is None:
        cross_entropy_forward_kernel[(m,)](
            *operands, n, *strides, ignore_index, label_smoothing, 1.0 / n, **constants
        )
    elif m:
        cross_entropy_fused_kernel[(m,)](
            *operands, dlogits, n, *strides, *dlogits.stride(), ignore_index, label_smoothing,
            1.0 / n, divisor, *q_values(label_smoothing, n), **constants,
        )  # fmt: skip


def cross_entropy_forward(logits, target, ignore_index, label_smoothing, loss, lse):
    check_forward(logits, target, ignore_index, label_smoothing, loss, lse, check_range=False)
    with on_device_of(logits):
        kept_rows(logits, target, ignore_index)
        launch_rows(logits, target, ignore_index, label_smoothing, loss, lse, None, 1.0)
    return loss, lse


def cross_entropy_backward(logits, target, lse, dloss, ignore_index, label_smoothing, dlogits):
    args = (logits, target, lse, dloss, ignore_index, label_smoothing, dlogits)
    check_backward(*args, check_range=False)
    m, n = logits.shape
    with on_device_of(logits):
        kept_rows(logits, target, ignore_index)
        if m:
            cross_entropy_backward_kernel[(m,)](
                logits, target, lse, dloss, dlogits, n, *logits.stride(), target.stride(0),
                lse.stride(0), dloss.stride(0), *dlogits.stride(), ignore_index,
                *q_values(label_smoothing, n), CHUNK=chunk_for(n), num_warps=CHUNK_WARPS,
            )  # fmt: skip
    return dlogits


def sum_rows(loss, total, divisor):
    """total = (the fixed-tree sum of loss) / divisor, correctly rounded, in total's dtype; no
    rows: 0 / divisor (the mean of nothing is NaN)."""
    if not loss.shape[0]:
        return total.fill_(0.0 / divisor if divisor else math.nan)
    loss_sum_kernel[(1,)](
        loss, total, loss.shape[0], loss.stride(0), divisor, CHUNK=SUM_CHUNK,
        LOG2_CHUNK=SUM_CHUNK.bit_length() - 1,
    )  # fmt: skip
    return total


def reduce_loss(loss, target, ignore_index, reduction):
    check_reduction(loss, target, ignore_index, reduction)
    if reduction == "none":
        return loss
    with on_device_of(loss):
        total = sum_rows(loss, torch.empty((), dtype=torch.float32, device=loss.device), 1.0)
    return total if reduction == "sum" else total / (target != ignore_index).sum()


def cross_entropy_fused(
    logits, target, ignore_index, label_smoothing, reduction, loss, lse, dlogits
):  # fmt: skip
    """(the reduced loss in the logits' dtype, lse, dlogits) in one pass over the logits, with
    dlogits the gradient of the reduced loss for a gradient of 1 (dloss_i = 1 / count for
    'mean', 1 otherwise): the loss is the graph's last op. dlogits may be logits itself; None
    runs the forward kernel alone (no gradient wanted), still without a device count."""
    check_forward(logits, target, ignore_index, label_smoothing, loss, lse, check_range=False)
    if dlogits is not None:
        inputs = (("logits", logits), ("target", target), ("loss", loss), ("lse", lse))
        check_dlogits(logits, dlogits, inputs)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    with on_device_of(logits):
        kept = kept_rows(logits, target, ignore_index)
        divisor = float(kept) if reduction == "mean" else 1.0  # exact below 2**24 rows
        launch_rows(logits, target, ignore_index, label_smoothing, loss, lse, dlogits, divisor)
        if reduction == "none":
            return loss.to(logits.dtype), lse, dlogits
        total = torch.empty((), dtype=logits.dtype, device=logits.device)
        return sum_rows(loss, total, divisor), lse, dlogits


def scale_gradient(dlogits, target, grad, ignore_index):
    """dlogits *= grad (a 0-dim gradient of the reduced loss, or one per row) in place, skipping
    on the GPU the rows whose grad is exactly 1: no host read of grad."""
    m, n = dlogits.shape
    if m:
        grad = grad.expand(m)  # a 0-dim grad: stride 0
        with on_device_of(dlogits):
            scale_gradient_kernel[(m,)](
                dlogits, target, grad, n, *dlogits.stride(), target.stride(0), grad.stride(0),
                ignore_index, CHUNK=chunk_for(n), num_warps=CHUNK_WARPS,
            )  # fmt: skip
    return dlogits


CrossEntropyFunction = autograd_function(cross_entropy_forward, cross_entropy_backward, reduce_loss)
cross_entropy = traceable_cross_entropy(
    "triton", cross_entropy_forward, cross_entropy_backward, reduce_loss,
    fused_when_differentiated(cross_entropy_fused, scale_gradient),
)  # fmt: skip


class CrossEntropyLoss(CrossEntropyLossModule):
    """Drop-in for torch.nn.CrossEntropyLoss, on this file's cross_entropy."""

    loss_function = staticmethod(cross_entropy)
