"""Next-token sampling on the leader: greedy, or temperature/top-k/top-p with a per-request seed.

Each request owns a CPU torch.Generator seeded at admission and draws exactly one uniform number
per sampled token, so its tokens never depend on which requests share the batch. Warping follows
transformers' order (temperature, then top-k, then top-p keeping at least one token), in fp32.
On a GPU the rows of a step are warped and drawn together, a few tensor ops for the whole batch
rather than a dozen per row (each op is a launch); the CPU takes them one at a time. Every op is
row-wise with the same arithmetic for a row whatever else is in the batch (elementwise ops,
per-row top-k, stable sorts, softmax and cumulative sums along the row), and a row's parameters
reach it as its own entries of per-row tensors. Grammar masks are not applied here yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorad.protocol.messages import SamplingParams

_SEED_MASK = (1 << 64) - 1  # torch seeds are unsigned 64-bit; any int from the wire maps into it


class Sampler:
    def __init__(self, rows_together: bool | None = None) -> None:
        """rows_together: warp and draw a step's rows in one go (True) or one by one (False);
        None: together on a GPU, one by one on the CPU (see the module's doc)."""
        self._generators: dict[str, torch.Generator] = {}
        self._rows_together = rows_together

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
        device = logits.device
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        if not drawn:
            return logits.argmax(dim=-1).tolist()
        # One uniform per drawn row from its request's generator, in row order.
        u = torch.stack([torch.rand((), generator=self._generators[request_ids[i]],
                                    dtype=torch.float32) for i in drawn])
        # On a GPU the drawn rows go together (each op is a launch); on the CPU one at a time,
        # so that a row stays in cache from op to op (a whole step's rows stream through memory
        # once per op: 2 to 3 times slower here). The same bits either way.
        together = self._rows_together
        if together is None:
            together = device.type == "cuda"
        group = len(drawn) if together else 1
        picks = []
        for start in range(0, len(drawn), group):
            part = drawn[start:start + group]
            rows = logits if len(part) == len(params) else \
                logits.index_select(0, _index(part, device))
            probs = torch.softmax(warp_rows(rows, [params[i] for i in part]), dim=-1)
            picks.append(draw_rows(probs, u[start:start + group].to(device)))
        picked = picks[0] if len(picks) == 1 else torch.cat(picks)  # [num_drawn]
        if not greedy:
            return picked.tolist()
        chosen = torch.empty(len(params), dtype=torch.int64, device=device)
        chosen.index_copy_(0, _index(drawn, device), picked)
        greedy_index = _index(greedy, device)
        chosen.index_copy_(0, greedy_index, logits.index_select(0, greedy_index).argmax(dim=-1))
        return chosen.tolist()


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def warp_rows(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """rows: [n, vocab] fp32 logits, params[i] row i's (temperature > 0) -> [n, vocab] logits
    with each row's removed tokens at -inf."""
    num_rows, vocab = rows.shape
    device = rows.device
    # Temperature: each row divided by its own Python float, as transformers divides (a tensor of
    # divisors could round otherwise: a scalar divisor may become a multiply by its reciprocal).
    temperatures = sorted({p.temperature for p in params})
    if len(temperatures) == 1:
        rows = rows / temperatures[0]
    else:
        scaled = torch.empty_like(rows)
        for t in temperatures:
            index = _index([i for i, p in enumerate(params) if p.temperature == t], device)
            scaled.index_copy_(0, index, rows.index_select(0, index) / t)
        rows = scaled
    # Top-k: the k-th largest value of each row (from one top-k of the largest k asked for); a
    # row that asks for none gets -inf, which removes nothing. Ties with the k-th stay, as in HF.
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(rows, max(ks), dim=-1).values  # [n, max k], descending
        kth = top.gather(1, _index([max(k, 1) - 1 for k in ks], device)[:, None])  # [n, 1]
        kth = kth.masked_fill(_index(ks, device)[:, None] == 0, float("-inf"))
        rows = rows.masked_fill(rows < kth, float("-inf"))
    # Top-p, on the rows that ask for it: remove the ascending-sorted tokens whose cumulative
    # probability stays within 1 - p, keeping the most likely. A stable sort, so tied logits
    # are removed in index order in any batch.
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        index = _index(nucleus, device) if len(nucleus) < num_rows else None
        part = rows if index is None else rows.index_select(0, index)
        sorted_logits, order = torch.sort(part, dim=-1, descending=False, stable=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [m, vocab]
        # fp32 like the comparison with a Python float would make them
        limits = torch.tensor([1 - params[i].top_p for i in nucleus], dtype=torch.float32,
                              device=device)[:, None]
        remove = cumulative <= limits
        remove[:, -1] = False  # keep at least the most likely token
        part = part.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        if index is None:
            rows = part
        else:
            rows = rows.index_copy(0, index, part)
    return rows


def warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row: [vocab] fp32 logits -> [vocab] logits with the removed tokens at -inf."""
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0,
                            max_tokens=1, stop_token_ids=[], ignore_eos=False)
    return warp_rows(row[None], [params])[0]


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [n, vocab] fp32, u [n] in [0, 1) -> [n] chosen indices.

    The first index whose cumulative mass exceeds u * total always has non-zero probability, so
    a removed token can never be drawn.
    """
    cdf = probs.cumsum(dim=-1)  # [n, vocab]
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # [n, 1]
    return index.clamp_(max=probs.shape[-1] - 1)[:, 0]
