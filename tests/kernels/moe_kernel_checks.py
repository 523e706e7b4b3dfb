"""Checks of the fused MoE kernel (lorad/workers/kernels/fused_moe.py) against the plain-torch
path it replaces (moe.routed_experts_torch), on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess;
tests/gpu/test_moe_kernel_gpu.py calls them on CUDA at Qwen1.5-MoE-A2.7B's expert shapes. Fresh
random inputs each time, the kernel's buffers poisoned with NaN (a pair never written shows), and
a row's bits alone against the same row among others that pick the same experts.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.triton_interpreter import run_checks
from tests.model_steps import rel_error

POISON = float("nan")
# max |kernel - torch| / max |torch| of the routed sum. fp32: the order of the fp32 sums only.
# bf16: the gate/up products round to bf16 before silu * up, so a sum in another order may move
# an element of h by one bf16 ulp; the down product carries that along.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
MODEL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # as model_kernel_checks.py's


def _inputs(device: str, dtype: torch.dtype, num_rows: int, hidden: int, inter: int,
            num_experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)
    x = rand(num_rows, hidden)
    gate_up = rand(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = rand(num_experts, hidden, inter, scale=inter ** -0.5)
    logits = torch.randn(num_rows, num_experts, generator=gen)
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, gate_up, down, weights.to(dtype=dtype, device=device), experts.to(device)


def _fused(x, gate_up, down, weights, experts, real_rows=None, buffers_out=None):
    """fused_moe with poisoned buffers (appended to buffers_out, a list, when given)."""
    from lorad.workers.kernels.fused_moe import fused_moe
    num_pairs = experts.numel()
    buffers = (torch.full((num_pairs, gate_up.shape[1] // 2), POISON, dtype=x.dtype,
                          device=x.device),
               torch.full((num_pairs, down.shape[1]), POISON, dtype=torch.float32,
                          device=x.device))
    if buffers_out is not None:
        buffers_out.extend(buffers)
    return fused_moe(x, gate_up, down, weights, experts, buffers=buffers, real_rows=real_rows)


def check_fused_moe(device: str, dtype: torch.dtype = torch.bfloat16, num_rows: int = 11,
                    hidden: int = 48, inter: int = 40, num_experts: int = 6, top_k: int = 3,
                    seed: int = 0) -> None:
    """fused_moe against the torch path, every pair written (no NaN left in the sum)."""
    from lorad.workers.moe import routed_experts_torch
    inputs = _inputs(device, dtype, num_rows, hidden, inter, num_experts, top_k, seed)
    got = _fused(*inputs).cpu()
    want = routed_experts_torch(*inputs).cpu()
    where = f"fused_moe {dtype} rows {num_rows} experts {num_experts} top {top_k}"
    if torch.isnan(got).any():
        raise AssertionError(f"{where}: {int(torch.isnan(got).any(1).sum())} rows kept poison")
    err = rel_error(got, want)
    if err > TOLERANCE[dtype]:
        raise AssertionError(f"{where}: relative error {err:.3g} over {TOLERANCE[dtype]}")


def check_rows_alone(device: str, dtype: torch.dtype = torch.bfloat16, num_rows: int = 20,
                     hidden: int = 48, inter: int = 40, num_experts: int = 4, top_k: int = 2,
                     seed: int = 1) -> None:
    """A row's bits alone, among the first rows, and among all: with 4 experts and top 2 an
    expert gets more than a tile of pairs, so the row's tile and lane move between the runs."""
    x, gate_up, down, weights, experts = _inputs(device, dtype, num_rows, hidden, inter,
                                                 num_experts, top_k, seed)
    whole = _fused(x, gate_up, down, weights, experts).cpu()
    half = _fused(x[:7], gate_up, down, weights[:7], experts[:7]).cpu()
    for row in range(num_rows):
        alone = _fused(x[row:row + 1], gate_up, down, weights[row:row + 1],
                       experts[row:row + 1]).cpu()[0]
        if not torch.equal(alone, whole[row]):
            raise AssertionError(f"row {row} ({dtype}): other bits alone than among "
                                 f"{num_rows} rows")
        if row < 7 and not torch.equal(alone, half[row]):
            raise AssertionError(f"row {row} ({dtype}): other bits alone than among 7 rows")


def check_expert_tiles(device: str, num_rows: int = 37, num_experts: int = 5, top_k: int = 3,
                       block_m: int = 16) -> None:
    """Every pair in exactly one tile, a tile's pairs all of its expert, at most block_m each;
    spare tiles marked -1 with no pairs."""
    from lorad.workers.kernels.fused_moe import expert_tiles
    gen = torch.Generator().manual_seed(2)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                           for _ in range(num_rows)]).sort(dim=1).values.to(device)
    order, tile_expert, start, count = (t.cpu() for t in expert_tiles(experts, num_experts,
                                                                          block_m))
    flat = experts.reshape(-1).cpu()
    seen = []
    for e, s, c in zip(tile_expert.tolist(), start.tolist(), count.tolist()):
        if e < 0:
            if c != 0:
                raise AssertionError("a spare tile has pairs")
            continue
        if not 0 < c <= block_m:
            raise AssertionError(f"a tile of expert {e} has {c} pairs")
        pairs = order[s:s + c]
        if not (flat[pairs] == e).all():
            raise AssertionError(f"a tile of expert {e} holds another expert's pairs")
        seen += pairs.tolist()
    if sorted(seen) != list(range(num_rows * top_k)):
        raise AssertionError("the tiles do not cover every pair exactly once")


def check_padding_rows(device: str, dtype: torch.dtype = torch.bfloat16, num_rows: int = 8,
                       num_real: int = 3, hidden: int = 48, inter: int = 40,
                       num_experts: int = 12, top_k: int = 2, seed: int = 4) -> None:
    """A padded step (num_real rows, then padding, as a decode step pads to MIN_ROWS): the
    padding rows pick experts no real row picks, and the tiles hold the real rows' experts and
    pairs only: the kernels write no padding pair (its poison stays in both buffers). The real
    rows' bits are those of the real rows alone (kernel and torch path), the padding rows'
    zeros."""
    from lorad.workers.kernels.fused_moe import expert_tiles
    from lorad.workers.moe import routed_experts_torch
    x, gate_up, down, weights, _ = _inputs(device, dtype, num_rows, hidden, inter, num_experts,
                                           top_k, seed)
    # Real rows among the first half of the experts, padding rows among the second.
    gen = torch.Generator().manual_seed(seed)
    half = num_experts // 2
    experts = torch.stack([torch.randperm(half, generator=gen)[:top_k]
                           + (0 if row < num_real else half) for row in range(num_rows)])
    experts = experts.sort(dim=1).values.to(device)
    real_rows = torch.arange(num_rows, device=device) < num_real
    where = f"padding rows ({dtype}, {num_real} real of {num_rows})"
    flat = experts.reshape(-1).cpu()
    padded = torch.where(real_rows[:, None], experts, num_experts)
    order, tile_expert, start, count = (t.cpu() for t in expert_tiles(padded, num_experts, 16))
    covered = sorted(p for e, s, c in zip(tile_expert.tolist(), start.tolist(), count.tolist())
                     if e >= 0 for p in order[s:s + c].tolist())
    if covered != list(range(num_real * top_k)):
        raise AssertionError(f"{where}: the tiles hold pairs {covered}")
    if set(tile_expert[tile_expert >= 0].tolist()) != set(flat[:num_real * top_k].tolist()):
        raise AssertionError(f"{where}: tiles of experts no real row picked")
    alone = _fused(x[:num_real], gate_up, down, weights[:num_real], experts[:num_real]).cpu()
    buffers = []
    fused = _fused(x, gate_up, down, weights, experts, real_rows, buffers).cpu()
    for buffer in buffers:  # h, then the weighted pairs (by position, by pair index)
        if not torch.isnan(buffer[num_real * top_k:].float()).all():
            raise AssertionError(f"{where}: a padding pair was computed")
        if torch.isnan(buffer[:num_real * top_k].float()).any():
            raise AssertionError(f"{where}: a real pair was not computed")
    for name, got, want in (
            ("fused_moe", fused, alone),
            ("torch path", routed_experts_torch(x, gate_up, down, weights, experts,
                                                real_rows).cpu(),
             routed_experts_torch(x[:num_real], gate_up, down, weights[:num_real],
                                  experts[:num_real]).cpu())):
        if not torch.equal(got[:num_real], want):
            raise AssertionError(f"{where}: {name}'s real rows differ from them alone")
        if not torch.equal(got[num_real:], torch.zeros_like(got[num_real:])):
            raise AssertionError(f"{where}: {name}'s padding rows are not zeros")


def _tiny_moe_models(dtype: torch.dtype, count: int) -> list:
    """`count` models of one tiny Qwen2-MoE (head_dim 16: the kernels want a power of two) with
    adapters on every servable projection (slot 1) and on o_proj + shared expert down (slot 2),
    each with its own KV pool."""
    import tempfile
    from pathlib import Path

    from tests.kernels.model_kernel_checks import BLOCK_SIZE, NUM_BLOCKS
    from tests.model_steps import build_model
    from tests.tiny_adapters import make_peft_adapter
    from tests.tiny_models import make_tiny_qwen2_moe
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_qwen2_moe(root / "moe", with_tokenizer=False, seed=9, hidden_size=96)
        adapters = [make_peft_adapter(base, root / "a", r=4, seed=41),
                    make_peft_adapter(base, root / "b", r=2, seed=42,
                                      target_modules=("o_proj", "shared_expert.down_proj"))]
        return [build_model(base, adapters, dtype, torch.device("cpu"), NUM_BLOCKS, BLOCK_SIZE)
                for _ in range(count)]


def check_decode_graph_inputs(device: str, dtype: torch.dtype) -> None:
    """On the kernel path, an MoE decode step through the decode graphs' static inputs (run
    eagerly, as on the CPU) gives the same bits as the plain step (model_kernel_checks.py's
    check, on the MoE family)."""
    from lorad.workers.cuda_graph import DecodeGraphs
    from tests.kernels.model_kernel_checks import (BLOCK_SIZE, MAX_LEN, NUM_BLOCKS, _forward,
                                                   _kernel_path)
    from tests.model_steps import make_streams
    assert device == "cpu"
    model, = _tiny_moe_models(dtype, 1)
    streams = make_streams([1, 2, 0, 1], [5, 3, 6, 4], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=7)
    graphs = DecodeGraphs(model, max_num_seqs=8, max_model_len=16, block_size=BLOCK_SIZE,
                          num_adapters=2)
    _forward(model, [s.prefill_chunk() for s in streams], kernels=True)
    chunks = [stream.decode_chunk(11) for stream in streams]
    with _kernel_path():
        via_inputs = graphs.run(chunks)
    if not torch.equal(via_inputs, _forward(model, chunks, kernels=True)):
        raise AssertionError(f"{dtype}: the MoE step through the graphs' inputs gave other bits")


def check_model_kernel_path(device: str, dtype: torch.dtype) -> None:
    """A tiny Qwen2-MoE with two adapters (every servable projection; o_proj and the shared
    expert's down_proj) on the kernel path (fused MoE, LoRA kernels, fused ops) against its
    torch path, step by step; and a decode row alone against the row in its batch there."""
    from tests.kernels.model_kernel_checks import BLOCK_SIZE, MAX_LEN, NUM_BLOCKS, _forward
    from tests.model_steps import make_streams, scenario_steps
    assert device == "cpu"
    models = dict(zip(("torch", "kernels"), _tiny_moe_models(dtype, 2)))
    steps = {path: scenario_steps(make_streams([1, 0, 2, 1], [9, 6, 4, 7], MAX_LEN, BLOCK_SIZE,
                                               NUM_BLOCKS, seed=5)) for path in models}
    for i, chunks in enumerate(steps["torch"]):
        want = _forward(models["torch"], chunks, kernels=False)
        got = _forward(models["kernels"], chunks, kernels=True)
        err = rel_error(got, want)
        if not torch.isfinite(got).all() or err > MODEL_TOLERANCE[dtype]:
            raise AssertionError(f"step {i} ({dtype}): kernel path vs torch path relative "
                                 f"error {err:.2e} over {MODEL_TOLERANCE[dtype]:.0e}")
    last = steps["kernels"][-1]
    alone = _forward(models["kernels"], last[:1], kernels=True)[0]
    if not torch.equal(alone, _forward(models["kernels"], last, kernels=True)[0]):
        raise AssertionError(f"{dtype}: a decode row's logits differ alone and in its batch")


def check_fold_epilogue(device: str, dtype: torch.dtype) -> None:
    """On the kernel path at one rank, the blocks' epilogue in the next residual add + norm's
    launch (MoeConfig.fold_epilogue) gives every step (prompt chunks, a mixed step, a decode) the
    logits of the epilogue's own launch, bit for bit (the interpreter fuses no multiply-add; on
    CUDA the norm may round otherwise: moe_glue_checks.check_epilogue_add_norm); the blocks
    return their sum unlaunched with it, a tensor without it."""
    from lorad.workers.lora_rows import LoraRows
    from lorad.workers.moe import MoeSum
    from lorad.workers.tuning import Tuning, replaced
    from tests.kernels.model_kernel_checks import (BLOCK_SIZE, MAX_LEN, NUM_BLOCKS, _forward,
                                                   _kernel_path)
    from tests.model_steps import make_streams, scenario_steps
    assert device == "cpu"
    folded, two = _tiny_moe_models(dtype, 2)
    folded.tune(replaced(Tuning(), "moe.fold_epilogue=True"))
    two.tune(replaced(Tuning(), "moe.fold_epilogue=False"))
    for model, kind in ((folded, MoeSum), (two, torch.Tensor)):
        block = model.model.layers[0].mlp
        x = torch.zeros(8, block.router_gate.shape[1], dtype=dtype)
        with _kernel_path():
            out, _ = block(x, LoraRows(slots=(), groups=[], pdl_rows=0))
        if not isinstance(out, kind):
            raise AssertionError(f"fold_epilogue {model is folded}: the block returned "
                                 f"{type(out).__name__}, not {kind.__name__}")
    steps = [scenario_steps(make_streams([1, 0, 2, 1], [9, 6, 4, 7], MAX_LEN, BLOCK_SIZE,
                                         NUM_BLOCKS, seed=8))[:4] for _ in range(2)]
    for i, (chunks, twin) in enumerate(zip(*steps)):
        got, want = _forward(folded, chunks, kernels=True), _forward(two, twin, kernels=True)
        if not torch.equal(got, want):
            raise AssertionError(f"step {i} ({dtype}): the folded epilogue gave other logits "
                                 f"(max {(got - want).abs().max().item():.2e})")


CHECKS = {
    "fused_moe_bf16": (check_fused_moe, dict(dtype=torch.bfloat16)),
    "fused_moe_fp32": (check_fused_moe, dict(dtype=torch.float32)),
    "fused_moe_many_tiles_fp32": (check_fused_moe, dict(dtype=torch.float32, num_rows=40,
                                                        num_experts=4, top_k=2, seed=3)),
    "fused_moe_rows_alone_bf16": (check_rows_alone, dict(dtype=torch.bfloat16)),
    "fused_moe_rows_alone_fp32": (check_rows_alone, dict(dtype=torch.float32)),
    "expert_tiles": (check_expert_tiles, {}),
    "fused_moe_padding_rows_bf16": (check_padding_rows, dict(dtype=torch.bfloat16)),
    "fused_moe_padding_rows_fp32": (check_padding_rows, dict(dtype=torch.float32, num_real=1)),
    "moe_model_kernel_path_fp32": (check_model_kernel_path, dict(dtype=torch.float32)),
    "moe_model_kernel_path_bf16": (check_model_kernel_path, dict(dtype=torch.bfloat16)),
    "moe_decode_graph_inputs_fp32": (check_decode_graph_inputs, dict(dtype=torch.float32)),
    "moe_fold_epilogue_bf16": (check_fold_epilogue, dict(dtype=torch.bfloat16)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
