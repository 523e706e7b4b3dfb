"""Checks of the sampler's GPU sums (lorad/workers/kernels/token_draw.py): the draw and the
cumulative sum against float64 torch references, on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a
subprocess, at a vocabulary of three chunks of 1024 (the last partial); tests/gpu/
test_token_draw_gpu.py calls them on CUDA at Llama 3's vocabulary and the kernel's own chunk.
Each check raises AssertionError naming what differed. The kernel module is imported inside the
checks, after the interpreter is set.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.triton_interpreter import run_checks

CPU_VOCAB = 2500
CPU_CHUNK = 1024
GPU_VOCAB = 128256


def _kernels():
    from lorad.workers.kernels import token_draw
    return token_draw


def _chunk_or_default(chunk: int | None) -> int:
    return chunk or _kernels().CHUNK


def _draw(logits, temperatures, uniforms, chunk):
    return _kernels().draw_tokens(logits, temperatures, uniforms, chunk=_chunk_or_default(chunk))


def _masses(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[n, vocab] float64 exp(logit / t - max): the unnormalised probabilities."""
    scaled = logits.double() / temperatures.double()[:, None]
    return torch.exp(scaled - scaled.max(dim=1, keepdim=True).values)


def _inputs(num_rows: int, vocab: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    temperatures = 0.3 + torch.rand(num_rows, generator=gen) * 1.5
    return logits.to(device), temperatures.to(device)


def _midpoint_uniforms(masses: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row a token of probability >= 1e-4, and the uniform at the middle of its share
    of the CDF: -> (tokens [n], uniforms [n] float32). Any summation order lands in that token."""
    gen = torch.Generator().manual_seed(seed)
    masses = masses.cpu()
    total = masses.sum(dim=1)
    tokens, uniforms = [], []
    for row, row_total in zip(masses, total):
        candidates = torch.nonzero(row / row_total >= 1e-4).flatten()
        token = int(candidates[torch.randint(len(candidates), (), generator=gen)])
        before = row[:token].sum()
        tokens.append(token)
        uniforms.append(float((before + row[token] / 2) / row_total))
    return torch.tensor(tokens), torch.tensor(uniforms, dtype=torch.float32)


def check_matches_reference(device: str, vocab: int = CPU_VOCAB,
                            chunk: int | None = CPU_CHUNK) -> None:
    logits, temperatures = _inputs(9, vocab, device, seed=1)
    tokens, uniforms = _midpoint_uniforms(_masses(logits, temperatures), seed=2)
    drawn = _draw(logits, temperatures, uniforms.to(device), chunk).cpu()
    assert drawn.dtype == torch.int64 and drawn.shape == (9,)
    assert torch.equal(drawn, tokens), (drawn.tolist(), tokens.tolist())


def check_rows_do_not_depend_on_the_batch(device: str, vocab: int = CPU_VOCAB,
                                          chunk: int | None = CPU_CHUNK) -> None:
    logits, temperatures = _inputs(6, vocab, device, seed=3)
    uniforms = torch.rand(6, generator=torch.Generator().manual_seed(4)).to(device)
    together = _draw(logits, temperatures, uniforms, chunk).cpu()
    for i in range(6):
        alone = _draw(logits[i:i + 1], temperatures[i:i + 1], uniforms[i:i + 1], chunk).cpu()
        assert int(alone) == int(together[i]), (i, int(alone), int(together[i]))
    # The same rows in another order, and inside a strided view of a wider buffer.
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    shuffled = _draw(logits[order.to(device)], temperatures[order.to(device)],
                     uniforms[order.to(device)], chunk).cpu()
    assert torch.equal(shuffled, together[order])
    wide = torch.zeros(6, vocab + 37, device=device)
    wide[:, :vocab] = logits
    assert torch.equal(_draw(wide[:, :vocab], temperatures, uniforms, chunk).cpu(), together)


def check_never_draws_a_removed_token(device: str, vocab: int = CPU_VOCAB,
                                      chunk: int | None = CPU_CHUNK) -> None:
    """-inf logits (tokens a mask removed) get no mass: neither the smallest uniform nor the
    largest lands on them, whichever chunks they fill."""
    size = _chunk_or_default(chunk)
    assert vocab > 2 * size + 1
    logits, temperatures = _inputs(5, vocab, device, seed=5)
    logits[0, :size + size // 2] = float("-inf")  # the first chunk and a half gone
    logits[1, 1:] = float("-inf")  # one token left
    logits[2, :-1] = float("-inf")  # only the last token, in the partial chunk
    logits[3, size:] = float("-inf")  # everything past the first chunk gone
    logits[4, size:2 * size] = float("-inf")  # a whole chunk gone between two with mass
    for u in (0.0, 0.5, 1.0 - 2.0 ** -24):
        uniforms = torch.full((5,), u, dtype=torch.float32, device=device)
        drawn = _draw(logits, temperatures, uniforms, chunk).cpu().tolist()
        finite = torch.isfinite(logits.cpu())
        assert all(bool(finite[row, token]) for row, token in enumerate(drawn)), (u, drawn)
        assert drawn[1] == 0 and drawn[2] == vocab - 1, (u, drawn)
        if u == 0.0:  # the first token with mass
            assert drawn[0] == size + size // 2 and drawn[3] == 0 and drawn[4] == 0, drawn


def check_follows_the_distribution(device: str, vocab: int = CPU_VOCAB,
                                   chunk: int | None = CPU_CHUNK) -> None:
    """Uniforms on an even grid draw each token about as often as its probability says, and a
    near-zero temperature draws the largest logit."""
    size = _chunk_or_default(chunk)
    likely = (17, size + 6, vocab - 2)  # most of the mass, in three chunks
    gen = torch.Generator().manual_seed(6)
    row = torch.randn(vocab, generator=gen) * 0.5  # at most about 2.5
    row[list(likely)] = torch.tensor([9.0, 8.5, 8.0])
    count = 200
    logits = row.expand(count, vocab).contiguous().to(device)
    temperatures = torch.ones(count, device=device)
    uniforms = ((torch.arange(count) + 0.5) / count).to(device)
    drawn = _draw(logits, temperatures, uniforms, chunk).cpu()
    probs = torch.softmax(row.double(), dim=0)
    for token in likely:
        expected = float(probs[token]) * count
        got = int((drawn == token).sum())
        assert abs(got - expected) <= 2, (token, got, expected)
    cold = torch.full((20,), 0.01, device=device)
    drawn_cold = _draw(logits[:20], cold, uniforms[::count // 20], chunk).cpu()
    assert bool((drawn_cold == 17).all()), drawn_cold  # 0.5 / 0.01: 50 nats ahead of the next


def check_cumulative_sum(device: str, vocab: int = CPU_VOCAB,
                         chunk: int | None = CPU_CHUNK) -> None:
    """Running sums against float64, and the same bits for a row alone, among others and again."""
    gen = torch.Generator().manual_seed(8)
    x = (torch.rand(5, vocab, generator=gen) / vocab).to(device)
    x[1, 3:] = 0.0
    size = _chunk_or_default(chunk)
    together = _kernels().cumulative_sum(x, chunk=size)
    reference = x.double().cumsum(dim=1)
    assert torch.allclose(together.double(), reference, rtol=1e-5, atol=1e-7), \
        float((together.double() - reference).abs().max())
    assert torch.equal(together[1, 3:], together[1, 2:3].expand(vocab - 3))
    assert torch.equal(_kernels().cumulative_sum(x, chunk=size), together)
    for i in range(5):
        assert torch.equal(_kernels().cumulative_sum(x[i:i + 1].contiguous(), chunk=size)[0],
                           together[i]), i


def check_warp_rows(device: str, vocab: int = CPU_VOCAB,
                    chunk: int | None = CPU_CHUNK) -> None:
    """The kernel path's warp of a step's rows: each row's bits the same alone and among others,
    and the tokens it keeps those that float64 top-k and top-p keep (the CPU path's warp agrees;
    ties at the k-th value stay)."""
    from lorad.workers import sampler as sampler_module
    temperatures = [0.7, 1.0, 1.3, 0.9, 1.0, 0.5, 1.0]
    top_ks = [0, 40, 5, 0, 1, vocab, 0]  # vocab: none
    top_ps = [0.9, 1.0, 0.5, 0.95, 1.0, 0.8, 1.0]
    logits, _ = _inputs(len(top_ks), vocab, device, seed=9)
    logits[1, :3] = logits[1].max()  # three tokens tied at the top of a top-k row
    logits[6, 7] = -300.0  # its exp underflows to 0, but with neither top-k nor top-p it stays
    args = (torch.tensor(temperatures, device=device), torch.tensor(top_ks, device=device),
            torch.tensor(top_ps, device=device))
    together = sampler_module.warp_rows(logits, *args, 40, True)
    for i in range(len(top_ks)):
        alone = sampler_module.warp_rows(logits[i:i + 1], *(a[i:i + 1] for a in args),
                                         max(top_ks[i] if top_ks[i] < vocab else 0, 0),
                                         top_ps[i] < 1.0)
        assert torch.equal(alone[0], together[i]), i
        row = logits[i].cpu().double() / temperatures[i]
        keep = torch.ones(vocab, dtype=torch.bool)
        if 0 < top_ks[i] < vocab:
            keep &= row >= torch.topk(row, top_ks[i]).values[-1]
        if top_ps[i] < 1.0:
            masked = row.masked_fill(~keep, float("-inf"))
            ordered = torch.sort(masked, descending=True)
            probs = torch.softmax(ordered.values, dim=0)
            before = probs.cumsum(dim=0) - probs
            kept = torch.zeros(vocab, dtype=torch.bool)
            kept[ordered.indices[before < top_ps[i]]] = True
            keep &= kept
        got = torch.isfinite(together[i].cpu())
        assert torch.equal(got, keep), (i, int(got.sum()), int(keep.sum()))
        cpu = sampler_module.warp(logits[i].cpu(), temperatures[i], top_ks[i], top_ps[i])
        assert torch.equal(torch.isfinite(cpu), keep), i
        finite = together[i].cpu()[got]
        assert torch.equal(finite, (logits[i].cpu() / temperatures[i])[got]), i
    assert int(torch.isfinite(together[1]).sum()) == 40  # the tie at the top: still 40


def check_the_sampler_uses_it(device: str, vocab: int = CPU_VOCAB,
                              chunk: int | None = CPU_CHUNK) -> None:
    """On the kernel path a step's drawn rows take one draw with their uniforms in row order, the
    top-k and top-p rows warped first (then at temperature 1), and the warp keeps the tokens a
    float64 top-k and top-p keep; greedy rows take the argmax. The sampler uses the kernel's own
    chunk (`chunk` is not used)."""
    import os

    from lorad.protocol.messages import SamplingParams
    from lorad.workers import sampler as sampler_module
    from lorad.workers.kernel_path import KERNELS_ON_CPU_ENV

    def sp(temperature, top_k=0, top_p=1.0):
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0,
                              max_tokens=8, stop_token_ids=[], ignore_eos=False)

    params = [sp(0.8), sp(0.0), sp(1.0, top_k=20), sp(1.3), sp(0.7, top_p=0.9), sp(1.0)]
    logits, _ = _inputs(len(params), vocab, device, seed=7)
    ids = [f"r{i}" for i in range(len(params))]
    drawn_rows = [0, 2, 3, 4, 5]
    previous = os.environ.get(KERNELS_ON_CPU_ENV)
    os.environ[KERNELS_ON_CPU_ENV] = "1"  # the kernel path on CPU tensors, as the checks run
    try:
        sampler_module.warm_up(logits)  # the engine's, on this path (it must not raise)
        warped = logits[drawn_rows].clone()
        warped[[1, 3]] = sampler_module.warp_rows(
            logits[[2, 4]], torch.tensor([1.0, 0.7], device=device),
            torch.tensor([20, 0], device=device), torch.tensor([1.0, 0.9], device=device), 20,
            True)
        top_k = torch.topk(logits[2].cpu(), 20).indices
        ordered = torch.sort(logits[4].cpu().double() / 0.7, descending=True)
        before = torch.softmax(ordered.values, dim=0).cumsum(dim=0) - \
            torch.softmax(ordered.values, dim=0)
        top_p = ordered.indices[before < 0.9]  # the smallest prefix holding 0.9 of the mass
        for j, kept in ((1, top_k), (3, top_p)):
            assert torch.equal(torch.isfinite(warped[j].cpu()).nonzero().flatten(),
                               kept.sort().values), j
        temperatures = torch.tensor([0.8, 1.0, 1.3, 1.0, 1.0], device=device)
        def fresh_step(step_rows, seed):
            """A new sampler's step over logits[step_rows], every request seeded `seed` ->
            (its tokens, the uniform a drawn row uses: any request's first, as all share the
            seed)."""
            sampler = sampler_module.Sampler()
            for i in step_rows:
                sampler.add(ids[i], seed)
            tokens = sampler.sample(logits[step_rows], [ids[i] for i in step_rows],
                                    [params[i] for i in step_rows])
            first = torch.rand((), generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float32)
            return tokens, first.to(device)

        for seed in (11, 12):
            tokens, u = fresh_step(list(range(len(params))), seed)
            expected = _draw(warped, temperatures, u.repeat(len(drawn_rows)), None).cpu().tolist()
            assert [tokens[i] for i in drawn_rows] == expected, (tokens, expected)
            assert tokens[1] == int(logits[1].argmax())
        # Temperature-only rows alone: drawn from the logits themselves, not a copy.
        plain_rows = [0, 3, 5]
        tokens, u = fresh_step(plain_rows, 13)
        expected = _draw(logits[plain_rows], torch.tensor([0.8, 1.3, 1.0], device=device),
                         u.repeat(3), None).cpu().tolist()
        assert tokens == expected, (tokens, expected)
        # Every drawn row warped (warp_rows on the rows themselves, no scatter), alone and with a
        # greedy row beside them; each row's token as in the mixed step above.
        for step_rows in ([2, 4], [2, 1, 4]):
            tokens, u = fresh_step(step_rows, 14)
            expected = _draw(warped[[1, 3]], torch.ones(2, device=device), u.repeat(2),
                             None).cpu().tolist()
            drawn = [token for i, token in zip(step_rows, tokens) if i != 1]
            assert drawn == expected, (step_rows, tokens, expected)
            if 1 in step_rows:
                assert tokens[step_rows.index(1)] == int(logits[1].argmax())
    finally:
        if previous is None:
            os.environ.pop(KERNELS_ON_CPU_ENV, None)
        else:
            os.environ[KERNELS_ON_CPU_ENV] = previous


CHECKS = {
    "matches_reference": (check_matches_reference, {}),
    "rows_do_not_depend_on_the_batch": (check_rows_do_not_depend_on_the_batch, {}),
    "never_draws_a_removed_token": (check_never_draws_a_removed_token, {}),
    "follows_the_distribution": (check_follows_the_distribution, {}),
    "cumulative_sum": (check_cumulative_sum, {}),
    "warp_rows": (check_warp_rows, {}),
    "the_sampler_uses_it": (check_the_sampler_uses_it, {}),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
