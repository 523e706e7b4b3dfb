"""The grammar mask on CUDA logits (the tiny test tokenizer, Llama 3's vocabulary width): the
constrained rows come out with exactly the CPU path's values (-inf where refused, the same bits
elsewhere), the other rows keep every bit, and the unpacked bitmask equals numpy's unpack."""

from __future__ import annotations

import json

import pytest
import torch

LLMatcher = pytest.importorskip("llguidance").LLMatcher  # carry its wheel to the GPU image

from lorad.workers.grammar import GrammarRows  # noqa: E402
from tests.daemons import REPO  # noqa: E402
from tests.tiny_models import write_tokenizer  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
VOCAB = 128256
GRAMMARS = [LLMatcher.grammar_from_regex("[0-9]{2,4}"),
            LLMatcher.grammar_from_json_schema({"type": "object"}),
            LLMatcher.grammar_from_lark('start: "yes" | "no"')]


def grammar_rows(folder) -> GrammarRows:
    folder.mkdir()
    write_tokenizer(folder)
    config = json.loads((REPO / "scripts/configs/llama3-8b/config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB}))
    rows = GrammarRows(str(folder))
    for i, grammar in enumerate(GRAMMARS):
        rows.add(f"c{i}", grammar, [2])
    return rows


def test_cuda_mask_equals_the_cpu_mask(tmp_path):
    on_cpu, on_gpu = grammar_rows(tmp_path / "cpu"), grammar_rows(tmp_path / "gpu")
    ids = ["u0", "c0", "u1", "c1", "c2", "u2"]
    torch.manual_seed(0)
    logits = torch.randn(len(ids), VOCAB)
    cpu, gpu = logits.clone(), logits.to(CUDA)
    on_cpu.mask(cpu, ids)
    on_gpu.mask(gpu, ids)
    assert torch.equal(gpu.cpu(), cpu)
    for i, request_id in enumerate(ids):
        finite = cpu[i].isfinite()
        if request_id.startswith("u"):
            assert torch.equal(cpu[i], logits[i])
        else:
            assert 0 < finite.sum() < 400  # the tiny tokenizer's ids only
            assert torch.equal(cpu[i][finite], logits[i][finite])
