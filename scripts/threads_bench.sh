#!/bin/bash
# README's first command under each thread setting, idle and with one core busy (yes > /dev/null),
# two runs each: reports/cpu/threads/threads_bench.log. Usage: scripts/threads_bench.sh > threads_bench.log
cd /tmp
measure() {  # label, env...
  local label=$1; shift
  for rep in 1 2; do
    tps=$(env "$@" pagedbench run --out /tmp/rt --overwrite 2>/tmp/rt.err | awk -F'|' '/^\| sdpa/{print $8}')
    echo "$label rep$rep load=$(cut -d' ' -f1 /proc/loadavg) output_tok/s=$tps $(grep -o 'CPU threads: [0-9]*' /tmp/rt.err)"
  done
}
for state in idle busy; do
  if [ $state = busy ]; then yes > /dev/null & BUSY=$!; sleep 3; fi
  measure "$state OMP=2" OMP_NUM_THREADS=2
  measure "$state OMP=2 PASSIVE" OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE
  measure "$state OMP=1" OMP_NUM_THREADS=1
  measure "$state auto" -u OMP_NUM_THREADS
  measure "$state auto PASSIVE" -u OMP_NUM_THREADS OMP_WAIT_POLICY=PASSIVE
  [ $state = busy ] && kill $BUSY
done
