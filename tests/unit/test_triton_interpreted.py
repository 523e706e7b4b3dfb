"""Every Triton kernel check under Triton's CPU interpreter: CI has no GPU, so this is where it
sees the kernels and the model's kernel path.

Each check module runs once, in its own subprocess with TRITON_INTERPRET=1 (the variable must be
set before triton is imported, and the interpreter is patched there: tests/triton_interpreter.py),
so neither leaks into other tests or the processes they start. Each check is its own test here.
Tiny shapes throughout; the GPU tests (tests/gpu) run the same checks at Llama-3-8B's shapes.

- tests/lora_kernel_checks.py: the LoRA shrink and expand against the plain-torch reference, row
  bits across batches and mixtures, the layer path against the CPU's.
- tests/paged_attention_checks.py: decode and prefill attention and the KV write against the
  reference (2 KV heads, head_dim 16, blocks of 4, decode splits of 32 in tiles of 16), and the
  CUDA attention path against the per-sequence CPU path.
- tests/fused_ops_checks.py: residual add + RMSNorm, rotary + KV write, silu * up against the
  torch path they replace; add + RMSNorm + LoRA shrink against add_rms_norm and lora_shrink.
- tests/decode_gemv_checks.py: the decode GEMV against a float64 x w^T (bit-exact on integer
  inputs), row bits across batches, weight views, refused inputs; a tiny tile and the default.
- tests/model_kernel_checks.py: the whole model's kernel path (LORAD_TEST_KERNELS_ON_CPU) against
  its torch path on the same weights and steps, with three adapters.
- tests/token_draw_checks.py: the sampler's draw and running sum against float64 references, rows
  across batches, removed tokens, the distribution, and the sampler's use of it.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests import (decode_gemv_checks, fused_ops_checks, lora_kernel_checks, model_kernel_checks,
                   paged_attention_checks, token_draw_checks)
from tests.triton_interpreter import interpret_in_subprocess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra has it on Linux "
                                       "x86_64)")

MODULES = {module.__name__: module.CHECKS for module in (
    lora_kernel_checks, paged_attention_checks, fused_ops_checks, decode_gemv_checks,
    model_kernel_checks, token_draw_checks)}
_results: dict[str, dict | str] = {}  # module -> its results, or why its run failed


def _results_of(module: str) -> dict:
    if module not in _results:
        try:
            _results[module] = interpret_in_subprocess(module)
        except AssertionError as exc:
            _results[module] = str(exc)
    if isinstance(_results[module], str):
        pytest.fail(_results[module], pytrace=False)
    return _results[module]


@pytest.mark.parametrize("module,name", [(module, name) for module, checks in MODULES.items()
                                         for name in checks])
def test_interpreted(module, name):
    results = _results_of(module)
    assert name in results, f"{name} did not run"
    outcome = results[name]["outcome"]
    assert outcome == "ok", f"{name} ({results[name]['seconds']} s) failed under the Triton " \
                            f"interpreter:\n{outcome}"
