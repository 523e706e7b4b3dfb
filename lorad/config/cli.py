"""The `lorad` command line: flags grouped as a serving tool's help, parsed into a ServeConfig.

A bad value is refused here, as one line naming the flag (exit 2), before anything loads.
Checks that need the model folder (tokenizer present, --max-model-len within the model's limit,
adapter folders against the base config) happen in the coordinator right after, still before any
worker starts. `lorad check-adapter` has its own parser (lorad/config/check_adapter.py).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from lorad.config.adapter_capacity import LORA_DTYPES
from lorad.config.adapters import AdapterArg
from lorad.config.cluster import DEFAULT_MASTER_PORT, ClusterConfig
from lorad.config.errors import ConfigError
from lorad.config.kernel_cache import check_writable, resolve_kernel_cache_dir
from lorad.config.serve import (ALL_REDUCES, DEVICES, DIST_BACKENDS, DTYPES, LOAD_FORMATS,
                                 ServeConfig)

_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2,
               "mb": 1000**2, "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4,
               "tib": 1024**4, "tb": 1000**4}


class OneLineParser(argparse.ArgumentParser):
    """argparse with its error as a single line: `lorad: error: argument --port: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, 0 or more, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer, 0 or more, got {text!r}")
    return value


def _or_auto(parse, expected: str):
    """A type for argparse: "auto", or what `parse` accepts (its refusal names `expected`)."""
    def parse_or_auto(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {expected} or auto, got {text!r}"
                                             ) from None
    return parse_or_auto


positive_int_or_auto = _or_auto(positive_int, "a positive integer")
non_negative_int_or_auto = _or_auto(non_negative_int, "an integer, 0 or more,")


def port_number(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port between 1 and 65535, got {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1073741824': binary units (K, M, G, KiB...) are powers of 1024,
    KB/MB/GB are powers of 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512MiB or 2GiB, got {text!r}")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above zero, got {text!r}")
    return value


DEFAULT_SPILL_BYTES = 8 << 30


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="lorad",
        description="Serve one language model over an OpenAI-compatible HTTP API,\n"
                    "tensor-parallel over N worker processes.",
        epilog="example:\n"
               "  lorad --model /srv/models/SmolLM2-135M-Instruct --parallel 2 --port 8000 \\\n"
               "        --adapter sql=/srv/adapters/sql --adapter-strength sql=0.5\n\n"
               "check adapters offline:\n  lorad check-adapter DIR... [--model DIR] "
               "[--parallel N]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(parser.add_argument_group("model"))
    _add_adapter_flags(parser.add_argument_group("LoRA adapters"))
    _add_parallel_flags(parser.add_argument_group("parallelism and devices"))
    _add_scheduler_flags(parser.add_argument_group("scheduler and KV cache"))
    _add_cluster_flags(parser.add_argument_group("several hosts"))
    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to listen on; anything but loopback exposes the API: give "
                           "it an --api-key-file (default: %(default)s)")
    http.add_argument("--port", type=port_number, default=8000,
                      help="TCP port to listen on (default: %(default)s)")
    auth = http.add_mutually_exclusive_group()
    auth.add_argument("--api-key-file", metavar="FILE",
                      help="every route but /health and /ready then needs 'Authorization: "
                           "Bearer KEY', KEY being the file's first line")
    auth.add_argument("--api-key", metavar="KEY",
                      help="the same with the key on the command line (other local users can "
                           "see it in the process list; prefer --api-key-file)")
    _add_limit_flags(parser.add_argument_group("limits"))
    proc = parser.add_argument_group("process")
    proc.add_argument("--runtime-dir", metavar="DIR",
                      help="parent of the private per-instance socket folder "
                           "(default: $XDG_RUNTIME_DIR or the system temp folder)")
    proc.add_argument("--kernel-cache-dir", metavar="DIR",
                      help="where the workers cache compiled Triton kernels, so a restart does "
                           "not compile them again (default: $TRITON_CACHE_DIR if set, else "
                           "$CACHE_DIRECTORY/triton under systemd, else ~/.triton/cache)")
    proc.add_argument("--startup-timeout", type=seconds, default=600.0, metavar="SECONDS",
                      help="how long workers may take to load and report ready "
                           "(default: %(default)g)")
    proc.add_argument("--shutdown-timeout", type=seconds_or_zero, default=30.0,
                      metavar="SECONDS",
                      help="on SIGTERM or SIGINT, how long open requests may run on while new "
                           "ones get a 503; the rest then end with an error (default: "
                           "%(default)g)")
    proc.add_argument("--step-timeout", type=seconds, default=30.0, metavar="SECONDS",
                      help="a worker whose step (or collective) runs longer has stalled: open "
                           "requests fail and lorad exits non-zero, for its supervisor to "
                           "restart it (default: %(default)g)")
    proc.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                      default="info", help="log verbosity of the coordinator and the workers "
                                           "(default: %(default)s)")
    return parser


def _add_limit_flags(group) -> None:
    group.add_argument("--max-queued-requests", type=positive_int_or_auto, default="auto",
                       metavar="N",
                       help="most admitted requests still waiting for their first token; more "
                            "get a 429; auto: 4 x --max-num-seqs, at least 256 "
                            "(default: %(default)s)")
    group.add_argument("--request-timeout", type=seconds, metavar="SECONDS",
                       help="deadline of each generation request, from its arrival; a request "
                            "past it is cancelled and ends with an error (default: none)")


def _add_model_flags(group) -> None:
    group.add_argument("--model", required=True, metavar="DIR",
                       help="Hugging Face model folder (config.json, *.safetensors, "
                            "tokenizer.json)")
    group.add_argument("--name", metavar="NAME",
                       help="model id served at /v1/models and expected in requests "
                            "(default: the model folder's name)")
    group.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="dtype of weights and activations; auto lets the workers pick for "
                            "the device (default: %(default)s)")
    group.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                       help="where weights come from: the folder's safetensors (auto), or "
                            "random values of the right shapes from a fixed seed, reading only "
                            "config.json (for benchmarks) (default: %(default)s)")
    group.add_argument("--max-model-len", type=positive_int, metavar="N",
                       help="longest context (prompt + completion) in tokens "
                            "(default: the model's max_position_embeddings)")


def adapter_pair(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, folder


def strength_pair(text: str) -> tuple[str, float]:
    name, sep, number = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"the strength must be a finite number, got {text!r}")
    return name, value


def _add_adapter_flags(group) -> None:
    group.add_argument("--adapter", type=adapter_pair, action="append", default=[],
                       metavar="NAME=DIR",
                       help="serve the PEFT LoRA folder DIR as model id NAME (repeatable; "
                            "registry ids 1..K follow the order given)")
    group.add_argument("--adapter-strength", type=strength_pair, action="append", default=[],
                       metavar="NAME=NUMBER",
                       help="multiply adapter NAME's scales by NUMBER (default: 1.0)")
    group.add_argument("--pin-adapter", action="append", default=[], metavar="NAME",
                       help="keep adapter NAME in its device slot, never evicted (repeatable)")
    group.add_argument("--adapter-dir", metavar="DIR",
                       help="serve every valid PEFT folder DIR/NAME as model id NAME, loaded "
                            "(and validated) on its first request")
    group.add_argument("--admin-key-file", metavar="FILE",
                       help="allow loading, reloading and unloading adapters while serving "
                            "(POST /v1/adapters, DELETE /v1/adapters/NAME) with the key in FILE "
                            "as 'Authorization: Bearer KEY'; off without it")
    group.add_argument("--max-gpu-adapters", type=non_negative_int, metavar="N",
                       help="device slots for adapters; more registered adapters take turns, "
                            "least recently used first (default: the --adapter count, or at "
                            "least 8 with --adapter-dir or --admin-key-file)")
    group.add_argument("--max-cpu-adapters", type=non_negative_int_or_auto, default="auto",
                       metavar="N", help="adapters whose factors each worker keeps in host "
                       "memory beyond the device slots; auto: as many as fill a quarter of the "
                       "host memory available at the start, shared by this host's workers "
                       "(default: %(default)s)")
    group.add_argument("--max-lora-rank", type=positive_int, metavar="N",
                       help="the largest rank the slot tables hold for adapters loaded while "
                            "serving (default: 16, or the largest --adapter rank)")
    group.add_argument("--lora-dtype", choices=("auto", *LORA_DTYPES), default="auto",
                       help="the dtype of the adapter slot tables; auto: float32 with adapters "
                            "loaded while serving, else the dtype the --adapters store (float32 "
                            "where they differ); bfloat16 or float16 halve the tables and refuse "
                            "an adapter stored otherwise (default: %(default)s)")


def _adapter_args(pairs: list[tuple[str, str]],
                  strengths: list[tuple[str, float]]) -> tuple[AdapterArg, ...]:
    names = [name for name, _ in pairs]
    by_name: dict[str, float] = {}
    for name, value in strengths:
        if name not in names:
            raise ConfigError(f"--adapter-strength {name}: no --adapter is named {name!r}")
        if name in by_name:
            raise ConfigError(f"--adapter-strength {name}: given twice")
        by_name[name] = value
    return tuple(AdapterArg(name, folder, by_name.get(name, 1.0)) for name, folder in pairs)


def _add_parallel_flags(group) -> None:
    group.add_argument("--parallel", type=positive_int, default=1, metavar="N",
                       help="tensor-parallel worker processes, one per GPU (default: %(default)s)")
    group.add_argument("--device", choices=DEVICES, default="auto",
                       help="where workers run; auto: cuda if available, else cpu "
                            "(default: %(default)s)")
    group.add_argument("--dist-backend", choices=DIST_BACKENDS, default="auto",
                       help="collectives between workers; auto: nccl on cuda, gloo on cpu "
                            "(default: %(default)s)")
    group.add_argument("--all-reduce", choices=ALL_REDUCES, default="nccl",
                       help="the model's all-reduce: nccl (the process group's: gloo on cpu), "
                            "or oneshot (peer GPU memory, rank-ordered, for decode-size "
                            "tensors; NCCL for the rest); auto: oneshot on cuda at --parallel 2+ "
                            "on one host. oneshot has not yet run on GPUs (docs/multi-gpu.md) "
                            "(default: %(default)s)")
    group.add_argument("--threads", type=positive_int_or_auto, default="auto", metavar="N|auto",
                       help="torch threads per worker; a row's bits are the same at any "
                            "count. auto: on the CPU, the CPUs this process may use, shared by "
                            "this host's workers; 1 on a GPU (default: auto)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: no CUDA graphs for decode steps "
                            "(graphs are used on CUDA otherwise, at any --parallel)")
    group.add_argument("--mixed-step-graphs", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="on CUDA, capture steps with prompt chunks too (prefill, mixed, "
                            "drafted), in pieces between the layers' attention, which runs "
                            "eagerly: the host no longer queues every kernel of such a step; "
                            "not over gloo (default: on)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="at --parallel 1, plan and launch each decode step before the "
                            "host applies and publishes the one before, so the device does "
                            "not wait for that work; the same tokens either way (a sequence "
                            "that ends on a stop token runs one row in vain); not with "
                            "--speculative-ngram. Default: on CUDA, off on the CPU, where the "
                            "step is the host's own work")
    group.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                       help="a stream's tokens do not depend on what shares its steps (the "
                            "default); --no-deterministic: on a GPU, cuBLAS at every row count, "
                            "where it may split K (no matmul plans at start)")


def _add_scheduler_flags(group) -> None:
    group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                       help="compute every prompt from its first token: no reuse of cached KV "
                            "blocks of earlier prompts with the same prefix and adapter")
    group.add_argument("--max-num-seqs", type=positive_int_or_auto, default="auto", metavar="N",
                       help="most sequences running in one step; auto: as many as the KV pool "
                            "holds at 2,048 tokens each, 64 to 256 on a GPU, 64 on the CPU, at "
                            "most --max-num-batched-tokens (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=512, metavar="N",
                       help="most tokens in one step; longer prompts are prefilled in chunks "
                            "(default: %(default)s)")
    group.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                       help="draft up to K tokens per decode by prompt lookup (the sequence's "
                            "own earlier n-grams) and verify them in one step; a request's "
                            '"draft": false opts out (default: 0, off)')
    group.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                       help="tokens per KV cache block (default: %(default)s)")
    kv = group.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=positive_int, metavar="N",
                    help="KV cache blocks per worker")
    kv.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                    help="KV cache memory per worker, e.g. 512MiB or 2GiB "
                         "(default: the workers size the cache themselves)")
    group.add_argument("--kv-spill-dir", metavar="DIR",
                       help="write prefix-cache blocks evicted from the KV pool to this folder "
                            "(one subfolder per rank) and read them back for later prompts, also "
                            "after a restart (default: no spill)")
    group.add_argument("--kv-spill-bytes", type=byte_size, default=DEFAULT_SPILL_BYTES,
                       metavar="SIZE", help="most bytes each rank spills (default: 8GiB)")


def _add_cluster_flags(group) -> None:
    group.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                       help="hosts the --parallel ranks are split over, evenly; the coordinator "
                            "runs on node 0, every other host runs `lorad node` (default: "
                            "%(default)s: one host, nothing listens off loopback)")
    group.add_argument("--node-rank", type=int, metavar="R",
                       help="this host's place, 0..N-1: node R runs ranks R*P/N .. (R+1)*P/N-1")
    group.add_argument("--master-addr", metavar="IP",
                       help="node 0's IP address: its coordinator and torch.distributed store "
                            "listen there only")
    group.add_argument("--master-port", type=port_number, metavar="PORT",
                       help=f"the store's port; the coordinator's two sockets take the next two "
                            f"(default with --nnodes: {DEFAULT_MASTER_PORT})")
    group.add_argument("--node-addr", metavar="IP",
                       help="this host's IP address, where its ranks' gloo collectives listen "
                            "(default: --master-addr on node 0; elsewhere GLOO_SOCKET_IFNAME's "
                            "interface, or the host name's address)")
    group.add_argument("--cluster-key-dir", metavar="DIR",
                       help="this host's CURVE keys (`lorad keys DIR`): the control plane "
                            "between hosts is authenticated and encrypted")


def cluster_config(args, node: bool) -> ClusterConfig:
    """The several-hosts flags checked for the command: `lorad` is node 0, `lorad node` any
    other node."""
    multi = args.nnodes > 1
    port = args.master_port if args.master_port or not multi else DEFAULT_MASTER_PORT
    rank = args.node_rank if args.node_rank is not None else (None if node else 0)
    if node and (not multi or rank is None or rank == 0):
        raise ConfigError(f"lorad node needs --nnodes 2 or more and --node-rank 1.. (node 0 "
                          f"runs the coordinator, `lorad`), got --node-rank {rank}")
    if not node and rank:
        raise ConfigError(f"--node-rank {rank}: the coordinator (`lorad`) runs on node 0; run "
                          f"`lorad node --node-rank {rank} ...` on that host")
    key_dir = args.cluster_key_dir
    if key_dir is not None:
        key_dir = str(Path(key_dir).expanduser().absolute())
    return ClusterConfig(args.nnodes, rank or 0, args.master_addr, port, key_dir, args.node_addr)


def _spill_dir(args) -> str | None:
    """--kv-spill-dir made absolute, created and checked writable; None without it."""
    if args.kv_spill_dir is None:
        return None
    if not args.prefix_cache:
        raise ConfigError("--kv-spill-dir holds prefix-cache blocks: it needs the prefix cache "
                          "(drop --no-prefix-cache)")
    if not args.kv_spill_dir.strip():
        raise ConfigError(f"--kv-spill-dir must name a folder, got {args.kv_spill_dir!r}")
    path = Path(args.kv_spill_dir).expanduser().absolute()
    check_writable(path, f"--kv-spill-dir {args.kv_spill_dir}")
    return str(path)


def parse_args(argv: list[str] | None = None, node: bool = False) -> ServeConfig:
    """Parse flags into a ServeConfig; on a bad value print one line and exit 2. node: for
    `lorad node` (the same flags; the HTTP ones go unused)."""
    parser = build_parser()
    if node:
        parser.prog = "lorad node"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    name = args.name if args.name is not None else Path(args.model).resolve().name
    try:
        adapters = _adapter_args(args.adapter, args.adapter_strength)
        api_key = _read_api_key(args.api_key_file) if args.api_key_file else args.api_key
        admin_key = (_read_api_key(args.admin_key_file, "--admin-key-file")
                     if args.admin_key_file else None)
        return ServeConfig(
            model_dir=args.model, served_name=name, parallel=args.parallel, host=args.host,
            cluster=cluster_config(args, node),
            port=args.port, dtype=args.dtype, load_format=args.load_format, device=args.device,
            dist_backend=args.dist_backend, all_reduce=args.all_reduce,
            enforce_eager=args.enforce_eager, mixed_step_graphs=args.mixed_step_graphs,
            async_scheduling=args.async_scheduling,
            deterministic=args.deterministic,
            speculative_ngram=args.speculative_ngram,
            prefix_cache=args.prefix_cache, kv_spill_dir=_spill_dir(args),
            kv_spill_bytes=args.kv_spill_bytes, max_model_len=args.max_model_len,
            max_num_seqs=_none_if_auto(args.max_num_seqs),
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            kv_cache_blocks=args.kv_cache_blocks, kv_cache_memory=args.kv_cache_memory,
            num_threads=_none_if_auto(args.threads), runtime_dir=args.runtime_dir,
            startup_timeout=args.startup_timeout, shutdown_timeout=args.shutdown_timeout,
            request_timeout=args.request_timeout, step_timeout=args.step_timeout,
            max_queued_requests=_none_if_auto(args.max_queued_requests), log_level=args.log_level,
            adapters=adapters, api_key=api_key,
            kernel_cache_dir=resolve_kernel_cache_dir(args.kernel_cache_dir, os.environ),
            admin_key=admin_key, adapter_dir=_adapter_dir(args.adapter_dir),
            max_gpu_adapters=args.max_gpu_adapters,
            max_cpu_adapters=_none_if_auto(args.max_cpu_adapters),
            max_lora_rank=args.max_lora_rank, pinned_adapters=tuple(args.pin_adapter),
            lora_dtype=_none_if_auto(args.lora_dtype))
    except ConfigError as exc:
        parser.error(str(exc))


def _none_if_auto(value: int | str) -> int | None:
    return None if value == "auto" else value


def _read_api_key(path: str, flag: str = "--api-key-file") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read it: {exc}") from None


def _adapter_dir(path: str | None) -> str | None:
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--adapter-dir {path}: not a folder")
    return str(folder.resolve())
