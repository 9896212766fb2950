#!/usr/bin/env bash
# GPU-side validation of pagedbench, run from the project's root on the GPU machine, in three calls
# of at most ~8 minutes each (a developer session has 30 minutes of device time in all):
#   bash .gpu/kit/validate.sh part1   environment facts, first half of the FA4 wheels stashed, the CUDA
#                                     test cases that need no flash-attn, `check` on every other backend
#   bash .gpu/kit/validate.sh part2   FA4 installed and smoke-tested, the flash-attn CUDA cases, `check`
#                                     on flash-attn
#   bash .gpu/kit/validate.sh part3   `kernels` (decode + mixed, pages 16 and 128) and `compare --peer hf`
#                                     on mixed at the Qwen3-0.6B shape (FA4 still installed if warm)
#   bash .gpu/kit/validate.sh part4   optional: `compare` on decode-heavy, an --enforce-eager row, and the
#                                     step profile (profile_step.py)
#   bash .gpu/kit/validate.sh anchors optional: reference kernels outside the project (anchors.py)
# Everything it prints also goes to $OUT/validate.log; reports come back as $OUT/reports.tar.gz.
# Each step has its own time limit; a failing step is recorded and the next one still runs; the
# exit code is 1 when any step failed or was cut.
set -u
OUT=${OUT:-/tmp/pagedbench-out}
STASH=/tmp/pagedbench-gpu          # survives between calls only while the machine stays warm
SITE=$STASH/site
FA4_PART1=${FA4_PART1:-.gpu/fa4-1/part}   # the two halves of the FA4 wheel tar (pack.sh)
FA4_PART2=${FA4_PART2:-.gpu/fa4-2/part}
SCALE=${VALIDATE_SCALE:-0.5}       # compare scale: 128 requests of mixed at 0.5
DEADLINE=$((SECONDS + ${VALIDATE_SECONDS:-480}))   # a call may run 600 s; three calls must fit 30 min
mkdir -p "$OUT" "$STASH"
exec > >(tee -a "$OUT/validate.log") 2>&1
TEE=$!
export PYTHONUNBUFFERED=1
# FA4 lives in $SITE once part2 installed it; the CuTe DSL's .pth line, spelled out for PYTHONPATH:
export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS CMD... (the limit is cut to what is left before DEADLINE)
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 15))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "=== $name: skipped, no time left"; echo "$name skipped" >> "$OUT/summary.txt"; return 124; fi
  echo; echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" bash -c '"$@"' "$name" "$@"; local rc=$?
  [ "$rc" -eq 124 ] && echo "=== $name: cut at its time limit"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  echo "$name rc=$rc $((SECONDS - t0))s" >> "$OUT/summary.txt"
  return "$rc"
}

env_facts() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 - <<'PY'
import inspect, sysconfig, os, shutil, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
p = torch.cuda.get_device_properties(0)
print("SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1), "cc", f"{p.major}.{p.minor}")
for mod in ("triton", "transformers", "flash_attn", "flash_attn_interface"):
    try:
        m = __import__(mod); print(mod, getattr(m, "__version__", "?"), getattr(m, "__file__", None))
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, e)
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except Exception as e:
    print("varlen_attn: none", e)
inc = sysconfig.get_paths()["include"]
print("C compiler", shutil.which("cc") or shutil.which("gcc"), "| Python.h", os.path.exists(os.path.join(inc, "Python.h")))
PY
}

install_project() {
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
  python3 -c "import pagedbench, sys; print('pagedbench from', pagedbench.__file__)"
}

install_fa4() {
  [ -f "$STASH/fa4.1" ] || { echo "FA4 part 1 is missing: the machine was given back between the calls; run part1 again"; return 1; }
  cat "$STASH/fa4.1" "$FA4_PART2" | tar -C "$STASH" -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STASH"/wheels/*.whl || return 1
  python3 -c "from flash_attn.cute import flash_attn_varlen_func; import flash_attn; print('FA4 ok', flash_attn.__path__)"
}

fa4_smoke() {  # FA4's paged varlen path against dense attention, independent of pagedbench
  python3 - <<'PY'
import torch
from flash_attn.cute import flash_attn_varlen_func
torch.manual_seed(0)
dev, dt, H, Hkv, D, page = "cuda", torch.bfloat16, 16, 8, 128, 16
for q_lens, k_lens in (([1, 1, 1], [339, 17, 1024]), ([64, 1, 5], [800, 2048, 5])):
    B, pages_per = len(q_lens), max((k + page - 1) // page for k in k_lens)
    num_pages = B * pages_per + 1
    k_cache = torch.randn(num_pages, page, Hkv, D, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(num_pages - 1, device=dev)[: B * pages_per] + 1).view(B, pages_per).int()
    q = torch.randn(sum(q_lens), H, D, device=dev, dtype=dt)
    cu_q = torch.tensor([0] + q_lens, device=dev).cumsum(0).int()
    res = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens),
                                 seqused_k=torch.tensor(k_lens, device=dev, dtype=torch.int32),
                                 page_table=table, softmax_scale=D ** -0.5, causal=True)
    out = res[0] if isinstance(res, tuple) else res
    worst = 0.0
    for b, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        kk = k_cache[table[b].long()].reshape(-1, Hkv, D)[:kl].float().repeat_interleave(H // Hkv, 1)
        vv = v_cache[table[b].long()].reshape(-1, Hkv, D)[:kl].float().repeat_interleave(H // Hkv, 1)
        qq = q[cu_q[b]: cu_q[b + 1]].float()
        s = torch.einsum("qhd,khd->hqk", qq, kk) * D ** -0.5
        pos_q = torch.arange(kl - ql, kl, device=dev)[:, None]
        s = s.masked_fill(torch.arange(kl, device=dev)[None, :] > pos_q, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
        worst = max(worst, (out[cu_q[b]: cu_q[b + 1]].float() - ref).abs().max().item())
    print(f"FA4 paged q_lens={q_lens} k_lens={k_lens}: max |err| vs fp32 dense = {worst:.4f}", "OK" if worst < 2e-2 else "TOO LARGE")
PY
}

pack_reports() {
  [ -d reports-gpu ] && tar -czf "$OUT/reports.tar.gz" reports-gpu && echo "reports: \$OUT/reports.tar.gz ($(du -h "$OUT/reports.tar.gz" | cut -f1))"
}

backends_here() {  # every registered backend but the slow per-sequence reference
  python3 -c "from pagedbench.backends.registry import list_backends; print(','.join(b for b in list_backends() if b != 'reference'))"
}

export -f env_facts install_project install_fa4 fa4_smoke
export OUT STASH SITE FA4_PART1 FA4_PART2
stage=${1:-part1}
kit=$(dirname "$0")
case "$stage" in
  a)
    step env 15 env_facts
    cp "$FA4_PART1" "$STASH/fa4.1" && echo "FA4 part 1 stashed"
    step install 30 install_project
    step pytest-cuda 210 python3 -m pytest -v -rfEs -n 14 --timeout 150 -k "cuda and not flash" -p no:cacheprovider tests
    step kernels 140 pagedbench kernels --phases decode --batch-sizes 1,16,64,256 --context-lens 2048,4096 \
      --block-sizes 16 --heads 32/8 --max-kv-tokens 1100000 --warmup 3 --repeats 20 --backends sdpa,flex,triton --out reports-gpu
    ;;
  b)
    step install 20 install_project
    step fa4-install 45 install_fa4
    step pytest-flash 150 python3 -m pytest -v -rfEs -n 14 --timeout 120 -k "cuda and flash" -p no:cacheprovider tests
    step kernels-fa 60 pagedbench kernels --phases decode --batch-sizes 1,16,64,256 --context-lens 2048,4096 \
      --block-sizes 16 --heads 32/8 --max-kv-tokens 1100000 --warmup 3 --repeats 20 --backends flash-attn --out reports-gpu --overwrite
    step compare 150 pagedbench compare --backends triton,flash-attn,flex --model qwen3-0.6b \
      --scenario mixed --scale 1 --out reports-gpu --overwrite
    ;;
esac
pack_reports
echo; echo "summary:"; cat "$OUT/summary.txt"
failed=$(grep -cv ' rc=0 ' "$OUT/summary.txt")
exec 1>&- 2>&-
wait "$TEE"
[ "$failed" -eq 0 ]
