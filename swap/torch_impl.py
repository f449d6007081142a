"""swap: x <-> y with PyTorch, the way a researcher writes it.

Three copies through a temporary: 6n elements of traffic where a fused kernel needs 4n.
"""

from reference import check_operands, overlap


def swap(x, y):
    check_operands(x, y)
    if overlap(x, y) != "same":
        saved_x = x.clone()
        x.copy_(y)
        y.copy_(saved_x)
    return x, y
