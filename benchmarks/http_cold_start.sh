#!/usr/bin/env bash
# The first burst after a start on an empty Triton cache, against the same burst again: lorad on
# random weights of scripts/configs/llama3-8b (bf16) with N distinct adapters (random PEFT folders
# of rank 16 on all seven projections, a seed each; 0: the base model alone), then
# scripts/bench.py twice with no unmeasured warm-up requests (round-robin over the adapters).
# Prints the start-up line and both bursts' tables; logs in $OUT. With PREFILL=1, then: 32
# streams of 1,024 in / 64 out and single prompts of 512 and 2,048 tokens (max_tokens 1: the
# time to first token is the prefill), on the base model and on the adapters.
#
# Usage, from the repository root on a lent GPU (pyzmq and llguidance wheels carried in .whl/;
# MODEL_DIR=another config folder for a dry run; LORAD_FLAGS="--no-async-scheduling", say,
# adds lorad flags):
#   bash benchmarks/http_cold_start.sh [NUM_ADAPTERS (8)] [CONCURRENCY (64)] [MAX_TOKENS (512)]
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/lorad-cold-start}/a${1:-8}-c${2:-64}
num_adapters=${1:-8} concurrency=${2:-64} max_tokens=${3:-512}
model=${MODEL_DIR:-scripts/configs/llama3-8b}  # another config folder for a dry run
port=8011
mkdir -p "$OUT"
url="http://127.0.0.1:$port"
source benchmarks/http_lib.sh
TRITON_CACHE_DIR=$(mktemp -d /tmp/lorad-triton-empty.XXXX)  # empty: the cold start measured
export TRITON_CACHE_DIR

adapters=$(mktemp -d /tmp/lorad-cold-start-adapter.XXXX)
write_adapters "$adapters" "$model" "$num_adapters"
model_ids=$(IFS=,; echo "${adapter_ids[*]}")
pick=(--model "$model_ids")
(( num_adapters == 0 )) && pick=() model_ids=base  # bench.py takes the first id: the base model

start_lorad "$OUT/lorad.log" --model "$model" --load-format random --dtype bfloat16 \
  --port "$port" "${adapter_flags[@]}"

for burst in first second; do
  echo "=== $burst burst: $concurrency streams, 16 in / $max_tokens out, ids $model_ids"
  python3 scripts/bench.py --url "$url" "${pick[@]}" \
    --concurrency "$concurrency" --requests "$concurrency" --warmup 0 --prompt-len 16 \
    --max-tokens "$max_tokens" --note "random 8B, $num_adapters adapters, empty triton cache" \
    2>&1 | tee "$OUT/bench-$burst.log"
done
if [[ -n ${PREFILL:-} ]]; then  # the prefill-heavy workloads, base model against the adapters
  base_id=$(base_model_id)
  run() {  # name, then bench.py's arguments
    local name=$1; shift
    echo "=== $name"
    python3 scripts/bench.py --url "$url" "$@" 2>&1 | tee "$OUT/$name.log" \
      | grep -E "output tokens/s|time to first|completed"
  }
  targets=("$base_id")
  (( num_adapters > 0 )) && targets+=("$model_ids")
  # Each run its own --seed: bench.py's prompts of one seed share their first tokens across
  # lengths, so a later run's prompts would hit the prefix cache the earlier runs filled.
  seed=100
  for ids in "${targets[@]}"; do
    tag=$([[ $ids == "$base_id" ]] && echo base || echo adapters)
    run "prefill-burst-$tag" --model "$ids" --concurrency 32 --requests 32 --warmup 2 \
      --prompt-len 1024 --max-tokens 64 --seed $((seed += 1))
    for len in 512 2048; do
      run "prompt-$len-$tag" --model "${ids%%,*}" --concurrency 1 --requests 4 --warmup 1 \
        --prompt-len "$len" --max-tokens 1 --seed $((seed += 1))
    done
  done
fi
stop_lorad
rm -rf "$adapters"
