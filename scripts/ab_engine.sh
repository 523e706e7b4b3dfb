#!/usr/bin/env bash
# The engine benchmark of two revisions on one GPU, in turn: this checkout, another revision,
# this checkout again. Machines differ by a few percent, and kernel benchmarks alone have
# disagreed with the engine (docs/benchmarks.md, 2026-11-30 06:02 round), so a change to the
# decode step is judged this way.
#
# Here, in the git checkout: export the other revision's lorad/ and scripts/ (into .ab/, which
# git ignores), and have the pyzmq wheel in .whl/ (scripts/gpu_session.sh says how):
#   scripts/ab_engine.sh export REV
# On the lent GPU, through the device tool, both folders carried:
#   run(command="bash scripts/ab_engine.sh run REV -- --cases many,mixed4 --batches 32,64",
#       carry=[".whl", ".ab"])
# Arguments after -- go to both revisions' scripts/bench_engine.py, so they must be ones both
# take (default: mixed4 and many at batches 1, 32 and 64, no prefill, no transformers). Prints each (case, batch)'s graph replay ms for
# this checkout, REV, this checkout; logs go to $OUT.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
usage() { echo "usage: scripts/ab_engine.sh export REV | run REV [-- BENCH_ENGINE_ARGS]" >&2; }
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
  git archive "$rev" lorad scripts | tar -x -C "$tree" || exit 1
  echo "ab_engine: $rev exported to $tree; carry .ab (and .whl) in the device call"
  exit 0
fi
[[ $mode == run ]] || { usage; exit 2; }
[[ -f $tree/scripts/bench_engine.py ]] \
  || { echo "ab_engine: no $tree: run 'scripts/ab_engine.sh export $rev' here first" >&2; exit 2; }
if [[ $# -gt 0 ]]; then
  [[ $1 == -- ]] || { usage; exit 2; }
  shift
fi
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--cases mixed4,many --batches 1,32,64 --prefill ""
                                 --hf-batches "" --eager-batches "")
OUT=${OUT:-/tmp/lorad-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    2>/dev/null || echo "ab_engine: installing the carried wheels failed"
fi
export PYTHONPATH=/tmp/site

# bench_engine.py puts its own checkout first on sys.path, so each tree runs its own lorad.
status=0
for round in this "$name" this2; do
  root=.
  [[ $round == "$name" ]] && root=$tree
  echo "=== $round ($root)"
  timeout -k 10 "${AB_TIMEOUT_S:-150}" python3 "$root/scripts/bench_engine.py" "${args[@]}" \
    >"$OUT/$round.log" 2>&1 || { echo "ab_engine: $round exited $?"; status=1; }
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
