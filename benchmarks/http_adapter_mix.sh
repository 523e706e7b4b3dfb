#!/usr/bin/env bash
# Issue 29's check that a burst equals each stream's solo run at the 8B shape: lorad on random
# weights of scripts/configs/llama3-8b (bf16, default flags) with NUM_ADAPTERS distinct random
# rank-16 adapters (all seven projections, one seed each), then scripts/adapter_mix.py over the
# base model and every adapter: prompts of mixed lengths (random token ids, so long prompts are
# prefilled in chunks beside the other streams' decodes), greedy and seeded, a burst of BURST
# streams; every stream must equal its solo run. Prints adapter_mix.py's tables and verdict;
# logs in $OUT. Exit status: adapter_mix.py's (1: a stream differs, 2: a request failed).
#
# Usage, from the repository root on a lent GPU (wheels carried in .whl/; MODEL_DIR=another
# config folder and DTYPE=float32 for a dry run on the CPU):
#   bash benchmarks/http_adapter_mix.sh [NUM_ADAPTERS (64)] [BURST (64)] [PROMPT_LENGTHS]
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/lorad-adapter-mix}/mix
num_adapters=${1:-64} burst=${2:-64} prompt_lengths=${3:-9,300,1200}
model=${MODEL_DIR:-scripts/configs/llama3-8b}
dtype=${DTYPE:-bfloat16}
port=8013
url="http://127.0.0.1:$port"
mkdir -p "$OUT"
source benchmarks/http_lib.sh

adapters=$(mktemp -d /tmp/lorad-mix-adapters.XXXX)
write_adapters "$adapters" "$model" "$num_adapters"

start_lorad "$OUT/lorad.log" --model "$model" --load-format random --dtype "$dtype" \
  --port "$port" "${adapter_flags[@]}"
models=$(IFS=,; echo "$(base_model_id),${adapter_ids[*]}")

python3 scripts/adapter_mix.py --url "$url" --models "$models" --prompt-lengths "$prompt_lengths" \
  --seeded --burst "$burst" --max-tokens "${MAX_TOKENS:-24}" --ignore-eos 2>&1 \
  | tee "$OUT/adapter_mix.log"
verdict=${PIPESTATUS[0]}
stop_lorad
echo "adapter_mix.py exited with $verdict"
rm -rf "$adapters"
exit "$verdict"
