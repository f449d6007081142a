"""cross-entropy with PyTorch, the way a researcher writes it, and the model plumbing.

The forward is the shifted log-sum-exp in float32 torch ops minus the target's logit (and,
with label smoothing, the row mean); the backward is README.md's formula in float32 torch ops.
Both sum in the library's own, undocumented order, so README.md bounds them by what holds for
every order. `reduce_loss` is `sum()` (one fixed order on a given device and shape) and the mean
divides by the count of rows not ignored.

`autograd_function` and `traceable_cross_entropy` build, over any implementation's three plain
functions (forward, backward, reduce_loss), the autograd.Function for eager calls and the custom
ops torch.compile sees; `fused_when_differentiated` the eager path over a fused pass (the
gradient computed in the forward, README.md "The fused path"); `CrossEntropyLoss` is the
drop-in for torch.nn.CrossEntropyLoss. triton_impl.py calls them with its own functions.
"""

import torch

from reference import REDUCTIONS, check_backward, check_forward, check_reduction


def cross_entropy_forward(logits, target, ignore_index, label_smoothing, loss, lse):
    check_forward(logits, target, ignore_index, label_smoothing, loss, lse)
    if logits.shape[0] == 0:
        return loss, lse
    x = logits.float()
    # Not torch.logsumexp, which returns +inf for a row holding +inf: the definition (and
    # torch's cross_entropy, through log_softmax) says NaN. A row of -inf is shifted by 0.
    row_max = x.max(dim=-1, keepdim=True).values
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    lse.copy_((shift + torch.exp(x - shift).sum(dim=-1, keepdim=True).log())[:, 0])
    kept = target != ignore_index
    target_logit = x.gather(1, torch.where(kept, target, 0).long()[:, None])[:, 0]
    row_loss = lse - target_logit
    if label_smoothing:
        row_loss += label_smoothing * (target_logit - x.mean(dim=-1))
    loss.copy_(torch.where(kept, row_loss, 0.0))
    return loss, lse


def cross_entropy_backward(logits, target, lse, dloss, ignore_index, label_smoothing, dlogits):
    check_backward(logits, target, lse, dloss, ignore_index, label_smoothing, dlogits)
    if logits.shape[0] == 0:
        return dlogits
    m, v = logits.shape
    kept = target != ignore_index
    q = torch.full((m, v), label_smoothing / v, device=logits.device)
    q.scatter_(1, torch.where(kept, target, 0).long()[:, None], 1 - label_smoothing + q[:, :1])
    dx = (torch.exp(logits.float() - lse[:, None]) - q) * dloss[:, None]
    dlogits.copy_(torch.where(kept[:, None], dx, 0.0))
    return dlogits


def reduce_loss(loss, target, ignore_index, reduction):
    check_reduction(loss, target, ignore_index, reduction)
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()


def row_gradient(grad, target, ignore_index, reduction):
    """dloss/dloss_i for every row, float32 (M,), from the gradient of the reduced loss: the
    mean's 1 / count and the sum's 1 broadcast (stride 0, nothing is copied)."""
    if reduction == "none":
        return grad.float()
    if reduction == "mean":
        grad = grad.float() / (target != ignore_index).sum()
    return grad.float().expand(target.shape[0])


def loss_and_lse(fns, logits, target, ignore_index, label_smoothing, reduction):
    """(the reduced loss in the logits' dtype, as torch returns it; lse) by fns' functions."""
    m = logits.shape[0]
    new = lambda: torch.empty(m, device=logits.device)  # noqa: E731
    loss, lse = fns[0](logits, target, ignore_index, label_smoothing, new(), new())
    return fns[2](loss, target, ignore_index, reduction).to(logits.dtype), lse


def dlogits_of(fns, logits, target, lse, grad, ignore_index, label_smoothing, reduction, out):
    dloss = row_gradient(grad, target, ignore_index, reduction)
    return fns[1](logits, target, lse, dloss, ignore_index, label_smoothing, out)


def autograd_function(forward, backward, reduce):
    """CrossEntropyFunction.apply(logits, target, ignore_index, label_smoothing, reduction,
    in_place_backward) over an implementation's plain functions: the eager path. With
    in_place_backward the gradient overwrites the saved logits (no second (M, V) buffer, the
    trick of fused loss kernels): right only when nothing else reads those logits afterwards."""
    fns = (forward, backward, reduce)

    class CrossEntropyFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, in_place):
            if reduction not in REDUCTIONS:
                raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
            out, lse = loss_and_lse(fns, logits, target, ignore_index, label_smoothing, reduction)
            ctx.save_for_backward(logits, target, lse)
            ctx.options = ignore_index, label_smoothing, reduction, in_place
            return out

        @staticmethod
        def backward(ctx, grad):
            logits, target, lse = ctx.saved_tensors
            ignore_index, label_smoothing, reduction, in_place = ctx.options
            out = logits if in_place else torch.empty_like(logits)
            dlogits = dlogits_of(
                fns, logits, target, lse, grad, ignore_index, label_smoothing, reduction, out
            )
            return dlogits, None, None, None, None, None

    return CrossEntropyFunction


def fused_when_differentiated(fused, scale):
    """The eager cross_entropy(logits, target, ignore_index, label_smoothing, reduction,
    in_place) over an implementation's fused pass, fused(logits, target, ignore_index,
    label_smoothing, reduction, loss, lse, dlogits) -> (reduced loss, lse, dlogits), dlogits
    the gradient for a gradient of 1 (None: no gradient), and scale(dlogits, target, grad,
    ignore_index), which multiplies it by autograd's gradient in place. When autograd will want
    the gradient, a Function whose forward is the fused pass; otherwise the forward alone,
    outside autograd (its bookkeeping would be host time for nothing). With in_place the
    gradient overwrites the logits in the forward already: right only when nothing else reads
    them afterwards."""

    class FusedCrossEntropyFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, in_place):
            rows = lambda: torch.empty(logits.shape[0], device=logits.device)  # noqa: E731
            dlogits = logits if in_place else torch.empty_like(logits)
            options = (ignore_index, label_smoothing, reduction)
            out, _, dlogits = fused(logits, target, *options, rows(), rows(), dlogits)
            ctx.save_for_backward(dlogits.detach(), target)
            ctx.ignore_index, ctx.scaled = ignore_index, False
            return out

        @staticmethod
        def backward(ctx, grad):
            if ctx.scaled:  # scaled in place already: a second pass would scale it twice
                raise RuntimeError("the fused cross-entropy's backward runs once (no retain_graph)")
            ctx.scaled = True
            dlogits, target = ctx.saved_tensors
            return scale(dlogits, target, grad, ctx.ignore_index), None, None, None, None, None

    def cross_entropy(logits, target, ignore_index, label_smoothing, reduction, in_place):
        options = (ignore_index, label_smoothing, reduction)
        if torch.is_grad_enabled() and logits.requires_grad:
            return FusedCrossEntropyFunction.apply(logits, target, *options, in_place)
        rows = lambda: torch.empty(logits.shape[0], device=logits.device)  # noqa: E731
        return fused(logits, target, *options, rows(), rows(), None)[0]

    return cross_entropy


def traceable_cross_entropy(name, forward, backward, reduce, eager=None):
    """cross_entropy(logits, target, ...) over an implementation's plain functions, registered as
    the custom ops kernel_course::cross_entropy_<name>_{forward,backward}: torch.compile sees an
    opaque call with a known output (register_fake) and a backward it can put in its graph. The
    compiled path never writes in place (a custom op that mutates its input would have to say
    so to the compiler); in_place_backward applies to eager calls, which go to
    eager(logits, target, ignore_index, label_smoothing, reduction, in_place) (by default the
    autograd.Function over the three functions)."""
    fns = (forward, backward, reduce)
    prefix = f"kernel_course::cross_entropy_{name}"

    @torch.library.custom_op(f"{prefix}_forward", mutates_args=())
    def forward_op(
        logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
        reduction: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return loss_and_lse(fns, logits, target, ignore_index, label_smoothing, reduction)

    @torch.library.custom_op(f"{prefix}_backward", mutates_args=())
    def backward_op(
        logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
        ignore_index: int, label_smoothing: float, reduction: str,
    ) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(logits)
        return dlogits_of(
            fns, logits, target, lse, grad, ignore_index, label_smoothing, reduction, out
        )

    @forward_op.register_fake
    def _(logits, target, ignore_index, label_smoothing, reduction):
        m = logits.shape[0]
        shape = (m,) if reduction == "none" else ()
        return logits.new_empty(shape), logits.new_empty(m, dtype=torch.float32)

    @backward_op.register_fake
    def _(logits, target, lse, grad, ignore_index, label_smoothing, reduction):
        return torch.empty_like(logits)

    def save_inputs(ctx, inputs, output):
        logits, target, *options = inputs
        ctx.save_for_backward(logits, target, output[1])
        ctx.options = options

    def backward_of_forward_op(ctx, grad, grad_lse):
        logits, target, lse = ctx.saved_tensors
        return backward_op(logits, target, lse, grad, *ctx.options), None, None, None, None

    forward_op.register_autograd(backward_of_forward_op, setup_context=save_inputs)
    eager = eager or autograd_function(forward, backward, reduce).apply

    def cross_entropy(
        logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
        in_place_backward=False,
    ):  # fmt: skip
        """torch.nn.functional.cross_entropy's loss for (M, V) logits and (M,) targets:
        differentiable, traceable by torch.compile. Eager calls take the autograd.Function (a
        custom op's Python dispatch costs tens of microseconds a call)."""
        if torch.compiler.is_compiling():
            return forward_op(logits, target, ignore_index, float(label_smoothing), reduction)[0]
        return eager(logits, target, ignore_index, label_smoothing, reduction, in_place_backward)

    return cross_entropy


class CrossEntropyLossModule(torch.nn.Module):
    """torch.nn.CrossEntropyLoss(ignore_index, reduction, label_smoothing)'s interface over an
    implementation's `loss_function` (each file's `CrossEntropyLoss` sets it): forward(input,
    target) with (M, V) logits and (M,) class indices. Class weights and probability targets
    are not supported (a TypeError says so)."""

    loss_function = None

    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        super().__init__()
        if weight is not None:
            raise TypeError("class weights are not supported: weight must be None")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing = label_smoothing

    def forward(self, input, target):
        return self.loss_function(
            input, target, self.ignore_index, self.reduction, self.label_smoothing
        )


CrossEntropyFunction = autograd_function(cross_entropy_forward, cross_entropy_backward, reduce_loss)


def cross_entropy(
    logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
    in_place_backward=False,
):  # fmt: skip
    """torch.nn.functional.cross_entropy's loss for (M, V) logits and (M,) targets."""
    return CrossEntropyFunction.apply(
        logits, target, ignore_index, label_smoothing, reduction, in_place_backward
    )


class CrossEntropyLoss(CrossEntropyLossModule):
    """Drop-in for torch.nn.CrossEntropyLoss, on this file's cross_entropy."""

    loss_function = staticmethod(cross_entropy)
