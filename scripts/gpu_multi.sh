#!/bin/bash
# Multi-GPU tests and benchmarks on a 4-GPU H200 host (some stages also on 2), in stages (STAGES=a,b,...), within BUDGET seconds.
#   retest   chosen GPU tests (RETESTS) with full tracebacks on GPU RETEST_GPU (1), in the background
#   build    the CUDA extensions (tableb builds them itself, in its timing lane)
#   tests4   the 4-GPU NCCL tests (SDP4Bit as 2 nodes x 2, ZeRO, TP)
#   hiprio   Table B sockets, 20 iterations: plain and both quantized (bucket HP_BUCKET), each without and with
#            --high-priority-stream-groups dp
#   nccl     the NCCL tests (-k NCCL_K, default all) on every GPU (TP=2 eager and compiled against TP=1, ZeRO overlap, PP=2, SDP4Bit);
#            runs while the extensions build (a test that needs one waits for the build's lock)
#   tableb   Table B: ZeRO DP=2 as 2 one-GPU nodes, 1.36B, micro-batch 4, global batch 16, overlap on:
#            plain vs qWD vs TLq-HS vs both at three link settings (timing lane, GPUs 0,1; 12 steps) and
#            a one-GPU run with the same per-GPU work (the compute-only reference for exposed
#            communication). With 4 GPUs, lane B on GPUs 2,3 runs stages tests (every gpu-marked test),
#            sdpbench, the same four configurations for 100 steps with validation (NVLink), optbench, fp8bench
#   corpus   a larger code corpus (the host's site-packages) for conv and loss200, in the background
#   tp       TP=2 with SP on every GPU (x DP=2 on four): bf16 vs COAT + FP8 optimizer states
#            (tp_tensorwise adds FP8 tensorwise)
#   tpdiag   TP=2, micro-batch 1: peak memory compiled vs eager, ZeRO vs not, COAT + FP8 states
#   tpbisect the 1.36B shape with BISECT_LAYERS layers: full gradients of one step (benchmarks/grad_snapshot.py)
#            at TP=2 eager / compiled / without gradient-accumulation fusion / without SP against TP=1,
#            and what is alive at the TP=2 micro-batch-4 memory peak (benchmarks/memory_peak.py)
#   tpverify after the fix: TP=2 compiled (micro-batches 1 and 4) against TP=1 eager gradient by gradient,
#            and the NCCL tests of tests/test_gpu.py (TP=2 compiled bf16 among them)
#   twonode  4 GPUs as 2 emulated nodes x 2 GPUs: NVLink inside a node, sockets between (t_nvlink adds
#            the same run with all four on one node)
#   conv     ~125M model, 2000 steps: plain vs qWD + TLq-HS (CONV_RUNS), validation loss; 2 nodes x 2 on
#            four GPUs, 2 one-GPU nodes on two; CONV_RUNS may add sdp4bit_1node (every GPU one node: the
#            single 8-bit level)
#   buckets  Table B sockets: plain and both quantized at the default bucket size, then both quantized
#            at smaller --ddp-bucket-size (BUCKETS), all in one run
#   loss200  1.36B, 2 x 2 layout, 200 steps: plain vs qWD + TLq-HS
# Emulated nodes: one torchrun per node, each with its own NCCL_HOSTID, so NCCL treats them as two
# hosts: it connects ranks of one node over NVLink (P2P) and ranks of different nodes through its
# network transport (sockets over loopback, NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo).
# Runs from a clean export of a commit (SRC, default .), reads the default corpus from .data, writes under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache OMP_NUM_THREADS=4
# Per-run logs and JSON go to $X and are packed into one archive at the end ($OUT stays a few files).
OUT=${OUT:-/tmp/out}; X=$OUT/x; mkdir -p "$X/runs" /tmp/logs; R=$X/runs; LOG=$OUT/log.txt
SRC=${SRC:-.}; HERE=$PWD; cd "$SRC"; export PYTHONPATH=$PWD
export TORCH_EXTENSIONS_DIR=$HERE/.ext   # an .ext kept from an earlier run skips the 75 s build
if [ -d "$HERE/.whl/megatron-core" ]; then  # a megatron-core wheel under .whl/: the megatron-core logits test
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $HERE/.whl/megatron-core/*.whl 2>&1 | tail -1
  export PYTHONPATH=$PWD:/tmp/site; fi
STAGES=${STAGES:-tests,sdpbench,tableb,optbench,fp8bench}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
T0=$(date +%s); el() { echo "(t=$(( $(date +%s) - T0 )) s)"; }
BUDGET=${BUDGET:-500}
late() { if [ $(( $(date +%s) - T0 )) -gt $BUDGET ]; then echo "-- skipped $1 (budget) $(el)" >> $LOG; return 0; fi; return 1; }
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
{ date -u; cat COMMIT 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -6; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > $LOG 2>&1

DATA=${DATA:-.data}
STDLIB="--data-path $DATA/stdlib_text_document --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/tokenizer.model"
M1="--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 16 --attention-dropout 0 --hidden-dropout 0 --untie-embeddings-and-output-weights --bf16 --make-vocab-size-divisible-by 32000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 --seed 1234"
ZERO="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
QW="--quantized-weights"; QG="--quantized-gradients --hadamard-transform"
FP8S="--fp8-format hybrid --fp8-recipe coat --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
NV=(NCCL_P2P_DISABLE=0); PCIE=(NCCL_P2P_DISABLE=1)
SOCK=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
INTER=(NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo)   # with per-node NCCL_HOSTID: sockets between nodes only
TMO=${TMO:-120}
TIMING="--train-iters 12 --log-interval 4 --eval-interval 0 --eval-iters 0"
SMALL="--num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8"
if [ "${SMOKE:-0}" = 1 ]; then  # CPU check of this script's plumbing: tiny models, 4 pretend GPUs
  M1="$M1 --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
  SMALL="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --train-iters 20 --eval-interval 10 --eval-iters 2"
  NGPU=4; export OMP_NUM_THREADS=1
fi

# launch NAME GPUS NODES PORT [ENV=V ...] -- pretrain_gpt.py flags
launch() {
  local name=$1 gpus=$2 nodes=$3 port=$4; shift 4; local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  late "$name" && return
  local g; IFS=, read -ra g <<< "$gpus"; local per=$(( ${#g[@]} / nodes )) pids=() n vis
  echo "== $name gpus=$gpus nodes=$nodes ${envs[*]} $* $(el)" >> $LOG
  for ((n = 0; n < nodes; n++)); do
    vis=$(IFS=,; echo "${g[*]:n*per:per}")
    env "${envs[@]}" NCCL_HOSTID=megacoat-emu-node$n CUDA_VISIBLE_DEVICES=$vis timeout $TMO \
      torchrun --nnodes $nodes --node-rank $n --nproc-per-node $per --master-addr 127.0.0.1 --master-port $port \
      pretrain_gpt.py "$@" --log-json $R/$name.jsonl > /tmp/logs/$name.n$n.txt 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  { grep -hE "iteration +[0-9]+/|validation loss|rror|Traceback|model-state" /tmp/logs/$name.n*.txt | tail -n 5 | cut -c1-900
    echo "-- end $name $(el)"; } >> $LOG
  if grep -qE "Traceback|Error" /tmp/logs/$name.n*.txt; then cp /tmp/logs/$name.n*.txt $X/; fi
}

build_ext() { echo "== build CUDA extensions $(el)" >> $LOG
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -c "from megacoat.optim.fp8_adam import fused_extension as f; print('fused adamw extension built:', f() is not None)" 2>&1 | tail -3 >> $LOG &
  local pid=$!  # the two builds in parallel (wait for this one only: other background stages run on)
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -c "from megacoat.kernels.sdp4bit import cuda_extension as f; print('sdp4bit extension built:', f() is not None)" 2>&1 | tail -3 >> $LOG
  wait $pid
}
bench() { # NAME FILE GPU [args]: a kernel benchmark on one GPU, its JSON into the archive
  late $1 && return; echo "== $2 $(el)" >> $LOG
  CUDA_VISIBLE_DEVICES=$3 timeout ${BENCH_TMO:-150} python3 benchmarks/$2 --out $X/$1.json "${@:4}" 2>&1 | grep -v Warning | tail -25 >> $LOG
}
if has retest; then (  # chosen GPU tests with full tracebacks, one GPU, in the background
  CUDA_VISIBLE_DEVICES=${RETEST_GPU:-1} timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=long --timeout 120 \
    ${RETESTS:-tests/test_fp8_gpu.py} > $X/retests.txt 2>&1
  { echo "== retests $(el)"; grep -E "passed|failed|FAILED|^E " $X/retests.txt | cut -c1-300 | tail -40; } >> $LOG ) &
  RETEST_PID=$!
fi
if has nccl && [ "$NGPU" -ge 2 ]; then  # the extensions build in the background meanwhile
  has build && { build_ext & BUILD_PID=$!; }
  echo "== NCCL tests on $NGPU GPUs $(el)" >> $LOG
  timeout ${NCCL_TMO:-240} python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --timeout 150 \
    tests/test_gpu.py tests/test_pipeline.py tests/test_sdp4bit_dist.py -k "${NCCL_K:-nccl}" > $X/nccl_tests.txt 2>&1
  grep -E "PASSED|FAILED|passed|failed|skipped|^E " $X/nccl_tests.txt | cut -c1-300 | tail -24 >> $LOG
  wait ${BUILD_PID:-}
elif has build; then build_ext; fi
if has tests4 && [ "$NGPU" -ge 4 ]; then echo "== 4-GPU NCCL tests $(el)" >> $LOG
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 -m gpu \
    tests/test_sdp4bit_dist.py tests/test_gpu.py -k nccl > $X/nccl4_tests.txt 2>&1
  grep -E "passed|failed|^FAILED|^ERROR" $X/nccl4_tests.txt | cut -c1-300 | tail -20 >> $LOG
fi
if has tableb; then
  ( # timing lane, GPUs 0,1; then the compute-only reference on GPU 0
    build_ext
    for link in nvlink pcie sockets; do
      case $link in nvlink) E=("${NV[@]}");; pcie) E=("${PCIE[@]}");; sockets) E=("${SOCK[@]}");; esac
      launch b_${link}_plain 0,1 1 29500 "${E[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING
      launch b_${link}_qw 0,1 1 29500 "${E[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING $QW
      launch b_${link}_qg 0,1 1 29500 "${E[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING $QG
      launch b_${link}_both 0,1 1 29500 "${E[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING $QW $QG
    done
    launch b_ref_1gpu 0 1 29500 -- $M1 $STDLIB --use-distributed-optimizer --global-batch-size 8 $TIMING
  ) &
  A=$!
  if [ "$NGPU" -ge 4 ]; then ( # lane B, GPUs 2,3: GPU tests, kernel benchmarks, then the loss runs (NVLink, 100 steps)
    if has tests; then echo "== GPU tests on 2 GPUs $(el)" >> $LOG
      CUDA_VISIBLE_DEVICES=2,3 timeout ${TEST_TMO:-200} python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short \
        --timeout ${PER_TEST_TMO:-60} ${GPU_TESTS:-tests/} > $X/gputests.txt 2>&1
      grep -E "passed|failed|FAILED|^ERROR" $X/gputests.txt | cut -c1-300 | tail -40 >> $LOG
    fi
    has sdpbench && bench sdpbench sdp4bit_bench.py 2
    L="--train-iters 100 --log-interval 10 --eval-interval 100 --eval-iters 3"
    launch l_plain 2,3 1 29600 -- $M1 $STDLIB $ZERO --ranks-per-node 1 $L
    launch l_both 2,3 1 29600 -- $M1 $STDLIB $ZERO --ranks-per-node 1 $L $QW $QG
    launch l_qg 2,3 1 29600 -- $M1 $STDLIB $ZERO --ranks-per-node 1 $L $QG
    launch l_qw 2,3 1 29600 -- $M1 $STDLIB $ZERO --ranks-per-node 1 $L $QW
    has optbench && bench optbench optimizer_bench.py 3
    has fp8bench && bench fp8bench fp8_bench.py 3 ${FP8_ARGS:-}
  ) & fi
  wait
fi

SITE=/tmp/code/sitepackages
if has corpus; then (
  echo "== corpus $(el)" >> $LOG; mkdir -p /tmp/code
  timeout 240 python3 tools/preprocess_data.py --input $(python3 -c "import site; print(site.getsitepackages()[0])") \
    --input-format text-files --input-suffix .py --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/tokenizer.model \
    --append-eod --output-prefix $SITE --workers 24 --no-progress-bar --skip-bad-lines 2>&1 | tail -3 >> $LOG
  echo "-- corpus done $(el)" >> $LOG ) &
  CORPUS_PID=$!
fi
ALL=$(seq -s, 0 $((NGPU - 1)))   # every GPU: TP=2 x DP=2 on four, TP=2 on two
if has tp && [ "$NGPU" -ge 2 ]; then
  T="$M1 $STDLIB $ZERO --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 16000 $TIMING"
  launch tp_bf16 $ALL 1 29800 -- $T
  launch tp_coat_fp8states $ALL 1 29800 -- $T $FP8S
  has tp_tensorwise && launch tp_tensorwise $ALL 1 29800 -- $T --fp8-format hybrid --fp8-recipe tensorwise
fi
if has tpdiag && [ "$NGPU" -ge 2 ]; then  # TP=2 peak memory: compiled vs eager, ZeRO vs not, micro-batch 1
  D="$M1 $STDLIB --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 16000 --micro-batch-size 1 --global-batch-size 4 --train-iters 6 --log-interval 2 --eval-interval 0 --eval-iters 0"
  launch tpd_compiled_zero 0,1 1 29800 -- $D $ZERO
  launch tpd_eager_zero 0,1 1 29800 -- $D $ZERO --no-torch-compile
  launch tpd_compiled_plain 0,1 1 29800 -- $D
  launch tpd_compiled_zero_coat_fp8states 0,1 1 29800 -- $D $ZERO $FP8S
fi
if has tpbisect && [ "$NGPU" -ge 2 ]; then
  # snap NAME GPUS -- flags: one forward/backward, full gradients into /tmp/snaps/NAME.safetensors
  snap() { local name=$1 gpus=$2; shift 3; late $name && return; echo "== snap $name $* $(el)" >> $LOG
    CUDA_VISIBLE_DEVICES=$gpus timeout $TMO torchrun --nproc-per-node $(( (${#gpus} + 1) / 2 )) --master-port 29810 \
      benchmarks/grad_snapshot.py "$@" --out /tmp/snaps/$name.safetensors > /tmp/logs/snap_$name.txt 2>&1
    grep -hE "grad_snapshot|rror" /tmp/logs/snap_$name.txt | tail -3 | cut -c1-400 >> $LOG; }
  B="$M1 $STDLIB --num-layers ${BISECT_LAYERS:-4} --micro-batch-size 1 --global-batch-size 1 --make-vocab-size-divisible-by 16000 --train-iters 2 --eval-interval 0 --eval-iters 0"
  TP2="--tensor-model-parallel-size 2"; mkdir -p /tmp/snaps
  snap tp1_eager 0 -- $B --no-torch-compile
  if ! has tpcompile && ! has tpverify; then  # the first bisection: which TP=2 path departs from TP=1
    snap tp2_eager 0,1 -- $B $TP2 --sequence-parallel --no-torch-compile
    snap tp2_compiled 0,1 -- $B $TP2 --sequence-parallel --torch-compile
    snap tp2_eager_nofusion 0,1 -- $B $TP2 --sequence-parallel --no-torch-compile --no-gradient-accumulation-fusion
    snap tp2_eager_nosp 0,1 -- $B $TP2 --no-torch-compile
    snap tp2_eager_zero 0,1 -- $B $TP2 --sequence-parallel --no-torch-compile $ZERO
    snap tp1_compiled_mb4 0 -- $B --torch-compile --micro-batch-size 4 --global-batch-size 4
    snap tp2_compiled_mb4 0,1 -- $B $TP2 --sequence-parallel --torch-compile --micro-batch-size 4 --global-batch-size 4
  fi
  if has tpcompile; then  # which compiled path loses the layer gradients: TP=1, TP=2 without fusion, the graphs
    snap tp1_compiled 0 -- $B --torch-compile
    snap tp2_compiled_nofusion 0,1 -- $B $TP2 --sequence-parallel --torch-compile --no-gradient-accumulation-fusion
    snap tp2_compiled_nosp 0,1 -- $B $TP2 --torch-compile
    TORCH_LOGS=aot_graphs,output_code snap tp2_compiled_graphs 0,1 -- $B $TP2 --sequence-parallel --torch-compile --num-layers 1
    cp /tmp/logs/snap_tp2_compiled_graphs.txt $X/
  fi
  if has tpverify; then  # after the fix
    snap tp2_compiled_fixed 0,1 -- $B $TP2 --sequence-parallel --torch-compile
    snap tp2_compiled_zero_fixed 0,1 -- $B $TP2 --sequence-parallel --torch-compile $ZERO
    snap tp2_compiled_mb4_fixed 0,1 -- $B $TP2 --sequence-parallel --torch-compile --micro-batch-size 4 --global-batch-size 4
  fi
  # Every snapshot of the reference's batch against TP=1 eager (micro-batch 4 ones only report their peak).
  for f in /tmp/snaps/*.safetensors; do
    [ -f "$f" ] || continue; r=$(basename $f .safetensors)
    [[ $r == tp1_eager || $r == *mb4* || $r == *graphs* ]] && continue
    echo "-- $r vs tp1_eager" >> $LOG
    python3 benchmarks/grad_snapshot.py --compare $f /tmp/snaps/tp1_eager.safetensors --top 8 >> $LOG 2>&1
  done
  if has tpverify && ! late nccltests; then echo "== NCCL tests $(el)" >> $LOG
    timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --timeout 120 tests/test_gpu.py -k nccl > $X/nccl_tests.txt 2>&1
    grep -E "PASSED|FAILED|passed|failed|skipped|^E " $X/nccl_tests.txt | cut -c1-300 | tail -20 >> $LOG
  fi
  if ! has tpcompile && ! has tpverify && ! late tpmem; then echo "== TP=2 micro-batch 4 memory peak $(el)" >> $LOG
    CUDA_VISIBLE_DEVICES=0,1 timeout $TMO torchrun --nproc-per-node 2 --master-port 29811 benchmarks/memory_peak.py \
      $B $TP2 --sequence-parallel --torch-compile --micro-batch-size 4 --global-batch-size 4 --train-iters 4 --record-steps 1 \
      --out $X/tp2_mb4_memory.txt > /tmp/logs/tp2_mb4_memory.txt 2>&1
    grep -vE "Warning|warn|^ *$" /tmp/logs/tp2_mb4_memory.txt | tail -32 | cut -c1-300 >> $LOG
  fi
fi
wait ${CORPUS_PID:-}
if has twonode && [ "$NGPU" -ge 4 ]; then
  M2="$M1 $STDLIB $ZERO --global-batch-size 32 $TIMING"
  launch t_plain 0,1,2,3 2 29700 "${INTER[@]}" -- $M2
  launch t_sdp4bit 0,1,2,3 2 29700 "${INTER[@]}" -- $M2 $QW $QG
  has t_nvlink && launch t_plain_nvlink 0,1,2,3 1 29700 -- $M2
fi
if has conv && [ "$NGPU" -ge 2 ]; then  # four GPUs: 2 nodes x 2; two GPUs: 2 one-GPU nodes (one 4-bit level)
  [ -f $SITE"_text_document.bin" ] && CD="--data-path ${SITE}_text_document" || CD="--data-path $DATA/stdlib_text_document"
  echo "-- conv corpus: $CD" >> $LOG   # the small default corpus overfits in 2000 steps: say which one ran
  C="--global-batch-size 32 --attention-dropout 0 --hidden-dropout 0 --bf16 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --train-iters 2000 --log-interval 50 --eval-interval 500 --eval-iters 20 $SMALL --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/tokenizer.model $CD $ZERO --ranks-per-node $((NGPU / 2))"
  [[ " ${CONV_RUNS:-plain sdp4bit} " == *" plain "* ]] && TMO=${CONV_TMO:-200} launch c_plain $ALL 1 29900 -- $C
  [[ " ${CONV_RUNS:-plain sdp4bit} " == *" sdp4bit "* ]] && TMO=${CONV_TMO:-200} launch c_sdp4bit $ALL 1 29900 -- $C $QW $QG
  [[ " ${CONV_RUNS:-plain sdp4bit} " == *" sdp4bit_1node "* ]] && TMO=${CONV_TMO:-200} launch c_sdp4bit_1node $ALL 1 29900 -- $C $QW $QG --ranks-per-node $NGPU
fi
if has buckets; then  # Table B sockets, both quantized: smaller buckets leave less communication exposed
  launch b_sockets_plain 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING
  launch b_sockets_both 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING $QW $QG
  for b in ${BUCKETS:-20000000 10000000}; do
    launch b_sockets_both_bucket$b 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $TIMING $QW $QG --ddp-bucket-size $b
  done
fi
if has hiprio; then  # do high-priority DP streams let the socket transfers overlap compute better?
  S="--train-iters ${SOCK_ITERS:-20} --log-interval 4 --eval-interval 0 --eval-iters 0"
  HP="--high-priority-stream-groups dp"; HB="--ddp-bucket-size ${HP_BUCKET:-10000000}"
  # most informative first (a budget cut drops the last): does it help the quantized run, then the ratio
  launch h_sockets_both 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $S $QW $QG $HB
  launch h_sockets_both_hp 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $S $QW $QG $HB $HP
  launch h_sockets_plain_hp 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $S $HP
  launch h_sockets_plain 0,1 1 29500 "${SOCK[@]}" -- $M1 $STDLIB $ZERO --ranks-per-node 1 $S
fi
if has loss200 && [ "$NGPU" -ge 4 ]; then
  [ -f $SITE"_text_document.bin" ] && CD="--data-path ${SITE}_text_document" || CD="$STDLIB"
  echo "-- loss200 corpus: $CD" >> $LOG
  L="$M1 --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/tokenizer.model $CD $ZERO --ranks-per-node 2 --global-batch-size 32 --train-iters 200 --log-interval 20 --eval-interval 200 --eval-iters 5"
  launch l200_plain 0,1,2,3 1 29950 -- $L
  launch l200_sdp4bit 0,1,2,3 1 29950 -- $L $QW $QG
fi
wait ${RETEST_PID:-}
echo "== done $(el)" >> $LOG
python3 benchmarks/multi_gpu_report.py $R > $OUT/report.md 2>&1; cat $OUT/report.md >> $LOG
cp /tmp/logs/*.txt $X/ 2>/dev/null; tar czf $OUT/details.tgz -C $X . && rm -rf $X
[ -d "$TORCH_EXTENSIONS_DIR" ] && tar czf $OUT/ext.tgz -C "$TORCH_EXTENSIONS_DIR" .
