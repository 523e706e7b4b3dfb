"""The LoRA shrink/expand kernels on CUDA at the 8B model's shapes (hidden 4096, intermediate
14336, rank 16, 64 adapters, batch 1..128, bf16 x): against the plain-torch reference, row bits
independent of the batch, nothing written without adapter rows, the layer path equal to the CPU
torch path, and a CUDA graph replaying any mixture with the eager bits; bf16 and fp16 tables
(adapters stored so) against the reference and bit for bit against fp32 tables of their values.

The checks are tests/kernels/lora_kernel_checks.py, the same the interpreter runs on tiny shapes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from tests.kernels.lora_kernel_checks import (GPU_SHAPES, Shape, check_block_groups_change_no_bit,
                                      check_block_widths_change_no_bit,
                                      check_chunk_groups_change_no_bit,
                                      check_exact_dot_keeps_every_bit,
                                      check_layer_path, check_matches_reference,
                                      check_narrow_tables_read_exactly, check_no_adapter_rows,
                                      check_rows_independent_of_batch, fill_lora_slots,
                                      make_tables, mixed_slots)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
]

BATCH_SIZES = (1, 7, 8, 9, 33, 128)


def check_cuda_graph_replay(device: str, shape: Shape, x_dtype: torch.dtype,
                            num_rows: int) -> None:
    """A graph captured with launch_always (tiles built inside it from the batch's slot tensor)
    replays any mixture, none included, with the bits of the eager kernel path."""
    from lorad.workers.lora import LoraSlots, add_lora_deltas
    from lorad.workers.lora_rows import LoraRows
    gen = torch.Generator().manual_seed(4)
    tables = make_tables(shape, gen, device)
    loras = []
    for i, (n, max_rank) in enumerate(zip(shape.out_features, shape.max_ranks)):
        lora = LoraSlots(shape.num_slots, max_rank, shape.in_features, n,
                         (0, shape.in_features), (0, n), torch.device(device))
        fill_lora_slots(lora, tables, i)
        loras.append(lora)

    def decode_batch(slots: list[int]) -> ForwardBatch:
        return ForwardBatch.build([([5], 0, [i], True, slot) for i, slot in enumerate(slots)],
                                  16, device)

    static = decode_batch([1] * num_rows)
    x = torch.zeros(num_rows, shape.in_features, dtype=x_dtype, device=device)
    outs = [torch.zeros(num_rows, n, dtype=x_dtype, device=device) for n in shape.out_features]

    def step(batch: ForwardBatch, always: bool) -> list[torch.Tensor]:
        return add_lora_deltas(loras, outs, x, LoraRows.from_batch(batch, launch_always=always))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static, True)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = step(static, True)
    mixtures = {
        "one adapter": [shape.num_slots - 1] * num_rows,
        "distinct adapters": [1 + i % (shape.num_slots - 1) for i in range(num_rows)],
        "mixed": mixed_slots(num_rows, shape.num_slots, gen).tolist(),
        "none": [0] * num_rows,
    }
    for name, slots in mixtures.items():
        batch = decode_batch(slots)
        x.copy_(torch.randn(num_rows, shape.in_features, generator=gen))
        bases = [torch.randn(num_rows, n, generator=gen).to(device, x_dtype)
                 for n in shape.out_features]
        for out, base in zip(outs, bases):
            out.copy_(base)
        want = [o.clone() for o in step(batch, False)] if any(slots) else bases
        for out, base in zip(outs, bases):
            out.copy_(base)
        static.row_adapter_slots.copy_(batch.row_adapter_slots)
        graph.replay()
        for i, (got, w) in enumerate(zip(graph_outs, want)):
            if not torch.equal(got, w):
                raise AssertionError(f"{name}: graph replay differs from eager, table {i}")


@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_matches_reference_bf16(name: str) -> None:
    check_matches_reference("cuda", GPU_SHAPES[name], torch.bfloat16, BATCH_SIZES)


def test_matches_reference_fp32_x() -> None:
    check_matches_reference("cuda", GPU_SHAPES["qkv"], torch.float32, (1, 8, 128))


@pytest.mark.parametrize("name", ["gate_up", "down"])
def test_matches_reference_few_programs(name: str) -> None:
    """Each program loops over many (tile, block[, K chunk]) items, as in a graph sized for any
    mixture; down's 14336 inputs make 28 K chunks."""
    check_matches_reference("cuda", GPU_SHAPES[name], torch.bfloat16, (64,), num_programs=7)


@pytest.mark.parametrize("name", ["qkv", "down", "ranks_to_64"])
def test_rows_independent_of_batch(name: str) -> None:
    check_rows_independent_of_batch("cuda", GPU_SHAPES[name], torch.bfloat16, num_rows=128,
                                    num_programs=(7, None))


def test_no_adapter_rows() -> None:
    check_no_adapter_rows("cuda", GPU_SHAPES["qkv"], torch.bfloat16)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_layer_path_equals_cpu_torch_path(x_dtype: torch.dtype) -> None:
    check_layer_path("cuda", GPU_SHAPES["qkv"], x_dtype)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replays_any_mixture(x_dtype: torch.dtype) -> None:
    check_cuda_graph_replay("cuda", GPU_SHAPES["qkv"], x_dtype, num_rows=64)


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down"])
def test_bf16_tables_match_reference(name: str) -> None:
    check_matches_reference("cuda", GPU_SHAPES[name], torch.bfloat16, (1, 33, 64),
                            table_dtype=torch.bfloat16)


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["qkv", "down"])
def test_narrow_tables_read_exactly(name: str, table_dtype: torch.dtype) -> None:
    x_dtype = torch.bfloat16 if table_dtype == torch.bfloat16 else torch.float16
    check_narrow_tables_read_exactly("cuda", GPU_SHAPES[name], x_dtype, table_dtype, num_rows=64)


def test_layer_path_with_bf16_tables() -> None:
    check_layer_path("cuda", GPU_SHAPES["qkv"], torch.bfloat16, table_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["qkv", "down"])
def test_chunk_groups_change_no_bit(name: str) -> None:
    """q/k/v's 8 and down's 28 K chunks taken one per work item or in groups, at batch 64."""
    check_chunk_groups_change_no_bit("cuda", GPU_SHAPES[name], torch.bfloat16, num_rows=64,
                                     targets=(1, 100, 800))


@pytest.mark.parametrize("name", ["qkv", "gate_up"])
def test_block_groups_change_no_bit(name: str) -> None:
    """The expand's blocks of outputs taken one per work item or in groups, at batch 64."""
    check_block_groups_change_no_bit("cuda", GPU_SHAPES[name], torch.bfloat16, num_rows=64,
                                     targets=(1, 100, 800))


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_block_widths_change_no_bit(name: str, table_dtype: torch.dtype) -> None:
    """The expand's blocks of 128 outputs (large steps) and 256 (small ones), and 64 and 512,
    give the same bits, at batch 64."""
    check_block_widths_change_no_bit("cuda", GPU_SHAPES[name], torch.bfloat16, num_rows=64,
                                     widths=(128, 256, 64, 512), table_dtype=table_dtype)


def test_exact_dot_keeps_every_bit() -> None:
    check_exact_dot_keeps_every_bit("cuda")
