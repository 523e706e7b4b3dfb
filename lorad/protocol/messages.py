"""Every message that crosses between the coordinator and the workers.

Frozen dataclasses whose field order is the wire order. Coordinator -> workers (PUB/SUB): Hello
(unsequenced handshake), then Admit / Cancel / Shutdown / LoadAdapter / UnloadAdapter, each with a
sequence number `seq` starting at 1 with no gaps. Workers -> coordinator (PUSH/PULL): Ready from
every rank, then StepResult / StepFailed / AdapterLoaded from the leader, WorkerFailed and
AdapterRefused from any rank, and RankStatus from every rank's status thread four times a second,
from start-up on.
The kind byte of each class is fixed here forever; a new field means a new PROTOCOL_VERSION.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# 2: RankStatus; 3: Ready.startup_phases; 4: Ready.max_num_seqs; 5: Admit.grammar;
# 6: SamplingParams.num_logprobs, SeqOutput.logprobs; 7: Admit.n, StepResult.num_model_tokens;
# 8: SamplingParams' penalties, min_p, logit_bias, request_stop_token_ids and min_tokens;
# 9: SamplingParams.prompt_logprobs, SeqOutput.prompt_logprobs (completions' echo);
# 10: Admit.cache_prompt, SeqOutput.num_cached_tokens, RankStatus' prefix cache and spill counts
# 11: Admit.adapter_strength (per-request strength)
# 12: Admit.adapter_id (a registry id; the planner places it in a device slot), LoadAdapter,
# UnloadAdapter, AdapterLoaded, AdapterRefused, RankStatus' adapter slot and cache counts
# 13: Admit.draft, StepResult.num_draft_tokens and num_draft_accepted (n-gram drafting)
PROTOCOL_VERSION = 13
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; keeps a step result's size bounded
MAX_CHOICES = 16  # n: choices of one prompt, each a live sequence after the shared prefill
# adapter_strength: 4x the adapter's scales is past any use seen (1..2 is common) and keeps a
# delta's growth bounded; 0 is the base model's arithmetic on the adapter's rows.
MAX_ADAPTER_STRENGTH = 4.0
MAX_LOGIT_BIAS = 300  # entries of logit_bias per request: bounds an Admit and a step's copy
MAX_STOP_TOKEN_IDS = 64  # request stop_token_ids per request
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
class TokenBias:
    """One logit_bias entry: on the wire the pair [token_id, bias]."""

    token_id: int
    bias: float  # -100..100, added to the token's logit


@dataclass(frozen=True)
class SamplingParams:
    temperature: float  # 0 means greedy
    top_p: float  # 1.0 disables
    top_k: int  # 0 disables
    seed: int  # seeds this request's own generator
    max_tokens: int
    # EOS and friends: end the sequence with finish_reason "stop", unless ignore_eos
    stop_token_ids: list[int]
    ignore_eos: bool
    # -1: no log probabilities; 0..MAX_TOP_LOGPROBS: each sampled token's log probability and
    # this many most likely alternatives (workers/logprobs.py)
    num_logprobs: int = -1
    # The logits transforms (workers/logits_processors.py); each default is "off".
    presence_penalty: float = 0.0  # -2..2, over the output tokens
    frequency_penalty: float = 0.0  # -2..2, over the output tokens
    repetition_penalty: float = 1.0  # (0, 2], over the prompt and output tokens
    min_p: float = 0.0  # 0..1
    logit_bias: list[TokenBias] = field(default_factory=list)  # sorted by token id, unique
    # The request's own stop_token_ids: end with "stop" even with ignore_eos
    request_stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0  # EOS and stop tokens are masked until this many were generated

    # -1: none; 0..MAX_TOP_LOGPROBS: completions' echo, the log probability of each prompt token
    # after the first and this many alternatives (workers/prompt_logprobs.py). With it,
    # max_tokens may be 0: the prompt is scored, nothing is generated.
    prompt_logprobs: int = -1

    def __post_init__(self) -> None:
        for name in ("num_logprobs", "prompt_logprobs"):
            if not -1 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be -1..{MAX_TOP_LOGPROBS}, "
                                 f"got {getattr(self, name)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be -2..2, got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], "
                             f"got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be 0..1, got {self.min_p}")
        ids = [b.token_id for b in self.logit_bias]
        if (len(ids) > MAX_LOGIT_BIAS or ids != sorted(set(ids))
                or not all(-100.0 <= b.bias <= 100.0 for b in self.logit_bias)):
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries with "
                             f"unique ascending ids and biases in -100..100")
        if len(self.request_stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"request_stop_token_ids holds more than {MAX_STOP_TOKEN_IDS} ids")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError(f"min_tokens must be 0..max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")

    @property
    def transforms_logits(self) -> bool:
        """Whether any transform of workers/logits_processors.py applies to this request."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens)


@dataclass(frozen=True)
class Admit:
    KIND = 2
    seq: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    adapter_id: int  # the adapter's registry id (LoadAdapter, or 1..K at start); 0 = base model
    adapter_key: str  # that adapter's identity key, "" for the base model
    # The output constraint as llguidance's grammar text (its JSON form or Lark, validated by the
    # coordinator), "" for none. Text, never a pickled object; only the leader builds a matcher.
    grammar: str = ""
    # Choices of this prompt (1..MAX_CHOICES), sharing its prefill; choice j is the sequence
    # choice_ids(request_id, n)[j], sampled with seed + j (mod 2**64).
    n: int = 1
    # Whether this prompt reads and fills the prefix cache (lorad's "cache_prompt" field).
    cache_prompt: bool = True
    # lorad's "adapter_strength": the multiplier of the adapter's scales for this request alone,
    # 0..MAX_ADAPTER_STRENGTH; 1.0 for the base model.
    adapter_strength: float = 1.0
    # lorad's "draft": whether the workers may draft this request's tokens (--speculative-ngram;
    # workers/ngram_draft.py says which requests they never draft for).
    draft: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"Admit.n must be 1..{MAX_CHOICES}, got {self.n}")
        if not 0.0 <= self.adapter_strength <= MAX_ADAPTER_STRENGTH:
            raise ValueError(f"Admit.adapter_strength must be 0..{MAX_ADAPTER_STRENGTH}, "
                             f"got {self.adapter_strength}")
        if self.adapter_id == 0 and self.adapter_strength != 1.0:
            raise ValueError("Admit.adapter_strength needs an adapter (id 0 is the base model)")


def choice_ids(request_id: str, n: int) -> list[str]:
    """The request ids of an admission's n choices: its own id alone when n is 1."""
    return [request_id] if n == 1 else [f"{request_id}/{j}" for j in range(n)]


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


@dataclass(frozen=True)
class LoadAdapter:
    """Register an adapter version under a new registry id (never reused), at the agreed step:
    every rank validates the folder and must compute `key`; the ranks agree on the outcome and
    the leader answers AdapterLoaded. A reload is a LoadAdapter of the new version; the old one
    is unloaded once its last request ended."""

    KIND = 5
    seq: int
    adapter_id: int
    name: str
    path: str  # the resolved folder
    strength: float
    key: str  # the identity key the coordinator computed
    pinned: bool = False  # never evicted from its device slot

    def __post_init__(self) -> None:
        if self.adapter_id <= 0:
            raise ValueError(f"LoadAdapter.adapter_id must be positive, got {self.adapter_id}")


@dataclass(frozen=True)
class UnloadAdapter:
    """Forget a registry id; sent once no request of it is open (the coordinator drains)."""

    KIND = 6
    seq: int
    adapter_id: int


# --- workers -> coordinator -------------------------------------------------------------------

@dataclass(frozen=True)
class StartupPhase:
    # "workers up", "weights", "adapters", "KV pool", "matmul plans" (GPU), "graphs", "warm-up"
    name: str
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
    # Prompt tokens whose KV the sequence's first start found in the prefix cache.
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class StepResult:
    KIND = 17
    step: int
    outputs: list[SeqOutput]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_model_tokens: int = 0  # tokens the step ran through the model (prefill chunks, decodes)
    # N-gram drafting: draft tokens the step verified, and those of them the sequences took.
    num_draft_tokens: int = 0
    num_draft_accepted: int = 0


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
class AdapterLoaded:
    """The leader's answer to a LoadAdapter once every rank's outcome is agreed: registered on
    every rank (no failed ranks), or on none (each failed rank sent an AdapterRefused)."""

    KIND = 21
    adapter_id: int
    failed_ranks: list[int]


@dataclass(frozen=True)
class AdapterRefused:
    """Why this rank could not register (LoadAdapter) or read back an adapter."""

    KIND = 22
    rank: int
    adapter_id: int
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
    # The prefix cache: full blocks indexed by chain hash (held or evictable, a part of the two
    # counts above), and cached blocks taken back for other contents since the start.
    prefix_cached_blocks: int = 0
    prefix_evictions: int = 0
    # The disk spill (--kv-spill-dir): blocks held, and since the start blocks written, read
    # back, reads that failed (missing or corrupt), entries dropped as invalid.
    spill_blocks: int = 0
    spill_writes: int = 0
    spill_reads: int = 0
    spill_read_failures: int = 0
    spill_drops: int = 0
    # Adapters (adapter_slots.py, adapter_store.py): registry ids held, device slots and those
    # holding an adapter; since the start, adapters copied into a slot, slots taken back for
    # another adapter, copies served by the host cache and those read from disk.
    adapters_registered: int = 0
    adapter_slots: int = 0
    adapter_slots_used: int = 0
    adapter_loads: int = 0
    adapter_evictions: int = 0
    adapter_host_hits: int = 0
    adapter_disk_reads: int = 0


COORDINATOR_TO_WORKER = (Hello, Admit, Cancel, Shutdown, LoadAdapter, UnloadAdapter)
WORKER_TO_COORDINATOR = (Ready, StepResult, StepFailed, WorkerFailed, RankStatus, AdapterLoaded,
                         AdapterRefused)
