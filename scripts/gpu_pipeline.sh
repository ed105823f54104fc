#!/bin/bash
# Pipeline-parallel tests and benchmark on 2 GPUs (2 x H200), < 6 minutes:
#   1. NCCL correctness: tests/test_pipeline.py -k nccl (PP=2 1F1B and interleaved = one process:
#      losses, gradients, weights, tied embeddings, 1F1B memory bound).
#   2. The 1.36B model (scripts/gpu_zero.sh's flags) on one GPU (PP=1, baseline and loss reference),
#      then PP=2 with m = 2, 4, 8 micro-batches (1F1B) and m = 8 interleaved (2 chunks per GPU):
#      tokens/s and, per stage, the measured bubble (1 - forward/backward compute time from CUDA
#      events / wall time of the schedule, --log-pipeline-bubble) next to (pp-1)/(vp*m+pp-1).
# Usage on a 2-GPU host: bash scripts/gpu_pipeline.sh   (writes under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; J=$OUT/pipeline_json; mkdir -p "$J"; LOG=$OUT/pipeline_log.txt
ITERS=${ITERS:-8}          # timed: iterations ITERS/2+1 .. ITERS (the first ones compile)
BUDGET_S=${BUDGET_S:-265}  # start no run after this many seconds (a run is capped at 90 s: total < 6 min)
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
{ date -u; git rev-parse HEAD 2>/dev/null || cat COMMIT 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m 2>/dev/null | head -3
  timeout 100 python3 -m pytest -q -x tests/test_pipeline.py -k nccl 2>&1 | tail -3
  echo "(tests done at $(elapsed) s)"; } 2>&1 | tee "$LOG"
M=${M:-"--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --mock-data --vocab-size 32000 --attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --eval-interval 0 --eval-iters 0 --untie-embeddings-and-output-weights --bf16 --train-iters $ITERS --log-interval 1 --log-pipeline-bubble"}
PORT=29600
run() { # name, nproc, flags...
  local name=$1 nproc=$2; shift 2
  if [ "$(elapsed)" -gt "$BUDGET_S" ]; then echo "== $name skipped (time budget)" | tee -a "$LOG"; return; fi
  PORT=$((PORT + 1))
  echo "== $name (GPUs: $nproc) $* [t=$(elapsed) s]" | tee -a "$LOG"
  timeout 90 torchrun --nproc-per-node "$nproc" --master-port $PORT pretrain_gpt.py $M "$@" \
      --log-json "$J/$name.jsonl" > "$J/$name.out" 2>&1
  grep -E "model parameters|model-state" "$J/$name.out" | tee -a "$LOG"
  grep -E "iteration +[0-9]+/|pipeline bubble|Error|error" "$J/$name.out" | tail -2 | cut -c1-700 | tee -a "$LOG"
}
PP2="--pipeline-model-parallel-size 2"
run pp1_m4 1 --global-batch-size 16
run pp2_m2 2 $PP2 --global-batch-size 8
run pp2_m4 2 $PP2 --global-batch-size 16
run pp2_m8 2 $PP2 --global-batch-size 32
run pp2_vp2_m8 2 $PP2 --global-batch-size 32 --num-layers-per-virtual-pipeline-stage 6
python3 - "$J" "$ITERS" <<'PY' | tee "$OUT/pipeline_summary.md"
import glob, json, os, sys
J, iters = sys.argv[1], int(sys.argv[2])
first_timed = iters // 2 + 1
runs = {}
for f in sorted(glob.glob(os.path.join(J, "*.jsonl"))):
    name = os.path.basename(f)[:-6]
    recs = [json.loads(l) for l in open(f)]
    steps = [r for r in recs if "lm_loss" in r]
    bub = [r["pipeline_bubble"] for r in recs if "pipeline_bubble" in r and r["iteration"] >= first_timed]
    runs[name] = (steps, bub)
with open(os.path.join(os.path.dirname(J), "pipeline_results.jsonl"), "w") as out:
    for name, (steps, bub) in runs.items():
        for r in steps:
            out.write(json.dumps(dict(r, run=name)) + "\n")
        for b in bub:
            out.write(json.dumps(dict(pipeline_bubble=b, run=name)) + "\n")
print(f"| run | m | ms/iter | tokens/s (all GPUs) | peak GiB | schedule ms/stage | compute ms/stage | measured bubble/stage | theory |")
print("|---|---|---|---|---|---|---|---|---|")
for name, (steps, bub) in runs.items():
    timed = [r for r in steps if r["iteration"] >= first_timed]
    if not timed:
        print(f"| {name} | - | no timed iterations (see the log) |"); continue
    ms = 1e3 * sum(r["time_per_iter_s"] for r in timed) / len(timed)
    tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
    mem = max(r["peak_mem_gib"] for r in timed)
    if bub:
        n = len(bub); st = len(bub[0]["measured"])
        avg = lambda k: [sum(b[k][s] for b in bub) / n for s in range(st)]
        sched, comp, meas = avg("schedule_ms"), avg("compute_ms"), avg("measured")
        f = lambda xs, d=1: " / ".join(f"{x:.{d}f}" for x in xs)
        extra = f"{f(sched)} | {f(comp)} | {f([100 * x for x in meas])} % | {100 * bub[0]['theory']:.1f} %"
        m = bub[0]["num_microbatches"]
    else:
        extra, m = "- | - | - | -", "?"
    print(f"| {name} | {m} | {ms:.1f} | {tps:,.0f} | {mem:.1f} | {extra} |")
def losses(n): return [r["lm_loss"] for r in runs.get(n, ([], []))[0]]
for a, b in (("pp1_m4", "pp2_m4"), ("pp2_m8", "pp2_vp2_m8")):
    la, lb = losses(a), losses(b)
    if la and lb:
        diffs = [abs(x - y) / abs(x) for x, y in zip(la, lb)]
        print(f"\nloss {a} vs {b} (same data and seed), per iteration: {la} vs {lb}; "
              f"max relative difference {max(diffs):.2e}, iteration 1: {diffs[0]:.2e}")
PY
echo "done in $(elapsed) s" | tee -a "$LOG"
