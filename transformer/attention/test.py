"""Tests for attention: every implementation, forward and backward, lands within README.md's bound.

Run with `python test.py` (or `nox -s attention` from the top). Without a GPU, torch runs on the
CPU and Triton under its interpreter at tiny sizes, and the CuTe kernel is compiled for sm_90a
and its PTX read (launching it needs the GPU: those tests say so when they skip); the GPU adds
the model sizes.
"""

import collections
import functools
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # CuTe builds for the H200 without one

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
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    import cute_1_tiled
    import cute_2_wgmma
    import cute_3_backward
    import cute_3_overlap
    import cute_impl
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_1_tiled = cute_2_wgmma = cute_3_backward = cute_3_overlap = cute_impl = None
    CUTE_MISSING = f"cute_impl cannot be imported ({error})"
else:
    CUTE_MISSING = None

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = {"torch": torch_impl, "triton": triton_impl, "cute": cute_impl}
if cute_impl is not None:  # each step called explicitly ("cute", the default, is step 3's
    # forward on a Hopper GPU, with step 3's backward at D = 128 and Triton's at other head
    # dimensions): step 1's forward with Triton's backward, step 2's forward, step 3's forward
    # and backward.
    IMPLS["cute step 1"] = types.SimpleNamespace(
        attention_forward=cute_impl.attention_forward_step1,
        attention_backward=triton_impl.attention_backward,
        attention=cute_impl.attention_step1,
    )
    IMPLS["cute step 2"] = types.SimpleNamespace(
        attention_forward=cute_impl.attention_forward_step2
    )
    IMPLS["cute step 3"] = types.SimpleNamespace(
        attention_forward=cute_impl.attention_forward_step3,
        attention_backward=cute_impl.attention_backward_cute,
        attention=cute_impl.attention_step3,
    )
needs_cute = pytest.mark.skipif(cute_impl is None, reason=str(CUTE_MISSING))
gpu_only = pytest.mark.skipif(not ON_GPU, reason="launching a CuTe kernel needs a CUDA GPU")
# Implementations a test launches: CuTe's only on a GPU (test_cute_builds_for_hopper checks its
# build on the CPU): the default (step 3's forward on the H200), step 1 (the default forward
# elsewhere) and step 3 with its own backward; implementations a test only validates with:
# CuTe's wherever it imports.
LAUNCHED = ["torch", "triton"] + [
    pytest.param(name, marks=[needs_cute, gpu_only])
    for name in ("cute", "cute step 1", "cute step 3")
]
VALIDATED = ["torch", "triton", pytest.param("cute", marks=needs_cute)]
U32, EX2 = unit_roundoff(torch.float32), APPROX_RELATIVE_ERROR["ex2.approx.ftz.f32"]
LN2 = math.log(2.0)
# (B, S_q, S_k, H, H_kv, D): single tokens, primes, S_q != S_k both ways, GQA and MQA, a head
# dimension that is not a power of two, and one past the small tile.
SHAPES = [
    (1, 1, 1, 1, 1, 16), (2, 5, 3, 4, 2, 8), (1, 7, 7, 2, 1, 16), (1, 3, 11, 3, 3, 20),
    (1, 37, 19, 2, 2, 32), (1, 17, 33, 4, 1, 64),
]  # fmt: skip


def operands(batch, s_q, s_k, heads, heads_kv, head_dim, dtype, layout="bshd"):
    """Fresh random q, k, v, dO; "bhsd" makes them (B, H, S, D) tensors seen as (B, S, H, D)."""

    def make(seq, h):
        if layout == "bhsd":
            return torch.randn(batch, h, seq, head_dim, device=DEVICE).to(dtype).transpose(1, 2)
        return torch.randn(batch, seq, h, head_dim, device=DEVICE).to(dtype)

    return make(s_q, heads), make(s_k, heads_kv), make(s_k, heads_kv), make(s_q, heads)


def float64_forward(q, k, v, causal, scale):
    """The definition in float64 torch (P unrounded): the stand-in for reference.py at sizes
    Python loops cannot reach; `test_stand_in_matches_reference` checks it."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    p, lse = torch_impl.probabilities(q64, k64, causal, scale, dtype=torch.float64)
    group = q.shape[2] // k.shape[2]
    o = torch.einsum("bhij,bjhd->bihd", p, v64.repeat_interleave(group, dim=2))
    return o, lse


def magnitudes(q, k, v, causal, scale):
    """float64 (P, |P| |V| sums (B, S_q, H, D), per-row score error E (log2 units) and the
    row's largest |score| (log2 units))."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    p, _ = torch_impl.probabilities(q64, k64, causal, scale, dtype=torch.float64)
    keys = k64.repeat_interleave(group, dim=2)
    head_dim = q.shape[3]
    abs_scores = torch.einsum("bihd,bjhd->bhij", q64.abs(), keys.abs()) * scale / LN2
    scores = torch.einsum("bihd,bjhd->bhij", q64, keys) * scale / LN2
    if causal:
        hidden = torch_impl.causal_mask(q.shape[1], k.shape[1], q.device)
        abs_scores = abs_scores.masked_fill(hidden, 0.0)
        scores = scores.masked_fill(hidden, 0.0)
    # A score: D products (exact in float32 for 16-bit inputs, one rounding for float32) summed
    # in float32, times scale log2 e (that constant rounded once, the product once).
    products = 1 if q.dtype == torch.float32 else 0
    score_error = gamma(head_dim + products + 2, U32) * abs_scores.amax(-1)
    largest = scores.abs().amax(-1)
    weighted = torch.einsum("bhij,bjhd->bihd", p, v64.abs().repeat_interleave(group, dim=2))
    return p, weighted, score_error, largest


def relative_p_error(score_error, largest):
    """rho, the relative error of a row's exp terms (README.md, "The error bound"): the score's
    error and the rounding of score - shift (|score - shift| <= 2 max |score|) in the exponent,
    then exp2's own error."""
    return (2.0 ** (score_error + 2 * U32 * largest) - 1.0) + EX2


def forward_bound(q, k, v, o, causal, scale):
    """(bound on |O_hat - O|, bound on |lse_hat - lse|) of README.md: the numerator's terms move
    by rho + u_in + gamma, the denominator's by rho + gamma, the ratio by their sum over
    1 - (rho + gamma); the store rounds once more."""
    s_k = k.shape[1]
    u_in = unit_roundoff(q.dtype) if q.dtype != torch.float32 else 0.0
    _, weighted, score_error, largest = magnitudes(q, k, v, causal, scale)
    rho = relative_p_error(score_error, largest)  # (B, H, S_q)
    steps = s_k + 2 * math.ceil(s_k / 16) + 4  # additions, rescales, the division's two roundings
    num, den = rho + u_in + gamma(steps, U32), rho + gamma(steps, U32)
    ratio = ((num + den) / (1 - den)).transpose(1, 2)[..., None]  # (B, S_q, H, 1)
    o_bound = ratio * weighted + store_roundoff(q.dtype) * o.abs() + underflow(q.dtype)
    lse_bound = LN2 * score_error + den / (1 - den) + 4 * U32 * (LN2 * largest + math.log(s_k + 1))
    return o_bound, lse_bound


def check_forward(impl, q, k, v, causal, scale=None, o=None, lse=None):
    """Run impl's forward (into o and lse when given) and check both against float64."""
    batch, s_q, heads, _ = q.shape
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(batch, heads, s_q, device=q.device) if lse is None else lse
    IMPLS[impl].attention_forward(q, k, v, causal, scale, o, lse)
    scale_value = reference.default_scale(q.shape[3], scale)
    exact_o, exact_lse = float64_forward(q, k, v, causal, scale_value)
    o_bound, lse_bound = forward_bound(q, k, v, exact_o, causal, scale_value)
    assert_within_bound(o, exact_o, o_bound, f"{impl} O")
    assert_within_bound(lse, exact_lse, lse_bound, f"{impl} lse")
    return o, lse


def backward_bounds(q, k, v, o_hat, lse_hat, do, causal, scale):
    """Bounds on |dQ_hat - dQ|, |dK_hat - dK|, |dV_hat - dV| (README.md, "The error bound"): P is
    recomputed from the saved lse (its error moves every P by e**|dlse| - 1 more), rounded to
    the input dtype for dV and dS; dP and D_i are float32 dots (D_i of the rounded O, whose own
    error the forward bound gives); the products' sums are float32; the store rounds once
    (among the 16-bit subnormals, by an absolute `underflow`)."""
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    batch, s_q, heads, head_dim = q.shape
    s_k, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    u_in = unit_roundoff(q.dtype) if q.dtype != torch.float32 else 0.0
    p, _, score_error, largest = magnitudes(q, k, v, causal, scale)
    exact_o, exact_lse = float64_forward(q, k, v, causal, scale)
    o_bound, _ = forward_bound(q, k, v, exact_o, causal, scale)
    lse_error = (lse_hat.double() - exact_lse).abs().nan_to_num(0.0, 0.0, 0.0)
    rho = (relative_p_error(score_error, largest) + torch.expm1(lse_error))[..., None]
    keys, values = (t.repeat_interleave(group, dim=2) for t in (k64, v64))
    dp = torch.einsum("bihd,bjhd->bhij", do64, values)
    dp_error = gamma(head_dim + 2, U32) * torch.einsum("bihd,bjhd->bhij", do64.abs(), values.abs())
    delta = (do64 * exact_o).sum(-1).transpose(1, 2)[..., None]
    delta_error = (do64.abs() * o_bound).sum(-1) + gamma(head_dim + 2, U32) * (
        do64 * o_hat.double()
    ).abs().sum(-1)
    delta_error = delta_error.transpose(1, 2)[..., None]  # fmt: skip
    ds = p * (dp - delta)
    ds_error = (rho * p * (dp - delta).abs() + p * (dp_error + delta_error)) * (1 + u_in)
    ds_error = ds_error + (u_in + 3 * U32) * ds.abs()
    sums_q = gamma(s_k + 2, U32)
    sums_k = gamma(s_q * group + 2, U32)

    def per_kv_head(t):
        return t.reshape(batch, s_k, heads_kv, group, head_dim).sum(3)

    dq = scale * torch.einsum("bhij,bjhd->bihd", ds, keys)
    dq_bound = scale * torch.einsum("bhij,bjhd->bihd", ds_error + sums_q * ds.abs(), keys.abs())
    dk = per_kv_head(scale * torch.einsum("bhij,bihd->bjhd", ds, q64))
    dk_bound = per_kv_head(scale * torch.einsum("bhij,bihd->bjhd", ds_error + sums_k * ds.abs(),
                                                q64.abs()))  # fmt: skip
    dv = per_kv_head(torch.einsum("bhij,bihd->bjhd", p, do64))
    dv_bound = per_kv_head(torch.einsum("bhij,bihd->bjhd", (rho + u_in + sums_k) * p, do64.abs()))
    u_out = store_roundoff(q.dtype)
    bounds = [b + u_out * e.abs() + underflow(q.dtype)
              for b, e in ((dq_bound, dq), (dk_bound, dk), (dv_bound, dv))]  # fmt: skip
    return (dq, dk, dv), bounds


def check_backward(impl, q, k, v, do, causal, scale=None, grads=None):
    """Forward then backward with impl (into grads, [dQ, dK, dV], when given); every gradient
    against float64 within its bound."""
    o, lse = check_forward(impl, q, k, v, causal, scale)
    grads = [torch.empty_like(t) for t in (q, k, v)] if grads is None else grads
    IMPLS[impl].attention_backward(q, k, v, o, lse, do, causal, scale, *grads)
    scale_value = reference.default_scale(q.shape[3], scale)
    exact, bounds = backward_bounds(q, k, v, o, lse, do, causal, scale_value)
    for name, got, want, bound in zip(("dq", "dk", "dv"), grads, exact, bounds, strict=True):
        assert_within_bound(got, want, bound, f"{impl} {name}")
    return grads


# (2) The contract, over every implementation ----------------------------------------------------


def test_reference_backward_matches_autograd():
    """reference.py's hand-derived backward against float64 torch.autograd through SDPA's math
    (the mask bottom-right aligned), GQA and a fully masked row included."""
    torch.manual_seed(1)
    q, k, v, do = operands(1, 5, 3, 4, 2, 8, torch.float32)
    for causal in (False, True):
        o, lse = reference.attention_forward(q, k, v, causal)
        grads = reference.attention_backward(q, k, v, o, lse, do, causal)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        mask = None if not causal else ~torch_impl.causal_mask(5, 3, DEVICE)
        heads = [leaves[0].transpose(1, 2)] + [
            t.repeat_interleave(2, dim=2).transpose(1, 2) for t in leaves[1:]
        ]
        out = torch.nn.functional.scaled_dot_product_attention(*heads, attn_mask=mask)
        out.transpose(1, 2).backward(do.double())
        assert torch.allclose(out.transpose(1, 2).cpu(), o, atol=1e-12)
        for mine, theirs in zip(grads, leaves, strict=True):
            assert torch.allclose(mine, theirs.grad.cpu(), atol=1e-12)


def test_stand_in_matches_reference():
    """float64_forward (the large-size stand-in) agrees with reference.py to float64 rounding."""
    torch.manual_seed(2)
    for shape in SHAPES[:4]:
        q, k, v, _ = operands(*shape, torch.float32)
        for causal in (False, True):
            o, lse = float64_forward(q, k, v, causal, 1 / math.sqrt(shape[-1]))
            ref_o, ref_lse = reference.attention_forward(q, k, v, causal)
            assert torch.allclose(o.cpu(), ref_o, atol=1e-12)
            assert torch.equal(lse.cpu().isinf(), ref_lse.isinf())
            assert torch.allclose(lse.cpu().nan_to_num(0, 0, 0), ref_lse.nan_to_num(0, 0, 0))


@pytest.mark.parametrize("impl", LAUNCHED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_definition(impl, dtype, shape, causal):
    """O, lse, dQ, dK and dV of fresh random operands within the bound, every dtype, shape and
    mask (S_q > S_k with causal leaves queries that see no key: O = 0, lse = -inf)."""
    q, k, v, do = operands(*shape, dtype)
    check_backward(impl, q, k, v, do, causal)


@pytest.mark.parametrize("impl", LAUNCHED)
def test_reference_at_small_sizes(impl):
    """The implementations against reference.py itself (Python floats, math.fsum)."""
    q, k, v, do = operands(1, 6, 5, 2, 1, 8, torch.float32)
    for causal in (False, True):
        o, lse = check_forward(impl, q, k, v, causal)
        ref_o, ref_lse = reference.attention_forward(q, k, v, causal)
        bound, _ = forward_bound(q, k, v, ref_o.to(DEVICE), causal, 1 / math.sqrt(8))
        assert_within_bound(o, ref_o, bound, f"{impl} O against reference.py")


@pytest.mark.parametrize("impl", LAUNCHED)
@pytest.mark.parametrize("layout", ["bhsd", "strided"])
def test_strided_operands(impl, layout):
    """(B, H, S, D) tensors seen as (B, S, H, D), and q, k, v as slices of one packed qkv
    projection (B, S, H + 2 H_kv, D): any strides but the head dimension's."""
    torch.manual_seed(3)
    if layout == "bhsd":
        q, k, v, do = operands(2, 9, 13, 4, 2, 16, torch.bfloat16, layout)
    else:
        qkv = torch.randn(2, 9, 4 + 2 + 2, 16, device=DEVICE).to(torch.bfloat16)
        q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
        do = torch.randn_like(q)
    for causal in (False, True):
        check_backward(impl, q, k, v, do, causal)


def guarded(shape, dtype, margin=2):
    """A view of `shape` inside a NaN-filled buffer one margin wider in every dimension."""
    buffer = torch.full([n + 2 * margin for n in shape], math.nan, device=DEVICE, dtype=dtype)
    return buffer[tuple(slice(margin, margin + n) for n in shape)], buffer


@pytest.mark.parametrize("impl", LAUNCHED)
def test_outputs_inside_guard(impl):
    """O, lse, dQ, dK and dV as views inside NaN-filled buffers: every element inside written,
    nothing outside touched."""
    q, k, v, do = operands(1, 7, 5, 2, 1, 16, torch.float16)
    o, o_buffer = guarded(q.shape, q.dtype)
    lse, lse_buffer = guarded((1, 2, 7), torch.float32)
    IMPLS[impl].attention_forward(q, k, v, True, None, o, lse)
    grads = [guarded(t.shape, t.dtype) for t in (q, k, v)]
    IMPLS[impl].attention_backward(q, k, v, o, lse, do, True, None, *(g for g, _ in grads))
    for view, buffer in [(o, o_buffer), (lse, lse_buffer), *grads]:
        inside = torch.zeros_like(buffer, dtype=torch.bool)
        inside[tuple(slice(2, 2 + n) for n in view.shape)] = True
        assert buffer[~inside].isnan().all(), "an element outside the output was written"
    assert not o.isnan().any() and not any(g.isnan().any() for g, _ in grads)
    seen_none = torch.tensor([[[True, True] + [False] * 5] * 2], device=DEVICE)  # S_q - S_k = 2
    assert (lse.isinf() == seen_none).all()


@pytest.mark.parametrize("impl", LAUNCHED)
def test_repeatability(impl):
    """Two runs give the same bits: fixed orders (GQA's heads summed in order; CuTe's dQ summed
    over the key blocks in a semaphore's order)."""
    q, k, v, do = operands(1, 40, 40, 4, 2, 32, torch.bfloat16)
    runs = [check_backward(impl, q, k, v, do, True) for _ in range(2)]
    for first, second in zip(*runs, strict=True):
        assert_same_bits(first, second, f"{impl} gradient")


@pytest.mark.parametrize("impl", LAUNCHED)
def test_special_values(impl):
    """Scores of 1e4 do not overflow (float32 within the bound); a NaN in one key reaches every
    row that sees it and only those; a NaN in one value reaches every row that sees its key, in
    that column; a query that sees no key has O = 0 and lse = -inf; scores
    all near -120 give finite gradients."""
    q, k, v, do = operands(1, 6, 6, 2, 2, 16, torch.bfloat16)
    check_forward(impl, q * 25, k * 25, v, False)  # |scores| up to about 1e4 / sqrt(16)
    k_nan = k.clone()
    k_nan[0, 3, 0, 0] = math.nan
    o, lse = check_forward(impl, q, k_nan, v, True)
    assert (
        o[0, :3, 0].isfinite().all() and o[0, 3:, 0].isnan().all() and o[0, :, 1].isfinite().all()
    )
    # A NaN in V reaches every row that sees its key, in its column only (README.md, "NaN").
    v_nan = v.clone()
    v_nan[0, 3, 0, 0] = math.nan
    o, lse = torch.empty_like(q), torch.empty(1, 2, 6, device=q.device)
    IMPLS[impl].attention_forward(q, k, v_nan, True, None, o, lse)
    assert o[0, 3:, 0, 0].isnan().all() and o[0, 3:, 0, 1:].isfinite().all()
    assert o[0, :, 1].isfinite().all() and lse.isfinite().all()
    o, lse = check_forward(impl, q, k[:, :2], v[:, :2], True)  # S_q = 6 > S_k = 2
    assert (o[0, :4] == 0).all() and (lse[0, :, :4] == -math.inf).all()
    # Every score near -120 (lse too): exp(-lse) overflows float32, so a key past S_k (23 is
    # no multiple of any tile) that the copy engine fills with zeros must be masked, not used.
    k_near = (1 + 0.01 * k.new_empty(1, 23, 2, 16).normal_()).to(torch.bfloat16)
    q_far = torch.full_like(q, -30.0)  # scores -30 * 16 / sqrt(16) = -120
    grads = check_backward(impl, q_far, k_near, v[:, :1].expand(1, 23, 2, 16), do, False)
    assert all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("impl", LAUNCHED)
def test_negative_controls(impl):
    """The bound rejects the plausible bugs: a key dropped from the softmax, the causal mask
    off by one, and the lse of the neighbouring row."""
    q, k, v, _ = operands(1, 12, 12, 2, 2, 16, torch.bfloat16)
    o, lse = check_forward(impl, q, k, v, True)
    scale = 1 / math.sqrt(16)
    exact_o, exact_lse = float64_forward(q, k, v, True, scale)
    o_bound, lse_bound = forward_bound(q, k, v, exact_o, True, scale)
    dropped_o, _ = float64_forward(q, k[:, :-1], v[:, :-1], True, scale)  # the last key gone
    # The diagonal moved by one: query i also sees key i + 1 (S_q = S_k here).
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    rows, cols = torch.arange(12, device=DEVICE)[:, None], torch.arange(12, device=DEVICE)
    p = scores.masked_fill(cols > rows + 1, -math.inf).softmax(-1)
    wrong_o = torch.einsum("bhij,bjhd->bihd", p, v.double())
    for name, bad in (("a key dropped", dropped_o), ("mask off by one", wrong_o)):
        with pytest.raises(AssertionError):
            assert_within_bound(bad, exact_o, o_bound, name)
    with pytest.raises(AssertionError):
        assert_within_bound(lse.roll(1, dims=2), exact_lse, lse_bound, "the neighbour's lse")


def bad_inputs():
    """(q, k, v, causal, scale, what the message names) for each kind of bad input."""
    q, k, v, _ = operands(1, 4, 4, 2, 1, 8, torch.float32)
    yield q.half(), k, v, False, None, "k must be"
    yield q, k[..., :4], v, False, None, "k must have shape"
    yield q, k.repeat(1, 1, 3, 1), v.repeat(1, 1, 3, 1), False, None, "multiple"
    yield q.new_empty(1, 4, 8, 2).transpose(2, 3), k, v, False, None, "q's head dimension"
    yield q.int(), k, v, False, None, "q must be float32"
    yield q, k, v, 1, None, "causal must be a bool"
    yield q, k, v, False, -1.0, "scale"
    yield q[..., ::2], k[..., ::2], v[..., ::2], False, None, "contiguous"


@pytest.mark.parametrize("impl", VALIDATED)
@pytest.mark.parametrize("case", range(8))
def test_bad_input_raises_before_launch(impl, case):
    """A clear error naming the operand, and the outputs untouched."""
    q, k, v, causal, scale, words = list(bad_inputs())[case]
    o = torch.full((1, 4, 2, 8), 7.0, device=DEVICE)
    lse = torch.full((1, 2, 4), 7.0, device=DEVICE)
    if q.shape[3] != 8:
        o = torch.full(q.shape, 7.0, device=DEVICE) if q.dim() == 4 else o
    with pytest.raises((TypeError, ValueError), match=words):
        IMPLS[impl].attention_forward(q, k, v, causal, scale, o, lse)
    assert (o == 7).all() and (lse == 7).all()


def bad_backward_inputs():
    """(how to spoil a valid backward call's operands, what the message names) for each kind of
    bad input the backward alone reads (O, lse, dO) and an output over an input."""
    yield lambda call: call.update(o=call["o"].double()), "o must be"
    yield lambda call: call.update(lse=call["lse"][:, :, :-1]), "lse must have shape"
    yield lambda call: call.update(lse=call["lse"].half()), "lse must be"
    yield lambda call: call.update(do=strided_last(call["do"])), "do's"
    yield lambda call: call.update(dq=call["o"]), "dq overlaps o"


def strided_last(t):
    """A copy of t whose last dimension has stride 2."""
    return t.new_empty(*t.shape[:-1], 2 * t.shape[-1])[..., ::2].copy_(t)


@pytest.mark.parametrize("impl", LAUNCHED)
@pytest.mark.parametrize("case", range(5))
def test_bad_backward_input_raises_before_launch(impl, case):
    """The backward's own inputs checked before any launch, every operand untouched (a wrong
    lse shape would otherwise be read past its end)."""
    spoil, words = list(bad_backward_inputs())[case]
    q, k, v, do = operands(1, 4, 4, 2, 1, 8, torch.float32)
    o, lse = IMPLS[impl].attention_forward(q, k, v, True, None, torch.empty_like(q),
                                           torch.empty(1, 2, 4, device=DEVICE))  # fmt: skip
    grads = {g: torch.full_like(t, 7.0) for g, t in (("dq", q), ("dk", k), ("dv", v))}
    call = {"o": o, "lse": lse, "do": do, **grads}
    before = {name: t.clone() for name, t in call.items()}
    originals = dict(call)
    spoil(call)
    with pytest.raises((TypeError, ValueError), match=words):
        IMPLS[impl].attention_backward(q, k, v, call["o"], call["lse"], call["do"], True, None,
                                       call["dq"], call["dk"], call["dv"])  # fmt: skip
    for name, t in originals.items():
        assert_same_bits(t, before[name], f"{name} under a refused call")


@pytest.mark.parametrize("impl", VALIDATED)
def test_outputs_must_not_overlap(impl):
    """An output that reaches an input's memory is refused before anything is written."""
    q, k, v, _ = operands(1, 4, 4, 2, 2, 8, torch.float32)
    lse = torch.empty(1, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="overlaps"):
        IMPLS[impl].attention_forward(q, k, v, False, None, q, lse)


@pytest.mark.parametrize("impl", LAUNCHED)
def test_autograd_and_compile(impl):
    """The autograd.Function's gradients equal the explicit backward's; torch.compile with
    fullgraph traces the custom op (eager backend: no compiler needed on the CPU)."""
    q, k, v, do = operands(1, 9, 9, 2, 1, 16, torch.float32)
    grads = check_backward(impl, q, k, v, do, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    IMPLS[impl].attention(*leaves, causal=True).backward(do)
    for leaf, grad in zip(leaves, grads, strict=True):
        assert_same_bits(leaf.grad, grad, f"{impl} autograd")
    compiled = torch.compile(IMPLS[impl].attention, fullgraph=True, backend="eager")
    out = compiled(q, k, v, causal=True)
    assert_same_bits(out, IMPLS[impl].attention(q, k, v, causal=True), f"{impl} compiled")


# (3) Triton-specific --------------------------------------------------------------------------


def test_triton_head_dims_pad_to_powers_of_two():
    """D = 20 runs in a 32-wide block (masked), D = 256 in 256, the smallest is tl.dot's 16; the
    forward's tile follows the padded D, the dtype's width and whether the loads are TMA's."""
    assert [triton_impl.padded_head_dim(d) for d in (1, 16, 20, 80, 128, 256)] == [
        16, 16, 32, 128, 128, 256,
    ]  # fmt: skip
    for dtype in DTYPES:
        for head_dim in (8, 64, 80, 128, 200, 256):
            width = 4 if dtype == torch.float32 else 2
            entry = triton_impl.FORWARD_TILES[
                (width, max(64, triton_impl.padded_head_dim(head_dim)))
            ]
            for tma in (True, False):
                tile = triton_impl.forward_tile(dtype, head_dim, tma)
                want = triton_impl.POINTER_TILE if width == 2 and not tma else entry
                assert tuple(tile.values()) == want


@pytest.mark.parametrize("head_dim", [80, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_head_dims_80_and_256(head_dim, causal):
    """Head dimensions that are not 64 or 128: 80 (padded to 128, the columns past 80 masked or
    zero-filled by the copy engine) and 256 (the largest), forward and backward."""
    q, k, v, do = operands(1, 19, 23, 2, 1, head_dim, torch.bfloat16)
    check_backward("triton", q, k, v, do, causal)


# (S_q, S_k) around the interpreter's 16 x 16 tile: both multiples, neither, S_q above and below
# S_k (the causal diagonal shifted both ways), and a short query block over many whole key tiles.
SPLIT_LENGTHS = [(32, 32), (48, 32), (32, 48), (33, 47), (47, 33), (16, 64), (5, 70)]


@pytest.mark.parametrize("path", ["tma", "pointers"])
@pytest.mark.parametrize("lengths", SPLIT_LENGTHS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_unmasked_and_masked_key_loops(path, lengths, causal):
    """The loops in two parts, whole tiles without a mask and the tail/diagonal with one (the
    forward's and dQ's over keys, dK/dV's over queries, whose tiles differ here), at lengths
    that are and are not multiples of the tiles, through tensor descriptors (D = 16, bf16: every
    stride a multiple of 16 bytes) and through pointers (D = 20, fp16: a 40-byte head stride no
    descriptor can take), forward and backward."""
    dtype, head_dim = (torch.bfloat16, 16) if path == "tma" else (torch.float16, 20)
    q, k, v, do = operands(1, *lengths, 2, 1, head_dim, dtype)
    o, lse = torch.empty_like(q), torch.empty(1, 2, lengths[0], device=DEVICE)
    plan = triton_impl.forward_plan(q, k, v, o, lse, causal, 1 / math.sqrt(head_dim))
    assert plan.config["TMA"] == (path == "tma" and triton_impl.has_tma(q.device))
    check_backward("triton", q, k, v, do, causal)


def test_triton_kernels_end_with_the_launch_constants():
    """KernelLaunch's direct launch appends CAUSAL and CONSTEXPRS' values to the arguments: each
    kernel's parameters must end with them, in that order."""
    for kernel in (triton_impl.attention_forward_kernel, triton_impl.attention_dq_kernel,
                   triton_impl.attention_dkdv_kernel):  # fmt: skip
        params = list(inspect.signature(kernel.fn).parameters.values())
        constant = [p.annotation is triton_impl.tl.constexpr for p in params]
        assert [p.name for p in params[-7:]] == ["CAUSAL", *triton_impl.CONSTEXPRS]
        assert constant == [False] * (len(params) - 7) + [True] * 7


def test_triton_cached_plan_still_validates():
    """After a valid call caches its plan (forward, then backward), calls with the same shapes,
    strides and dtypes are still refused when an output overlaps an input or causal is 1
    instead of True."""
    q, k, v, _ = operands(1, 9, 9, 2, 2, 16, torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(1, 2, 9, device=DEVICE)
    triton_impl.attention_forward(q, k, v, True, None, o, lse)
    with pytest.raises(ValueError, match="o overlaps k"):
        triton_impl.attention_forward(q, k, v, True, None, k, lse)
    with pytest.raises(TypeError, match="causal must be a bool"):
        triton_impl.attention_forward(q, k, v, 1, None, o, lse)
    do, grads = torch.randn_like(q), [torch.empty_like(t) for t in (q, k, v)]
    triton_impl.attention_backward(q, k, v, o, lse, do, True, None, *grads)  # caches its plan
    with pytest.raises(ValueError, match="dq overlaps do"):
        triton_impl.attention_backward(q, k, v, o, lse, do, True, None, do, *grads[1:])


def sm90_forward_assembly(dtype_name, head_dim, causal):
    """(PTX, TTGIR) of the forward kernel for Hopper (sm_90) with tensor descriptors, compiled
    without a GPU (triton.compile for a GPUTarget); needs a process without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    tile = triton_impl.forward_tile(dtype, head_dim)
    block_d = triton_impl.padded_head_dim(head_dim)
    rows = [f"tensordesc<{dtype_name}[1, {tile[n]}, 1, {block_d}]>" for n in ("BLOCK_M", "BLOCK_N")]
    kernel = triton_impl.attention_forward_kernel
    constexprs = {"CAUSAL": causal, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "UPCAST": False,
                  "TMA": True, "BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"]}  # fmt: skip
    kinds = [rows[0], rows[1], rows[1], rows[0], "*fp32", "i32", "i32", "i32", "i32", "fp32"]
    signature = dict(zip(kernel.arg_names, kinds + ["i32"] * 14 + ["constexpr"] * 7, strict=True))
    source = triton.compiler.ASTSource(
        kernel, signature, constexprs, attrs={(4,): [["tt.divisibility", 16]]}
    )
    options = {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], compiled.asm["ttgir"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_forward_uses_tma_and_wgmma_on_hopper(causal):
    """Compiled for sm_90 (no GPU needed), the D = 128 bf16 forward loads through TMA
    (cp.async.bulk.tensor), multiplies with wgmma, and has two key loops (unmasked, masked), each
    with its two warpgroup products reading K and V from shared memory."""
    path = str(HERE / "test.py")
    script = (
        "import importlib.util, json\n"
        f"spec = importlib.util.spec_from_file_location('attention_test', {path!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"print(json.dumps(module.sm90_forward_assembly('bf16', 128, {causal})))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ptx, ttgir = json.loads(done.stdout.splitlines()[-1])
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "cp.async.bulk.tensor.4d" in ptx
    assert ttgir.count("scf.for") == 2 and ttgir.count("ttng.warp_group_dot ") == 4


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    shapes = ((5, 2), (7, 1), (7, 1), (5, 2))  # (S, H): 5 queries, 7 keys, 2 heads on 1 KV head
    q, k, v, do = (torch.randn(1, s, h, 16).to(dtype) for s, h in shapes)
    o, lse = torch.empty_like(q), torch.empty(1, 2, 5)
    triton_impl.attention_forward(q, k, v, True, None, o, lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    triton_impl.attention_backward(q, k, v, o, lse, do, True, None, dq, dk, dv)
    outputs = dict(q=q, k=k, v=v, do=do, o=o, lse=lse, dq=dq, dk=dk, dv=dv)
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
    patch included) runs the causal forward and backward (grouped heads) on CPU tensors,
    bfloat16 and float32, within their bounds: the README's laptop command works."""
    for t in fresh_interpreter_calls(FRESH_CALL):
        q, k, v, o, lse = t["q"], t["k"], t["v"], t["o"], t["lse"]
        scale = reference.default_scale(q.shape[3], None)
        exact_o, exact_lse = float64_forward(q, k, v, True, scale)
        o_bound, lse_bound = forward_bound(q, k, v, exact_o, True, scale)
        assert_within_bound(o, exact_o, o_bound, "fresh O")
        assert_within_bound(lse, exact_lse, lse_bound, "fresh lse")
        exact, bounds = backward_bounds(q, k, v, o, lse, t["do"], True, scale)
        for name, want, bound in zip(("dq", "dk", "dv"), exact, bounds, strict=True):
            assert_within_bound(t[name], want, bound, f"fresh {name}")


# (4) CuTe-specific --------------------------------------------------------------------------

CUTE_DTYPES = [torch.float16, torch.bfloat16]
CUTE_HEAD_DIMS = sorted(cute_1_tiled.TILES) if cute_1_tiled else []
# The CuTe steps a test runs over: step 1 (warp-level MMA, the public forward), step 2 (TMA and
# wgmma, cute_impl.attention_forward_step2) and step 3 (the FlashAttention-3 schedule,
# attention_forward_step3, and the backward on TMA and wgmma, attention_backward_cute);
# neither 2 nor 3 is yet a default. A GPU test of step 3 checks its backward too (behind its
# forward), unless the test is of the forward alone.
BACKWARD_STEP = 3
CUTE_STEPS = [1, 2, 3]
# The builds the CPU tests compile: each step's forward, then step 3's backward.
BACKWARD = "3-backward"
CUTE_BUILDS = [*CUTE_STEPS, BACKWARD]


@functools.cache
def cute_ptx(dtype, head_dim, causal, build=1):
    """The sm_90a PTX of a CuTe build, compiled once per test session (about 2 s each)."""
    if build == BACKWARD:
        return cute_impl.ptx_of(dtype, head_dim, causal, BACKWARD_STEP, backward=True)
    return cute_impl.ptx_of(dtype, head_dim, causal, build)


def step1_ptx_promises(kind, head_dim):
    """README.md's CuTe step 1: the warp MMA in the dtype with float32 accumulation, as many as
    two key loops (unmasked, masked) of two products over the tile take, fed by ldmatrix
    (transposed for V) from buffers cp.async fills 16 bytes at a time; 16-byte stores of O; no
    Hopper-only instruction. As (instruction counts, present, absent)."""
    block_m, block_n = cute_1_tiled.TILES[head_dim]
    products = (block_m // 64) * (block_n // 8) * (head_dim // 16)  # per warp, S and P V alike
    expected = {f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32": 2 * 2 * products}
    present = ["ldmatrix.sync.aligned.m8n8.x4.shared.b16",
               "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
               "cp.async.cg.shared.global", "cp.async.wait_group \t1;", "st.global.v4"]  # fmt: skip
    return expected, present, ["wgmma", "cp.async.bulk"]


def step2_ptx_promises(kind, head_dim):
    """The map of cute_2_wgmma.py: two key loops of wgmmas, S's (64 x BLOCK_N, D / 16 of them
    a tile) and P V's (64 x D, BLOCK_N / 16, P's A operand in registers); TMA loads completing
    on mbarriers, the TMA store of O written by stmatrix; the producer's and consumers'
    setmaxnreg; no warp-level MMA, no ldmatrix (S and P never leave the registers), no cp.async
    of step 1's. As (instruction counts, present, absent)."""
    block_n, _ = cute_2_wgmma.TILES[head_dim]
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{{}}k16.f32.{kind}.{kind} "
    expected = collections.Counter({wgmma.format(block_n): 2 * head_dim // 16})
    expected[wgmma.format(head_dim)] += 2 * block_n // 16
    expected[REGISTER_A_WGMMA] = 2 * block_n // 16
    present = ["cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes",
               "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group",
               "mbarrier.arrive.expect_tx", "mbarrier.try_wait.parity", "stmatrix.sync.aligned",
               "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group",
               f"setmaxnreg.dec.sync.aligned.u32 \t{cute_2_wgmma.PRODUCER_REGISTERS};",
               f"setmaxnreg.inc.sync.aligned.u32 \t{cute_2_wgmma.CONSUMER_REGISTERS};"]  # fmt: skip
    return expected, present, ["mma.sync", "ldmatrix", "cp.async.cg", "cp.async.wait_group"]


def step3_ptx_promises(kind, head_dim):
    """The map of cute_3_overlap.py: step 2's, the loop over key tiles written three times
    (tile 0's S, then S of a tile with P V of the one before, without and with the mask, then
    the last P V), the wait for S alone while P V runs (wait_group 1), and the two consumers'
    turns on named barriers of 256 threads. As (instruction counts, present, absent)."""
    block_n, _ = cute_3_overlap.TILES[head_dim]
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{{}}k16.f32.{kind}.{kind} "
    expected = collections.Counter({wgmma.format(block_n): 3 * head_dim // 16})
    expected[wgmma.format(head_dim)] += 3 * block_n // 16
    expected[REGISTER_A_WGMMA] = 3 * block_n // 16
    _, present, absent = step2_ptx_promises(kind, head_dim)
    present = [*present, "wgmma.wait_group.sync.aligned \t1;", ", 256;", "bar.arrive"]
    return expected, present, absent


def backward_ptx_promises(kind, head_dim):
    """The map of cute_3_backward.py: delta's kernel (a butterfly sum), then one pass over the
    query tiles, in two loops (causal: the masked tiles, then the others; without a mask: the
    tiles from the block's start on, then those wrapped around), each with S^T and dP^T (64 x
    BLOCK_M, D / 16 wgmmas each, from shared memory), dV += P^T dO and dK += dS^T Q (64 x D,
    BLOCK_M / 16 each, from registers) and the tile before's dQ share dS K (64 x D / 2 a
    consumer, BLOCK_N / 16 from shared memory; once more after the loops, the last tile's);
    TMA loads on mbarriers, TMA stores of dK and dV written by
    stmatrix, dQ added in float32 by TMA reduce-add in the order of a semaphore (an acquire
    load, a release add on an integer); setmaxnreg with the .minnctapersm that keeps ptxas
    from ignoring it; no float atomics (a float sum in no fixed order). As (instruction
    counts, present, absent)."""
    block_m, _ = cute_3_backward.TILES[head_dim]
    loops = 2
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{{}}k16.f32.{kind}.{kind} "
    expected = collections.Counter({wgmma.format(block_m): loops * 2 * head_dim // 16})
    expected[wgmma.format(head_dim)] += loops * 2 * block_m // 16
    expected[wgmma.format(head_dim // 2)] += (loops + 1) * cute_3_backward.BLOCK_N // 16
    expected[REGISTER_A_WGMMA] = loops * 2 * block_m // 16
    _, present, absent = step2_ptx_promises(kind, head_dim)
    present = [*present, ".minnctapersm 1", "shfl.sync.bfly",
               "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile",
               "ld.acquire.gpu.global.b32", "atom.global.release.add.u32"]  # fmt: skip
    return expected, present, [*absent, FLOAT_ATOMIC]


# A wgmma whose A operand is a vector of registers ("{...}, {") rather than a descriptor.
REGISTER_A_WGMMA = re.compile(r"wgmma\.mma_async\S* \{[^}]*\}, \{")
# A float atomic (red or atom, with or without a predicate): a sum in no fixed order.
FLOAT_ATOMIC = re.compile(r"^\s*(@!?%p\d+\s+)?(red|atom)\.\S*\.(f16|bf16|f32|f64)\b", re.MULTILINE)


def missing_ptx_facts(ptx, dtype, head_dim, build=1):
    """What README.md's CuTe build `build` (a step's forward, or BACKWARD) promises and `ptx`
    lacks (an empty list: all there): the build's own instructions and counts
    (step1_ptx_promises to backward_ptx_promises), and for every build exp2 as ex2.approx.ftz
    (the bound counts it), no approximate division, and no local memory (no register array
    indexed at run time); the forwards' 1 / l correctly rounded."""
    kind = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    promises = {1: step1_ptx_promises, 2: step2_ptx_promises, 3: step3_ptx_promises,
                BACKWARD: backward_ptx_promises}  # fmt: skip
    expected, present, absent = promises[build](kind, head_dim)
    present = [*present, "ex2.approx.ftz.f32", *(["rcp.rn.f32"] if build != BACKWARD else [])]
    absent = [*absent, "ld.local", "st.local", "rcp.approx", "div.approx"]

    def count(instruction):
        if isinstance(instruction, re.Pattern):
            return len(instruction.findall(ptx))
        return ptx.count(instruction)

    def name(instruction):
        return getattr(instruction, "pattern", instruction)

    missing = [f"{n} x {name(instruction)}"
               for instruction, n in expected.items() if count(instruction) != n]  # fmt: skip
    missing += [instruction for instruction in present if instruction not in ptx]
    missing += [f"no {name(instruction)}" for instruction in absent if count(instruction)]
    if build == 1 and "cp.async.cg.shared.global" in ptx and ", 16, 16;" not in ptx:
        missing.append("16-byte cp.async")
    return missing


@needs_cute
@pytest.mark.parametrize("build", CUTE_BUILDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", CUTE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", CUTE_DTYPES, ids=str)
def test_cute_builds_for_hopper(dtype, head_dim, causal, build):
    """Every specialisation each CuTe build is compiled for compiles for sm_90a (no GPU) into
    the instructions its step promises (step 1: warp-level MMA fed by ldmatrix and cp.async;
    step 2: wgmma fed by TMA and mbarriers; step 3: step 2's on the overlapped schedule; the
    backward: the same in one pass, dQ added in a fixed order, no float atomics), with the
    instructions the bound counts."""
    ptx = cute_ptx(dtype, head_dim, causal, build)
    assert missing_ptx_facts(ptx, dtype, head_dim, build) == []


@needs_cute
@pytest.mark.parametrize("build", CUTE_BUILDS)
def test_cute_ptx_check_rejects_other_builds(build):
    """Negative control of the check above: another head dimension's build (its MMA count),
    the other dtype's (its MMA type), another step's build, the PTX with its MMAs or its loads
    removed (step 3: its wait for S alone or its turns), and (the backward) with a float
    atomic added or the launch bound that keeps setmaxnreg removed."""
    ptx = cute_ptx(torch.bfloat16, 64, False, build)
    assert missing_ptx_facts(ptx, torch.bfloat16, 64, build) == []
    assert missing_ptx_facts(cute_ptx(torch.bfloat16, 128, False, build), torch.bfloat16, 64,
                             build)  # fmt: skip
    assert missing_ptx_facts(ptx, torch.float16, 64, build)
    other_build = {1: 2, 2: 3, 3: 2, BACKWARD: 2}[build]
    assert missing_ptx_facts(cute_ptx(torch.bfloat16, 64, False, other_build), torch.bfloat16,
                             64, build)  # fmt: skip
    stripped_instructions = {
        1: ("mma.sync", "cp.async.cg"),
        2: ("wgmma.mma_async", "cp.async.bulk.tensor", "stmatrix"),
        3: (
            "wgmma.mma_async",
            "cp.async.bulk.tensor",
            "wgmma.wait_group.sync.aligned \t1;",
            "bar.arrive",
        ),
        BACKWARD: (
            "wgmma.mma_async",
            "cp.async.bulk.tensor",
            "stmatrix",
            ".minnctapersm",
            "cp.reduce.async",
            "ld.acquire",
        ),
    }
    for instruction in stripped_instructions[build]:
        stripped = "\n".join(line for line in ptx.splitlines() if instruction not in line)
        assert missing_ptx_facts(stripped, torch.bfloat16, 64, build)
    if build == BACKWARD:
        atomic = ptx.replace("\tret;", "\tred.global.add.f32 [%rd1], %f1;\n\tret;", 1)
        assert missing_ptx_facts(atomic, torch.bfloat16, 64, build) == [
            f"no {FLOAT_ATOMIC.pattern}"
        ]


@needs_cute
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (the CUDA toolkit's)")
@pytest.mark.parametrize("build", CUTE_BUILDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", CUTE_HEAD_DIMS)
def test_cute_tiles_fit_the_registers(head_dim, causal, build, tmp_path):
    """ptxas for sm_90a fits each bf16 build in the registers without spilling: the reason
    cute_1_tiled.TILES gives for its tiles, and cute_2_wgmma.TILES, cute_3_overlap.TILES and
    cute_3_backward.TILES for theirs (within the consumers' setmaxnreg budget, which ptxas
    honours: 168 spills at D = 128; its warning C7508 would say it ignored setmaxnreg), and
    the overlapped wgmmas are neither serialised nor waited for by ptxas (its serialisation
    warnings; its C7517, "warpgroup.wait is injected", when registers a running wgmma owns
    are written)."""
    source = tmp_path / "forward.ptx"
    source.write_text(cute_ptx(torch.bfloat16, head_dim, causal, build))
    done = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "o")],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"this ptxas cannot assemble the DSL's PTX: {done.stderr[-300:]}")
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr)  # every kernel's
    assert spills and set(spills) == {"0"}, done.stderr
    assert "C7508" not in done.stderr, "ptxas ignored setmaxnreg"
    assert "serializ" not in done.stderr.lower(), done.stderr
    assert "C7517" not in done.stderr, "ptxas waits for a wgmma the schedule overlaps"


def wgmma_tiles():
    """(D, N, stages) of every wgmma pair the steps build (steps 2's and 3's S and P V; the
    backward's S^T, dP^T and the dK, dV products): an accumulator 64 x N regrouped as the
    register A operand of a 64 x D x N product, whose B is a ring of N x D seen transposed."""
    if cute_impl is None:
        return []
    steps = (cute_2_wgmma, cute_3_overlap, cute_3_backward)
    return sorted({(d, *tile) for step in steps for d, tile in step.TILES.items()})


@needs_cute
@pytest.mark.parametrize("tile", wgmma_tiles(), ids=str)
def test_cute_step2_operand_layouts(tile):
    """Steps 2's and 3's register and shared-memory operands, checked on the layouts (no GPU),
    for every (D, N, stages) they build (`wgmma_tiles`; the names are the forward's): P, S's
    accumulator reshaped by as_a_operand, holds for each thread exactly the (row, key)
    elements that the register A operand of P V's wgmma expects, in its order; by_rows gives a
    thread rows r and r + 8 of its warp's 16 and column pairs 8 apart (the quad's share); V's
    ring seen transposed is the MN-major 128-byte-swizzled layout sm90_utils gives a B
    operand whose N (D) is contiguous. Negative control: slices paired N / 16 apart
    (`pairs_slices_far_apart`) are not the A operand."""
    facts = cute_2_wgmma_layout_facts(*tile)
    assert facts["p_is_a_operand"] == [True] * 4, facts
    assert not any(facts["far_is_a_operand"]), "the check cannot tell a wrong pairing"
    assert facts["v_is_mn_major"], facts
    assert facts["rows"] == f"(2,2,{tile[1] // 8}):(8@0,1@1,8@1)"


# What check_step2_layouts found while tracing (a @cute.jit function returns nothing here).
STEP2_LAYOUT_FACTS = collections.defaultdict(dict)


def cute_2_wgmma_layout_facts(head_dim, block_n, stages):
    """Compile check_step2_layouts for a few threads (no kernel, layout algebra only); what it
    found, as strings and booleans."""
    facts = STEP2_LAYOUT_FACTS[head_dim, block_n, stages]
    if not facts:
        for thread in (0, 1, 37, 127):
            cute.compile(check_step2_layouts, head_dim, block_n, stages, thread)
    return facts


def fragment_text(coords):
    """A k step's fragment of coordinates as text: its first (row, column) and its layout."""
    return f"{coords.iterator} {cute.coalesce(coords.layout)}"


def pairs_slices_far_apart(p):
    """A plausible wrong as_a_operand (the negative control): each k step made of the 8-column
    slices j and j + BLOCK_N / 16 instead of 2 j and 2 j + 1."""
    steps = cute.size(p.layout.shape[0][2]) // 2
    split = cute.logical_divide(p.layout, ((None, None, steps), None, None))
    (pair, half, (steps, two)), mma_m, mma_n = split.shape
    (pair_s, half_s, (steps_s, two_s)), m_s, n_s = split.stride
    return cute.make_tensor(
        p.iterator,
        cute.make_layout(
            ((pair, half, two), mma_m, (steps, mma_n)),
            stride=((pair_s, half_s, two_s), m_s, (steps_s, n_s)),
        ),  # fmt: skip
    )


if cute_impl is not None:  # @cute.jit needs the DSL

    @cute.jit
    def check_step2_layouts(
        head_dim: cutlass.Constexpr, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
        thread: cutlass.Constexpr,
    ):  # fmt: skip
        """Trace-time layout algebra (the coordinates of identity tensors, static for a static
        thread) recorded into STEP2_LAYOUT_FACTS[head_dim, block_n, stages]."""
        facts = STEP2_LAYOUT_FACTS[head_dim, block_n, stages]
        dtype = cutlass.BFloat16
        mma_qk, mma_pv = cute_2_wgmma.tiled_mmas(dtype, head_dim, block_n)
        tile = cute.make_identity_tensor((cute_2_wgmma.WGMMA_M, block_n))
        s_coords = mma_qk.get_slice(thread).partition_C(tile)
        a_coords = mma_pv.get_slice(thread).partition_A(tile)
        p_coords = cute_2_wgmma.as_a_operand(s_coords)
        far_coords = pairs_slices_far_apart(s_coords)
        p_same, far_same = True, True
        for kk in cutlass.range_constexpr(cute.size(a_coords, mode=[2])):  # the k steps of P V
            want = fragment_text(a_coords[None, None, kk])
            p_same = p_same and fragment_text(p_coords[None, None, kk]) == want
            far_same = far_same and fragment_text(far_coords[None, None, kk]) == want
        facts.setdefault("p_is_a_operand", []).append(p_same)
        facts.setdefault("far_is_a_operand", []).append(far_same)
        facts["rows"] = str(cute.coalesce(cute_2_wgmma.by_rows(s_coords).layout))
        _, kv_layout = cute_2_wgmma.smem_layouts(dtype, head_dim, block_n, stages)
        v_t = cute_2_wgmma.transposed(kv_layout.outer, head_dim, block_n, stages)
        mn_major = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (cute_2_wgmma.WGMMA_M, head_dim, block_n), dtype, stages
        )
        facts["v_is_mn_major"] = str(cute.coalesce(v_t)) == str(
            cute.coalesce(mn_major.outer)
        ) and str(mn_major.inner) == str(kv_layout.inner)


def dq_walks(s_q, s_k, causal):
    """Each key block's walk over the query tiles (cute_3_backward.walk, the kernel's own), as
    (sum, tile) in its order: sum 1 for the tiles after it wraps around."""
    block_m, _ = cute_3_backward.TILES[128]
    n_blocks = -(-s_k // cute_3_backward.BLOCK_N)
    walks = []
    for n in range(n_blocks):
        tiles = cute_3_backward.query_tiles(n, n_blocks, s_q, s_k, block_m, causal)
        walks.append([(int(wrapped), t) for lo, hi, _, wrapped in cute_3_backward.walk(tiles)
                      for t in range(lo, hi)])  # fmt: skip
    return walks


def play_dq_order(s_q, s_k, causal, blocks_before, resident):
    """The writers of the one-pass backward played on the host: the key blocks launched last
    first, `resident` at a time (the next once one finishes, as blocks wait for an SM); each
    round, every running block adds its next tile if the tile's semaphore, as it stood at the
    round's start (an add is seen a round later), counts `blocks_before`. Returns the rounds
    and each (sum, tile)'s adding blocks in order, or None if no block can move (a deadlock:
    on a GPU, a hang)."""
    block_m, _ = cute_3_backward.TILES[128]
    walks = dq_walks(s_q, s_k, causal)
    n_blocks = len(walks)
    to_launch, running = list(range(n_blocks - 1, -1, -1)), {}
    counts, adds, rounds = collections.Counter(), collections.defaultdict(list), 0
    while to_launch or running:
        while to_launch and len(running) < resident:
            running[to_launch.pop(0)] = 0
        seen, moved = dict(counts), False
        for n in list(running):
            which, tile = walks[n][running[n]]
            waits = blocks_before(n, tile, which == 1, n_blocks, s_q, s_k, block_m, causal)
            if seen.get((which, tile), 0) == waits:
                counts[which, tile] += 1
                adds[which, tile].append(n)
                running[n] += 1
                moved = True
                if running[n] == len(walks[n]):
                    del running[n]
        rounds += 1
        if not moved:
            return None
    return rounds, adds


def dq_order_faults(s_q, s_k, causal, blocks_before):
    """What breaks the dQ order's promises (`play_dq_order`), as strings (none: an empty
    list): no deadlock with one block resident, two, or all; each query tile added to exactly
    once by every key block one of its rows sees (causal: the block's first key is seen by the
    tile's last row), each sum's adds from the last block down (one order, every run); and,
    with every block resident and at least as many query tiles as key blocks, without a mask
    or with S_q = S_k, no block waits for another: the rounds are the longest walk's tiles."""
    block_m, _ = cute_3_backward.TILES[128]
    n_blocks, tiles = -(-s_k // cute_3_backward.BLOCK_N), -(-s_q // block_m)
    longest = max(len(walk) for walk in dq_walks(s_q, s_k, causal))
    no_chain = tiles >= n_blocks and (not causal or s_q == s_k)
    faults = []
    for resident in sorted({1, 2, n_blocks}):
        played = play_dq_order(s_q, s_k, causal, blocks_before, resident)
        if played is None:
            faults.append(f"deadlock with {resident} blocks resident")
            continue
        rounds, adds = played
        for tile in range(tiles):
            last_row = min((tile + 1) * block_m, s_q) - 1 + (s_k - s_q if causal else s_k)
            seen_by = [n for n in range(n_blocks) if n * cute_3_backward.BLOCK_N <= last_row]
            if sorted(adds[0, tile] + adds[1, tile]) != seen_by:
                faults.append(f"tile {tile} added to by {adds[0, tile]} + {adds[1, tile]}")
        for key, blocks in adds.items():
            if blocks != sorted(blocks, reverse=True):
                faults.append(f"sum {key[0]}, tile {key[1]}: blocks {blocks} in that order")
        if resident == n_blocks and no_chain and rounds != longest:
            faults.append(f"{rounds} rounds for walks of {longest} tiles")
    return faults


@needs_cute
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cute_backward_dq_order(causal):
    """dq_order_faults finds nothing for S_q and S_k of every relation (equal, one token,
    primes, S_q above S_k: rows that see no key; below: the diagonal shifted), and finds the
    faults of wrong orders (negative controls): the first block first; without a mask,
    every block counted before block n at every tile (the one order of the kernel before
    2026-12-06, whose walks all began at tile 0, played on the rotated walks: it waits for
    blocks that add to the other sum or not at all); under causal masking with S_q < S_k,
    the count of an unmasked order."""
    sizes = [(1, 1), (1, 300), (64, 64), (127, 131), (200, 70), (70, 200), (1000, 129),
             (129, 1000), (4096, 4096), (333, 777), (2048, 4096)]  # fmt: skip
    for s_q, s_k in sizes:
        assert dq_order_faults(s_q, s_k, causal, cute_3_backward.blocks_before) == []

    def first_block_first(n, *_):
        return n

    assert dq_order_faults(4096, 4096, causal, first_block_first)
    if causal:

        def unmasked(n, tile, wrapped, n_blocks, s_q, s_k, block_m, causal):
            return cute_3_backward.blocks_before(n, tile, wrapped, n_blocks, s_q, s_k, block_m,
                                                 False)  # fmt: skip

        assert dq_order_faults(2048, 4096, causal, unmasked)
    else:

        def last_block_first(n, tile, wrapped, n_blocks, *_):
            return n_blocks - 1 - n

        assert dq_order_faults(4096, 4096, causal, last_block_first)


@needs_cute
def test_cute_routes_what_the_kernel_does_not_take():
    """kernel_takes (operands already validated): 16-bit D = 64 and 128 with 16-byte aligned
    rows run the CuTe kernel, (B, H, S, D) views and packed qkv slices included; float32,
    other head dimensions and misaligned bases or strides go to Triton (negative controls).
    Step 2 takes the same, less views with a zero stride (TMA's strides must be positive);
    step 3's backward the same as step 2 over q, k, v, O, dO, dK and dV."""
    q, k, v, _ = operands(1, 5, 7, 4, 2, 64, torch.bfloat16)
    assert cute_impl.kernel_takes(q, k, v, torch.empty_like(q))
    bhsd = operands(1, 5, 7, 4, 2, 128, torch.float16, layout="bhsd")
    assert cute_impl.kernel_takes(*bhsd[:3], torch.empty_like(bhsd[0]))
    qkv = torch.randn(1, 5, 4 + 2 + 2, 64, dtype=torch.bfloat16)
    assert cute_impl.kernel_takes(qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:], torch.empty_like(q))
    q32, k32, v32, _ = operands(1, 5, 7, 4, 2, 64, torch.float32)
    assert not cute_impl.kernel_takes(q32, k32, v32, torch.empty_like(q32))
    q80, k80, v80, _ = operands(1, 5, 7, 4, 2, 80, torch.bfloat16)
    assert not cute_impl.kernel_takes(q80, k80, v80, torch.empty_like(q80))
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    assert not cute_impl.kernel_takes(q, k, v, shifted)
    wide = torch.randn(1, 5, 4, 68, dtype=torch.bfloat16)[..., :64]  # 136-byte head stride
    assert not cute_impl.kernel_takes(wide, k, v, torch.empty_like(q))
    # Step 2 takes the same, but an expanded (stride 0) view no TMA descriptor can describe.
    assert cute_impl.kernel_takes(q, k, v, torch.empty_like(q), step=2)
    assert cute_impl.kernel_takes(*bhsd[:3], torch.empty_like(bhsd[0]), step=2)
    assert not cute_impl.kernel_takes(q32, k32, v32, torch.empty_like(q32), step=2)
    shared = k[:, :1].expand(k.shape)  # one key row for every position: sequence stride 0
    assert cute_impl.kernel_takes(q, shared, v, torch.empty_like(q))
    assert not cute_impl.kernel_takes(q, shared, v, torch.empty_like(q), step=2)

    # Step 3's backward: step 2's rules over every tensor it loads or stores (dq is written by
    # torch from the float32 sum: any dq).
    def takes(q, k, v, o=None, do=None, dq=None, dk=None, dv=None):
        o, do, dq = (torch.empty_like(q) if t is None else t for t in (o, do, dq))
        dk, dv = (torch.empty_like(k) if t is None else t for t in (dk, dv))
        return cute_impl.backward_kernel_takes(q, k, v, o, do, dq, dk, dv)

    assert takes(q, k, v) and takes(*bhsd[:3], do=bhsd[3])
    assert not takes(q32, k32, v32) and not takes(q80, k80, v80)
    assert takes(q, k, v, dq=shifted) and not takes(q, k, v, do=shifted)
    assert not takes(q, k, v, dk=torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape))
    assert not takes(q, shared, v) and not takes(q, k, v, do=q[:, :1].expand(q.shape))


@needs_cute
def test_cute_default_backward_by_head_dim(monkeypatch):
    """The default backward runs step 3's on a Hopper GPU at the head dimensions where it was
    measured the faster (CUTE_BACKWARD_HEAD_DIMS: 128), Triton's at the others and on other
    GPUs (Hopper faked, both backwards replaced by recorders); a malformed q reaches the
    validation, not an IndexError."""
    called = []
    monkeypatch.setattr(cute_impl, "attention_backward_cute", lambda *a: called.append("cute"))
    monkeypatch.setattr(cute_impl.triton_impl, "attention_backward",
                        lambda *a: called.append("triton"))  # fmt: skip
    for hopper, head_dim, expected in [(True, 128, "cute"), (True, 64, "triton"),
                                       (False, 128, "triton")]:  # fmt: skip
        monkeypatch.setattr(cute_impl, "on_hopper", lambda q, hopper=hopper: hopper)
        q = torch.empty(1, 4, 2, head_dim, dtype=torch.bfloat16)
        cute_impl.attention_backward(q, q, q, q, None, q, False, None, q, q, q)
        assert called.pop() == expected, (hopper, head_dim)
    flat = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    cute_impl.attention_backward(flat, flat, flat, flat, None, flat, False, None, flat, flat, flat)
    assert called.pop() == "triton"


@needs_cute
@pytest.mark.skipif(ON_GPU, reason="the CPU refusal; the GPU runs the kernel")
@pytest.mark.parametrize("build", CUTE_BUILDS)
def test_cute_refuses_cpu_tensors(build):
    """Valid operands on the CPU: a clear error after the validation, the outputs untouched
    (the backward: dQ, dK and dV)."""
    q, k, v, do = operands(1, 4, 4, 2, 1, 64, torch.bfloat16)
    o, lse = torch.full_like(q, 7.0), torch.full((1, 2, 4), 7.0)
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    with pytest.raises(ValueError, match="CUDA"):
        if build == BACKWARD:
            cute_impl.attention_backward_cute(q, k, v, o, lse, do, False, None, *grads)
        else:
            IMPLS[CUTE_IMPLS[build]].attention_forward(q, k, v, False, None, o, lse)
    assert (o == 7).all() and (lse == 7).all() and all((g == 7).all() for g in grads)


def check_cute_forward(q, k, v, causal, scale=None, o=None, lse=None, step=1):
    """check_forward on CuTe step `step`'s forward, asserting that its kernel (not Triton's)
    ran."""
    o = torch.empty_like(q) if o is None else o
    assert cute_impl.kernel_takes(q, k, v, o, step), "these operands would go to Triton"
    return check_forward(CUTE_IMPLS[step], q, k, v, causal, scale, o, lse)


def check_cute_backward(q, k, v, do, causal, scale=None, grads=None):
    """check_backward through step 3's forward and backward (into grads when given),
    asserting that its kernels (not Triton's) ran; returns [dQ, dK, dV]."""
    grads = [torch.empty_like(t) for t in (q, k, v)] if grads is None else grads
    o = torch.empty_like(q)  # as check_forward makes it
    assert cute_impl.backward_kernel_takes(q, k, v, o, do, *grads), "this would go to Triton"
    return check_backward(CUTE_IMPLS[BACKWARD_STEP], q, k, v, do, causal, scale, grads)


# IMPLS's names of the steps (step 3's: its forward and its backward).
CUTE_IMPLS = {1: "cute step 1", 2: "cute step 2", 3: "cute step 3"}


# (B, S_q, S_k, H, H_kv): one token, a decode step over a cache, primes, S_q above and below
# S_k (the diagonal shifted both ways, rows that see no key), whole 64-row tiles, MQA.
CUTE_SHAPES = [
    (1, 1, 1, 1, 1), (2, 1, 300, 4, 1), (1, 127, 131, 4, 2), (1, 200, 70, 2, 2),
    (1, 70, 200, 2, 1), (2, 64, 128, 3, 3), (1, 129, 1000, 2, 1),
]  # fmt: skip


@needs_cute
@gpu_only
@pytest.mark.parametrize("step", CUTE_STEPS)
@pytest.mark.parametrize("shape", CUTE_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", CUTE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", CUTE_DTYPES, ids=str)
def test_cute_kernel_matches_definition(dtype, head_dim, causal, shape, step):
    """Each CuTe step's kernel itself (not the Triton route) within README.md's forward bound
    (step 3: its backward's too): tails of every length, the causal diagonal both ways, GQA and
    MQA, fully masked rows (and, in steps 2 and 3, rows past S_q or S_k in a consumer's 64 and
    rings wrapping around their mbarrier phases many times: at S_k = 1000, and over a group's
    query heads in step 3's dK/dV kernel)."""
    torch.manual_seed(sum(shape) + head_dim)
    batch, s_q, s_k, heads, heads_kv = shape
    q, k, v, do = operands(batch, s_q, s_k, heads, heads_kv, head_dim, dtype)
    if step == BACKWARD_STEP:
        dq, _, _ = check_cute_backward(q, k, v, do, causal)
        if causal and s_q > s_k:  # rows that see no key: dQ = 0
            assert (dq[:, : s_q - s_k] == 0).all()
    o, lse = check_cute_forward(q, k, v, causal, step=step)
    if causal and s_q > s_k:
        assert (o[:, : s_q - s_k] == 0).all() and (lse[:, :, : s_q - s_k] == -math.inf).all()


@needs_cute
@gpu_only
@pytest.mark.parametrize("step", CUTE_STEPS)
@pytest.mark.parametrize("layout", ["bhsd", "packed"])
@pytest.mark.parametrize("head_dim", CUTE_HEAD_DIMS)
def test_cute_kernel_strided_operands(layout, head_dim, step):
    """(B, H, S, D) tensors seen as (B, S, H, D) and q, k, v sliced from one packed qkv, through
    the CuTe kernel (step 3: the backward, dO and the gradients (B, H, S, D) views too), with a
    scale given."""
    torch.manual_seed(5)
    if layout == "bhsd":
        q, k, v, do = operands(2, 77, 93, 4, 2, head_dim, torch.bfloat16, layout)
    else:
        qkv = torch.randn(2, 77, 4 + 2 + 2, head_dim, device=DEVICE).to(torch.bfloat16)
        q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
        do = torch.randn_like(q)
    for causal in (False, True):
        if step == BACKWARD_STEP:
            grads = [torch.empty_like(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v)]
            check_cute_backward(q, k, v, do, causal, scale=0.3, grads=grads)
        else:
            check_cute_forward(q, k, v, causal, scale=0.3, step=step)


@needs_cute
@gpu_only
@pytest.mark.parametrize("step", CUTE_STEPS)
def test_cute_kernel_special_values(step):
    """Through the CuTe kernel: scores of about 1e4, a NaN key reaching exactly the rows that
    see it, no key at all (S_k = 0)."""
    q, k, v, _ = operands(1, 70, 70, 2, 2, 64, torch.bfloat16)
    check_cute_forward(q * 25, k * 25, v, False, step=step)  # |scores| up to about 1e4
    k_nan = k.clone()
    k_nan[0, 66, 0, 0] = math.nan
    o, lse = check_cute_forward(q, k_nan, v, True, step=step)
    assert o[0, :66, 0].isfinite().all() and o[0, 66:, 0].isnan().all()
    assert lse[0, 0, 66:].isnan().all() and o[0, :, 1].isfinite().all()
    o, lse = torch.full_like(q, 7.0), torch.full((1, 2, 70), 7.0, device=DEVICE)
    IMPLS[CUTE_IMPLS[step]].attention_forward(q, k[:, :0], v[:, :0], False, None, o, lse)
    assert (o == 0).all() and (lse == -math.inf).all()


def guarded_rows(shape, dtype):
    """(view, buffer, inside): a (B, S, H, D) view inside a NaN-filled buffer wider in every
    dimension, its rows still 16-byte aligned (so the CuTe kernels take it), and the mask of
    the buffer's elements the view covers."""
    buffer = torch.full([shape[0] + 2, shape[1] + 4, shape[2] + 2, shape[3] + 16], math.nan,
                        device=DEVICE, dtype=dtype)  # fmt: skip
    where = (slice(1, 1 + shape[0]), slice(2, 2 + shape[1]), slice(1, 1 + shape[2]),
             slice(8, 8 + shape[3]))  # fmt: skip
    inside = torch.zeros_like(buffer, dtype=torch.bool)
    inside[where] = True
    return buffer[where], buffer, inside


@needs_cute
@gpu_only
@pytest.mark.parametrize("step", CUTE_STEPS)
def test_cute_kernel_outputs_inside_guard(step):
    """O as a 16-byte aligned view inside a NaN-filled buffer (so the kernel takes it) and lse
    as a view of another: every element inside written, nothing outside touched. Step 3 also
    dQ, dK and dV so, twice, the same bits both times (a KV head's 3 query heads summed in
    order, dQ's key blocks in the semaphores' order)."""
    q, k, v, do = operands(2, 75, 75, 3, 1, 64, torch.float16)
    if step == BACKWARD_STEP:
        runs = []
        for _ in range(2):
            guards = [guarded_rows(t.shape, t.dtype) for t in (q, k, v)]
            grads = check_cute_backward(q, k, v, do, True, grads=[g[0] for g in guards])
            for _, buffer, inside in guards:
                assert buffer[~inside].isnan().all(), "an element outside a gradient was written"
            runs.append(grads)
        for first, second in zip(*runs, strict=True):
            assert_same_bits(first, second, "CuTe backward, run twice")
    o, o_buffer, inside = guarded_rows(q.shape, q.dtype)
    lse, lse_buffer = guarded((2, 3, 75), torch.float32)
    check_cute_forward(q, k, v, True, o=o, lse=lse, step=step)
    assert o_buffer[~inside].isnan().all(), "an element outside O was written"
    assert lse_buffer.isnan().sum() == lse_buffer.numel() - lse.numel()


@needs_cute
@gpu_only
@pytest.mark.parametrize("step", CUTE_STEPS)
def test_cute_kernel_offsets_past_int32(step):
    """A second batch whose q, k, v (one buffer) and O (another) start past 2**31 elements
    (8.6 GB of bf16 in all): offsets formed in 32 bits would read and write the first batch's
    rows."""
    batch_stride = 2**31 + 64  # elements, a multiple of 8
    s, heads, head_dim = 100, 2, 64
    rows = s * heads * head_dim
    shape, strides = (2, s, heads, head_dim), (batch_stride, heads * head_dim, head_dim, 1)
    inputs = torch.zeros(batch_stride + 3 * rows, device=DEVICE, dtype=torch.bfloat16)
    q, k, v = (inputs.as_strided(shape, strides, n * rows) for n in range(3))  # interleaved
    for t in (q, k, v):
        t.copy_(torch.randn(shape, device=DEVICE))
    o = torch.full((batch_stride + rows,), math.nan, device=DEVICE, dtype=torch.bfloat16)
    check_cute_forward(q, k, v, True, o=o.as_strided(shape, strides), step=step)


@needs_cute
@gpu_only
@pytest.mark.parametrize("step", CUTE_STEPS)
@pytest.mark.parametrize("head_dim", CUTE_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cute_kernel_model_sizes(causal, head_dim, step):
    """The forward alone at test_model_sizes_against_float64's size (B = 1, S_q = 1031 over
    S_k = 1024, 8 query heads on 2 KV heads, bf16): many key tiles per block, the longest
    causal blocks first. Step 3: the backward so, many tiles in both of its kernels."""
    q, k, v, do = operands(1, 1031, 1024, 8, 2, head_dim, torch.bfloat16)
    if step == BACKWARD_STEP:
        check_cute_backward(q, k, v, do, causal)
    else:
        check_cute_forward(q, k, v, causal, step=step)


# (5) GPU-only sizes ---------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="model sizes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("impl", LAUNCHED)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_model_sizes_against_float64(impl, head_dim, causal):
    """B = 1, S = 1031 queries and 1024 keys, 8 query heads over 2 KV heads, bf16."""
    q, k, v, do = operands(1, 1031, 1024, 8, 2, head_dim, torch.bfloat16)
    check_backward(impl, q, k, v, do, causal)


@pytest.mark.skipif(not ON_GPU, reason="model sizes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("head_dim", [80, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_model_sizes_head_dims_80_and_256(head_dim, causal, dtype):
    """The GPU tiles at D = 80 (padded to 128) and D = 256 (the tables' own entries), bf16 and
    float32 (whose tiles must fit shared memory at D = 256)."""
    q, k, v, do = operands(1, 1031, 1024, 4, 2, head_dim, dtype)
    check_backward("triton", q, k, v, do, causal)


def misaligned(t):
    """A copy of t whose base sits one element past a 16-byte boundary: no TMA descriptor."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buffer[1:].view(t.shape).copy_(t)


@pytest.mark.skipif(not ON_GPU, reason="the GPU tiles (128 queries x 128 keys at D = 128)")
@pytest.mark.parametrize("path", ["tma", "pointers"])
@pytest.mark.parametrize(
    "lengths", [(1024, 1024), (1000, 1100), (1100, 1000), (100, 4096)], ids=str
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_unmasked_and_masked_key_loops(path, lengths, causal):
    """The loops' split at the GPU tiles (forward 128 x 128; backward 32 x 64 and 64 x 64):
    lengths that are multiples of 128 and not, the causal diagonal shifted both ways, through
    descriptors and (misaligned copies) pointers, forward and backward."""
    q, k, v, do = operands(1, *lengths, 4, 2, 128, torch.bfloat16)
    if path == "pointers":
        q, k, v, do = (misaligned(t) for t in (q, k, v, do))
    o, lse = torch.empty_like(q), torch.empty(1, 4, lengths[0], device=DEVICE)
    plan = triton_impl.forward_plan(q, k, v, o, lse, causal, 1 / math.sqrt(128))
    assert plan.config["TMA"] == (path == "tma")
    check_backward("triton", q, k, v, do, causal)


@pytest.mark.skipif(not ON_GPU, reason="the direct launch reuses a compiled GPU kernel")
def test_direct_launch_matches_first_launch():
    """The first call of a shape goes through the JIT and keeps the compiled kernels; the second
    launches them directly: the same bits, forward and backward."""
    q, k, v, do = operands(2, 300, 300, 4, 2, 64, torch.bfloat16)
    triton_impl.PLANS.clear()
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = triton_impl.attention(*leaves, causal=True)
        out.backward(do)
        runs.append([out, *(leaf.grad for leaf in leaves)])
    launches = [launch for plan in triton_impl.PLANS.values()
                for launch in (getattr(plan, name, None) for name in
                               ("kernel", "dq_kernel", "dkdv_kernel")) if launch]  # fmt: skip
    assert len(launches) == 3 and all(launch.compiled is not None for launch in launches)
    for first, second in zip(*runs, strict=True):
        assert_same_bits(first, second, "direct launch")


@pytest.mark.skipif(not ON_GPU, reason="CUDA contexts exist on a GPU only")
def test_cached_plans_run_from_a_fresh_thread():
    """A thread that has made no CUDA call has no current context; the cached plans' launches
    (whose TMA descriptors need one) bind the device's: the same bits as on the main thread.
    (The autograd engine runs backward on such a thread.)"""
    q, k, v, do = operands(1, 200, 200, 4, 2, 64, torch.bfloat16)

    def run():
        o, lse = torch.empty_like(q), torch.empty(1, 4, 200, device=DEVICE)
        triton_impl.attention_forward(q, k, v, True, None, o, lse)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        triton_impl.attention_backward(q, k, v, o, lse, do, True, None, *grads)
        return [o, lse, *grads]

    main = run()  # caches both plans
    fresh = []
    worker = threading.Thread(target=lambda: fresh.append(run()))
    worker.start()
    worker.join()
    assert fresh, "the launch from a fresh thread raised"
    for first, second in zip(main, fresh[0], strict=True):
        assert_same_bits(first, second, "fresh thread")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
