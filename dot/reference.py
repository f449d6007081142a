"""dot: z = x^T y, the definition.

    z = sum_{i=0}^{n-1} x_i y_i

float16 and bfloat16 widen to float32 exactly, and a product of two float32 numbers (24
significant bits each, so at most 48) is exact in Python's float64. `math.fsum` then adds the n
products with a single rounding at the end, so this returns the exact dot product as nearly as
float64 can hold it. Implementations round the products, the partial sums and the stored
result; README.md derives how far that can take them from this.

The empty sum (n = 0) is 0. NaN and infinities propagate as IEEE arithmetic says (inf * 0 and
inf - inf are NaN). x and y are only read, so they may overlap, be one and the same vector, or
have step 0. This file is the contract: `check_operands` says which inputs are valid (every
implementation calls it before launching anything) and `dot` what the answer is, as plain
Python over Python floats. It returns a new 0-dim float64 tensor and mutates nothing.
"""

import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_vector(name, v):
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1:
        raise ValueError(f"{name} must be a 1-D vector, got a tensor of shape {tuple(v.shape)}")
    if v.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {v.dtype}; supported: float32, float16, bfloat16")


def check_operands(x, y):
    """Raise TypeError/ValueError, naming the operand, for anything dot does not accept."""
    _check_vector("x", x)
    _check_vector("y", y)
    if y.dtype != x.dtype:
        raise TypeError(f"y has dtype {y.dtype} but x has {x.dtype}; dot does not convert")
    if y.numel() != x.numel():
        raise ValueError(f"y has {y.numel()} elements but x has {x.numel()}")
    if y.device != x.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}")


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def dot(x, y):
    check_operands(x, y)
    products = [x_i * y_i for x_i, y_i in zip(x.tolist(), y.tolist(), strict=True)]
    return torch.tensor(exact_sum(products), dtype=torch.float64)
