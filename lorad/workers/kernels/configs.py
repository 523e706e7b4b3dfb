"""The launch settings of lorad's kernels, each a frozen dataclass whose defaults are the
product's choices; lorad/workers/tuning.py composes them into the engine's one Tuning.

Apart from the kernels so that the CPU path, which never imports triton, can build a Tuning too.
Only settings here: how a kernel uses them is its own module's business.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# The widest decode GEMV x tile: a decode step of up to 32 sequences in one tile (a multiple of
# the MMA's 16).
GEMV_MAX_ROWS = 32


def _check_powers_of_two(config, names: tuple[str, ...], least: int, why: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < least or value & (value - 1):
            raise ValueError(f"{name} {value} is not a power of two >= {least}{why}")


@dataclass(frozen=True)
class PdlConfig:
    """The most rows a step may have for its kernels to launch with PDL (kernels/pdl.py): past
    them PDL cost more than it saved (docs/performance-log.md: PDL for the decode kernels up to
    32 rows). A step that launches LoRA kernels has its own limit, since PDL pays there at more
    rows (docs/performance-log.md: PDL up to 64 rows in LoRA steps). 0 turns PDL off."""

    max_rows: int = 32
    max_rows_with_lora: int = 64

    def step_rows(self, with_lora: bool) -> int:
        """A step's PDL row limit, the pdl_rows its kernels take."""
        return self.max_rows_with_lora if with_lora else self.max_rows


@dataclass(frozen=True)
class OneshotConfig:
    """The one-shot all-reduce (kernels/oneshot_reduce.py, workers/peer_reduce.py): the largest
    tensor it takes (decode-size: more rows, or a wider row, go to NCCL) and its fixed grid,
    which must be resident at once on every rank (the barrier meets program p with program p).
    Unmeasured defaults: no multi-GPU machine has run it yet."""

    max_rows: int = 64
    max_hidden: int = 16384
    num_programs: int = 32


@dataclass(frozen=True)
class TileConfig:
    """The LoRA kernels' row tiles (lora_tiles.py) and persistent grids."""

    # Rows per tile: shrink and expand share the tiles, so they share this (the kernels take it
    # from the tiles). The M side of their MMAs, so at least 16. A row's bits depend on it, so a
    # server keeps one.
    block_m: int = 16
    # A persistent grid's size per multiprocessor: enough programs in flight to hide load
    # latency (docs/performance-log.md: LoRA grid of 32 programs per SM).
    programs_per_sm: int = 32


@dataclass(frozen=True)
class ShrinkConfig:
    """lora_shrink.py's work items and tile."""

    # Ranks and inputs per work item: one [BLOCK_M, block_k] x [block_k, block_r] MMA a step
    # (both sides powers of two of at least 16, as tl.dot takes them). Decode rows are few, so
    # ranks and K chunks give the parallelism.
    block_r: int = 16
    block_k: int = 128
    # Inputs per chunk, a multiple of block_k: a fixed size, so a row's sums never depend on the
    # batch. Smaller means more programs but more partial sums for the expand to add
    # (docs/performance-log.md: shrink K chunks of 256).
    k_chunk: int = 512
    num_warps: int = 2  # (docs/performance-log.md: shrink on 4 warps)
    # Loads in flight along a chunk (Hopper: cp.async into shared memory).
    num_stages: int = 3
    # Work items per multiprocessor past which a work item takes several K chunks in one sweep
    # (its tile looked up once, its loads running on across the chunks): with distinct adapters
    # at batch 64 one chunk per item made thousands of items, each a chain of dependent loads
    # (docs/performance-log.md: shrink K-chunk groups). 0: one chunk per item.
    items_per_sm: int = 3

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_r", "block_k"), 16, " (a tl.dot side)")
        if self.k_chunk % self.block_k:
            raise ValueError(f"k_chunk {self.k_chunk} is not a multiple of block_k {self.block_k}")


@dataclass(frozen=True)
class ExpandConfig:
    """One lora_expand.py launch's tile."""

    # Outputs per block: one [BLOCK_M, rank] x [rank, block_n] MMA (a power of two >= 16)
    # (docs/performance-log.md: expand blocks of 64 on 2 warps).
    block_n: int = 128
    num_warps: int = 4
    # B's loads in flight along a group of blocks (Hopper: cp.async into shared memory)
    # (docs/performance-log.md: expand on 3 stages).
    num_stages: int = 3

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_n",), 16, " (a tl.dot side)")


@dataclass(frozen=True)
class ExpandSteps:
    """Which tile an expand takes by its step's rows, and how its work items group."""

    # Steps of up to small_step_rows rows take the small tile: blocks of 256 outputs, twice the
    # B bytes per load. The block changes no bit (an MMA computes each output from its own column
    # of B: check_block_widths_change_no_bit), so it may follow the step's size
    # (docs/performance-log.md: expand blocks of 256 up to 32 rows).
    small_step_rows: int = 32
    small: ExpandConfig = ExpandConfig(block_n=256)
    large: ExpandConfig = ExpandConfig()
    # Work items per multiprocessor past which a work item takes several consecutive blocks of
    # outputs (its tile looked up and its t summed once): with distinct adapters at batch 64, one
    # block per item makes thousands of small items (docs/performance-log.md: expand block
    # groups). 0: one block per item.
    items_per_sm: int = 4
    # Steps with prompt chunks of at least this many rows add each delta into its base output
    # in place, after the matmul, instead of writing fp32 deltas beside it for the next kernel
    # to add: the same bits (LoraDelta is defined as the in-place add), half the bytes, and the
    # consumers' plain kernels (silu * up reading two fp32 deltas took 36.9 vs 12.4 us a layer
    # at 512 rows), where the side stream's overlap buys little since the matmul fills the
    # GPU (docs/performance-log.md: LoRA deltas in place in prompt steps). Decode steps keep the
    # deltas beside the matmul at any batch. 0: never.
    in_place_rows: int = 256

    def config(self, num_rows: int) -> ExpandConfig:
        """The tile of an expand over num_rows rows."""
        return self.small if num_rows <= self.small_step_rows else self.large

    def in_place(self, num_rows: int, prompt: bool) -> bool:
        """Whether a step of num_rows rows adds its deltas in place; prompt: it has prompt chunks
        (or drafts: anything but one generated token a sequence)."""
        return prompt and 0 < self.in_place_rows <= num_rows


@dataclass(frozen=True)
class GemvConfig:
    """decode_gemv.py's tile."""

    # Rows of the x tile: the most rows one call takes (a multiple of 16, at most 32).
    block_m: int = GEMV_MAX_ROWS
    # Outputs per program: N / block_n programs, each reading block_n rows of w in full.
    block_n: int = 32
    # Inputs per step: block_n * block_k elements of w per load, num_stages - 1 loads in flight.
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32):
            raise ValueError(f"block_m {self.block_m} is not 16 or 32")
        _check_powers_of_two(self, ("block_n", "block_k"), 16, " (a tl.dot side)")
        _check_powers_of_two(self, ("num_warps",), 1, "")
        if self.num_stages < 1:
            raise ValueError(f"num_stages {self.num_stages} is below 1")


@dataclass(frozen=True)
class MatmulConfig:
    """row_matmul.py's tile: block_m rows and block_n outputs per program, block_k inputs per
    MMA step (powers of two of at least 16, as tl.dot takes them), group_m row tiles per wave
    along N (L2 reuse of w). Unmeasured: benchmarks/probe_row_matmul.py compares tiles."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_m", "block_n", "block_k"), 16, " (a tl.dot side)")
        _check_powers_of_two(self, ("num_warps",), 1, "")
        if self.group_m < 1 or self.num_stages < 1:
            raise ValueError(f"group_m {self.group_m} and num_stages {self.num_stages} must be "
                             ">= 1")


@dataclass(frozen=True)
class MatmulTiles:
    """row_matmul's tile by a product's row count (matmul_plan.py), in bands: (most rows, tile),
    ascending, the last band's tile for any count past it. Every tile gives the same bits, so
    the count may pick one. benchmarks/probe_row_matmul.py, H100, 8B shapes, bf16: each tile
    the decode GEMV's bits at every count tried; against cuBLAS, 16 x 64 at 1-16 rows 0.95-1.17x
    (o, down, gate/up; q/k/v 0.7x), 64 x 64 at 64-128 rows 0.89-0.99x (down, gate/up: the
    counts where cuBLAS splits K are down's), 64 x 128 at 256-512 0.57-0.74x, 128 x 256 at
    1,024 and more 0.79-0.93x. The plan takes row_matmul only where cuBLAS splits K. 16 x 64
    keeps its time to 32 rows (down: 46.8-47.0 us at 24 and 32, cuBLAS 47.4; 64 x 64 77.9 and
    72.5: lorad --deterministic's cost at 32 streams was +8.5-9.5% with 64 x 64 there)."""

    bands: tuple[tuple[int, MatmulConfig], ...] = (
        (32, MatmulConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)),
        (128, MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)),
        (768, MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)),
        (1 << 30, MatmulConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                               num_stages=3)))

    def __post_init__(self) -> None:
        if not self.bands or [rows for rows, _ in self.bands] != sorted(
                {rows for rows, _ in self.bands}):
            raise ValueError("bands must be non-empty, by most rows ascending")

    @property
    def first(self) -> MatmulConfig:
        """The first band's tile: the reference the others are checked against."""
        return self.bands[0][1]

    def config(self, num_rows: int) -> MatmulConfig:
        for most, tile in self.bands:
            if num_rows <= most:
                return tile
        return self.bands[-1][1]

    def replacing(self, tile: MatmulConfig) -> "MatmulTiles":
        """These bands with `tile` replaced by the first band's."""
        return dataclasses.replace(self, bands=tuple(
            (most, self.first if t == tile else t) for most, t in self.bands))

    def for_dtype(self, dtype: torch.dtype) -> "MatmulTiles":
        """The tiles for weights of `dtype`: block_k halved for 4-byte weights (fp32), so that
        their pipelined loads take the shared memory of the 2-byte tiles (the first tile's fp32
        loads at block_k 256 and 4 stages ask 245,760 bytes, over an H100's 232,448)."""
        if dtype.itemsize <= 2:
            return self
        return dataclasses.replace(self, bands=tuple(
            (most, fitting_itemsize(t, dtype.itemsize)) for most, t in self.bands))


def fitting_itemsize(config, itemsize: int):
    """A tile (a config with block_k) for weights of `itemsize` bytes: block_k halved for 4-byte
    ones (fp32), so that its pipelined loads take the shared memory of the 2-byte tile."""
    if itemsize <= 2:
        return config
    return dataclasses.replace(config, block_k=max(16, config.block_k // 2))


@dataclass(frozen=True)
class GemvModelTiles:
    """The decode GEMV's tile for each fused base projection of the model (linear.py's
    base_matmul), in steps of at most its block_m rows on CUDA; None: cuBLAS (o and down lose on
    the GEMV: docs/performance-log.md: o and down on the GEMV at batches 1 to 16). gate/up's
    28,672 outputs in blocks of 64 make 448 programs, which stay resident together at 3 stages
    of 128 inputs (docs/performance-log.md: decode GEMV for gate/up up to 16 rows)."""

    qkv: GemvConfig | None = GemvConfig(block_m=16, block_n=64, block_k=256, num_stages=4)
    gate_up: GemvConfig | None = GemvConfig(block_m=16, block_n=64, block_k=128, num_stages=3)
    o: GemvConfig | None = None
    down: GemvConfig | None = None
    # Where gate/up takes the GEMV and no LoRA kernel runs for it (no row's adapter edits gate
    # or up), silu(gate) * up in the GEMV's epilogue (decode_gemv.decode_swiglu, gate/up's tile):
    # one launch instead of two and no gate/up in memory, the same bits. Not yet timed on a GPU
    # (bench_engine --variant 'gemv.swiglu_epilogue=False' gives the two launches).
    swiglu_epilogue: bool = True

    def config(self, projection: str, dtype: torch.dtype) -> GemvConfig | None:
        """`projection`'s tile for weights of `dtype`: block_k halved for 4-byte weights (fp32),
        so that the tile's pipelined loads take the shared memory of the 2-byte tile (q/k/v's
        fp32 tile of 64 x 256 at 4 stages asks 240 KiB, over an H200's 227)."""
        config = getattr(self, projection)
        return None if config is None else fitting_itemsize(config, dtype.itemsize)


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """paged_attention.py's split-KV decode kernels."""

    # Context tokens per split. Larger splits write fewer partial results (fp32 [head_dim] per
    # query head and split); smaller ones give short batches more programs. Part of a row's
    # arithmetic, as tile_tokens is, so a server keeps one (docs/performance-log.md: attention
    # split and tile sizes).
    split_size: int = 128
    tile_tokens: int = 64  # keys per step inside a split
    # Programs per (sequence, KV head) of the split kernel, each taking every split_programs-th
    # split of its context: a graph's grid is sized for the longest context its block table
    # holds, and one program per split launches mostly programs with nothing to do
    # (docs/performance-log.md: attention: 16 looping programs per (sequence, KV head)).
    # 0: one per split.
    split_programs: int = 16
    num_warps: int = 4  # the split kernel's
    # The split kernel's pipeline depth over its tiles; it changes no bit
    # (docs/performance-log.md: attention stages by batch).
    num_stages: int = 2
    # Splits the reduce kernel loads at once, merged one after another in split order.
    reduce_group: int = 8
    # The split kernel's L2 prefetch before its PDL wait, in steps of at most this many
    # sequences: it adds no arithmetic but costs registers, which only a step with few programs
    # can spare (docs/performance-log.md: attention L2 prefetch at 1 or 2 sequences).
    prefetch_max_seqs: int = 2
    # In steps of at most this many sequences the split kernel reads the block ids of each
    # program's first split's first tile before its PDL wait (the block tables are a step
    # input), beside the context length, so that after the wait that split's first K/V loads
    # wait on nothing else. Every split then takes its first tile apart from the rest, so which
    # program or batch computes a split still does not change its arithmetic
    # (check_decode_preload_same_bits; docs/performance-log.md: attention block ids read early
    # at one sequence).
    preload_max_seqs: int = 1


@dataclass(frozen=True)
class MoeConfig:
    """fused_moe.py's tiles: block_m (pair, expert) rows of one expert per tile, block_n outputs
    and block_k inputs per MMA step (powers of two of at least 16, as tl.dot takes them),
    num_stages loads of the weights in flight (triton's software pipeline; changes no bit). A
    row's bits depend on block_k (the order of its sums), so a server keeps one. block_k and
    num_stages measured on an H100 (below), block_m, block_n and num_warps only in
    benchmarks/probe_moe_decode.py's sweep (none more than 2% faster at batch 1)."""

    # block_k 128 at 4 stages: 3.14 ms of device time a decode step at batch 1 on an H100
    # against 3.36 at 64 and 3 (docs/performance-log.md: MoE expert tiles block_k 128 at 4
    # stages).
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    # Steps of at most this many rows build the tile tables over a pair block sized for them
    # (rows x top_k, to a power of two) instead of the 512 pairs the one-program kernel takes
    # at most: a decode step of one sequence sorts 64 lanes, not 512. Integer tables, the same
    # entries either way; one more compiled variant (a warm-up row band). 0: never.
    small_step_rows: int = 16
    # Launch the block's kernels (route, tile tables, the two expert kernels, the epilogue, the
    # router's GEMV) with PDL under the step's row limit (kernels/pdl.py), as the dense layers'
    # kernels are: 2.86 against 2.96 ms of device time a decode step at batch 1 on an H100
    # (docs/performance-log.md: MoE block's kernels with PDL).
    pdl: bool = True
    # Route the rows and run the routed experts on a side stream beside the shared expert
    # (workers/streams.py): the two read different weights and meet only in the epilogue, so
    # the router's small launches and each side's tail overlap the other side's loads. The same
    # kernels on the same inputs, so the same bits. 2.46 against 2.75 ms of device time a
    # decode step at batch 1 on an H100 (docs/performance-log.md: MoE routed experts beside the
    # shared expert).
    overlap_shared: bool = True
    # With overlap_shared, in steps of at most this many rows: the router's and the shared
    # expert gate's GEMV on the side stream too, forked before it, so that the shared expert's
    # gate/up starts at the norm's output, not after the GEMV. The same kernels on the same
    # inputs: the same bits. Device ms a decode step on an H100, idle / mixed4: batch 1 2.38 /
    # 2.77 against 2.48 / 2.82, batch 32 10.91 / 11.36 against 10.88 / 11.13, so not there
    # (docs/performance-log.md: MoE router's GEMV on the side stream). 0: never.
    router_on_side_rows: int = 16
    # On one rank (no all-reduce after the block): the epilogue's sum left to the next residual
    # add + RMSNorm, one launch for both (moe_glue.epilogue_add_norm) instead of two. The
    # residual's bits are the same; the normed row's may not be on CUDA (no fused multiply-add
    # in that launch). To be timed (docs/performance-log.md: MoE epilogue in the next add +
    # norm).
    fold_epilogue: bool = False

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_m", "block_n", "block_k"), 16, " (tl.dot's sides)")
        if self.num_stages < 1:
            raise ValueError(f"num_stages {self.num_stages} is below 1")
        if self.small_step_rows < 0:
            raise ValueError(f"small_step_rows {self.small_step_rows} is below 0")
        if self.router_on_side_rows < 0:
            raise ValueError(f"router_on_side_rows {self.router_on_side_rows} is below 0")

