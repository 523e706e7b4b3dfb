"""Prompt-lookup (n-gram) drafting: guess a decoding sequence's next tokens from its own ids.

The draft is what followed the most recent earlier occurrence of the sequence's last n tokens
(n from NGRAM_MAX down to NGRAM_MIN), read from its prompt and generated ids only; the target
model checks it in one step (planner.py schedules it, the leader samples every row,
accepted_tokens is what every rank then takes). Pure: no torch, no model, no adapter. A draft
model (--draft-model) would be a second proposer beside this one; none is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorad.protocol.messages import Admit
    from lorad.workers.sequence import Sequence

NGRAM_MAX = 3
# A lone repeated token predicts little, and a drafted step runs eagerly on a GPU (no decode
# graph), so a weak guess costs more than it wins.
NGRAM_MIN = 2
# A sequence whose draft was wholly rejected skips drafting for 1, 2, 4, ... decodes (up to this)
# before it tries again; a taken draft resets it, and a partly taken one shortens the next
# (note_outcome). Text that does not repeat itself then pays for fewer rows nobody takes.
MAX_BACKOFF = 16


class NgramIndex:
    """n-gram -> end position of its most recent occurrence in one sequence, for every n in
    NGRAM_MIN..NGRAM_MAX; kept up to date as the sequence grows (its tokens only append), so a
    step looks up a few dicts instead of scanning the whole sequence."""

    def __init__(self) -> None:
        self._last: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
        self.num_indexed = 0  # end positions 0..num_indexed-1 are in the dicts

    def propose(self, seq: Sequence, max_draft: int) -> list[int]:
        """Up to max_draft tokens guessed to follow seq's last one; [] when no suffix of it
        occurred before."""
        num_tokens = seq.num_tokens
        self._index_upto(seq, num_tokens - 1)  # the suffix's own end is not an earlier one
        for n in range(min(NGRAM_MAX, num_tokens), NGRAM_MIN - 1, -1):
            end = self._last[n].get(tuple(seq.token_slice(num_tokens - n, num_tokens)))
            if end is not None:
                return continuation(seq, end, max_draft)
        return []

    def _index_upto(self, seq: Sequence, stop: int) -> None:
        if stop <= self.num_indexed:
            return
        first = max(0, self.num_indexed - NGRAM_MAX + 1)
        window = seq.token_slice(first, stop)  # every n-gram ending in num_indexed..stop-1
        for end in range(self.num_indexed, stop):
            at = end - first
            for n, last in self._last.items():
                if at + 1 >= n:
                    last[tuple(window[at + 1 - n:at + 1])] = end
        self.num_indexed = stop


def continuation(seq: Sequence, end: int, max_draft: int) -> list[int]:
    """The max_draft tokens after position `end`, where the sequence's last tokens repeat those
    ending at `end`. Past the sequence's end the draft goes on repeating with the same period:
    a loop of p tokens is drafted whole, not only up to the sequence's last token."""
    num_tokens = seq.num_tokens
    draft = seq.token_slice(end + 1, min(num_tokens, end + 1 + max_draft))
    period = num_tokens - 1 - end
    while len(draft) < max_draft:
        draft.append(draft[len(draft) - period])
    return draft


def accepted_tokens(row_tokens: list[int], draft: list[int]) -> list[int]:
    """The tokens a drafted sequence takes from its chunk's sampled rows: row i was sampled
    after draft[:i], so it stands while each draft token before it was what its row sampled.
    -> the rows up to and including the first that differs from its draft token (all of them,
    the last a bonus token, when every draft token matched). Every rank computes it from the
    same broadcast rows; the leader also returns the unused rows' uniforms (sampler.py)."""
    for i, token in enumerate(draft):
        if row_tokens[i] != token:
            return row_tokens[:i + 1]
    return list(row_tokens[:len(draft) + 1])


def note_outcome(seq: Sequence, num_drafted: int, num_accepted: int) -> None:
    """After a drafted decode: the next draft is at most one longer than what was taken of this
    one (all taken: no limit), and a draft of which nothing was taken backs off (MAX_BACKOFF):
    rows that the text's own repeats do not support cost a step time and give nothing."""
    seq.draft_taken_whole = num_accepted == num_drafted
    seq.draft_limit = 0 if seq.draft_taken_whole else num_accepted + 1
    if num_accepted:
        seq.draft_backoff = 0
    else:
        seq.draft_backoff = min(MAX_BACKOFF, 2 * seq.draft_backoff or 1)
        seq.draft_skips_left = seq.draft_backoff


def may_draft(admit: Admit) -> bool:
    """Whether an admitted request's sequence may be drafted for. The leader samples a drafted
    chunk's rows at once, each from the model's logits alone, so every feature that makes a row
    depend on the tokens sampled before it in the same step, or that returns more than the
    tokens, is left out: a grammar (its matcher must consume each token before the next mask),
    logprobs and echo (per-token values of rows that may be thrown away), penalties, logit_bias
    and min_tokens (logits_processors.py counts the output so far), and n > 1 (the choices
    share blocks copy-on-write). Stop strings are the coordinator's: it sends draft False for
    them (tokens after a match would be counted in usage)."""
    sampling = admit.sampling
    return (admit.draft and not admit.grammar and admit.n == 1 and sampling.num_logprobs < 0
            and sampling.prompt_logprobs < 0 and not sampling.transforms_logits)
