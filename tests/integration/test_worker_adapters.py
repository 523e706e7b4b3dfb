"""Adapters in real worker processes at world 2, the test playing the coordinator: greedy tokens
against peft's generate, a mixed batch against each stream's solo run, refused admissions, a rank
that applies an admission with another slot, and start-up refusals that name the adapter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lorad.config import ModelConfig
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.protocol import Admit, SamplingParams, Shutdown, StepFailed
from lorad.workers.loop import CORRUPT_SLOT_RANK_ENV
from tests.integration.test_worker_loop import EOS, FakeCoordinator, _collect, greedy
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

MAX_TOKENS = 12
# name -> (make_peft_adapter arguments, strength); slots 1..K in this order
ADAPTERS = {
    "sql": (dict(r=4, lora_alpha=8, seed=21, magnitude=0.1), 1.0),
    "chat": (dict(r=6, lora_alpha=6, use_rslora=True, target_modules=("q_proj", "v_proj",
                                                                     "down_proj"),
                  seed=22, magnitude=0.1), 0.5),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("adapters")
    base = make_tiny_llama(root / "llama", with_tokenizer=False, seed=4)
    folders = {name: make_peft_adapter(base, root / name, **kwargs)
               for name, (kwargs, _) in ADAPTERS.items()}
    folders["sql_other"] = make_peft_adapter(base, root / "sql_other",
                                             **{**ADAPTERS["sql"][0], "seed": 23})
    return base, folders


def entries(base: Path, folders: dict[str, Path], **paths: str) -> list[dict]:
    """WorkerConfig.adapters with the keys a coordinator would compute (paths: name -> folder
    to use instead of the adapter's own)."""
    config = ModelConfig.from_dir(base)
    out = []
    for slot, (name, (_, strength)) in enumerate(ADAPTERS.items(), start=1):
        path = str(folders[paths.get(name, name)])
        out.append(load_adapter(AdapterArg(name, path, strength), slot, config).to_worker_dict())
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (5, 11, 7, 20)]


# (request id, prompt index, slot): two streams of "sql", one of "chat", one of the base model
STREAMS = [("sql0", 0, 1), ("chat1", 1, 2), ("base2", 2, 0), ("sql3", 3, 1)]


@pytest.fixture(scope="module")
def reference(model, prompts) -> dict[str, list[int]]:
    """peft's greedy tokens per stream."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base, folders = model
    hf = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    names = [None, *ADAPTERS]
    out = {}
    for request_id, prompt, slot in STREAMS:
        run = hf
        if slot:
            run = PeftModel.from_pretrained(hf, folders[names[slot]], adapter_name="a")
            for module in run.modules():
                scaling = getattr(module, "scaling", None)
                if isinstance(scaling, dict) and "a" in scaling:
                    scaling["a"] *= ADAPTERS[names[slot]][1]
        ids = torch.tensor([prompts[prompt]])
        tokens = run.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=EOS, pad_token_id=EOS)
        out[request_id] = tokens[0, len(prompts[prompt]):].tolist()
        if slot:
            hf = run.unload()
    return out


def admit(coord: FakeCoordinator, request_id: str, prompt: list[int], slot: int,
          params: SamplingParams) -> None:
    key = coord.cfg.adapters[slot - 1]["key"] if slot else ""
    coord.send(lambda seq: Admit(seq, request_id, prompt, params, slot, key))


def test_adapters_serve_like_peft(model, prompts, reference):
    base, folders = model
    coord = FakeCoordinator(base, 2, adapters=entries(base, folders))
    try:
        ready = coord.handshake()
        assert len({r.registry_digest for r in ready}) == 1
        # Each stream alone, then all four in one mixed batch: greedy equals peft both times.
        for request_id, prompt, slot in STREAMS:
            admit(coord, request_id, prompts[prompt], slot, greedy(MAX_TOKENS))
            tokens, _, _ = _collect(coord, [request_id])
            assert tokens[request_id] == reference[request_id], request_id
        for request_id, prompt, slot in STREAMS:
            admit(coord, f"m-{request_id}", prompts[prompt], slot, greedy(MAX_TOKENS))
        tokens, _, _ = _collect(coord, [f"m-{r}" for r, _, _ in STREAMS])
        assert {r: tokens[f"m-{r}"] for r, _, _ in STREAMS} == reference

        # Sampling reads every bit of the logits: an adapter stream draws the same tokens
        # alone and in a crowd of other adapters.
        params = SamplingParams(0.9, 0.95, 50, 7, 10, [EOS], True)
        admit(coord, "solo", prompts[1], 2, params)
        solo, _, _ = _collect(coord, ["solo"])
        admit(coord, "n0", prompts[0], 1, greedy(6))
        admit(coord, "crowd", prompts[1], 2, params)
        admit(coord, "n2", prompts[3], 1, SamplingParams(1.0, 1.0, 0, 3, 8, [], True))
        crowd, _, _ = _collect(coord, ["n0", "crowd", "n2"])
        assert crowd["crowd"] == solo["solo"]

        _refusals_fail_only_their_request(coord, prompts, reference["sql0"])
        coord.send(Shutdown)
        for proc in coord.procs:
            assert proc.wait(timeout=30) == 0, coord.worker_logs()
    finally:
        coord.close()


def _refusals_fail_only_their_request(coord: FakeCoordinator, prompts, want: list[int]) -> None:
    """Admissions no rank can serve end alone; "ok" (stream sql0 again) runs on untouched."""
    admit(coord, "ok", prompts[0], 1, greedy(MAX_TOKENS))
    sql_key = coord.cfg.adapters[0]["key"]
    coord.send(lambda seq: Admit(seq, "no-id", prompts[0], greedy(4), 3, sql_key))
    coord.send(lambda seq: Admit(seq, "wrong-key", prompts[0], greedy(4), 2, sql_key))
    coord.send(lambda seq: Admit(seq, "base-with-key", prompts[0], greedy(4), 0, sql_key))
    failed, tokens = {}, []
    for msg in coord.results(failed_ok=True):
        if isinstance(msg, StepFailed):
            assert len(msg.request_ids) == 1
            failed[msg.request_ids[0]] = msg.message
            continue
        tokens += [t for o in msg.outputs if o.request_id == "ok" for t in o.token_ids]
        if any(o.request_id == "ok" and o.finish_reason for o in msg.outputs):
            break
    assert "adapter id 3 is not registered" in failed["no-id"]
    assert "adapter id 2 is 'chat'" in failed["wrong-key"]
    assert "id 0 is the base model" in failed["base-with-key"]
    assert tokens == want


def test_a_rank_with_another_slot_fails_the_step_everywhere(model, prompts, reference):
    base, folders = model
    coord = FakeCoordinator(base, 2, adapters=entries(base, folders),
                            env={CORRUPT_SLOT_RANK_ENV: "1"})
    try:
        coord.handshake()
        admit(coord, "bystander", prompts[3], 0, greedy(40, ignore_eos=True))
        results = coord.results(failed_ok=True)
        next(r for r in results if any(o.request_id == "bystander" for o in r.outputs))
        admit(coord, "victim", prompts[0], 1, greedy(MAX_TOKENS))  # rank 1 applies slot 2
        failed = next(r for r in results if isinstance(r, StepFailed))
        assert "victim" in failed.request_ids and "differ" in failed.message

        # Both ranks are clean again and serve adapter requests exactly.
        for request_id, prompt, slot in STREAMS[:2]:
            admit(coord, request_id, prompts[prompt], slot, greedy(MAX_TOKENS))
        tokens, _, _ = _collect(coord, [r for r, _, _ in STREAMS[:2]])
        assert tokens == {r: reference[r] for r, _, _ in STREAMS[:2]}
        logs = coord.worker_logs()  # read last: rank 1 may log after rank 0 has published
        failed_steps = re.findall(r"rank (\d)\] ERROR step (\d+) failed", logs)
        assert sorted(failed_steps) == [("0", str(failed.step)), ("1", str(failed.step))], logs
    finally:
        coord.close()


def test_start_up_refuses_an_adapter_that_differs_on_one_rank(model):
    base, folders = model
    coord = FakeCoordinator(base, 2, adapters=entries(base, folders),
                            rank_adapters={1: entries(base, folders, sql="sql_other")})
    try:
        failures = coord.start_up_failures()
        for rank, message in failures.items():
            assert "adapter 'sql' (id 1) differs from rank 0 on rank(s) [1]" in message, rank
            assert "'chat'" not in message
    finally:
        coord.close()


def test_start_up_refuses_a_key_the_coordinator_did_not_compute(model):
    base, folders = model
    adapters = entries(base, folders)
    adapters[1] = {**adapters[1], "key": "0" * 64}
    coord = FakeCoordinator(base, 1, adapters=adapters)
    try:
        (message,) = coord.start_up_failures().values()
        assert "adapter 'chat'" in message and "identity key" in message
    finally:
        coord.close()
