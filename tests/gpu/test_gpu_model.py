"""The whole model on CUDA: logits against transformers + peft, a mixed burst through the engine
against each stream's solo run, and `--parallel 2 --dist-backend gloo` on one GPU against
`--parallel 1` (in-process ranks through tests/tp_runner.py, and real worker processes).

Tolerances are max|lorad - reference| / max|reference| over a step's logits: bf16 against the
fp32 reference as on the CPU (transformers' own bf16 run is about 2e-2 off its fp32 run on these
models; an adapter moves them by more than 1); fp32 on CUDA is one rounding order away.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorad.config import ModelConfig, WorkerConfig
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.protocol import Admit, SamplingParams, Shutdown
from lorad.workers.block_manager import BlockManager
from lorad.workers.cuda_graph import DecodeGraphs
from lorad.workers.engine import Engine
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence
from tests.kernels.compiled_variants import forget_compiled, num_compiled
from tests.model_steps import (build_model, check_scenario_against_reference, make_streams,
                               rel_error, scenario_steps)
from tests.tiny_adapters import cast_adapter, make_peft_adapter
from tests.tiny_models import make_tiny_llama
from tests.tp_runner import launch_ranks

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
BF16_REL_TOL = 5e-2
FP32_REL_TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 128
MAX_LEN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny llama3-rope checkpoint (6 query and 3 KV heads: splits over 2 ranks unevenly in
    the MLP and vocabulary) and three adapters of different ranks and modules."""
    root = tmp_path_factory.mktemp("gpu_model")
    checkpoint = make_tiny_llama(
        root / "llama", with_tokenizer=False, hidden_size=96, num_attention_heads=6,
        num_key_value_heads=3, intermediate_size=100, vocab_size=401, seed=6,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    adapters = [
        make_peft_adapter(checkpoint, root / "a1", r=4, lora_alpha=8, seed=41, magnitude=0.1),
        make_peft_adapter(checkpoint, root / "a2", r=8, lora_alpha=4, seed=42, magnitude=0.1,
                          use_rslora=True),
        make_peft_adapter(checkpoint, root / "a3", r=2, lora_alpha=16, seed=43, magnitude=0.1,
                          target_modules=("q_proj", "v_proj", "down_proj")),
    ]
    return checkpoint, adapters


@pytest.fixture(scope="module")
def tiny_bf16_adapters(tiny, tmp_path_factory) -> tuple[Path, list[Path]]:
    """tiny's checkpoint with its adapters stored in bf16: lorad's tables are then bf16."""
    checkpoint, adapters = tiny
    root = tmp_path_factory.mktemp("bf16_adapters")
    return checkpoint, [cast_adapter(path, root / path.name, torch.bfloat16)
                        for path in adapters]


@pytest.mark.parametrize("adapter_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype,tol", [("bfloat16", BF16_REL_TOL), ("float32", FP32_REL_TOL)])
def test_logits_match_transformers_and_peft(request, dtype, tol, adapter_dtype):
    checkpoint, adapters = request.getfixturevalue(
        "tiny" if adapter_dtype == "fp32" else "tiny_bf16_adapters")
    model = build_model(checkpoint, adapters, DTYPES[dtype], CUDA, NUM_BLOCKS, BLOCK_SIZE)
    graphs = DecodeGraphs(model, 8, MAX_LEN, BLOCK_SIZE, num_adapters=len(adapters))
    graphs.capture()
    streams = make_streams([0, 1, 2, 3, 2], [7, 12, 5, 9, 3], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                           seed=3)
    tables = {lora.lora_a.dtype for layer in model.model.layers
              for lora in (layer.self_attn.qkv_proj.lora("q"), layer.mlp.down_proj.lora) if lora}
    assert tables == {torch.float32 if adapter_dtype == "fp32" else torch.bfloat16}
    check_scenario_against_reference(model, graphs, checkpoint, adapters, streams, BLOCK_SIZE,
                                     CUDA, tol, adapter_moves=10 * BF16_REL_TOL)


# --- a mixed burst through the engine against each stream's solo run ------------------------

def start_engine(checkpoint: Path, adapters: list[Path], tmp_path: Path, **overrides) -> Engine:
    config = ModelConfig.from_dir(checkpoint)
    entries = [{"name": f"a{slot}", "path": str(path), "strength": 1.0,
                "key": load_adapter(AdapterArg(f"a{slot}", str(path)), slot, config).key}
               for slot, path in enumerate(adapters, start=1)]
    settings = dict(max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=16,
                    kv_cache_blocks=NUM_BLOCKS)
    cfg = WorkerConfig(
        model_dir=str(checkpoint), parallel=1, dtype="bfloat16", device="cuda",
        dist_backend="auto", block_size=BLOCK_SIZE, kv_cache_memory=None, num_threads=1,
        runtime_dir=str(tmp_path), instance_id="gpu", coordinator_pid=os.getpid(),
        adapters=entries, **{**settings, **overrides})
    return Engine.start(cfg, 0)


def drive(engine: Engine, requests: list[tuple[str, list[int], int, int]],
          forced: dict[str, list[int]] | None = None,
          limits: PlannerLimits = PlannerLimits(8, 16, MAX_LEN)) -> tuple[dict, int]:
    """requests: (request id, prompt, slot, step at which it arrives). Steps the planner and the
    engine as the worker loop does (no sockets), greedy or with `forced` tokens.
    -> (request id -> [vocab] logits per sampled token, number of steps through a graph)."""
    planner = Planner(limits, BlockManager(engine.num_kv_blocks, engine.block_size))
    logits_of = {request_id: [] for request_id, *_ in requests}
    num_tokens = 12
    pending = sorted(requests, key=lambda r: r[3])
    step, num_graph_steps, arrival = 0, 0, 0
    while pending or planner.running or planner.waiting:
        while pending and pending[0][3] <= step:
            request_id, prompt, slot, _ = pending.pop(0)
            arrival += 1
            key = engine.adapters[slot - 1].key if slot else ""
            params = SamplingParams(0.0, 1.0, 0, 0, num_tokens, [], True)
            assert planner.admit(Sequence(request_id, list(prompt), params, slot, key,
                                          arrival)) is None
        plan = planner.plan()
        step += 1
        if not plan.chunks:
            continue
        num_graph_steps += engine.graphs.can_run(plan.batch_chunks())
        logits = engine.forward(plan).float().cpu()
        sampled = []
        for row, request_id in zip(logits, plan.sampled_request_ids):
            logits_of[request_id].append(row)
            index = len(logits_of[request_id]) - 1
            sampled.append(forced[request_id][index] if forced else int(row.argmax()))
        planner.apply(plan, sampled)
    assert planner.blocks.num_free_blocks == engine.num_kv_blocks
    return logits_of, num_graph_steps


def _compiled_variants(forget: bool = False) -> dict[str, int]:
    """Each of lorad's triton kernels -> the variants compiled for it in this process (none after
    `forget`, which drops them: they compile again, from triton's disk cache)."""
    import importlib
    import pkgutil

    import triton

    import lorad.workers.kernels as package
    counts = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, kernel in vars(module).items():
            if isinstance(kernel, triton.runtime.JITFunction) and \
                    kernel.__module__ == module.__name__:
                if forget:
                    forget_compiled(kernel)
                counts[f"{info.name}.{name}"] = num_compiled(kernel)
    return counts


def test_serving_compiles_no_kernel_after_the_start(tiny, tmp_path):
    """Everything a step can launch is compiled before the rank says Ready (the warm-up step,
    the graph capture, the sampler's warm-up): prompts of other lengths, chunked prompts, decode
    steps in and out of graphs and every adapter mixture compile no further variant (triton
    compiles one per pointer alignment, and per int argument equal to 1 or divisible by 16)."""
    checkpoint, adapters = tiny
    _compiled_variants(forget=True)  # as a fresh process: nothing from earlier tests
    engine = start_engine(checkpoint, adapters, tmp_path)
    started = _compiled_variants()
    assert sum(started.values()) > 0
    gen = torch.Generator().manual_seed(13)
    lengths = [1, 2, 16, 17, 5, 32, 3, 13]
    requests = [(f"c{i}", torch.randint(3, 384, (n,), generator=gen).tolist(), i % 4, i // 2)
                for i, n in enumerate(lengths)]
    _, num_graph_steps = drive(engine, requests)
    assert num_graph_steps > 0
    after = _compiled_variants()
    assert after == started, {name: (started[name], after[name]) for name in after
                              if after[name] != started[name]}


def test_large_steps_compile_no_kernel_after_the_start(tmp_path):
    """The warm-up's bands (lorad/workers/warm_up.py) at the default budget: prompt chunks of 512
    and of 64 tokens beside decodes, steps of base rows only with adapters loaded, and decode
    steps of up to 80 sequences (past both PDL limits, the expand's small tile and the decode
    GEMV's rows) compile no variant that the start did not."""
    checkpoint = make_tiny_llama(tmp_path / "llama", with_tokenizer=False, hidden_size=96,
                                 num_attention_heads=6, num_key_value_heads=3,
                                 intermediate_size=100, vocab_size=401, seed=7,
                                 max_position_embeddings=1024)
    adapters = [make_peft_adapter(checkpoint, tmp_path / f"a{i}", r=r, lora_alpha=8, seed=50 + i,
                                  magnitude=0.1) for i, r in ((1, 4), (2, 8))]
    _compiled_variants(forget=True)
    max_len, budget, max_seqs = 1024, 512, 80
    engine = start_engine(checkpoint, adapters, tmp_path / "run", max_model_len=max_len,
                          max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          kv_cache_blocks=4096)
    started = _compiled_variants()
    gen = torch.Generator().manual_seed(21)

    def prompt(n):
        return torch.randint(3, 384, (n,), generator=gen).tolist()

    # Base rows alone first (70 short prompts, then a 70-token one), then adapters join: a
    # 600-token prompt (chunks of 512 and 88) and a 64-token one beside the decodes.
    requests = [(f"b{i}", prompt(3), 0, 0) for i in range(70)]
    requests += [("b-long", prompt(70), 0, 4), ("a-long", prompt(600), 1, 8),
                 ("a-mid", prompt(64), 2, 9)]
    requests += [(f"a{i}", prompt(2), 1 + i % 2, 10) for i in range(9)]
    _, num_graph_steps = drive(engine, requests, limits=PlannerLimits(max_seqs, budget, max_len))
    assert num_graph_steps > 0
    after = _compiled_variants()
    assert after == started, {name: (started[name], after[name]) for name in after
                              if after[name] != started[name]}


def test_mixed_burst_equals_each_streams_solo_run(tiny, tmp_path):
    checkpoint, adapters = tiny
    engine = start_engine(checkpoint, adapters, tmp_path)
    assert engine.graphs is not None and engine.graphs.captured
    gen = torch.Generator().manual_seed(12)
    slots = [1, 0, 2, 3, 1, 2]
    arrivals = [0, 0, 1, 3, 3, 6]
    lengths = [9, 20, 5, 14, 3, 11]  # 20 > the 16-token budget: a chunked prompt
    requests = [(f"r{i}", torch.randint(3, 384, (n,), generator=gen).tolist(), slot, at)
                for i, (n, slot, at) in enumerate(zip(lengths, slots, arrivals))]
    solo, tokens = {}, {}
    for request in requests:
        logits, _ = drive(engine, [(*request[:3], 0)])
        solo[request[0]] = logits[request[0]]
        tokens[request[0]] = [int(row.argmax()) for row in logits[request[0]]]
    burst, num_graph_steps = drive(engine, requests, forced=tokens)
    assert num_graph_steps >= 5
    for request_id, rows in solo.items():
        assert len(burst[request_id]) == len(rows) == 12
        for k, (alone, crowded) in enumerate(zip(rows, burst[request_id])):
            assert rel_error(crowded, alone) < BF16_REL_TOL, (request_id, k)
            top2 = alone.topk(2).values
            if top2[0] - top2[1] > 2 * BF16_REL_TOL * alone.abs().max():
                assert int(crowded.argmax()) == tokens[request_id][k], (request_id, k)


# --- --parallel 2 --dist-backend gloo on one GPU --------------------------------------------

def test_two_ranks_on_one_gpu_with_gloo_equal_one(tiny, tmp_path):
    checkpoint, adapters = tiny
    models = []
    for dtype in ("float32", "bfloat16"):
        streams = make_streams([2, 0, 1, 3], [9, 6, 4, 7], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                               seed=4)
        models.append({"name": dtype, "dir": str(checkpoint), "dtype": dtype,
                       "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
                       "scenarios": {"mixed": scenario_steps(streams)},
                       "adapters": [{"name": f"a{i}", "path": str(p), "strength": 1.0}
                                    for i, p in enumerate(adapters, start=1)]})
    outs = launch_ranks({1: models, 2: models}, tmp_path, backend="gloo", device="cuda",
                        timeout_s=300)
    for dtype, tol in (("float32", FP32_REL_TOL), ("bfloat16", BF16_REL_TOL)):
        one = load_file(outs[1] / f"{dtype}.rank0.safetensors")
        for rank in (0, 1):
            two = load_file(outs[2] / f"{dtype}.rank{rank}.safetensors")
            assert one.keys() == two.keys()
            for name in one:
                assert rel_error(two[name], one[name]) < tol, (dtype, rank, name)


def test_segmented_graphs_of_two_gloo_ranks_on_one_gpu(tiny, tmp_path):
    """At world 2 over gloo the decode graphs end at each collective, which runs between the
    segments: a replay has the bits of the same padded step run eagerly on both ranks, and stays
    within bf16 noise of world 1's graphs."""
    checkpoint, adapters = tiny
    streams = make_streams([2, 0, 1, 3], [9, 6, 4, 7], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=4)
    models = [{"name": "graphs", "dir": str(checkpoint), "dtype": "bfloat16",
               "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
               "scenarios": {"mixed": scenario_steps(streams)},
               "adapters": [{"name": f"a{i}", "path": str(p), "strength": 1.0}
                            for i, p in enumerate(adapters, start=1)],
               "graphs": {"max_num_seqs": 4, "max_model_len": MAX_LEN}}]
    outs = launch_ranks({1: models, 2: models}, tmp_path, backend="gloo", device="cuda",
                        timeout_s=300)
    one = load_file(outs[1] / "graphs.rank0.safetensors")
    replayed = [name for name in one if name.endswith(".eager")]
    assert len(replayed) == 4, sorted(one)  # the four decode steps
    for rank in (0, 1):
        two = load_file(outs[2] / f"graphs.rank{rank}.safetensors")
        assert one.keys() == two.keys()
        for name in replayed:
            step = name.removesuffix(".eager")
            assert torch.equal(two[step], two[name]), (rank, step)
            assert rel_error(two[step], one[step]) < BF16_REL_TOL, (rank, step)


def test_worker_processes_on_one_gpu_at_parallel_1_and_2(tiny):
    """Real workers (`python -m lorad.workers`) on CUDA, fp32: graphs at --parallel 1, gloo at
    --parallel 2; every greedy token is transformers' choice given the tokens before it."""
    from transformers import LlamaForCausalLM

    from tests.integration.test_worker_loop import FakeCoordinator, _collect, greedy

    checkpoint, _ = tiny
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    reference = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(CUDA)
    for parallel, backend in ((1, "auto"), (2, "gloo")):
        coord = FakeCoordinator(
            checkpoint, parallel, env={"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME",
                                                                            "lo")},
            overrides={"device": "cuda", "dtype": "float32", "dist_backend": backend})
        try:
            coord.handshake(timeout_s=240)
            for i, prompt in enumerate(prompts):
                coord.send(lambda seq, i=i, prompt=prompt: Admit(seq, f"r{i}", prompt,
                                                                 greedy(16, True), 0, ""))
            tokens, finished, _ = _collect(coord, [f"r{i}" for i in range(len(prompts))])
            coord.send(Shutdown)
            for proc in coord.procs:
                assert proc.wait(timeout=60) == 0, coord.worker_logs()
        finally:
            coord.close()
        for i, prompt in enumerate(prompts):
            out = tokens[f"r{i}"]
            assert len(out) == 16 and finished[f"r{i}"] == "length"
            with torch.no_grad():
                ref = reference(torch.tensor([prompt + out], device=CUDA)).logits[0].float()
            for k, token in enumerate(out):
                row = ref[len(prompt) - 1 + k]  # predicts position len(prompt) + k
                gap = (row.max() - row[token]).item()
                assert gap <= 1e-3 * row.abs().max().item(), (parallel, i, k, gap)


def test_worker_processes_with_adapters_warm_up_and_serve(tiny):
    """Real workers on CUDA with three adapters, at --parallel 1 (graphs) and 2 (gloo): the
    warm-up step (a prefill on adapter slot 1 and a decode) runs before Ready, leaves every KV
    block free, and requests on an adapter and on the base model are then served."""
    from tests.integration.test_worker_loop import FakeCoordinator, _collect, greedy

    checkpoint, folders = tiny
    config = ModelConfig.from_dir(checkpoint)
    entries = [load_adapter(AdapterArg(f"a{i}", str(path), 1.0), i, config).to_worker_dict()
               for i, path in enumerate(folders, start=1)]
    for parallel, backend in ((1, "auto"), (2, "gloo")):
        coord = FakeCoordinator(
            checkpoint, parallel, adapters=entries,
            env={"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")},
            overrides={"device": "cuda", "dtype": "float32", "dist_backend": backend})
        try:
            ready = coord.handshake(timeout_s=240)
            assert coord.worker_logs().count("warm-up: ") == parallel
            coord.send(lambda seq: Admit(seq, "lora", [5, 6, 7, 8], greedy(4, True), 1,
                                         entries[0]["key"]))
            coord.send(lambda seq: Admit(seq, "base", [9, 10], greedy(4, True), 0, ""))
            tokens, finished, result = _collect(coord, ["lora", "base"])
            assert finished == {"lora": "length", "base": "length"}
            assert result.num_free_blocks == ready[0].num_kv_blocks
            coord.send(Shutdown)
            for proc in coord.procs:
                assert proc.wait(timeout=60) == 0, coord.worker_logs()
        finally:
            coord.close()


def test_async_scheduling_gives_the_tokens_of_synchronous_steps(tiny):
    """At --parallel 1 on CUDA (decode graphs, bf16), decode steps that run ahead of their apply
    (the default; the continuation's tokens gathered on the device) give every stream the tokens
    and endings of synchronous steps: greedy and seeded rows, streams that end on a stop token
    (their next row runs in vain) and by length."""
    from tests.integration.test_worker_loop import FakeCoordinator, _collect

    checkpoint, _ = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist()
               for n in (3, 7, 12, 20, 5, 9, 4, 15)]
    ids = [f"r{i}" for i in range(len(prompts))]

    def serve(async_scheduling: bool, stops: dict[str, list[int]]):
        coord = FakeCoordinator(checkpoint, 1, overrides={
            "device": "cuda", "dtype": "bfloat16", "kv_cache_blocks": 256,
            "async_scheduling": async_scheduling})
        try:
            coord.handshake(timeout_s=240)
            for i, prompt in enumerate(prompts):
                params = SamplingParams(0.0 if i % 2 else 1.0, 1.0, 0, 100 + i, 24, [], True,
                                        request_stop_token_ids=stops.get(ids[i], []))
                coord.send(lambda seq, i=i, prompt=prompt, params=params:
                           Admit(seq, ids[i], prompt, params, 0, ""))
            tokens, finished, _ = _collect(coord, ids)
            ran_ahead = "async scheduling: step" in coord.worker_logs()
            coord.send(Shutdown)
            assert coord.procs[0].wait(timeout=60) == 0, coord.worker_logs()
        finally:
            coord.close()
        assert ran_ahead == async_scheduling
        return tokens, finished

    free, _ = serve(False, {})
    # Streams r0, r2, r4, r6 stop on their own token 5 + i (at its first appearance).
    stops = {r: [free[r][5 + i]] for i, r in enumerate(ids) if i % 2 == 0}
    expected = serve(False, stops)
    assert serve(True, stops) == expected
    assert sorted(expected[1].values()) == ["length"] * 4 + ["stop"] * 4
