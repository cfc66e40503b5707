"""transformers' eager attention adds finfo(dtype).min to masked scores. In float16 that is -65504, where
the spacing is 32: a fully masked row's scores round apart (or overflow to -inf) once they exceed 16 in
size, so the row is not the uniform average the peers' policy declares. The peers run float16 only where
no row is fully masked."""

from __future__ import annotations

import pytest
import torch

from parity.peers import hf


def test_a_fully_masked_float16_row_is_not_uniform_once_scores_exceed_16():
    """HF's eager maths for one fully masked row: scores + finfo.min in the input dtype, softmax in float32."""
    scores = torch.tensor([20.0, 0.0, -20.0])
    for dtype, uniform in ((torch.float16, False), (torch.bfloat16, True), (torch.float32, True)):
        row = scores.to(dtype) + torch.finfo(dtype).min
        weights = torch.softmax(row, dim=-1, dtype=torch.float32)
        assert torch.allclose(weights, torch.full((3,), 1 / 3)) is uniform, (dtype, row, weights)
    small = torch.tensor([15.0, 0.0, -15.0], dtype=torch.float16) + torch.finfo(torch.float16).min
    assert torch.allclose(torch.softmax(small, -1, dtype=torch.float32), torch.full((3,), 1 / 3))  # |s| <= 16: exact


@pytest.mark.parametrize("name", ["hf-bert", "hf-llama"])
def test_bert_and_llama_run_float16_only_where_no_row_is_fully_masked(name):
    impl = next(i for i in hf.IMPLEMENTATIONS if i.name == name)
    assert not impl.runs("self/padding/float16") and not impl.runs("self/random/float16")
    assert impl.runs("self/causal/float16") and impl.runs("self/none/float16")
    assert impl.runs("self/padding/bfloat16") and impl.runs("self/padding/float32")


def test_mistral_runs_no_float16_window_case():
    impl = next(i for i in hf.IMPLEMENTATIONS if i.name == "hf-mistral")
    assert not impl.runs("self/window/float16")
    assert impl.runs("self/window/bfloat16") and impl.runs("self/packed/float16")
