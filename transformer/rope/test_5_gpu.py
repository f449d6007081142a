"""RoPE tests, section (5): GPU-only sizes (Llama's, against the float64 reference).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import DEVICE, IMPLS, ON_GPU, angle_sources, check, random_heads

import reference

# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="large sizes need a CUDA GPU")


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("source", ["inv_freq", "hf_table"])
def test_llama_size_against_float64(impl, dtype, layout, source):
    """B = 4, S = 4095 (in (B, H, S, D) a bf16 block of two tokens straddles each batch
    boundary), H = 32, Hk = 8, D = 128 with Llama 3's angles (CuTe's general kernel) or
    Hugging Face's table in q's dtype (its table kernel: bench.py's call), both directions, in
    both layouts; the reference is already float64 torch, fast enough at this size."""
    q = random_heads(4, 4095, 32, 128, dtype, layout)
    k = random_heads(4, 4095, 8, 128, dtype, layout)
    angles = {"inv_freq": reference.inverse_frequencies(128, 500000.0).to(DEVICE)}
    if source == "hf_table":
        angles = {n: t.to(dtype) for n, t in angle_sources(128, source, positions=4095).items()}
    for direction in ("forward", "backward"):
        check(impl, direction, q, k, **angles, layout=layout)
