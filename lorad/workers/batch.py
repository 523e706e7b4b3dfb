"""The flat token batch one model step runs: every sequence's new tokens, back to back.

Built from the step plan on every rank identically; the model reads nothing else. Rows beyond the
real tokens are padding (token 0, slot -1: nothing is written to the KV cache for them) so that a
matmul never sees fewer than MIN_ROWS rows, which keeps a row's bits independent of how many
neighbours it has on MKL (see shared/DESIGN.md, "Numerics"); on the CPU, product_rows says
what more a product's rows are padded to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorad.workers.cpu_threads import MIN_ROWS, padding_for


def product_rows(num_rows: int) -> int:
    """The rows a CPU product of num_rows rows (a step, an attention product, the LM head's
    sampled rows) is computed with: at least MIN_ROWS, and at more than one torch thread more
    where this machine's threaded matmuls split that count differently (cpu_threads.py, measured
    once per process), so that a row's bits are one thread's at any count."""
    rows = max(num_rows, MIN_ROWS)
    threads = torch.get_num_threads()
    if threads == 1:
        return rows
    return padding_for(threads).get(rows, rows)  # measured on first use


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's slice of the batch."""

    token_start: int  # index of its first new token in the flat batch
    num_tokens: int  # new tokens this step (a prompt chunk, or 1 when decoding)
    context_len: int  # tokens in the KV cache after this step: positions 0..context_len-1
    block_table: list[int]  # KV block ids holding positions 0..context_len-1, in order
    adapter_slot: int  # 0 = base model
    adapter_strength: float = 1.0  # the request's multiplier of its adapter's scales
    # Of the chunk's tokens, how many (its first ones) are prompt tokens; the rest are tokens the
    # model generated (a decode's one, or those a preempted sequence computes again). On the
    # GPU each kind keeps one attention arithmetic whatever the step (attention_cuda.py).
    num_prompt: int = 0


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_rows] int64, num_rows >= MIN_ROWS (padding at the end)
    positions: torch.Tensor  # [num_rows] int64
    slot_mapping: torch.Tensor  # [num_rows] int64: KV slot (block * block_size + offset), -1 = pad
    row_adapter_slots: torch.Tensor  # [num_rows] int64: each row's adapter slot (0 for padding)
    seqs: list[SeqChunk]
    # [num_sampled] int64: rows whose logits are returned, in order: a sampling chunk's last, or
    # a drafted chunk's every row
    sample_rows: torch.Tensor
    num_tokens: int  # real (unpadded) rows
    # The same per-sequence facts as `seqs`, as device tensors, for kernels and CUDA graphs
    # (which cannot walk a Python list):
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries 0
    context_lens: torch.Tensor  # [num_seqs] int32
    query_starts: torch.Tensor  # [num_seqs + 1] int32: seq i's rows are query_starts[i]:[i+1]
    # The LoRA kernels' row tiles (tile_slot, tile_rows, num_tiles: LoraTiles' tensors) where
    # the batch's maker filled them (a decode graph's static inputs); None: built from `seqs`.
    lora_tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [num_rows] float32: each row's adapter strength (1.0 for padding and base rows), by which
    # the LoRA paths multiply the row's delta after its scale. None: every row 1.0.
    row_strengths: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence runs exactly one generated token (the shape CUDA graphs capture)."""
        return all(chunk.num_tokens == 1 and not chunk.num_prompt for chunk in self.seqs)

    @classmethod
    def build(cls, chunks: list[tuple[list[int], int, list[int], bool, int]], block_size: int,
              device: torch.device | str = "cpu", min_rows: int = MIN_ROWS) -> "ForwardBatch":
        """chunks: (new_token_ids, start_position, block_table, wants_sample, adapter_slot[,
        adapter_strength[, prompt_len[, num_draft]]]) (strength 1.0 when absent; prompt_len, the
        sequence's prompt tokens, when absent: a chunk of one token that samples is a decode,
        any other all prompt; num_draft: a sampling chunk's last 1 + num_draft rows sample)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_adapters: list[int] = []
        row_strengths: list[float] = []
        seqs: list[SeqChunk] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            token_ids, start, block_table, wants_sample, adapter_slot = chunk[:5]
            strength = chunk[5] if len(chunk) > 5 else 1.0
            n = len(token_ids)
            assert n > 0, "a chunk has at least one token"
            assert (start + n + block_size - 1) // block_size <= len(block_table), \
                "block table too short for the chunk"
            seqs.append(SeqChunk(len(ids), n, start + n, list(block_table), adapter_slot,
                                 strength, num_prompt_rows(chunk)))
            for i, token in enumerate(token_ids):
                pos = start + i
                ids.append(token)
                positions.append(pos)
                slots.append(kv_slot(block_table, pos, block_size))
                row_adapters.append(adapter_slot)
                row_strengths.append(strength)
            if wants_sample:
                num_draft = chunk[7] if len(chunk) > 7 else 0
                sample_rows.extend(range(len(ids) - 1 - num_draft, len(ids)))
        num_tokens = len(ids)
        pad = max(0, min_rows - num_tokens)
        if torch.device(device).type == "cpu":
            pad = max(pad, product_rows(num_tokens) - num_tokens)
        ids += [0] * pad
        positions += [0] * pad
        slots += [-1] * pad
        row_adapters += [0] * pad
        row_strengths += [1.0] * pad

        def tensor(values, dtype=torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        max_blocks = max((len(s.block_table) for s in seqs), default=0)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        starts = [s.token_start for s in seqs] + [num_tokens]
        return cls(tensor(ids), tensor(positions), tensor(slots), tensor(row_adapters), seqs,
                   tensor(sample_rows), num_tokens,
                   tensor(tables, torch.int32).reshape(len(seqs), max_blocks),
                   tensor([s.context_len for s in seqs], torch.int32),
                   tensor(starts, torch.int32), None,
                   tensor(row_strengths, torch.float32))


def num_prompt_rows(chunk: tuple) -> int:
    """How many of a chunk's tokens (ForwardBatch.build's form) are prompt tokens: its first
    ones, up to the sequence's prompt length when the chunk carries it (its 7th field), else
    none for a chunk of one token that samples (a decode) and all for any other."""
    token_ids, start, wants_sample = chunk[0], chunk[1], chunk[3]
    if len(chunk) > 6 and chunk[6] is not None:
        return max(0, min(chunk[6] - start, len(token_ids)))
    return 0 if len(token_ids) == 1 and wants_sample else len(token_ids)


def kv_slot(block_table: list[int], pos: int, block_size: int) -> int:
    """The KV cache slot of position `pos` of a sequence with these blocks: its block's id *
    block_size + the offset inside it (the caches are [num_blocks, block_size, ...])."""
    return block_table[pos // block_size] * block_size + pos % block_size
