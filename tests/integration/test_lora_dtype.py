"""--lora-dtype bfloat16 with --adapter-dir at --parallel 2: the slot tables hold bf16, a bf16
adapter's greedy tokens equal its tokens with the default fp32 tables (the tables hold its values
exactly either way), and an adapter stored in fp32 is refused with a 400 naming the module and the
flag, the base model and the bf16 adapter still served."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from tests.daemons import start_daemon
from tests.integration.test_many_adapters import complete
from tests.tiny_adapters import make_peft_adapter


def test_bf16_tables_serve_bf16_adapters_exactly_and_refuse_fp32_ones(tiny_model, tmp_path):
    check_lora_dtype(tiny_model, tmp_path, "--parallel", "2")


def check_lora_dtype(tiny_model, tmp_path, *placement: str) -> None:
    """The check, with the daemons' placement flags (tests/gpu runs it on a GPU)."""
    library = tmp_path / "library"
    half = make_peft_adapter(tiny_model, library / "half", r=4, seed=5)
    weights = half / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    make_peft_adapter(tiny_model, library / "full", r=4, seed=6)  # fp32 factors
    tokens = {}
    for dtype in ("auto", "bfloat16"):
        daemon = start_daemon(tiny_model, *placement, "--kv-cache-blocks", "256",
                              "--adapter-dir", str(library), "--lora-dtype", dtype)
        try:
            status, reply = complete(daemon.url, "half")
            assert status == 200, reply
            tokens[dtype] = reply["choices"][0]["token_ids"]
            base = complete(daemon.url, tiny_model.name)[1]
            assert base["choices"][0]["token_ids"] != tokens[dtype]  # the adapter acts
            status, reply = complete(daemon.url, "full")
            if dtype == "auto":
                assert status == 200, reply
            else:
                assert status == 400, reply
                message = reply["error"]["message"]
                assert "stores F32 factors" in message and "--lora-dtype" in message, message
                assert "full" in message, message
                assert complete(daemon.url, "half")[1]["choices"][0]["token_ids"] == \
                    tokens[dtype]
        finally:
            assert daemon.stop() == 0, daemon.log()[-4000:]
    assert tokens["bfloat16"] == tokens["auto"]
