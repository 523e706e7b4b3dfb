#!/usr/bin/env bash
# Issue 31's GPU figures: the prefix cache's hit rate and time to first token on a multi-turn
# workload, and decode throughput with the cache on and off. lorad on random weights of
# scripts/configs/llama3-8b (bf16, defaults otherwise), then scripts/bench.py:
#   1. chat-turns: CONVERSATIONS conversations of 4 turns opening with one SYSTEM_TOKENS-token
#      system prompt, 64 tokens out a turn, with the cache ("cache_prompt" default) and without
#      ("cache_prompt": false, --no-cache) on the same server;
#   2. independent prompts (no shared prefix: no hits), DECODE_STREAMS (64) streams of 16 in /
#      DECODE_TOKENS (256) out, on that server and on a second one started with
#      --no-prefix-cache: decode throughput.
# Prints bench.py's tables; logs in $OUT.
#
# Usage, from the repository root on a lent GPU (wheels carried in .whl/; MODEL_DIR=another
# config folder and DTYPE=float32 for a dry run on the CPU):
#   bash benchmarks/http_prefix.sh [CONVERSATIONS (64)] [SYSTEM_TOKENS (2000)]
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/lorad-prefix}/prefix
conversations=${1:-64} system_tokens=${2:-2000}
model=${MODEL_DIR:-scripts/configs/llama3-8b}
dtype=${DTYPE:-bfloat16}
decode_streams=${DECODE_STREAMS:-64} decode_tokens=${DECODE_TOKENS:-256}
port=8012
url="http://127.0.0.1:$port"
mkdir -p "$OUT"
source benchmarks/http_lib.sh
start() {  # log name, then lorad's extra flags
  local log=$1; shift
  start_lorad "$OUT/$log" --model "$model" --load-format random --dtype "$dtype" --port "$port" "$@"
}
bench() {  # name, then bench.py's arguments
  local name=$1; shift
  echo "=== $name"
  python3 scripts/bench.py --url "$url" "$@" 2>&1 | tee "$OUT/$name.log"
}

start lorad-cache.log
for cache in on off; do
  flags=()
  [[ $cache == off ]] && flags=(--no-cache)
  bench "chat-turns-cache-$cache" --workload chat-turns --concurrency "$conversations" \
    --turns 4 --system-tokens "$system_tokens" --max-tokens 64 --warmup 2 "${flags[@]}" \
    --note "random $(basename "$model") $dtype, cache $cache"
done
bench decode-cache-on --concurrency "$decode_streams" --requests "$decode_streams" \
  --warmup 2 --prompt-len 16 --max-tokens "$decode_tokens" \
  --note "random $(basename "$model") $dtype, prefix cache on (no shared prefixes)"
stop_lorad

start lorad-no-cache.log --no-prefix-cache
bench decode-no-prefix-cache --concurrency "$decode_streams" --requests "$decode_streams" \
  --warmup 2 --prompt-len 16 --max-tokens "$decode_tokens" \
  --note "random $(basename "$model") $dtype, --no-prefix-cache"
stop_lorad
