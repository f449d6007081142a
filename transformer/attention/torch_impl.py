"""Attention in PyTorch ops: the scores materialised, the quick way a researcher writes it.

S = Q K^T * scale is an (S_q, S_k) float32 matrix per batch and head: at S = 16384 and 32 heads
that is 32 GiB per batch element, which is why the kernels never write it (README.md). P is
rounded to the input dtype before P V, as the kernels do (their tensor cores take 16-bit P),
so that all three implementations share README.md's bound. The backward recomputes P from the
saved lse. `model_plumbing` wraps any implementation's pair of explicit-output functions into
an autograd.Function, a convenience `attention(q, k, v, causal=False, scale=None)`, and a
torch.library custom op that torch.compile traces without a graph break.
"""

import math

import torch

from reference import (
    backward_inputs,
    backward_outputs,
    check_operands,
    default_scale,
    forward_outputs,
)


def causal_mask(s_q, s_k, device):
    """True where query i must not see key j: j > i + S_k - S_q (bottom-right aligned)."""
    rows = torch.arange(s_q, device=device)[:, None]
    return torch.arange(s_k, device=device)[None, :] > rows + (s_k - s_q)


def probabilities(q, k, causal, scale, lse=None, dtype=torch.float32):
    """(P of shape (B, H, S_q, S_k), lse (B, H, S_q)) computed in `dtype`: from the saved lse
    when given. A query that sees no key has lse = -inf and a row of P = 0."""
    group = q.shape[2] // k.shape[2]
    keys = k.to(dtype).repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.to(dtype), keys) * scale
    if causal:
        scores = scores.masked_fill(causal_mask(q.shape[1], k.shape[1], q.device), -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    return torch.where((lse == -math.inf)[..., None], 0.0, p), lse


def attention_forward(q, k, v, causal, scale, o, lse):
    check_operands(q, k, v, causal, scale, forward_outputs(q, o, lse))
    scale = default_scale(q.shape[3], scale)
    p, row_lse = probabilities(q, k, causal, scale)
    values = v.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    o.copy_(torch.einsum("bhij,bjhd->bihd", p.to(q.dtype).float(), values))
    lse.copy_(row_lse)
    return o, lse


def attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv):
    check_operands(q, k, v, causal, scale, backward_outputs(q, k, dq, dk, dv),
                   backward_inputs(q, o, lse, do))  # fmt: skip
    scale = default_scale(q.shape[3], scale)
    batch, s_k, heads_kv, head_dim = k.shape
    group = q.shape[2] // heads_kv
    p, _ = probabilities(q, k, causal, scale, lse)
    d_o = do.float()
    values = v.float().repeat_interleave(group, dim=2)
    delta = (d_o * o.float()).sum(-1).transpose(1, 2)  # (B, H, S_q)
    ds = p * (torch.einsum("bihd,bjhd->bhij", d_o, values) - delta[..., None])
    keys = k.float().repeat_interleave(group, dim=2)
    dq.copy_(torch.einsum("bhij,bjhd->bihd", ds, keys) * scale)

    def per_kv_head(t):  # (B, S_k, H, D) -> (B, S_k, H_kv, D): a group's query heads summed
        return t.reshape(batch, s_k, heads_kv, group, head_dim).sum(3)

    dk.copy_(per_kv_head(torch.einsum("bhij,bihd->bjhd", ds, q.float()) * scale))
    dv.copy_(per_kv_head(torch.einsum("bhij,bihd->bjhd", p, d_o)))
    return dq, dk, dv


def model_plumbing(name, forward, backward):
    """(AttentionFunction, attention, the custom op) over an implementation's explicit-output
    pair. Eager calls take the autograd.Function (a custom op's Python dispatch costs tens of
    microseconds); under torch.compile the custom op, with a fake implementation, is traced."""

    def run_forward(q, k, v, causal, scale):
        batch, s_q, heads, _ = q.shape
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(batch, heads, s_q, dtype=torch.float32, device=q.device)
        return forward(q, k, v, causal, scale, o, lse)

    def run_backward(q, k, v, o, lse, do, causal, scale):
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        return backward(q, k, v, o, lse, do.contiguous(), causal, scale, dq, dk, dv)

    class AttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = run_forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale = causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = run_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
            return dq, dk, dv, None, None

    @torch.library.custom_op(f"kernel_course::attention_{name}_forward", mutates_args=())
    def forward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_forward(q, k, v, causal, scale)

    @torch.library.custom_op(f"kernel_course::attention_{name}_backward", mutates_args=())
    def backward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
        do: torch.Tensor, causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        return run_backward(q, k, v, o, lse, do, causal, scale)

    @forward_op.register_fake
    def _(q, k, v, causal, scale):
        batch, s_q, heads, _ = q.shape
        lse = q.new_empty(batch, heads, s_q, dtype=torch.float32)
        return torch.empty_like(q, memory_format=torch.contiguous_format), lse

    @backward_op.register_fake
    def _(q, k, v, o, lse, do, causal, scale):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    def save(ctx, inputs, output):
        q, k, v, causal, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.causal, ctx.scale = causal, scale

    def backward_of_forward_op(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None

    forward_op.register_autograd(backward_of_forward_op, setup_context=save)

    def attention(q, k, v, causal=False, scale=None):
        """O = softmax(Q K^T scale, masked) V over (B, S, H, D) operands, differentiable."""
        if torch.compiler.is_compiling():
            return forward_op(q, k, v, causal, default_scale(q.shape[3], scale))[0]
        return AttentionFunction.apply(q, k, v, causal, scale)

    return AttentionFunction, attention, forward_op


AttentionFunction, attention, _forward_op = model_plumbing(
    "torch", attention_forward, attention_backward
)
