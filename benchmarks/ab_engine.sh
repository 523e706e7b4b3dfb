#!/usr/bin/env bash
# The engine benchmark of two revisions on one GPU, in turn (A/B/A): this checkout, another
# revision, this checkout again, so that the machine's drift shows as the spread of the two A
# rounds. A change to the decode step is judged this way: kernel benchmarks alone have
# disagreed with the engine, and machines differ by a few percent.
#
# Here, in the git checkout: export the other revision (its lorad/, benchmarks/ or, before they
# existed, scripts/; into .ab/, which git ignores):
#   benchmarks/ab_engine.sh export REV
# On the lent GPU, through the device tool, .ab carried (and .whl, as gpu_session.sh says):
#   run(command="bash benchmarks/ab_engine.sh run REV -- --quick", carry=[".whl", ".ab"])
# Arguments after -- go to both revisions' bench_engine, so they must be ones both take
# (default: mixed4 and many at batches 1, 32 and 64, no prefill, no transformers). Each tree
# runs from its own root, so each imports its own lorad. Prints each (case, batch, mode)'s graph
# replay ms (else step ms) for this checkout, REV, this checkout; logs go to $OUT.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
usage() { echo "usage: benchmarks/ab_engine.sh export REV | run REV [-- BENCH_ENGINE_ARGS]" >&2; }
[[ $# -ge 2 ]] || { usage; exit 2; }
mode=$1 rev=$2
shift 2
# A folder name from the revision (a branch name may hold slashes).
name=$(printf '%s' "$rev" | tr -c 'A-Za-z0-9._-' '_')
tree=.ab/$name

if [[ $mode == export ]]; then
  [[ $# -eq 0 ]] || { usage; exit 2; }
  git rev-parse --verify --quiet "$rev^{commit}" >/dev/null \
    || { echo "ab_engine: $rev is not a revision here" >&2; exit 2; }
  rm -rf "$tree" && mkdir -p "$tree"
  paths=()
  for path in lorad benchmarks scripts tests; do
    git cat-file -e "$rev:$path" 2>/dev/null && paths+=("$path")
  done
  git archive "$rev" "${paths[@]}" | tar -x -C "$tree" || exit 1
  echo "ab_engine: $rev exported to $tree; carry .ab (and .whl) in the device call"
  exit 0
fi
[[ $mode == run ]] || { usage; exit 2; }
[[ -f $tree/benchmarks/bench_engine.py || -f $tree/scripts/bench_engine.py ]] \
  || { echo "ab_engine: no $tree: run 'benchmarks/ab_engine.sh export $rev' here first" >&2
       exit 2; }
if [[ $# -gt 0 ]]; then
  [[ $1 == -- ]] || { usage; exit 2; }
  shift
fi
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--cases mixed4,many --batches 1,32,64 --prefill ""
                                 --hf-batches "" --eager-batches "")
OUT=${OUT:-/tmp/lorad-ab}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    2>/dev/null || echo "ab_engine: installing the carried wheels failed"
fi
export PYTHONPATH=/tmp/site

# A tree's bench_engine runs from that tree's root, whose lorad comes first on sys.path.
bench_in() {  # tree root: its bench_engine, as that tree runs it
  local limit=${AB_TIMEOUT_S:-150}
  if [[ -f $1/benchmarks/bench_engine.py ]]; then
    (cd "$1" && timeout -k 10 "$limit" python3 -m benchmarks.bench_engine "${args[@]}")
  else
    (cd "$1" && timeout -k 10 "$limit" python3 scripts/bench_engine.py "${args[@]}")
  fi
}
status=0
for round in this "$name" this2; do
  root=.
  [[ $round == "$name" ]] && root=$tree
  echo "=== $round ($root)"
  bench_in "$root" >"$OUT/$round.log" 2>&1 || { echo "ab_engine: $round exited $?"; status=1; }
done
python3 - "$OUT" "$name" <<'EOF'
import json, sys
from pathlib import Path
out, name = Path(sys.argv[1]), sys.argv[2]
rounds = ["this", name, "this2"]
figures = {}
for r in rounds:
    path = out / f"{r}.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith('{"case"'):
            row = json.loads(line)
            ms = row["device_ms"] or row["step_ms"]
            figures.setdefault((row["case"], str(row["batch"]), row["mode"]), {})[r] = ms
print(f"\n{'case':<28} {'batch':>7} {'mode':>6} " + " ".join(f"{r:>10}" for r in rounds)
      + "   (graph replay ms, else step ms)")
for (case, batch, mode), by_round in figures.items():
    cells = " ".join(f"{by_round[r]:>10.2f}" if by_round.get(r) else f"{'-':>10}" for r in rounds)
    print(f"{case:<28} {batch:>7} {mode:>6} {cells}")
EOF
exit $status
