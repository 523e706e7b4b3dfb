"""Every message that crosses between the coordinator and the workers.

Frozen dataclasses whose field order is the wire order. Coordinator -> workers (PUB/SUB): Hello
(unsequenced handshake), then Admit / Cancel / Shutdown, each with a sequence number `seq`
starting at 1 with no gaps. Workers -> coordinator (PUSH/PULL): Ready from every rank, then
StepResult / StepFailed / WorkerFailed from the leader (WorkerFailed from any rank), and RankStatus
from every rank's status thread about twice a second, from start-up on.
The kind byte of each class is fixed here forever; a new field means a new PROTOCOL_VERSION.
"""

from __future__ import annotations

from dataclasses import dataclass

# 2: RankStatus; 3: Ready.startup_phases; 4: Ready.max_num_seqs; 5: Admit.grammar;
# 6: SamplingParams.num_logprobs, SeqOutput.logprobs;
# 7: SamplingParams.prompt_logprobs, SeqOutput.prompt_logprobs (completions' echo)
PROTOCOL_VERSION = 7
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; keeps a step result's size bounded
# Prompt positions whose log probabilities one step computes at most (the planner caps echo's
# prefill chunks): a StepResult then holds at most ~20 MB of them (~300 bytes each at 20
# alternatives), within codec.MAX_FRAME_BYTES whatever --max-num-batched-tokens is.
MAX_PROMPT_LOGPROBS_PER_STEP = 65536


# --- coordinator -> workers -------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    """Repeated until every rank answered Ready: proves each SUB socket is subscribed."""

    KIND = 1
    protocol_version: int
    instance_id: str


@dataclass(frozen=True)
class SamplingParams:
    temperature: float  # 0 means greedy
    top_p: float  # 1.0 disables
    top_k: int  # 0 disables
    seed: int  # seeds this request's own generator
    max_tokens: int
    stop_token_ids: list[int]  # end the sequence with finish_reason "stop" (EOS and friends)
    ignore_eos: bool
    # -1: no log probabilities; 0..MAX_TOP_LOGPROBS: each sampled token's log probability and
    # this many most likely alternatives (workers/logprobs.py)
    num_logprobs: int = -1
    # -1: none; 0..MAX_TOP_LOGPROBS: completions' echo, the log probability of each prompt token
    # after the first and this many alternatives (workers/prompt_logprobs.py). With it,
    # max_tokens may be 0: the prompt is scored, nothing is generated.
    prompt_logprobs: int = -1

    def __post_init__(self) -> None:
        for name in ("num_logprobs", "prompt_logprobs"):
            if not -1 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be -1..{MAX_TOP_LOGPROBS}, "
                                 f"got {getattr(self, name)}")


@dataclass(frozen=True)
class Admit:
    KIND = 2
    seq: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    adapter_slot: int  # 0 = base model
    adapter_key: str  # identity key of the adapter in that slot, "" for slot 0
    # The output constraint as llguidance's grammar text (its JSON form or Lark, validated by the
    # coordinator), "" for none. Text, never a pickled object; only the leader builds a matcher.
    grammar: str = ""


@dataclass(frozen=True)
class Cancel:
    """The client went away or a stop string matched: free the sequence at the agreed step."""

    KIND = 3
    seq: int
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    KIND = 4
    seq: int


# --- workers -> coordinator -------------------------------------------------------------------

@dataclass(frozen=True)
class StartupPhase:
    name: str  # "workers up", "weights", "adapters", "KV pool", "graphs", "warm-up"
    seconds: float


@dataclass(frozen=True)
class Ready:
    KIND = 16
    rank: int
    protocol_version: int
    instance_id: str
    num_kv_blocks: int
    block_size: int
    registry_digest: str
    max_num_seqs: int  # --max-num-seqs as the ranks resolved it (auto: from the KV pool)
    # This rank's start, from its spawn to Ready, in the order the phases ran (for the log's
    # "ready in" line, /health and /metrics).
    startup_phases: list[StartupPhase]


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled (or, for echo, prompt) token's log probability and its position's most likely
    alternatives: the model's own fp32 log-softmax, before any warper, penalty or grammar mask."""

    logprob: float  # of the sampled token (echo: of the prompt's token at the next position)
    top_ids: list[int]  # the num_logprobs most likely tokens, most likely first
    top_logprobs: list[float]  # theirs, in the same order

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise ValueError(f"TokenLogprobs: {len(self.top_ids)} ids and "
                             f"{len(self.top_logprobs)} values (at most {MAX_TOP_LOGPROBS})")


@dataclass(frozen=True)
class SeqOutput:
    request_id: str
    token_ids: list[int]  # new tokens this step (usually one)
    finish_reason: str | None  # "stop", "length", "cancelled", or None while running
    num_prompt_tokens: int
    # One per token of token_ids when the request asked for log probabilities, else None.
    logprobs: list[TokenLogprobs] | None = None
    # Echo: the values of the prompt's tokens 1..n-1 (each from the position before it) for the
    # prompt positions this step ran, in prompt order; a prefill's steps together send n-1 of
    # them, steps that sample nothing in an output without tokens. None otherwise.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class StepResult:
    KIND = 17
    step: int
    outputs: list[SeqOutput]
    num_running: int
    num_waiting: int
    num_free_blocks: int


@dataclass(frozen=True)
class StepFailed:
    """A step failed on every rank (e.g. live sets disagreed); these requests are gone."""

    KIND = 18
    step: int
    request_ids: list[str]
    message: str


@dataclass(frozen=True)
class WorkerFailed:
    """A rank cannot go on; the coordinator ends every stream with an error and exits."""

    KIND = 19
    rank: int
    message: str


@dataclass(frozen=True)
class RankStatus:
    """A rank's heartbeat, sent by its status thread even while the loop is blocked in a step or
    a collective: whether the loop progresses (stall detection, the systemd watchdog) and what
    its KV pool holds (/health, /metrics)."""

    KIND = 20
    rank: int
    phase: str  # "loading" (before Ready), "ready" (Ready sent) or "serving" (in the step loop)
    steps: int  # loop rounds completed, idle rounds included
    step_seconds: float  # how long the current round has run; 0.0 between rounds
    kv_blocks_used: int
    kv_blocks_free: int


COORDINATOR_TO_WORKER = (Hello, Admit, Cancel, Shutdown)
WORKER_TO_COORDINATOR = (Ready, StepResult, StepFailed, WorkerFailed, RankStatus)
