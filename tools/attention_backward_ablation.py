"""What each piece of the CuTe attention backward costs, on a GPU (Hopper).

    python3 tools/attention_backward_ablation.py [--quick] [--d64] [VARIANT ...]

The one-pass backward (transformer/attention/cute_3_backward.py) runs its tiles at about half
the tensor cores' rate on an H100 (the folder's README, tuning log, 2026-12-06). This tool
builds variants of it that each leave a piece out, times them side by side with the whole
kernel and Triton's backward, and prints the table: the time a variant saves is what its piece
costs. The variants compute wrong gradients (that is the point); only the first is
correct. Each is the kernel's source with exact text replaced (a replacement that no longer
matches the source stops the tool), imported in its own process in place of cute_3_backward.

  whole         the kernel as it is
  from tile 0   without a mask every key block walks the query tiles from tile 0, all in one
                order from the last block down (the kernel before 2026-12-06, evening: block
                n waits for the n_blocks - 1 - n blocks before it, one after another)
  unordered     the dQ adds in any order: no semaphores, the writer waits only for its reads
  no adds       unordered, and the writer issues no TMA reduce-add
  no handover   the consumers do not stage dQ for the writer, which does nothing
  no fence      unordered, and the consumers do not fence their staged dQ for TMA
  no empty wait unordered, and the consumers do not wait for the writer to hand the staging
                buffer back (nor does the writer)
  no stores     unordered, and the consumers do not store their dQ into the staging buffer
                (the last three split "no handover"'s saving among its pieces)
  no dQ         no handover, and no dS^T store, DS_READY barrier or dQ wgmma either
  no stats      the whole kernel with lse and delta not loaded (constants staged instead)

bf16, 4 x 4096 x 16 x 128 (half the headline's heads; --d64: 4 x 4096 x 32 x 64), causal and
not; --quick: non-causal only;
VARIANT names: those only (and Triton's), e.g. `whole` to time the kernel against Triton's.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

ATTENTION = Path(__file__).resolve().parent.parent / "transformer" / "attention"
SHAPES = {128: (4, 4096, 16, 128), 64: (4, 4096, 32, 64)}  # B, S, H, D: 0.7 TFLOP each

UNORDERED = [
    ("    if lane == 0:\n        before = blocks_before(",
     "    if cutlass.const_expr(False):\n        before = blocks_before("),
    ("        cute.arch.cp_async_bulk_wait_group(0)  # the adds are done, not only read\n"
     "        cute.arch.atomic_add(semaphore, cutlass.Int32(1), "
     'sem="release", scope="gpu")',
     "        cute.arch.cp_async_bulk_wait_group(0, read=True)"),
]  # fmt: skip
FROM_TILE_0 = [
    ("        start = n_block * end // n_blocks", "        start = n_block * 0"),
    ("    elif cutlass.const_expr(not wrapped):", "    elif cutlass.const_expr(False):"),
]  # fmt: skip
NO_ADDS = [
    ("            cute.copy(tma_add, staged[None, box], tiles_of_sum[None, tile, in_sum + box])",
     "            pass"),
]  # fmt: skip
# A variant that leaves out what reads dQ keeps it behind a branch never taken (`scale < 0`,
# a kernel argument the compiler cannot see): ptxas drops a wgmma whose result nothing reads,
# and the first runs of "no stores" and "no handover" timed the kernel without dQ's product
# (cuobjdump: 52 HGMMA instructions of the whole kernel's 64).
NEVER = "    if scale < 0.0:  # never: dQ's wgmmas stay (ptxas drops a product nothing reads)\n"
# hand_over's stores of dQ into the staging buffer, and the fence that shows them to TMA.
STAGE_DQ = "    cute.autovec_copy(dq, mma_dq.get_slice(mine).partition_C(dq_staged))\n"
FENCE_FOR_TMA = (
    '    cute.arch.fence_proxy("async.shared", space="cta")  # seen by TMA (async proxy)\n'
)
NEVER_STAGED = NEVER + "    " + STAGE_DQ
NO_HANDOVER = [
    ("    for head in cutlass.range(group, unroll=1):\n"
     "        h = g * group + head\n"
     "        boxes_of_sums =",
     "    for head in cutlass.range(0, unroll=1):\n"
     "        h = g * group + head\n"
     "        boxes_of_sums ="),
    ("    cute.arch.barrier(barrier_id=DQ_EMPTY + half, number_of_threads=CONSUMER_AND_WRITER)\n"
     + STAGE_DQ + FENCE_FOR_TMA
     + "    cute.arch.barrier_arrive(barrier_id=DQ_FULL + half, "
     "number_of_threads=CONSUMER_AND_WRITER)",
     NEVER_STAGED.rstrip("\n")),
]  # fmt: skip
NO_FENCE = [(STAGE_DQ + FENCE_FOR_TMA, STAGE_DQ)]
NO_EMPTY_WAIT = [
    ("    cute.arch.barrier(barrier_id=DQ_EMPTY + half, number_of_threads=CONSUMER_AND_WRITER)\n"
     "    cute.autovec_copy(dq,",
     "    cute.autovec_copy(dq,"),
    ("        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY + half, "
     "number_of_threads=CONSUMER_AND_WRITER)",
     "        pass"),
]  # fmt: skip
NO_STORES = [
    (STAGE_DQ, NEVER_STAGED),
]  # fmt: skip
NO_DQ = [
    ("    cute.autovec_copy(ds_t, mma_kq.get_slice(mine).partition_C(ds_store[None, None, slot]))\n"
     '    cute.arch.fence_proxy("async.shared", space="cta")  # seen by the wgmmas (async proxy)\n'
     "    cute.arch.barrier(barrier_id=DS_READY, number_of_threads=CONSUMERS)\n",
     ""),
    ("        issue(mma_dq, dq, ds_frag[None, None, None, slots + key_half],\n"
     "              k_t_frag[None, None, None, key_half],\n"
     "              overwrite_dq if cutlass.const_expr(key_half == 0) else None)  # fmt: skip",
     "        pass"),
]  # fmt: skip
NO_STATS = [
    ("    return lse[b, h, query], delta[b, h, query]",
     "    return cutlass.Float32(1.0), cutlass.Float32(0.0)"),
]  # fmt: skip
VARIANTS = {
    "whole": [],
    "from tile 0": FROM_TILE_0,
    "unordered": UNORDERED,
    "no adds": UNORDERED + NO_ADDS,
    "no handover": NO_HANDOVER,
    "no fence": UNORDERED + NO_FENCE,
    "no empty wait": UNORDERED + NO_EMPTY_WAIT,
    "no stores": UNORDERED + NO_STORES,
    "no dQ": NO_HANDOVER + NO_DQ,
    "no stats": NO_STATS,
}

# Run in a child process with the variant's cute_3_backward first on sys.path (put there by the
# child itself: `python -c` puts the working directory ahead of PYTHONPATH, and the tool runs in
# the attention folder, so every variant once timed the kernel as it is): prints the kernel's
# file, then one line "TIMING name causal ms" per timing.
CHILD = """
import sys
sys.path[:0] = sys.argv[3:]  # the variant's folder first: ahead of the working directory too
import torch, triton
import cute_3_backward, cute_impl, triton_impl
name, causals = sys.argv[1], [c == "1" for c in sys.argv[2].split(",")]
print("KERNEL", cute_3_backward.__file__, flush=True)
b, s, h, d = {shape}
for causal in causals:
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    cute_impl.attention_forward_step3(q, k, v, causal, None, o, lse)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    backward = (triton_impl.attention_backward if name == "triton"
                else cute_impl.attention_backward_cute)
    ms = triton.testing.do_bench(
        lambda: backward(q, k, v, o, lse, do, causal, None, *grads), warmup=5, rep=50,
        return_mode="median")
    print("TIMING", name, int(causal), ms, flush=True)
"""


def patched(source, replacements):
    for old, new in replacements:
        if source.count(old) != 1:
            raise SystemExit(f"the kernel's source no longer holds exactly one of:\n{old}")
        source = source.replace(old, new)
    return source


def main():
    causals = "0" if "--quick" in sys.argv else "0,1"
    batch, seq, heads, head_dim = SHAPES[64 if "--d64" in sys.argv else 128]
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"no variant {sorted(unknown)}; the variants: {list(VARIANTS)}")
    source = (ATTENTION / "cute_3_backward.py").read_text()
    child = CHILD.format(shape=(batch, seq, heads, head_dim))
    times = {}
    for name in ["triton", *names]:
        with tempfile.TemporaryDirectory() as variant_dir:
            folders = [str(ATTENTION)]
            if name != "triton":
                Path(variant_dir, "cute_3_backward.py").write_text(patched(source, VARIANTS[name]))
                folders.insert(0, variant_dir)
            run = subprocess.run([sys.executable, "-c", child, name, causals, *folders],
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        kernel = next((line.split(" ", 1)[1] for line in run.stdout.splitlines()
                       if line.startswith("KERNEL ")), "")  # fmt: skip
        if not kernel.startswith(folders[0]):
            raise SystemExit(f"{name}: timed {kernel or 'no kernel'}, not {folders[0]}\n"
                             f"{run.stderr[-2000:]}")  # fmt: skip
        for line in run.stdout.splitlines():
            if line.startswith("TIMING "):
                _, _, causal, ms = line.rsplit(" ", 3)
                times[name, causal] = float(ms)
        if run.returncode != 0:
            print(f"{name}: failed\n{run.stderr[-2000:]}")
    flops = 2.5 * 4 * batch * heads * seq * seq * head_dim
    print(f"backward alone, bf16 {batch} x {seq} x {heads} x {head_dim}, ms (TFLOP/s counted)")
    for name in ["triton", *names]:
        cells = [
            f"{times[name, c]:.3f} ({flops / (2 if c == '1' else 1) / times[name, c] / 1e9:.0f})"
            for c in causals.split(",")
            if (name, c) in times
        ]
        print(f"  {name:12s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
