"""RoPE tests, section (2): the contract over every implementation, autograd and the module.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import math

import pytest
import torch
from test import (
    CUTE_MISSING,
    DEVICE,
    DTYPES,
    IMPLS,
    ON_GPU,
    SHAPES,
    angle_sources,
    check,
    cute_impl,
    implementation,
    random_heads,
    rope_bounds,
    run,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import reference
from common.tolerance import assert_within_bound

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


def far_strides(far, batch, seq, heads, head_dim):
    """(B, S, H, D) strides whose last element lies past 2**31 elements from the first: tokens
    2**27 apart (from the 17th on, a token's offset needs 64 bits), or D outermost, a
    (D, B, S, H) tensor permuted (the last column's offset needs 64 bits)."""
    if far == "tokens":
        return seq * 2**27, 2**27, head_dim, 1
    return seq * heads, heads, 1, 2**31 // (head_dim - 1) + 1


def far_view(t, strides, path):
    """t copied into a view of these strides over a buffer of its own: device memory on a
    GPU, on the CPU a sparse file at `path` mapped privately, so that only the pages of the
    view's elements take any."""
    size = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, strides, strict=True))
    if t.is_cuda:
        buffer = torch.empty(size, dtype=t.dtype, device=t.device)
    else:
        with open(path, "wb") as file:
            file.truncate(size * t.element_size())
        buffer = torch.from_file(str(path), shared=False, size=size, dtype=t.dtype)
    return buffer.as_strided(t.shape, strides).copy_(t)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("far", ["tokens", "columns"])
def test_offsets_past_2_31_elements(impl, far, tmp_path):
    """q read from, and q_out written into, views whose elements lie up to past 2**31 elements
    from their first (tokens far apart, or D outermost), bf16, a Hugging Face table and
    positions: both within the bound, where an offset formed in 32 bits wraps and reads or
    writes outside the view (on the CPU a segmentation fault of the interpreter; on a GPU an
    illegal address, which ends the process's CUDA context: run it alone first,
    `python test.py -k past_2_31`)."""
    batch, seq, heads, heads_k, head_dim = 1, 20, 2, 1, 16
    q, k = (random_heads(batch, seq, h, head_dim, torch.bfloat16) for h in (heads, heads_k))
    strides = far_strides(far, batch, seq, heads, head_dim)
    q_far, q_out = (far_view(t, strides, tmp_path / name) for t, name in ((q, "q"), (q, "q_out")))
    angles = {n: t.to(torch.bfloat16) for n, t in angle_sources(head_dim, "hf_table").items()}
    position_ids = torch.randint(0, 16, (batch, seq), device=DEVICE)
    check(impl, "forward", q_far, k, (q_out, torch.empty_like(k)), **angles,
          position_ids=position_ids)  # fmt: skip


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
    mixed = {**angle_sources(8, "table"), "sin": angle_sources(8, "table")["sin"].bfloat16()}
    yield q.bfloat16(), k.bfloat16(), (torch.zeros_like(q.bfloat16()), torch.zeros_like(
        k.bfloat16())), mixed, TypeError, "sin has dtype", "sin dtype not cos's"  # fmt: skip
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
    # One fused qkv (H = 2, Hk = 1): views that share elements, not the interleaved q and k.
    qkv = torch.randn(1, 3, 4, 8, device=DEVICE)
    q_heads, k_head = qkv[:, :, :2], qkv[:, :, 2:3]
    into_q = qkv[:, :, 1:2]  # k one head early: q's second head
    yield q_heads, into_q, (q_heads, into_q), freq, ValueError, "q_out overlaps k", "k on q's head"
    shifted = qkv.as_strided(k_head.shape, k_head.stride(), k_head.storage_offset() - 3)
    yield q_heads, shifted, (q_heads, shifted), freq, ValueError, "q_out overlaps k", \
        "k 3 elements into q"  # fmt: skip
    q_mha, k_mha = torch.randn(1, 3, 2, 2, 8, device=DEVICE).unbind(2)
    yield q_mha, k_mha, (k_mha, q_mha), freq, ValueError, "q_out overlaps k", "outputs swapped"


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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_special_values(impl, interleaved):
    """IEEE arithmetic on the rotation, as reference.py computes it: a NaN in q makes the two
    outputs of its pair NaN and nothing else; an infinity in k makes its pair infinite (or NaN
    where it meets a zero cos or sin); forward and backward."""
    q, k = random_heads(2, 5, 4, 16, torch.bfloat16), random_heads(2, 5, 2, 16, torch.bfloat16)
    q[1, 2, 3, 5] = math.nan
    k[0, 4, 1, 9] = math.inf
    for direction in ("forward", "backward"):
        got_q, got_k = check(impl, direction, q, k, **angle_sources(16, "inv_freq"),
                             interleaved=interleaved)  # fmt: skip
        partner = (5 ^ 1) if interleaved else 13  # element 5's pair: 4 interleaved, 5 + D/2
        assert got_q[1, 2, 3, [5, partner]].isnan().all() and got_q.isnan().sum() == 2
        assert not got_k[0, 4, 1].isfinite().all() and got_k.isfinite().sum() == k.numel() - 2


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 3, 4, 2, 8), (2, 0, 4, 2, 8), (2, 3, 4, 2, 0)], ids=str)
def test_empty_operands(impl, shape):
    """No batch, no token or no head dimension (then a (P, 0) table: there is no inv_freq):
    nothing to rotate, nothing launched, the outputs returned."""
    batch, seq, heads, heads_k, head_dim = shape
    q, k = (random_heads(batch, seq, h, head_dim, torch.float32) for h in (heads, heads_k))
    source = "inv_freq" if head_dim else "table"
    got = check(impl, "forward", q, k, **angle_sources(head_dim, source))
    assert got[0].shape == q.shape and got[1].shape == k.shape


# In a training loop: what a model does around the op beyond forward and backward


@pytest.mark.parametrize("impl", IMPLS)
def test_double_backward_raises(impl):
    """The backward is not itself differentiable: a second derivative (create_graph=True, as a
    gradient penalty asks) raises rather than giving a wrong answer silently (zero through the
    kernels' outputs)."""
    module = implementation(impl).RotaryEmbedding(16, device=DEVICE)
    q = random_heads(2, 4, 4, 16, torch.float32).requires_grad_()
    k = random_heads(2, 4, 2, 16, torch.float32).requires_grad_()
    q_rot, k_rot = module(q, k)
    grads = torch.autograd.grad(q_rot.square().sum() + k_rot.square().sum(), (q, k),
                                create_graph=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="not differentiable"):
        (grads[0].square().sum() + grads[1].square().sum() + q.sum()).backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("convert", ["half", "bfloat16", "to"])
def test_module_keeps_float32_frequencies(impl, convert):
    """model.half(), .bfloat16() or .to(dtype), the usual way to train in 16 bits, convert every
    floating buffer: inv_freq must stay float32 (its exact values, which the bound assumes; a
    16-bit one is refused by check_rope), moved only."""
    module = implementation(impl).RotaryEmbedding(16, base=500000.0, device=DEVICE)
    exact = module.inv_freq.clone()
    converted = module.to(torch.float16) if convert == "to" else getattr(module, convert)()
    assert converted.inv_freq.dtype == torch.float32
    assert torch.equal(converted.inv_freq, exact)
    q, k = random_heads(2, 4, 4, 16, torch.bfloat16), random_heads(2, 4, 2, 16, torch.bfloat16)
    fresh = implementation(impl).RotaryEmbedding(16, base=500000.0, device=DEVICE)
    for got, expected in zip(converted(q, k), fresh(q, k), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_module_pickles(impl):
    """torch.save of a whole model pickles the module's class by name: the class must be found
    where the implementation file binds it."""
    import pickle

    fns = implementation(impl)
    again = pickle.loads(pickle.dumps(fns.RotaryEmbedding(16, base=500000.0, device=DEVICE)))
    assert type(again) is fns.RotaryEmbedding
    assert again.inv_freq.dtype == torch.float32 and again.base == 500000.0


@pytest.mark.parametrize("impl", IMPLS)
def test_module_built_on_meta_device(impl):
    """A large model is built on the meta device, then to_empty() gives it storage and
    load_state_dict its parameters; inv_freq is in no state_dict (as in Hugging Face's), so
    to_empty must leave it computed, not uninitialised memory."""
    fns = implementation(impl)
    with torch.device("meta"):
        module = fns.RotaryEmbedding(16, base=500000.0)
    module.to_empty(device=DEVICE)
    expected = fns.RotaryEmbedding(16, base=500000.0, device=DEVICE).inv_freq
    assert module.inv_freq.dtype == torch.float32 and torch.equal(module.inv_freq, expected)


def check_op(impl, name, args):
    """torch.library.opcheck of kernel_course::<name> (the schema: no undeclared mutation or
    alias; the fake against the real outputs' shapes, strides and dtypes; the autograd
    registration; AOTAutograd's dynamic-shape trace). CuTe's kernels launch only on a GPU:
    without one, its fake is checked against the real Triton op's outputs."""
    if impl == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    op = getattr(torch.ops.kernel_course, name.format(impl))
    if impl != "cute" or ON_GPU:
        torch.library.opcheck(op, args)
        return
    real = getattr(torch.ops.kernel_course, name.format("triton"))(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.parametrize("impl", ["torch", "triton", "cute"])
def test_custom_ops_pass_opcheck(impl):
    """Both ops on representative operands: float32 q and k that require grad, bfloat16 heads
    seen through a transpose with position ids and the interleaved pairs, a (P, D/2) table,
    and the backward given the stride-0 gradient that loss = q.sum() sends."""
    inv_freq = reference.inverse_frequencies(16).to(DEVICE)
    q, k = random_heads(2, 5, 4, 16, torch.float32), random_heads(2, 5, 2, 16, torch.float32)
    q_t = random_heads(2, 5, 4, 16, torch.bfloat16, layout="bhsd").transpose(1, 2)
    k_16 = random_heads(2, 5, 2, 16, torch.bfloat16)
    positions = torch.tensor([[3, 1, 4, 1, 5]], device=DEVICE)
    cos, sin = (torch.randn(9, 8, device=DEVICE) for _ in range(2))
    grad = lambda t: t.clone().requires_grad_()  # noqa: E731
    forward, backward = "rope_{}_forward", "rope_{}_backward"
    check_op(impl, forward, (grad(q), grad(k), None, None, inv_freq, None, False, "bshd"))
    check_op(impl, forward, (q_t, k_16, None, None, inv_freq, positions, True, "bshd"))
    check_op(impl, forward, (q, k, cos, sin, None, None, False, "bshd"))
    ones = torch.ones((), device=DEVICE).expand(2, 5, 4, 16)
    check_op(impl, backward, (ones, k, None, None, inv_freq, None, False, "bshd"))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("source", ["table", "inv_freq"])
def test_angles_that_require_grad_are_refused(impl, source):
    """The angles get no gradient: a table or inv_freq that requires grad (learned frequencies)
    raises a clear error rather than leaving the parameter untrained silently."""
    fns = implementation(impl)
    q, k = random_heads(2, 4, 4, 16, torch.float32), random_heads(2, 4, 2, 16, torch.float32)
    angles = {key: t.clone().requires_grad_() for key, t in angle_sources(16, source).items()}
    with pytest.raises(ValueError, match="no gradient"):
        fns.rope(q.requires_grad_(), k, **angles)
    with torch.no_grad():  # no gradient wanted: fine
        fns.rope(q, k, **angles)
