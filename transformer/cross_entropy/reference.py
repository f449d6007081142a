"""cross-entropy loss over the rows of a logits matrix, forward and backward: the definition.

For row i of logits x (M, V) with target class t_i and label smoothing eps:

    lse_i  = log sum_j exp(x_ij)                          (computed as m + log sum exp(x - m))
    loss_i = lse_i - (1 - eps) x_it - eps mean_j x_ij     (eps = 0: lse_i - x_it)
    dx_ij  = dloss_i (exp(x_ij - lse_i) - q_ij),   q_ij = (1 - eps) [j = t_i] + eps / V

A row whose target is ignore_index has loss 0 and dx 0 and is left out of the mean. The
reductions: 'none' (the M losses), 'sum', 'mean' (the sum over the rows not ignored divided by
their count; when every row is ignored that is 0 / 0 = NaN, as torch.nn.functional.cross_entropy
returns). README.md derives the backward by hand.

Special values follow the formula as written: a -inf logit (masked class) adds nothing to the sum;
a NaN or +inf logit makes lse (so the loss and the row's dx) NaN, as in torch.

This file is the contract: `check_forward`, `check_backward` and `check_reduction` say which
operands are valid (every implementation calls them before launching anything: a target outside
[0, V) that is not ignore_index raises here, which reads the targets once), and
`cross_entropy_forward`, `cross_entropy_backward`, `reduce_loss` what the answer is, in plain
Python over Python floats with `math.fsum` for the sums. They return new float64 tensors and
mutate nothing. The forward's loss and lse are float32 (M,) vectors in every implementation: the
statistics the backward reuses, kept at the precision they are computed in.
"""

import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("none", "mean", "sum")


def address_range(t):
    """[first byte, one past the last byte] of t's elements (torch strides are never negative)."""
    if t.numel() == 0:
        return None
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def overlap(a, b):
    """'none', 'same' (the very same elements in the same order) or 'partial', by address."""
    range_a, range_b = address_range(a), address_range(b)
    if range_a is None or range_b is None or range_a[1] <= range_b[0] or range_b[1] <= range_a[0]:
        return "none"
    same_layout = a.shape == b.shape and all(
        a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] > 1
    )
    return "same" if range_a[0] == range_b[0] and same_layout else "partial"


def elements_collide(t):
    """True unless t's elements have distinct addresses (sorted by stride, each dimension's
    stride steps past everything the smaller ones span; conservative)."""
    if t.is_contiguous():
        return False
    span = 0
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size > 1:
            if stride <= span:
                return True
            span += (size - 1) * stride
    return False


def _check_tensor(name, t, ndim, dtypes, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {names}")


def _check_same_device(first_name, first, others):
    for name, t in others:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def _check_outputs(outputs, inputs):
    """Outputs never have colliding elements nor partially overlap another operand."""
    for name, t in outputs:
        if elements_collide(t):
            raise ValueError(f"{name}'s strides {t.stride()} give two of its elements one address")
        for other_name, other in inputs + outputs:
            if other_name != name and overlap(t, other) != "none":
                if name == "dlogits" and other_name == "logits" and overlap(t, other) == "same":
                    continue  # the backward may overwrite the logits with their gradient
                raise ValueError(f"{name} overlaps {other_name}")


def _check_options(ignore_index, label_smoothing):
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")


def check_target_range(logits, target, ignore_index):
    """Raise ValueError naming the first target outside [0, V) that is not ignore_index. One
    read of the targets (a device sync on the GPU): a bad index never reaches a kernel."""
    if target.numel():
        wrong = (target != ignore_index) & ((target < 0) | (target >= logits.shape[1]))
        if bool(wrong.any()):
            first = int(target[wrong][0])
            raise ValueError(
                f"target holds {first}, outside [0, {logits.shape[1]}) and not ignore_index "
                f"({ignore_index})"
            )


def _check_logits_and_target(logits, target, ignore_index, label_smoothing, check_range):
    _check_tensor("logits", logits, 2, SUPPORTED_DTYPES, "an (M, V) matrix")
    _check_tensor("target", target, 1, TARGET_DTYPES, "an (M,) vector of class indices")
    if target.shape[0] != logits.shape[0]:
        raise ValueError(f"target has {target.shape[0]} rows but logits has {logits.shape[0]}")
    if logits.shape[1] == 0 and logits.shape[0] > 0:
        raise ValueError("logits has rows of 0 classes: no class can be a target")
    _check_same_device("logits", logits, (("target", target),))
    _check_options(ignore_index, label_smoothing)
    if check_range:
        check_target_range(logits, target, ignore_index)


def _check_row_vector(name, t, m, device):
    _check_tensor(name, t, 1, (torch.float32,), "an (M,) float32 vector")
    if t.shape[0] != m:
        raise ValueError(f"{name} has {t.shape[0]} rows but logits has {m}")
    _check_same_device("logits", torch.empty(0, device=device), ((name, t),))


def check_forward(logits, target, ignore_index, label_smoothing, loss, lse, check_range=True):
    """Raise TypeError/ValueError, naming the operand, for anything the forward refuses
    (loss, lse None: the inputs only). check_range=False leaves the targets' range to a caller
    that reads them its own way first (triton_impl.py: one kernel that also counts the rows)."""
    _check_logits_and_target(logits, target, ignore_index, label_smoothing, check_range)
    outputs = tuple((n, t) for n, t in (("loss", loss), ("lse", lse)) if t is not None)
    for name, t in outputs:
        _check_row_vector(name, t, logits.shape[0], logits.device)
    _check_outputs(outputs, (("logits", logits), ("target", target)))


def check_backward(
    logits, target, lse, dloss, ignore_index, label_smoothing, dlogits, check_range=True
):
    """The same for the backward; dloss may be a broadcast (stride 0) vector, dlogits may be
    logits itself (the gradient overwrites the logits)."""
    _check_logits_and_target(logits, target, ignore_index, label_smoothing, check_range)
    for name, t in (("lse", lse), ("dloss", dloss)):
        _check_row_vector(name, t, logits.shape[0], logits.device)
    if dlogits is not None:
        inputs = (("logits", logits), ("target", target), ("lse", lse), ("dloss", dloss))
        check_dlogits(logits, dlogits, inputs)


def check_dlogits(logits, dlogits, inputs):
    """dlogits: logits' dtype and shape, its device, overlapping none of the (name, tensor)
    inputs but logits itself, exactly (the gradient may overwrite the logits)."""
    _check_tensor("dlogits", dlogits, 2, SUPPORTED_DTYPES, "an (M, V) matrix")
    if dlogits.dtype != logits.dtype or dlogits.shape != logits.shape:
        raise ValueError(
            f"dlogits is {dlogits.dtype} {tuple(dlogits.shape)} but logits is "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    _check_same_device("logits", logits, (("dlogits", dlogits),))
    _check_outputs((("dlogits", dlogits),), inputs)


def check_reduction(loss, target, ignore_index, reduction):
    _check_tensor("loss", loss, 1, (torch.float32,), "an (M,) float32 vector")
    _check_tensor("target", target, 1, TARGET_DTYPES, "an (M,) vector of class indices")
    if target.shape != loss.shape:
        raise ValueError(f"target has {target.shape[0]} rows but loss has {loss.shape[0]}")
    _check_same_device("loss", loss, (("target", target),))
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def logsumexp_row(row):
    if any(math.isnan(v) for v in row):
        return math.nan
    m = max(row)
    if math.isinf(m):  # all -inf: log 0 = -inf; a +inf: inf - inf in the shifted sum, NaN
        return -math.inf if m < 0 else math.nan
    return m + math.log(exact_sum([math.exp(v - m) for v in row]))


def loss_row(row, target, lse, label_smoothing):
    if not label_smoothing:
        return lse - row[target]
    return lse - (1 - label_smoothing) * row[target] - label_smoothing * exact_sum(row) / len(row)


def cross_entropy_forward(logits, target, ignore_index=-100, label_smoothing=0.0):
    """(loss, lse): the exact per-row loss (0 for ignored rows) and log-sum-exp, float64 (M,)."""
    check_forward(logits, target, ignore_index, label_smoothing, None, None)
    rows, targets = logits.detach().cpu().double().tolist(), target.cpu().tolist()
    lse = [logsumexp_row(row) if row else math.nan for row in rows]
    loss = [
        0.0 if t == ignore_index else loss_row(row, t, s, label_smoothing)
        for row, t, s in zip(rows, targets, lse, strict=True)
    ]
    return torch.tensor(loss, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def cross_entropy_backward(logits, target, lse, dloss, ignore_index=-100, label_smoothing=0.0):
    """dlogits for the given lse (M,) and dloss (M,), exactly: a new float64 (M, V) tensor."""
    check_backward(logits, target, lse, dloss, ignore_index, label_smoothing, None)
    m, v = logits.shape
    rows, targets = logits.detach().cpu().double().tolist(), target.cpu().tolist()
    result = []
    for row, t, s, g in zip(rows, targets, lse.tolist(), dloss.tolist(), strict=True):
        if t == ignore_index:
            result.append([0.0] * v)
            continue
        q = [label_smoothing / v + (1 - label_smoothing) * (j == t) for j in range(v)]
        result.append([g * (math.exp(x - s) - q_j) for x, q_j in zip(row, q, strict=True)])
    return torch.tensor(result, dtype=torch.float64).reshape(m, v)


def reduce_loss(loss, target, ignore_index, reduction):
    """The reduction of the per-row losses, float64: (M,) for 'none', else 0-dim."""
    check_reduction(loss, target, ignore_index, reduction)
    values = loss.detach().cpu().double()
    if reduction == "none":
        return values
    total = exact_sum(values.tolist())
    if reduction == "sum":
        return torch.tensor(total, dtype=torch.float64)
    count = int((target != ignore_index).sum())
    return torch.tensor(total / count if count else math.nan, dtype=torch.float64)
