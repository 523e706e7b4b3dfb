"""Checks of min_p on the sampler's kernel path (Sampler._draw with warp_rows and token_draw), on
any device: a row draws only tokens that min_p's definition keeps (min_p 1 leaves the argmax),
beside top-k/top-p rows, greedy rows and plain rows, and every row draws what it draws alone.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess;
tests/gpu/test_logits_processors_gpu.py calls them on CUDA at Llama 3's vocabulary.
"""

from __future__ import annotations

import os
import sys

import torch

from tests.kernels.triton_interpreter import run_checks

CPU_VOCAB = 2500
GPU_VOCAB = 128256


def _kept_by_min_p(row: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    """The definition in float64: probabilities after temperature, at least min_p x the max."""
    probs = torch.softmax(row.double() / temperature, dim=-1)
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


def check_min_p_on_the_kernel_path(device: str, vocab: int = CPU_VOCAB, **_) -> None:
    from lorad.protocol.messages import SamplingParams
    from lorad.workers import sampler as sampler_module
    from lorad.workers.kernel_path import KERNELS_ON_CPU_ENV

    def sp(temperature, top_k=0, top_p=1.0, min_p=0.0):
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0,
                              max_tokens=8, stop_token_ids=[], ignore_eos=False, min_p=min_p)

    params = [sp(1.0, min_p=1.0), sp(0.0), sp(1.2, min_p=0.2), sp(0.9),
              sp(1.0, top_k=30, top_p=0.9, min_p=0.05), sp(0.8, top_p=0.95)]
    gen = torch.Generator().manual_seed(3)
    ids = [f"r{i}" for i in range(len(params))]
    previous = os.environ.get(KERNELS_ON_CPU_ENV)
    os.environ[KERNELS_ON_CPU_ENV] = "1"  # the kernel path on CPU tensors, as the checks run
    try:
        for seed in range(6):
            logits = (torch.randn(len(params), vocab, generator=gen) * 3).to(device)
            together = sampler_module.Sampler()
            for rid in ids:
                together.add(rid, seed)
            tokens = together.sample(logits, ids, params)
            assert tokens[0] == int(logits[0].argmax()), seed
            assert tokens[1] == int(logits[1].argmax()), seed
            assert tokens[2] in _kept_by_min_p(logits[2].cpu(), 1.2, 0.2), seed
            assert tokens[4] in _kept_by_min_p(logits[4].cpu(), 1.0, 0.05), seed
            for i in range(len(params)):  # alone, and with one neighbour, the same token
                for rows in ([i], sorted({i, (i + 3) % len(params)})):
                    alone = sampler_module.Sampler()
                    for j in rows:
                        alone.add(ids[j], seed)
                    got = alone.sample(logits[rows], [ids[j] for j in rows],
                                       [params[j] for j in rows])
                    assert got[rows.index(i)] == tokens[i], (seed, i, rows)
    finally:
        if previous is None:
            os.environ.pop(KERNELS_ON_CPU_ENV, None)
        else:
            os.environ[KERNELS_ON_CPU_ENV] = previous


CHECKS = {"min_p_on_the_kernel_path": (check_min_p_on_the_kernel_path, {})}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
