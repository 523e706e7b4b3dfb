"""CUDA graphs of decode steps: one per batch-size bucket, captured at start over static inputs.

A decode step (every sequence runs one token and samples it) of at most the largest bucket's
sequences replays the graph of the smallest bucket that holds it. The step's inputs are copied
into static buffers; the bucket's spare sequences and rows are padding (token 0, KV slot -1 so
nothing is written, adapter slot 0, context length 0) and their logits are dropped. Each row's
adapter slot is an input, and so are the LoRA kernels' row tiles, built on the host, so one
graph serves any mixture of adapters. Prefill and mixed steps always run eagerly.

With several ranks over NCCL the collectives are captured inside the graph. Over gloo they cannot be
(gloo reduces host memory), so the step is captured in segments that end at each collective
(SegmentedGraph): a replay runs segment, collective, segment... on the same stream. Without a
capture (the CPU, tests) `run` executes the same padded step eagerly.

With adapters loaded, each bucket has two graphs: one that launches the LoRA kernels for any
mixture of slots, and one for steps whose rows are all on the base model, which launches no LoRA
work at all (a slot-0 row gets the same bits from either: the kernels never touch it).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from lorad.workers.batch import MIN_ROWS, ForwardBatch, SeqChunk, kv_slot
from lorad.workers.kernels.lora_tiles import host_tiles

log = logging.getLogger("lorad.worker")

NUM_WARMUP = 2  # eager runs per bucket before its capture: Triton compiles, cuBLAS workspaces
ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "row_adapter_slots")
# (new_token_ids, start_position, block_table, wants_sample, adapter_slot[, adapter_strength[,
# prompt_len]]): StepPlan.batch_chunks (strength 1.0 when absent; prompt_len: ForwardBatch.build)
Chunk = tuple


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs: every decode batch fits one."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def rows_of(bucket: int) -> int:
    """Rows a bucket's graph runs: one per sequence, padded to MIN_ROWS as every batch is."""
    return max(bucket, MIN_ROWS)


def is_decode_step(chunks: list[Chunk]) -> bool:
    """Every chunk is one generated token that samples (batch.num_prompt_rows 0, inlined: the
    check runs on every step): the only step shape graphs capture. A prompt's last token alone
    is not one: on the GPU it keeps the prompt's attention arithmetic (attention_cuda.py)."""
    return bool(chunks) and all(
        len(chunk[0]) == 1 and chunk[3] and (len(chunk) < 7 or chunk[6] is None
                                             or chunk[1] >= chunk[6])
        for chunk in chunks)


class DecodeInputs:
    """The static tensors every bucket's graph reads, and the host buffers they are filled from.

    Buffers are sized for the largest bucket; bucket B's batch views their first B sequences and
    rows_of(B) rows, so every graph reads the same memory. With lora_block_m, they also hold the
    LoRA kernels' row tiles of that many rows (lora_tiles.host_tiles), written when a step's
    adapters differ from the last step's that had any, so the graphs build none on the
    device."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, lora_block_m: int = 0) -> None:
        self.block_size = block_size
        self.device = device
        num_rows = rows_of(max_seqs)
        # [4, num_rows] int64, one row per ROW_FIELDS entry: a single copy fills them all
        self.rows = torch.zeros(len(ROW_FIELDS), num_rows, dtype=torch.int64, device=device)
        # [num_rows] float32: each row's adapter strength (ForwardBatch.row_strengths), 1.0 pads
        self.strengths = torch.ones(num_rows, dtype=torch.float32, device=device)
        self.context_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)  # [max_seqs]
        # [max_seqs, max_blocks_per_seq]
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        # A decode step gives sequence i row i, and samples every row, whatever the batch.
        self.query_starts = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.sample_rows = torch.arange(max_seqs, dtype=torch.int64, device=device)
        # Pinned staging, so the copies to the device do not wait for the step before; filled
        # through numpy views of the same memory (a torch op per field costs microseconds each,
        # and the GPU waits for the whole fill).
        pin = device.type == "cuda"
        self._host_rows = torch.zeros(self.rows.shape, dtype=torch.int64, pin_memory=pin)
        self._host_strengths = torch.ones(num_rows, dtype=torch.float32, pin_memory=pin)
        self._strengths_np = self._host_strengths.numpy()
        self._host_context_lens = torch.zeros(max_seqs, dtype=torch.int32, pin_memory=pin)
        self._host_block_tables = torch.zeros(self.block_tables.shape, dtype=torch.int32,
                                              pin_memory=pin)
        self._rows_np = self._host_rows.numpy()
        self._context_lens_np = self._host_context_lens.numpy()
        self._block_tables_np = self._host_block_tables.numpy()
        # What each staging row of the block tables holds, so that an unchanged table (a decode
        # sequence's grows by one block every block_size steps) is not written again.
        self._tables: list[list[int] | None] = [None] * max_seqs
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's copies
        self._tiles = _TileBuffers(num_rows, lora_block_m, device, pin) if lora_block_m else None

    def batch(self, bucket: int, seqs: list[SeqChunk]) -> ForwardBatch:
        """Bucket `bucket`'s view of the buffers; `seqs` describe them to eager code only."""
        num_rows = rows_of(bucket)
        ids, positions, slots, adapters = (self.rows[i, :num_rows] for i in range(len(ROW_FIELDS)))
        tiles = None if self._tiles is None else self._tiles.views(num_rows)
        return ForwardBatch(ids, positions, slots, adapters, seqs, self.sample_rows[:bucket],
                            bucket, self.block_tables[:bucket], self.context_lens[:bucket],
                            self.query_starts[:bucket + 1], tiles, self.strengths[:num_rows])

    def fill(self, chunks: list[Chunk], bucket: int,
             token_source: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """Copy a decode step (see is_decode_step) into bucket `bucket`'s part of the buffers,
        padding the rest: row i is chunk i's token, the rows past them pad (token 0, KV slot -1,
        adapter slot 0), and the sequences past them have context length 0. token_source:
        (sampled [n] int64 on the device, rows): row i's token is sampled[rows[i]] instead,
        gathered on the device after the step that samples them (a continuation's, whose
        chunks' tokens are not known yet: planner.continue_decodes)."""
        num_seqs, num_rows, block_size = len(chunks), rows_of(bucket), self.block_size
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free once that copy ran
        positions, kv_slots, adapters, strengths = [], [], [], []
        ids = [] if token_source is None else token_source[1]  # the rows, gathered below
        for chunk in chunks:
            (token,), pos, table, _, adapter = chunk[:5]
            if token_source is None:
                ids.append(token)
            positions.append(pos)
            kv_slots.append(kv_slot(table, pos, block_size))
            adapters.append(adapter)
            strengths.append(chunk[5] if len(chunk) > 5 else 1.0)
        rows = self._rows_np
        for i, values in enumerate((ids, positions, kv_slots, adapters)):  # ROW_FIELDS' order
            rows[i, :num_seqs] = values
        rows[:, num_seqs:num_rows] = 0
        rows[2, num_seqs:num_rows] = -1  # padding rows write no KV
        self._strengths_np[:num_seqs] = strengths
        self._strengths_np[num_seqs:num_rows] = 1.0
        context_lens = self._context_lens_np
        context_lens[:num_seqs] = positions
        context_lens[:num_seqs] += 1
        context_lens[num_seqs:bucket] = 0
        # Columns past a sequence's own blocks keep older ids: they are never read, since the
        # context length bounds what attention reads, and any id there is a valid block.
        tables, written = self._block_tables_np, self._tables
        for i, chunk in enumerate(chunks):
            table = chunk[2]
            if written[i] != table:
                tables[i, :len(table)] = table
                written[i] = list(table)  # a copy: the caller may grow its list in place
        for i in range(num_seqs, bucket):
            if written[i] != []:
                tables[i] = 0
                written[i] = []
        self.rows.copy_(self._host_rows, non_blocking=True)
        if token_source is not None:
            ids = self.rows[0, :num_seqs]
            ids.copy_(token_source[0].index_select(0, ids))
        self.strengths.copy_(self._host_strengths, non_blocking=True)
        self.context_lens[:bucket].copy_(self._host_context_lens[:bucket], non_blocking=True)
        self.block_tables[:bucket].copy_(self._host_block_tables[:bucket], non_blocking=True)
        if self._tiles is not None and any(adapters):  # only the LoRA graphs read the tiles
            self._tiles.fill(adapters)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def seqs(self, chunks: list[Chunk], bucket: int) -> list[SeqChunk]:
        """The sequences fill() wrote, for eager code (never on a graph's path): the step's, as
        ForwardBatch.build describes them, then one padding sequence per spare slot."""
        step = ForwardBatch.build(chunks, self.block_size, "cpu", min_rows=rows_of(bucket))
        return step.seqs + [SeqChunk(i, 1, 0, [], 0) for i in range(len(chunks), bucket)]


class _TileBuffers:
    """DecodeInputs' LoRA row tiles: [tile_slot | tile_rows | num_tiles] in one int64 buffer of
    the largest bucket's rows (each part at a 128-byte offset, so a bucket's views have the
    same alignment whatever its size, and triton one compiled variant), and its pinned staging.
    Entries past a step's tiles hold slot 0 and empty lanes, so every bucket's view is whole."""

    ALIGN = 16  # int64 entries: 128 bytes

    def __init__(self, num_rows: int, block_m: int, device: torch.device, pin: bool) -> None:
        self.num_rows, self.block_m = num_rows, block_m
        self._rows_at = _aligned(num_rows, self.ALIGN)
        self._count_at = self._rows_at + _aligned(num_rows * block_m, self.ALIGN)
        size = self._count_at + 1
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._np = self._host.numpy()
        self._np[self._rows_at:self._count_at] = -1  # no tiles yet: every lane empty
        self.device_buffer = self._host.to(device, copy=True)
        self._adapters: list[int] | None = None  # whose tiles the buffers hold

    def views(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tile_slot [num_rows], tile_rows [num_rows, block_m], num_tiles [1]) on the device."""
        buf = self.device_buffer
        tile_rows = buf[self._rows_at:self._rows_at + self.num_rows * self.block_m]
        return (buf[:num_rows], tile_rows.view(self.num_rows, self.block_m)[:num_rows],
                buf[self._count_at:self._count_at + 1])

    def fill(self, adapters: list[int]) -> None:
        """The tiles of a decode step whose row i has adapter slot adapters[i] (rows past them
        slot 0), copied to the device after the step's other inputs (the caller synchronized
        on the last step's copies); nothing when the last one had the same slots."""
        if adapters == self._adapters:
            return
        row_slots = np.zeros(self.num_rows, dtype=np.int64)
        row_slots[:len(adapters)] = adapters
        tile_slot, tile_rows, num_tiles = host_tiles(row_slots, self.block_m)
        rows_at = self._rows_at
        self._np[:self.num_rows] = tile_slot
        self._np[rows_at:rows_at + tile_rows.size] = tile_rows.reshape(-1)
        self._np[self._count_at] = num_tiles
        self.device_buffer.copy_(self._host, non_blocking=True)
        self._adapters = list(adapters)


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


class SegmentedGraph:
    """One step as CUDA graphs that end at each collective, the collectives run eagerly between
    their replays. Captured by running the step once with `tp.segmenter` set to this object:
    the model's collectives call `collective`, which closes the current segment, and reopen the
    next. All segments share one memory pool and replay in capture order, so a tensor a segment
    leaves for a later one (the collective's input, held by its closure) stays where it was."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self._parts: list = []  # CUDAGraph segments and collective callables, in order
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)

    def end(self) -> None:
        assert self._graph is not None
        graph, self._graph = self._graph, None
        graph.capture_end()
        self._parts.append(graph)

    def collective(self, run) -> torch.Tensor:
        """Called by TensorParallel in place of a collective during the capture: -> the static
        tensor that holds run()'s result after each replay of the segment before it."""
        self.end()
        # Once now, eagerly, on whatever the buffers hold (every rank captures the same
        # collectives in the same order): it gives the output its memory, outside the pool.
        out = run()
        self._parts.append(lambda: out.copy_(run()))
        self.begin()
        return out

    @property
    def num_segments(self) -> int:
        return sum(isinstance(part, torch.cuda.CUDAGraph) for part in self._parts)

    def replay(self) -> None:
        for part in self._parts:
            if isinstance(part, torch.cuda.CUDAGraph):
                part.replay()
            else:
                part()


class DecodeGraphs:
    """Decode steps of `model` through per-bucket CUDA graphs (after `capture()`)."""

    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int,
                 num_adapters: int, segmented: bool = False) -> None:
        """segmented: capture each step as a SegmentedGraph (collectives outside the graphs)."""
        self.model = model
        self.segmented = segmented
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.num_adapters = num_adapters
        self.inputs = DecodeInputs(max_num_seqs, self.max_blocks_per_seq, block_size,
                                   model.device,
                                   model.tuning.tiles.block_m if num_adapters else 0)
        # (bucket, with_lora) -> its graph, and the static [bucket, vocab] fp32 logits it writes
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph | SegmentedGraph] = {}
        self._logits: dict[tuple[int, bool], torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def graph_for(self, num_seqs: int,
                  with_lora: bool) -> torch.cuda.CUDAGraph | SegmentedGraph | None:
        """The captured graph a step of num_seqs sequences replays (benchmarks time it)."""
        return self._graphs.get((self.bucket_for(num_seqs), with_lora and self.num_adapters > 0))

    def can_run(self, chunks: list[Chunk]) -> bool:
        return (is_decode_step(chunks) and len(chunks) <= self.buckets[-1]
                and all(len(chunk[2]) <= self.max_blocks_per_seq for chunk in chunks))

    @torch.inference_mode()
    def run(self, chunks: list[Chunk],
            token_source: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """-> [len(chunks), vocab] float32 logits of a decode step (see can_run);
        token_source: DecodeInputs.fill's."""
        num_seqs = len(chunks)
        bucket = self.bucket_for(num_seqs)
        self.inputs.fill(chunks, bucket, token_source)
        key = (bucket, any(chunk[4] != 0 for chunk in chunks))
        graph = self._graphs.get(key)
        if graph is None:
            batch = self.inputs.batch(bucket, self.inputs.seqs(chunks, bucket))
            return self.model.forward(batch)[:num_seqs]
        graph.replay()
        # A copy: the static logits are overwritten by the next replay of any graph.
        return self._logits[key][:num_seqs].clone()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool."""
        if self.model.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        start = time.monotonic()
        free_before, _ = torch.cuda.mem_get_info(self.model.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.model.device)
        # Largest first: the smaller graphs' activations fit in memory the pool already holds.
        variants = (True, False) if self.num_adapters else (False,)
        for bucket, with_lora in ((b, v) for b in reversed(self.buckets) for v in variants):
            batch = self.inputs.batch(bucket, self._capture_seqs(bucket, with_lora))
            try:
                # Warm up on the capture stream: kernels compile and per-stream library
                # workspaces are allocated here, outside the capture. The buffers hold padding
                # only, so these runs write no KV.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(NUM_WARMUP):
                        self.model.forward(batch, lora_launch_always=with_lora)
                torch.cuda.current_stream().wait_stream(stream)
                # [bucket, vocab] fp32. With LoRA, the kernels launch for every edited
                # projection whatever the captured slots; without, nothing LoRA is recorded.
                if self.segmented:
                    graph, logits = self._capture_segmented(batch, with_lora, pool, stream)
                else:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        logits = self.model.forward(batch, lora_launch_always=with_lora)
            except RuntimeError as exc:
                raise RuntimeError(f"capturing the CUDA graph of decode steps of {bucket} "
                                   f"sequences failed ({exc}); --enforce-eager runs without "
                                   "graphs") from exc
            self._graphs[bucket, with_lora] = graph
            self._logits[bucket, with_lora] = logits
        torch.cuda.synchronize(self.model.device)
        free_after, _ = torch.cuda.mem_get_info(self.model.device)
        segments = ""
        if self.segmented:
            counts = sorted({g.num_segments for g in self._graphs.values()})
            segments = f", {'/'.join(map(str, counts))} segments each, collectives between"
        log.info("captured CUDA graphs of decode steps for %s sequences in %.1fs (%.0f MiB%s)",
                 self.buckets, time.monotonic() - start, (free_before - free_after) / 2**20,
                 segments)

    def _capture_segmented(self, batch: ForwardBatch, with_lora: bool, pool,
                           stream: torch.cuda.Stream) -> tuple[SegmentedGraph, torch.Tensor]:
        graph = SegmentedGraph(pool)
        tp = self.model.tp
        with torch.cuda.stream(stream):
            graph.begin()
            tp.segmenter = graph
            try:
                logits = self.model.forward(batch, lora_launch_always=with_lora)
            finally:
                tp.segmenter = None
                graph.end()  # never leave the stream capturing, even after a failure
        return graph, logits

    def _capture_seqs(self, bucket: int, with_lora: bool) -> list[SeqChunk]:
        """What a captured step's sequences look like to code that reads Python metadata: the
        largest context and every loaded adapter (none for the base graph), so a bound taken
        from them holds for every step the graph will replay (the kernels read the actual slots
        and lengths from the tensors, and size their grids from tensor shapes)."""
        slots = list(range(1, self.num_adapters + 1)) if with_lora else [0]
        table = [0] * self.max_blocks_per_seq
        return [SeqChunk(i, 1, self.max_model_len, table, slots[i % len(slots)])
                for i in range(bucket)]
