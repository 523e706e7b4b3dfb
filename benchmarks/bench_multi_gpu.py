#!/usr/bin/env python3
"""Issue 6: lorad at --parallel 2 over NCCL on two GPUs (run by scripts/multi_gpu_session.sh).

    multi_gpu_checks.py logits --device cuda --backend nccl --work DIR
        tests/tp_runner.py ranks at world 1 and 2 (fp32 and bf16, the adapters and scenarios of
        tests/unit/test_lora_logits.py) against transformers + peft fp32, and world 2 against 1.
    multi_gpu_checks.py serve --device cuda --backend nccl --work DIR
        a real daemon at --parallel 2 with adapters a and b: start-up (registry agreement),
        scripts/adapter_mix.py (burst == solo), then per-step agreement through the
        LORAD_TEST_CORRUPT_SLOT_RANK hook (that step fails on every rank, serving goes on).
    multi_gpu_checks.py faults --device cuda --backend nccl --work DIR
        kill -9 of one worker mid-stream (rank 1, then rank 0), and one rank raising in a step
        (a wrapper worker command that patches Engine.forward; lorad itself is unchanged):
        every open stream ends with an error event, the daemon exits non-zero, every worker
        process is gone within seconds.
    multi_gpu_checks.py bench --device cuda --backend nccl --work DIR [--config DIR]
        eager decode step time of the 8B shape (random weights) at world 1 and 2, batch 1 and
        32, and a loop of the step's collectives alone for the all-reduce share.

Every subcommand prints PASS/FAIL lines and exits 0 only when all its checks passed. Internal
subcommands: `rank` (one bench rank), `raising-worker` (the worker wrapper).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RAISE_RANK_ENV = "LORAD_CHECK_RAISE_RANK"  # the raising-worker wrapper's rank to fail
RAISE_TRIGGER_ENV = "LORAD_CHECK_RAISE_TRIGGER"  # ... at its first step once this file exists
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    results.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return bool(ok)


def finish() -> int:
    failed = [name for name, ok, _ in results if not ok]
    print(f"--- {len(results) - len(failed)}/{len(results)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed or not results else 0


# --- part 1a: logits at world 1 and 2 -------------------------------------------------------

def cmd_logits(args) -> int:
    import torch
    from safetensors.torch import load_file

    import tests.unit.test_lora_logits as T
    from tests.tiny_adapters import make_peft_adapter
    from tests.tiny_models import make_tiny_llama
    from tests.tp_runner import launch_ranks

    root = Path(args.work)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda" and args.backend == "nccl":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    shape = dict(T.MODEL)
    if max(worlds) > shape["num_key_value_heads"]:  # whole KV heads per rank
        heads = 2 * max(worlds)  # head_dim 16, as the GPU attention kernels need
        shape.update(num_key_value_heads=max(worlds), num_attention_heads=heads,
                     hidden_size=16 * heads)
    base = make_tiny_llama(root / "base", with_tokenizer=False, **shape)
    folders = {name: make_peft_adapter(base, root / name, **kw) for name, kw in T.FOLDERS.items()}
    entry = {"dir": str(base), "num_blocks": T.NUM_BLOCKS, "block_size": T.BLOCK_SIZE,
             "scenarios": T.STEPS, "adapters": T.adapter_args(folders)}
    models = {w: [{**entry, "name": "fp32", "dtype": "float32"},
                  {**entry, "name": "bf16", "dtype": "bfloat16"}] for w in worlds}
    started = time.monotonic()
    runs_root = root / "runs"
    runs_root.mkdir()
    try:
        runs = launch_ranks(models, runs_root, backend=args.backend, device=args.device,
                            timeout_s=args.rank_timeout)
    except AssertionError as exc:
        check("logits: tp_runner ranks ran", False, str(exc)[-3000:])
        return finish()
    check("logits: tp_runner ranks ran", True, f"{time.monotonic() - started:.1f} s")

    # peft's fp32 logits, as test_lora_logits.reference builds them.
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    refs = {}
    with torch.no_grad():
        for seq, ids in T.SEQS.items():
            refs[(0, seq)] = model(torch.tensor([ids])).logits[0]
        for slot, (_, folder, strength) in T.SLOTS.items():
            name = f"slot{slot}"
            peft_model = PeftModel.from_pretrained(model, folders[folder], adapter_name=name)
            for module in peft_model.modules():
                scaling = getattr(module, "scaling", None)
                if isinstance(scaling, dict) and name in scaling:
                    scaling[name] *= strength
            for seq, ids in T.SEQS.items():
                refs[(slot, seq)] = peft_model(torch.tensor([ids])).logits[0]
            model = peft_model.unload()

    def read(world, dtype, rank=0):
        return load_file(str(runs[world] / f"{dtype}.rank{rank}.safetensors"))

    def worst(got_of, want_of) -> float:
        return max(T.relative_error(got_of(k), want_of(k)) for k in keys)

    keys = [f"{s}.{i}" for s, steps in T.EXPECTED.items() for i in range(len(steps))]
    want = {f"{s}.{i}": torch.stack([refs[(slot, seq)][pos] for slot, seq, pos in rows])
            for s, steps in T.EXPECTED.items() for i, rows in enumerate(steps)}
    tols = {"fp32": args.fp32_tol, "bf16": args.bf16_tol}
    for dtype, tol in tols.items():
        for world in worlds:
            got = read(world, dtype)
            err = worst(got.__getitem__, want.__getitem__)
            check(f"logits: {dtype} world {world} vs peft fp32", err < tol,
                  f"max relative error {err:.2e} (tolerance {tol:.0e})")
        w1 = read(1, dtype)
        for world in worlds[1:]:
            ranks = [read(world, dtype, rank) for rank in range(world)]
            err = worst(ranks[0].__getitem__, w1.__getitem__)
            check(f"logits: {dtype} world {world} vs world 1", err < tol,
                  f"max relative error {err:.2e} (tolerance {tol:.0e})")
            same = all(torch.equal(r[k], ranks[0][k]) for r in ranks[1:] for k in keys)
            check(f"logits: {dtype} world {world} ranks return identical logits", same)
    # Batch invariance on this device (informational on CUDA: kernels may pick by batch size).
    for world in worlds:
        got = read(world, "fp32")
        diffs = []
        for i, (solo_rows, batched_rows) in enumerate(zip(T.EXPECTED["solo"],
                                                          T.EXPECTED["batched"])):
            solo = got[f"solo.{i}"][0]
            batched = got[f"batched.{i}"][batched_rows.index(solo_rows[0])]
            diffs.append((solo - batched).abs().max().item())
        print(f"INFO logits: fp32 world {world} solo vs batched row max |diff| {max(diffs):.2e}"
              f" ({'bit-identical' if max(diffs) == 0 else 'not bit-identical'})")
    return finish()


# --- daemons ----------------------------------------------------------------------------------

class Daemon:
    def __init__(self, model_dir: Path, flags: list[str], log_path: Path, entry=None,
                 env: dict | None = None) -> None:
        from tests.daemons import free_port
        self.runtime = Path(tempfile.mkdtemp(prefix="lrd-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [*(entry or [sys.executable, "-m", "lorad.daemon"]), "--model", str(model_dir),
                "--port", str(self.port), "--runtime-dir", str(self.runtime), *flags]
        print(f"starting: {' '.join(argv)}  (log {log_path})", flush=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              **(env or {})})
        self.started = time.monotonic()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def wait_healthy(self, timeout_s: float) -> str | None:
        """None once /health says serving; else why not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode} during start-up:\n{self.log()[-3000:]}"
            try:
                if self.health().get("status") == "serving":
                    return None
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        return f"not healthy within {timeout_s:.0f} s:\n{self.log()[-3000:]}"

    def worker_pids(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 40) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


def check_sigterm(daemon: "Daemon", pids: list[int], part: str) -> None:
    """SIGTERM the daemon: it exits 0 and leaves no worker."""
    code = daemon.stop()
    check(f"{part}: SIGTERM exits 0", code == 0, f"exit {code}")
    alive, _ = wait_gone(pids, 10)
    check(f"{part}: no worker left after SIGTERM", not alive, f"alive: {alive}")


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> tuple[list[int], float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        alive = [p for p in pids if running(p)]
        if not alive:
            return [], time.monotonic() - start
        time.sleep(0.05)
    return [p for p in pids if running(p)], time.monotonic() - start


def kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def device_flags(args) -> list[str]:
    flags = ["--parallel", str(args.parallel), "--device", args.device,
             "--dist-backend", args.backend,
             "--dtype", args.dtype, "--kv-cache-blocks", "512", "--max-num-seqs", "48",
             "--startup-timeout", str(int(args.startup_timeout))]
    if args.device == "cpu":
        flags += ["--threads", "1"]
    return flags


def make_model_and_adapters(root: Path, parallel: int = 2) -> tuple[Path, dict[str, Path]]:
    from tests.tiny_adapters import make_peft_adapter
    from tests.tiny_models import make_tiny_llama
    # Whole KV heads per rank: at least one per rank, two query heads each.
    # head_dim 16: the GPU attention kernels need at least 16 (a tl.dot's K).
    kv_heads = max(2, parallel)
    model = make_tiny_llama(root / "tiny", max_position_embeddings=2048,
                            hidden_size=32 * kv_heads, intermediate_size=64 * kv_heads,
                            num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads)
    adapters = {"a": make_peft_adapter(model, root / "a", r=4, seed=1),
                "b": make_peft_adapter(model, root / "b", r=8, lora_alpha=8, seed=2,
                                       target_modules=("q_proj", "v_proj", "o_proj",
                                                       "down_proj"))}
    return model, adapters


def adapter_flags(adapters: dict[str, Path]) -> list[str]:
    return [f for name, path in adapters.items() for f in ("--adapter", f"{name}={path}")]


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    from urllib.parse import urlparse
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request("POST", parsed.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw[:500].decode(errors="replace")}
    finally:
        conn.close()


# --- part 1b: a real daemon at --parallel 2, adapter_mix, per-step agreement ---------------------

def cmd_serve(args) -> int:
    root = Path(args.work)
    model, adapters = make_model_and_adapters(root, args.parallel)
    daemon = Daemon(model, device_flags(args) + adapter_flags(adapters), root / "serve.log")
    pids: list[int] = []
    try:
        problem = daemon.wait_healthy(args.startup_timeout)
        if not check(f"serve: daemon --parallel {args.parallel} starts (registry agreement) "
                     "and is healthy", problem is None,
                     problem or f"{time.monotonic() - daemon.started:.1f} s"):
            return finish()
        pids = daemon.worker_pids()
        health = daemon.health()
        check(f"serve: /health reports {args.parallel} ranks and both adapters",
              len(health.get("ranks", [])) == args.parallel
              and len(health.get("adapters", [])) == 2,
              json.dumps({k: health.get(k) for k in ("ranks", "adapters", "kv_blocks")})[:400])
        log = daemon.log()
        for needle in (f"backend {args.backend}", f"world size {args.parallel}"):
            check(f"serve: worker log says {needle!r}", needle in log)
        cmd = [sys.executable, str(REPO / "scripts/adapter_mix.py"), "--url", daemon.url,
               "--models", "tiny,a,b", "--max-tokens", "32", "--ignore-eos", "--timeout", "60"]
        mix = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        print(mix.stdout + mix.stderr, flush=True)
        check(f"serve: adapter_mix burst equals solo runs (--parallel {args.parallel})",
              mix.returncode == 0,
              f"exit {mix.returncode}")
        check_sigterm(daemon, pids, "serve")
    finally:
        daemon.stop(signal.SIGKILL, 10)
        kill_leftovers(pids)

    # Per-step agreement: rank 1 applies its first adapter admission with another slot.
    from lorad.workers.loop import CORRUPT_SLOT_RANK_ENV
    daemon = Daemon(model, device_flags(args) + adapter_flags(adapters), root / "agree.log",
                    env={CORRUPT_SLOT_RANK_ENV: "1"})
    pids = []
    try:
        problem = daemon.wait_healthy(args.startup_timeout)
        if not check("agreement: daemon with the corrupt-slot hook on rank 1 starts",
                     problem is None, problem or ""):
            return finish()
        pids = daemon.worker_pids()
        body = {"model": "a", "prompt": [5, 17, 42, 99, 7, 250, 31, 64], "max_tokens": 8,
                "temperature": 0}
        status, reply = post(daemon.url + "/v1/completions", body)
        check("agreement: the disagreeing step fails with a 500", status == 500,
              f"{status} {json.dumps(reply)[:300]}")
        started = time.monotonic()
        status, reply = post(daemon.url + "/v1/completions", body)
        ok = status == 200 and reply.get("choices", [{}])[0].get("finish_reason") == "length"
        check("agreement: serving goes on (next request for a is 200)", ok,
              f"{status} in {time.monotonic() - started:.1f} s")
        status, reply = post(daemon.url + "/v1/completions", {**body, "model": "tiny"})
        check("agreement: base model request after it is 200", status == 200, f"{status}")
        check("agreement: daemon still running", daemon.proc.poll() is None)
        check_sigterm(daemon, pids, "agreement")
    finally:
        daemon.stop(signal.SIGKILL, 10)
        kill_leftovers(pids)
    return finish()


# --- part 2: fault injection --------------------------------------------------------------------

def open_streams(url: str, count: int, max_tokens: int) -> list[http.client.HTTPResponse]:
    """Open `count` streamed completions (alternating models) and read each one's first event."""
    from urllib.parse import urlparse
    parsed = urlparse(url)
    streams = []
    for i in range(count):
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
        body = {"model": ("tiny", "a", "b")[i % 3], "prompt": f"Hello number {i}",
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        streams.append(conn.getresponse())
    for resp in streams:
        assert resp.status == 200, resp.status
        while not resp.readline().startswith(b"data: "):
            pass
    return streams


def rest_events(resp: http.client.HTTPResponse, out: list) -> None:
    try:
        events = [e.strip().removeprefix(b"data: ") for e in resp.read().split(b"\n\n")]
        out.extend(e for e in events if e)
    except Exception as exc:  # a broken stream counts as no error event
        out.append(f"broken: {exc!r}".encode())


def stream_verdicts(streams) -> list[str]:
    """Read every stream to its end concurrently; -> per stream 'ok' or what was wrong."""
    outs = [[] for _ in streams]
    threads = [threading.Thread(target=rest_events, args=(r, o), daemon=True)
               for r, o in zip(streams, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    verdicts = []
    for events in outs:
        try:
            error = json.loads(events[-2])["error"]
            ok = events[-1] == b"[DONE]" and error.get("type") == "server_error"
            verdicts.append("ok" if ok else f"last events {events[-2:]!r}")
        except (IndexError, ValueError, KeyError, TypeError):
            verdicts.append(f"no error event; last events {events[-2:]!r}")
    return verdicts


def fault_case(args, name: str, model: Path, adapters, log_path: Path, inject,
               entry=None, env=None, expect_in_log: str | None = None) -> None:
    daemon = Daemon(model, device_flags(args) + adapter_flags(adapters), log_path, entry=entry,
                    env=env)
    pids: list[int] = []
    try:
        problem = daemon.wait_healthy(args.startup_timeout)
        if not check(f"{name}: daemon starts", problem is None, problem or ""):
            return
        pids = daemon.worker_pids()
        check(f"{name}: {args.parallel} worker processes", len(pids) == args.parallel,
              f"{pids}")
        streams = open_streams(daemon.url, args.streams, args.stream_tokens)
        t0 = time.monotonic()
        inject(pids)
        verdicts = stream_verdicts(streams)
        bad = [v for v in verdicts if v != "ok"]
        check(f"{name}: every open stream ({len(verdicts)}) ends with an error event + [DONE]",
              not bad, "; ".join(bad[:3]))
        try:
            code = daemon.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        check(f"{name}: daemon exits non-zero", code not in (None, 0),
              f"exit {code} {time.monotonic() - t0:.1f} s after the fault")
        alive, _ = wait_gone(pids, 10)
        gone_s = time.monotonic() - t0
        check(f"{name}: every worker gone within seconds (none stuck in a collective)",
              not alive and gone_s < 30, f"alive: {alive}; all gone {gone_s:.1f} s after the fault")
        leftovers = list(daemon.runtime.iterdir()) if daemon.runtime.exists() else []
        check(f"{name}: runtime folder removed", not leftovers, f"{leftovers}")
        if expect_in_log:
            check(f"{name}: log names the failure ({expect_in_log!r})",
                  expect_in_log in daemon.log())
        # Which failure the coordinator reported first (a race between the dead rank's exit and
        # its peer's failed collective): informational.
        first = next((line for line in daemon.log().splitlines()
                      if " ERROR lorad: " in line or "exited unexpectedly" in line), "none found")
        print(f"INFO {name}: first failure the coordinator reported: {first[:300]}", flush=True)
    except Exception:
        check(f"{name}: ran without an exception", False, traceback.format_exc()[-2000:])
    finally:
        daemon.stop(signal.SIGKILL, 10)
        kill_leftovers(pids)
        print(f"--- {name}: last lines of {log_path.name}:\n"
              + "\n".join(daemon.log().splitlines()[-12:]), flush=True)


def cmd_faults(args) -> int:
    root = Path(args.work)
    model, adapters = make_model_and_adapters(root, args.parallel)
    for rank in args.kill_ranks:
        fault_case(args, f"kill -9 rank {rank}", model, adapters, root / f"kill{rank}.log",
                   lambda pids, r=rank: os.kill(pids[r], signal.SIGKILL))
    # One rank raising inside a step: the wrapper worker patches Engine.forward on that rank.
    wrapper = (sys.executable, str(Path(__file__).resolve()), "raising-worker")
    code = ("import sys; from lorad.daemon.main import main; "
            f"sys.exit(main(sys.argv[1:], worker_command={wrapper!r}))")
    trigger = root / "raise-now"
    fault_case(args, "rank 1 raises in a step", model, adapters, root / "raise.log",
               lambda pids: trigger.touch(), entry=[sys.executable, "-c", code],
               env={RAISE_RANK_ENV: "1", RAISE_TRIGGER_ENV: str(trigger)},
               expect_in_log="injected failure in a step")
    return finish()


def cmd_raising_worker(argv: list[str]) -> int:
    """`python -m lorad.workers` with Engine.forward raising on rank RAISE_RANK at its first
    step after the trigger file appears (the check creates it once every stream is open)."""
    from lorad.workers import __main__ as worker_main
    from lorad.workers.engine import Engine

    rank = int(argv[argv.index("--rank") + 1])
    if os.environ.get(RAISE_RANK_ENV) == str(rank):
        trigger = os.environ[RAISE_TRIGGER_ENV]
        real_forward = Engine.forward
        calls = [0]

        def forward(self, plan):
            calls[0] += 1
            if os.path.exists(trigger):
                raise RuntimeError(f"injected failure in a step (rank {rank}, call {calls[0]})")
            return real_forward(self, plan)

        Engine.forward = forward
    return worker_main.main(argv)


# --- part 3: benchmark ------------------------------------------------------------------------

def cmd_rank(args) -> int:
    """One benchmark rank: eager decode steps, then the step's collectives alone."""
    import torch
    import torch.distributed as dist

    from lorad.config import ModelConfig
    from lorad.workers.batch import MIN_ROWS, ForwardBatch
    from lorad.workers.models.llama import LlamaForCausalLM
    from lorad.workers.parallel import init_tensor_parallel

    torch.set_num_threads(1 if args.device == "cpu" else 4)
    cuda = args.device == "cuda"
    device = torch.device("cuda", args.rank) if cuda else torch.device("cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    tp = init_tensor_parallel(args.rank, args.world, f"file://{args.init_file}", args.backend,
                              device, timeout_s=120)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = ModelConfig.from_dir(args.config)
    t0 = time.monotonic()
    model = LlamaForCausalLM(config, tp, dtype, device)
    model.load_random_weights(0)
    block, batches = 16, [int(b) for b in args.batches.split(",")]
    blocks_per_seq = -(-(args.context + args.warmup + args.steps + 1) // block)
    model.allocate_kv_cache(1 + max(batches) * blocks_per_seq, block)
    for layer in model.model.layers:
        layer.self_attn.kv_cache.k.normal_()
        layer.self_attn.kv_cache.v.normal_()
    sync()
    load_s = time.monotonic() - t0
    out = {"world": args.world, "rank": args.rank, "load_s": load_s, "rows": [],
           "layers": config.num_hidden_layers}
    graphs = None
    if cuda and not args.eager_only:
        from lorad.workers.cuda_graph import DecodeGraphs
        # NCCL collectives inside the graphs; gloo's between graph segments (as the engine does).
        graphs = DecodeGraphs(model, max(batches), blocks_per_seq * block, block, 0,
                              segmented=args.world > 1 and args.backend == "gloo")
        graphs.capture()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in batches:
            tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
                      for i in range(batch)]
            step_s = []
            for step in range(args.warmup + args.steps):
                pos = args.context + step
                ids = torch.randint(3, min(1000, config.vocab_size), (batch,),
                                    generator=gen).tolist()
                chunks = [([ids[i]], pos, tables[i][:pos // block + 1], True, 0)
                          for i in range(batch)]
                if tp.world_size > 1:
                    dist.barrier(group=tp.cpu_group)  # start every step together
                start = time.perf_counter()
                logits = model.forward(ForwardBatch.build(chunks, block, device,
                                                          min_rows=MIN_ROWS))
                logits.argmax(-1).tolist()  # the leader's host sync each step
                step_s.append(time.perf_counter() - start)
            step = statistics.median(step_s[args.warmup:])
            graph_step = None
            if graphs is not None:
                graph_s = []
                for step_i in range(args.warmup + args.steps):
                    pos = args.context + step_i
                    chunks = [([5], pos, tables[i][:pos // block + 1], True, 0)
                              for i in range(batch)]
                    if tp.world_size > 1:
                        dist.barrier(group=tp.cpu_group)
                    start = time.perf_counter()
                    graphs.run(chunks).argmax(-1).tolist()
                    graph_s.append(time.perf_counter() - start)
                graph_step = statistics.median(graph_s[args.warmup:])
            # The step's collectives alone: 2 all-reduces per layer + the embedding's one of
            # [rows, hidden] in the model dtype, and the logits' all-gather of [batch, vocab/N].
            rows = max(batch, MIN_ROWS)
            comm = {}
            if tp.world_size > 1:
                for name, dt in (("ar_model_dtype", dtype), ("ar_fp32", torch.float32)):
                    xs = [torch.randn(rows, hidden, device=device).to(dt)
                          for _ in range(2 * layers + 1)]
                    shard = -(-config.vocab_size // tp.world_size)
                    logit_part = torch.randn(batch, shard, device=device)
                    sizes = [shard] * tp.world_size

                    def collectives():
                        for x in xs:
                            tp.all_reduce(x)
                        if name == "ar_model_dtype":
                            tp.all_gather_last_dim(logit_part, sizes)
                    for _ in range(args.warmup):
                        collectives()
                    sync()
                    times = []
                    for _ in range(args.steps):
                        dist.barrier(group=tp.cpu_group)
                        start = time.perf_counter()
                        collectives()
                        sync()
                        times.append(time.perf_counter() - start)
                    comm[name] = statistics.median(times)
                if graphs is not None and args.backend == "nccl":
                    comm["graph_collectives"] = time_collectives_graph(
                        tp, rows, hidden, layers, dtype, batch, config.vocab_size, args)
            out["rows"].append({"batch": batch, "step_s": step, "min_step_s": min(step_s),
                                "graph_step_s": graph_step, **comm})
    Path(args.out).write_text(json.dumps(out))
    print(f"rank {args.rank}/{args.world} done: {json.dumps(out)}", flush=True)
    if tp.world_size > 1:
        dist.barrier(group=tp.cpu_group)
    # No destroy_process_group: its teardown can abort a rank after the results are written
    # (seen with gloo); the process ends here without running finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def time_collectives_graph(tp, rows: int, hidden: int, layers: int, dtype, batch: int,
                           vocab_size: int, args) -> float:
    """The step's collectives as the decode graph holds them (2 fp32 all-reduces per layer, the
    embedding's in the model dtype, the logits' all-gather), captured alone in a CUDA graph:
    median seconds per replay."""
    import torch
    import torch.distributed as dist

    device = tp.device
    xs = [torch.randn(rows, hidden, device=device) for _ in range(2 * layers)]
    xs.append(torch.randn(rows, hidden, device=device).to(dtype))
    shard = -(-vocab_size // tp.world_size)
    logit_part = torch.randn(batch, shard, device=device)

    def collectives():
        for x in xs:
            tp.all_reduce(x)
        tp.all_gather_last_dim(logit_part, [shard] * tp.world_size)

    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            collectives()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        collectives()
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier(group=tp.cpu_group)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup:])


def cmd_bench(args) -> int:
    root = Path(args.work)
    rows = {}
    worlds = [int(w) for w in args.worlds.split(",")]
    if max(worlds) > 1 and args.device == "cuda" and args.backend == "nccl":
        import torch
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    for world in worlds:
        procs = []
        env = {**os.environ, "OMP_NUM_THREADS": "4"}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        for rank in range(world):
            cmd = [sys.executable, __file__, "rank", "--rank", str(rank), "--world", str(world),
                   "--init-file", str(root / f"store{world}"), "--out",
                   str(root / f"bench{world}.rank{rank}.json"), "--config", args.config,
                   "--device", args.device, "--backend", args.backend, "--dtype", args.dtype,
                   "--batches", args.batches, "--context", str(args.context),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)] + (
                       ["--eager-only"] if args.eager_only else [])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        ok = True
        for rank, proc in enumerate(procs):
            try:
                output, _ = proc.communicate(timeout=args.world_timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                output, _ = proc.communicate()
                output += "\n(timed out)"
            print(f"--- bench world {world} rank {rank} (exit {proc.returncode}):\n"
                  + "\n".join(output.splitlines()[-15:]), flush=True)
            ok &= proc.returncode == 0 or (root / f"bench{world}.rank{rank}.json").exists()
        if check(f"bench: world {world} ranks ran", ok):
            rows[world] = json.loads((root / f"bench{world}.rank0.json").read_text())
    if not rows:
        return finish()
    print(f"\n8B-shape decode, {args.dtype}, random weights, context {args.context}, "
          f"median of {args.steps} steps (rank 0, host-synced step incl. batch build + argmax); "
          f"collectives alone: {2 * rows[max(rows)]['layers'] + 1} all-reduces of "
          "[max(batch, 8), hidden] + the logits "
          "all-gather, timed in a loop on the same ranks.\n")
    table = ["| world | batch | eager step ms | graph step ms | graph tok/s | collectives "
             "alone ms (eager) | all-reduce share of eager step | collectives in a graph ms | "
             "their share of the graph step | scaling efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["batch"]: r for r in rows.get(1, {"rows": []})["rows"]}
    for world, data in sorted(rows.items()):
        for r in data["rows"]:
            comm = r.get("ar_model_dtype")
            share = f"{100 * comm / r['step_s']:.0f}%" if comm else "-"
            graph = r.get("graph_step_s")
            best = graph or r["step_s"]
            one = base.get(r["batch"])
            one_best = one and (one.get("graph_step_s") or one["step_s"])
            # Speed-up over world 1 divided by the world size (1.0 = linear scaling).
            eff = f"{one_best / best / world:.2f}" if one_best and world > 1 else "-"
            in_graph = r.get("graph_collectives")
            graph_share = f"{100 * in_graph / graph:.0f}%" if in_graph and graph else "-"
            table.append(f"| {world} | {r['batch']} | {1e3 * r['step_s']:.2f} | "
                         f"{f'{1e3 * graph:.2f}' if graph else '-'} | "
                         f"{r['batch'] / best:.0f} | "
                         f"{f'{1e3 * comm:.2f}' if comm else '-'} | {share} | "
                         f"{f'{1e3 * in_graph:.2f}' if in_graph else '-'} | {graph_share} | "
                         f"{eff} |")
    text = "\n".join(table)
    print(text)
    if args.table_out:
        Path(args.table_out).write_text(text + "\n")
    return finish()


# --- command line -----------------------------------------------------------------------------

def main() -> int:
    if sys.argv[1:2] == ["raising-worker"]:
        return cmd_raising_worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
        sp.add_argument("--backend", default="nccl", choices=("gloo", "nccl"))
        sp.add_argument("--work", default=None, help="scratch folder (default: a new temp one)")
        return sp

    lp = common(sub.add_parser("logits"))
    lp.add_argument("--fp32-tol", type=float, default=1e-5)
    lp.add_argument("--bf16-tol", type=float, default=5e-2)
    lp.add_argument("--rank-timeout", type=float, default=150)
    lp.add_argument("--worlds", default="1,2,4",
                    help="world sizes (NCCL: those above the GPU count are skipped; 1 first)")
    for name in ("serve", "faults"):
        sp = common(sub.add_parser(name))
        sp.add_argument("--dtype", default="bfloat16")
        sp.add_argument("--startup-timeout", type=float, default=90)
        sp.add_argument("--streams", type=int, default=6)
        sp.add_argument("--stream-tokens", type=int, default=1500)
        sp.add_argument("--kill-ranks", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 0])
        sp.add_argument("--parallel", type=int, default=2, help="ranks of the daemon")
    bp = common(sub.add_parser("bench"))
    bp.add_argument("--worlds", default="1,2,4",
                    help="world sizes to run (NCCL: those above the GPU count are skipped)")
    rp = sub.add_parser("rank")
    for sp in (bp, rp):
        sp.add_argument("--eager-only", action="store_true", help="no CUDA graphs")
        sp.add_argument("--config", default=str(REPO / "scripts/configs/llama3-8b"))
        sp.add_argument("--dtype", default="bfloat16")
        sp.add_argument("--batches", default="1,32")
        sp.add_argument("--context", type=int, default=512)
        sp.add_argument("--steps", type=int, default=30)
        sp.add_argument("--warmup", type=int, default=5)
    bp.add_argument("--world-timeout", type=float, default=150)
    bp.add_argument("--table-out")
    rp.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    rp.add_argument("--backend", default="nccl", choices=("gloo", "nccl"))
    for name in ("rank", "world", "init-file", "out"):
        rp.add_argument(f"--{name}", required=True, type=int if name in ("rank", "world") else str)
    args = p.parse_args()
    if args.cmd == "rank":
        return cmd_rank(args)
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix=f"mgpu-{args.cmd}-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    print(f"{args.cmd}: device {args.device}, backend {args.backend}, work {args.work}",
          flush=True)
    return {"logits": cmd_logits, "serve": cmd_serve, "faults": cmd_faults,
            "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
