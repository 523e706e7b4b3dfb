"""In-process model steps for tests: a tiny model with adapters at world size 1, and sequences
that prefill and then decode teacher-forced from their own KV blocks. Used by the CPU tests of the
decode-graph inputs and by the GPU tests (the same code on another device).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from lorad.config import ModelConfig
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers.batch import ForwardBatch
from lorad.workers.models import model_class
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel


def build_model(checkpoint, adapter_dirs: list, dtype: torch.dtype, device: torch.device,
                num_blocks: int, block_size: int) -> LlamaForCausalLM:
    """lorad's model (its family's, by config.json) at world size 1 with adapters in slots
    1..K (in list order) and a KV pool."""
    config = ModelConfig.from_dir(checkpoint)
    model = model_class(config)(config, TensorParallel(0, 1, device), dtype, device)
    model.load_weights(checkpoint)
    model.load_adapters(tuple(load_adapter(AdapterArg(f"a{slot}", str(path)), slot, config)
                              for slot, path in enumerate(adapter_dirs, start=1)))
    model.allocate_kv_cache(num_blocks, block_size)
    return model


@dataclass
class Stream:
    """One sequence: its tokens so far, adapter slot and KV blocks."""

    tokens: list[int]
    slot: int
    blocks: list[int]  # enough for the longest the stream gets
    block_size: int
    num_cached: int = 0  # tokens whose K/V are in the cache
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] row per sampled step
    # The prompt's length, carried in every chunk (ForwardBatch.build's 7th field: which tokens
    # are prompt tokens); None: chunks of five fields, their kind told by their shape.
    prompt_len: int | None = None
    # The request's adapter strength, carried in every chunk (the 6th field); None: no field
    # (1.0), unless prompt_len asks for one.
    strength: float | None = None

    def prefill_chunk(self, num_tokens: int | None = None):
        """The next prompt chunk (all uncached tokens by default), sampling its last row."""
        end = len(self.tokens) if num_tokens is None else self.num_cached + num_tokens
        chunk = (self.tokens[self.num_cached:end], self.num_cached, self.table(end),
                 end == len(self.tokens), self.slot)
        self.num_cached = end
        return self._with_kind(chunk)

    def decode_chunk(self, token: int):
        """Append `token` and run it."""
        self.tokens.append(token)
        chunk = ([token], self.num_cached, self.table(self.num_cached + 1), True, self.slot)
        self.num_cached += 1
        return self._with_kind(chunk)

    def _with_kind(self, chunk: tuple) -> tuple:
        strength = 1.0 if self.strength is None else self.strength
        if self.prompt_len is not None:
            return (*chunk, strength, self.prompt_len)
        return chunk if self.strength is None else (*chunk, strength)

    def table(self, num_tokens: int) -> list[int]:
        """The blocks holding positions 0..num_tokens-1, as the planner hands them out."""
        block_size = self.block_size
        return self.blocks[:-(-num_tokens // block_size)]


def prefill_rows(model, stream: Stream, sizes: list, block_size: int,
                 device: torch.device | str = "cpu", neighbour: Stream | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill the stream's prompt in chunks of `sizes` (None: the rest), each beside a decode
    of `neighbour` (token 11) when given -> (the last position's logits, [prompt positions,
    hidden] every position's final hidden state)."""
    logits, hidden = None, []
    for size in sizes:
        start = stream.num_cached
        chunk = stream.prefill_chunk(size)
        chunks = [chunk] if neighbour is None else [neighbour.decode_chunk(11), chunk]
        first = len(chunks) - 1  # the chunk's rows follow the neighbour's one row
        rows = torch.arange(first, first + stream.num_cached - start, device=device)
        out, chunk_hidden = model.forward(ForwardBatch.build(chunks, block_size, device),
                                          hidden_rows=rows)
        hidden.append(chunk_hidden)
        if chunk[3]:
            logits = out[-1]
    return logits, torch.cat(hidden)


def kv_of(model, blocks: list[int], length: int) -> list[torch.Tensor]:
    """Every layer's K and V of positions 0..length-1 held in `blocks`."""
    kv = []
    for layer in model.model.layers:
        cache = layer.self_attn.kv_cache
        kv += [cache.k[blocks].flatten(0, 1)[:length].clone(),
               cache.v[blocks].flatten(0, 1)[:length].clone()]
    return kv


def make_streams(slots: list[int], prompt_lens: list[int], max_len: int, block_size: int,
                 num_blocks: int, seed: int = 0, vocab: tuple[int, int] = (3, 384),
                 strengths: list[float | None] | None = None) -> list[Stream]:
    """Streams with random prompts, each owning enough shuffled blocks for max_len tokens.
    Blocks 0 and num_blocks - 1 are never handed out, so a stray write through KV slot 0 or -1
    (padding) lands where no stream reads. strengths: each stream's Stream.strength (None:
    none carries one)."""
    rng = random.Random(seed)
    pool = list(range(1, num_blocks - 1))
    rng.shuffle(pool)
    per_stream = -(-max_len // block_size)
    if per_stream * len(slots) > len(pool):
        raise ValueError("not enough KV blocks for the streams")
    strengths = strengths or [None] * len(slots)
    return [Stream([rng.randrange(*vocab) for _ in range(n)], slot,
                   pool[i * per_stream:(i + 1) * per_stream], block_size, strength=strength)
            for i, (slot, n, strength) in enumerate(zip(slots, prompt_lens, strengths))]


def scenario_steps(streams) -> list[list]:
    """Runner steps: chunked prompts, a mixed step, then decodes (teacher-forced)."""
    s0, s1, s2, s3 = streams
    steps = [[s0.prefill_chunk(5), s1.prefill_chunk()], [s0.prefill_chunk(), s2.prefill_chunk()]]
    steps.append([s0.decode_chunk(11), s1.decode_chunk(12), s3.prefill_chunk()])
    for i in range(4):
        steps.append([s.decode_chunk(20 + i) for s in (s3, s2, s1, s0)])
    return [[list(chunk) for chunk in step] for step in steps]


def runner_scenarios(scenarios: dict, seqs: dict, block_size: int, num_blocks: int
                     ) -> tuple[dict, dict]:
    """tp_runner steps from schedules: scenario -> steps, each a list of (sequence, slot,
    num_tokens) or (sequence, slot, strength, num_tokens) entries that run the sequence's next
    num_tokens of `seqs[sequence]` (strength None or absent: no strength in the chunk). Each
    scenario reuses the pool from scratch, in its own shuffled block order. -> (runner steps per
    scenario, per step the (slot, strength, sequence, position) of each sampled row, strength
    1.0 where the chunk carries none)."""
    steps_of, expected_of = {}, {}
    for n, (scenario, schedule) in enumerate(scenarios.items()):
        blocks = list(range(num_blocks))
        random.Random(n).shuffle(blocks)
        tables, progress = {}, {}
        steps, expected = [], []
        for step in schedule:
            chunks, rows = [], []
            for entry in step:
                seq, slot, num = entry[0], entry[1], entry[-1]
                strength = entry[2] if len(entry) == 4 else None
                if seq not in tables:
                    count = -(-len(seqs[seq]) // block_size)
                    tables[seq], blocks = blocks[:count], blocks[count:]
                    progress[seq] = 0
                start = progress[seq]
                chunk = [seqs[seq][start:start + num], start, tables[seq], True, slot]
                chunks.append(chunk if strength is None else chunk + [strength])
                rows.append((slot, 1.0 if strength is None else strength, seq, start + num - 1))
                progress[seq] = start + num
            steps.append(chunks)
            expected.append(rows)
        assert all(progress[s] <= len(seqs[s]) for s in progress), scenario
        steps_of[scenario], expected_of[scenario] = steps, expected
    return steps_of, expected_of


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in fp32."""
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def reference_logits(checkpoint, adapters: list, streams: list[Stream],
                     device: torch.device) -> list[torch.Tensor]:
    """Each stream's full sequence through transformers (its family's class, by config.json)
    with its peft adapter (slot k: adapters[k - 1]; slot 0 none), fp32 on `device`:
    -> per stream [num_tokens, vocab]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device)
    model = PeftModel.from_pretrained(base.eval(), adapters[0], adapter_name="a1")
    for slot, path in enumerate(adapters[1:], start=2):
        model.load_adapter(path, adapter_name=f"a{slot}")
    model.eval()
    out = []
    with torch.no_grad():
        for stream in streams:
            ids = torch.tensor([stream.tokens], device=device)
            if stream.slot == 0:
                with model.disable_adapter():
                    out.append(model(ids).logits[0].float())
            else:
                model.set_adapter(f"a{stream.slot}")
                out.append(model(ids).logits[0].float())
    return out


def graph_scenario(model: LlamaForCausalLM, graphs, streams: list[Stream],
                   block_size: int) -> list[tuple[list, torch.Tensor, bool]]:
    """Five streams: chunked prompts, a late arrival in a mixed step, then decodes of several
    mixtures through `graphs` (a captured cuda_graph.DecodeGraphs; steps it cannot run go
    eagerly). -> per step (sampled (stream index, position) pairs, logits, through a graph)."""
    from lorad.workers.batch import ForwardBatch
    gen = torch.Generator().manual_seed(8)
    s0, s1, s2, s3, s4 = streams
    index = {id(s): i for i, s in enumerate(streams)}
    records = []

    def run(pairs):
        chunks = [chunk for _, chunk in pairs]
        in_graph = graphs.can_run(chunks)
        if in_graph:
            logits = graphs.run(chunks)
        else:
            logits = model.forward(ForwardBatch.build(chunks, block_size, model.device))
        sampled = [(index[id(s)], s.num_cached - 1) for s, chunk in pairs if chunk[3]]
        records.append((sampled, logits.float(), in_graph))

    def decode(live):
        return [(s, s.decode_chunk(int(torch.randint(3, 384, (), generator=gen)))) for s in live]

    run([(s0, s0.prefill_chunk()), (s1, s1.prefill_chunk(6)), (s2, s2.prefill_chunk())])
    run([(s1, s1.prefill_chunk()), (s3, s3.prefill_chunk())])
    run(decode((s0, s1, s2, s3)) + [(s4, s4.prefill_chunk())])
    for live in ((s0, s1, s2, s3, s4), (s4, s2, s0), (s3,), (s1, s2, s3, s4, s0), (s2, s4)):
        run(decode(live))
    return records


def check_scenario_against_reference(model: LlamaForCausalLM, graphs, checkpoint, adapters: list,
                                     streams: list[Stream], block_size: int,
                                     device: torch.device, tol: float,
                                     adapter_moves: float) -> None:
    """graph_scenario's steps (five of them through the captured graphs) against transformers
    + peft: each step's logits within `tol` (max |got - want| / max |want|) of the reference;
    and each adapter stream's reference more than `adapter_moves` from the base model's, so
    that a row given the wrong slot could not pass."""
    records = graph_scenario(model, graphs, streams, block_size)
    reference = reference_logits(checkpoint, adapters, streams, device)
    for i, (sampled, logits, _) in enumerate(records):
        expected = torch.stack([reference[stream][pos] for stream, pos in sampled])
        assert rel_error(logits, expected) < tol, (i, rel_error(logits, expected))
    assert sum(in_graph for *_, in_graph in records) == 5
    base = reference_logits(checkpoint, adapters,
                            [Stream(s.tokens, 0, s.blocks, s.block_size) for s in streams], device)
    for stream, ref, ref_base in zip(streams, reference, base):
        if stream.slot:
            assert rel_error(ref, ref_base) > adapter_moves, stream.slot
