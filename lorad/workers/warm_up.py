"""The eager steps a rank runs before it says Ready, so that no request compiles a kernel.

Triton compiles a variant per constexpr value, and some of ours follow the step's size: PDL on or
off (the step's rows against PdlConfig's limits), the expand's tile (ExpandSteps), the decode GEMV
(base projections of at most its block_m rows), the MoE tile tables' pair block (MoeConfig), the
LoRA flags (whether any row has an adapter) and decode attention's paths by sequence count.
warm_up_steps lists one step in each band, with and without adapter rows, and a mixed step
with more decodes than decode attention's early block-id read takes (a mixed step's decode rows
run the decode kernel, attention_cuda.py); integer arguments that follow the step (block-table
widths, row counts) are not specialized by the kernels, so one step per band compiles what the
band can reach. The steps take no block and write nothing: their tables name block 0, only
read, and the engine sets every KV slot to -1. No torch here: the list is pure, Engine.warm_up runs it.
"""

from __future__ import annotations

from lorad.workers.batch import MIN_ROWS
from lorad.workers.tuning import Tuning

# (new token ids, start position, block table, wants a sample, adapter slot): cuda_graph.Chunk
Chunk = tuple[list[int], int, list[int], bool, int]


def row_bands(tuning: Tuning, max_rows: int) -> list[int]:
    """One row count per band of step sizes that selects other kernel variants, ascending, each at
    most max_rows: MIN_ROWS (every step is padded to it), one past each size limit a kernel's
    choice follows, and max_rows itself (the largest step the budget allows)."""
    limits = [tuning.pdl.max_rows, tuning.pdl.max_rows_with_lora, tuning.expand.small_step_rows,
              tuning.moe.small_step_rows]
    limits += [config.block_m for config in (tuning.gemv.qkv, tuning.gemv.gate_up, tuning.gemv.o,
                                             tuning.gemv.down) if config is not None]
    bands = {MIN_ROWS, max_rows} | {limit + 1 for limit in limits if limit > 0}
    return sorted(rows for rows in bands if rows <= max_rows)


def seq_bands(tuning: Tuning) -> list[int]:
    """Sequence counts of a decode step at which decode attention takes other paths: one past
    each of its limits by sequences (the early block-id read, the L2 prefetch), and one."""
    attention = tuning.attention
    return sorted({1, attention.preload_max_seqs + 1, attention.prefetch_max_seqs + 1})


def warm_up_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int, num_adapters: int, tuning: Tuning) -> list[list[Chunk]]:
    """The steps, each a list of chunks: for every row band, a prompt chunk beside a decode (the
    eager mixed step a burst makes) and, up to max_num_seqs, a decode-only step (eager where no
    graph runs it: --enforce-eager, contexts past the graphs' tables); decode-only steps at each
    of seq_bands too. Each once on the base model and, with adapters loaded, once with adapter 1
    on its rows beside base rows, and once with adapter 1 on every row."""
    mixtures = [(0, 0)] if num_adapters == 0 else [(0, 0), (1, 0), (1, 1)]
    bands = row_bands(tuning, max_num_batched_tokens)
    steps: list[list[Chunk]] = []
    for rows in bands:
        prompt_len = min(rows - 1, max_model_len - 1)
        for prompt_slot, decode_slot in mixtures:
            if prompt_len >= 1:
                table = [0] * -(-prompt_len // block_size)
                steps.append([([0] * prompt_len, 0, table, True, prompt_slot),
                              ([0], 0, [0], True, decode_slot)])
    # A mixed step's decodes run the decode kernel as sequences of their own, which reads each
    # split's first block ids early at up to preload_max_seqs of them: one step past that too.
    decodes = tuning.attention.preload_max_seqs + 1
    prompt_len = min(MIN_ROWS - decodes, max_num_batched_tokens - decodes, max_model_len - 1)
    if prompt_len >= 2 and decodes < max_num_seqs:  # two tokens: not taken for a decode
        table = [0] * -(-prompt_len // block_size)
        for prompt_slot, decode_slot in mixtures:
            steps.append([([0] * prompt_len, 0, table, True, prompt_slot)]
                         + [([0], 0, [0], True, decode_slot)] * decodes)
    for num_seqs in sorted(set(seq_bands(tuning)) | set(bands)):
        if num_seqs > min(max_num_seqs, max_num_batched_tokens):
            continue
        for first_slot, other_slot in mixtures:
            steps.append([([0], 0, [0], True, first_slot if i == 0 else other_slot)
                          for i in range(num_seqs)])
    return steps
