"""LoRA slots of one linear layer: per-slot factor tables, their shard loader, the per-row delta.

Slot 0 is the base model and has no factors; adapters take slots 1..K. A linear layer gets a
LoraSlots only when some adapter edits it, so unedited modules and base-only steps do no LoRA
work. The delta is computed as peft does (`lora_B(lora_A(x)) * scaling`, in fp32, added once to
the layer's output) and never depends on which other rows share the step: on the CPU through
torch per slot group, on CUDA through the Triton shrink and expand kernels (kernels/lora_*.py),
which give each row a fixed order of fp32 sums (cuBLAS would pick kernels by batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.config.adapters import LoraModule
from lorad.workers.lora_rows import LoraRows
from lorad.workers.streams import fork, join, on_stream, side_stream

if TYPE_CHECKING:  # a kernel module (imports triton, which the CPU path never loads)
    from lorad.workers.kernels.lora_common import LoraDelta


def check_factor_shape(name: str, got, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"adapter tensor {name} has shape {tuple(got)}, expected {want}")


# safetensors dtype of adapter factors -> the table dtype that holds them exactly.
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def table_dtype(file_dtypes: set[str]) -> torch.dtype:
    """The dtype of every LoRA table, from the safetensors dtypes of all loaded adapters' factors
    (LoraModule.dtype): that dtype when they all share it, else fp32 (which holds bf16 and fp16
    values exactly too). One dtype for all tables: one compiled variant of each LoRA kernel."""
    if len(file_dtypes) == 1:
        return STORED_DTYPES[next(iter(file_dtypes))]
    return torch.float32


class LoraSlots(nn.Module):
    """Factor tables of one projection, indexed by slot, holding this rank's shard.

    The owning layer passes the input and output ranges it holds: a column-parallel layer holds
    all inputs (A whole) and a range of outputs (B split by rows); a row-parallel layer holds a
    range of inputs (A split by columns) and all outputs (B whole). peft computes the delta in
    fp32 whatever the model dtype (it upcasts bf16/fp16 adapter weights), and so does every
    path here; the tables hold the factors in `dtype` (table_dtype: fp32, or the bf16/fp16 every
    adapter's file stores them in), which keeps their values exactly: widened to fp32 as they
    are read, they are peft's fp32 values, at half the bytes to read.
    """

    def __init__(self, num_slots: int, max_rank: int, in_features: int, out_features: int,
                 in_range: tuple[int, int], out_range: tuple[int, int],
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        assert dtype in STORED_DTYPES.values()
        self.in_features, self.out_features = in_features, out_features  # full, unsplit sizes
        self.in_start, self.in_end = in_range
        self.out_start, self.out_end = out_range
        num_in, num_out = self.in_end - self.in_start, self.out_end - self.out_start
        # Ranks are zero-padded to max_rank, but the delta reads only a slot's own rank, so
        # its matrix products have peft's shapes.
        # [num_slots, max_rank, in_end - in_start]
        self.register_buffer("lora_a", torch.zeros(num_slots, max_rank, num_in, dtype=dtype,
                                                   device=device), persistent=False)
        # [num_slots, out_end - out_start, max_rank]
        self.register_buffer("lora_b", torch.zeros(num_slots, num_out, max_rank, dtype=dtype,
                                                   device=device), persistent=False)
        self.ranks = [0] * num_slots  # 0: the slot's adapter does not edit this module
        # Kept per slot, not folded into B: peft multiplies the expanded output by its scaling,
        # and B * scale would round differently.
        self.scales = [0.0] * num_slots
        # The same ranks and scales on the device, for the kernels.
        self.register_buffer("rank_table", torch.zeros(num_slots, dtype=torch.int32,
                                                       device=device), persistent=False)
        self.register_buffer("scale_table", torch.zeros(num_slots, dtype=torch.float32,
                                                        device=device), persistent=False)

    def load(self, slot: int, module: LoraModule, a_slice, b_slice) -> None:
        """Copy this rank's shard of one adapter's factors (safetensors slices) into `slot`."""
        self.fill(slot, module, *self.shard(module, a_slice, b_slice))

    def shard(self, module: LoraModule, a_slice, b_slice) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one adapter's factors (safetensors slices, or WholeTensor):
        ([rank, in_end - in_start] of A, [out_end - out_start, rank] of B), as stored."""
        r = module.rank
        check_factor_shape(module.a_tensor, a_slice.get_shape(), (r, self.in_features))
        check_factor_shape(module.b_tensor, b_slice.get_shape(), (self.out_features, r))
        # get_slice reads only the columns (A) or rows (B) this rank holds.
        return a_slice[:, self.in_start:self.in_end], b_slice[self.out_start:self.out_end]

    def fill(self, slot: int, module: LoraModule, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put a shard (LoraSlots.shard) into `slot`, with the module's rank and scale."""
        fill_tables(slot, [(self, module, a, b)])

    def clear(self, slot: int) -> None:
        """The slot's adapter does not edit this projection (its rows add no delta here)."""
        fill_tables(slot, [(self, None, None, None)])

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, rows: LoraRows | None) -> torch.Tensor:
        """out + (scale * (x A^T) B^T) * strength for each row, by its slot (and its request's
        strength); `out` itself when no row edits.

        x: [num_rows, in_end - in_start]; out: [num_rows, out_end - out_start] (a row-parallel
        layer passes its fp32 partial sum: the delta then joins the layer's all-reduce)."""
        if rows is not None and rows.tiles is not None:
            return add_lora_deltas([self], [out], x, rows)[0]
        groups = [group for group in rows.groups if self.ranks[group[0]]] if rows else []
        if not groups:
            return out
        # One rounding of base + delta, in fp32, as peft does for a low-precision base.
        acc = out if out.dtype == torch.float32 else out.float()
        for slot, idx, strengths in groups:
            r = self.ranks[slot]
            xs = x.index_select(0, idx).float().unsqueeze(1)  # [num_slot_rows, 1, in]
            n = xs.shape[0]
            # A batched product with the factors broadcast: each row is its own [1, in] x
            # [in, r] product, so its bits do not depend on how many rows share the slot. A
            # plain matmul does not give that for a narrow output like r (MKL, torch 2.13).
            # Factors widened to fp32 (a no-op for fp32 tables): exactly the stored values.
            a_t = self.lora_a[slot, :r].float().t().unsqueeze(0).expand(n, -1, -1)  # [n, in, r]
            b_t = self.lora_b[slot, :, :r].float().t().unsqueeze(0).expand(n, -1, -1)  # [n, r, out]
            shrink = torch.bmm(xs, a_t)  # [n, 1, r]
            delta = torch.bmm(shrink, b_t).squeeze(1) * self.scales[slot]  # [n, out]
            if strengths is not None:  # the request's strength, after the scale, as the kernel
                delta = delta * strengths
            acc.index_add_(0, idx, delta)  # each row once: a single fp32 add per element
        return acc if acc is out else acc.to(out.dtype)


@dataclass(frozen=True)
class PendingShrink:
    """The LoRA shrink of projections that share an input (q/k/v, gate/up, or one), launched
    with their base matmul: on CUDA on a side stream, so it runs beside the matmul; the expand
    adds the deltas into the outputs once they exist (`expand_into`), or writes them into
    buffers beside the matmul still (`expand_deltas`)."""

    loras: tuple[LoraSlots | None, ...]  # one per output; None: no delta for it this step
    t: torch.Tensor  # [num_edited, num_rows, num_k_chunks, width] float32, from lora_shrink
    edited: tuple[int, ...]  # the output each table of t belongs to
    rows: LoraRows  # the step's rows: their tiles and the kernels' settings
    side: torch.cuda.Stream | None  # the stream the shrink runs on; None: the current one

    def wait(self) -> None:
        """Order what the current stream does next after the shrink."""
        join(self.side)

    @property
    def tables(self) -> list[LoraSlots]:
        return [self.loras[i] for i in self.edited]

    def _expand(self, outs: Sequence[torch.Tensor], deltas: bool) -> None:
        from lorad.workers.kernels.lora_expand import lora_expand
        tables = self.tables
        lora_expand(self.t, outs, [lora.lora_b for lora in tables],
                    [lora.rank_table for lora in tables], [lora.scale_table for lora in tables],
                    self.rows.tiles, row_strengths=self.rows.row_strengths, deltas=deltas,
                    steps=self.rows.expand, pdl_rows=self.rows.pdl_rows)

    def expand_into(self, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Add each edited output's delta into it, in place (the expand kernel); -> outs."""
        self.wait()
        self._expand([outs[i] for i in self.edited], deltas=False)
        return list(outs)

    def expand_deltas(self, buffers: Sequence[torch.Tensor],
                      row_slots: torch.Tensor) -> tuple["LoraDelta | None", ...]:
        """The expand of each edited output into its fp32 buffer (one per edited table, in
        order), on the shrink's stream, then the join: -> each output's LoraDelta or None.
        The buffers must exist before the fork (see matmul_with_deltas)."""
        from lorad.workers.kernels.lora_common import LoraDelta
        with on_stream(self.side):
            self._expand(buffers, deltas=True)
        self.wait()
        deltas: list[LoraDelta | None] = [None] * len(self.loras)
        for i, lora, buffer in zip(self.edited, self.tables, buffers):
            deltas[i] = LoraDelta(buffer, lora.rank_table, row_slots)
        return tuple(deltas)


def edited_this_step(loras: Sequence[LoraSlots | None],
                     rows: LoraRows | None) -> tuple[int, ...]:
    """The projections whose LoRA kernels run this step, by index (none on the torch path): a
    table some row's adapter edits, or any table in a graph that launches them always."""
    if rows is None or rows.tiles is None:
        return ()
    return tuple(i for i, lora in enumerate(loras)
                 if lora is not None and rows.launches(lora.ranks))


def matmul_and_shrink(loras: Sequence[LoraSlots | None], x: torch.Tensor, rows: LoraRows | None,
                      matmul: Callable[[], torch.Tensor] | None
                      ) -> tuple[torch.Tensor | None, PendingShrink | None]:
    """(matmul(), the pending shrink of the projections that share the input x): the base
    product (None without a matmul) and, on the kernel path, the LoRA shrink launched beside it
    on the side stream (None when none of the projections gets a delta this step, or on the
    torch path, which adds its deltas in add_lora_deltas). The caller finishes with
    expand_into or expand_deltas."""
    edited = edited_this_step(loras, rows)
    if not edited:
        return (None if matmul is None else matmul()), None
    # Lazily: the CPU never imports triton.
    from lorad.workers.kernels.lora_common import MAX_TABLES
    from lorad.workers.kernels.lora_shrink import lora_shrink
    assert len(edited) <= MAX_TABLES, f"at most {MAX_TABLES} projections share an input"
    tables = [loras[i] for i in edited]
    # Beside the base matmul, which it does not depend on (docs/performance-log.md: shrink
    # beside the matmul on a side stream). Forked from the current stream here, where x is ready
    # and the matmul not yet queued, joined in wait(). t, allocated on the side stream, is used
    # only there (by the shrink, and by the expand of expand_deltas) or after the join
    # (expand_into), and can be reused only by a later shrink there, forked after the expand
    # that reads t.
    side = side_stream(x.device, "lora")
    fork(side)
    # The matmul is queued before the shrink: a shrink launched first spread its persistent grid
    # over every SM and the matmul started only as it drained (docs/performance-log.md: matmul
    # launched before the shrink).
    out = matmul() if matmul is not None else None
    with on_stream(side):
        t = lora_shrink(x, [lora.lora_a for lora in tables],
                        [lora.rank_table for lora in tables], rows.tiles, config=rows.shrink,
                        pdl_rows=rows.pdl_rows)
    return out, PendingShrink(tuple(loras), t, edited, rows, side)


def matmul_with_deltas(loras: Sequence[LoraSlots | None], x: torch.Tensor,
                       rows: LoraRows | None, matmul: Callable[[], torch.Tensor],
                       sizes: Sequence[int] | None = None
                       ) -> tuple[torch.Tensor, tuple[LoraDelta | None, ...]]:
    """(matmul(), each output's LoraDelta or None) on the kernel path: the base product of x on
    the current stream and, beside it on the side stream, the shrink and the expand of the
    projections that share x into fp32 delta buffers, joined before returning (the consumer
    kernel comes next). No delta (all None) when no projection is edited this step, nor in a
    step that adds its deltas in place (LoraRows.in_place): there the expand adds each delta
    into its output after the matmul, the product's column slices of `sizes` (one per
    projection; None: the product is the one output)."""
    edited = edited_this_step(loras, rows)
    if not edited:
        return matmul(), (None,) * len(loras)
    if rows.in_place:
        out, pending = matmul_and_shrink(loras, x, rows, matmul)
        pending.expand_into(list(out.split(sizes, dim=1)) if sizes is not None else [out])
        return out, (None,) * len(loras)
    assert rows.row_slots is not None
    # Allocated on the current stream before the fork: the side stream writes them after every
    # earlier use of their memory there, and the current one reads and frees them after the
    # join, so the allocator's reuse stays ordered.
    buffers = [torch.empty(x.shape[0], loras[i].lora_b.shape[1], dtype=torch.float32,
                           device=x.device) for i in edited]
    out, pending = matmul_and_shrink(loras, x, rows, matmul)
    return out, pending.expand_deltas(buffers, rows.row_slots)


def add_lora_deltas(loras: Sequence[LoraSlots | None], outs: Sequence[torch.Tensor],
                    x: torch.Tensor, rows: LoraRows | None) -> list[torch.Tensor]:
    """Each projection's output plus its delta, for projections that share the input x (q/k/v,
    gate/up; None: a projection no adapter edits). On the kernel path one shrink and one expand
    serve them all, adding into the outputs in place; on the torch path each adds its own,
    exactly as add_delta does."""
    if rows is None or rows.tiles is None:
        return [out if lora is None else lora.add_delta(out, x, rows)
                for lora, out in zip(loras, outs)]
    _, pending = matmul_and_shrink(loras, x, rows, None)  # the outputs exist already
    return list(outs) if pending is None else pending.expand_into(outs)


def fill_tables(slot: int, entries: list[tuple[LoraSlots, LoraModule | None, torch.Tensor | None,
                                                torch.Tensor | None]]) -> None:
    """Put shards (LoraSlots.shard) into `slot` of each entry's table, with the module's rank and
    scale; an entry of module None clears the table's slot (its adapter does not edit it).

    A handful of foreach calls for the copies, though each table's slot is sliced anew (six
    views a table). The adapter jobs, which copy beside the step loop where every torch call
    waits for the GIL, go through adapter_host_cache instead, whose views are made once; this
    serves the start's copies (loader.load_adapter_weights), a lit slot and LoraSlots.fill."""
    dsts, srcs, tails, rank_views, scale_views, ranks, scales = [], [], [], [], [], [], []
    for table, module, a, b in entries:
        r = 0 if module is None else module.rank
        if module is not None:
            if r > table.lora_a.shape[1]:
                raise ValueError(f"{module.full_name} has rank {r}; its table holds "
                                 f"{table.lora_a.shape[1]}")
            # fp32 tables widen any factor dtype exactly; narrower ones were chosen for this
            # dtype (table_dtype), so the copy never rounds.
            assert table.lora_a.dtype in (torch.float32, STORED_DTYPES[module.dtype])
            dsts += [table.lora_a[slot, :r], table.lora_b[slot, :, :r]]
            srcs += [a, b]
            # Past the rank: zeros, not what an adapter of a higher rank left in the slot.
            tails += [table.lora_a[slot, r:], table.lora_b[slot, :, r:]]
        scale = 0.0 if module is None else module.scale
        table.ranks[slot], table.scales[slot] = r, scale
        rank_views.append(table.rank_table[slot:slot + 1])
        scale_views.append(table.scale_table[slot:slot + 1])
        ranks.append(r)
        scales.append(scale)
    # Ordered on the current stream; from pageable shards the driver stages each copy before
    # returning, so no wait for each one.
    if dsts:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    tails = [t for t in tails if t.numel()]
    if tails:
        torch._foreach_zero_(tails)
    write_ranks_and_scales(rank_views, scale_views, ranks, scales)


def write_ranks_and_scales(rank_views: list[torch.Tensor], scale_views: list[torch.Tensor],
                           ranks: list[int], scales: list[float]) -> None:
    """Each table's slot rank and scale (rank_table[slot:slot + 1] views and their values) for
    the kernels, in two calls, ordered on the current stream."""
    if rank_views:
        # Scales rounded to fp32 here, as torch's `fp32 * scale` rounds them.
        torch._foreach_copy_(rank_views, torch.tensor(ranks, dtype=torch.int32).split(1),
                             non_blocking=True)
        torch._foreach_copy_(scale_views, torch.tensor(scales, dtype=torch.float32).split(1),
                             non_blocking=True)
