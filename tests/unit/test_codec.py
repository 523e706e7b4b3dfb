"""The wire codec: every message round-trips to an equal dataclass, and every malformed frame is a
ProtocolError (unknown or unexpected kind, wrong field types, bool for int, truncated, oversized)."""

from __future__ import annotations

import msgpack
import pytest

from lorad.protocol import (
    MAX_FRAME_BYTES, PROTOCOL_VERSION, Admit, Cancel, Hello, ProtocolError, RankStatus, Ready,
    SamplingParams, SeqOutput, Shutdown, StartupPhase, StepFailed, StepResult, WorkerFailed,
    decode, encode)
from lorad.protocol.messages import (
    MAX_PROMPT_LOGPROBS_PER_STEP, MAX_TOP_LOGPROBS, TokenBias, TokenLogprobs)
from lorad.protocol.messages import COORDINATOR_TO_WORKER, WORKER_TO_COORDINATOR

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**62 + 5, max_tokens=16,
                          stop_token_ids=[2, 0], ignore_eos=False)
MESSAGES = [
    Hello(PROTOCOL_VERSION, "tiny-123-abcd"),
    Admit(1, "cmpl-1", [1, 2, 3, 399], SAMPLING, 0, ""),
    Admit(2, "chatcmpl-é", list(range(5000)), SAMPLING, 3, "sha256:" + "ab" * 32),
    Admit(3, "cmpl-g", [1], SAMPLING, 0, "", '{"grammars": [{"json_schema": {"type": "object"}}]}'),
    Cancel(3, "cmpl-1"),
    Shutdown(4),
    Ready(0, PROTOCOL_VERSION, "tiny-123-abcd", 128, 16, "digest", 256,
          [StartupPhase("workers up", 1.25), StartupPhase("weights", 0.5)]),
    StepResult(7, [SeqOutput("a", [5], None, 3), SeqOutput("b", [6, 2], "stop", 9)], 1, 0, 120),
    StepResult(8, [], 0, 0, 128),
    StepResult(10, [], 4, 0, 100, 37),
    Admit(6, "cmpl-n", [1, 2], SAMPLING, 0, "", "", 16),
    Admit(7, "cmpl-s", [1, 2], SAMPLING, 2, "sha256:" + "cd" * 32, adapter_strength=0.5),
    Admit(8, "cmpl-s0", [1], SAMPLING, 2, "sha256:" + "cd" * 32, adapter_strength=0.0),
    Admit(9, "cmpl-d", [1, 2], SAMPLING, 0, "", draft=False),
    StepResult(11, [SeqOutput("d", [5, 6, 7], None, 2)], 1, 0, 5, 4, 2),
    StepResult(9, [SeqOutput("a", [5], None, 3, [TokenLogprobs(-0.25, [5, 7], [-0.25, -2.5])]),
                   SeqOutput("b", [2], "stop", 9, [TokenLogprobs(-3.0, [], [])])], 1, 0, 120),
    Admit(5, "cmpl-l", [1], SamplingParams(0.0, 1.0, 0, 1, 4, [2], False, 20), 0, ""),
    Admit(6, "cmpl-p", [1], SamplingParams(
        0.5, 1.0, 0, 1, 8, [2], True, presence_penalty=-2.0, frequency_penalty=0.5,
        repetition_penalty=1.3, min_p=0.1, logit_bias=[TokenBias(3, -100.0), TokenBias(9, 2.5)],
        request_stop_token_ids=[4, 5], min_tokens=8), 0, ""),
    Admit(6, "cmpl-e", [1, 2], SamplingParams(0.0, 1.0, 0, 1, 0, [2], False, 3,
                                              prompt_logprobs=3), 0, ""),
    StepResult(10, [SeqOutput("e", [], None, 9, None, [TokenLogprobs(-1.5, [4], [-0.5])] * 3),
                    SeqOutput("f", [], "length", 2, None, [TokenLogprobs(-2.0, [], [])])],
               0, 0, 120),
    StepFailed(9, ["a", "b"], "live sets disagree"),
    WorkerFailed(1, "CUDA error: out of memory"),
    RankStatus(0, "loading", 0, 0.0, 0, 0),
]
ALL_KINDS = COORDINATOR_TO_WORKER + WORKER_TO_COORDINATOR


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg), ALL_KINDS) == msg


def test_int_is_accepted_for_float():
    frame = bytes([Admit.KIND]) + msgpack.packb(
        [1, "r", [1], [1, 1, 0, 0, 4, [], False, -1, 0, 0, 1, 0, [[7, 5]], [], 0, -1], 0, "", "",
         1, True, 1.0, True])
    sampling = decode(frame, (Admit,)).sampling
    assert sampling.temperature == 1.0 and sampling.repetition_penalty == 1.0
    assert type(sampling.temperature) is float and type(sampling.repetition_penalty) is float
    assert sampling.logit_bias == [TokenBias(7, 5.0)]


def test_kinds_are_distinct():
    assert len({cls.KIND for cls in ALL_KINDS}) == len(ALL_KINDS)


def _admit_frame(prompt, sampling, slot=0, key="", grammar="", n=1, cache_prompt=True,
                 strength=1.0) -> bytes:
    """An Admit frame with every field (protocol 11's adapter_strength last)."""
    return _frame(Admit.KIND, [1, "r", prompt, sampling, slot, key, grammar, n, cache_prompt,
                               strength])


def _frame(kind: int, body) -> bytes:
    return bytes([kind]) + msgpack.packb(body, use_bin_type=True)


def _sp(first=(1.0, 1.0, 0, 0, 4, [], False, -1), **changed) -> list:
    """A SamplingParams body on the wire: the first eight fields, then the version 8 ones
    (penalties, min_p, logit_bias, request stop ids, min_tokens) and the version 9 one
    (prompt_logprobs) as given or off."""
    later = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
             "min_p": 0.0, "logit_bias": [], "request_stop_token_ids": [], "min_tokens": 0,
             "prompt_logprobs": -1}
    return [*first, *{**later, **changed}.values()]


@pytest.mark.parametrize("frame,accept", [
    (_frame(99, [1]), ALL_KINDS),  # unknown kind
    (encode(Hello(1, "x")), WORKER_TO_COORDINATOR),  # a kind this receiver does not take
    (encode(Cancel(1, "x"))[:1], ALL_KINDS),  # nothing after the kind byte
    (b"", ALL_KINDS),
    (encode(StepResult(1, [SeqOutput("a", [5], None, 3)], 1, 0, 9))[:-3], (StepResult,)),
    # 21 alternatives, or ids and values of different lengths: over the message's own bounds
    (_frame(StepResult.KIND,
            [1, [["a", [5], None, 3, [[-1.0, list(range(21)), [-1.0] * 21]], None]], 1, 0, 9, 0]),
     (StepResult,)),
    (_frame(StepResult.KIND,
            [1, [["a", [5], None, 3, [[-1.0, [1, 2], [-1.0]]], None]], 1, 0, 9, 0]),
     (StepResult,)),
    (_admit_frame([1], _sp((1.0, 1.0, 0, 0, 4, [], False, 21))),
     (Admit,)),
    # n outside 1..MAX_CHOICES
    (_admit_frame([1], _sp(), n=0), (Admit,)),
    (_admit_frame([1], _sp(), n=17),
     (Admit,)),
    (_frame(Cancel.KIND, [1]), (Cancel,)),  # too few fields
    (_frame(Cancel.KIND, [1, "x", 3]), (Cancel,)),  # too many fields
    (_frame(Cancel.KIND, {"seq": 1, "request_id": "x"}), (Cancel,)),  # a map, not an array
    (_frame(Cancel.KIND, ["1", "x"]), (Cancel,)),  # str for int
    (_frame(Cancel.KIND, [True, "x"]), (Cancel,)),  # bool for int
    (_frame(Cancel.KIND, [1.0, "x"]), (Cancel,)),  # float for int
    (_frame(Cancel.KIND, [1, b"x"]), (Cancel,)),  # bytes for str
    (_frame(Shutdown.KIND, [None]), (Shutdown,)),  # None for a required int
    (_frame(Cancel.KIND, [1, None]), (Cancel,)),  # None for a required str
    # (a whole StepResult, so that only the one bad value is wrong: see the test below)
    (_frame(StepResult.KIND, [1, [["a", [5], None, 3, "x", None]], 1, 0, 9, 0]), (StepResult,)),
    (_frame(StepResult.KIND, [1, [["a", [5], b"stop", 3, None, None]], 1, 0, 9, 0]), (StepResult,)),
    (_frame(StepResult.KIND, [1, [["a", [5], None, 3.0, None, None]], 1, 0, 9, 0]), (StepResult,)),
    (_admit_frame([1, "2"], _sp()), (Admit,)),
    (_admit_frame([1], _sp((1.0, 1.0, 0, 0, 4, [], 0, -1))),
     (Admit,)),
    (_admit_frame([1], _sp((True, 1.0, 0, 0, 4, [], False, -1))),
     (Admit,)),
    (_admit_frame(7, _sp()), (Admit,)),
    (_admit_frame([1], _sp(), grammar=None), (Admit,)),
    (_frame(Admit.KIND, [1, "r", [1], _sp(), 0, ""]), (Admit,)),  # too few fields
    # version 11's adapter_strength: out of 0..4, not a number, or on the base model (slot 0)
    (_admit_frame([1], _sp(), slot=1, key="k", strength=4.5), (Admit,)),
    (_admit_frame([1], _sp(), slot=1, key="k", strength=-0.5), (Admit,)),
    (_admit_frame([1], _sp(), slot=1, key="k", strength="2"), (Admit,)),
    (_admit_frame([1], _sp(), slot=1, key="k", strength=float("nan")), (Admit,)),
    (_admit_frame([1], _sp(), strength=2.0), (Admit,)),
    (_frame(StepResult.KIND, [1, [["a", [5], 3, 3, None, None]], 1, 0, 9, 0]), (StepResult,)),
    # echo's values out of their bounds, or not a list
    (_frame(StepResult.KIND, [1, [["a", [], None, 3, None, [[-1.0, [1], []]]]], 1, 0, 9, 0]),
     (StepResult,)),
    (_frame(StepResult.KIND, [1, [["a", [], None, 3, None, -1.0]], 1, 0, 9, 0]), (StepResult,)),
    (_admit_frame([1], _sp((1.0, 1.0, 0, 0, 0, [], False, -1), prompt_logprobs=21)),
     (Admit,)),
    (_frame(StepResult.KIND, [1, [["a", [5], None]], 1, 0, 9, 0]), (StepResult,)),
    (_frame(Ready.KIND, [0, 3, "x", 1, 1, "d", [["weights", "1.5"]]]), (Ready,)),  # str seconds
    (bytes([Cancel.KIND]) + b"\xc1\xc1", (Cancel,)),  # bytes msgpack never produces
    # the version 8 fields' own bounds: a penalty of 0, a bias over 100, unsorted or repeated
    # logit_bias ids, min_tokens over max_tokens, a bias entry that is not a pair
    (_admit_frame([1], _sp(repetition_penalty=0)), (Admit,)),
    (_admit_frame([1], _sp(logit_bias=[[3, 101.0]])), (Admit,)),
    (_admit_frame([1], _sp(logit_bias=[[9, 1], [3, 1]])), (Admit,)),
    (_admit_frame([1], _sp(logit_bias=[[3, 1], [3, 2]])), (Admit,)),
    (_admit_frame([1], _sp(min_tokens=5)), (Admit,)),
    (_admit_frame([1], _sp(logit_bias=[3])), (Admit,)),
    (_admit_frame([1], _sp(presence_penalty=2.5)), (Admit,)),
    (_admit_frame([1], _sp(), cache_prompt=1), (Admit,)),  # cache_prompt
])
def test_rejections(frame, accept):
    with pytest.raises(ProtocolError):
        decode(frame, accept)


def test_the_step_result_frame_of_the_rejections_decodes_with_good_values():
    frame = _frame(StepResult.KIND, [1, [["a", [5], None, 3, None, None, 16],
                                     ["b", [], "stop", 4, None, None, 0]], 1, 0, 9, 0, 0, 0])
    assert decode(frame, (StepResult,)) == StepResult(
        1, [SeqOutput("a", [5], None, 3, num_cached_tokens=16), SeqOutput("b", [], "stop", 4)],
        1, 0, 9, 0)


def test_oversized_frame_is_refused_before_parsing():
    frame = bytes([Admit.KIND]) + b"\x00" * MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(frame, (Admit,))


def test_rank_status_round_trip():
    msg = RankStatus(1, "serving", 12345, 0.25, 17, 239, 12, 3)
    assert decode(encode(msg), (RankStatus,)) == msg


def test_legit_big_messages_fit_and_oversized_ones_are_refused_at_encode():
    # A prompt of a 1M-token context and a step result for 512 sequences stay far below the limit.
    big_prompt = Admit(1, "r", list(range(1_000_000)), SAMPLING, 0, "")
    assert decode(encode(big_prompt), (Admit,)) == big_prompt
    outputs = [SeqOutput(f"chatcmpl-{i:032x}", [i], None, 4096) for i in range(512)]
    assert decode(encode(StepResult(1, outputs, 512, 0, 9)), (StepResult,)).outputs == outputs
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(StepFailed(1, [], "x" * MAX_FRAME_BYTES))


def test_a_step_of_echo_values_at_its_cap_fits_a_frame():
    """The planner caps echo's prompt positions at MAX_PROMPT_LOGPROBS_PER_STEP a step; that many
    values with 20 alternatives each, at the widest ids and values msgpack has, fit a frame."""
    worst = TokenLogprobs(-1e-300 / 3, [2**31 + i for i in range(MAX_TOP_LOGPROBS)],
                          [-1e-300 / (i + 3) for i in range(MAX_TOP_LOGPROBS)])
    values = [worst] * MAX_PROMPT_LOGPROBS_PER_STEP
    frame = encode(StepResult(1, [SeqOutput("cmpl-" + "f" * 32, [2**31], None, 10**6, [worst],
                                            values)], 1, 0, 9))
    assert len(frame) < MAX_FRAME_BYTES / 2
