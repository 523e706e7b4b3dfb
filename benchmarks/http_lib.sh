# Sourced by the benchmarks/http_*.sh scripts, from the repository root, after they set `url`:
# the environment for lorad on a lent GPU (the wheels carried in .whl/ installed when the image
# lacks pyzmq or llguidance), random adapters written for a config, and one lorad daemon at a
# time, started, asked its base model's id and stopped.
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if compgen -G ".whl/*.whl" >/dev/null && ! python3 -c "import zmq, llguidance" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

daemon=
start_lorad() {  # log file, then lorad's flags (then LORAD_FLAGS'): prints its start-up lines
  local log=$1 extra=(); shift
  read -ra extra <<<"${LORAD_FLAGS:-}"
  python3 -m lorad.daemon "$@" "${extra[@]}" >"$log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 600); do
    python3 -c "import urllib.request as u; u.urlopen('$url/ready', timeout=2)" 2>/dev/null \
      && { grep -E "ready in|warm-up:" "$log"; return 0; }
    kill -0 "$daemon" 2>/dev/null \
      || { echo "lorad exited before /ready"; tail -20 "$log"; exit 1; }
    sleep 1
  done
  echo "lorad not ready in 600 s"; exit 1
}

stop_lorad() {
  kill -TERM "$daemon"
  wait "$daemon"
  echo "lorad exited with $?"
}

# folder, model config folder, count: random rank-16 PEFT folders a1..aN there, served as a1..aN
# by lorad's flags in adapter_flags (adapter_ids: the names)
write_adapters() {
  python3 - "$@" <<'PY' || exit 1
import sys
from pathlib import Path
from benchmarks.bench_engine import write_adapter
from lorad.config import ModelConfig
root, config = Path(sys.argv[1]), ModelConfig.from_dir(sys.argv[2])
for i in range(1, int(sys.argv[3]) + 1):  # distinct factors: a seed each
    write_adapter(root / f"a{i}", config, 16, seed=i)
PY
  adapter_flags=() adapter_ids=()
  for i in $(seq 1 "$3"); do adapter_flags+=(--adapter "a$i=$1/a$i"); adapter_ids+=("a$i"); done
}

base_model_id() {  # the running daemon's first model id: its base model
  python3 -c "import json, urllib.request as u
print(json.load(u.urlopen('$url/v1/models'))['data'][0]['id'])"
}
