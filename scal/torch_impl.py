"""scal: y = alpha * y with PyTorch, the way a researcher writes it.

`mul_` by a Python number computes in float32 for float16 and bfloat16 data (PyTorch's "opmath"
type) and rounds once at the store, which is exactly the definition. alpha == 0 must not read y.
"""

from reference import check_operands


def scal(alpha, y):
    check_operands(alpha, y)
    if alpha == 0:
        return y.zero_()
    return y.mul_(alpha)
