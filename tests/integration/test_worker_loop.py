"""Real worker processes (`python -m lorad.workers`) at world 1 and 2, with the test playing the
coordinator over real zmq sockets: greedy tokens against transformers, cancel, garbage, shutdown.
The failed-step path (digests that differ) runs the loop in a thread with a fake engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq

from lorad.config import WorkerConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.protocol import (
    PROTOCOL_VERSION, Admit, Cancel, Hello, RankStatus, Ready, SamplingParams, Shutdown,
    StepFailed, StepResult, WorkerFailed, decode, encode)
from lorad.protocol import MAX_FRAME_BYTES
from lorad.protocol.messages import choice_ids
from lorad.protocol.sockets import (
    bind_publisher, bind_puller, connect_pusher, connect_subscriber, make_runtime_dir)
from lorad.workers import loop as loop_module
from lorad.workers.adapter_store import AdapterStore
from lorad.workers.agreement import RegistryDigest, StepAgreement
from lorad.workers.seq_limit import auto_max_num_seqs
from tests.tiny_models import make_tiny_llama

REPO = Path(__file__).resolve().parents[2]
EOS = 2
NUM_KV_BLOCKS = 20  # fewer than the requests below need at once: forces preemption
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
PROMPT_LENS = (3, 9, 17, 30)  # 30 > the 16-token budget: a chunked prefill
MAX_TOKENS = (20, 14, 20, 16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", with_tokenizer=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> list[list[int]]:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outs = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS):
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def greedy(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(0.0, 1.0, 0, 0, max_tokens, [EOS], ignore_eos)


class FakeCoordinator:
    """PUB/PULL bound in a private runtime dir, worker processes started as the daemon does.

    adapters: WorkerConfig.adapters; rank_adapters: other entries for some ranks (each rank then
    reads its own worker.json); env: extra environment variables for the workers; overrides:
    other WorkerConfig fields (device, dtype... for the GPU tests)."""

    def __init__(self, checkpoint: Path, parallel: int, coordinator_pid: int | None = None,
                 adapters: list[dict] = (), rank_adapters: dict[int, list[dict]] | None = None,
                 env: dict[str, str] | None = None, overrides: dict | None = None):
        self._parent = tempfile.mkdtemp(prefix="lw", dir="/tmp")  # ipc paths must stay short
        runtime, instance = make_runtime_dir(self._parent, "t")
        self.cfg = WorkerConfig(
            model_dir=str(checkpoint), parallel=parallel, dtype="auto", device="cpu",
            dist_backend="auto", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
            max_num_batched_tokens=16, block_size=BLOCK_SIZE, kv_cache_blocks=NUM_KV_BLOCKS,
            kv_cache_memory=None, num_threads=1, runtime_dir=str(runtime), instance_id=instance,
            coordinator_pid=coordinator_pid or os.getpid(), adapters=list(adapters))
        self.cfg = replace(self.cfg, **(overrides or {}))
        self.cfg.path.write_text(self.cfg.to_json())
        config_paths = [self.cfg.path] * parallel
        for rank, entries in (rank_adapters or {}).items():
            config_paths[rank] = runtime / f"worker.rank{rank}.json"
            config_paths[rank].write_text(replace(self.cfg, adapters=list(entries)).to_json())
        self.ctx = zmq.Context()
        self.pub = bind_publisher(self.ctx, self.cfg.admit_endpoint)
        self.pull = bind_puller(self.ctx, self.cfg.results_endpoint)
        self.seq = 0
        self.statuses: dict[int, RankStatus] = {}  # each rank's latest report
        self.logs = [open(runtime / f"rank{r}.log", "w+") for r in range(parallel)]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "lorad.workers", "--config", str(config_paths[r]),
             "--rank", str(r)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=self.logs[r], stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}) for r in range(parallel)]

    def handshake(self, timeout_s: float = 120) -> list[Ready]:
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.procs):
            assert time.monotonic() < deadline, f"no Ready in time:\n{self.worker_logs()}"
            self.pub.send(encode(Hello(PROTOCOL_VERSION, self.cfg.instance_id)))
            if self.pull.poll(100):
                msg = self.recv((Ready, WorkerFailed))
                if msg is None:
                    continue
                assert isinstance(msg, Ready), f"{msg}\n{self.worker_logs()}"
                ready[msg.rank] = msg
        self.pub.send(encode(Hello(PROTOCOL_VERSION, self.cfg.instance_id)))  # a late repeat
        return [ready[r] for r in range(len(self.procs))]

    def start_up_failures(self, timeout_s: float = 120) -> dict[int, str]:
        """Send Hello until every rank has answered; -> rank -> its WorkerFailed message."""
        answers: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(self.procs):
            assert time.monotonic() < deadline, f"not every rank answered:\n{self.worker_logs()}"
            self.pub.send(encode(Hello(PROTOCOL_VERSION, self.cfg.instance_id)))
            if self.pull.poll(100):
                msg = self.recv((Ready, WorkerFailed))
                if msg is None:
                    continue
                answers[msg.rank] = msg
        assert all(isinstance(m, WorkerFailed) for m in answers.values()), answers
        return {rank: msg.message for rank, msg in answers.items()}

    def recv(self, accept: tuple[type, ...]):
        """The next message of the kinds accepted, or None for a RankStatus (kept in statuses)."""
        msg = decode(self.pull.recv(), accept + (RankStatus,))
        if isinstance(msg, RankStatus):
            self.statuses[msg.rank] = msg
            return None
        return msg

    def send(self, make) -> None:
        self.seq += 1
        self.pub.send(encode(make(self.seq)))

    def results(self, timeout_s: float = 60, failed_ok: bool = False):
        """Yield StepResults (and StepFailed when failed_ok) until timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.pull.poll(int(left * 1000) + 1), \
                f"no result in time:\n{self.worker_logs()}"
            msg = self.recv((StepResult, StepFailed, WorkerFailed))
            if msg is None:
                continue
            assert isinstance(msg, StepResult) or (failed_ok and isinstance(msg, StepFailed)), \
                f"{msg}\n{self.worker_logs()}"
            yield msg

    def worker_logs(self) -> str:
        out = []
        for r, f in enumerate(self.logs):
            f.flush()
            f.seek(0)
            out.append(f"--- rank {r} ---\n{f.read()[-4000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in self.logs:
            f.close()
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._parent, ignore_errors=True)


@pytest.mark.parametrize("parallel, async_scheduling",
                         [(1, False), (1, True), (2, False)])
def test_worker_loop_serves_like_transformers(checkpoint, prompts, reference, parallel,
                                               async_scheduling):
    # async_scheduling: decode steps run ahead of their apply (loop.py), on the CPU too here.
    coord = FakeCoordinator(checkpoint, parallel,
                            overrides={"async_scheduling": async_scheduling})
    try:
        ready = coord.handshake()
        assert {(r.num_kv_blocks, r.block_size, r.instance_id, r.max_num_seqs) for r in ready} == \
            {(NUM_KV_BLOCKS, BLOCK_SIZE, coord.cfg.instance_id, 8)}  # an explicit value is kept
        assert len({r.registry_digest for r in ready}) == 1

        for garbage in (b"", b"\x02", b"\x02not msgpack", b"\xff\x00\x01",
                        encode(Ready(0, 1, "x", 1, 1, "d", 1, [])), encode(Shutdown(0)),
                        bytes([Admit.KIND]) + b"\x00" * MAX_FRAME_BYTES):
            coord.pub.send(garbage)
        for i, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS)):
            coord.send(lambda seq: Admit(seq, f"r{i}", prompt, greedy(max_tokens), 0, ""))

        tokens, finished, result = _collect(coord, [f"r{i}" for i in range(len(prompts))])
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
        for i, ref in enumerate(reference):
            assert finished[f"r{i}"] == ("stop" if ref[-1] == EOS else "length")
        assert result.num_free_blocks == NUM_KV_BLOCKS
        assert "preempted" in coord.worker_logs()  # the small pool really forced recompute
        assert "dropped a frame" in coord.worker_logs()
        assert "exceeds the" in coord.worker_logs()  # the oversized one, logged, not fatal
        assert ("async scheduling: step" in coord.worker_logs()) == async_scheduling

        _cancel_frees_blocks(coord, prompts[3])
        _every_rank_reports_a_free_pool(coord)
        _sampling_ignores_neighbours(coord, prompts)
        coord.send(Shutdown)
        for proc in coord.procs:
            assert proc.wait(timeout=30) == 0, coord.worker_logs()
    finally:
        coord.close()


@pytest.mark.parametrize("parallel", [1, 2])
def test_n_choices_fork_through_preemption_like_transformers(checkpoint, prompts, reference,
                                                              parallel):
    # Three greedy choices of each prompt in the small pool: the choices share each prompt's
    # blocks, get preempted (releasing only their references) and recompute, and every one
    # still equals transformers' greedy run; the pool is whole again at the end.
    coord = FakeCoordinator(checkpoint, parallel)
    try:
        coord.handshake()
        for i, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS)):
            coord.send(lambda seq: Admit(seq, f"r{i}", prompt, greedy(max_tokens), 0, "", "", 3))
        ids = [choice_ids(f"r{i}", 3) for i in range(len(prompts))]
        tokens, finished, result = _collect(coord, [r for group in ids for r in group])
        for group, ref in zip(ids, reference):
            assert [tokens[r] for r in group] == [ref] * 3
            assert {finished[r] for r in group} == {"stop" if ref[-1] == EOS else "length"}
        assert result.num_free_blocks == NUM_KV_BLOCKS
        assert "preempted" in coord.worker_logs()
        coord.send(Shutdown)
        for proc in coord.procs:
            assert proc.wait(timeout=30) == 0, coord.worker_logs()
    finally:
        coord.close()


def _collect(coord: FakeCoordinator, request_ids: list[str]):
    """Read step results until every request finished: (tokens, finish reasons, last result)."""
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    finished: dict[str, str] = {}
    for result in coord.results():
        for out in result.outputs:
            assert out.request_id not in finished
            tokens[out.request_id] += out.token_ids
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
        if len(finished) == len(request_ids):
            return tokens, finished, result


def _every_rank_reports_a_free_pool(coord: FakeCoordinator) -> None:
    # Every rank's own status thread, not the leader's StepResult: followers' pools count too.
    first_steps = {rank: msg.steps for rank, msg in coord.statuses.items()}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if coord.pull.poll(100):
            coord.recv(())
        statuses = coord.statuses
        if len(statuses) == len(coord.procs) and all(
                (m.phase, m.kv_blocks_used, m.kv_blocks_free) == ("serving", 0, NUM_KV_BLOCKS)
                and m.steps > first_steps.get(m.rank, 0) for m in statuses.values()):
            return
    pytest.fail(f"statuses never showed every pool free: {coord.statuses}")


def _sampling_ignores_neighbours(coord: FakeCoordinator, prompts: list[list[int]]) -> None:
    # Padding to 8 rows and one thread keep a row's logits bit-identical whatever shares the
    # batch, and each request draws from its own generator: the same seed gives the same tokens.
    params = SamplingParams(0.9, 0.95, 50, 11, 12, [EOS], True)
    coord.send(lambda seq: Admit(seq, "solo", prompts[1], params, 0, ""))
    solo, _, _ = _collect(coord, ["solo"])
    coord.send(lambda seq: Admit(seq, "n0", prompts[0], greedy(5), 0, ""))
    coord.send(lambda seq: Admit(seq, "crowd", prompts[1], params, 0, ""))
    coord.send(lambda seq: Admit(seq, "n2", prompts[2], SamplingParams(1.0, 1.0, 0, 3, 9, [],
                                                                       True), 0, ""))
    crowd, _, _ = _collect(coord, ["n0", "crowd", "n2"])
    assert crowd["crowd"] == solo["solo"] and len(solo["solo"]) == 12


def _cancel_frees_blocks(coord: FakeCoordinator, prompt: list[int]) -> None:
    coord.send(lambda seq: Admit(seq, "long", prompt, greedy(30, ignore_eos=True), 0, ""))
    results = coord.results()
    for result in results:
        if any(o.request_id == "long" and o.token_ids for o in result.outputs):
            break
    assert result.num_free_blocks < NUM_KV_BLOCKS
    coord.send(lambda seq: Cancel(seq, "long"))
    for result in results:
        (out,) = [o for o in result.outputs if o.request_id == "long"] or [None]
        if out is not None and out.finish_reason:
            break
    assert (out.finish_reason, out.token_ids, out.num_prompt_tokens) == \
        ("cancelled", [], len(prompt))
    assert (result.num_running, result.num_waiting, result.num_free_blocks) == \
        (0, 0, NUM_KV_BLOCKS)


def test_auto_max_num_seqs_is_the_same_on_every_rank(checkpoint):
    coord = FakeCoordinator(checkpoint, 2, overrides={"max_num_seqs": None})
    try:
        ready = coord.handshake()
        # 16: the loop's token budget (max_num_batched_tokens) caps the floor of 64
        expected = auto_max_num_seqs(NUM_KV_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN,
                                     coord.cfg.max_num_batched_tokens, on_gpu=False)
        assert expected == 16
        assert [r.max_num_seqs for r in ready] == [expected, expected]
        assert "at most 16 sequences a step (--max-num-seqs auto)" in coord.worker_logs()
        coord.send(Shutdown)
        for proc in coord.procs:
            assert proc.wait(timeout=30) == 0, coord.worker_logs()
    finally:
        coord.close()


def test_worker_exits_when_the_coordinator_is_gone(checkpoint):
    stand_in = subprocess.Popen(["sleep", "60"])  # plays the coordinator's pid
    coord = FakeCoordinator(checkpoint, 1, coordinator_pid=stand_in.pid)
    try:
        coord.handshake()
        stand_in.kill()
        stand_in.wait()
        start = time.monotonic()
        assert coord.procs[0].wait(timeout=10) != 0
        assert time.monotonic() - start < 3, coord.worker_logs()
    finally:
        stand_in.kill()
        coord.close()


def test_workers_stuck_in_a_step_exit_when_the_coordinator_is_gone(checkpoint):
    # Rank 1 blocks inside its first model step and rank 0 waits for it in a collective: neither
    # loop can look at the coordinator, so the status threads have to end the processes.
    stand_in = subprocess.Popen(["sleep", "60"])
    coord = FakeCoordinator(checkpoint, 2, coordinator_pid=stand_in.pid,
                            env={"LORAD_TEST_STALL_RANK": "1"})
    try:
        coord.handshake()
        coord.send(lambda seq: Admit(seq, "a", [5, 6, 7], greedy(4), 0, ""))
        deadline = time.monotonic() + 30
        while not (len(coord.statuses) == 2
                   and all(m.step_seconds > 1 for m in coord.statuses.values())):
            assert time.monotonic() < deadline, f"{coord.statuses}\n{coord.worker_logs()}"
            if coord.pull.poll(100):
                coord.recv((StepResult,))
        stand_in.kill()
        stand_in.wait()
        start = time.monotonic()
        for proc in coord.procs:
            assert proc.wait(timeout=15) == 1, coord.worker_logs()
        assert time.monotonic() - start < 6, coord.worker_logs()
        # Rank 1 can only be ended by its status thread; rank 0 either by its own or by gloo
        # failing once rank 1 is gone (then it exits 1 through WorkerFailed).
        rank1 = coord.worker_logs().split("--- rank 1 ---")[1]
        assert "the step loop is stuck" in rank1, coord.worker_logs()
    finally:
        stand_in.kill()
        coord.close()


class FakeEngine:
    """The engine's surface the loop uses, at world size 1: always predicts token 5."""

    def __init__(self) -> None:
        self.tp = SimpleNamespace(rank=0, world_size=1, cpu_group=None, device=torch.device("cpu"))
        self.num_kv_blocks = 16
        self.block_size = BLOCK_SIZE
        self.max_num_seqs = 4
        self.registry = RegistryDigest(b"m" * 32, b"e" * 32, b"a" * 32)
        self.startup_phases = []
        self.store = AdapterStore({}, None, LoraCapacity(0, False, 0), 0, torch.device("cpu"))
        self.resident = {}

    def adapter_refusal(self, adapter_id: int, key: str) -> str | None:
        return None if (adapter_id, key) == (0, "") else "no adapters here"

    def forward(self, plan):
        logits = torch.zeros(len(plan.sampled_request_ids), 32)  # [num_sampled, vocab]
        logits[:, 5] = 1.0
        return logits


def test_digest_mismatch_fails_the_step_and_the_loop_goes_on(tmp_path, monkeypatch):
    # The second step that "a" is live in (its first decode, after the prefill that gave its
    # first token) sees other digests. Counted by the loop's own steps, not by the test
    # thread's timing: a loaded machine once let "a" run to its length before a flag set after
    # its first token reached the loop.
    steps_with_a = []
    real_agree = loop_module.agree_step

    def agree(tp, watermark, digest, *spill):
        agreed = real_agree(tp, watermark, digest, *spill)
        if any(seq.request_id == "a" for seq in worker.planner.live()):
            steps_with_a.append(digest)
            if len(steps_with_a) == 2:
                return StepAgreement(agreed.watermark, False, [digest, digest + 1])
        return agreed
    monkeypatch.setattr(loop_module, "agree_step", agree)

    cfg = WorkerConfig(
        model_dir="unused", parallel=1, dtype="auto", device="cpu", dist_backend="auto",
        max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=16,
        block_size=BLOCK_SIZE, kv_cache_blocks=16, kv_cache_memory=None, num_threads=1,
        runtime_dir=str(tmp_path), instance_id="fake", coordinator_pid=os.getpid())
    ctx = zmq.Context()
    pub, pull = bind_publisher(ctx, "inproc://admit"), bind_puller(ctx, "inproc://results")
    sub, push = connect_subscriber(ctx, "inproc://admit"), connect_pusher(ctx, "inproc://results")
    pull.setsockopt(zmq.RCVTIMEO, 10_000)  # a hung loop fails the test instead of blocking it
    exit_code = []
    try:  # the sockets close whatever fails: a context left open hangs a later GC's term()
        worker = loop_module.WorkerLoop(cfg, 0, FakeEngine(), sub, push)
        thread = threading.Thread(target=lambda: exit_code.append(worker.run()), daemon=True)
        thread.start()
        pub.send(encode(Hello(PROTOCOL_VERSION, "fake")))
        assert isinstance(decode(pull.recv(), (Ready,)), Ready)
        pub.send(encode(Admit(1, "a", [7, 8, 9], greedy(100, ignore_eos=True), 0, "")))
        first = decode(pull.recv(), (StepResult,))
        assert first.outputs[0].token_ids == [5]
        while True:
            msg = decode(pull.recv(), (StepResult, StepFailed))
            if isinstance(msg, StepFailed):
                break
        assert msg.request_ids == ["a"] and "differ" in msg.message
        pub.send(encode(Cancel(2, "a")))  # already gone: nothing happens
        pub.send(encode(Admit(3, "b", [1, 2], greedy(2), 0, "")))
        outs = []  # an empty StepResult may come first: the dropped sequence freed its blocks
        while len(outs) < 2:
            outs += decode(pull.recv(), (StepResult,)).outputs
        assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == \
            [("b", [5], None), ("b", [5], "length")]
        assert worker.planner.blocks.num_free_blocks == 16
        pub.send(encode(Shutdown(4)))
        thread.join(timeout=10)
        assert exit_code == [0]
    finally:
        for sock in (pub, pull, sub, push):
            sock.close(linger=0)
        ctx.term()
