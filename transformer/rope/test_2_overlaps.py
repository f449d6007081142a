"""RoPE tests, section (2), continued: operands that share one buffer. q and k cut from one
fused qkv projection interleave in memory but share no element, so rotating them in place (or
into the views of one fused output) is valid; views that do share elements are refused
(test_2_contract.py's bad inputs). README.md, "Operands that share a buffer", says how the
check decides. The set-up and the shared helpers live in test.py, which runs this file."""

import math

import pytest
import torch
from test import DEVICE, IMPLS, angle_sources, check, run

import reference

# (2) The contract: fused qkv buffers ----------------------------------------------------------


def split_qkv(qkv, form, layout, heads):
    """q, k and v as views of qkv the way models cut them: 'mha' from (B, S, 3, H, D)
    (qkv.unbind(2), or permuted to (3, B, H, S, D) for 'bhsd'), 'gqa' from (B, S, H + 2 Hk, D)
    (or (B, H + 2 Hk, S, D)) split along the heads."""
    if form == "mha":
        return qkv.unbind(2) if layout == "bshd" else qkv.permute(2, 0, 3, 1, 4).unbind(0)
    heads_k = (qkv.shape[2 if layout == "bshd" else 1] - heads) // 2
    return qkv.split([heads, heads_k, heads_k], dim=2 if layout == "bshd" else 1)


def fused_buffer(form, layout, batch, seq, heads, head_dim, dtype):
    """A random qkv projection output of the form's shape (GQA: Hk = H / 2)."""
    if form == "mha":
        shape = (batch, seq, 3, heads, head_dim)
    else:
        width = heads + 2 * (heads // 2)
        shape = (batch, seq, width, head_dim) if layout == "bshd" else (batch, width, seq, head_dim)
    return torch.randn(shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", ["mha", "gqa"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("source", ["table", "inv_freq"])
def test_fused_qkv_in_place_and_out_of_place(impl, form, layout, source):
    """q and k of one fused qkv: rotated out of place into the q and k views of a NaN-filled
    output qkv of the same layout (within the bound, its v part never written, the input
    unchanged), then in place, which gives the same bits, its v part untouched. D = 64 in bf16
    is whole 16-byte runs: on a GPU CuTe takes its vector kernels, not torch's fallback."""
    batch, seq, heads, head_dim = 2, 5, 4, 64
    qkv = fused_buffer(form, layout, batch, seq, heads, head_dim, torch.bfloat16)
    out = torch.full_like(qkv, math.nan)
    (q, k, v), (q_out, k_out, v_out) = (split_qkv(t, form, layout, heads) for t in (qkv, out))
    options = {**angle_sources(head_dim, source), "layout": layout,
               "position_ids": torch.randint(0, 16, (batch, seq), device=DEVICE)}  # fmt: skip
    before = qkv.clone()
    check(impl, "forward", q, k, (q_out, k_out), **options)
    assert v_out.isnan().all(), "the output's v part was written"
    assert torch.equal(qkv.view(torch.int16), before.view(torch.int16)), "the input changed"
    run(impl, "forward", q, k, (q, k), **options)
    for got, want in ((q, q_out), (k, k_out), (v, split_qkv(before, form, layout, heads)[2])):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def element_offsets(view):
    """The storage offsets of a view's elements (of a buffer holding 0, 1, 2, ...)."""
    return set(view.flatten().tolist())


def sub_box(parent, steps):
    """A random box of a tensor: a start and a size in every dimension, every steps[d]-th."""
    index = []
    for size, step in zip(parent.shape, steps, strict=True):
        start = int(torch.randint(0, size, ()))
        index.append(slice(start, start + int(torch.randint(1, size - start + 1, ())), step))
    return parent[tuple(index)]


def random_parent(offsets):
    """offsets (0, 1, 2, ...) seen as a random 5-D shape with its dimensions permuted."""
    sizes = torch.randint(1, 5, (5,)).tolist()
    parent = offsets[: math.prod(sizes)].view(sizes)
    return parent.permute(torch.randperm(5).tolist())


def random_pair(offsets):
    """Two random views of offsets and whether they move along one lattice: two boxes of one
    (permuted) tensor taken with the same steps, the second's dimensions reordered or not
    (True), or a box of another shape of the buffer (False)."""
    parent, steps = random_parent(offsets), (torch.rand(5) < 0.2).long().add(1).tolist()
    a, source = sub_box(parent, steps), int(torch.randint(0, 3, ()))
    if source < 2:  # the same tensor and steps: the same strides, in another order or not
        order = torch.randperm(5) if source else torch.arange(5)
        return a, sub_box(parent, steps).permute(order.tolist()), True
    return a, sub_box(random_parent(offsets), [1] * 5), False


def test_share_an_element_against_the_element_sets():
    """The check against brute force on random view pairs of one buffer. Views along one
    lattice are decided exactly, sharing or not. A box of another shape of the buffer may be
    refused conservatively, but a pair that shares an element is never passed. Every kind of
    answer occurs."""
    offsets = torch.arange(1024)
    answers = {"one lattice": set(), "any strides": set()}
    for _ in range(400):
        a, b, one_lattice = random_pair(offsets)
        shares = bool(element_offsets(a) & element_offsets(b))
        kind = reference.overlap(a, reference.address_range(a), b, reference.address_range(b))
        if one_lattice:
            assert (kind != "none") == shares, (a.shape, a.stride(), a.storage_offset(), b.shape,
                                                b.stride(), b.storage_offset())  # fmt: skip
            answers["one lattice"].add(shares)
        else:
            assert kind != "none" or not shares, (a.shape, a.stride(), b.shape, b.stride())
            answers["any strides"].add(kind == "none")
    assert answers == {"one lattice": {True, False}, "any strides": {True, False}}


def test_memoised_decision_matches_the_search():
    """share_an_element answers from views_meet's cache, keyed on the integers alone: on random
    view pairs the answer equals the search run afresh (views_meet.__wrapped__), and the same
    views of another buffer, at another address, are answered from the cache, equally (the key
    holds the offset between the views, not where they lie)."""
    offsets, moved = torch.arange(1024), torch.arange(1024)
    for _ in range(200):
        a, b, _ = random_pair(offsets)
        key = (b.data_ptr() - a.data_ptr(), a.element_size(), b.element_size(), a.shape,
               a.stride(), b.shape, b.stride())  # fmt: skip
        fresh = reference.views_meet.__wrapped__(*key)
        assert reference.share_an_element(a, b) == fresh, key
        a2, b2 = (moved.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (a, b))
        hits = reference.views_meet.cache_info().hits
        assert reference.share_an_element(a2, b2) == fresh, key
        assert reference.views_meet.cache_info().hits == hits + 1, key
