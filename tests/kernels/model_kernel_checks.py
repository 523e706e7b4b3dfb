"""The model's kernel path (the one CUDA runs) end to end on CPU tensors, under Triton's
interpreter, against the torch path on the same weights.

The kernel path is what `kernel_path()` selects on CUDA: one matmul for q/k/v and one for gate/up,
the LoRA shrink and expand kernels writing fp32 deltas that the next kernel adds, rotary fused
with the KV write, the paged attention kernels, add + RMSNorm and silu * up kernels. LORAD_TEST_KERNELS_ON_CPU
turns it on for CPU tensors (read at each call), so one process runs both paths.
test_triton_interpreted.py runs these checks in a subprocess with TRITON_INTERPRET=1.

Each check builds a tiny Llama with three adapters twice (one model per path, each with its own
KV pool) and runs the same steps through both: prompts in chunks, a step mixing a prompt chunk
with decodes, and decode steps mixing the base model and adapters. Every step's logits must agree
within the dtype's tolerance (the kernels sum in other orders), and a decode row's logits must be
the same bits alone as in a batch on the kernel path. The SwiGLU epilogue's check runs steps of
up to 16 rows with it on and off: the same bits, with and without gate/up adapters.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from tests.kernels.triton_interpreter import run_checks

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_LEN = 48
# max|kernel path - torch path| / max|torch path| per step
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@contextlib.contextmanager
def _kernel_path(on: bool = True):
    """The model's kernel path on CPU tensors for the block (LORAD_TEST_KERNELS_ON_CPU)."""
    from lorad.workers.kernel_path import KERNELS_ON_CPU_ENV
    if on:
        os.environ[KERNELS_ON_CPU_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(KERNELS_ON_CPU_ENV, None)


def _forward(model, chunks, kernels: bool) -> torch.Tensor:
    from lorad.workers.batch import ForwardBatch
    with _kernel_path(kernels):
        return model.forward(ForwardBatch.build(chunks, BLOCK_SIZE, "cpu"))


def _tiny_models(dtype: torch.dtype, count: int, seed: int, rank_step: int,
                 adapter_seed: int) -> list:
    """`count` models of one tiny Llama (4 query / 2 KV heads, hidden 64) with three adapters of
    ranks 2, 2 + rank_step, 2 + 2 * rank_step, each with its own KV pool."""
    from tests.model_steps import build_model
    from tests.tiny_adapters import make_peft_adapter
    from tests.tiny_models import make_tiny_llama
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=seed,
                                     hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2)
        adapters = [make_peft_adapter(checkpoint, root / f"a{i}", r=2 + rank_step * i,
                                      seed=adapter_seed + i, magnitude=0.2) for i in range(3)]
        return [build_model(checkpoint, adapters, dtype, torch.device("cpu"), NUM_BLOCKS,
                            BLOCK_SIZE) for _ in range(count)]


def check_kernel_path_matches_torch_path(device: str, dtype: torch.dtype,
                                         plans: bool = False) -> None:
    """plans: the kernel path's matmul plans measured first (matmul_plan.py; the CPU's matmul
    stands for cuBLAS there), then row_matmul given every odd row count, so that steps of both
    paths run (MKL gives row_matmul's bits at most counts of these shapes)."""
    from tests.model_steps import make_streams, scenario_steps
    assert device == "cpu"
    models = dict(zip(("torch", "kernels"), _tiny_models(dtype, 2, seed=4, rank_step=3,
                                                         adapter_seed=30)))
    if plans:
        with _kernel_path():
            measured = models["kernels"].plan_matmuls(16)
        for plan in measured.values():
            plan.cublas_rows[1::2] = False
        if not any(plan.num_cublas < 16 for plan in measured.values()):
            raise AssertionError("no plan takes row_matmul anywhere: the check checks nothing")
    streams = {path: make_streams([2, 0, 1, 3], [9, 6, 4, 7], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                                  seed=4) for path in models}
    steps = {path: scenario_steps(streams[path]) for path in models}
    assert steps["torch"] == steps["kernels"]
    for i, chunks in enumerate(steps["torch"]):
        want = _forward(models["torch"], chunks, kernels=False)
        got = _forward(models["kernels"], chunks, kernels=True)
        if not torch.isfinite(got).all():
            raise AssertionError(f"step {i}: the kernel path gave non-finite logits")
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > TOLERANCE[dtype]:
            raise AssertionError(f"step {i} ({dtype}): kernel path vs torch path relative error "
                                 f"{err:.2e} over {TOLERANCE[dtype]:.0e}")
    # A row's bits on the kernel path: the last decode step's first sequence (an adapter row)
    # rerun alone over the same KV (its token's K/V are rewritten with the same values), then
    # the whole step again. Both batches pad to the same 8 rows, so the CPU matmuls see one
    # shape; the kernels must not care what the other rows hold.
    last = steps["kernels"][-1]
    alone = _forward(models["kernels"], last[:1], kernels=True)[0]
    batched = _forward(models["kernels"], last, kernels=True)[0]
    if not torch.equal(alone, batched):
        raise AssertionError(f"{dtype}: a decode row's logits differ alone and in its batch "
                             f"(max {(alone - batched).abs().max().item():.2e})")


def check_deltas_in_place_match_deltas(device: str, dtype: torch.dtype,
                                       family: str = "llama") -> None:
    """On the kernel path, every step with its LoRA deltas added into the fused projections'
    outputs in place after the matmul (ExpandSteps.in_place_rows 1: every prompt step) gives
    the bits of the same steps with fp32 deltas left to rotary + KV write and silu * up
    (in_place_rows 0), adapters at strengths other than 1.0 too. family "qwen2_moe": q/k/v with
    biases, which go into the product before the delta either way. (On CPU tensors o_proj and
    down_proj add in place either way; tests/gpu/test_mixed_graphs_gpu.py checks them on CUDA.)"""
    import dataclasses

    from lorad.workers.batch import ForwardBatch
    from lorad.workers.kernels.configs import ExpandSteps
    from lorad.workers.lora_rows import LoraRows
    from lorad.workers.tuning import Tuning
    from tests.model_steps import make_streams, scenario_steps
    assert device == "cpu"
    if family == "qwen2_moe":
        from tests.kernels.moe_kernel_checks import _tiny_moe_models
        models, slots = _tiny_moe_models(dtype, 2), [2, 0, 1, 1]
    else:
        models = _tiny_models(dtype, 2, seed=5, rank_step=2, adapter_seed=50)
        slots = [2, 0, 1, 3]
    for model, rows in zip(models, (1, 0)):
        model.tune(dataclasses.replace(Tuning(), expand=ExpandSteps(in_place_rows=rows)))
    streams = [make_streams(slots, [9, 6, 4, 7], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=5,
                            strengths=[0.7, None, 1.3, 0.45]) for _ in models]
    # The prompt steps and one decode after them (reading their KV); decodes add no delta in place.
    steps = [scenario_steps(s)[:4] for s in streams]
    prompt_steps = 0
    for i, (chunks, twin) in enumerate(zip(*steps)):
        got, want = (_forward(model, c, kernels=True) for model, c in zip(models, (chunks, twin)))
        if not torch.equal(got, want):
            raise AssertionError(f"step {i} ({dtype}): in place gave other logits than the "
                                 f"deltas (max {(got - want).abs().max().item():.2e})")
        with _kernel_path():
            rows = LoraRows.from_batch(ForwardBatch.build(chunks, BLOCK_SIZE, "cpu"),
                                       tuning=models[0].tuning)
        prompt_steps += rows.in_place and bool(rows.slots)
    if not prompt_steps:
        raise AssertionError("no step added adapter deltas in place: the check checks nothing")


def check_decode_graph_inputs_match_plain_steps(device: str, dtype: torch.dtype) -> None:
    """On the kernel path, decode steps through the decode graphs' static inputs (run eagerly,
    as on the CPU: the LoRA row tiles come from those inputs, filled on the host) give the same
    bits as the plain step, whose tiles are built from its chunks: a step of three adapters
    (one of them on two rows) and the base model. (tests/unit/test_decode_graphs.py checks the
    tiles the inputs hold over many steps.)"""
    from lorad.workers.cuda_graph import DecodeGraphs
    from tests.model_steps import make_streams
    assert device == "cpu"
    model, = _tiny_models(dtype, 1, seed=6, rank_step=2, adapter_seed=40)
    streams = make_streams([1, 2, 0, 3, 1], [5, 3, 6, 4, 2], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                           seed=6)
    graphs = DecodeGraphs(model, max_num_seqs=8, max_model_len=16, block_size=BLOCK_SIZE,
                          num_adapters=3)
    _forward(model, [s.prefill_chunk() for s in streams], kernels=True)
    chunks = [stream.decode_chunk(11) for stream in streams]
    with _kernel_path():
        via_inputs = graphs.run(chunks)
    plain = _forward(model, chunks, kernels=True)  # the same K/V again
    if not torch.equal(via_inputs, plain):
        raise AssertionError(f"{dtype}: the graphs' inputs gave other bits (max "
                             f"{(via_inputs - plain).abs().max().item():.2e})")


def _swiglu_steps(streams) -> list[list]:
    """Steps of at most 16 rows (the decode GEMV's): the first two streams' prompts, the
    others', a decode of all four, a decode of the first two."""
    s0, s1, s2, s3 = streams
    steps = [[s0.prefill_chunk(), s1.prefill_chunk()], [s2.prefill_chunk(), s3.prefill_chunk()],
             [s.decode_chunk(20) for s in streams], [s0.decode_chunk(21), s1.decode_chunk(21)]]
    return [[list(chunk) for chunk in step] for step in steps]


def check_swiglu_epilogue(device: str, dtype: torch.dtype, family: str = "llama") -> None:
    """On the kernel path, silu(gate) * up in the decode GEMV's epilogue
    (GemvModelTiles.swiglu_epilogue) gives every step the bits of the two launches (the switch
    off), and the torch path's logits within the tolerance; it is taken in the steps where no
    row's adapter edits gate or up (base rows; qwen2_moe: slot 2, on o_proj and the shared
    expert's down only, beside them) and not in the others, in every MLP (dense and shared
    expert)."""
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.fused_linear import MergedColumnParallelLinear
    from lorad.workers.lora_rows import LoraRows
    from lorad.workers.tuning import Tuning, replaced
    from tests.model_steps import make_streams, rel_error
    assert device == "cpu"
    if family == "qwen2_moe":
        from tests.kernels.moe_kernel_checks import _tiny_moe_models
        models, slots = _tiny_moe_models(dtype, 3), [0, 2, 1, 0]
        # slot: whether its adapter edits gate/up (slot 2's does not)
        edits = {0: False, 1: True, 2: False}
    else:
        models, slots = _tiny_models(dtype, 3, seed=7, rank_step=2, adapter_seed=60), [0, 0, 1, 3]
        edits = {0: False, 1: True, 3: True}
    torch_model, fused, two = models
    two.tune(replaced(Tuning(), "gemv.swiglu_epilogue=False"))
    streams = [make_streams(slots, [5, 4, 6, 3], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=7)
               for _ in models]
    gate_ups = [m for m in fused.modules() if isinstance(m, MergedColumnParallelLinear)]
    taken = set()
    for i, (chunks, *_) in enumerate(zip(*(_swiglu_steps(s) for s in streams))):
        batch = ForwardBatch.build(chunks, BLOCK_SIZE, "cpu")
        with _kernel_path():
            rows = LoraRows.from_batch(batch, tuning=fused.tuning)
            x = torch.zeros(batch.row_adapter_slots.shape[0], gate_ups[0].in_features,
                            dtype=dtype)
            chosen = {layer.swiglu_in_gemv(x, rows) for layer in gate_ups}
        expected = not any(edits[chunk[4]] for chunk in chunks)
        if chosen != {expected}:
            raise AssertionError(f"step {i} (slots {[c[4] for c in chunks]}): the epilogue "
                                 f"chosen {chosen} in its MLPs, expected {expected}")
        taken.add(expected)
        got = _forward(fused, chunks, kernels=True)
        want = _forward(two, chunks, kernels=True)
        if not torch.equal(got, want):
            raise AssertionError(f"step {i} ({dtype}, {family}, epilogue {expected}): other "
                                 f"logits than the two launches' (max "
                                 f"{(got - want).abs().max().item():.2e})")
        err = rel_error(got, _forward(torch_model, chunks, kernels=False))
        if not torch.isfinite(got).all() or err > TOLERANCE[dtype]:
            raise AssertionError(f"step {i} ({dtype}, {family}): kernel path vs torch path "
                                 f"relative error {err:.2e} over {TOLERANCE[dtype]:.0e}")
    if taken != {True, False}:
        raise AssertionError(f"the steps took the epilogue only {taken}: the check checks less")


CHECKS = {
    "kernel_path_fp32": (check_kernel_path_matches_torch_path, dict(dtype=torch.float32)),
    "kernel_path_bf16": (check_kernel_path_matches_torch_path, dict(dtype=torch.bfloat16)),
    "kernel_path_planned_bf16": (check_kernel_path_matches_torch_path,
                                 dict(dtype=torch.bfloat16, plans=True)),
    "deltas_in_place_bf16": (check_deltas_in_place_match_deltas, dict(dtype=torch.bfloat16)),
    "deltas_in_place_qwen2_moe_bf16": (check_deltas_in_place_match_deltas,
                                       dict(dtype=torch.bfloat16, family="qwen2_moe")),
    "decode_graph_inputs_fp32": (check_decode_graph_inputs_match_plain_steps,
                                 dict(dtype=torch.float32)),
    "swiglu_epilogue_bf16": (check_swiglu_epilogue, dict(dtype=torch.bfloat16)),
    "swiglu_epilogue_qwen2_moe_fp32": (check_swiglu_epilogue,
                                       dict(dtype=torch.float32, family="qwen2_moe")),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
