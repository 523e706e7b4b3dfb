"""Running Triton kernel checks on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).

The check modules (lora_kernel_checks.py, paged_attention_checks.py) run in a subprocess through
`run_checks`, so the interpreter setting never leaks into other tests. Three faults of triton's
interpreter and one slowness are patched for that process only.
"""

from __future__ import annotations

import json
import os
import time
import traceback


def patch_triton_interpreter() -> None:
    """- it turns a loop bound into an int with int() on a 1-element array, which numpy 2.4
      refuses (triton-lang/triton#9171; the fix upstream squeezes first);
    - tl.dot multiplies bf16 operands as their raw uint16 bits; widen them to fp32 first (exact);
      and it hands numpy's matmul a transposed operand (tl.trans) as a strided view, for which
      BLAS sums in another order than for the same values laid out plainly: give it both operands
      contiguous, so that equal values give equal bits whichever way they were made (an MMA on
      the GPU does not see the layout either); and where both are fp32 it sums each element in
      one order whatever its place (see patched_dot);
    - fp32 -> bf16 casts truncate, where the GPU rounds to nearest even; round as torch does;
    - (speed) it patches triton.language again at every call of a jit function from a kernel, once
      per program and call (tens of thousands in a model check, half of its run spent in
      inspect.getmembers), though the launch has patched it for its whole run: patch each
      language module once per launch, and restore them all at its end.
    """
    import inspect

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype == tl.bfloat16:
            return interpreter.TensorHandle(np.ascontiguousarray(
                (x.data.astype(np.uint32) << 16).view(np.float32)), tl.float32)
        return interpreter.TensorHandle(np.ascontiguousarray(x.data), x.dtype.scalar)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = widen(a), widen(b)
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        # Every output element summed over K in one order, whatever its place in the tile:
        # BLAS's sgemm (what np.matmul calls) sums an element at a tile's edge in another order
        # than one inside it on some CPUs (OpenBLAS's Haswell kernels on an AMD EPYC), so a row's
        # bits would move with its lane, which an MMA on the GPU never does. The products are
        # exact in float64 (fp32 x fp32), added one K slice after another, rounded to fp32 once.
        products = (a.data.astype(np.float64)[..., :, :, None]
                    * b.data.astype(np.float64)[..., None, :, :])  # [..., M, K, N]
        total = np.add.reduce(products, axis=-2).astype(np.float32)
        return interpreter.TensorHandle(total + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = patched_dot
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            import torch
            wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = patched_cast
    patch_lang = interpreter._patch_lang
    # While a launch runs: its scope, then those of the jit functions that reached a language
    # module it had not patched (triton's own, such as tl.zeros, reach triton.language.core),
    # restored in reverse at its end; and the modules patched so far.
    scopes, patched = [], set()
    reached = {}  # jit function -> the language modules its globals hold

    class LaunchScope:
        def restore(self) -> None:  # the launch's end (GridExecutor restores in a finally)
            while scopes:
                scopes.pop().restore()
            patched.clear()

    launch_scope = LaunchScope()

    def patched_patch_lang(fn):
        if fn not in reached:
            reached[fn] = {id(v) for v in fn.__globals__.values()
                           if inspect.ismodule(v) and v in (tl, tl.core)}
        if not scopes or not reached[fn] <= patched:
            scopes.append(patch_lang(fn))
            patched.update(reached[fn])
        return launch_scope

    interpreter._patch_lang = patched_patch_lang


def probe_device(tool: str) -> str | None:
    """Where a probe of the kernels runs: "cuda", or "cpu" under TRITON_INTERPRET=1 (the
    interpreter patched, one torch thread); None, with a line on stderr naming `tool`, when
    neither is there."""
    import sys

    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        patch_triton_interpreter()
        torch.set_num_threads(1)
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    print(f"{tool}: needs CUDA, or TRITON_INTERPRET=1 for the CPU", file=sys.stderr)
    return None


def run_checks(checks: dict, names: list[str]) -> int:
    """Run the named checks (all by default) on CPU tensors; print one JSON line:
    name -> {"outcome": "ok" or the failure, "seconds"}."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    patch_triton_interpreter()
    results = {}
    for name in names or list(checks):
        check, kwargs = checks[name]
        start = time.perf_counter()
        try:
            check(device="cpu", **kwargs)
            outcome = "ok"
        except Exception:  # every failure is reported by name, the others still run
            outcome = traceback.format_exc(limit=-3)
        results[name] = {"outcome": outcome, "seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps(results))
    return 0


def interpret_in_subprocess(module: str, timeout_s: float = 600) -> dict[str, dict]:
    """Run `python -m module` (a check module calling run_checks) with TRITON_INTERPRET=1 and
    one thread, from the repository root; -> its results by check name. Raises AssertionError
    with the subprocess's stderr when it did not report."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(f"the interpreter run of {module} failed (exit {proc.returncode}):"
                             f"\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
