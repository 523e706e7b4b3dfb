#!/usr/bin/env bash
# One GPU session on a lent H200, in one device call: the gpu-marked tests, the kernel
# micro-benchmarks, then the engine benchmark; the short tables are printed last.
#
# Run from the repository root through the device tool, with the pyzmq wheel carried:
#   cp /work/shared/wheels-gpu/*.whl .whl/      (here, once; .whl/ is git-ignored)
#   run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Installs only the carried wheel (into /tmp/site); everything else is the image's (torch,
# triton, transformers, peft...), and lorad is used from the checkout through PYTHONPATH.
# Logs go to $OUT (gpu-tests.log, bench-lora.log, bench-attention.log, bench-sampler.log,
# sampler-profile.log, bench-gemv.log, bench-gemv-lora.log, bench-norm-shrink.log, profile.log,
# graph-profile.log and traces/, ncu.log and ncu/, bench.log, bench.md).
# Time limits: tests 320 s and the sampler's unit tests 60 s, the LoRA kernels 120 s, attention
# and the sampler 60 s each, the sampler's profile 45 s (LORAD_SESSION_MICRO=0 skips these
# four), the GEMV sweep 75 s (LORAD_SESSION_GEMV=0 skips it), the decode profile 90 s
# (LORAD_SESSION_PROFILE=0 skips it), the graph replays' timeline 150 s (off unless
# LORAD_SESSION_GRAPH_PROFILE=1), the kernels' hardware counters 120 s (off unless
# LORAD_SESSION_NCU=1), the engine 210 s (LORAD_SESSION_ENGINE=0 skips it; so does
# LORAD_SESSION_TESTS=0 the tests). LORAD_SESSION_QUICK=1 makes the engine
# benchmark shorter (--quick); LORAD_SESSION_ENGINE_ARGS, LORAD_SESSION_LORA_ARGS and
# LORAD_SESSION_ATTENTION_ARGS pass more options to the engine, LoRA and attention benchmarks.
# Everything on is more than 10 minutes: switch parts off to fit.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/lorad-gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Ranks on one host talk over loopback (the machine has no other network worth resolving).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
started=$SECONDS

say() { printf '\n=== %s (%ds) ===\n' "$*" "$((SECONDS - started))"; }

say "setup"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || echo "gpu_session: installing the carried wheels failed"
else
  echo "gpu_session: no .whl/*.whl carried: pyzmq is missing, worker-process tests will fail"
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem \
  --format=csv 2>&1 | tee "$OUT/env.txt"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib.metadata as md, platform, torch
names = ("torch", "triton", "transformers", "peft", "pyzmq", "msgpack", "aiohttp", "safetensors")
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} MISSING")
print(f"python {platform.python_version()}; " + ", ".join(found))
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}, "
      f"torch cuda {torch.version.cuda}")
EOF

tests_status=skipped
if [[ ${LORAD_SESSION_TESTS:-1} == 1 ]]; then  # LORAD_SESSION_TESTS=0 skips the tests
  say "gpu tests"
  # LORAD_SESSION_TEST_ARGS: the tests to run (default tests/gpu), e.g. one file or -k EXPR.
  read -ra test_args <<<"${LORAD_SESSION_TEST_ARGS:-tests/gpu}"
  timeout -k 10 320 python3 -m pytest -m gpu "${test_args[@]}" -q -p no:cacheprovider -o addopts="" \
    -rfE --durations=8 2>&1 | tee "$OUT/gpu-tests.log"
  tests_status=${PIPESTATUS[0]}
  # CPU tests that depend on the torch version: the sampler's uniforms come from torch's CPU
  # generator in blocks, which must give single draws' values on this image's torch too.
  timeout -k 10 60 python3 -m pytest tests/unit/test_sampler.py -q -p no:cacheprovider \
    -o addopts="" -rfE 2>&1 | tee -a "$OUT/gpu-tests.log"
  unit_status=${PIPESTATUS[0]}
  (( tests_status == 0 )) && tests_status=$unit_status
fi

run_bench() {  # log name, timeout s, script[, its arguments]: a micro-benchmark or profile
  local log=$1 limit=$2
  shift 2
  [[ -f scripts/$1 ]] || return 0
  say "$*"
  timeout -k 5 "$limit" python3 "scripts/$1" "${@:2}" 2>&1 | tee "$OUT/$log"
}
if [[ ${LORAD_SESSION_MICRO:-1} == 1 ]]; then  # LORAD_SESSION_MICRO=0 skips these four
  # Options split on spaces, e.g. LORAD_SESSION_LORA_ARGS="--sweep --sweep-kernels expand",
  # LORAD_SESSION_ATTENTION_ARGS="--table-tokens 8192 --split-programs=0,16".
  read -ra lora_args <<<"${LORAD_SESSION_LORA_ARGS:-}"
  read -ra attention_args <<<"${LORAD_SESSION_ATTENTION_ARGS:-}"
  run_bench bench-lora.log 120 bench_lora_kernels.py "${lora_args[@]}"
  run_bench bench-attention.log 60 bench_paged_attention.py "${attention_args[@]}"
  run_bench bench-sampler.log 60 bench_sampler.py --device cuda
  # Where a lone top-k row's time goes (host and device per op).
  run_bench sampler-profile.log 45 bench_sampler.py --device cuda --batches 1 --repeats 3 \
    --profile "top-k 50"
fi
# The decode GEMV's tile sweep against cuBLAS (LORAD_SESSION_GEMV=0 skips it).
[[ ${LORAD_SESSION_GEMV:-1} == 1 ]] && run_bench bench-gemv.log 75 bench_decode_gemv.py
[[ ${LORAD_SESSION_PROFILE:-1} == 1 ]] && run_bench profile.log 90 profile_decode.py
# Graph replays on a timeline (LORAD_SESSION_GRAPH_PROFILE=1 runs it; LORAD_SESSION_GRAPH_ARGS
# passes options, e.g. "--cases base:1,one:32"); each case's kernels land in $OUT/traces.
if [[ ${LORAD_SESSION_GRAPH_PROFILE:-0} == 1 ]]; then
  read -ra graph_args <<<"${LORAD_SESSION_GRAPH_ARGS:-}"
  run_bench graph-profile.log 150 profile_graph.py --trace-out "$OUT/traces" "${graph_args[@]}"
fi
# Nsight Compute's counters of the decode kernels (LORAD_SESSION_NCU=1 runs it; 60 s on an H200
# for its four cases); ncu's CSV of each case lands in $OUT/ncu.
if [[ ${LORAD_SESSION_NCU:-0} == 1 ]]; then
  run_bench ncu.log 120 ncu_decode_kernels.py --csv-out "$OUT/ncu"
fi

bench_status=skipped
if [[ ${LORAD_SESSION_ENGINE:-1} == 1 ]]; then  # LORAD_SESSION_ENGINE=0 skips it
  say "engine benchmark"
  quick=()
  [[ ${LORAD_SESSION_QUICK:-0} == 1 ]] && quick=(--quick)
  read -ra extra <<<"${LORAD_SESSION_ENGINE_ARGS:-}"
  timeout -k 10 210 python3 scripts/bench_engine.py "${quick[@]}" "${extra[@]}" \
    --table-out "$OUT/bench.md" \
    2>&1 | tee "$OUT/bench.log"
  bench_status=${PIPESTATUS[0]}
fi

say "summary"
echo "--- gpu tests (exit $tests_status; 124 = timed out): $OUT/gpu-tests.log"
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)\b" "$OUT/gpu-tests.log" | tail -n 25
for log in "$OUT/bench-lora.log" "$OUT/bench-attention.log" "$OUT/bench-sampler.log" \
    "$OUT/sampler-profile.log" "$OUT/bench-gemv.log" \
    "$OUT/bench-gemv-lora.log" "$OUT/bench-norm-shrink.log" "$OUT/profile.log" \
    "$OUT/graph-profile.log"; do
  [[ -f $log ]] && { echo "--- $(basename "$log")"; grep -vE "^\s*$" "$log" | tail -n 30; }
done
echo "--- engine benchmark (exit $bench_status; 124 = timed out)"
if [[ -s $OUT/bench.md ]]; then
  cat "$OUT/bench.md"
elif [[ -f $OUT/bench.log ]]; then
  tail -n 40 "$OUT/bench.log"
fi
echo "--- whole session: $((SECONDS - started)) s"
