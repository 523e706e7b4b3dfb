"""The LoRA tables a model builds from its adapters, in-process at world 1 on the CPU: only where an
adapter edits, ranks padded per module, bf16 factors kept as stored. The adapters and the tiny
Llama are tests/integration/test_lora_logits.py's (which compares the logits across ranks)."""

from __future__ import annotations

import sys

import torch

from lorad.config import ModelConfig
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers import lora
from tests.integration.test_lora_logits import BLOCK_SIZE, MODEL, SEQS
from tests.integration.test_lora_logits import checkpoint  # noqa: F401  (a fixture)
from tests.tiny_adapters import cast_adapter


def test_tables_only_where_an_adapter_edits(checkpoint, monkeypatch):
    """In-process, world 1: an unedited module has no tables, ranks are padded per module, and a
    step without adapter rows makes no LoRA product at all."""
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.models import LlamaForCausalLM
    from lorad.workers.parallel import TensorParallel

    base, folders = checkpoint
    config = ModelConfig.from_dir(base)
    model = LlamaForCausalLM(config, TensorParallel(0, 1, torch.device("cpu")), torch.float32,
                             torch.device("cpu"))
    model.load_weights(str(base))
    args = [AdapterArg("subset", str(folders["subset"])),
            AdapterArg("patterns", str(folders["patterns"]))]
    model.load_adapters(tuple(load_adapter(a, slot, config) for slot, a in enumerate(args, 1)))
    model.allocate_kv_cache(8, BLOCK_SIZE)
    q0, k0, down1 = (model.lora_target(0, "q_proj").lora, model.lora_target(0, "k_proj").lora,
                     model.lora_target(1, "down_proj").lora)
    assert q0.ranks == [0, 3, 2] and q0.lora_a.shape == (3, 3, MODEL["hidden_size"])
    assert k0.ranks == [0, 0, 8] and down1.ranks == [0, 0, 5]
    assert down1.lora_b.shape == (3, MODEL["hidden_size"], 5)

    # The LoRA products: torch.bmm called from lora.py (attention and, at more than one
    # thread, cpu_threads.linear make their own)
    calls = []
    real_bmm = torch.bmm

    def bmm(*args):
        if sys._getframe(1).f_code.co_filename == lora.__file__:
            calls.append(1)
        return real_bmm(*args)

    monkeypatch.setattr(torch, "bmm", bmm)
    ids = SEQS["X"][:5]
    model(ForwardBatch.build([(ids, 0, [0, 1], True, 0)], BLOCK_SIZE))
    assert calls == []
    model(ForwardBatch.build([(ids, 0, [2, 3], True, 1)], BLOCK_SIZE))
    # "subset" edits q, v, down in layers 0 and 2: two products each.
    assert len(calls) == 2 * 3 * 2


def test_tables_hold_bf16_factors_as_stored(checkpoint, tmp_path):
    """Adapters whose files all store bf16 factors get bf16 tables; a mixture of file dtypes gets
    fp32 ones. Widened as they are read, bf16 tables give the logits of fp32 tables holding the
    same values, bit for bit (world 1, in-process, on the CPU path)."""
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.models import LlamaForCausalLM
    from lorad.workers.parallel import TensorParallel

    base, folders = checkpoint
    config = ModelConfig.from_dir(base)
    plain16 = cast_adapter(folders["plain"], tmp_path / "plain_bf16", torch.bfloat16)
    logits, dtypes = {}, {}
    for name, others in (("bf16", []), ("mixed", [folders["subset"]])):
        model = LlamaForCausalLM(config, TensorParallel(0, 1, torch.device("cpu")),
                                 torch.float32, torch.device("cpu"))
        model.load_weights(str(base))
        args = [AdapterArg("plain16", str(plain16))] + [
            AdapterArg(f"other{i}", str(path)) for i, path in enumerate(others)]
        model.load_adapters(tuple(load_adapter(a, slot, config) for slot, a in
                                  enumerate(args, 1)))
        model.allocate_kv_cache(8, BLOCK_SIZE)
        dtypes[name] = {lora.lora_a.dtype for lora in (
            model.lora_target(layer, module).lora for layer in range(MODEL["num_hidden_layers"])
            for module in ("q_proj", "down_proj")) if lora is not None}
        ids = SEQS["X"][:5]
        logits[name] = model(ForwardBatch.build([(ids, 0, [0, 1], True, 1)], BLOCK_SIZE))
    assert dtypes == {"bf16": {torch.bfloat16}, "mixed": {torch.float32}}
    assert torch.equal(logits["bf16"], logits["mixed"])
