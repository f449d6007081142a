"""The tables and summary results_table.py writes, from one folder's results.json.

size_of, timed_rows, eager, largest_rows          the rows of a run, and their labels
attention_table, model_size_table, per_call_table, compute_table, module_shape_table
                                                  the tables of each kind of folder
folder_table                                      the folder README's results block
step_table                                        a lesson in steps: what each step gained
summary                                           the top-level README's "H200" column
"""

import math


def size_of(shape):
    """'n = 2**28' for a vector, '16384 x 16384' for a matrix."""
    if len(shape) == 1:
        return f"n = 2**{shape[0].bit_length() - 1}"
    return " x ".join(map(str, shape))


def timed_rows(results):
    """Rows of a timed size; the per-call rows carry host_us and no time of their own."""
    return [row for row in results["rows"] if row.get("ms") is not None]


def eager(row):
    """The mark " (eager)" on a row timed call by call, not as a replayed CUDA graph: host time may
    be in it (bench.py printed why it could not be captured)."""
    return " (eager)" if row.get("timing", "graph").startswith("eager") else ""


def largest_rows(results):
    """The rows of the largest size; of two shapes of one size, the first bench.py timed."""
    largest = max(math.prod(row["shape"]) for row in timed_rows(results))
    shape = next(r["shape"] for r in timed_rows(results) if math.prod(r["shape"]) == largest)
    rows = [row for row in timed_rows(results) if row["shape"] == shape]
    return rows, size_of(shape)


def is_attention(results):
    """Attention's rows carry `causal` and report TFLOP/s against the bf16 matmul ceiling."""
    return any("causal" in row for row in results["rows"])


def attention_rates(results):
    """({(impl, pass, causal): TFLOP/s}, shape) at the first shape bench.py timed (its
    headline shape), in the order the rows were timed."""
    shape = timed_rows(results)[0]["shape"]
    rows = [r for r in timed_rows(results) if r["shape"] == shape and "kv_heads" not in r]
    return {(r["impl"], r["pass"], r["causal"]): r["TFLOPs"] for r in rows}, shape


def attention_table(results):
    """TFLOP/s of every implementation at the headline shape, per pass and mask, with the ratio
    to cuDNN and to FlashAttention-4 timed in the same run."""
    rate, shape = attention_rates(results)
    ceiling = results["ceilings"]["bf16_matmul_TFLOPs"]
    lines = [
        f"{results['device']}, B x S x H x D = {' x '.join(map(str, shape))}, bf16; matmul "
        f"ceiling (torch.matmul, bf16 8192^3) measured in the same run: {ceiling:.0f} TFLOP/s. "
        "TFLOP/s (x cuDNN, x FA4).",
        "",
        "| implementation | fwd | fwd+bwd | causal fwd | causal fwd+bwd |",
        "| --- | --- | --- | --- | --- |",
    ]
    cases = [(p, c) for c in (False, True) for p in ("fwd", "fwd+bwd")]
    for impl in dict.fromkeys(impl for impl, _, _ in rate):
        cells = []
        for p, c in cases:
            mine = rate.get((impl, p, c))
            ratios = [
                f"{mine / rate[(a, p, c)]:.2f}" for a in ("cudnn", "fa4") if (a, p, c) in rate
            ]
            cells.append(f"{mine:.0f} ({', '.join(ratios)})" if mine else "")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    return "\n".join(lines + per_call_table(results))


# The sizes a model calls (issue 13): vectors of 2**20 and 2**24, matrices of 4096^2 and 8192^2.
MODEL_SIZES = {(2**20,), (2**24,), (4096, 4096), (8192, 8192)}


def model_size_table(results):
    """Time and speed against the library op at the sizes a model calls, one line per case."""
    rows = [row for row in timed_rows(results) if tuple(row["shape"]) in MODEL_SIZES]
    if not rows:
        return []
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    lines = [
        "",
        "At the sizes a model calls, time in us (x the library op's speed):",
        "",
        "| dtype | size | " + " | ".join(impls) + " |",
        "| --- | --- | " + " | ".join("---" for _ in impls) + " |",
    ]
    cases = dict.fromkeys((r["dtype"], tuple(r["shape"]), r.get("layout")) for r in rows)
    for dtype, shape, layout in cases:
        of_case = {
            r["impl"]: r
            for r in rows
            if (r["dtype"], tuple(r["shape"]), r.get("layout")) == (dtype, shape, layout)
        }
        size = size_of(shape) + (f", {layout}-major" if layout else "")
        cells = [
            f"{of_case[i]['ms'] * 1e3:.1f} (x{of_case[i]['vs_library']:.2f}){eager(of_case[i])}"
            if i in of_case
            else ""
            for i in impls
        ]
        lines.append(f"| {dtype} | {size} | " + " | ".join(cells) + " |")
    return lines


def per_call_table(results):
    """Host microseconds per call at a tiny size, beside the run's floors."""
    rows = [row for row in results["rows"] if row.get("ms") is None and "host_us" in row]
    if not rows:
        return []
    ceilings = results["ceilings"]
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    floors = ""
    if "torch_call_us" in ceilings:
        floors = (f"; floors of the same run: torch `y.copy_(x)` {ceilings['torch_call_us']:.1f} "
                  f"us, a bare Triton launch {ceilings['triton_launch_us']:.1f} us")  # fmt: skip
    lines = [
        "",
        f"Per call at {size_of(rows[0]['shape'])} (wall time of back-to-back calls, us){floors}.",
        "",
        "| dtype | " + " | ".join(impls) + " |",
        "| --- | " + " | ".join("---" for _ in impls) + " |",
    ]
    for dtype, layout in dict.fromkeys((row["dtype"], row.get("layout")) for row in rows):
        host = {
            r["impl"]: r["host_us"]
            for r in rows
            if (r["dtype"], r.get("layout")) == (dtype, layout)
        }
        label = dtype if layout is None else f"{dtype}, {layout}"
        lines.append(
            f"| {label} | "
            + " | ".join(f"{host[i]:.1f}" if i in host else "" for i in impls)
            + " |"
        )
    return lines


def is_compute_bound(results):
    """gemm reports TFLOP/s against the bf16 matmul ceiling; the others GB/s against copy."""
    return "bf16_matmul_TFLOPs" in results["ceilings"]


def compute_table(results):
    """One line per dtype and shape: TFLOP/s of torch.addmm (cuBLAS), and of Triton and CuTe
    with their share of cuBLAS's rate and of the bf16 matmul ceiling."""
    ceiling = results["ceilings"]["bf16_matmul_TFLOPs"]
    lines = [
        f"{results['device']}; bf16 matmul ceiling (torch.matmul, bfloat16 8192^3) measured in "
        f"the same run: {ceiling:.0f} TFLOP/s. TFLOP/s (% of cuBLAS, % of the ceiling).",
        "",
        "| dtype | m x n x k | layout | cuBLAS | Triton | CuTe |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    cases = dict.fromkeys(
        (row["dtype"], tuple(row["shape"]), row.get("layout")) for row in timed_rows(results)
    )
    for dtype, shape, layout in cases:
        rate = {
            r["impl"]: r
            for r in timed_rows(results)
            if (r["dtype"], tuple(r["shape"]), r.get("layout")) == (dtype, shape, layout)
        }
        cells = []
        for impl in ("triton", "cute"):
            r = rate.get(impl)
            cells.append(
                f"{r['TFLOPs']:.1f} ({100 * r['vs_library']:.0f}%, {r['pct_of_ceiling']:.0f}%)"
                if r
                else ""
            )
        lines.append(
            f"| {dtype} | {' x '.join(map(str, shape))} | {layout or 'NN'} | "
            f"{rate['library']['TFLOPs']:.1f} | " + " | ".join(cells) + " |"
        )
    lines += per_call_table(results)
    lines += ["", "![TFLOP/s per shape](perf.png)"]
    return "\n".join(lines)


def folder_table(results):
    if is_attention(results):
        return attention_table(results) + "\n\n![TFLOP/s per shape](perf.png)"
    if is_compute_bound(results):
        return compute_table(results)
    rows, size = largest_rows(results)
    layout = "layout" in rows[0]  # matrix kernels report row- and column-major A separately
    passes = "pass" in rows[0]  # transformer modules: forward, and forward + backward
    lines = [
        f"{results['device']}, {size}; copy ceiling measured in the same run: "
        f"{results['ceilings']['copy_GBps']:.0f} GB/s.",
        "",
        "| implementation | dtype |"
        + (" A |" if layout else "")
        + (" pass |" if passes else "")
        + " time (us) | GB/s | % of copy | vs torch |",
        "| --- | --- |" + (" --- |" * (layout + passes)) + " --- | --- | --- | --- |",
    ]
    for row in rows:
        vs_library = "" if row["vs_library"] is None else f"{row['vs_library']:.2f}"
        lines.append(
            f"| {row['impl']} | {row['dtype']} |"
            + (f" {row['layout']}-major |" if layout else "")
            + (f" {row['pass']} |" if passes else "")
            + f" {row['ms'] * 1e3:.1f} | {row['GBps']:.0f} | "
            f"{row['pct_of_ceiling']:.1f}{eager(row)} | {vs_library} |"
        )
    lines += model_size_table(results) + module_shape_table(results) + per_call_table(results)
    lines += ["", "![GB/s against n](perf.png)"]
    return "\n".join(lines)


def module_shape_table(results):
    """Transformer modules: % of copy bandwidth of every implementation at every timed shape,
    one line per dtype, shape and pass."""
    rows = [row for row in timed_rows(results) if "pass" in row]
    if not rows:
        return []
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    lines = [
        "",
        "Every timed shape, % of copy bandwidth (minimal bytes):",
        "",
        "| dtype | M x N | pass | " + " | ".join(impls) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in impls) + " |",
    ]
    for dtype, shape, pass_name in dict.fromkeys(
        (r["dtype"], tuple(r["shape"]), r["pass"]) for r in rows
    ):
        of_case = {
            r["impl"]: r
            for r in rows
            if (r["dtype"], tuple(r["shape"]), r["pass"]) == (dtype, shape, pass_name)
        }
        cells = [
            f"{of_case[i]['pct_of_ceiling']:.0f}{eager(of_case[i])}" if i in of_case else ""
            for i in impls
        ]
        lines.append(f"| {dtype} | {size_of(shape)} | {pass_name} | " + " | ".join(cells) + " |")
    return lines


def step_table(results, folder):
    """A lesson in steps (cute_1_*.py, cute_2_*.py, ...): what each step gained, from the rows
    cute.step1, cute.step2, ... timed beside the library op in the same rounds. None if the
    folder has no steps."""
    steps = sorted({r["impl"] for r in timed_rows(results) if r["impl"].startswith("cute.step")})
    if not steps:
        return None
    # When the last step is not timed under its own name, `cute` (the dispatcher) stands for it.
    last = len(list(folder.glob("cute_[0-9]_*.py")))
    if f"cute.step{last}" not in steps:
        steps.append("cute")
    unit = "TFLOPs" if is_compute_bound(results) else "GBps"
    lines = [
        f"{unit.replace('Bps', 'B/s').replace('FLOPs', 'FLOP/s')} (% of the library op's speed), "
        "each step timed in the same rounds as the library op:",
        "",
        "| dtype | size | library | "
        + " | ".join(f"cute.step{last}" if s == "cute" else s for s in steps)
        + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in steps) + " |",
    ]
    # Modules: the forward rows (their steps are forward kernels).
    rows = [r for r in timed_rows(results) if r.get("pass", "fwd") == "fwd"]
    cases = {
        (r["dtype"], tuple(r["shape"]), r.get("layout"))
        for r in rows
        if r["impl"].startswith("cute.step")
    }
    for dtype, shape, layout in sorted(cases):
        of_case = {
            r["impl"]: r
            for r in rows
            if (r["dtype"], tuple(r["shape"]), r.get("layout")) == (dtype, shape, layout)
        }
        cells = [
            f"{of_case[s][unit]:.1f} ({100 * of_case[s]['vs_library']:.0f}%)"
            if s in of_case
            else ""
            for s in steps
        ]
        size = " x ".join(map(str, shape)) + (f" {layout}" if layout else "")
        library = of_case["library"][unit] if "library" in of_case else float("nan")
        lines.append(f"| {dtype} | {size} | {library:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results):
    """Triton's and CuTe's % of the copy ceiling at the largest size, per dtype (and layout);
    for gemm their % of cuBLAS at 8192^3; for attention Triton's and CuTe's TFLOP/s and ratio to
    FA4 at the headline shape."""
    if is_attention(results):
        rate, shape = attention_rates(results)
        parts = []
        for (impl, p, c), tflops in rate.items():
            if impl in ("triton", "cute") and (("fa4", p, c) in rate):
                mask = "causal " if c else ""
                parts.append(
                    f"{impl} {mask}{p} {tflops:.0f} TFLOP/s ({tflops / rate['fa4', p, c]:.2f}x FA4)"
                )
        return f"{' x '.join(map(str, shape))} bf16: " + "; ".join(parts)
    if is_compute_bound(results):
        parts = []
        for dtype in dict.fromkeys(row["dtype"] for row in timed_rows(results)):
            shape = [4096] * 3 if dtype == "float32" else [8192] * 3
            pct = {
                r["impl"]: 100 * r["vs_library"]
                for r in timed_rows(results)
                if r["dtype"] == dtype and r["shape"] == shape and r.get("layout", "NN") == "NN"
            }
            kernels = [f"{impl} {pct[impl]:.0f}%" for impl in ("triton", "cute") if impl in pct]
            parts.append(f"{dtype} {shape[0]}^3: " + ", ".join(kernels))
        return "% of cuBLAS: " + "; ".join(parts)
    rows, size = largest_rows(results)
    parts = []
    for case in dict.fromkeys((row["dtype"], row.get("layout") or row.get("pass")) for row in rows):
        pct = {
            r["impl"]: r["pct_of_ceiling"]
            for r in rows
            if (r["dtype"], r.get("layout") or r.get("pass")) == case
        }
        label = case[0] if case[1] is None else f"{case[0]} {case[1]}"
        label += "-major" if rows[0].get("layout") else ""
        kernels = [f"{impl} {pct[impl]:.0f}%" for impl in ("triton", "cute") if impl in pct]
        parts.append(f"{label}: " + ", ".join(kernels))
    return f"{size}: " + "; ".join(parts)
