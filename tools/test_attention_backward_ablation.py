"""tools/attention_backward_ablation.py's variants still match the kernel's source: each of its
replacements finds its text exactly once (the tool stops otherwise, on a GPU machine, after
device time was spent on the way there), and no two variants are the same kernel."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention_backward_ablation as ablation  # noqa: E402

SOURCE = (ablation.ATTENTION / "cute_3_backward.py").read_text()


@pytest.mark.parametrize("name", list(ablation.VARIANTS))
def test_variant_applies(name):
    ablation.patched(SOURCE, ablation.VARIANTS[name])


def test_variants_differ():
    sources = {ablation.patched(SOURCE, r) for r in ablation.VARIANTS.values()}
    assert len(sources) == len(ablation.VARIANTS)


def test_stale_replacement_stops():
    with pytest.raises(SystemExit, match="no longer holds"):
        ablation.patched(SOURCE, [("text that is not in the kernel", "")])
