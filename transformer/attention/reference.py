"""Attention, the definition: plain Python over float64 values, and the operand checks.

    S = Q K^T * scale (+ mask)     P = softmax(S) row by row     O = P V
    lse_i = log sum_j exp(S_ij)    (the statistic the kernels save for the backward)

per batch b and query head h, in the (B, S, H, D) layout: q (B, S_q, H, D), k and v
(B, S_k, H_kv, D), with H a multiple of H_kv (grouped-query attention: query head h reads key
and value head h // (H / H_kv)). Causal masking is bottom-right aligned, as flash-attention
does: query i sees key j when j <= i + S_k - S_q, so the last query sees every key. A query that
sees no key (causal with S_q > S_k) has O = 0 and lse = -inf: torch's scaled_dot_product_attention
gives the same 0. A NaN anywhere in a row's scores makes that row's O and lse NaN; a NaN in V
reaches the rows that see its key (here only those; README.md, "NaN", says why a kernel's
other rows may get it too).

The backward (README.md derives it), with D_i = sum_d dO_id O_id:

    dV_j = sum_i P_ij dO_i     dP_ij = dO_i . V_j     dS_ij = P_ij (dP_ij - D_i)
    dQ_i = scale sum_j dS_ij K_j     dK_j = scale sum_i dS_ij Q_i

dK and dV of a shared key and value head sum over the query heads of its group. Every sum is
math.fsum of float64 terms; only tiny shapes are practical.
"""

import math

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def visible(i, j, s_q, s_k, causal):
    """Whether query i sees key j: always, or (causal, bottom-right aligned) j <= i + S_k - S_q."""
    return not causal or j <= i + s_k - s_q


def default_scale(head_dim, scale):
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def reach(t):
    """How many bytes past its first element a tensor's elements reach (0 when empty)."""
    if t.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (span + 1) * t.element_size()


def address_range(t):
    """[first byte, past the last byte) of the elements a tensor can reach."""
    return t.data_ptr(), t.data_ptr() + reach(t)


def check_no_overlap(inputs, outputs):
    """inputs, outputs: [(name, (first byte, past the last))]; raise ValueError when an output
    reaches the memory of an input or of an earlier output."""
    ranges = list(inputs)
    for name, (start, end) in outputs:
        for other, (lo, hi) in ranges:
            if start < hi and lo < end:
                raise ValueError(f"{name} overlaps {other}: outputs need memory of their own")
        ranges.append((name, (start, end)))


def _check_tensor(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}: one device for all operands")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_operands(q, k, v, causal, scale, outputs=(), inputs=()):
    """Raise TypeError/ValueError naming the operand before anything is launched or written.
    q (B, S_q, H, D), k and v (B, S_k, H_kv, D) of one dtype among DTYPES on one device, the
    head dimension contiguous (stride 1), 1 <= D <= MAX_HEAD_DIM, H a multiple of H_kv >= 1;
    causal a bool, scale None or a finite float > 0; further inputs (the backward's O, lse and
    dO) and outputs as (name, tensor, shape, dtype), each on q's device with its last dimension
    contiguous, no output reaching the memory of an input or of another output."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, S_q, H, D), got {q.dim()} dimensions")
    batch, _, heads, head_dim = q.shape
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError("k must be a (B, S_k, H_kv, D) torch.Tensor")
    _check_tensor("k", k, (batch, k.shape[1], k.shape[2], head_dim), q.dtype, q.device)
    _check_tensor("v", v, k.shape, q.dtype, q.device)
    if k.shape[2] == 0 or heads % k.shape[2]:
        raise ValueError(f"q's {heads} heads must be a multiple of k's {k.shape[2]} (>= 1)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the head dimension must be 1 to {MAX_HEAD_DIM}, got {head_dim}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and t.stride(3) != 1:
            raise ValueError(f"{name}'s head dimension must be contiguous (stride 1)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
        or scale <= 0
    ):  # fmt: skip
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")
    for name, t, shape, dtype in (*inputs, *outputs):
        _check_tensor(name, t, shape, dtype, q.device)
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")
    reads = [("q", q), ("k", k), ("v", v), *((name, t) for name, t, _, _ in inputs)]
    check_no_overlap([(name, address_range(t)) for name, t in reads],
                     [(name, address_range(t)) for name, t, _, _ in outputs])  # fmt: skip


def forward_outputs(q, o, lse):
    batch, s_q, heads, _ = q.shape
    return (("o", o, q.shape, q.dtype), ("lse", lse, (batch, heads, s_q), torch.float32))


def backward_inputs(q, o, lse, do):
    """The backward's inputs beside q, k and v, as check_operands takes them: the forward's O
    and lse (in q's dtype and float32) and dO."""
    batch, s_q, heads, _ = q.shape
    return (
        ("o", o, q.shape, q.dtype),
        ("lse", lse, (batch, heads, s_q), torch.float32),
        ("do", do, q.shape, q.dtype),
    )


def backward_outputs(q, k, dq, dk, dv):
    return (
        ("dq", dq, q.shape, q.dtype),
        ("dk", dk, k.shape, k.dtype),
        ("dv", dv, k.shape, k.dtype),
    )


def _values(t):
    return t.detach().cpu().double().tolist()


def _row_scores(qv, kv, b, i, h, g, s_q, s_k, causal, scale):
    """[(j, S_ij)] over the keys query i sees."""
    return [
        (j, scale * math.fsum(a * c for a, c in zip(qv[b][i][h], kv[b][j][g], strict=True)))
        for j in range(s_k)
        if visible(i, j, s_q, s_k, causal)
    ]


def attention_forward(q, k, v, causal=False, scale=None):
    """(O, lse) as float64 tensors of shapes (B, S_q, H, D) and (B, H, S_q)."""
    check_operands(q, k, v, causal, scale)
    batch, s_q, heads, head_dim = q.shape
    s_k, group = k.shape[1], heads // k.shape[2]
    scale = default_scale(head_dim, scale)
    qv, kv, vv = _values(q), _values(k), _values(v)
    o = torch.zeros(batch, s_q, heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, heads, s_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // group
            for i in range(s_q):
                scores = _row_scores(qv, kv, b, i, h, g, s_q, s_k, causal, scale)
                if not scores:
                    continue  # sees no key: O = 0, lse = -inf
                if any(not math.isfinite(s) for _, s in scores):
                    o[b, i, h], lse[b, h, i] = math.nan, math.nan
                    continue
                top = max(s for _, s in scores)
                weights = [(j, math.exp(s - top)) for j, s in scores]
                total = math.fsum(w for _, w in weights)
                lse[b, h, i] = top + math.log(total)
                for d in range(head_dim):
                    o[b, i, h, d] = math.fsum(w * vv[b][j][g][d] for j, w in weights) / total
    return o, lse


def attention_backward(q, k, v, o, lse, do, causal=False, scale=None):
    """(dQ, dK, dV) as float64 tensors, from the forward's O and lse (float64 from
    attention_forward, or any implementation's) and dO."""
    check_operands(q, k, v, causal, scale)
    batch, s_q, heads, head_dim = q.shape
    s_k, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    scale = default_scale(head_dim, scale)
    qv, kv, vv, ov, dov = _values(q), _values(k), _values(v), _values(o), _values(do)
    lsev = lse.detach().cpu().double().tolist()
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk_terms = [[[[[] for _ in range(head_dim)] for _ in range(heads_kv)] for _ in range(s_k)]
                for _ in range(batch)]  # fmt: skip
    dv_terms = [[[[[] for _ in range(head_dim)] for _ in range(heads_kv)] for _ in range(s_k)]
                for _ in range(batch)]  # fmt: skip
    for b in range(batch):
        for h in range(heads):
            g = h // group
            for i in range(s_q):
                scores = _row_scores(qv, kv, b, i, h, g, s_q, s_k, causal, scale)
                if not scores:
                    continue
                delta = math.fsum(a * c for a, c in zip(dov[b][i][h], ov[b][i][h], strict=True))
                dq_terms = [[] for _ in range(head_dim)]
                for j, s in scores:
                    p = math.exp(s - lsev[b][h][i])
                    dp = math.fsum(a * c for a, c in zip(dov[b][i][h], vv[b][j][g], strict=True))
                    ds = p * (dp - delta)
                    for d in range(head_dim):
                        dv_terms[b][j][g][d].append(p * dov[b][i][h][d])
                        dk_terms[b][j][g][d].append(scale * ds * qv[b][i][h][d])
                        dq_terms[d].append(scale * ds * kv[b][j][g][d])
                for d in range(head_dim):
                    dq[b, i, h, d] = math.fsum(dq_terms[d])
    dk = torch.tensor([[[[math.fsum(t) for t in head] for head in row] for row in seq]
                       for seq in dk_terms], dtype=torch.float64).reshape(k.shape)  # fmt: skip
    dv = torch.tensor([[[[math.fsum(t) for t in head] for head in row] for row in seq]
                       for seq in dv_terms], dtype=torch.float64).reshape(k.shape)  # fmt: skip
    return dq, dk, dv
