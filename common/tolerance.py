"""Turn a README's forward error bound into a check.

Every kernel in the course is "equivalent to its definition" in one of two senses:

* bitwise: the kernel does no rounding the definition does not do (copy, swap, scal), so the
  stored bits must equal the reference rounded to the output dtype;
* within a derived bound: the kernel rounds in a different order than the exact math, and the
  folder's README derives how far that can move each element, |y_hat - y| <= bound, from
  the unit roundoff u of each precision involved and gamma(k) = k*u / (1 - k*u).

README.md beside this file derives the model. Nothing here knows about any particular kernel.
"""

import torch

# Unit roundoff u = 2**-p for a format with p significand bits (counting the implicit one):
# round-to-nearest moves a value by at most a relative u.
_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


# Approximate instructions (common/README.md, "Approximate instructions"): the relative error
# against the exact function for a normal result. ex2.approx.ftz.f32 is within 2 ulp of the
# correctly rounded 2**a (PTX ISA): 2 ulp <= 4u of the result, plus the u of that rounding.
# rsqrt.approx.ftz.f32 (and without .ftz): "maximum relative error 2**-22.9 over the entire
# range" (PTX ISA), against the exact 1/sqrt(a), so no further rounding is added.
APPROX_RELATIVE_ERROR = {"ex2.approx.ftz.f32": 5 * 2.0**-24, "rsqrt.approx.ftz.f32": 2.0**-22.9}


def unit_roundoff(dtype):
    return 2.0 ** -_SIGNIFICAND_BITS[dtype]


def gamma(k, u):
    """Higham's gamma_k: the relative error bound of k successive roundings, |prod(1+d_i) - 1|."""
    if k * u >= 1:
        raise ValueError(f"gamma({k}) is unbounded for u = {u}: k*u >= 1")
    return k * u / (1 - k * u)


def underflow(dtype):
    """Absolute error of one rounding among the subnormals, where the relative bound u fails:
    half the subnormal spacing, tiny * u. A rounding moves v by at most u*|v| + underflow."""
    return torch.finfo(dtype).tiny * unit_roundoff(dtype)


def store_roundoff(dtype, compute_dtype=torch.float32):
    """u of the final store: 0 when the result is already held in the output's own precision."""
    return 0.0 if dtype == compute_dtype else unit_roundoff(dtype)


def _bits(t):
    integer_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(integer_type)


def assert_same_bits(actual, expected, what="result"):
    """Bitwise equality (NaN payloads and the sign of zero included) of two tensors of one dtype."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: got {actual.dtype} {tuple(actual.shape)}, "
            f"expected {expected.dtype} {tuple(expected.shape)}"
        )
    actual, expected = actual.cpu().flatten(), expected.cpu().flatten()
    differ = _bits(actual) != _bits(expected)
    if differ.any():
        first = int(differ.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {actual.numel()} elements differ in their bits; "
            f"first at {first}: got {actual[first].item()!r}, expected {expected[first].item()!r}"
        )


def assert_matches_rounded(actual, exact, what="result"):
    """Bitwise equality with the exact float64 result rounded once to actual's dtype. A computed
    NaN matches any NaN: IEEE 754 leaves its sign and payload to the hardware (x86 keeps the
    input's, NVIDIA GPUs return 0x7fffffff), so only data movement must keep NaN bits."""
    actual, expected = actual.cpu(), exact.to(actual.dtype)
    both_nan = actual.isnan() & expected.isnan()
    assert_same_bits(torch.where(both_nan, expected, actual), expected, what)


def assert_within_bound(actual, exact, bound, what="result"):
    """|actual - exact| <= bound elementwise, exact and bound in float64 (any shape; positions
    in the message count elements in row-major order).

    Non-finite exact values must be reproduced exactly (NaN where NaN, the same infinity), and a
    finite exact value must not come back as NaN or infinity."""
    actual = actual.detach().cpu().to(torch.float64).flatten()
    exact = exact.cpu().to(torch.float64).flatten()
    bound = bound.cpu().to(torch.float64).flatten()
    finite = torch.isfinite(exact)
    nan_mismatch = torch.isnan(actual) != torch.isnan(exact)
    inf_mismatch = ~finite & ~torch.isnan(exact) & (actual != exact)
    error = torch.where(finite, (actual - exact).abs(), torch.zeros_like(exact))
    too_far = finite & ~(error <= bound)  # a NaN error (actual NaN) also lands here
    bad = nan_mismatch | inf_mismatch | too_far
    if bad.any():
        first = int(bad.nonzero()[0])
        ratios = error[finite] / bound[finite].clamp_min(torch.finfo(torch.float64).tiny)
        worst = f"{ratios.max().item():.3g}" if ratios.numel() else "none finite"
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {actual.numel()} elements outside the bound; first at "
            f"{first}: got {actual[first].item()!r}, exact {exact[first].item()!r}, "
            f"bound {bound[first].item():.3e}; worst error/bound {worst}"
        )
