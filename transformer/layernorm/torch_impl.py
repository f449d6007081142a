"""layernorm with PyTorch, the way a researcher writes it, and the glue that makes any
implementation usable in a model.

The forward and the backward are README.md's formulas in float32 torch ops: a two-pass
variance (the mean first, then the mean of the squared deviations), `torch.rsqrt`, and the
column sums of dweight and dbias by `sum(dim=0)`. Every sum runs in the library's own,
undocumented order, so README.md bounds them by what holds for every order.

The glue, written once here and reused by triton_impl.py and cute_impl.py:
  * `autograd_function(forward, backward)`: a torch.autograd.Function over a pair of plain
    functions with explicit outputs (the eager path);
  * `custom_ops(name, forward, backward, eager)`: the same pair registered as torch.library
    custom ops with fake implementations and an autograd formula, so
    torch.compile(fullgraph=True) traces a model that calls them; returns the differentiable
    `layernorm(x, w, b, eps)`, which takes the Function `eager` outside torch.compile;
  * `LayerNorm`: the drop-in for torch.nn.LayerNorm (same arguments, parameters and
    state_dict keys), calling its class's `function`.
"""

import math
import numbers

import torch

from reference import as_rows, as_vector, check_backward, check_forward, to_float32


def layernorm_forward(x, weight, bias, eps, y, mean, rstd):
    check_forward(x, weight, bias, eps, y, mean, rstd)
    if x.numel():
        x32 = as_rows(x)[0].float()
        mu = x32.mean(dim=-1, keepdim=True)
        centred = x32 - mu
        r = torch.rsqrt(centred.square().mean(dim=-1, keepdim=True) + to_float32(eps))
        out = centred * r
        if weight is not None:
            out = out * weight.float()
        if bias is not None:
            out = out + bias.float()
        y.copy_(out.view(y.shape))
        mean.copy_(mu.view(mean.shape))
        rstd.copy_(r.view(rstd.shape))
    return y, mean, rstd


def layernorm_backward(x, weight, mean, rstd, dy, dx, dweight, dbias):
    check_backward(x, weight, mean, rstd, dy, dx, dweight, dbias)
    n = x.shape[-1]
    x32, dy32 = as_rows(x)[0].float(), as_rows(dy)[0].float()
    mu, r = as_vector(mean)[0].view(-1, 1), as_vector(rstd)[0].view(-1, 1)
    xhat = (x32 - mu) * r
    g = dy32 * weight.float() if weight is not None else dy32
    if x.numel():
        a = g.sum(dim=-1, keepdim=True) / n
        b = (g * xhat).sum(dim=-1, keepdim=True) / n
        dx.copy_(((g - a - xhat * b) * r).view(dx.shape))
    if dweight is not None:
        dweight.copy_((dy32 * xhat).sum(dim=0))
    if dbias is not None:
        dbias.copy_(dy32.sum(dim=0))
    return dx, dweight, dbias


def stats_like(x):
    """Fresh float32 mean and rstd for x: one value per row."""
    return (torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for _ in range(2))


def autograd_function(forward, backward):
    """A torch.autograd.Function over forward(x, w, b, eps, y, mean, rstd) and
    backward(x, w, mean, rstd, dy, dx, dw, db): it saves x, w and the float32 statistics."""

    class LayerNormFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps):
            y, mean, rstd = forward(x, weight, bias, eps, torch.empty_like(x), *stats_like(x))
            ctx.save_for_backward(x, weight, mean, rstd)
            ctx.bias_dtype = None if bias is None else bias.dtype
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, mean, rstd = ctx.saved_tensors
            wants, n = ctx.needs_input_grad, x.shape[-1]
            dweight = torch.empty_like(weight) if wants[1] else None
            dbias = None
            if wants[2]:
                dbias = torch.empty(n, dtype=ctx.bias_dtype, device=x.device)
            dx, dweight, dbias = backward(x, weight, mean, rstd, dy, torch.empty_like(x),
                                          dweight, dbias)  # fmt: skip
            return dx, dweight, dbias, None

    return LayerNormFunction


def custom_ops(name, forward, backward, eager):
    """Register kernel_course::layernorm_<name>_forward and _backward and return the
    differentiable layernorm(x, weight, bias, eps) over them. torch.compile sees an opaque call
    with known outputs (the fakes) and a backward it can put in its graph. An absent weight's
    or bias's gradient comes back as an empty tensor (custom ops return tensors only). `eager`
    is autograd_function's Function over the same pair, which eager calls take."""

    @torch.library.custom_op(f"kernel_course::layernorm_{name}_forward", mutates_args=())
    def forward_op(
        x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return forward(x, weight, bias, eps, torch.empty_like(x), *stats_like(x))

    @torch.library.custom_op(f"kernel_course::layernorm_{name}_backward", mutates_args=())
    def backward_op(
        x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        mean: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        dweight, dbias = parameter_gradients(x, weight, bias)
        dx, _, _ = backward(x, weight, mean, rstd, dy, torch.empty_like(x),
                            dweight if weight is not None else None,
                            dbias if bias is not None else None)  # fmt: skip
        return dx, dweight, dbias

    @forward_op.register_fake
    def _(x, weight, bias, eps):
        return torch.empty_like(x), *stats_like(x)

    @backward_op.register_fake
    def _(x, weight, bias, mean, rstd, dy):
        return torch.empty_like(x), *parameter_gradients(x, weight, bias)

    def setup_context(ctx, inputs, output):
        x, weight, bias, _ = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, bias, mean, rstd)

    def backward_formula(ctx, dy, _dmean, _drstd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = backward_op(x, weight, bias, mean, rstd, dy)
        return (dx, dweight if weight is not None else None,
                dbias if bias is not None else None, None)  # fmt: skip

    forward_op.register_autograd(backward_formula, setup_context=setup_context)

    def layernorm(x, weight=None, bias=None, eps=1e-5):
        """layernorm over x's last dimension: differentiable, traceable by torch.compile.
        Eager calls take the autograd.Function: a custom op's Python dispatch costs tens of
        microseconds a call, more than a small kernel's whole run; torch.compile sees the op."""
        if torch.compiler.is_compiling():
            return forward_op(x, weight, bias, eps)[0]
        return eager.apply(x, weight, bias, eps)

    return layernorm


def parameter_gradients(x, weight, bias):
    """Fresh (dweight, dbias), each (N,) in its parameter's dtype or (0,) when it is absent."""
    n = x.shape[-1]
    return tuple(
        torch.empty(
            (n,) if p is not None else (0,),
            dtype=p.dtype if p is not None else x.dtype,
            device=x.device,
        )  # fmt: skip
        for p in (weight, bias)
    )


LayerNormFunction = autograd_function(layernorm_forward, layernorm_backward)


def layernorm(x, weight=None, bias=None, eps=1e-5):
    """layernorm over x's last dimension, differentiable (torch's autograd over this file)."""
    return LayerNormFunction.apply(x, weight, bias, eps)


class LayerNorm(torch.nn.Module):
    """A drop-in for torch.nn.LayerNorm: the same arguments, parameters `weight` and `bias`
    (state_dict keys included) and initialisation. The normalised dimensions, the last
    len(normalized_shape) of the input, flatten into one row of N elements."""

    function = staticmethod(layernorm)

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x):
        dims = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - dims :]) != self.normalized_shape:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; its last dimensions must be {self.normalized_shape}"
            )
        n = math.prod(self.normalized_shape)
        flat = lambda p: None if p is None else p.reshape(n)  # noqa: E731
        rows = x.reshape(*x.shape[: x.dim() - dims], n)
        return self.function(rows, flat(self.weight), flat(self.bias), self.eps).view(x.shape)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")  # fmt: skip
