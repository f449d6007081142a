"""Tests for RoPE: every implementation, forward and backward, lands within README.md's bound.

Run with `python test.py`. Without a GPU, torch runs on the CPU and Triton under its
interpreter; a child process compiles the Triton kernel for sm_90 and reads its PTX; the CuTe
kernel is compiled for sm_90a, its PTX read and its entry's checks run (launching it needs a GPU).
"""

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
from common.tolerance import assert_within_bound, gamma, store_roundoff, underflow, unit_roundoff

try:
    import cute_impl
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = {"torch": torch_impl, "triton": triton_impl, "cute": cute_impl}
# (B, S, H, Hk, D): one token, primes, heads not a power of two, D/2 odd and past a power of two.
SHAPES = [(1, 1, 1, 1, 2), (2, 3, 4, 2, 8), (1, 7, 5, 1, 30), (2, 5, 3, 3, 128), (1, 3, 8, 2, 130)]
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny
# cosf and sinf (CUDA's, which Triton's tl.cos and torch call): within 2 ulp over the full
# range (CUDA math API), so 5u of the result by common/README.md's argument for ex2.
TRIG = 5 * U32


def random_heads(batch, seq, heads, head_dim, dtype, layout="bshd"):
    shape = (batch, seq, heads, head_dim) if layout == "bshd" else (batch, heads, seq, head_dim)
    return torch.randn(shape, device=DEVICE).to(dtype)


def angle_sources(head_dim, source, positions=16, base=10000.0):
    """The angles as keyword arguments: a (P, D/2) float32 table, a (P, D) table in q's
    dtype with repeating halves (Hugging Face's), or inv_freq."""
    if source == "inv_freq":
        return {"inv_freq": reference.inverse_frequencies(head_dim, base).to(DEVICE)}
    theta = torch.rand(positions, head_dim // 2, dtype=torch.float64) * 2 * math.pi
    if source == "table":
        return {"cos": theta.cos().float().to(DEVICE), "sin": theta.sin().float().to(DEVICE)}
    return {name: torch.cat((t, t), dim=-1).to(DEVICE) for name, t in (("cos", theta.cos()),
            ("sin", theta.sin()))}  # fmt: skip


def rope_bounds(x, exact, angles, position_ids, interleaved, layout):
    """README.md's bound for each output element of x rotated (either direction):

    E = u |theta| (1 + F) + F + tiny for computed angles (float32 theta, cosf/sinf within F),
        0 for a table (its values are the definition)
    |y_a_hat - y_a| <= (|x_a| + |x_b|) E + gamma_2 (|x_a| (|c| + E) + |x_b| (|s| + E)),
    and y_b with a and b swapped; then the store's rounding."""
    x4 = reference.canonical(x.detach().cpu().double(), layout)
    batch, seq, _, head_dim = x4.shape
    c, s = reference.angles(head_dim // 2, batch, seq, angles.get("cos"), angles.get("sin"),
                            angles.get("inv_freq"), position_ids, interleaved)  # fmt: skip
    if "inv_freq" in angles:
        positions = reference.positions_of(position_ids, batch, seq).float().double()
        theta = positions[..., None, None] * angles["inv_freq"].cpu().double()
        e = U32 * theta.abs() * (1 + TRIG) + TRIG + TINY32
    else:
        e = torch.zeros_like(c)
    a, b = (h.abs() for h in reference.pair_halves(x4, interleaved))
    g2 = gamma(2, U32)
    bound_a = (a + b) * e + g2 * (a * (c.abs() + e) + b * (s.abs() + e)) + 2 * TINY32
    bound_b = (a + b) * e + g2 * (b * (c.abs() + e) + a * (s.abs() + e)) + 2 * TINY32
    bound = reference.canonical(reference.join_halves(bound_a, bound_b, interleaved), layout)
    u_s = store_roundoff(x.dtype)
    return u_s * exact.abs() + (1 + u_s) * bound + underflow(x.dtype)


def implementation(impl):
    """The implementation's module, for tests that launch it."""
    if impl == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    if impl == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return IMPLS[impl]


def run(impl, direction, q, k, outputs=None, **options):
    fn = getattr(implementation(impl), f"rope_{direction}")
    q_out, k_out = outputs if outputs is not None else (torch.empty_like(q), torch.empty_like(k))
    return fn(q, k, q_out, k_out, **options)


def check(impl, direction, q, k, outputs=None, **options):
    """Run impl and compare both outputs with the reference within the bound."""
    exact = getattr(reference, f"rope_{direction}")(q, k, **options)
    got = run(impl, direction, q, k, outputs, **options)
    angles = {n: options[n] for n in ("cos", "sin", "inv_freq") if options.get(n) is not None}
    for name, x, out, e in zip(("q", "k"), (q, k), got, exact, strict=True):
        layout, interleaved = options.get("layout", "bshd"), options.get("interleaved", False)
        bound = rope_bounds(x, e, angles, options.get("position_ids"), interleaved, layout)
        assert_within_bound(out, e, bound, f"{impl} {direction} {name}")
    return got


# (2) The contract over every implementation ---------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("source", ["table", "hf_table", "inv_freq"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_matches_reference(impl, dtype, shape, source, interleaved, direction):
    batch, seq, heads, heads_k, head_dim = shape
    q, k = (random_heads(batch, seq, h, head_dim, dtype) for h in (heads, heads_k))
    angles = angle_sources(head_dim, source)
    if source == "hf_table":
        angles = {n: t.to(dtype) for n, t in angles.items()}
    position_ids = torch.randint(0, 16, (batch, seq), device=DEVICE)
    check(impl, direction, q, k, **angles, position_ids=position_ids, interleaved=interleaved)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("base, scaling", [(10000.0, None), (500000.0, "llama3")])
def test_large_positions(impl, dtype, base, scaling):
    """Positions up to 2**17 (packed, out of order): float32 theta's error grows with p and
    the bound's u |theta| term holds it."""
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position": 8192} if scaling else None  # fmt: skip
    inv_freq = reference.inverse_frequencies(128, base, llama3).to(DEVICE)
    q, k = random_heads(2, 9, 4, 128, dtype), random_heads(2, 9, 1, 128, dtype)
    position_ids = torch.randint(0, 2**17, (2, 9), device=DEVICE)
    check(impl, "forward", q, k, inv_freq=inv_freq, position_ids=position_ids)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_operands(impl, dtype):
    """q and k as views of a fused qkv projection's output in (B, H, S, D) order, outputs
    transposed, position_ids (1, S) broadcast over the batch and a strided table."""
    batch, seq, heads, heads_k, head_dim = 2, 5, 4, 2, 16
    qkv = torch.randn(batch, heads + 2 * heads_k, seq, head_dim + 4, device=DEVICE).to(dtype)
    q, k = qkv[:, :heads, :, :head_dim], qkv[:, heads : heads + heads_k, :, :head_dim]
    outputs = tuple(torch.empty(batch, seq, h, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
                    for h in (heads, heads_k))  # fmt: skip
    wide = angle_sources(2 * head_dim, "table")
    angles = {n: t[:, ::2] for n, t in wide.items()}  # (P, D/2) with a column stride of 2
    position_ids = torch.randint(0, 16, (1, seq), device=DEVICE)
    for interleaved in (False, True):
        check(impl, "forward", q, k, outputs, **angles, position_ids=position_ids,
              interleaved=interleaved, layout="bhsd")  # fmt: skip


def poisoned_view(shape, dtype, margin=3):
    """A view of `shape` inside a NaN-filled buffer wider in every dimension."""
    buffer = torch.full([n + 2 * margin for n in shape], math.nan, device=DEVICE, dtype=dtype)
    view = buffer[tuple(slice(margin, margin + n) for n in shape)]
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[tuple(slice(margin, margin + n) for n in shape)] = False
    return buffer, view, outside


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_inside_guard(impl, dtype):
    """Nothing outside the output views changes, and every element inside is written."""
    q, k = random_heads(2, 3, 3, 10, dtype), random_heads(2, 3, 2, 10, dtype)
    (q_buf, q_out, q_outside), (k_buf, k_out, k_outside) = (poisoned_view(t.shape, dtype)
                                                            for t in (q, k))  # fmt: skip
    got = check(impl, "forward", q, k, (q_out, k_out), **angle_sources(10, "inv_freq"))
    for buf, outside, out in ((q_buf, q_outside, got[0]), (k_buf, k_outside, got[1])):
        assert buf[outside].isnan().all()
        assert not out.isnan().any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_in_place_and_round_trip(impl, interleaved):
    """q_out = q and k_out = k rotate in place; the backward (R(-theta)) then brings float32
    q back within twice the bound."""
    q, k = random_heads(2, 4, 4, 32, torch.float32), random_heads(2, 4, 2, 32, torch.float32)
    angles = angle_sources(32, "inv_freq")
    q0, k0 = q.clone(), k.clone()
    exact = reference.rope_forward(q, k, **angles, interleaved=interleaved)
    run(impl, "forward", q, k, (q, k), **angles, interleaved=interleaved)
    for x, e, x0 in ((q, exact[0], q0), (k, exact[1], k0)):
        assert_within_bound(x, e, rope_bounds(x0, e, angles, None, interleaved, "bshd"))
    run(impl, "backward", q, k, (q, k), **angles, interleaved=interleaved)
    for x, x0 in ((q, q0), (k, k0)):
        bound = 2 * rope_bounds(x0, x0.cpu().double(), angles, None, interleaved, "bshd")
        assert_within_bound(x, x0.double(), bound)


@pytest.mark.parametrize("impl", IMPLS)
def test_repeatability_and_positions_outside_the_table(impl):
    """Two runs give the same bits; a position outside the table gives NaN for its token
    only (the reference's definition), never a read out of bounds."""
    q, k = random_heads(2, 5, 4, 16, torch.bfloat16), random_heads(2, 5, 2, 16, torch.bfloat16)
    angles = angle_sources(16, "table", positions=6)
    position_ids = torch.tensor([[0, 5, 6, -1, 2], [1, 2, 3, 4, 1000]], device=DEVICE)
    first = check(impl, "forward", q, k, **angles, position_ids=position_ids)
    second = run(impl, "forward", q, k, **angles, position_ids=position_ids)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        outside = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
        assert a.isnan().all(-1).all(-1).cpu().equal(outside)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("source", ["table", "hf_table"])
def test_positions_near_int32_limits(impl, source):
    """int64 positions at and past 2**31 (and 2**32 + 1, which a 32-bit index would wrap to 1)
    are outside a 16-row table: NaN for those tokens only, in CuTe's table kernel as elsewhere."""
    q, k = random_heads(2, 5, 4, 64, torch.bfloat16), random_heads(2, 5, 2, 64, torch.bfloat16)
    angles = {n: t.to(torch.bfloat16) for n, t in angle_sources(64, source, positions=16).items()}
    position_ids = torch.tensor([[2**31 - 1, 2**31, 2**32 + 1, 3, -(2**31)],
                                 [2**32 + 15, 1, 2**63 - 1, -1, 15]], device=DEVICE)  # fmt: skip
    got = check(impl, "forward", q, k, **angles, position_ids=position_ids)
    outside = torch.tensor([[1, 1, 1, 0, 1], [1, 0, 1, 1, 0]], dtype=torch.bool)
    for out in got:
        assert out.isnan().all(-1).all(-1).cpu().equal(outside)


def bad_inputs():
    """(q, k, outputs, options, error, message fragment, id)."""
    q, k = random_heads(1, 3, 2, 8, torch.float32), random_heads(1, 3, 1, 8, torch.float32)
    freq = angle_sources(8, "inv_freq")
    fresh = lambda: (torch.zeros_like(q), torch.zeros_like(k))  # noqa: E731
    yield q.half(), k, fresh(), freq, TypeError, "k has dtype", "k dtype"
    yield q, k[:, :2], fresh(), freq, ValueError, "k has shape", "k sequence"
    yield q[..., :7], k[..., :7], fresh(), freq, ValueError, "even", "odd D"
    yield q[0], k, fresh(), freq, ValueError, "4 dimensions", "3-D q"
    yield q, k, fresh(), {}, ValueError, "cos and sin together", "no angles"
    yield q, k, fresh(), {**freq, **angle_sources(8, "table")}, ValueError, "one of", "both"
    yield q, k, fresh(), {"inv_freq": freq["inv_freq"].double()}, TypeError, "inv_freq", "f64"
    yield q, k, fresh(), {**angle_sources(8, "table"), "position_ids": torch.zeros(3)}, \
        TypeError, "position_ids", "float positions"  # fmt: skip
    wrong_positions = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    yield q, k, fresh(), {**freq, "position_ids": wrong_positions}, \
        ValueError, "position_ids has shape", "positions shape"  # fmt: skip
    yield q, k, (k.clone(), k.clone()), freq, ValueError, "q_out has shape", "q_out shape"
    yield q, k, (q[:, :, :1].expand(1, 3, 2, 8), torch.zeros_like(k)), freq, ValueError, \
        "two elements one address", "q_out collides"  # fmt: skip
    yield q, k, (k.new_empty(0), k), freq, ValueError, "q_out has shape", "q_out empty"
    qk = torch.zeros(1, 3, 3, 8, device=DEVICE)
    yield q, k, (qk[:, :, :2], qk[:, :, 1:2]), freq, ValueError, "overlaps", "q_out overlaps k_out"
    yield q, k, (k, torch.zeros_like(k)), freq, ValueError, "q_out has shape", "q_out is k"


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    q, k, outputs, options, error, fragment, _ = case
    if impl == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    before = [o.clone() for o in outputs]
    fn = reference.rope_forward if impl == "reference" else IMPLS[impl].rope_forward
    with pytest.raises(error, match=fragment):
        fn(q, k, *outputs, **options)
    for o, b in zip(outputs, before, strict=True):
        assert torch.equal(o, b), "an output changed before the error"


# Negative controls: the bound rejects plausible bugs.


@pytest.mark.parametrize("source", ["table", "inv_freq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_controls(source, dtype):
    """The neighbour position's angle, sin's sign flipped, and the other convention's pairs
    (halves swapped for interleaved) all land outside the bound; the exact answer rounded once
    lands inside."""
    q, k = random_heads(2, 6, 4, 64, dtype), random_heads(2, 6, 2, 64, dtype)
    angles = angle_sources(64, source, positions=64)
    position_ids = torch.randint(0, 63, (2, 6), device=DEVICE)
    exact = reference.rope_forward(q, k, **angles, position_ids=position_ids)[0]
    bound = rope_bounds(q, exact, angles, position_ids, False, "bshd")
    forward, backward = reference.rope_forward, reference.rope_backward
    at = {**angles, "position_ids": position_ids}
    wrong = {
        "neighbour position": forward(q, k, **angles, position_ids=position_ids + 1)[0],
        "sin's sign flipped": backward(q, k, **at)[0],
        "interleaved pairs": forward(q, k, **at, interleaved=True)[0],
    }
    for what, result in wrong.items():
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(result.to(dtype), exact, bound, what)
    assert_within_bound(exact.to(dtype), exact, bound)


def test_reference_backward_matches_autograd():
    """rope_backward (the rotation by -theta) is the float64 autograd of rope_forward."""
    q, k = torch.randn(2, 3, 4, 10), torch.randn(2, 3, 2, 10)
    angles = {"inv_freq": reference.inverse_frequencies(10)}
    position_ids = torch.randint(0, 100, (2, 3))
    c, s = reference.angles(5, 2, 3, None, None, angles["inv_freq"], position_ids, False)
    for interleaved in (False, True):
        x, dy = q.double().requires_grad_(), torch.randn_like(q)
        (dx,) = torch.autograd.grad(reference.rotate(x, c, s, interleaved), x, dy.double())
        mine = reference.rope_backward(dy, k, **angles, position_ids=position_ids,
                                       interleaved=interleaved)[0]  # fmt: skip
        torch.testing.assert_close(mine, dx, rtol=1e-14, atol=1e-14)


# Autograd, the custom ops, the module and torch.compile


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_module_gradients(impl, compiled):
    """RotaryEmbedding's forward and its gradients (the custom op's under torch.compile,
    fullgraph) match the reference within the bound."""
    module = implementation(impl).RotaryEmbedding(16, base=500000.0, device=DEVICE)
    q, k = random_heads(2, 4, 4, 16, torch.float32), random_heads(2, 4, 2, 16, torch.float32)
    position_ids = torch.randint(0, 4096, (2, 4), device=DEVICE)
    call = torch.compile(module, fullgraph=True) if compiled else module
    q_leaf, k_leaf = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_rot, k_rot = call(q_leaf, k_leaf, position_ids)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    ((q_rot * dq).sum() + (k_rot * dk).sum()).backward()
    angles = {"inv_freq": module.inv_freq}
    exact = reference.rope_forward(q, k, **angles, position_ids=position_ids)
    exact_grad = reference.rope_backward(dq, dk, **angles, position_ids=position_ids)
    for got, x, e in ((q_rot, q, exact[0]), (k_rot, k, exact[1]), (q_leaf.grad, dq, exact_grad[0]),
                      (k_leaf.grad, dk, exact_grad[1])):  # fmt: skip
        assert_within_bound(got, e, rope_bounds(x, e, angles, position_ids, False, "bshd"))


# (3) Triton: the build for sm_90 and its PTX ----------------------------------------------------

# A child process: under TRITON_INTERPRET=1 the kernel cannot be compiled. The launch's own
# specialisation: unit strides as constants, the rest divisible by 16 (D = 128, bfloat16).
TRITON_PTX_SCRIPT = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl as t

kernel, names = t.rope_kernel, [p.name for p in t.rope_kernel.params]
units = {n: 1 for n in names if n.startswith("stride") and n[-1] in "dif"}
for table in (False, True):
    for interleaved in (False, True):
        consts = dict(units, HEADS=8, HALF_BLOCK=64, TABLE=table, POSITIONS=True,
                      INTERLEAVED=interleaved, INVERSE=False)
        kinds = {n: "constexpr" if n in consts else "*i64" if n == "pos_ptr" else
                 "*fp32" if n in ("cos_ptr", "sin_ptr", "freq_ptr") else
                 "*bf16" if n.endswith("_ptr") else "i64" for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if kinds[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride")
                                                 or n == "half")}
        built = triton.compile(ASTSource(kernel, kinds, {(names.index(n),): v for n, v in
                               consts.items()}, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 2})
        ptx = built.asm["ptx"]
        print(table, interleaved, len(re.findall(r"ld\\.global[.\\w]*\\.v4", ptx)),
              len(re.findall(r"st\\.global[.\\w]*\\.v4", ptx)), "cos.approx" in ptx,
              len(re.findall(r"bar\\.sync", ptx)))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the contract tests launch the kernel")
def test_triton_ptx_has_128_bit_loads():
    """The kernel builds for sm_90 in every variant; with D = 128 in bfloat16 every thread moves
    its part of each half with one 16-byte load and one 16-byte store (two per branch, q and
    k), and cos/sin are libdevice's full-range ones, not cos.approx. A table's row is read in
    the heads' layout, 8 values of cos and of sin a thread: rotate-half then needs no barrier
    (README.md, tuning log); computed angles are moved through shared memory."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", TRITON_PTX_SCRIPT], cwd=HERE, env=env,
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    for line in child.stdout.split("\n")[:-1]:
        table, interleaved, loads, stores, approx, barriers = line.split()
        table_loads = 4 if table == "True" else 0  # float32 cos and sin: 32 bytes a thread each
        assert (int(loads), int(stores), approx) == (4 + table_loads, 4, "False"), line
        if table == "True" and interleaved == "False":
            assert barriers == "0", line


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    q, dq, k, dk = (torch.randn(2, 5, h, 8).to(dtype) for h in (3, 3, 1, 1))
    theta = torch.rand(5, 4) * 6.28  # a (positions, D/2) table of angles in [0, 2 pi)
    angles = dict(cos=theta.cos(), sin=theta.sin())
    q_out, k_out = triton_impl.rope_forward(q, k, torch.empty_like(q), torch.empty_like(k),
                                            **angles)
    dq_out, dk_out = triton_impl.rope_backward(dq, dk, torch.empty_like(q), torch.empty_like(k),
                                               **angles)
    outputs = dict(q=q, k=k, dq=dq, dk=dk, q_out=q_out, k_out=k_out, dq_out=dq_out, dk_out=dk_out)
    calls.append({name: (str(t.dtype), t.tolist()) for name, t in {**outputs, **angles}.items()})
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
    within their bounds: the README's laptop command works."""
    for t in fresh_interpreter_calls(FRESH_CALL):
        angles = {"cos": t["cos"], "sin": t["sin"]}
        for direction, (a, b) in (("forward", ("q", "k")), ("backward", ("dq", "dk"))):
            exact = getattr(reference, f"rope_{direction}")(t[a], t[b], **angles)
            for name, want in zip((a, b), exact, strict=True):
                bound = rope_bounds(t[name], want, angles, None, False, "bshd")
                assert_within_bound(t[f"{name}_out"], want, bound, f"fresh {direction} {name}")


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


# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="large sizes need a CUDA GPU")


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("source", ["inv_freq", "hf_table"])
def test_llama_size_against_float64(impl, dtype, layout, source):
    """B = 4, S = 4095 (in (B, H, S, D) a bf16 block of two tokens straddles each batch
    boundary), H = 32, Hk = 8, D = 128 with Llama 3's angles (CuTe's general kernel) or
    Hugging Face's table in q's dtype (its table kernel: bench.py's call), both directions, in
    both layouts; the reference is already float64 torch, fast enough at this size."""
    q = random_heads(4, 4095, 32, 128, dtype, layout)
    k = random_heads(4, 4095, 8, 128, dtype, layout)
    angles = {"inv_freq": reference.inverse_frequencies(128, 500000.0).to(DEVICE)}
    if source == "hf_table":
        angles = {n: t.to(dtype) for n, t in angle_sources(128, source, positions=4095).items()}
    for direction in ("forward", "backward"):
        check(impl, direction, q, k, **angles, layout=layout)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
