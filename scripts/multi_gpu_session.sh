#!/usr/bin/env bash
# Issue 6: lorad at --parallel 2 (and 4) over NCCL on a multi-GPU host, in one device call
# (kind nvidia-h200-x2 or -x4). Four parts, each under its own timeout, logs under $OUT:
#   1. logits   tests/tp_runner.py ranks (nccl, cuda) at world 1 and 2, fp32 and bf16, tiny Llama
#               + six peft adapters (tests/unit/test_lora_logits.py's scenarios) against
#               transformers + peft fp32 (fp32 < 1e-5, bf16 < 5e-2 relative), world 2 vs world 1,
#               ranks identical                                                  -> logits.log
#   2. serve    a real daemon --parallel 2 --device cuda --dist-backend nccl --dtype bfloat16
#               with adapters a, b: start-up (registry agreement), /health, scripts/adapter_mix.py
#               (burst == solo), SIGTERM exit 0; then per-step agreement through the
#               LORAD_TEST_CORRUPT_SLOT_RANK hook (500, serving goes on)        -> serve.log
#   3. faults   kill -9 rank 1 and rank 0 mid-stream, and rank 1 raising in a step (a wrapper
#               worker command patches Engine.forward; lorad unchanged): error event on every open
#               stream, daemon exit non-zero, every worker gone within seconds  -> faults.log
#               (daemon and worker logs of each case: daemon-<part>-<case>.log)
#   4. bench    8B shape (scripts/configs/llama3-8b, random weights, bf16), decode step at batch 1
#               and 32 through the decode CUDA graphs and eagerly, at world 1, 2 and 4 (those the
#               GPU count allows), and the step's collectives alone      -> bench.log, bench.md
# A summary with each part's PASS/FAIL and the benchmark table is printed last.
#
# Run from the repository root through the device tool, with the pyzmq wheel carried:
#   cp /work/shared/wheels-gpu/*.whl .whl/      (here, once; .whl/ is git-ignored)
#   run(command="bash scripts/multi_gpu_session.sh", kind="nvidia-h200-x2", carry=[".whl"],
#       timeout_s=600)
# Budget (timeouts): logits 100 s, serve 120 s, faults 140 s, bench 240 s (MGPU_BENCH_TIMEOUT).
# On a 4-GPU host (nvidia-h200-x4) the same script runs; the bench adds world 4.
# Locally on CPU: MGPU_DEVICE=cpu MGPU_BACKEND=gloo MGPU_DTYPE=float32 MGPU_BENCH_CONFIG=<tiny>
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/lorad-multi-gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # the machine sets the other NCCL variables
DEVICE=${MGPU_DEVICE:-cuda}
BACKEND=${MGPU_BACKEND:-nccl}
DTYPE=${MGPU_DTYPE:-bfloat16}
PY=${MGPU_PYTHON:-python3}
WORK=$(mktemp -d /tmp/mgpu-XXXXXX)
started=$SECONDS
declare -A status

say() { printf '\n=== %s (%ds) ===\n' "$*" "$((SECONDS - started))"; }

say "setup"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || echo "multi_gpu_session: installing the carried wheels failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "multi_gpu_session: no .whl/*.whl carried (fine where pyzmq is installed)"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
env | grep -E '^(NCCL|CUDA_VISIBLE)' | sort | tee "$OUT/env.txt"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv 2>&1 | tee -a "$OUT/env.txt"
nvidia-smi topo -m 2>&1 | head -n 6 | tee -a "$OUT/env.txt"
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib.metadata as md, torch
found = []
for name in ("torch", "transformers", "peft", "pyzmq", "aiohttp", "uvloop"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} MISSING")
print(", ".join(found))
print(f"cuda devices: {torch.cuda.device_count()}, nccl "
      f"{torch.cuda.nccl.version() if torch.cuda.is_available() else '-'}")
EOF

PARTS=" ${MGPU_PARTS:-logits serve faults bench} "  # a subset: MGPU_PARTS="serve faults"
part() {  # name, timeout seconds, checks subcommand and its flags
  local name=$1 limit=$2
  shift 2
  [[ $PARTS == *" $name "* ]] || { status[$name]=skipped; return; }
  say "$name"
  mkdir -p "$WORK/$name"
  timeout -k 10 "$limit" "$PY" scripts/multi_gpu_checks.py "$@" --device "$DEVICE" \
    --backend "$BACKEND" --work "$WORK/$name" 2>&1 \
    | grep --line-buffered -vE 'Loading weights|Writing model shards|FutureWarning|warnings.warn' \
    | tee "$OUT/$name.log"
  status[$name]=${PIPESTATUS[0]}
  # Daemon logs of this part (worker tracebacks live there), as $OUT/daemon-<part>-<case>.log.
  for log in "$WORK/$name"/*.log; do
    [[ -f $log ]] && cp "$log" "$OUT/daemon-$name-$(basename "$log")"
  done
  # Anything the part left behind (a timed-out part's daemons and workers) goes now, so the next
  # part starts on idle GPUs: only our own processes, by the pid of each.
  for pid in $(pgrep -f "$WORK/$name" || true); do
    [[ $pid != "$$" ]] && kill -9 "$pid" 2>/dev/null && echo "killed leftover pid $pid"
  done
}

part logits 100 logits
# The daemon's ranks: 2, or MGPU_PARALLEL (4 on a 4-GPU host); MGPU_FAULTS_PARALLEL for faults.
PARALLEL=${MGPU_PARALLEL:-2}
part serve 120 serve --dtype "$DTYPE" --parallel "$PARALLEL"
part faults 140 faults --dtype "$DTYPE" --parallel "${MGPU_FAULTS_PARALLEL:-$PARALLEL}"
bench_config=${MGPU_BENCH_CONFIG:-scripts/configs/llama3-8b}
part bench "${MGPU_BENCH_TIMEOUT:-240}" bench --dtype "$DTYPE" --config "$bench_config" --table-out "$OUT/bench.md" \
  ${MGPU_BENCH_FLAGS:-}

say "summary"
for name in logits serve faults bench; do
  code=${status[$name]:-missing}
  verdict=FAIL
  [[ $code == 0 ]] && verdict=PASS
  [[ $code == skipped ]] && { echo "--- $name: skipped (MGPU_PARTS)"; continue; }
  [[ $code == 124 || $code == 137 ]] && verdict="FAIL (timed out)"
  echo "--- $name: $verdict (exit $code): $OUT/$name.log"
  grep -E '^(FAIL|INFO) ' "$OUT/$name.log" | head -n 12
  grep -E '^--- [0-9]+/[0-9]+ checks' "$OUT/$name.log"
done
echo "--- bench (decode, 8B shape; graphs and eager):"
[[ -s $OUT/bench.md ]] && cat "$OUT/bench.md"
echo "--- whole session: $((SECONDS - started)) s"
failed=0
for name in logits serve faults bench; do
  [[ ${status[$name]:-1} == 0 || ${status[$name]} == skipped ]] || failed=1
done
exit $failed
