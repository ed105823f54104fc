#!/bin/bash
# Checkpoint and pipeline benchmarks on a 2-GPU H200 host within ~9 minutes, in priority order:
#   1. checkpoint save/load GB/s and --async-save stall, ~1B model, one GPU
#   2. pipeline parallelism PP=2 (scripts/gpu_pipeline.sh, time-budgeted)
#   3. megacoat 1.36B bf16 at global batch 4 (scripts/gpu_foundation.sh STAGES=compile) if time remains
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
{ date -u; cat COMMIT 2>/dev/null
  echo "== checkpoint bench (1 GPU)"
  timeout 170 python3 benchmarks/checkpoint_bench.py --save-dir /tmp/ckbench --repeats 2 --out $OUT/checkpoint_h200.jsonl \
     -- --no-torch-compile --bf16 2>&1 | grep -v '^  [a-z_0-9]* \.\.' | tail -12
  rm -rf /tmp/ckbench
  echo "(checkpoint done at $(( $(date +%s) - T0 )) s)"; } 2>&1 | tee $OUT/final_log.txt
BUDGET_S=${PP_BUDGET_S:-170} bash scripts/gpu_pipeline.sh
LEFT=$(( 540 - ($(date +%s) - T0) ))
if [ $LEFT -gt 100 ]; then
  STAGES=compile timeout $((LEFT - 10)) bash scripts/gpu_foundation.sh >/dev/null 2>&1
  grep -E "compile_gbs|iteration +40/|iteration +12/" $OUT/log.txt | cut -c1-420 | tee -a $OUT/final_log.txt
fi
rm -rf $OUT/pipeline_json  # pipeline_results.jsonl holds the per-run JSON: $OUT stays a few files
echo "done at $(( $(date +%s) - T0 )) s" | tee -a $OUT/final_log.txt
