#!/bin/bash
# bench-serve TTFT per rate against a fresh `serve tiny-llama --backend flex` (CPU): old code vs new
run() {  # label, source dir, port
  local label=$1 src=$2 port=$3
  cd $src
  local t0=$(date +%s.%N)
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)  # a cold compile cache, as a fresh machine has
  PYTHONPATH=$src python -m pagedbench serve tiny-llama --backend flex --device cpu --port $port > /tmp/serve-$label.log 2>&1 &
  local pid=$!
  until curl -s localhost:$port/health > /dev/null; do sleep 0.2; done
  echo "$label: server up after $(echo "$(date +%s.%N) - $t0" | bc) s; load $(cut -d' ' -f1 /proc/loadavg)"
  grep -h "warmed up" /tmp/serve-$label.log
  cd /work/main
  pagedbench bench-serve --base-url http://127.0.0.1:$port --scenario online --scale 0.25 --request-rate 2,8,inf \
    --out /tmp/ttft-$label --overwrite 2>&1 | grep -E "^rate"
  kill $pid; wait $pid 2>/dev/null
}
run before /tmp/old 8101
run after /work/main 8102
