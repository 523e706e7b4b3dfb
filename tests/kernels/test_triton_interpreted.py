"""Every Triton kernel check under Triton's CPU interpreter: CI has no GPU, so this is where it
sees the kernels and the model's kernel path.

Each check module runs once, in its own subprocess with TRITON_INTERPRET=1 (the variable must be
set before triton is imported, and the interpreter is patched there: triton_interpreter.py),
so neither leaks into other tests or the processes they start; as many run at once as there are
cores. Each check is its own test here.
Tiny shapes throughout; the GPU tests (tests/gpu) run the same checks at Llama-3-8B's shapes.

- lora_kernel_checks.py: the LoRA shrink and expand against the plain-torch reference, row
  bits across batches and mixtures, the layer path against the CPU's.
- paged_attention_checks.py: decode and prefill attention and the KV write against the
  reference (2 KV heads, head_dim 16, blocks of 4, decode splits of 32 in tiles of 16), and the
  CUDA attention path against the per-sequence CPU path.
- fused_ops_checks.py: residual add + RMSNorm, rotary + KV write, silu * up against the
  torch path they replace.
- decode_gemv_checks.py: the decode GEMV against a float64 x w^T (bit-exact on integer
  inputs), row bits across batches, weight views, refused inputs; a tiny tile and the default.
- decode_swiglu_checks.py: the decode GEMV's SwiGLU variant bit for bit against the GEMV then
  silu * up (every row count of the tile, bf16, fp16, fp32, ragged N and K, poisoned output),
  row bits across batches, refused inputs.
- model_kernel_checks.py: the whole model's kernel path (LORAD_TEST_KERNELS_ON_CPU) against
  its torch path on the same weights and steps, with three adapters; the SwiGLU epilogue's
  steps against the two launches' bits.
- token_draw_checks.py: the sampler's draw and running sum against float64 references, rows
  across batches, removed tokens, the distribution, and the sampler's use of it.
- sampler_min_p_checks.py: min_p on the sampler's kernel path keeps what its definition keeps,
  and rows draw what they draw alone.
- moe_kernel_checks.py: the fused MoE kernel against the torch path (poisoned buffers), a row's
  bits alone and among rows of the same experts, the expert tiles; a tiny Qwen2-MoE's kernel
  path with two adapters against its torch path, and through the decode graphs' inputs.
- moe_glue_checks.py: the MoE block's route, one-program tile tables and epilogue kernels bit
  for bit against the torch ops they replace (ties, padding rows, poisoned outputs), and the
  block's kernel path against its former composition.
- row_matmul_checks.py: the row-invariant matmul bit-exact on integer inputs, a row's bits
  alone and in products of any row count, refused inputs.
- oneshot_reduce_checks.py: the one-shot all-reduce's rank-ordered sum, alone and fused with
  add + RMSNorm, bit for bit against the reference at worlds 2 to 8; the flag barrier's halves,
  epochs and flags with the peers' part preset.
"""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.kernels import (decode_gemv_checks, decode_swiglu_checks, fused_ops_checks,
                           lora_kernel_checks, model_kernel_checks, moe_glue_checks,
                           moe_kernel_checks, oneshot_reduce_checks, paged_attention_checks,
                           row_matmul_checks, sampler_min_p_checks, token_draw_checks)
from tests.kernels.triton_interpreter import interpret_in_subprocess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra has it on Linux "
                                       "x86_64)")

MODULES = {module.__name__: module.CHECKS for module in (
    lora_kernel_checks, paged_attention_checks, fused_ops_checks, decode_gemv_checks,
    decode_swiglu_checks, model_kernel_checks, token_draw_checks, sampler_min_p_checks,
    moe_kernel_checks, moe_glue_checks, oneshot_reduce_checks, row_matmul_checks)}
# The modules' interpreter run times on a 2-core machine, longest first (2026-12-02: 118, 107,
# 54, 39, 22, 11 s; moe_kernel_checks 2026-12-05: 75 s): two runners finish together when the
# long runs start first.
SLOWEST_FIRST = ("tests.kernels.model_kernel_checks", "tests.kernels.lora_kernel_checks",
                 "tests.kernels.moe_kernel_checks", "tests.kernels.decode_gemv_checks",
                 "tests.kernels.paged_attention_checks", "tests.kernels.fused_ops_checks",
                 "tests.kernels.token_draw_checks")


# module -> its run: its results, or why it failed. Started by the first test of any module.
_runs: dict[str, Future] = {}


def _interpret(module: str) -> dict | str:
    try:
        return interpret_in_subprocess(module)
    except AssertionError as exc:
        return str(exc)


def _start_runs(session: pytest.Session) -> None:
    """Start the interpreter runs of every check module that the session's selected tests
    need, as many at once as this machine has cores (each run is one thread; CI has 2, and the
    runs took 308 s one after another there), the slowest first. Their tests then only wait.
    Not from the session's start, beside the tests before them: on a 2-core VM the suite took
    1,158 s with the runs there at nice 19 against 1,127 s without, and a daemon's test file
    2.2x as long beside two CPU-bound processes even at SCHED_IDLE in an autogroup of nice 19
    (2026-12-07)."""
    wanted = {item.callspec.params["module"] for item in session.items
              if getattr(item, "originalname", None) == "test_interpreted"}
    order = [m for m in SLOWEST_FIRST if m in wanted] + sorted(wanted - set(SLOWEST_FIRST))
    pool = ThreadPoolExecutor(max(1, min(len(order), len(os.sched_getaffinity(0)))))
    for module in order:
        _runs[module] = pool.submit(_interpret, module)
    pool.shutdown(wait=False)  # the threads end with their runs


def _results_of(module: str, session: pytest.Session) -> dict:
    if not _runs:
        _start_runs(session)
    results = _runs[module].result()
    if isinstance(results, str):
        pytest.fail(results, pytrace=False)
    return results


@pytest.mark.parametrize("module,name", [(module, name) for module, checks in MODULES.items()
                                         for name in checks])
def test_interpreted(module, name, request):
    results = _results_of(module, request.session)
    assert name in results, f"{name} did not run"
    outcome = results[name]["outcome"]
    assert outcome == "ok", f"{name} ({results[name]['seconds']} s) failed under the Triton " \
                            f"interpreter:\n{outcome}"
