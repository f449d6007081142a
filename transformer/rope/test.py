"""Tests for RoPE: every implementation, forward and backward, lands within README.md's bound.

This file is section (1), the set-up and the bound model, with the helpers the sections share;
each later section is a file of its own: test_2_contract.py (every implementation, autograd and
the module), test_3_triton.py, test_4_cute.py (builds, dispatch and PTX), test_5_gpu.py. Run
them all with `python test.py` (extra arguments go to pytest: `python test.py -k cute -x`).
Without a GPU, torch runs on the CPU and Triton under its interpreter; a child process compiles
the Triton kernel for sm_90 and reads its PTX; the CuTe kernel is compiled for sm_90a, its PTX
read and its entry's checks run (launching it needs a GPU).
"""

import math
import os
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

CUTE_MISSING = None  # why the CuTe tests skip: set below where cute_impl cannot be imported
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


if __name__ == "__main__":
    # The section files, in their numbered order: every test_*.py beside this file.
    files = [__file__, *sorted(str(path) for path in HERE.glob("test_*.py"))]
    sys.exit(pytest.main([*files, *sys.argv[1:]]))
