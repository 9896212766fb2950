#!/bin/bash
# bench-serve TTFT per rate against a fresh `serve tiny-llama --backend flex` (CPU, a cold compile
# cache, as a fresh machine has), once per LABEL=SOURCE_DIR: the engine of that checkout serves, this
# checkout's bench-serve measures. reports/cpu/serve-warmup/ttft.log: before=<a checkout of 00646fd> after=.
# Usage: scripts/serve_ttft.sh before=/tmp/old after=.
here=$(pwd) port=8101
for arg in "$@"; do
  label=${arg%%=*} src=$(realpath "${arg#*=}")
  t0=$(date +%s.%N)
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=$src python -m pagedbench serve tiny-llama --backend flex \
    --device cpu --port $port > /tmp/serve-$label.log 2>&1 &
  pid=$!
  until curl -s localhost:$port/health > /dev/null; do sleep 0.2; done
  echo "$label: server up after $(echo "$(date +%s.%N) - $t0" | bc) s; load $(cut -d' ' -f1 /proc/loadavg)"
  grep -h "warmed up" /tmp/serve-$label.log
  (cd "$here" && pagedbench bench-serve --base-url http://127.0.0.1:$port --scenario online --scale 0.25 \
    --request-rate 2,8,inf --out /tmp/ttft-$label --overwrite 2>&1 | grep -E "^rate")
  kill $pid; wait $pid 2>/dev/null
  port=$((port + 1))
done
