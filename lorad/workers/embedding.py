"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous vocab range.

The embedding zeroes rows whose id lies outside this rank's range and all-reduces, so exactly
one rank contributes each row (an exact sum in any dtype). The head computes this rank's logit
columns and all-gathers them into the full vocabulary on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorad.workers.batch import MIN_ROWS, product_rows
from lorad.workers.linear import Plans, base_matmul, check_shape
from lorad.config.partition import balanced_split
from lorad.workers.parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp = tp
        self.vocab_sizes = [end - start for start, end in balanced_split(vocab_size, tp.world_size)]
        self.vocab_start, self.vocab_end = balanced_split(vocab_size, tp.world_size)[tp.rank]
        # [vocab_end - vocab_start, hidden_size]
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, name: str, tensor_slice) -> None:
        check_shape(name, tensor_slice.get_shape(), (self.vocab_size, self.hidden_size))
        param.data.copy_(tensor_slice[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_rows] -> [num_rows, hidden_size]
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_rows]
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight)
        out = out * in_shard.unsqueeze(1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits for the vocab range of the embedding; tied models read the embedding's weight."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.tp = embedding.tp
        self.vocab_size = embedding.vocab_size
        self.hidden_size = embedding.hidden_size
        self.vocab_sizes = embedding.vocab_sizes
        self.vocab_start, self.vocab_end = embedding.vocab_start, embedding.vocab_end
        if tied:
            # The same Parameter object: named_parameters() lists it once, under the embedding,
            # and the checkpoint's lm_head.weight (if present) is not read.
            self.weight = embedding.weight
        else:
            # [vocab_end - vocab_start, hidden_size]
            self.weight = nn.Parameter(
                torch.empty_like(embedding.weight, dtype=dtype, device=device), requires_grad=False)
            self.weight.weight_loader = embedding.weight_loader
        self.plans: Plans = None  # matmul_plan.plan_model_matmuls sets them on the kernel path

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_sampled, hidden_size] -> [num_sampled, vocab_size] float32, every rank
        num_sampled = hidden.shape[0]
        if num_sampled == 0:
            # Every rank runs the same batch, so every rank skips the gather together.
            return hidden.new_zeros((0, self.vocab_size), dtype=torch.float32)
        rows = product_rows(num_sampled) if hidden.device.type == "cpu" else MIN_ROWS
        if num_sampled < rows:
            # Zero rows up to MIN_ROWS (on the CPU, product_rows) so a row's bits do not depend
            # on how many rows are sampled this step (shared/DESIGN.md, "Numerics").
            hidden = F.pad(hidden, (0, 0, 0, rows - num_sampled))
        # On the GPU the measured plan's matmul, whose rows keep their bits at any count.
        local = base_matmul(hidden, self.weight, None, plans=self.plans)[:num_sampled].float()
        return self.tp.all_gather_last_dim(local, self.vocab_sizes)
