"""scal: y = alpha * y with PyTorch, the way a researcher writes it.

`mul_` by a Python number computes in float32 for float16 and bfloat16 data (PyTorch's "opmath"
type) and rounds once at the store, which is exactly the definition. alpha is the definition's
float32 scalar, so a value that rounds to 0 in float32 is a zero, and a zero must not read y.
"""

from reference import check_operands, to_float32


def scal(alpha, y):
    check_operands(alpha, y)
    alpha32 = to_float32(float(alpha))
    if alpha32 == 0.0:
        return y.zero_()
    return y.mul_(alpha32)
