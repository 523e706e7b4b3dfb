"""Next-token sampling on the leader: greedy, or temperature/top-k/top-p with a per-request seed.

Each request owns a CPU torch.Generator seeded at admission and draws exactly one uniform number
per sampled token, row by row, so its tokens never depend on which requests share the batch.
Warping follows transformers' order (temperature, then top-k, then top-p keeping at least one
token), in fp32. Grammar masks are not applied here yet.
"""

from __future__ import annotations

import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers.kernel_path import kernel_path

_SEED_MASK = (1 << 64) - 1  # torch seeds are unsigned 64-bit; any int from the wire maps into it
# On CUDA, rows with a temperature and no top-k or top-p (the API's defaults) drawn by one Triton
# launch (kernels/temperature_draw.py) instead of a handful of torch ops each. Off until a GPU run
# has passed tests/gpu/test_temperature_draw_gpu.py and test_sampler_gpu.py and measured it
# (scripts/bench_sampler.py --temperature-kernel); its draws follow the same distribution with
# other rounding.
TEMPERATURE_KERNEL = False


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, seed: int) -> None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed & _SEED_MASK)
        self._generators[request_id] = gen

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """logits: [num_sampled, vocab]; one id per row, in row order."""
        if not request_ids:
            return []
        logits = logits.float()
        drawn = [p.temperature != 0 for p in params]
        if not any(drawn):  # one argmax for the step: one launch on a GPU, not one per row
            return logits.argmax(dim=-1).tolist()
        chosen: list[torch.Tensor | None] = [None] * len(params)
        if not all(drawn):
            greedy = [i for i, d in enumerate(drawn) if not d]
            best = logits[greedy].argmax(dim=-1)  # [num_greedy]
            for i, token in zip(greedy, best.unbind()):
                chosen[i] = token
        self._draw([i for i, d in enumerate(drawn) if d], logits, request_ids, params, chosen)
        return torch.stack(chosen).tolist()

    def _draw(self, rows: list[int], logits: torch.Tensor, request_ids: list[str],
              params: list[SamplingParams], chosen: list) -> None:
        """Draw rows `rows` of logits into `chosen`: temperature-only rows in one launch of the
        kernel when TEMPERATURE_KERNEL is on, the others one at a time, each a 1-D row. The
        whole step at once through torch would be fewer launches, but its CUDA cumulative sum
        scans one row and several rows with different kernels (a device-wide scan, and a
        per-row kernel whose layout depends on the number of rows), so a row's sums, and with
        them its token, could change with its neighbours. The uniforms (one per row from its
        request's generator) reach the device in one copy: torch's blocking copy from host
        memory syncs the stream, so a copy per row could make each row wait for the rows before
        it to finish."""
        uniforms = torch.stack([
            torch.rand((), generator=self._generators[request_ids[i]], dtype=torch.float32)
            for i in rows]).to(logits.device)  # [len(rows)]
        vocab = logits.shape[1]
        use_kernel = TEMPERATURE_KERNEL and kernel_path(logits.device)
        plain = [j for j, i in enumerate(rows) if use_kernel
                 and not 0 < params[i].top_k < vocab and params[i].top_p >= 1.0]
        if plain:  # temperature only: one launch for all of them
            from lorad.workers.kernels.temperature_draw import temperature_draw
            temperatures = torch.tensor([params[rows[j]].temperature for j in plain],
                                        dtype=torch.float32, device=logits.device)
            picked = temperature_draw(logits[[rows[j] for j in plain]], temperatures,
                                      uniforms[plain])
            for j, token in zip(plain, picked.unbind()):
                chosen[rows[j]] = token
        for i, u in zip(rows, uniforms):
            if chosen[i] is None:
                p = params[i]
                probs = torch.softmax(warp(logits[i], p.temperature, p.top_k, p.top_p), dim=-1)
                chosen[i] = draw(probs, u)


def warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """row: [vocab] fp32 logits -> [vocab] logits with the removed tokens at -inf."""
    row = row / temperature
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))  # ties with the k-th stay, as in HF
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=False)  # [vocab], ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False  # keep at least the most likely token
        row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return row


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [vocab] fp32, u a scalar in [0, 1) -> the chosen index (scalar).

    The first index whose cumulative mass exceeds u * total always has non-zero probability, so
    a removed token can never be drawn.
    """
    cdf = probs.cumsum(dim=-1)  # [vocab]
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)  # [1]
    return index.clamp_(max=probs.shape[-1] - 1).reshape(())
