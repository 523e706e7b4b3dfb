"""CUDA graphs of steps with prompt chunks (prefill and mixed steps, drafted ones too), captured in
pieces between the layers' attention.

Such a step's attention depends on host-side facts of the step (which sequences have prompt
tokens, how long their chunks are: the prefill kernel's grid; which rows are generated tokens:
the decode kernel's), so it runs eagerly between the pieces, as vLLM's piecewise graphs do; every
other kernel of the step (the projections and their LoRA kernels, norms, rotary with the KV
write, the MLP) replays. Eagerly such a step is bound by the host queueing its ~17 launches a
layer (an 8B prompt chunk of 512 rows on an H100: 15.5 ms of host for 12 ms of kernels without
adapters, 86 ms for 16 with: docs/performance-log.md: mixed-step graphs).

A step of N rows replays the graphs of the smallest row bucket that holds N: its rows are
copied into static buffers, padded (token 0, KV slot -1 so nothing is written, adapter slot 0),
and the LoRA kernels' row tiles are a static input too (cuda_graph._TileBuffers), so one graph
serves any mixture of adapters; with adapters loaded each bucket has a graph without LoRA work
for steps whose rows are all on the base model. The pieces end at the final norm; the LM head
runs eagerly on the step's sampled rows, as the eager step runs it. A row's bits are those of
the eager step: the same kernels at the bucket's row count, whose arithmetic per row does not
depend on the row count (matmul plans, the LoRA kernels' fixed orders, row-wise kernels).

Only where the collectives are captured too (one rank, or NCCL); over gloo the decode graphs'
segments (cuda_graph.SegmentedGraph) would hold a step's activations per collective.
"""

from __future__ import annotations

import logging
import time

import torch

from lorad.workers.attention import AttentionContext
from lorad.workers.batch import MIN_ROWS, ForwardBatch
from lorad.workers.cuda_graph import NUM_WARMUP, ROW_FIELDS, Chunk, SegmentedGraph, _TileBuffers

log = logging.getLogger("lorad.worker")

LARGE_BUCKET_STEP = 64  # row buckets past 64 rows, every this many rows


def row_buckets(max_rows: int) -> list[int]:
    """Row counts the graphs are captured for: MIN_ROWS doubling to 64, then every
    LARGE_BUCKET_STEP rows, then max_rows (every step of at most max_rows rows fits one)."""
    sizes, size = [], MIN_ROWS
    while size < min(max_rows, LARGE_BUCKET_STEP):
        sizes.append(size)
        size *= 2
    size = LARGE_BUCKET_STEP
    while size < max_rows:
        sizes.append(size)
        size += LARGE_BUCKET_STEP
    return sizes + [max_rows]


class PieceGraph(SegmentedGraph):
    """One step as CUDA graphs that end at each layer's attention, which runs eagerly between
    their replays with the step's own attention context (`live`, set before each replay). The
    attention writes into one static tensor that every layer and bucket shares: graphs never
    replay at once, and a layer's output is read by the next piece before the next layer's
    attention writes it."""

    def __init__(self, pool, attn_out: torch.Tensor) -> None:
        super().__init__(pool)
        self._attn_out = attn_out  # [max_rows, q_heads * head_dim] of the model dtype
        self.live: AttentionContext | None = None  # the replayed step's attention context

    def attention(self, layer, q: torch.Tensor) -> torch.Tensor:
        """Called by a layer's RotaryAttention during the capture, its K/V written: ends the
        piece; -> the static tensor its attention output is in after each replay."""
        from lorad.workers.attention_cuda import attend_cuda  # the CPU never imports triton
        self.end()
        out = self._attn_out[:q.shape[0]]
        self._parts.append(lambda: attend_cuda(q, layer.kv_cache, self.live, layer.scale,
                                               layer.decode, out=out))
        self.begin()
        return out


class MixedInputs:
    """The static row tensors every bucket's graphs read (views of their first rows), and the
    LoRA row tiles with their pinned staging."""

    def __init__(self, max_rows: int, device: torch.device, lora_block_m: int = 0) -> None:
        self.device = device
        # [4, max_rows] int64, one row per ROW_FIELDS entry
        self.rows = torch.zeros(len(ROW_FIELDS), max_rows, dtype=torch.int64, device=device)
        self.rows[2] = -1  # padding: no KV written
        self.strengths = torch.ones(max_rows, dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        self._tiles = _TileBuffers(max_rows, lora_block_m, device, pin) if lora_block_m else None
        self._copied: torch.cuda.Event | None = None  # after the last tile copy

    def batch(self, bucket: int, like: ForwardBatch) -> ForwardBatch:
        """Bucket `bucket`'s view of the buffers, with `like`'s sequences and per-sequence facts
        (which only eager code reads: the attention context is built from them)."""
        ids, positions, slots, adapters = (self.rows[i, :bucket] for i in range(len(ROW_FIELDS)))
        tiles = None if self._tiles is None else self._tiles.views(bucket)
        return ForwardBatch(ids, positions, slots, adapters, like.seqs, like.sample_rows,
                            like.num_tokens, like.block_tables, like.context_lens,
                            like.query_starts, tiles, self.strengths[:bucket])

    def fill(self, live: ForwardBatch, with_lora: bool) -> None:
        """Copy a step built with `bucket` rows (ForwardBatch.build's padding) into the buffers,
        and its LoRA row tiles when its rows have adapters."""
        bucket = live.input_ids.shape[0]
        for i, name in enumerate(ROW_FIELDS):
            self.rows[i, :bucket].copy_(getattr(live, name))
        if live.row_strengths is None:
            self.strengths[:bucket].fill_(1.0)
        else:
            self.strengths[:bucket].copy_(live.row_strengths)
        if with_lora and self._tiles is not None:
            if self._copied is not None:
                self._copied.synchronize()  # the staging is free once that copy ran
            slots = [0] * bucket
            for chunk in live.seqs:
                slots[chunk.token_start:chunk.token_start + chunk.num_tokens] = (
                    [chunk.adapter_slot] * chunk.num_tokens)
            self._tiles.fill(slots)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()


class MixedGraphs:
    """Steps with prompt chunks of `model` through per-bucket piecewise CUDA graphs (after
    `capture()`)."""

    def __init__(self, model, max_rows: int, block_size: int, num_adapters: int) -> None:
        self.model = model
        self.block_size = block_size
        self.buckets = row_buckets(max(max_rows, MIN_ROWS))
        self.num_adapters = num_adapters
        self.inputs = MixedInputs(self.buckets[-1], model.device,
                                  model.tuning.tiles.block_m if num_adapters else 0)
        config = model.config
        width = config.num_attention_heads // model.tp.world_size * config.head_dim
        self._attn_out = torch.zeros(self.buckets[-1], width, dtype=model.dtype,
                                     device=model.device)
        # (bucket, with_lora) -> its graph, and the static [bucket, hidden] normed rows
        self._graphs: dict[tuple[int, bool], PieceGraph] = {}
        self._normed: dict[tuple[int, bool], torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def can_run(self, chunks: list[Chunk]) -> bool:
        """Whether a step fits a bucket (the engine gives decode steps to the decode graphs
        first)."""
        return bool(chunks) and sum(len(chunk[0]) for chunk in chunks) <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """-> [num_sampled, vocab] float32 logits of the step (see can_run), as model.forward
        gives them."""
        bucket = self.bucket_for(sum(len(chunk[0]) for chunk in chunks))
        live = ForwardBatch.build(chunks, self.block_size, self.model.device, min_rows=bucket)
        with_lora = self.num_adapters > 0 and any(chunk[4] != 0 for chunk in chunks)
        key = (bucket, with_lora)
        graph = self._graphs.get(key)
        if graph is None:  # not captured (tests on the CPU): the same padded step, eagerly
            return self.model.forward(live)
        self.inputs.fill(live, with_lora)
        graph.live = AttentionContext.build(live, self.block_size)
        try:
            graph.replay()
        finally:
            graph.live = None
        return self.model.lm_head(self._normed[key][live.sample_rows])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graphs, largest first, into one memory pool."""
        model = self.model
        if model.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        start = time.monotonic()
        free_before, _ = torch.cuda.mem_get_info(model.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=model.device)
        variants = (True, False) if self.num_adapters else (False,)
        attention = [layer.self_attn.attn for layer in model.model.layers]
        for bucket, with_lora in ((b, v) for b in reversed(self.buckets) for v in variants):
            batch = self._capture_batch(bucket, with_lora)
            ctx = AttentionContext.build(batch, self.block_size)  # outside the capture
            graph = PieceGraph(pool, self._attn_out)
            try:
                # Warm-up runs on the capture stream (kernels compile, workspaces exist); the
                # buffers hold padding, so they write no KV.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(NUM_WARMUP):
                        model.final_hidden(batch, with_lora, ctx)
                    for attn in attention:
                        attn.breaker = graph
                    graph.begin()
                    try:
                        normed = model.final_hidden(batch, with_lora, ctx)
                    finally:
                        graph.end()  # never leave the stream capturing, even after a failure
                        for attn in attention:
                            attn.breaker = None
                torch.cuda.current_stream().wait_stream(stream)
            except RuntimeError as exc:
                raise RuntimeError(f"capturing the CUDA graphs of steps of {bucket} rows with "
                                   f"prompt chunks failed ({exc}); --no-mixed-step-graphs runs "
                                   "them eagerly") from exc
            self._graphs[bucket, with_lora] = graph
            self._normed[bucket, with_lora] = normed
        torch.cuda.synchronize(model.device)
        free_after, _ = torch.cuda.mem_get_info(model.device)
        log.info("captured CUDA graphs of steps with prompt chunks for %s rows, in pieces "
                 "between the layers' attention, in %.1fs (%.0f MiB)", self.buckets,
                 time.monotonic() - start, (free_before - free_after) / 2**20)

    def _capture_batch(self, bucket: int, with_lora: bool) -> ForwardBatch:
        """What a captured step looks like to the code that reads Python metadata: one prompt
        chunk over the bucket's rows (KV slots -1: nothing written), on adapter 1 for the LoRA
        graph (the kernels read the actual slots and tiles from the static tensors)."""
        slot = 1 if with_lora else 0
        chunk = ([0] * bucket, 0, [0] * -(-bucket // self.block_size), True, slot)
        like = ForwardBatch.build([chunk], self.block_size, self.model.device, min_rows=bucket)
        return self.inputs.batch(bucket, like)
