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


def overlap(a, b):
    """How the elements of two equally long 1-D views of one dtype share memory: 'none', 'same'
    (the very same elements in the same order) or 'partial'. Interleaved views such as
    buf[0::2] and buf[1::2] share no element and are 'none'; views of different steps whose
    address ranges cross are reported 'partial' without searching for a common element."""
    n, size = a.numel(), a.element_size()
    if n == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return "none"
    start_a, start_b = a.data_ptr(), b.data_ptr()
    step_a, step_b = a.stride(0) * size, b.stride(0) * size
    if start_a == start_b and (step_a == step_b or n == 1):
        return "same"
    end_a, end_b = start_a + (n - 1) * step_a + size, start_b + (n - 1) * step_b + size
    if end_a <= start_b or end_b <= start_a:
        return "none"
    if step_a == step_b and size <= (start_a - start_b) % step_a <= step_a - size:
        return "none"  # equal steps: the elements of one sit in the gaps between the other's
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
