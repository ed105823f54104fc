#!/bin/bash
# GPU tests, the default main job on GPU, and the 1.36B bf16 benchmark
# (megacoat compiled / eager, and the plain-PyTorch peer measured side by side).
# Usage on a GPU host: bash scripts/gpu_foundation.sh  (writes under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; J=/tmp/mcjson; mkdir -p $J
LOG=$OUT/log.txt
STAGES=${STAGES:-tests,main,compile,eager,peer,profile}   # pick a subset, e.g. STAGES=tests,compile
has() { [[ ",$STAGES," == *",$1,"* ]]; }
{
echo "== env"; date -u; cat COMMIT 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
has tests && echo "== gpu tests" && python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tail -15
has main && echo "== default main job on GPU (40 iterations)" && python3 pretrain_gpt.py --train-iters 40 --log-interval 10 --eval-interval 20 --eval-iters 2 --data-cache-path /tmp/mc 2>&1 | grep -v '^  [a-z_0-9]* \.\.'
} 2>&1 | tee $LOG
M="--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --mock-data --vocab-size 32000 --attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 5 --eval-interval 0 --eval-iters 0 --untie-embeddings-and-output-weights --bf16"
run() { name=$1; shift; echo "== megacoat $name" | tee -a $LOG; python3 pretrain_gpt.py $M "$@" --log-json $J/$name.jsonl 2>&1 | grep -v '^  [a-z_0-9]* \.\.' | tail -6 | tee -a $LOG; }
has compile && run compile_gbs4 --global-batch-size 4 --train-iters 40 --log-interval 10
has eager && run eager_gbs4 --global-batch-size 4 --train-iters 30 --log-interval 10 --no-torch-compile
has compile && run compile_gbs32 --global-batch-size 32 --train-iters 12 --log-interval 4
if has peer; then
echo "== peer" | tee -a $LOG
python3 benchmarks/peer_plain_llama.py --compile --json $J/peer.jsonl 2>&1 | tail -2 | tee -a $LOG
python3 benchmarks/peer_plain_llama.py --json $J/peer.jsonl 2>&1 | tail -2 | tee -a $LOG
fi
has profile && echo "== profile (compiled, gbs 4)" | tee -a $LOG && python3 benchmarks/profile_step.py $M --global-batch-size 4 --train-iters 20 --log-interval 100 --profile-steps 3 2>&1 | grep -v '^  [a-z_0-9]* \.\.' | tail -45 > $OUT/profile.txt
python3 - <<'PY' > $OUT/results.jsonl
import glob, json, os
for f in sorted(glob.glob("/tmp/mcjson/*.jsonl")):
    name = os.path.basename(f)[:-6]
    for line in open(f):
        r = json.loads(line); r.setdefault("run", "megacoat " + name); print(json.dumps(r))
PY
echo done | tee -a $LOG
