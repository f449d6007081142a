"""Tests for cross_entropy: every implementation, forward, reduction and backward, lands within
README.md's bound.

Run with `python test.py` (or from the top with pytest). Without a GPU, torch runs on the CPU and
Triton under its interpreter; the CuTe kernels are compiled for sm_90a and their PTX read (launching
them needs the GPU: those tests skip and say so).
"""

import ctypes
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # what cute.compile builds for

import reference
import torch_impl
import triton_impl

try:
    from common.tolerance import (
        APPROX_RELATIVE_ERROR,
        assert_same_bits,
        assert_within_bound,
        gamma,
        store_roundoff,
        underflow,
        unit_roundoff,
    )
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not "
        f"two levels up: copy the course's common/ folder to {HERE.parent.parent / 'common'}"
    ) from error

try:
    import cute_impl

    CUTE_MISSING = None
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUTE_CANNOT_LAUNCH = CUTE_MISSING or (
    None if ON_GPU else "launching a CuTe kernel needs a CUDA GPU; section (4) checks the builds"
)
CUTE = pytest.param(
    "cute", marks=pytest.mark.skipif(bool(CUTE_CANNOT_LAUNCH), reason=str(CUTE_CANNOT_LAUNCH))
)
IMPLS = ["torch", "triton", CUTE]
MODULES = {"torch": torch_impl, "triton": triton_impl, "cute": cute_impl}
# (M, V): no rows, 1, primes, 2**k +- 1, a chunk's edges (4096) and several chunks.
SHAPES = [(0, 5), (1, 1), (2, 3), (7, 31), (3, 128), (5, 129), (2, 4095), (3, 4097), (2, 9001)]
REFERENCE_MAX_ELEMS = 2**17  # past this, plain Python is slow: the float64 stand-in takes over
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny  # ex2.approx.ftz flushes results below it to 0
EX2 = APPROX_RELATIVE_ERROR["ex2.approx.ftz.f32"]
# tl.log2 compiles to libdevice's __nv_log2f (the PTX holds no lg2.approx): at most 1 ulp, a
# relative 2u, by the CUDA Math API's table; torch's log is as good. With the float32 ln 2 and
# the product's rounding, L = log2(S) ln 2 meets a relative gamma_4.
LOG_ROUNDINGS = 4
LOG2E = 1 / math.log(2)
each_impl = pytest.mark.parametrize("impl", IMPLS)
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def forward_path(impl, n):
    """(exp evaluations, roundings) on a term's way into the row's sum of exp, and the additions
    on a logit's way into the smoothing's sum: torch sums in an undocumented order, possibly
    rescaling online, so what holds for any order."""
    if impl == "torch":
        return n + 1, 2 * n, n
    if impl == "cute":
        return (*cute_impl.forward_path(n), cute_impl.smoothing_path(n))
    chunk = triton_impl.chunk_for(n)
    return (*triton_impl.forward_path(n), triton_impl.tree_additions(n, chunk))


def lse_bound(impl, x, lse):
    """README.md's bound on |lse_hat - lse| per row, from x's float64 rows and the exact lse:
    beta = sum_j p_j rho_j + n (E + K) tiny                 (the sum's relative error)
    |L_hat - ln S| <= d1 + gamma_4 (ln S + d1),   d1 = -ln(1 - beta)
    |lse_hat - lse| <= e_L + u (|lse| + e_L)"""
    n = x.shape[1]
    exp_calls, roundings, _ = forward_path(impl, n)
    m = x.max(dim=1, keepdim=True).values
    shifted = x - m
    t = torch.where(torch.isfinite(shifted), shifted.abs() * LOG2E, torch.zeros_like(shifted))
    rho = torch.exp2(gamma(3, U32) * t) * (1 + EX2) ** exp_calls * (1 + U32) ** roundings - 1
    p = torch.exp(x - lse[:, None])
    beta = (p * rho).nan_to_num().sum(dim=1) + n * (exp_calls + roundings) * TINY32
    d1 = -torch.log1p(-beta)
    log_s = (lse - m[:, 0]).nan_to_num(0.0)
    e_l = d1 + gamma(LOG_ROUNDINGS, U32) * (log_s + d1)
    return e_l + U32 * (lse.abs().nan_to_num(0.0) + e_l)


def loss_bound(impl, x, target, lse, loss, ignore_index, eps):
    """README.md's bound on |loss_hat - loss| per row (0 on ignored rows, written exactly)."""
    e_lse = lse_bound(impl, x, lse)
    kept = target != ignore_index
    x_t = x.gather(1, torch.where(kept, target, 0)[:, None])[:, 0]
    base = (lse - x_t).abs()
    e_base = e_lse + U32 * (base + e_lse)
    e_smooth = torch.zeros_like(e_base)
    if eps:
        n, additions = x.shape[1], forward_path(impl, x.shape[1])[2]
        e_mean = gamma(additions + 2, U32) * x.abs().sum(dim=1) / n
        d = (x_t - x.mean(dim=1)).abs()
        e_d = e_mean + U32 * (d + e_mean)
        e_smooth = eps * e_d + gamma(2, U32) * eps * (d + e_d)
    bound = e_base + e_smooth + U32 * (loss.abs() + e_base + e_smooth)
    return torch.where(kept, bound, 0.0)


def backward_bound(x, target, lse, dloss, exact, ignore_index, eps, dtype, lse_error=0.0):
    """README.md's bound on |dx_hat - dx| for the given lse (off from the exact one by at most
    lse_error) and dloss: p_j = exp(x_j - lse), t_j = |x_j - lse| log2 e,
        D_j = p_j (2**(gamma_3 t_j) e**lse_error (1 + EX2) - 1) + tiny + 2u q_j
        |dx_hat_j - dx_j| <= |g| (D_j + u (|p_j - q_j| + D_j)) (1 + u) + u |dx_j| + tiny u
    then the store's rounding."""
    n = x.shape[1]
    kept = target != ignore_index
    arg = x - lse[:, None]
    p = torch.exp(arg)
    t = torch.where(torch.isfinite(arg), arg.abs() * LOG2E, torch.zeros_like(arg))
    q = torch.full_like(x, eps / n)
    q.scatter_(1, torch.where(kept, target, 0)[:, None], 1 - eps + eps / n)
    factor = torch.exp2(gamma(3, U32) * t) * math.exp(lse_error) * (1 + EX2) - 1
    big_d = p * factor + TINY32 + 2 * U32 * q
    g = dloss.abs()[:, None]
    bound = g * (big_d + U32 * ((p - q).abs() + big_d)) * (1 + U32) + U32 * exact.abs()
    bound = bound + TINY32 * U32
    u_s = store_roundoff(dtype)
    bound = u_s * exact.abs() + (1 + u_s) * bound + underflow(dtype)
    return torch.where(kept[:, None], bound, 0.0)


def float64_forward(x, target, ignore_index, eps):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    x = x.double().cpu()
    lse = torch.logsumexp(x, dim=1)
    kept = target.cpu() != ignore_index
    x_t = x.gather(1, torch.where(kept, target.cpu(), 0).long()[:, None])[:, 0]
    loss = lse - (1 - eps) * x_t - eps * x.mean(dim=1)
    return torch.where(kept, loss, 0.0), lse


def float64_backward(x, target, lse, dloss, ignore_index, eps):
    x, target = x.double().cpu(), target.cpu().long()
    kept = target != ignore_index
    q = torch.full_like(x, eps / x.shape[1])
    q.scatter_(1, torch.where(kept, target, 0)[:, None], 1 - eps + eps / x.shape[1])
    dx = (torch.exp(x - lse.double().cpu()[:, None]) - q) * dloss.double().cpu()[:, None]
    return torch.where(kept[:, None], dx, 0.0)


def exact_forward(x, target, ignore_index=-100, eps=0.0):
    if x.numel() > REFERENCE_MAX_ELEMS:
        return float64_forward(x, target, ignore_index, eps)
    return reference.cross_entropy_forward(x.cpu(), target.cpu(), ignore_index, eps)


def exact_backward(x, target, lse, dloss, ignore_index=-100, eps=0.0):
    if x.numel() > REFERENCE_MAX_ELEMS:
        return float64_backward(x, target, lse, dloss, ignore_index, eps)
    args = (x.cpu(), target.cpu(), lse.cpu(), dloss.cpu(), ignore_index, eps)
    return reference.cross_entropy_backward(*args)


def random_logits(m, n, dtype, scale=2.0):
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def random_targets(m, n, ignored=0.25):
    """Random classes, about `ignored` of them ignore_index (-100)."""
    target = torch.randint(0, max(n, 1), (m,), device=DEVICE)
    return torch.where(torch.rand(m, device=DEVICE) < ignored, -100, target)


def assert_forward_within_bound(impl, x, target, eps, ignore_index, loss, lse):
    """The row losses and lse against the exact ones; returns (exact loss, its row bounds)."""
    exact_loss, exact_lse = exact_forward(x, target, ignore_index, eps)
    x64, t = x.double().cpu(), target.cpu().long()
    assert_within_bound(lse, exact_lse, lse_bound(impl, x64, exact_lse), f"{impl} lse")
    bound = loss_bound(impl, x64, t, exact_lse, exact_loss, ignore_index, eps)
    assert_within_bound(loss, exact_loss, bound, f"{impl} loss")
    return exact_loss, bound


def check_forward(impl, x, target, eps=0.0, ignore_index=-100, loss=None, lse=None):
    m = x.shape[0]
    loss = torch.empty(m, device=DEVICE) if loss is None else loss
    lse = torch.empty(m, device=DEVICE) if lse is None else lse
    got = MODULES[impl].cross_entropy_forward(x, target, ignore_index, eps, loss, lse)
    assert got[0] is loss and got[1] is lse
    assert_forward_within_bound(impl, x, target, eps, ignore_index, loss, lse)
    return loss, lse


def assert_backward_within_bound(impl, x, target, lse, dloss, eps, ignore_index, dx):
    exact = exact_backward(x, target, lse, dloss, ignore_index, eps)
    args = (x.double().cpu(), target.cpu().long(), lse.double().cpu(), dloss.double().cpu())
    bound = backward_bound(*args, exact, ignore_index, eps, x.dtype)
    assert_within_bound(dx, exact, bound, f"{impl} dlogits")


def check_backward(impl, x, target, lse, dloss, eps=0.0, ignore_index=-100, out=None):
    out = torch.empty_like(x) if out is None else out
    fns = MODULES[impl]
    assert fns.cross_entropy_backward(x, target, lse, dloss, ignore_index, eps, out) is out
    assert_backward_within_bound(impl, x, target, lse, dloss, eps, ignore_index, out)
    return out


def reduced_bound(impl, exact_loss, row_bounds, target, reduction, dtype):
    """(the exact reduced loss, README.md's bound on it): the row bounds summed, gamma of
    reduction_path times the sum of |loss|, the mean's division, the store to dtype."""
    exact, bound = exact_loss, row_bounds
    if reduction != "none":
        m = exact_loss.shape[0]
        exact = torch.tensor(math.fsum(exact_loss.tolist()), dtype=torch.float64)
        k = m if impl == "torch" else MODULES[impl].reduction_path(m)
        bound = row_bounds.sum() + gamma(k, U32) * (exact_loss.abs().sum() + row_bounds.sum())
        if reduction == "mean":
            count = int((target != -100).sum())
            exact, bound = exact / count, bound / count * (1 + U32) + U32 * abs(exact) / count
    u_s = store_roundoff(dtype)
    return exact, u_s * exact.abs() + (1 + u_s) * bound + underflow(dtype)


def guarded_outputs(m, n, dtype, margin=5):
    """(loss, lse, dlogits, untouched): views inside NaN-filled buffers, and a check that
    nothing outside them changed."""
    rows = torch.full((2, m + 2 * margin), math.nan, device=DEVICE)
    grid = torch.full((m + 2, n + 2 * margin), math.nan, device=DEVICE, dtype=dtype)
    outside = torch.ones_like(grid, dtype=torch.bool)
    outside[1 : m + 1, margin : margin + n] = False

    def untouched():
        assert rows[:, :margin].isnan().all() and rows[:, margin + m :].isnan().all()
        assert grid[outside].isnan().all()

    loss, lse = rows[0, margin : margin + m], rows[1, margin : margin + m]
    return loss, lse, grid[1 : m + 1, margin : margin + n], untouched


def assert_rejects(wrongs, exact, bound):
    for wrong in wrongs:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.float(), exact, bound)
    assert_within_bound(exact.float(), exact, bound)


# (2) The contract over every implementation ---------------------------------------------------


@each_impl
@each_dtype
@pytest.mark.parametrize("m, n", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_matches_reference(impl, dtype, m, n, eps):
    x, target = random_logits(m, n, dtype), random_targets(m, n)
    loss, lse = check_forward(impl, x, target, eps)
    check_backward(impl, x, target, lse, torch.randn(m, device=DEVICE), eps)


@each_impl
def test_strided_operands(impl):
    """Logits as a slice of wider rows, a column step, a transpose; target, loss, lse and dloss
    strided (dloss a stride-0 broadcast, as the mean's gradient is)."""
    wide = random_logits(5, 3 * 700, torch.bfloat16)
    target = random_targets(10, 700)[::2]
    for x in (wide[:, 11:711], wide[:, ::3], random_logits(700, 5, torch.bfloat16).t()):
        loss, lse = torch.empty(5, 2, device=DEVICE)[:, 0], torch.empty(5, 3, device=DEVICE)[:, 1]
        check_forward(impl, x, target, 0.1, loss=loss, lse=lse)
        check_backward(impl, x, target, lse, torch.tensor(0.3, device=DEVICE).expand(5), 0.1)


@each_impl
@each_dtype
def test_outputs_inside_guard(impl, dtype):
    """loss, lse and dlogits are views into NaN: every element is written, nothing else moves."""
    m, n = 3, 4099
    x, target = random_logits(m, n, dtype), random_targets(m, n)
    loss, lse, dx, untouched = guarded_outputs(m, n, dtype)
    check_forward(impl, x, target, loss=loss, lse=lse)
    check_backward(impl, x, target, lse, torch.randn(m, device=DEVICE), out=dx)
    untouched()


@each_impl
def test_backward_in_place(impl):
    """dlogits may be the logits themselves: each element is read before it is written."""
    x, target = random_logits(4, 5001, torch.float32), random_targets(4, 5001)
    loss, lse = check_forward(impl, x, target)
    assert check_backward(impl, x.clone(), target, lse, torch.randn(4, device=DEVICE)) is not x
    dloss = torch.randn(4, device=DEVICE)
    expected = MODULES[impl].cross_entropy_backward(
        x, target, lse, dloss, -100, 0.0, torch.empty_like(x)
    )
    in_place = MODULES[impl].cross_entropy_backward(x, target, lse, dloss, -100, 0.0, x)
    assert in_place is x
    assert_same_bits(in_place, expected)


@each_impl
def test_special_values(impl):
    """-inf logits (masked classes) add nothing; a NaN or +inf makes the row's loss NaN; 1e4
    logits do not overflow; all as torch.nn.functional.cross_entropy says."""
    n = 300
    x = random_logits(5, n, torch.float32)
    x[0, ::3] = -math.inf
    x[1, 17] = math.inf
    x[2, 40] = math.nan
    x[3] = 1e4 * torch.randn(n, device=DEVICE)
    target = torch.tensor([1, 2, 3, 4, 5], device=DEVICE)
    loss, _ = check_forward(impl, x, target)
    theirs = torch.nn.functional.cross_entropy(x, target, reduction="none")
    assert torch.equal(loss.isnan(), theirs.isnan()) and loss[[1, 2]].isnan().all()


@each_impl
def test_all_ignored_mean_is_nan_like_torch(impl):
    """A batch whose every row is ignored: the mean over zero rows is 0/0 = NaN (torch's answer),
    the sum 0, and the gradient exact zeros."""
    x = random_logits(3, 50, torch.float32).requires_grad_()
    target = torch.full((3,), -100, device=DEVICE)
    loss = MODULES[impl].cross_entropy(x, target)
    assert loss.isnan() and torch.nn.functional.cross_entropy(x, target).isnan()
    loss.backward()
    assert (x.grad == 0).all()
    assert MODULES[impl].cross_entropy(x.detach(), target, reduction="sum") == 0


@each_impl
@pytest.mark.parametrize("reduction", reference.REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reductions(impl, reduction, dtype):
    """cross_entropy(...) against the exact reduction of the exact losses: the row bounds summed,
    gamma(reduction_path) of the sum of |loss|, the mean's division, the store to dtype."""
    m, n, eps = 1500, 37, 0.1
    x, target = random_logits(m, n, dtype), random_targets(m, n)
    got = MODULES[impl].cross_entropy(x, target, reduction=reduction, label_smoothing=eps)
    exact_loss, exact_lse = exact_forward(x, target, -100, eps)
    rows = loss_bound(impl, x.double().cpu(), target.cpu(), exact_lse, exact_loss, -100, eps)
    exact, bound = reduced_bound(impl, exact_loss, rows, target.cpu(), reduction, dtype)
    assert got.dtype == dtype
    assert_within_bound(got, exact, bound, f"{impl} {reduction}")


@each_impl
def test_repeatability(impl):
    """Two runs give the same bits: every sum is a fixed tree, the mean included (Triton: the
    fused path, as the logits need a gradient)."""
    x, target = random_logits(700, 3001, torch.bfloat16), random_targets(700, 3001)
    fns = MODULES[impl]
    runs = []
    for _ in range(2):
        logits = x.clone().requires_grad_()
        loss = fns.cross_entropy(logits, target, label_smoothing=0.1)
        loss.backward()
        runs.append((loss.detach(), logits.grad))
    for first, second in zip(*runs, strict=True):
        assert_same_bits(first, second)


def bad_inputs():
    """(operands of the forward, expected error, words the message must contain)"""
    x, t = torch.randn(3, 5, device=DEVICE), torch.tensor([0, 1, 4], device=DEVICE)
    rows = lambda: torch.empty(3, device=DEVICE)  # noqa: E731
    yield (x.tolist(), t, -100, 0.0, rows(), rows()), TypeError, "logits must be a torch"
    yield (x[0], t, -100, 0.0, rows(), rows()), ValueError, "an .M, V. matrix"
    yield (x.double(), t, -100, 0.0, rows(), rows()), TypeError, "supported: float32"
    yield (x, t.float(), -100, 0.0, rows(), rows()), TypeError, "target has dtype"
    yield (x, t[:2], -100, 0.0, rows(), rows()), ValueError, "target has 2 rows"
    yield (x, torch.tensor([0, 5, 1]), -100, 0.0, rows(), rows()), ValueError, "holds 5"
    yield (x, torch.tensor([0, -1, 1]), -100, 0.0, rows(), rows()), ValueError, "holds -1"
    yield (x, t, -100, 1.5, rows(), rows()), ValueError, "label_smoothing"
    yield (x, t, -100, 0.0, rows().half(), rows()), TypeError, "loss has dtype"
    yield (x, t, -100, 0.0, rows(), torch.empty(4, device=DEVICE)), ValueError, "lse has 4"
    shared = rows()
    yield (x, t, -100, 0.0, shared, shared), ValueError, "loss overlaps lse"


# CuTe's checks run before anything needs the GPU, so they are tested without one too.
@pytest.mark.parametrize("impl", ["torch", "triton", CUTE if CUTE_MISSING else "cute"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    operands, error, words = case
    if ON_GPU and not operands[1].is_cuda:
        operands = (operands[0], operands[1].to(DEVICE), *operands[2:])
    before = [t.clone() for t in operands[4:]]
    with pytest.raises(error, match=words):
        MODULES[impl].cross_entropy_forward(*operands)
    for t, b in zip(operands[4:], before, strict=True):
        assert_same_bits(t, b, "an output after a rejected call")


def test_backward_rejects_partial_overlap():
    x, t = torch.randn(3, 10, device=DEVICE), torch.tensor([0, 1, 4], device=DEVICE)
    row = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match="dlogits overlaps logits"):
        triton_impl.cross_entropy_backward(x[:, :8], t, row, row, -100, 0.0, x[:, 2:])


@each_dtype
def test_negative_controls(dtype):
    """The bounds reject plausible bugs. Two logits per row are pinned at 6 (rows' maxima
    differ): the loss with the neighbour row's target logit, with the neighbour row's max as
    the shift, or with one (large) term dropped from the sum; dx with the neighbour's lse or
    the one-hot at the neighbour's target."""
    x = random_logits(4, 1024, dtype).cpu()
    x[:, 10], x[:, 500] = 6.0, torch.tensor([6.0, 7.0, 6.5, 5.5]).to(dtype)
    target = torch.tensor([3, 500, 77, 10])
    exact_loss, exact_lse = reference.cross_entropy_forward(x, target)
    x64 = x.double()
    bound = loss_bound("triton", x64, target, exact_lse, exact_loss, -100, 0.0)
    x_t = x64.gather(1, target[:, None])[:, 0]
    m = x64.max(dim=1).values
    s = torch.exp(x64 - m[:, None]).sum(dim=1)
    wrongs = [
        exact_lse - x_t.roll(1),
        m.roll(1) + torch.log(s) - x_t,
        m + torch.log(s - torch.exp(x64[:, 10] - m)) - x_t,
    ]
    assert_rejects(wrongs, exact_loss, bound)
    lse, dloss = exact_lse.float(), torch.randn(4)
    exact = reference.cross_entropy_backward(x, target, lse, dloss)
    bound = backward_bound(x64, target, lse.double(), dloss.double(), exact, -100, 0.0, dtype)
    wrong_dx = [
        float64_backward(x, target, lse.roll(1), dloss, -100, 0.0),
        float64_backward(x, target.roll(1), lse, dloss, -100, 0.0),
    ]
    for wrong in wrong_dx:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.to(dtype), exact, bound)
    assert_within_bound(exact.to(dtype), exact, bound)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_reference_backward_matches_autograd(eps):
    """The hand-derived backward (README.md) against float64 torch.autograd of
    torch.nn.functional.cross_entropy, with reduction 'none' and a random dloss."""
    x = torch.randn(5, 37, dtype=torch.float64, requires_grad=True)
    target, dloss = torch.tensor([0, -100, 36, 7, 3]), torch.randn(5, dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(x, target, reduction="none", label_smoothing=eps)
    loss.backward(dloss)
    lse = torch.logsumexp(x.detach(), dim=1)
    x32, lse32, dloss32 = x.detach().float(), lse.float(), dloss.float()
    ours = reference.cross_entropy_backward(x32, target, lse32, dloss32, -100, eps)
    # ours saw x, lse and dloss rounded to float32: a relative 8u on each term is plenty.
    p = torch.exp(x.detach() - lse[:, None])
    slack = 8 * U32 * (x.grad.abs() + dloss.abs()[:, None] * (1 + p))
    assert_within_bound(ours, x.grad, slack)


# Autograd, the module, the custom ops and torch.compile


@each_impl
@pytest.mark.parametrize("reduction", reference.REDUCTIONS)
def test_module_matches_torch_module(impl, reduction):
    """CrossEntropyLoss(ignore_index, reduction, label_smoothing) takes torch's arguments, and
    its loss and gradient match the reference's (the gradient's bound counts the lse's error)."""
    fns = MODULES[impl]
    ours = fns.CrossEntropyLoss(reduction=reduction, label_smoothing=0.1, ignore_index=-1)
    theirs = torch.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=0.1, ignore_index=-1)
    assert ours.state_dict() == theirs.state_dict() == {}
    x = random_logits(6, 257, torch.float32).requires_grad_()
    target = torch.tensor([1, -1, 256, 0, 9, -1], device=DEVICE)
    loss = ours(x, target)
    reference_loss = theirs(x.double(), target)
    assert loss.shape == reference_loss.shape
    grad = torch.randn(loss.shape, device=DEVICE)
    loss.backward(grad)
    exact_loss, exact_lse = exact_forward(x.detach(), target, -1, 0.1)
    count = int((target != -1).sum())
    dloss = {"none": grad, "sum": grad.expand(6), "mean": (grad / count).expand(6)}[reduction]
    exact = float64_backward(x.detach(), target, exact_lse, dloss, -1, 0.1)
    e_lse = float(lse_bound(impl, x.detach().double().cpu(), exact_lse).max())
    args = (x.detach().double().cpu(), target.cpu(), exact_lse, dloss.double().cpu(), exact)
    bound = backward_bound(*args, -1, 0.1, torch.float32, lse_error=e_lse)
    bound += U32 * exact.abs()  # the mean's dloss = g / count, rounded once
    assert_within_bound(x.grad, exact, bound, f"{impl} gradient")
    with pytest.raises(TypeError, match="class weights"):
        fns.CrossEntropyLoss(weight=torch.ones(3))


@each_impl
def test_in_place_backward_overwrites_logits(impl):
    """in_place_backward=True: the gradient is the logits' own buffer, with the bits the
    out-of-place backward gives."""
    fns = MODULES[impl]
    x, target = random_logits(5, 300, torch.bfloat16), random_targets(5, 300)
    leaf = x.clone().requires_grad_()
    fns.cross_entropy(leaf, target).backward()
    logits = x.clone().requires_grad_()
    projected = logits * 1  # a non-leaf, as a model's last matmul output would be
    fns.cross_entropy(projected, target, in_place_backward=True).backward()
    assert_same_bits(logits.grad, leaf.grad)


@pytest.mark.parametrize("impl", ["triton", CUTE])
def test_torch_compile_fullgraph(impl):
    """torch.compile(fullgraph=True) traces a model that calls the kernels' loss (the custom
    op), forward and backward, without graph breaks, and computes what eager computes: the same
    loss bits, and the gradient of the logits inside the backward's bound both ways (Triton's
    eager call runs the fused kernel and the traced op the unfused pair, whose gradients may
    differ in the last bit: check_fused)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 33).to(DEVICE)
    loss_fn = MODULES[impl].CrossEntropyLoss(label_smoothing=0.1)
    x, target = torch.randn(8, 16, device=DEVICE), random_targets(8, 33)

    def step(inputs):
        return loss_fn(linear(inputs), target)

    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    compiled_loss = compiled(x)
    assert_same_bits(compiled_loss, step(x))
    (weight_grad,) = torch.autograd.grad(compiled_loss, linear.weight)  # the traced backward runs
    assert weight_grad.isfinite().all()
    # The logits' gradient, eager and traced, each inside the backward's bound.
    logits = linear(x).detach()
    rows = [torch.empty(8, device=DEVICE) for _ in range(2)]
    _, lse = MODULES[impl].cross_entropy_forward(logits, target, -100, 0.1, *rows)
    dloss = fused_dloss(target, "mean")
    loss_of_logits = lambda z: loss_fn(z, target)  # noqa: E731
    for run in (loss_of_logits, torch.compile(loss_of_logits, fullgraph=True, backend=backend)):
        leaf = logits.clone().requires_grad_()
        (dlogits,) = torch.autograd.grad(run(leaf), leaf)
        assert_backward_within_bound(impl, logits, target, lse, dloss, 0.1, -100, dlogits)


# (3) Triton builds: the chunk and the path counts, the fused path ----------------------------


def test_chunk_and_paths():
    assert triton_impl.chunk_for(1) == 1 and triton_impl.chunk_for(5000) == triton_impl.CHUNK
    assert triton_impl.forward_path(4096) == (2, 13)  # one chunk: exp, combine, 12 tree levels
    assert triton_impl.reduction_path(1024) == 10


# Built for sm_90a (pointers, n and the row strides divisible by 16 and unit column strides, as a
# launch specialises them), in a child process: under TRITON_INTERPRET=1 nothing compiles.
FUSED_PTX_SCRIPT = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl

def counts(element, group, smoothing):
    kernel = triton_impl.cross_entropy_fused_kernel
    constexprs = {"stride_xn": 1, "stride_dxn": 1, "CHUNK": 4096, "LOG2_CHUNK": 12,
                  "GROUP": group, "LOG2_GROUP": group.bit_length() - 1, "SMOOTHING": smoothing}
    kinds = {"x_ptr": "*" + element, "dx_ptr": "*" + element, "target_ptr": "*i64",
             "loss_ptr": "*fp32", "lse_ptr": "*fp32", "label_smoothing": "fp32",
             "inverse_n": "fp32", "divisor": "fp32", "smooth_weight": "fp32",
             "target_weight": "fp32"}
    signature = {name: "constexpr" if name in constexprs else kinds.get(name, "i32")
                 for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*") or name in ("n", "stride_xm", "stride_dxm")}
    source = ASTSource(kernel, signature, constexprs, aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": triton_impl.CHUNK_WARPS}).asm["ptx"]
    patterns = {"kept loads": r"ld\\.global\\.L1::evict_last\\.L2::cache_hint\\.v4",
                "last loads": r"ld\\.global\\.L1::evict_first\\.L2::cache_hint\\.v4",
                "stores": r"st\\.global\\.L1::evict_first\\.L2::cache_hint\\.v4",
                "ex2": r"ex2\\.approx", "spills": r"\\.local", "div": r"div\\.rn\\.f32"}
    return {name: len(re.findall(pattern, ptx)) for name, pattern in patterns.items()}

print(json.dumps({f"{e} {s}": counts(e, g, s) for e, g in (("bf16", 8), ("fp32", 4))
                  for s in (False, True)}))
"""


def test_fused_kernel_ptx():
    """The fused kernel as README.md describes it: per thread and chunk, 16 elements in 16-byte
    loads marked evict_last (the first sweep), the same again marked evict_first (the second)
    and 16-byte stores marked evict_first; 16 ex2 in the first sweep plus one per group of the
    thread's for its rescale and one at the final combine, 16 in the second; dloss = 1 / divisor
    correctly rounded; no spills."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", FUSED_PTX_SCRIPT],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    for name, found in json.loads(child.stdout).items():
        vectors = {"bf16": 2, "fp32": 4}[name.split()[0]]  # 16 elements of 8 or 4 a vector
        groups = 16 // {"bf16": 8, "fp32": 4}[name.split()[0]]
        assert found["kept loads"] == found["last loads"] == found["stores"] == vectors, name
        assert found["ex2"] == 16 + 2 * groups + 16 and found["div"] >= 1, name
        assert found["spills"] == 0, name


# The fused path: the forward that writes the gradient too, and the backward that scales it

# Each shape of SHAPES with one reduction, the three in turn (test_fused_reductions: all three).
FUSED_CASES = [(*shape, reference.REDUCTIONS[k % 3]) for k, shape in enumerate(SHAPES)]


def fused_dloss(target, reduction):
    """The dloss the fused kernel assumes, float32 (M,): row_gradient of a gradient of 1."""
    ones = torch.ones(target.shape if reduction == "none" else (), device=DEVICE)
    return torch_impl.row_gradient(ones, target, -100, reduction)


def check_fused(x, target, eps, reduction, outputs=None, in_place=False):
    """cross_entropy_fused against the reference: loss and lse within the forward's bound and
    with the unfused forward's bits, dx within the backward's bound at the dloss it assumes, the
    reduced loss within its bound, and dx with the unfused backward's bits at that dloss (the
    fused kernel reads back the lse it stored: its lanes' own may differ in the last bit).
    Returns dx."""
    m = x.shape[0]
    new_rows, new_dx = (lambda: torch.empty(m, device=DEVICE)), (lambda: torch.empty_like(x))
    logits = x.clone() if in_place else x  # x stays: the reference reads it afterwards
    loss, lse, dx = outputs or (new_rows(), new_rows(), new_dx())
    dx = logits if in_place else dx
    got = triton_impl.cross_entropy_fused(logits, target, -100, eps, reduction, loss, lse, dx)
    assert got[1] is lse and got[2] is dx and got[0].dtype == x.dtype
    exact_loss, rows = assert_forward_within_bound("triton", x, target, eps, -100, loss, lse)
    if reduction == "mean" and not (target != -100).any():
        assert got[0].isnan()  # 0 / 0, as torch says (test_all_ignored_mean_is_nan_like_torch)
    else:
        exact, bound = reduced_bound("triton", exact_loss, rows, target.cpu(), reduction, x.dtype)
        assert_within_bound(got[0], exact, bound, f"fused {reduction} loss")
    dloss = fused_dloss(target, reduction)
    assert_backward_within_bound("triton", x, target, lse, dloss, eps, -100, dx)
    unfused = triton_impl.cross_entropy_forward(x, target, -100, eps, new_rows(), new_rows())
    assert_same_bits(loss, unfused[0], "fused loss")
    assert_same_bits(lse, unfused[1], "fused lse")
    unfused_dx = triton_impl.cross_entropy_backward(
        x, target, unfused[1], dloss, -100, eps, torch.empty_like(x)
    )
    assert_same_bits(dx, unfused_dx, "fused dx")
    return dx


@each_dtype
@pytest.mark.parametrize("m, n, reduction", FUSED_CASES, ids=str)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_matches_reference(dtype, m, n, reduction, eps):
    check_fused(random_logits(m, n, dtype), random_targets(m, n), eps, reduction)


@pytest.mark.parametrize("reduction", reference.REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_reductions(reduction, dtype):
    x, target = random_logits(1500, 37, dtype), random_targets(1500, 37)
    check_fused(x, target, 0.1, reduction)


def test_fused_no_rows():
    """No rows: the mean of nothing is NaN, the sum 0, as torch says; no kernel runs."""
    x, target = random_logits(0, 7, torch.bfloat16), random_targets(0, 7)
    for reduction, expected in (("mean", math.nan), ("sum", 0.0)):
        got = triton_impl.cross_entropy(x, target, reduction=reduction)
        theirs = torch.nn.functional.cross_entropy(x.float(), target, reduction=reduction)
        assert got.dtype == x.dtype and torch.equal(got.float().isnan(), theirs.isnan())
        assert got.isnan() if math.isnan(expected) else got == expected


def test_fused_strided_operands():
    """Logits as a slice of wider rows, a column step, a transpose; target, loss and lse
    strided; dx a slice of a wider buffer or the transpose's own layout."""
    wide, target = random_logits(5, 3 * 700, torch.bfloat16), random_targets(10, 700)[::2]
    for x in (wide[:, 11:711], wide[:, ::3], random_logits(700, 5, torch.bfloat16).t()):
        loss, lse = torch.empty(5, 2, device=DEVICE)[:, 0], torch.empty(5, 3, device=DEVICE)[:, 1]
        for dx in (torch.empty(5, 800, device=DEVICE, dtype=x.dtype)[:, 50:750], None):
            outputs = (loss, lse, torch.empty_like(x) if dx is None else dx)
            check_fused(x, target, 0.1, "mean", outputs)


@each_dtype
def test_fused_outputs_inside_guard(dtype):
    """loss, lse and dlogits as views into NaN: every element written, nothing else moved."""
    m, n = 3, 4099
    loss, lse, dx, untouched = guarded_outputs(m, n, dtype)
    check_fused(random_logits(m, n, dtype), random_targets(m, n), 0.1, "sum", (loss, lse, dx))
    untouched()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_in_place(dtype):
    """dlogits may be the logits themselves: the second sweep reads each chunk before it writes
    it, so the bits are those of the out-of-place call."""
    x, target = random_logits(4, 5001, dtype), random_targets(4, 5001)
    in_place = check_fused(x, target, 0.1, "mean", in_place=True)
    assert_same_bits(in_place, check_fused(x, target, 0.1, "mean"))


def exact_gradient(x, target, reduction, grad, eps=0.1):
    """The gradient of the reduced loss for the incoming grad, through the fused path: (exact,
    unscaled = exact / grad, bound). README.md's backward bound at the dloss w the kernel
    assumed, with the lse error and w = 1 / count's rounding, times |grad|; then the scale's
    product and its store, one u and one u_s more."""
    weight = 1 / int((target != -100).sum()) if reduction == "mean" else 1.0
    weights = torch.full((x.shape[0],), weight, dtype=torch.float64)
    exact_loss, exact_lse = exact_forward(x, target, -100, eps)
    x64, t = x.double().cpu(), target.cpu()
    e_lse = float(lse_bound("triton", x64, exact_lse).max())
    unscaled = float64_backward(x, t, exact_lse, weights, -100, eps)
    bound = backward_bound(x64, t, exact_lse, weights, unscaled, -100, eps, x.dtype, e_lse)
    bound += U32 * unscaled.abs()  # w = 1 / count, rounded once
    g = grad.double().cpu().expand(x.shape[0])[:, None]
    exact, bound = g * unscaled, g.abs() * bound
    u_s = store_roundoff(x.dtype)
    bound = bound + U32 * (exact.abs() + bound)
    return exact, unscaled, u_s * (exact.abs() + bound) + bound + underflow(x.dtype)


@pytest.mark.parametrize("reduction", reference.REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_gradient_through_autograd(reduction, dtype):
    """x.grad of cross_entropy(x).backward(grad) on the fused path: within the bound for a
    grad that is not 1 (negative controls: the gradient scaled twice, not scaled, or the mean's
    1 / count missing); for grad = 1 (loss.backward()), the unfused path's very bits."""
    x, target = random_logits(6, 300, dtype), random_targets(6, 300)
    target[0] = 7  # at least one row kept: the mean's count is not 0
    shape = (6,) if reduction == "none" else ()
    # Away from 1 (0.25 to 0.75), so that a gradient left unscaled is far outside the bound.
    grad = 0.25 + 0.5 * torch.rand(shape, device=DEVICE) if reduction == "none" else None
    grad = torch.full(shape, 0.75, device=DEVICE) if grad is None else grad
    leaf = x.clone().requires_grad_()
    triton_impl.cross_entropy(leaf, target, reduction=reduction, label_smoothing=0.1).backward(
        grad.to(dtype)
    )  # the loss's gradient comes in the loss's dtype
    exact, unscaled, bound = exact_gradient(x, target, reduction, grad.to(dtype).float())
    assert_within_bound(leaf.grad, exact, bound, "fused gradient")
    count = max(int((target != -100).sum()), 1)
    g = grad.to(dtype).double().cpu().expand(6)[:, None]
    # scaled twice, not scaled, 1 / count missing (for 'none' and 'sum': doubled)
    wrongs = [g * exact, unscaled, exact * (count if reduction == "mean" else 2)]
    assert_rejects([w.to(dtype) for w in wrongs], exact, bound)
    grads = []
    for function in (triton_impl.cross_entropy, triton_impl.CrossEntropyFunction.apply):
        leaf = x.clone().requires_grad_()
        args = () if function is triton_impl.cross_entropy else (-100, 0.1, reduction, False)
        kwargs = {"reduction": reduction, "label_smoothing": 0.1} if not args else {}
        loss = function(leaf, target, *args, **kwargs)
        loss.backward(torch.ones_like(loss))
        grads.append(leaf.grad)
    assert_same_bits(grads[0], grads[1], "fused gradient for grad = 1")


def test_scale_gradient_skips_exact_ones():
    """scale_gradient multiplies the rows whose grad is not exactly 1 and leaves the others'
    bits (NaN included) alone; ignored rows stay as they are (the forward wrote zeros)."""
    dx, target = random_logits(6, 300, torch.bfloat16), random_targets(12, 300, ignored=0.0)
    target = target[::2]  # a strided target
    dx[0, 5], target[3] = math.nan, -100
    grad = torch.tensor([1.0, 0.5, 1.0, -2.0, 1.0, 3.0], device=DEVICE).to(torch.bfloat16)
    expected = dx.clone()
    scaled = torch.tensor([1, 5])  # grad != 1, target kept
    expected[scaled] = (dx[scaled].float() * grad[scaled, None].float()).to(torch.bfloat16)
    assert triton_impl.scale_gradient(dx, target, grad, -100) is dx
    assert_same_bits(dx, expected, "scaled gradient")


def test_fused_backward_runs_once():
    """The backward scales the saved gradient in place: a second pass (retain_graph) would
    scale it twice, so it raises instead."""
    x = random_logits(3, 50, torch.float32).requires_grad_()
    loss = triton_impl.cross_entropy(x, random_targets(3, 50, ignored=0.0))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


def fused_bad_inputs():
    """bad_inputs' cases with a reduction and a fresh dlogits, and the fused path's own."""
    for operands, error, words in bad_inputs():
        shape = operands[0].shape if isinstance(operands[0], torch.Tensor) else (3, 5)
        dx = torch.full(shape, 7.0, device=DEVICE)
        yield (*operands[:4], "mean", *operands[4:], dx), error, words
    x, t = torch.randn(3, 5, device=DEVICE), torch.tensor([0, 1, 4], device=DEVICE)
    rows = lambda: torch.empty(3, device=DEVICE)  # noqa: E731
    wide = torch.zeros(3, 7, device=DEVICE)
    yield (x, t, -100, 0.0, "avg", rows(), rows(), torch.zeros_like(x)), ValueError, "reduction"
    yield (x, t, -100, 0.0, "sum", rows(), rows(), x.half()), ValueError, "dlogits is"
    yield (wide[:, :5], t, -100, 0.0, "sum", rows(), rows(), wide[:, 2:]), ValueError, "overlaps"


@pytest.mark.parametrize("case", list(fused_bad_inputs()), ids=lambda case: case[-1])
def test_fused_bad_input_raises_before_launch(case):
    operands, error, words = case
    if ON_GPU and not operands[1].is_cuda:
        operands = (operands[0], operands[1].to(DEVICE), *operands[2:])
    before = [t.clone() for t in operands[5:]]
    with pytest.raises(error, match=words):
        triton_impl.cross_entropy_fused(*operands)
    for t, b in zip(operands[5:], before, strict=True):
        assert_same_bits(t, b, "an output after a rejected call")


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    x, dloss = (2 * torch.randn(4, 300)).to(dtype), torch.randn(4)
    target = torch.tensor([5, -100, 299, 0])  # row 1 ignored
    loss, lse = torch.empty(4), torch.empty(4)
    triton_impl.cross_entropy_forward(x, target, -100, 0.1, loss, lse)
    dx = triton_impl.cross_entropy_backward(x, target, lse, dloss, -100, 0.1, torch.empty_like(x))
    outputs = dict(x=x, target=target, dloss=dloss, loss=loss, lse=lse, dx=dx)
    calls.append({name: (str(t.dtype), t.tolist()) for name, t in outputs.items()})
print(json.dumps(calls))
"""


def fresh_interpreter_calls(script):
    """Run script in a fresh process under TRITON_INTERPRET=1 in this folder (no test.py, no
    common/); returns its printed calls, each a {name: tensor} dict rebuilt with its dtype."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", script], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return [
        {name: torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")))
         for name, (dtype, values) in call.items()}
        for call in json.loads(child.stdout)
    ]  # fmt: skip


def test_triton_kernels_run_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included) runs the forward and the backward on CPU tensors, bfloat16 and float32,
    with label smoothing 0.1 and an ignored row, within their bounds: the README's laptop
    command works."""
    for t in fresh_interpreter_calls(FRESH_CALL):
        x, target, lse = t["x"], t["target"], t["lse"]
        assert_forward_within_bound("triton", x, target, 0.1, -100, t["loss"], lse)
        assert_backward_within_bound("triton", x, target, lse, t["dloss"], 0.1, -100, t["dx"])


# (4) CuTe builds, dispatch and PTX ---------------------------------------------------------

cute_installed = pytest.mark.skipif(cute_impl is None, reason=str(CUTE_MISSING))
CPU_ONLY = "CPU only (the CuTe DSL installed): on a GPU the contract tests launch these builds"
cute_on_cpu = pytest.mark.skipif(cute_impl is None or ON_GPU, reason=CPU_ONLY)


def ptx_counts(ptx):
    patterns = {
        "loads": r"ld\.global", "vector loads": r"ld\.global\.v4", "stores": r"st\.global",
        "vector stores": r"st\.global\.v4", "ex2": r"ex2\.approx\.ftz\.f32",
        "approx": r"\.approx", "spills": r"\.local", "barriers": r"bar\.sync",
        "shuffles": r"shfl\.sync\.bfly",
    }  # fmt: skip
    return {name: len(re.findall(pattern, ptx)) for name, pattern in patterns.items()}


@cute_installed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vector", [True, False], ids=["vector", "any stride"])
@pytest.mark.parametrize("smoothing", [False, True], ids=["eps=0", "eps>0"])
def test_cute_forward_ptx(dtype, vector, smoothing):
    """The forward builds for sm_90a: a full tile's ELEMS_PER_THREAD elements in 128-bit loads
    (vector build) or one load each, the partial tile one load each, plus the target and its
    logit; ELEMS_PER_THREAD ex2 per tile plus one rescale, and one more before block_sum (the
    counts of forward_path); the log is libdevice's polynomial, no lg2.approx; block_max and
    block_sum (and the smoothing's block_sum): 8 shuffle levels and one barrier each, plus the
    barrier that lets shared memory be reused; no spills."""
    elems = cute_impl.ELEMS_PER_THREAD
    vector_elems = cute_impl.elements_per_access(dtype, vector)
    counts = ptx_counts(cute_impl.ptx_of("forward", dtype, torch.int64, vector_elems, smoothing))
    full_tile_loads = elems // vector_elems
    reductions = 3 if smoothing else 2
    assert counts["loads"] == full_tile_loads + elems + 2
    assert counts["vector loads"] == (full_tile_loads if vector else 0)
    assert counts["stores"] == 2 and counts["spills"] == 0
    assert counts["ex2"] == counts["approx"] == elems + 2
    assert counts["shuffles"] == 8 * reductions
    assert counts["barriers"] <= reductions + 1


@cute_installed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vector", [True, False], ids=["vector", "any stride"])
def test_cute_backward_ptx(dtype, vector):
    """The backward: 128-bit loads and stores of a full tile (vector build), one ex2 per
    element and no other approximate instruction, no block reduction, no spills."""
    elems = cute_impl.ELEMS_PER_THREAD
    vector_elems = cute_impl.elements_per_access(dtype, vector)
    counts = ptx_counts(cute_impl.ptx_of("backward", dtype, torch.int64, vector_elems))
    full_tile = elems // vector_elems
    # the element path of the partial tile, and the row's target, lse and dloss
    assert counts["loads"] == full_tile + elems + 3
    assert counts["stores"] == full_tile + elems
    assert counts["vector loads"] == counts["vector stores"] == (full_tile if vector else 0)
    assert counts["ex2"] == counts["approx"] == elems
    assert counts["barriers"] == counts["shuffles"] == counts["spills"] == 0


@cute_installed
def test_cute_paths_and_dispatch():
    """The counts README.md's bound uses, and which rows take the vector build."""
    assert cute_impl.TILE_ELEMS == 4096 and cute_impl.ELEMS_PER_THREAD == 16
    assert cute_impl.forward_path(4096) == (2, 14)  # exp, rescale; 4 + 1 + 1 + 8 roundings
    assert cute_impl.forward_path(4097) == (3, 16)
    assert cute_impl.smoothing_path(8192) == 13 and cute_impl.reduction_path(257) == 9
    rows = torch.empty(4, 1024, dtype=torch.bfloat16)
    assert cute_impl.is_vector_friendly(rows) and cute_impl.is_vector_friendly(rows[:, 8:520])
    assert not cute_impl.is_vector_friendly(rows[:, 1:513])  # starts mid-vector
    assert not cute_impl.is_vector_friendly(rows[:, ::2])
    assert not cute_impl.is_vector_friendly(torch.empty(4, 1001, dtype=torch.bfloat16))


@cute_on_cpu
def test_cute_refuses_cpu_tensors():
    """Valid operands on the CPU: a clear error before any compilation or launch."""
    x, target = torch.randn(3, 7), torch.tensor([0, 6, -100])
    loss, lse = torch.full((3,), 5.0), torch.full((3,), 5.0)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.cross_entropy_forward(x, target, -100, 0.0, loss, lse)
    assert (loss == 5).all() and (lse == 5).all()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.cross_entropy_backward(x, target, lse, loss, -100, 0.0, torch.empty(3, 7))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.reduce_loss(loss, target, -100, "mean")


@pytest.mark.skipif(CUTE_MISSING, reason="the CuTe DSL is not installed")
def test_cute_refuses_rows_past_its_32_bit_indices(monkeypatch):
    """A row of ROW_CLASSES_MAX + 1 classes (a stride-0 view: no memory) is refused before any
    launch, outputs untouched; ROW_CLASSES_MAX classes pass that check (and meet the next one
    on the CPU). The backward, whose dlogits cannot be a view, with the limit lowered to 6."""
    limit = cute_impl.ROW_CLASSES_MAX
    for n, words in ((limit + 1, f"at most {limit}"), (limit, "needs CUDA tensors")):
        x, target = torch.zeros(1, 1).expand(1, n), torch.tensor([n - 1])
        loss, lse = torch.full((1,), 5.0), torch.full((1,), 5.0)
        with pytest.raises(ValueError, match=words):
            cute_impl.cross_entropy_forward(x, target, -100, 0.0, loss, lse)
        assert (loss == 5).all() and (lse == 5).all()
    monkeypatch.setattr(cute_impl, "ROW_CLASSES_MAX", 6)
    x, target, dx = torch.randn(2, 7), torch.tensor([0, 6]), torch.full((2, 7), 5.0)
    with pytest.raises(ValueError, match="rows of 7 classes; the CuTe kernels take at most 6"):
        cute_impl.cross_entropy_backward(x, target, torch.zeros(2), torch.ones(2), -100, 0.0, dx)
    assert (dx == 5).all()


def cuda_labelled(t):
    """t, a CPU tensor, as a TVM-FFI tensor whose DLPack header says CUDA device 0: a compiled
    CuTe entry checks it (dtype, shape, strides, alignment) as it checks a GPU operand, and
    only the launch after the checks needs the GPU."""
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


def entry_operands(direction, vector, m=5, n=1024):
    """float32 operands of a pass as the launchers see them: rows that are a slice of wider
    rows (vector build) or a transposed matrix (any stride); int32 targets; a strided loss, a
    stride-0 dloss (the mean's broadcast gradient)."""
    x = torch.randn(m, n + 16)[:, :n] if vector else torch.randn(n, m).t()
    target, rows = torch.randint(0, n, (m,), dtype=torch.int32), torch.empty(m, 2)[:, 0]
    if direction == "forward":
        return (x, target, rows, torch.empty(m), -100, 0.1, 1 / n)
    dloss, dx = torch.tensor([0.5]).expand(m), torch.empty(m, n) if vector else torch.empty_like(x)
    return (x, target, torch.randn(m), dloss, dx, -100, 0.1, 0.9)


@cute_on_cpu
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("vector", [False, True], ids=["any stride", "vector"])
def test_cute_entry_takes_each_operands_layout(direction, vector):
    """TVM-FFI checks every operand before the launch; these layouts pass those checks and
    reach the launch, which fails here without a driver."""
    vector_elems = cute_impl.elements_per_access(torch.float32, vector)
    operands = entry_operands(direction, vector)
    kernel = cute_impl.compile_kernel(direction, torch.float32, torch.int32, vector_elems)
    labelled = [cuda_labelled(t) if isinstance(t, torch.Tensor) else t for t in operands]
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*labelled)


@cute_on_cpu
def test_cute_vector_entry_refuses_misaligned_rows():
    """The negative control of the test above: the vector build's entry refuses rows that
    start mid-vector, the case is_vector_friendly sends to the any-stride build."""
    x = torch.randn(5, 1030)[:, 1:1025]
    assert not cute_impl.is_vector_friendly(x)
    kernel = cute_impl.compile_kernel("forward", torch.float32, torch.int32, 4, True)
    operands = (x, *entry_operands("forward", True)[1:])
    labelled = [cuda_labelled(t) if isinstance(t, torch.Tensor) else t for t in operands]
    with pytest.raises(ValueError, match="alignment"):
        kernel(*labelled)


# (5) GPU-only sizes ----------------------------------------------------------------------------

PAST_2_31 = (16400, 131072)  # M V > 2**31: row offsets need 64 bits


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m, n", [(64, 262144), (33, 131071), PAST_2_31])
def test_large_vocabulary(impl, m, n):
    """Vocabulary-sized rows and an M V past 2**31 (64-bit offsets). The float64 stand-in sees
    a few rows (the first two, one in the middle, the last two), so the check needs megabytes
    where a float64 copy of the logits would need 16 GB: the suite runs beside others on one
    GPU. torch skips the largest shape (its float32 temporaries need ~35 GB and test nothing
    of ours)."""
    if impl == "torch" and (m, n) == PAST_2_31:
        pytest.skip("torch's temporaries at M V > 2**31 take ~35 GB; the kernels are the test")
    fns, eps = MODULES[impl], 0.1
    x, target = random_logits(m, n, torch.bfloat16), random_targets(m, n)
    loss, lse = torch.empty(m, device=DEVICE), torch.empty(m, device=DEVICE)
    fns.cross_entropy_forward(x, target, -100, eps, loss, lse)
    dloss = torch.randn(m, device=DEVICE)
    dx = fns.cross_entropy_backward(x, target, lse, dloss, -100, eps, torch.empty_like(x))
    assert_sampled_rows(impl, x, target, eps, loss, lse, dloss, dx)


@gpu_only
@pytest.mark.parametrize("m, n", [(64, 262144), (33, 131071), PAST_2_31])
def test_fused_large_vocabulary(m, n):
    """The fused kernel at the same sizes, checked on the same few rows."""
    x, target = random_logits(m, n, torch.bfloat16), random_targets(m, n)
    loss, lse, dx = (
        torch.empty(m, device=DEVICE),
        torch.empty(m, device=DEVICE),
        torch.empty_like(x),
    )
    triton_impl.cross_entropy_fused(x, target, -100, 0.1, "mean", loss, lse, dx)
    assert_sampled_rows("triton", x, target, 0.1, loss, lse, fused_dloss(target, "mean"), dx)


def assert_sampled_rows(impl, x, target, eps, loss, lse, dloss, dx):
    """Forward and backward bounds on the first two rows, one in the middle and the last two
    (the float64 stand-in then needs megabytes, where all of x would need 16 GB)."""
    m = x.shape[0]
    rows = torch.tensor(sorted({0, 1, m // 2, m - 2, m - 1}), device=DEVICE)
    sample, sample_target, row_lse = x[rows], target[rows], lse[rows]
    assert_forward_within_bound(impl, sample, sample_target, eps, -100, loss[rows], row_lse)
    args = (sample, sample_target, row_lse, dloss[rows], eps, -100, dx[rows])
    assert_backward_within_bound(impl, *args)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
