#!/bin/bash
# ZeRO tests and benchmark on 2 GPUs: NCCL correctness tests, model-state memory at DP=2 for the 1.36B
# model, and step time with overlap off/on at three link settings (NVLink;
# NCCL_P2P_DISABLE=1, PCIe class; sockets over loopback, Ethernet class).
# Usage on a 2-GPU host (2 x H200): bash scripts/gpu_zero.sh   (writes under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; J=/tmp/zjson; mkdir -p $J; LOG=$OUT/zero_log.txt
ITERS=${ITERS:-10}
{ date -u; cat COMMIT 2>/dev/null; nvidia-smi topo -m 2>/dev/null | head -4
  python3 -m pytest -q -x tests/test_gpu.py -k "nccl" 2>&1 | tail -3; } | tee $LOG
grep -q "passed" $LOG || { echo "NCCL tests failed: not benchmarking" | tee -a $LOG; exit 1; }
M="--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 16 --mock-data --vocab-size 32000 --attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --eval-interval 0 --eval-iters 0 --untie-embeddings-and-output-weights --bf16 --use-distributed-optimizer --train-iters $ITERS --log-interval 5"
run() { # name, env..., -- flags...
  name=$1; shift; envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "== $name ${envs[*]} $*" | tee -a $LOG
  env "${envs[@]}" torchrun --nproc-per-node 2 pretrain_gpt.py $M "$@" --log-json $J/$name.jsonl 2>&1 \
    | grep -E "model-state|iteration +[0-9]+/|Error|error" | tail -4 | tee -a $LOG
}
NV=(NCCL_P2P_DISABLE=0)
PCIE=(NCCL_P2P_DISABLE=1)
SOCK=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
OV="--overlap-grad-reduce --overlap-param-gather"
run nvlink_overlap "${NV[@]}" -- $OV
run nvlink_plain "${NV[@]}" --
run p2pdisabled_overlap "${PCIE[@]}" -- $OV
run p2pdisabled_plain "${PCIE[@]}" --
run sockets_overlap "${SOCK[@]}" -- $OV
run sockets_plain "${SOCK[@]}" --
python3 - <<'PY' > $OUT/zero_results.jsonl
import glob, json, os
for f in sorted(glob.glob("/tmp/zjson/*.jsonl")):
    for line in open(f):
        r = json.loads(line); r["run"] = os.path.basename(f)[:-6]; print(json.dumps(r))
PY
echo done | tee -a $LOG
