"""axpby: y = alpha*x + beta*y with PyTorch, the way a researcher writes it.

The arithmetic runs on float32 tensors: `torch.add(beta32 * y32, x32, alpha=alpha32, out=y)`
rounds each product and the sum in float32 and the store once, the fused kernels' roundings. On
16-bit tensors torch would work in their dtype instead: `beta * y` rounded to 16 bits (into the
subnormals for a tiny beta), and `alpha=` converted to 16 bits (1e5 overflows float16 with a
RuntimeError, 1e-8 becomes 0). The price is traffic: 16-bit data is widened into temporaries,
about 9n elements where a fused kernel moves 3n (README.md, "Fusion"). The zero cases
take their own paths so that an operand BLAS does not read is never touched.
"""

import torch

from reference import check_operands, to_float32


def axpby(alpha, x, beta, y):
    check_operands(alpha, x, beta, y)
    # The definition's scalars: a value that rounds to 0 in float32 is a zero.
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    if alpha32 == 0.0:
        return y.zero_() if beta32 == 0.0 else torch.mul(y.float(), beta32, out=y)
    if beta32 == 0.0:
        return torch.mul(x.float(), alpha32, out=y)
    return torch.add(y.float() * beta32, x.float(), alpha=alpha32, out=y)
