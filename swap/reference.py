"""swap: x <-> y, the definition.

    (x_i, y_i) <- (y_i, x_i)        for i = 0 .. n-1

Nothing is computed, so nothing is rounded: every implementation must move the bits unchanged.
This file is the contract. `check_operands` says which inputs are valid (every implementation calls
it before launching anything) and `swap` says what the answer is, as plain Python over Python
floats. It returns new float64 tensors (the new x, the new y) and mutates nothing.
"""

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_vector(name, v):
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1:
        raise ValueError(f"{name} must be a 1-D vector, got a tensor of shape {tuple(v.shape)}")
    if v.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {v.dtype}; supported: float32, float16, bfloat16")


def address_range(t):
    """[first byte, one past the last byte] of the memory t's elements occupy (torch strides are
    never negative); None for an empty tensor."""
    n, start = t.numel(), t.data_ptr()
    if n == 0:
        return None
    if t.is_contiguous():  # the common case, and 3x cheaper: n elements side by side
        return start, start + n * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (span + 1) * t.element_size()


def overlap(a, b):
    """How the elements of a and b share memory: 'none', 'same' (the very same elements in the
    same order) or 'partial'. Judged by addresses, not by storages: two storages can cover one
    memory (views of one numpy array, DLPack imports). Conservative: address ranges that cross
    are 'partial' without a search for a common element, except two 1-D views of one step whose
    elements sit in the gaps between each other's (buf[0::2] and buf[1::2]), which are 'none'."""
    range_a, range_b = address_range(a), address_range(b)
    if range_a is None or range_b is None or range_a[1] <= range_b[0] or range_b[1] <= range_a[0]:
        return "none"
    if (
        a.dtype == b.dtype
        and a.shape == b.shape
        and range_a[0] == range_b[0]
        and all(a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] > 1)
    ):
        return "same"
    if a.dim() == b.dim() == 1 and a.dtype == b.dtype:
        size, step = a.element_size(), a.stride(0) * a.element_size()
        if (
            0 < a.stride(0) == b.stride(0)
            and size <= (range_a[0] - range_b[0]) % step <= step - size
        ):
            return "none"  # one step: the elements of one sit in the gaps between the other's
    return "partial"


def check_operands(x, y):
    """Raise TypeError/ValueError, naming the operand, for anything swap does not accept."""
    _check_vector("x", x)
    _check_vector("y", y)
    if y.dtype != x.dtype:
        raise TypeError(f"y has dtype {y.dtype} but x has {x.dtype}; swap does not convert")
    if y.numel() != x.numel():
        raise ValueError(f"y has {y.numel()} elements but x has {x.numel()}")
    if y.device != x.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}")
    for name, v in (("x", x), ("y", y)):
        if v.numel() > 1 and v.stride(0) == 0:
            raise ValueError(
                f"{name} has stride 0: its elements overlap, so the result is undefined"
            )
    if overlap(x, y) == "partial":
        raise ValueError("x and y partially overlap: swap needs them disjoint or identical")


def swap(x, y):
    check_operands(x, y)
    new_x = [float(y_i) for y_i in y.tolist()]
    new_y = [float(x_i) for x_i in x.tolist()]
    return torch.tensor(new_x, dtype=torch.float64), torch.tensor(new_y, dtype=torch.float64)
