#!/usr/bin/env bash
# One GPU session in one call: the gpu-marked tests, then the benchmarks asked for; each part
# under its own time limit, its log in $OUT, a summary last.
#
# Usage, from the repository root (on a lent GPU through the device tool, with the pyzmq wheel
# carried when the image lacks pyzmq: cp /work/shared/wheels-gpu/*.whl .whl/ here, once):
#   bash benchmarks/gpu_session.sh [PART ...]          e.g. run(..., carry=[".whl"])
# PARTS (default: tests kernels engine; "multi" joins when two GPUs are visible):
#   tests     pytest -m gpu tests/gpu, and the sampler's CPU test that depends on torch's build;
#             tests-kernels, tests-model: its two halves (the kernels' tests, the rest)
#   kernels   bench_lora_kernels, bench_paged_attention, bench_sampler, bench_decode_gemv
#   engine    bench_engine (the decode step against its memory floor)
#   moe       bench_engine on the MoE shape (scripts/configs/qwen1.5-moe-a2.7b, random weights):
#             decode at batch 1, 32, 64, base and 4 adapters mixed, against the floor of the
#             experts touched and transformers + peft generate (issue 34's targets, last)
#   moe-pieces  probe_moe_decode (a MoE decode layer's pieces alone: tile tables, expert tiles,
#             each projection by GEMV tile against cuBLAS), profile_decode on the MoE shape
#   multi     bench_multi_gpu (world 1, 2, 4 over NCCL)
#   profile   profile_decode;  graph: profile_graph (traces in $OUT/traces);
#   prefill   profile_prefill (prefill steps' kernels by group, base and LoRA, with matmul plans;
#             eager and through the mixed-step graphs),
#             probe_matmul_rows (which row counts change a row's bits in cuBLAS and the GEMV)
#             and probe_row_matmul (row_matmul's tiles: bits against the GEMV, speed);
#   rowmm     probe_row_matmul alone;
#   copy      probe_adapter_copy: one 8B rank-16 adapter into an fp32 slot from the file's
#             shards, through the host cache from disk, and from a cached (page-locked) entry;
#   ncu       ncu_decode_kernels (CSVs in $OUT/ncu)
#   capacity  check_capacity: this GPU's step table (bench_engine --json-out), then 3 bursts of
#             bench.py (128 requests, 32 at once, 128 in / 128 out, base + 2 random rank-16
#             adapters, 8B shape, bf16) against capacity.py's prediction (issue 35: within 15%);
#             $OUT/capacity.tar.gz
#   http      issue 29 through HTTP, default flags, an empty Triton cache each (http_cold_start.sh):
#             256 streams of 16 in / 512 out on the base model, then on 64 distinct adapters
#             with PREFILL=1 (32 x 1,024 in, single prompts of 512 and 2,048 tokens); logs in
#             $OUT/http; mix: http_adapter_mix.sh 64 130 (every stream equals its solo run)
#   prefix    http_prefix.sh: the prefix cache over HTTP (8B shape, bf16): 64 conversations of 4
#             turns over a 2,000-token system prompt, cache on and off; decode with and without
#             --no-prefix-cache (issue 31's targets)
#   paging    bench_adapter_paging: a Zipf(1.0) burst over 1,000 adapters of rank 16 (64 distinct
#             files) in 64 device slots against the same burst all resident (8B shape, bf16);
#             the daemons log each copy's times (debug), in $OUT/paging.tar.gz
#   determinism bench_determinism: lorad --deterministic against --no-deterministic (8B shape,
#             bf16) at concurrency 1, 32, 64 and a prefill-heavy 32 x 1,024 in (issue 33's
#             target: <= 3%); logs and bench.py's JSON in $OUT/determinism.tar.gz
#   drafting  bench_drafting: --speculative-ngram 4 against "draft": false, editing and chat at
#             concurrency 1 and 8 (issue 33: >= 1.8x editing, one stream; chat <= 3%); log and
#             results.json in $OUT/drafting.tar.gz. No real checkpoint here: it runs on random
#             8B weights (bf16), so acceptance is a random model's loops, not editing (the model
#             through LORAD_BENCH_ARGS_bench_drafting, e.g. "--model DIR --load-format auto")
# Environment: OUT (default /tmp/lorad-gpu-session); LORAD_TEST_ARGS (default tests/gpu);
# LORAD_TEST_LIMIT (seconds, default 540); LORAD_PART_LIMIT (seconds): at most this for any
# benchmark (one call of the device tool is 600 s);
# LORAD_BENCH_ARGS_<module>, e.g. LORAD_BENCH_ARGS_bench_engine="--quick", options for one
# benchmark. Everything at once is more than 10 minutes: ask for parts.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/lorad-gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Ranks on one host talk over loopback (the machine has no other network worth resolving).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
started=$SECONDS
declare -A status

say() { printf '\n=== %s (%ds) ===\n' "$*" "$((SECONDS - started))"; }

say "setup"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || echo "gpu_session: installing the carried wheels failed"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
num_gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem \
  --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c 'from benchmarks.common import conditions; print(conditions("cuda"))' 2>&1 \
  | tee -a "$OUT/env.txt"

parts=("$@")
if (( ${#parts[@]} == 0 )); then
  parts=(tests kernels engine)
  (( num_gpus >= 2 )) && parts+=(multi)
fi

bench() {  # log name, time limit s, module[, its arguments]: one benchmark or profile
  local log=$1 limit=$2 module=$3
  shift 3
  (( limit > ${LORAD_PART_LIMIT:-limit} )) && limit=$LORAD_PART_LIMIT
  local var="LORAD_BENCH_ARGS_$module" extra=()
  read -ra extra <<<"${!var:-}"
  say "$module $* ${extra[*]}"
  timeout -k 5 "$limit" python3 -m "benchmarks.$module" "$@" "${extra[@]}" 2>&1 \
    | tee "$OUT/$log"
  status[$log]=${PIPESTATUS[0]}
}

for part in "${parts[@]}"; do
  case $part in
    tests|tests-kernels|tests-model)
      say "gpu tests ($part)"
      # The whole suite took more than 450 s on a fresh H100 (Triton compiling everything), so
      # it also runs as two parts of one call each: the kernels' tests, and the model's.
      kernel_tests="tests/gpu/test_decode_gemv_gpu.py tests/gpu/test_fused_ops_gpu.py
        tests/gpu/test_lora_kernels_gpu.py tests/gpu/test_moe_kernel_gpu.py
        tests/gpu/test_oneshot_reduce_gpu.py tests/gpu/test_paged_attention_gpu.py
        tests/gpu/test_sampler_gpu.py tests/gpu/test_token_draw_gpu.py
        tests/gpu/test_logits_processors_gpu.py tests/gpu/test_grammar_gpu.py"
      default_args=tests/gpu
      [[ $part == tests-kernels ]] && default_args=$kernel_tests
      if [[ $part == tests-model ]]; then
        default_args="tests/gpu"
        for file in $kernel_tests; do default_args+=" --ignore=$file"; done
      fi
      read -ra test_args <<<"${LORAD_TEST_ARGS:-$default_args}"
      # With pytest-xdist (carried as a wheel) six test files at once: on a fresh machine the
      # suite is mostly Triton compiling, which takes one CPU core per process.
      parallel=()
      python3 -c "import xdist" 2>/dev/null && parallel=(-n 6 --dist loadfile)
      # Each failure's report as it happens (tests/conftest.py): a run cut off keeps them.
      LORAD_TEST_FAILURES="$OUT/gpu-test-failures.txt" \
      timeout -k 10 "${LORAD_TEST_LIMIT:-540}" python3 -m pytest -m gpu "${test_args[@]}" -q \
        -p no:cacheprovider -o addopts="" "${parallel[@]}" -rfE --durations=8 2>&1 \
        | tee "$OUT/gpu-tests.log"
      status[gpu-tests.log]=${PIPESTATUS[0]}
      # The sampler's uniforms come from torch's CPU generator in blocks, which must give single
      # draws' values on this image's torch too.
      timeout -k 10 60 python3 -m pytest tests/unit/test_sampler.py -q -p no:cacheprovider \
        -o addopts="" -rfE 2>&1 | tee "$OUT/sampler-tests.log"
      status[sampler-tests.log]=${PIPESTATUS[0]} ;;
    kernels)
      bench bench-lora.log 120 bench_lora_kernels
      bench bench-attention.log 60 bench_paged_attention
      bench bench-sampler.log 60 bench_sampler --device cuda
      bench bench-gemv.log 75 bench_decode_gemv ;;
    engine) bench bench-engine.log 210 bench_engine --table-out "$OUT/bench-engine.md" ;;
    moe) bench bench-moe.log 500 bench_engine --config scripts/configs/qwen1.5-moe-a2.7b \
           --batches 1,32,64 --cases base,mixed4 --num-adapters 4 --eager-batches "" \
           --prefill "" --hf-batches 1,32 --table-out "$OUT/bench-moe.md" ;;
    moe-pieces)
      bench moe-probe.log 240 probe_moe_decode
      bench moe-profile.log 150 profile_decode --config scripts/configs/qwen1.5-moe-a2.7b \
        --top 25 ;;
    multi) bench bench-multi-gpu.log 240 bench_multi_gpu --table-out "$OUT/bench-multi-gpu.md" ;;
    profile) bench profile.log 90 profile_decode ;;
    prefill)
      bench prefill-profile.log 150 profile_prefill --deterministic --mixed-step-graphs
      bench matmul-rows.log 90 probe_matmul_rows
      bench row-matmul.log 180 probe_row_matmul ;;
    rowmm) bench row-matmul.log 180 probe_row_matmul ;;
    copy)
      for source in file disk cache; do
        bench "adapter-copy-$source.log" 100 probe_adapter_copy --source "$source"
      done ;;
    graph) bench graph-profile.log 150 profile_graph --trace-out "$OUT/traces" ;;
    ncu) bench ncu.log 120 ncu_decode_kernels --csv-out "$OUT/ncu" ;;
    paging) bench bench-paging.log 560 bench_adapter_paging --model scripts/configs/llama3-8b \
              --load-format random --lorad-flag=--dtype=bfloat16 --lorad-flag=--log-level=debug \
              --adapters 1000 --distinct 64 \
              --rank 16 --slots 64 --zipf 1.0 --requests 512 --concurrency 64 \
              --work "$OUT/paging" ;;
    determinism) bench bench-determinism.log 560 bench_determinism --work "$OUT/determinism" \
                   --table-out "$OUT/bench-determinism.md" ;;
    drafting)
      # The defaults come first: a --model in LORAD_BENCH_ARGS_bench_drafting comes later and wins.
      bench bench-drafting.log 560 bench_drafting --model scripts/configs/llama3-8b \
        --load-format random --dtype bfloat16 --work "$OUT/drafting" \
        --table-out "$OUT/bench-drafting.md" ;;
    capacity) bench bench-capacity.log 560 check_capacity --device cuda --concurrency 32 \
                --requests 128 --work "$OUT/capacity" --table-out "$OUT/bench-capacity.md" ;;
    http)
      for args in "0 256" "64 256"; do
        say "http_cold_start.sh $args"
        OUT=$OUT/http PREFILL=$([[ $args == 64* ]] && echo 1) \
          timeout -k 10 "${LORAD_PART_LIMIT:-280}" bash benchmarks/http_cold_start.sh $args 2>&1 \
          | tee "$OUT/http-${args// /-}.log" | grep -E "ready in|=== |output tokens/s|time to first"
        status[http-${args// /-}.log]=${PIPESTATUS[0]}
      done ;;
    mix)
      say "http_adapter_mix.sh 64 130"
      OUT=$OUT timeout -k 10 "${LORAD_PART_LIMIT:-400}" bash benchmarks/http_adapter_mix.sh 64 130 \
        2>&1 | tee "$OUT/mix.log" | tail -n 20
      status[mix.log]=${PIPESTATUS[0]} ;;
    prefix)
      say "http_prefix.sh"
      OUT=$OUT timeout -k 10 560 bash benchmarks/http_prefix.sh 2>&1 | tee "$OUT/prefix.log"
      status[prefix.log]=${PIPESTATUS[0]} ;;
    *) echo "gpu_session: unknown part $part (see the header of $0)" >&2; status[$part]=2 ;;
  esac
done

# The device tool brings back only so many files: each benchmark's work folder (daemon logs,
# bench.py's records, step tables) comes back as one archive, without the random adapters it
# wrote (84 MB each at the 8B shape: two made capacity's archive too large to come back).
for work in paging determinism drafting capacity; do
  if [[ -d $OUT/$work ]]; then
    tar czf "$OUT/$work.tar.gz" --exclude="$work/adapters" -C "$OUT" "$work" \
      && rm -rf "${OUT:?}/$work"
  fi
done

say "summary"
failed=0
for log in "${!status[@]}"; do
  code=${status[$log]}
  echo "--- $log: exit $code$( ((code == 124 || code == 137)) && echo ' (timed out)')"
  (( code == 0 )) || failed=1
done
[[ -f $OUT/gpu-tests.log ]] \
  && grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)\b" "$OUT/gpu-tests.log" | tail -n 25
for table in "$OUT"/bench-*.md; do
  [[ -s $table ]] && { echo "--- $(basename "$table")"; cat "$table"; }
done
echo "--- whole session: $((SECONDS - started)) s"
exit $failed
