"""Next-token sampling on the leader: greedy, or temperature/top-k/top-p with a per-request seed.

Each request owns a CPU torch.Generator seeded at admission and uses exactly one uniform number per
sampled token, the generator's float32 stream in order, so its tokens never depend on which
requests share the batch. The uniforms are taken UNIFORMS_AT_ONCE at a time (torch's CPU
generator gives a block the same values as as many single draws; tests/unit/test_sampler.py
checks it): a torch op per row per step cost more host time than the rest of a step's sampling.
Warping follows transformers' order (temperature, then top-k, then top-p keeping at least one
token), then min_p, in fp32. A constrained row arrives already masked (grammar.py), and a row
with logit_bias or penalties already transformed (logits_processors.py), before this runs. A
drafted chunk's rows (ngram_draft.py) each draw the request's next uniform, in row order; the
rows after the first rejected one emit nothing, and put_back() returns their uniforms, so a
request consumes one uniform per token it emits, drafted or not.
"""

from __future__ import annotations

import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers.kernel_path import kernel_path

_SEED_MASK = (1 << 64) - 1  # torch seeds are unsigned 64-bit; any int from the wire maps into it
UNIFORMS_AT_ONCE = 64
ALIGN_FLOATS = 4  # 16 bytes of fp32: the alignment triton specializes its pointers on


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._uniforms: dict[str, list[float]] = {}  # each request's next ones, last first
        # request id -> the uniforms the last sample() drew for it, in order, when it kept them
        self._drawn: dict[str, list[float]] | None = None

    def add(self, request_id: str, seed: int) -> None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed & _SEED_MASK)
        self._generators[request_id] = gen
        self._uniforms[request_id] = []

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._uniforms.pop(request_id, None)

    def _next_uniform(self, request_id: str) -> float:
        left = self._uniforms[request_id]
        if not left:
            drawn = torch.rand(UNIFORMS_AT_ONCE, generator=self._generators[request_id],
                               dtype=torch.float32)
            left.extend(reversed(drawn.tolist()))
        return left.pop()

    def put_back(self, request_id: str, num_used: int) -> None:
        """Give the uniforms the last sample(keep_drawn=True) drew for this request after its
        first num_used back to its stream: its next draws take them again, in order."""
        unused = self._drawn.get(request_id, [])[num_used:]
        self._uniforms[request_id].extend(reversed(unused))  # the list is last first

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams], keep_drawn: bool = False) -> list[int]:
        """logits: [num_sampled, vocab]; one id per row, in row order. keep_drawn: remember
        each request's uniforms for put_back (a step with drafted chunks)."""
        if not request_ids:
            self._drawn = {} if keep_drawn else None
            return []
        return self.sample_on_device(logits, request_ids, params, keep_drawn).tolist()

    def sample_on_device(self, logits: torch.Tensor, request_ids: list[str],
                         params: list[SamplingParams], keep_drawn: bool = False) -> torch.Tensor:
        """sample()'s ids as a [num_sampled] int64 tensor on the logits' device, with nothing
        waiting for the device where every row is greedy or every row draws: a continuation
        reads them there (loop.py's async scheduling)."""
        self._drawn = {} if keep_drawn else None
        logits = logits.float()
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        if not drawn:  # one argmax for the step: one launch on a GPU, not one per row
            return logits.argmax(dim=-1)
        tokens = self._draw(drawn, logits, request_ids, params)
        if len(drawn) == len(params):
            return tokens
        chosen = logits.argmax(dim=-1)  # the greedy rows' (rows are only read, never warped)
        chosen[drawn] = tokens
        return chosen

    def _draw(self, rows: list[int], logits: torch.Tensor, request_ids: list[str],
              params: list[SamplingParams]) -> torch.Tensor:
        """-> the tokens drawn for rows `rows` of logits ([len(rows)] int64 on the logits'
        device), in that order, each with one uniform
        from its request's generator. On the kernel path (CUDA) the whole step's drawn rows
        take one draw (kernels/token_draw.py), after the top-k/top-p rows are warped together
        (warp_rows): torch's CUDA cumulative sum is not repeatable, so neither is a draw made
        with it. On the CPU, torch's ops row by row. What the device needs reaches it in one
        copy: torch's blocking copy from host memory syncs the stream, so a copy per row could
        make each row wait for the rows before it to finish."""
        uniforms = [self._next_uniform(request_ids[i]) for i in rows]  # float32 values
        if self._drawn is not None:
            for i, u in zip(rows, uniforms):
                self._drawn.setdefault(request_ids[i], []).append(u)
        if not kernel_path(logits.device):
            tokens = []
            for i, u in zip(rows, uniforms):
                p = params[i]
                probs = torch.softmax(warp(logits[i], p.temperature, p.top_k, p.top_p, p.min_p),
                                      dim=-1)
                tokens.append(int(draw(probs, u)))
            return torch.tensor(tokens, dtype=torch.int64)
        from lorad.workers.kernels.token_draw import draw_tokens
        vocab = logits.shape[1]
        warped = [j for j, i in enumerate(rows)
                  if 0 < params[i].top_k < vocab or params[i].top_p < 1.0 or params[i].min_p > 0]
        every_row = len(rows) == logits.shape[0] and logits.stride(1) == 1
        # [num_drawn, vocab]: the logits themselves when nothing writes into them (no warp, or
        # every row warped: warp_rows returns new rows); else a copy of the drawn rows.
        batch = logits if every_row and len(warped) in (0, len(rows)) else logits[rows]
        # Everything the device needs in one copy: [7, num_drawn] fp32 (ints below 2**24 are
        # exact): the uniforms, the draw's temperatures (1 for warped rows, already scaled),
        # then, in the first len(warped) columns, the warped rows' temperature, top-k, top-p,
        # min_p and position in the batch. Built as lists: assigning a tensor's items one by
        # one costs microseconds each.
        temperatures = [params[i].temperature for i in rows]
        warped_params = [params[rows[j]] for j in warped]
        of_warped = [[0.0] * len(rows) for _ in range(5)]
        for n, (j, p) in enumerate(zip(warped, warped_params)):
            temperatures[j] = 1.0
            for field, value in zip(of_warped, (p.temperature, p.top_k, p.top_p, p.min_p, j)):
                field[n] = value
        values = device_columns([uniforms, temperatures, *of_warped], logits.device)
        if warped:
            num = len(warped)
            max_top_k = max(p.top_k if p.top_k < vocab else 0 for p in warped_params)
            any_top_p = any(p.top_p < 1.0 for p in warped_params)
            min_ps = values[5] if any(p.min_p > 0 for p in warped_params) else None
            if num == len(rows):  # every drawn row, in order: no gather, no scatter
                batch = warp_rows(batch, values[2], values[3].long(), values[4], max_top_k,
                                  any_top_p, min_ps)
            else:
                index = values[6, :num].long()
                batch[index] = warp_rows(batch[index], values[2, :num], values[3, :num].long(),
                                         values[4, :num], max_top_k, any_top_p,
                                         None if min_ps is None else min_ps[:num])
        return draw_tokens(batch, values[1], values[0])


def device_columns(columns: list[list[float]], device: torch.device) -> torch.Tensor:
    """-> [len(columns), n] fp32 on `device`, in one copy, each row starting on a 16-byte
    boundary: triton compiles a kernel once per alignment of its pointers, so rows at n * 4
    bytes apart would make odd batch sizes compile variants of the draw mid-serving. A copy from
    pageable memory would wait for every kernel queued before it, a step planned ahead
    (loop.py's async scheduling) included."""
    num = len(columns[0])
    pad = [0.0] * (-num % ALIGN_FLOATS)
    host = torch.tensor([column + pad for column in columns], dtype=torch.float32)
    if device.type == "cuda":  # from page-locked memory the copy waits for nothing before it
        host = host.pin_memory()
    return host.to(device, non_blocking=True)[:, :num]


def warm_up(logits: torch.Tensor) -> None:
    """Sample once from `logits` ([2 or more, vocab], the step's device) with a throwaway Sampler,
    one row plain and one with top-k, top-p and min_p: on the kernel path, the draw and top-p's
    running sum compile here, at start, rather than in the step of the first request that
    samples."""
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, seed=0, max_tokens=1,
                             stop_token_ids=[], ignore_eos=False, min_p=min_p)
              for top_k, top_p, min_p in ((0, 1.0, 0.0), (40, 0.9, 0.05))]
    ids = ["warm-up plain", "warm-up warped"]
    for request_id in ids:
        sampler.add(request_id, 0)
    sampler.sample(logits[:2], ids, params)


def warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
         min_p: float = 0.0) -> torch.Tensor:
    """The CPU path's warp: row [vocab] fp32 logits -> [vocab] logits / temperature with the
    removed tokens at -inf."""
    row = row / temperature
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))  # ties with the k-th stay, as in HF
    if top_p < 1.0:
        # Stable, so tied tokens at the cutoff go the same way each time.
        sorted_logits, order = torch.sort(row, descending=False, stable=True)  # [vocab]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False  # keep at least the most likely token
        row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    if min_p > 0:
        row = row.masked_fill(below_min_p(row, torch.tensor(min_p, dtype=torch.float32)),
                              float("-inf"))
    return row


def below_min_p(rows: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """rows [..., vocab] warped logits, min_ps [...] -> True where a token's probability is
    below min_p times the most likely one's. exp(logit - max) is that ratio without the
    normalising sum, so no reduction order enters it; the most likely token always stays."""
    return torch.exp(rows - rows.amax(dim=-1, keepdim=True)) < min_ps[..., None]


def warp_rows(rows: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
              top_ps: torch.Tensor, max_top_k: int, any_top_p: bool,
              min_ps: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel path's warp, a step's rows at once: rows [n, vocab] fp32; temperatures, top_ps
    [n] fp32 and top_ks [n] int64 on the rows' device (top-k <= 0 or >= vocab: none; top-p 1:
    none); max_top_k, any_top_p: what the host knows of them; min_ps [n] fp32 or None (no row
    has one) -> [n, vocab] rows / temperature with the removed tokens at -inf, in the CPU path's
    order (top-k, then top-p keeping at least the most likely token, then min_p). Nothing here
    sums across a row but token_draw's running sum (the others are exact: top-k's k-th value, a
    stable sort, the row's max, elementwise ops), so a row's result depends on that row alone
    and repeats bit for bit. Top-p compares the running
    mass of exp(x - max) with (1 - p) times its total, where the CPU path normalises first."""
    from lorad.workers.kernels.token_draw import cumulative_sum
    vocab = rows.shape[1]
    rows = rows / temperatures[:, None]
    if 0 < max_top_k:
        has_k = (top_ks > 0) & (top_ks < vocab)  # [n]
        largest = torch.topk(rows, min(max_top_k, vocab), dim=-1).values  # [n, k], descending
        kth = largest.gather(1, (top_ks.clamp(1, largest.shape[1]) - 1)[:, None])  # [n, 1]
        kth = torch.where(has_k[:, None], kth, float("-inf"))
        rows = rows.masked_fill(rows < kth, float("-inf"))  # ties with the k-th stay, as in HF
    if any_top_p:
        ascending, order = torch.sort(rows, dim=-1, stable=True)  # [n, vocab]
        running = cumulative_sum(torch.exp(ascending - ascending[:, -1:]))  # [n, vocab]
        remove = running <= (1 - top_ps)[:, None] * running[:, -1:]
        # Rows without top-p lose nothing, not even tokens whose exp underflows to 0.
        remove &= (top_ps < 1.0)[:, None]
        remove[:, -1] = False  # keep at least the most likely token
        rows = rows.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if min_ps is not None:  # a row with min_p 0 loses nothing: no ratio is below 0
        rows = rows.masked_fill(below_min_p(rows, min_ps), float("-inf"))
    return rows


def draw(probs: torch.Tensor, u: float) -> torch.Tensor:
    """Inverse-CDF draw, the CPU path's: probs [vocab] fp32, u in [0, 1) (a float32 value) -> the
    chosen index (scalar).

    The first index whose cumulative mass exceeds u * total always has non-zero probability, so
    a removed token can never be drawn.
    """
    cdf = probs.cumsum(dim=-1)  # [vocab]
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)  # [1]
    return index.clamp_(max=probs.shape[-1] - 1).reshape(())
