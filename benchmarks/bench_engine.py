#!/usr/bin/env python3
"""lorad's engine on one GPU, no HTTP: decode step time and tokens/s against the memory floor.

Builds lorad's model of --config's family in-process at world size 1 (random weights, bf16,
CUDA; scripts/configs/llama3-8b by default, scripts/configs/qwen1.5-moe-a2.7b for the MoE
shape), a KV pool of random values and the decode CUDA graphs, then times decode steps at
several batch sizes: the base model with no adapter loaded (`base`), adapters loaded but every
row on slot 0 (`idle`), one adapter on every row (`one`), rows cycling over four adapters
(`mixed4`), a distinct adapter per row up to --num-adapters slots (`many`); rank 16 on every
projection the family serves; and those on variants of lorad's Tuning (`--variant`). Beside
each figure the floor: the bytes a step must read (weights, on a MoE model only the routed
experts it touches: moe_floor.py; the batch's LoRA factors; every sequence's KV) over the
device-to-device copy bandwidth measured in this run. Then prefill tokens/s, and transformers +
peft `generate` of the same family on the same shapes (mixed adapters through
`adapter_names`). Prints the conditions and a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

from lorad.config import ModelConfig  # noqa: E402
from lorad.config.adapters import AdapterArg, layer_modules, load_adapter  # noqa: E402
from lorad.config.adapters import module_name, projection_features  # noqa: E402
from lorad.workers.batch import MIN_ROWS, ForwardBatch  # noqa: E402
from lorad.workers.cuda_graph import DecodeGraphs  # noqa: E402
from lorad.workers.fused_linear import FusedColumnParallelLinear  # noqa: E402
from lorad.workers.linear import RowParallelLinear  # noqa: E402
from lorad.workers.loader import fill_slot, read_shards  # noqa: E402
from lorad.workers.lora import LoraSlots  # noqa: E402
from lorad.workers.models import LlamaForCausalLM, model_class  # noqa: E402
from lorad.workers.moe import SparseMoeBlock  # noqa: E402
from lorad.workers.parallel import TensorParallel  # noqa: E402
from benchmarks.common import conditions, copy_bandwidth, time_cuda  # noqa: E402
from benchmarks.moe_floor import decode_bytes, expected_experts  # noqa: E402
from benchmarks.step_table import table_json, time_adapter_copy  # noqa: E402
from lorad.workers.tuning import Tuning, replaced  # noqa: E402

CUDA = torch.device("cuda", 0)
BLOCK_SIZE = 16
ADAPTER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROMPT_ID_RANGE = (100, 1000)
rows: list[dict] = []  # the table


def parse_args() -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "scripts/configs/llama3-8b"),
                   help="model folder; only config.json is read (default: %(default)s)")
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128])
    p.add_argument("--cases", default="base,idle,one,mixed4,many",
                   help="subset of base,idle,one,mixed4,many")
    p.add_argument("--variant", default="",
                   help="';'-separated tuning variants, each timed for --variant-cases at "
                        "--variant-batches with graphs captured again (and the many prefill "
                        "when many is among them). A variant is PATH=VALUE settings joined by "
                        "'+', each a dataclasses.replace of lorad's Tuning "
                        "(lorad/workers/tuning.py) at a dotted field path, VALUE a Python "
                        "literal; 'main' is Tuning() again. Fields: pdl.max_rows, "
                        "pdl.max_rows_with_lora (0: no PDL), tiles.block_m, "
                        "tiles.programs_per_sm, shrink.{block_r,block_k,k_chunk,num_warps,"
                        "num_stages,items_per_sm}, expand.{small,large}.{block_n,num_warps,"
                        "num_stages}, expand.small_step_rows, expand.items_per_sm, "
                        "gemv.{qkv,gate_up}.{block_m,block_n,block_k,num_warps,num_stages}, "
                        "moe.{block_m,block_n,block_k,num_warps,num_stages,small_step_rows,pdl} "
                        "(gemv.qkv=None: cuBLAS; gemv.o.block_m=16: the GEMV for o), "
                        "attention.{split_size,tile_tokens,split_programs,num_warps,"
                        "num_stages,reduce_group,prefetch_max_seqs,preload_max_seqs}; e.g. "
                        "'shrink.items_per_sm=4;main;pdl.max_rows=64+tiles.programs_per_sm=16'")
    p.add_argument("--variant-cases", default="idle,one,many")
    p.add_argument("--variant-batches", type=ints, default=[1, 32, 64])
    p.add_argument("--eager-batches", type=ints, default=[1, 32],
                   help="also time these batches without graphs (base and many)")
    p.add_argument("--context", type=int, default=512,
                   help="tokens in each sequence's KV when its decode steps start")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="what the graphs are captured for, as a server would (block table width)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per figure")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter-dtype", choices=sorted(ADAPTER_DTYPES), default="bf16",
                   help="the dtype the adapters' files store their factors in, and so the LoRA "
                        "tables' (lora.table_dtype)")
    p.add_argument("--prefill", default="8x512",
                   help="SEQSxTOKENS of the prefill step, several comma-separated (a step "
                        "table wants a few: 1x512,2x512,1x2048); '' skips")
    p.add_argument("--hf-batches", type=ints, default=[1, 32], help="'' skips transformers")
    p.add_argument("--hf-prompt", type=int, default=128)
    p.add_argument("--hf-new-tokens", type=int, default=16)
    p.add_argument("--hf-repeats", type=int, default=3,
                   help="transformers' times are each the fastest of this many runs")
    p.add_argument("--quick", action="store_true",
                   help="batches 1,32,64, prefill 2x512, transformers at batch 32 "
                        "(every target of the GPU issue, in about a minute)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch lorad's Triton kernels without programmatic dependent launch "
                        "(kernels/pdl.py), to measure what it saves (the same as every "
                        "variant's and main's pdl.max_rows=0+pdl.max_rows_with_lora=0)")
    p.add_argument("--deterministic", action="store_true",
                   help="measure matmul plans first, as lorad's default --deterministic does "
                        "(cuBLAS only at the row counts where it keeps a row's bits); without "
                        "it cuBLAS at every count, as --no-deterministic")
    p.add_argument("--mixed-step-graphs", action="store_true",
                   help="eager and prefill rows through the piecewise graphs of steps with "
                        "prompt chunks (workers/mixed_graph.py), as lorad --mixed-step-graphs "
                        "runs them")
    p.add_argument("--table-out", help="also write the markdown table to this file")
    p.add_argument("--json-out", help="also write the step-time table (lorad-step-table/1, "
                   "docs/capacity.md) of the decode and prefill rows and an adapter's copy "
                   "into a slot, for scripts/capacity.py")
    args = p.parse_args()
    if args.quick:
        args.batches, args.prefill, args.hf_batches = [1, 32, 64], "2x512", [32]
        args.eager_batches = [1]
    return args


# --- ceilings ---------------------------------------------------------------------------------

def measure_ceilings() -> tuple[float, float]:
    """-> (copy bandwidth in bytes/s, read + write counted; bf16 matmul FLOP/s), on random data."""
    bandwidth = copy_bandwidth(CUDA)
    a = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    seconds = time_cuda(lambda: a @ b, 10)
    return bandwidth, 2 * 8192**3 / seconds


# --- lorad ------------------------------------------------------------------------------------

def build_lorad(config: ModelConfig, max_batch: int, blocks_per_seq: int,
                tuning: Tuning = Tuning()) -> LlamaForCausalLM:
    model = model_class(config)(config, TensorParallel(0, 1, CUDA), torch.bfloat16, CUDA,
                                tuning)
    model.load_random_weights(seed=0)
    # Block 0 stays spare; sequence i owns blocks 1 + i * blocks_per_seq onwards.
    model.allocate_kv_cache(1 + max_batch * blocks_per_seq, BLOCK_SIZE)
    for layer in model.model.layers:  # random KV: never time attention on zeros
        layer.self_attn.kv_cache.k.normal_()
        layer.self_attn.kv_cache.v.normal_()
    return model


def adapter_modules(config: ModelConfig) -> list[str]:
    """The projections write_adapter edits, in PEFT's target_modules spelling: every one the
    family serves (a Qwen2-MoE sparse layer: q/k/v/o and the shared expert's gate/up/down)."""
    found = []
    for layer in range(config.num_hidden_layers):
        found += [m for m in layer_modules(config, layer) if m not in found]
    return found


def write_adapter(folder: Path, config: ModelConfig, rank: int,
                  dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> Path:
    """A PEFT LoRA folder with random factors (drawn from `seed`) stored as `dtype` (bf16: LoRA
    tables of bf16, as adapters saved in bf16 get; fp32: tables of fp32) on every projection
    of every layer that lorad serves for the family (lorad.config.adapters.layer_modules)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    # A dotted target ("shared_expert.gate_proj") matches by suffix; a Qwen2-MoE's routed
    # experts are no modules of their own in transformers, so "gate_proj" misses them.
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=adapter_modules(config),
               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM").save_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in layer_modules(config, layer):
            in_features, out_features = projection_features(config, module)
            name = f"base_model.model.{module_name(layer, module)}"
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=gen) * in_features**-0.5).to(dtype)
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=gen) * 0.02).to(dtype)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def load_adapters(model: LlamaForCausalLM, folder: Path, count: int) -> tuple[dict, object]:
    """The same factors in `count` slots (each its own memory): validated and keyed once; as
    model.load_adapters does, keeping the slot tables -> (tables, slot 1's spec)."""
    spec = load_adapter(AdapterArg("a1", str(folder)), 1, model.config)
    specs = tuple(dataclasses.replace(spec, name=f"a{slot}", adapter_id=slot)
                  for slot in range(1, count + 1))
    tables = model.add_lora_tables(specs, None)
    for one in specs:
        fill_slot(tables, one.adapter_id, one, read_shards(tables, one))
    return tables, specs[0]


def table_steps(found: list[dict], num_adapters: int) -> list[dict]:
    """The decode and prefill rows as a step table's steps; distinct adapters: base 0, one 1,
    mixed4 up to 4, many up to num_adapters. A decode case's eager row beside its graph row is
    filed as a prompt step of that many tokens: the worker runs every step with a prompt chunk
    eagerly, so it samples that path's cost at a few tokens."""
    levels = {"base": 0, "one": 1, "mixed4": 4, "many": num_adapters}
    graphed = {(r["case"], r["batch"]) for r in found if r["mode"] == "graph" and r["step_ms"]}
    steps = []
    for r in found:
        if not r["step_ms"]:
            continue
        if r["case"] in levels and r["mode"] == "eager" and (r["case"], r["batch"]) in graphed:
            steps.append({"decode_rows": 0, "prefill_tokens": r["batch"],
                          "adapters": min(r["batch"], levels[r["case"]]),
                          "step_ms": round(r["step_ms"], 4)})
        elif r["case"] in levels:
            steps.append({"decode_rows": r["batch"], "prefill_tokens": 0,
                          "adapters": min(r["batch"], levels[r["case"]]),
                          "step_ms": round(r["step_ms"], 4)})
        elif r["case"] in ("prefill base", "prefill many"):
            num_seqs, length = (int(x) for x in r["batch"].split("x"))
            adapters = 0 if r["case"] == "prefill base" else min(num_seqs, num_adapters)
            steps.append({"decode_rows": 0, "prefill_tokens": num_seqs * length,
                          "adapters": adapters, "step_ms": round(r["step_ms"], 4)})
    return steps


class Floor:
    """Bytes a decode step must read, and the time they take at the measured bandwidth; on a
    MoE model from its config (moe_floor.decode_bytes: the routed experts a step touches, by
    default as many as uniform routing touches in expectation)."""

    def __init__(self, model: LlamaForCausalLM, bandwidth: float) -> None:
        config = model.config
        self.bandwidth = bandwidth
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        embedding = model.model.embed_tokens.weight
        # An untied step reads one embedding row per token, not the table.
        self.weight_bytes = params - (0 if config.tie_word_embeddings
                                      else embedding.numel() * embedding.element_size())
        self.row_bytes = config.hidden_size * embedding.element_size()
        self.kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                                   * config.head_dim * embedding.element_size())
        self.loras = [m for m in model.modules() if isinstance(m, LoraSlots)]
        self.linear_params = sum(m.weight.numel() for m in model.modules()
                                 if isinstance(m, (FusedColumnParallelLinear, RowParallelLinear)))
        self.element_size = embedding.element_size()
        self.config = config

    def lora_bytes(self, slots: set[int]) -> int:
        return sum(lora.ranks[slot] * (lora.lora_a.shape[2] + lora.lora_b.shape[1])
                   * lora.lora_a.element_size() for lora in self.loras for slot in slots if slot)

    def prefill_flops(self, slots: list[int], length: int) -> float:
        """Matmul FLOPs of prompts of `length` tokens, one per slot, sampling their last rows."""
        config = self.config
        tokens = len(slots) * length
        attention = (4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
                     * len(slots) * length * (length + 1) / 2)  # causal: half of QK^T and PV
        head = 2 * len(slots) * config.vocab_size * config.hidden_size
        sparse = sum(config.is_moe_layer(layer) for layer in range(config.num_hidden_layers))
        moe = 2 * tokens * sparse * config.hidden_size * (  # each token's experts and router
            3 * config.num_experts_per_tok * config.moe_intermediate_size + config.num_experts)
        lora = sum(2 * length * lora.ranks[s] * (lora.lora_a.shape[2] + lora.lora_b.shape[1])
                   for lora in self.loras for s in slots if s)
        return 2 * self.linear_params * tokens + attention + head + moe + lora

    def decode_seconds(self, slots: list[int], context_lens: list[int],
                       experts_per_layer: float | None = None) -> float:
        """`experts_per_layer`: the routed experts each sparse layer reads (None: uniform
        routing's expectation at len(slots) rows); the dense family has none."""
        if self.config.num_experts:
            return decode_bytes(self.config, len(slots), sum(context_lens),
                                self.lora_bytes(set(slots)), self.element_size,
                                experts_per_layer)["total"] / self.bandwidth
        total = (self.weight_bytes + len(slots) * self.row_bytes + self.lora_bytes(set(slots))
                 + sum(context_lens) * self.kv_bytes_per_token)
        return total / self.bandwidth


def slots_for(case: str, batch: int, num_adapters: int) -> list[int]:
    if case in ("base", "idle"):
        return [0] * batch
    if case == "one":
        return [1] * batch
    if case == "mixed4":  # the mixture transformers+peft runs as mixed-4
        return [1 + i % 4 for i in range(batch)]
    return [1 + i % num_adapters for i in range(batch)]


def decode_steps(slots: list[int], context: int, blocks_per_seq: int, num_steps: int):
    """num_steps decode steps of len(slots) sequences, each from `context` tokens on."""
    gen = torch.Generator().manual_seed(len(slots))
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
              for i in range(len(slots))]
    for step in range(num_steps):
        pos = context + step
        ids = torch.randint(*PROMPT_ID_RANGE, (len(slots),), generator=gen).tolist()
        yield [([ids[i]], pos, tables[i][:pos // BLOCK_SIZE + 1], True, slot)
               for i, slot in enumerate(slots)]


def time_decode(model, graphs: DecodeGraphs | None, slots: list[int], args,
                blocks_per_seq: int) -> tuple[float, float | None, str]:
    """-> (median seconds per step as the worker runs it: inputs, forward, argmax to the host;
    median seconds per graph replay alone, or None eagerly; the host's fill and launch times
    as a note, or "" eagerly)."""
    steps = list(decode_steps(slots, args.context, blocks_per_seq, args.warmup + args.steps))

    def step(chunks):
        logits = graphs.run(chunks) if graphs is not None else eager_step(model, chunks, args)
        return logits.argmax(-1).tolist()  # the leader's sync each step

    for chunks in steps[:args.warmup]:
        step(chunks)
    torch.cuda.synchronize()
    times = []
    with HostClock(graphs) as clock:
        for chunks in steps[args.warmup:]:
            start = time.perf_counter()
            step(chunks)
            times.append(time.perf_counter() - start)
    # The median: the host's share of a step (inputs, launch, the sync) jumps now and then.
    per_step = statistics.median(times)
    replay = None
    if graphs is not None:
        replay = time_cuda(graphs.graph_for(len(slots), any(slots)).replay, args.steps, warmup=1)
    return per_step, replay, clock.summary()


def eager_step(model, chunks: list, args) -> torch.Tensor:
    """A step the worker runs without decode graphs: through the mixed-step graphs where
    --mixed-step-graphs captured them (args.mixed), else eagerly."""
    mixed = getattr(args, "mixed", None)
    if mixed is not None and mixed.can_run(chunks):
        return mixed.run(chunks)
    return model.forward(ForwardBatch.build(chunks, BLOCK_SIZE, CUDA))


def capture_mixed(model, args, num_adapters: int, max_rows: int) -> None:
    """args.mixed: the mixed-step graphs of --mixed-step-graphs for up to max_rows rows (None
    without the flag, or when the capture fails: then those rows run eagerly, and say so)."""
    args.mixed = None
    if not args.mixed_step_graphs:
        return
    from lorad.workers.mixed_graph import MixedGraphs
    mixed = MixedGraphs(model, max_rows, BLOCK_SIZE, num_adapters)
    try:
        mixed.capture()
    except Exception as exc:
        traceback.print_exc()
        add_row("mixed-step graph capture", "-", "-", None, note=f"failed, eager instead: {exc}")
        return
    args.mixed = mixed


class HostClock:
    """Times, on the host, the two parts of a graph step that run before the GPU has work: the
    inputs' fill (DecodeInputs.fill) and the replay call (the graph's launch), by wrapping both
    for the duration of a `with`; summary() -> their medians, or "" eagerly."""

    def __init__(self, graphs: DecodeGraphs | None) -> None:
        self.graphs = graphs
        self.fill: list[float] = []
        self.launch: list[float] = []

    @staticmethod
    def _timed(fn, into: list[float]):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - start)
        return timed

    def __enter__(self) -> "HostClock":
        if self.graphs is not None:
            self.graphs.inputs.fill = self._timed(self.graphs.inputs.fill, self.fill)
            for graph in self.graphs._graphs.values():
                graph.replay = self._timed(graph.replay, self.launch)
        return self

    def __exit__(self, *exc) -> None:
        if self.graphs is not None:  # back to the methods
            del self.graphs.inputs.fill
            for graph in self.graphs._graphs.values():
                del graph.replay

    def summary(self) -> str:
        if not self.fill or not self.launch:
            return ""
        return (f"host: fill {statistics.median(self.fill) * 1e3:.3f} ms, launch "
                f"{statistics.median(self.launch) * 1e3:.3f} ms")


class ExpertCounter:
    """Counts, inside a `with`, the distinct routed experts each MoE layer's experts read per
    call (an eager step: a graph replay calls no Python), by wrapping every layer's routed
    experts: the experts of the rows the block passes as real (a step pads to MIN_ROWS rows;
    the padding rows read no expert)."""

    def __init__(self, model) -> None:
        self.experts = [m.experts for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.counts: list[int] = []

    def __enter__(self) -> "ExpertCounter":
        for module in self.experts:
            module.forward = self._counted(module.forward)
        return self

    def _counted(self, forward):
        def counted(x, weights, experts, real_rows=None):
            read = experts if real_rows is None else experts[real_rows]
            self.counts.append(torch.unique(read).numel())
            return forward(x, weights, experts, real_rows)
        return counted

    def __exit__(self, *exc) -> None:
        for module in self.experts:  # back to the method
            del module.forward

    def mean(self) -> float | None:
        """The mean distinct experts read per layer and call, or None."""
        if not self.counts:
            return None
        return statistics.mean(self.counts)


def count_experts(model, slots: list[int], context: int, blocks_per_seq: int,
                  device: torch.device = CUDA) -> float | None:
    """The mean distinct experts per MoE layer that one eager decode step of these rows (at
    `context`, writing its KV there) reads; None on a dense model. The graph's step pads the
    same way (cuda_graph.rows_of) and reads the same experts."""
    counter = ExpertCounter(model)
    if not counter.experts:
        return None
    chunks = next(decode_steps(slots, context, blocks_per_seq, 1))
    with counter, torch.no_grad():
        model.forward(ForwardBatch.build(chunks, BLOCK_SIZE, device))
    return counter.mean()


def add_row(case: str, batch, mode: str, step_s: float | None, device_s: float | None = None,
            floor_s: float | None = None, tokens: int | None = None, note: str = "") -> None:
    row = {"case": case, "batch": batch, "mode": mode, "step_ms": step_s and step_s * 1e3,
           "tok_s": step_s and (tokens if tokens is not None else batch) / step_s,
           "device_ms": device_s and device_s * 1e3, "floor_ms": floor_s and floor_s * 1e3,
           "note": note}
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_decode(model, graphs, floor: Floor, cases: list[str], args, blocks_per_seq,
                 batches: list[int] | None = None, label: str = "") -> None:
    for case in cases:
        for batch in batches or args.batches:
            slots = slots_for(case, batch, args.num_adapters)
            context_lens = [args.context + args.warmup + args.steps // 2] * batch
            floor_s = floor.decode_seconds(slots, context_lens)
            moe_note = ""
            if floor.config.num_experts:
                try:
                    counted = count_experts(model, slots, args.context, blocks_per_seq)
                except Exception as exc:  # the figure matters more than the count
                    traceback.print_exc()
                    counted = None
                    moe_note = f"experts not counted: {type(exc).__name__}"
                config = floor.config
                uniform = expected_experts(config.num_experts, config.num_experts_per_tok, batch)
                if counted is not None:
                    at_count = floor.decode_seconds(slots, context_lens, counted)
                    moe_note = (f"experts/layer {counted:.1f} read (uniform {uniform:.1f}), "
                                f"floor at that count {at_count * 1e3:.2f} ms")
            for mode in ["graph" if graphs else "eager"] + (
                    ["eager"] if graphs and batch in args.eager_batches
                    and case in ("base", "many") else []):
                try:
                    step_s, replay_s, host = time_decode(
                        model, graphs if mode == "graph" else None, slots, args, blocks_per_seq)
                    note = "; ".join(x for x in (host, moe_note) if x)
                    add_row(case + label, batch, mode, step_s, replay_s, floor_s, note=note)
                except Exception as exc:  # one failed figure must not cost the others
                    traceback.print_exc()
                    add_row(case + label, batch, mode, None,
                            note=f"failed: {type(exc).__name__}: {exc}")


def bench_prefill(model, case: str, args, flops: float, floor: Floor, label: str = "") -> None:
    """One eager prefill step per --prefill shape (SEQSxTOKENS, comma-separated)."""
    for shape in [x for x in args.prefill.split(",") if x]:
        num_seqs, length = (int(x) for x in shape.split("x"))
        slots = slots_for("many" if case == "many" else "base", num_seqs, args.num_adapters)
        gen = torch.Generator().manual_seed(2)
        per_seq = -(-length // BLOCK_SIZE)
        chunks = [(torch.randint(*PROMPT_ID_RANGE, (length,), generator=gen).tolist(), 0,
                   list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True, slot)
                  for i, slot in enumerate(slots)]
        try:
            seconds = time_cuda(lambda: eager_step(model, chunks, args), 3, warmup=1)
        except Exception as exc:
            traceback.print_exc()
            add_row(f"prefill {case}{label}", shape, "eager", None, note=f"failed: {exc}")
            continue
        floor_s = max(floor.prefill_flops(slots, length) / flops,
                      floor.decode_seconds(slots, [length] * num_seqs))
        add_row(f"prefill {case}{label}", shape, "eager", seconds, None, floor_s,
                tokens=num_seqs * length)


# --- transformers + peft ----------------------------------------------------------------------

HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
              "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")}


def hf_model(config_dir: str, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """transformers' model of the config's family (LlamaForCausalLM, Qwen2MoeForCausalLM) with
    random weights, built in `dtype` on `device` (no download, no fp32 copy on the host)."""
    import transformers

    model_type = ModelConfig.from_dir(config_dir).model_type
    config_name, model_name = HF_CLASSES[model_type]
    config = getattr(transformers, config_name).from_pretrained(config_dir)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return getattr(transformers, model_name)(config)
    finally:
        torch.set_default_dtype(saved)


def bench_transformers(config_dir: str, adapter_folder: Path, args) -> None:
    """`generate` of transformers' model of the family (random weights, bf16, CUDA) with four
    peft adapters: the base (adapters disabled) and a mixture of the four per row
    (adapter_names)."""
    from peft import PeftModel

    model = hf_model(config_dir, CUDA)
    model = PeftModel.from_pretrained(model, adapter_folder, adapter_name="a0")
    for i in range(1, 4):
        model.load_adapter(adapter_folder, adapter_name=f"a{i}")
    model.eval()
    gen = torch.Generator(device=CUDA).manual_seed(3)

    def generate(batch: int, names: list[str] | None, new_tokens: int) -> float:
        ids = torch.randint(*PROMPT_ID_RANGE, (batch, args.hf_prompt), device=CUDA, generator=gen)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if names is None:
            with model.disable_adapter():
                out = model.generate(**kwargs)
        else:
            out = model.generate(**kwargs, adapter_names=names)
        torch.cuda.synchronize()
        assert out.shape == (batch, args.hf_prompt + new_tokens), out.shape
        return time.perf_counter() - start

    moe = ModelConfig.from_dir(config_dir).num_experts > 0
    for case in ("base", "mixed-4"):
        for batch in args.hf_batches:
            names = None if case == "base" else [f"a{i % 4}" for i in range(batch)]
            if names and moe:  # seen on the H100 (peft 0.21): "got 32 and 4096 respectively"
                add_row(f"transformers+peft {case}", batch, "generate", None,
                        note="not run: peft checks adapter_names against a module input's first "
                             "dimension, and Qwen2-MoE's shared expert takes the flat tokens")
                continue
            try:
                generate(batch, names, 2)  # warm-up
                # Each the fastest of a few runs: transformers' own figure moves by a third from
                # run to run, and the ratio to it should not flatter lorad.
                first = min(generate(batch, names, 1)  # the prompt and one token
                            for _ in range(args.hf_repeats))
                total = min(generate(batch, names, 1 + args.hf_new_tokens)
                            for _ in range(args.hf_repeats))
                per_token = (total - first) / args.hf_new_tokens
                add_row(f"transformers+peft {case}", batch, "generate", per_token,
                        note=f"prompt {args.hf_prompt}: prefill + 1 token {first * 1e3:.0f} ms")
            except Exception as exc:
                traceback.print_exc()
                add_row(f"transformers+peft {case}", batch, "generate", None,
                        note=f"failed: {type(exc).__name__}: {exc}")


# --- the run ----------------------------------------------------------------------------------

def without_pdl(tuning: Tuning, no_pdl: bool) -> Tuning:
    """--no-pdl: `tuning` with PDL off in every step."""
    return replaced(tuning, "pdl.max_rows=0+pdl.max_rows_with_lora=0") if no_pdl else tuning


def tuning_variants(text: str) -> list[tuple[str, Tuning]]:
    """--variant's ';'-separated variants, each (its text, lorad's Tuning() with its settings)."""
    variants = []
    for variant in [v for v in text.split(";") if v]:
        try:
            variants.append((variant, replaced(Tuning(), variant)))
        except ValueError as exc:
            raise SystemExit(f"--variant: {exc}") from None
    return variants


@contextlib.contextmanager
def tuned(model: LlamaForCausalLM, tuning: Tuning):
    """The model's layers on `tuning` for the block, on the one they had after it."""
    saved = model.tuning
    model.tune(tuning)
    try:
        yield
    finally:
        model.tune(saved)


def bench_with(context, model, args, floor: Floor, cases: list[str], blocks_per_seq: int,
               batches: list[int], label: str) -> None:
    """Time `cases` at `batches` inside `context` (the model's tuning put back after it) with
    the graphs captured again."""
    gc.collect()
    torch.cuda.empty_cache()
    with context:
        graphs = capture(model, args, args.num_adapters)
        bench_decode(model, graphs, floor, cases, args, blocks_per_seq, batches=batches,
                     label=label)
        del graphs


def capture(model, args, num_adapters: int) -> DecodeGraphs | None:
    graphs = DecodeGraphs(model, max(args.batches), args.max_model_len, BLOCK_SIZE, num_adapters)
    try:
        graphs.capture()
    except Exception as exc:  # report, and time eagerly rather than not at all
        traceback.print_exc()
        add_row("graph capture", "-", "-", None, note=f"failed, eager instead: {exc}")
        return None
    return graphs


def table(conditions: list[str]) -> str:
    def num(value, digits=2) -> str:
        return "" if value is None else f"{value:,.{digits}f}"

    lines = ["## lorad engine benchmark", ""] + [f"- {c}" for c in conditions] + [
        "", "| case | batch | mode | step ms | tokens/s | device ms | floor ms | floor/time |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = r["device_ms"] or r["step_ms"]
        ratio = f"{r['floor_ms'] / measured:.0%}" if r["floor_ms"] and measured else ""
        lines.append(f"| {r['case']} | {r['batch']} | {r['mode']} | {num(r['step_ms'])} | "
                     f"{num(r['tok_s'], 0)} | {num(r['device_ms'])} | {num(r['floor_ms'])} | "
                     f"{ratio} |" + (f" {r['note']}" if r["note"] else ""))
    return "\n".join(lines)


def find(case: str, batch, mode: str = "graph") -> dict | None:
    return next((r for r in rows if r["case"] == case and r["batch"] == batch
                 and r["mode"] == mode and r["step_ms"]), None)


def targets(moe: bool = False) -> str:
    """The GPU issue's four targets (moe: issue 34's, moe_targets) against this run's rows; a
    target whose rows did not run says so."""
    if moe:
        return moe_targets()
    def verdict(value, goal, at_least: bool) -> str:
        return "met" if (value >= goal if at_least else value <= goal) else "not met"

    def device(r) -> float:
        return r["device_ms"] or r["step_ms"]

    lines = ["| target | goal | measured | verdict |", "|---|---|---|---|"]
    base1 = find("base", 1)
    if base1:
        share = base1["floor_ms"] / device(base1)
        lines.append(f"| batch-1 decode, floor / time | >= 80% | {share:.0%} "
                     f"({device(base1):.2f} vs {base1['floor_ms']:.2f} ms) | "
                     f"{verdict(share, 0.80, True)} |")
    base32, one32 = find("base", 32), find("one", 32)
    if base32 and one32:
        ratio = one32["tok_s"] / base32["tok_s"]
        # The verdict is the issue's, by tokens/s (the host's fill of the inputs included,
        # which moves between runs); the replays' ratio beside it is the GPU's part alone.
        replay = ""
        if one32["device_ms"] and base32["device_ms"]:
            replay = f"; by graph replay {base32['device_ms'] / one32['device_ms']:.3f}x"
        lines.append(f"| one adapter on every row, batch 32, vs base | >= 0.95x | {ratio:.2f}x "
                     f"({one32['tok_s']:,.0f} vs {base32['tok_s']:,.0f} tok/s{replay}) | "
                     f"{verdict(ratio, 0.95, True)} |")
    many64 = find("many", 64)
    if many64:
        ratio = device(many64) / many64["floor_ms"]
        lines.append(f"| 64 distinct adapters, batch 64, vs the floor with their LoRA bytes | "
                     f"<= 1.15x | {ratio:.2f}x ({device(many64):.2f} vs "
                     f"{many64['floor_ms']:.2f} ms) | {verdict(ratio, 1.15, False)} |")
    # The same mixture on both sides: rows cycling over 4 adapters.
    mixed32, peft32 = find("mixed4", 32), find("transformers+peft mixed-4", 32, "generate")
    if mixed32 and peft32:
        ratio = mixed32["tok_s"] / peft32["tok_s"]
        lines.append(f"| 4 adapters mixed, batch 32, vs transformers+peft mixed-4 | >= 30x | "
                     f"{ratio:.1f}x ({mixed32['tok_s']:,.0f} vs {peft32['tok_s']:,.0f} tok/s) | "
                     f"{verdict(ratio, 30, True)} |")
    if len(lines) == 2:
        return "no target's rows ran"
    return "\n".join(lines)


def moe_targets() -> str:
    """Issue 34's targets on the MoE shape: batch-1 decode >= 60% of its floor; batch 32 >= 20x
    transformers (base against base, mixed adapters against peft's mixture)."""
    lines = ["| target | goal | measured | verdict |", "|---|---|---|---|"]
    base1 = find("base", 1)
    if base1:
        measured = base1["device_ms"] or base1["step_ms"]
        share = base1["floor_ms"] / measured
        lines.append(f"| MoE batch-1 decode, floor / time | >= 60% | {share:.0%} "
                     f"({measured:.2f} vs {base1['floor_ms']:.2f} ms) | "
                     f"{'met' if share >= 0.60 else 'not met'} |")
    for ours, theirs in (("base", "transformers+peft base"),
                         ("mixed4", "transformers+peft mixed-4")):
        mine, hf = find(ours, 32), find(theirs, 32, "generate")
        if mine and hf:
            ratio = mine["tok_s"] / hf["tok_s"]
            lines.append(f"| MoE {ours}, batch 32, vs {theirs} | >= 20x | {ratio:.1f}x "
                         f"({mine['tok_s']:,.0f} vs {hf['tok_s']:,.0f} tok/s) | "
                         f"{'met' if ratio >= 20 else 'not met'} |")
    return "\n".join(lines) if len(lines) > 2 else "no target's rows ran"


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_engine.py needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.monotonic()
    props = torch.cuda.get_device_properties(CUDA)
    bandwidth, flops = measure_ceilings()
    print(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    config = ModelConfig.from_dir(args.config)
    cases = [c for c in args.cases.split(",") if c]
    shapes = [[int(x) for x in shape.split("x")] for shape in args.prefill.split(",") if shape]
    prefill_seqs = max((seqs for seqs, _ in shapes), default=0)
    prefill_len = max((length for _, length in shapes), default=0)
    max_batch = max(args.batches + args.eager_batches + [prefill_seqs])
    blocks_per_seq = -(-max(args.context + args.warmup + args.steps, prefill_len) // BLOCK_SIZE)
    if args.context + args.warmup + args.steps > args.max_model_len:
        print("--context plus the steps exceed --max-model-len", file=sys.stderr)
        return 2
    variants = tuning_variants(args.variant)
    model = build_lorad(config, max_batch, blocks_per_seq, without_pdl(Tuning(), args.no_pdl))
    if args.deterministic:  # before any graph captures the matmuls, as the engine does
        model.plan_matmuls(max(max_batch, prefill_seqs * prefill_len, MIN_ROWS))
    print(f"lorad model built ({time.monotonic() - started:.0f}s)", flush=True)
    mixed_rows = max(args.eager_batches + [prefill_seqs * prefill_len, MIN_ROWS])
    if "base" in cases:
        graphs = capture(model, args, 0)
        capture_mixed(model, args, 0, mixed_rows)
        bench_decode(model, graphs, Floor(model, bandwidth), ["base"], args, blocks_per_seq)
        del graphs
        if args.prefill:
            bench_prefill(model, "base", args, flops, Floor(model, bandwidth))
        args.mixed = None
        gc.collect()
        torch.cuda.empty_cache()
    tmp = tempfile.TemporaryDirectory(prefix="bench_engine")
    folder = write_adapter(Path(tmp.name) / "adapter", config, args.rank,
                           ADAPTER_DTYPES[args.adapter_dtype])
    adapter_cases = [c for c in cases if c != "base"]
    copy_ms = {}
    if adapter_cases:
        start = time.monotonic()
        tables, first = load_adapters(model, folder, args.num_adapters)
        print(f"{args.num_adapters} adapters loaded ({time.monotonic() - start:.0f}s)",
              flush=True)
        if args.json_out:
            copy_ms = time_adapter_copy(tables, first, 5, CUDA)
        del tables
        graphs = capture(model, args, args.num_adapters)
        capture_mixed(model, args, args.num_adapters, mixed_rows)
        floor = Floor(model, bandwidth)
        bench_decode(model, graphs, floor, adapter_cases, args, blocks_per_seq)
        if args.prefill and "many" in adapter_cases:
            bench_prefill(model, "many", args, flops, floor)
        del graphs
        graph_only = argparse.Namespace(**{**vars(args), "eager_batches": []})
        timed = [c for c in args.variant_cases.split(",") if c in adapter_cases]
        for variant, tuning in variants:
            tuning = without_pdl(tuning, args.no_pdl)
            bench_with(tuned(model, tuning), model, graph_only, floor, timed, blocks_per_seq,
                       args.variant_batches, f" ({variant})")
            if args.prefill and "many" in timed:
                with tuned(model, tuning):
                    bench_prefill(model, "many", args, flops, floor, label=f" ({variant})")
        del floor
    peak_gib = torch.cuda.max_memory_allocated(CUDA) / 2**30
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf_batches:
        bench_transformers(args.config, folder, args)
        gc.collect()  # its model went with the call
        torch.cuda.empty_cache()
    tmp.cleanup()
    pdl_config = Tuning().pdl
    pdl_text = "off" if args.no_pdl else (f"up to {pdl_config.max_rows} rows "
                                          f"({pdl_config.max_rows_with_lora} in steps with LoRA "
                                          "launches)")
    mixed_text = ("through the mixed-step graphs (--mixed-step-graphs)"
                  if args.mixed_step_graphs else "eager")
    lines = [
        f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB),"
        f" CUDA {torch.version.cuda}; {conditions()}",
        f"measured here: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul {flops / 1e12:.0f} TFLOP/s (8192^3, random data)",
        f"model {Path(args.config).name}: random weights, bf16, world size 1, matmul "
        f"{'plans (--deterministic)' if args.deterministic else 'cuBLAS at every row count'}, "
        f"graphs captured "
        f"for up to {max(args.batches)} sequences and --max-model-len {args.max_model_len}, "
        f"programmatic dependent launch {pdl_text}; rows of mode eager (prefill rows too) "
        f"{mixed_text}; "
        f"lorad peak memory {peak_gib:.1f} GiB",
        f"decode: {args.context} tokens of KV per sequence, {args.steps} timed steps after "
        f"{args.warmup}; step ms = inputs + forward + argmax to the host, as the worker runs "
        f"it, the median step; device ms = one graph replay, the median of as many; tokens/s = "
        f"batch / step",
        f"cases: base = no adapter loaded; idle = {args.num_adapters} adapters loaded, rows on "
        f"slot 0; one = adapter 1 on every row; mixed4 = row i on adapter 1 + i % 4; many = row "
        f"i on adapter 1 + i % {args.num_adapters}; (PATH=VALUE...) = a --variant of lorad's "
        f"Tuning; rank {args.rank} on {', '.join(adapter_modules(config))}, "
        f"factors stored and tabled as {args.adapter_dtype}",
        "floor = (weights + LoRA factors of the batch's slots + KV) bytes / copy bandwidth; "
        "prefill: the larger of that and matmul FLOPs / matmul rate; floor/time uses device ms "
        "where there is one" + ("; MoE: the routed experts a decode step reads are those "
        f"uniform routing touches in expectation, E(1 - (1 - k/E)^B) per layer (E "
        f"{config.num_experts}, k {config.num_experts_per_tok}: "
        f"{expected_experts(config.num_experts, config.num_experts_per_tok, 1):.0f} at batch 1,"
        f" {expected_experts(config.num_experts, config.num_experts_per_tok, 32):.1f} at 32); "
        "the note gives the count the router picked in one eager step and the floor at it"
        if config.num_experts else ""),
        f"transformers+peft: generate, prompt {args.hf_prompt}, step ms = (time of "
        f"{1 + args.hf_new_tokens} new tokens - time of 1) / {args.hf_new_tokens}, each time "
        f"the fastest of {args.hf_repeats} runs; mixed-4 = "
        f"adapter_names cycling over 4 adapters",
        f"whole run {time.monotonic() - started:.0f}s",
    ]
    text = table(lines) + "\n\nTargets of the GPU issue:\n\n" + targets(config.num_experts > 0)
    if args.table_out:
        Path(args.table_out).write_text(text + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(table_json(
            lines[0], Path(args.config).name, props.name, 1, args.context, prefill_len,
            table_steps(rows, args.num_adapters), copy_ms,
            tables=f"start adapters: {args.num_adapters} of rank {args.rank} on "
            f"{len(adapter_modules(config))} projections, {args.adapter_dtype}"), indent=1)
            + "\n")
    print("\n" + text)
    return 0 if all(r["step_ms"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
