#!/bin/bash
# GPU tests and benchmarks on one H200, in stages (STAGES=a,b,...), within a time budget (BUDGET seconds):
#   build     compile the optional CUDA extensions (fused AdamW, SDP4Bit encode, FP8 wgrad; in parallel) once, before anything uses them
#   gputests  every test marked gpu (kernels vs references, bit-exact where meaningful)
#   wgrad     the fused weight-gradient GEMM (fp32 epilogue) vs mm + add
#   optncu    Nsight Compute sections of the fused AdamW kernel, one launch per NCU_CASES entry (case:variant; after build)
#   fp8bench / sdpbench / optbench / refreshbench / cebench / ropebench   the COAT FP8, SDP4Bit, FP8-optimizer, FP8 weight-refresh, fused cross-entropy and fused RoPE benchmarks (JSON; FP8_ARGS, OPT_ARGS, CE_ARGS, ROPE_ARGS)
#   big / small / eager / mem / profile / before   bf16 substrate vs the plain-PyTorch peer
#   prof      1.36B steps profiled (PROF_RUNS: bf16 and/or FP8 recipes; PROFILE_ARGS, PROFILE_STEPS), whole tables
#   profile_fp8   the 1.36B FP8 step profiled (PROFILE_RECIPE, default tensorwise): kernels, GPU busy vs wall
#   coat1 / coat7   1.36B and 7B: bf16 vs tensorwise vs coat, torchao float8 peer (coat1's runs: C1_RUNS, their names suffixed with C1_TAG;
#                   bf16_cudagraphs / coat_cudagraphs: with TORCHINDUCTOR_CUDAGRAPHS=1, coat_castperuse: --fp8-weight-cache none,
#                   bf16_eagerce / coat_eagerce: --no-cross-entropy-loss-fusion, coat_heuristic: --fp8-gemm-candidates 1,
#                   only when named); coat7 also
#             coat + FP8 optimizer states and larger micro-batches (C7_MBS, default 4) for bf16 and coat
#   states125 ~125M model, 1000 steps on the default corpus: fp32 vs fp8 optimizer states with and without
#             expansion, final training and validation loss
#   gradmem   7B micro-batch 1: fp32 vs bf16 gradient buffers (the bytes/param bf16 gradients save)
#   states    1.36B: fp32 vs fp8 optimizer states
#   snaps     one step's full gradients (benchmarks/grad_snapshot.py, 1.36B shape, 2 layers): TP=1 compiled vs
#             eager, and TP=2 as two processes on this one GPU over gloo, compiled and eager
# Training runs log every LOG_INTERVAL iterations (default 5). Each log line syncs the host with the GPU, and the step
# after a sync starts with an empty queue: where a forward's host time exceeds its GPU time (coat at 1.36B), that
# step loses a few ms. Megatron's runs log every 10-100 iterations.
# Runs from a clean export of a commit (SRC, default .), writes under $OUT.
# Usage: SRC=.snap STAGES=... bash scripts/gpu_evidence.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache   # later runs of the same shapes reuse compiled graphs
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; J=$OUT/results.jsonl
SRC=${SRC:-.}; HERE=$PWD; cd "$SRC"; export PYTHONPATH=$PWD
export TORCH_EXTENSIONS_DIR=$HERE/.ext   # an .ext kept from an earlier run (see stage build) skips the 75 s build
STAGES=${STAGES:-wgrad,small,big,mem,profile,eager}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
LOG=$OUT/log.txt
T0=$(date +%s); el() { echo "(t=$(( $(date +%s) - T0 )) s)"; }
BUDGET=${BUDGET:-560}  # seconds: stages that would start later are skipped (bounds the run's wall time)
late() { if [ $(( $(date +%s) - T0 )) -gt $BUDGET ]; then echo "-- skipped $1 (budget)" | tee -a $LOG; return 0; fi; return 1; }
M1="--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --micro-batch-size 4 --global-batch-size 4"
M7="--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --micro-batch-size 2 --global-batch-size 2"
C="--seq-length 2048 --max-position-embeddings 2048 --mock-data --vocab-size 32000 --attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 5 --eval-interval 0 --eval-iters 0 --untie-embeddings-and-output-weights --bf16"
mc() { name=$1; iters=$2; shift 2; late $name && return; echo "== megacoat $name $(el)" | tee -a $LOG
  # SMI=1: sample the SM clock and power while it runs (is a busier FP8 step slowed by the power limit?)
  [ "${SMI:-0}" = 1 ] && { nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits -lms 100 > /tmp/smi_$name.csv & smi=$!; }
  timeout ${TMO:-200} python3 ${MC_LAUNCH:-pretrain_gpt.py} $C "$@" --train-iters $iters --log-interval ${LOG_INTERVAL:-5} --log-json /tmp/$name.jsonl 2>&1 \
    | grep -E "iteration +$iters/|rror|bytes/param|Traceback|memory|skipping cudagraphs|weight-cache" | cut -c1-600 | tee -a $LOG
  if [ "${SMI:-0}" = 1 ]; then kill $smi; python3 -c "
import statistics as st
rows = [[float(v) for v in l.split(',')] for l in open('/tmp/smi_$name.csv') if l.count(',') == 2 and 'N/A' not in l]
busy = [r for r in rows if r[2] >= 90]
if busy: print(f'   while >= 90% busy ({len(busy)} samples): SM clock median {st.median(r[0] for r in busy):.0f} MHz (min {min(r[0] for r in busy):.0f}), power median {st.median(r[1] for r in busy):.0f} W (max {max(r[1] for r in busy):.0f})')" 2>&1 | tee -a $LOG; fi
  python3 -c "
import json
rs = [json.loads(l) for l in open('/tmp/$name.jsonl')]
r = rs[-1]; r['run'] = 'megacoat $name'
warm = [x['tokens_per_s'] for x in rs if x.get('iteration', 0) > 10 and 'tokens_per_s' in x]  # after compilation
if warm: r['tokens_per_s_mean_after_10'] = sum(warm) / len(warm); print('   mean tokens/s after iteration 10:', round(r['tokens_per_s_mean_after_10']))
open('$J', 'a').write(json.dumps(r) + '\\n')" 2>/dev/null | tee -a $LOG; }
peer() { name=$1; shift; late $name && return; echo "== peer $name $(el)" | tee -a $LOG
  timeout ${TMO:-200} python3 benchmarks/peer_plain_llama.py "$@" --json /tmp/p.jsonl 2>&1 | tail -1 | tee -a $LOG
  tail -1 /tmp/p.jsonl | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['run']='peer $name'; print(json.dumps(r))" >> $J 2>/dev/null; }
setup_torchao() {  # the newest torchao wheel under .whl/ whose float8 imports with this torch, into /tmp/site (once)
  [ -f /tmp/site/.ok ] && return 0
  for v in 0.17.0 0.16.0; do
    [ -d "$HERE/.whl/torchao$v" ] || continue
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $HERE/.whl/torchao$v/*.whl 2>&1 | tail -1
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -c "import torchao.float8" 2>/dev/null && { echo "torchao $v" | tee -a $LOG; touch /tmp/site/.ok; return 0; }
    rm -rf /tmp/site
  done
  return 1; }
{ date -u; cat COMMIT 2>/dev/null; git -C "$HERE" log -1 --oneline 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee $LOG
# Kept builds (.ext) whose sources changed are removed first. Exports get an old fixed mtime (so that an
# unchanged source is not rebuilt in every new export), and then ninja alone would keep a stale build of a
# changed one: torch's source hash only bumps the version inside one process (a later run would load
# the stale extension). The stamp is the sources' sha256, written after each build.
src_sum=$(cat csrc/* | sha256sum | cut -c1-64)   # one stamp for all three: they share headers
for ext in fused_adamw fp8_gemm sdp4bit; do
  d="$TORCH_EXTENSIONS_DIR/megacoat_$ext"
  if [ -d "$d" ] && [ "$(cat "$d/.megacoat_src_sha" 2>/dev/null)" != "$src_sum" ]; then
    echo "-- $ext: kept build is of other sources, rebuilding" | tee -a $LOG; rm -rf "$d"; fi
done
stamp_builds() { for ext in fused_adamw fp8_gemm sdp4bit; do
  d="$TORCH_EXTENSIONS_DIR/megacoat_$ext"; [ -d "$d" ] && echo "$src_sum" > "$d/.megacoat_src_sha"; done; }
if has build; then echo "== build CUDA extensions $(el)" | tee -a $LOG
  MEGACOAT_VERBOSE_BUILD=0 timeout 300 python3 -c "from megacoat.optim.fp8_adam import fused_extension as f; print('fused adamw extension built:', f() is not None)" 2>&1 | tail -5 | tee -a $LOG &
  pid=$!
  MEGACOAT_VERBOSE_BUILD=0 timeout 300 python3 -c "from megacoat.kernels.fp8_gemm import cuda_extension as f; print('fp8 gemm extension built:', f() is not None)" 2>&1 | tail -5 | tee -a $LOG &
  pid2=$!
  MEGACOAT_VERBOSE_BUILD=0 timeout 300 python3 -c "from megacoat.kernels.sdp4bit import cuda_extension as f; print('sdp4bit encode extension built:', f() is not None)" 2>&1 | tail -5 | tee -a $LOG
  wait $pid $pid2
  stamp_builds
  tar -C "$HERE" -czf "$OUT/ext.tgz" .ext   # the builds as one archive: unpacked as .ext, a later run skips the build
fi
if has snaps && ! late snaps; then echo "== gradient snapshots $(el)" | tee -a $LOG
  S="$C --num-layers 2 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --micro-batch-size 1 --global-batch-size 1 --train-iters 2"
  for v in "tp1_eager 1 --no-torch-compile" "tp1_compiled 1 --torch-compile" \
           "tp2gloo_eager 2 --no-torch-compile --tensor-model-parallel-size 2 --sequence-parallel --distributed-backend gloo" \
           "tp2gloo_compiled 2 --torch-compile --tensor-model-parallel-size 2 --sequence-parallel --distributed-backend gloo"; do
    set -- $v; name=$1; n=$2; shift 2
    timeout 150 torchrun --nproc-per-node $n --master-port 29830 benchmarks/grad_snapshot.py $S "$@" --out /tmp/$name.safetensors > /tmp/snap_$name.txt 2>&1
    grep -hE "grad_snapshot|Error" /tmp/snap_$name.txt | tail -2 | cut -c1-300 | tee -a $LOG
  done
  for name in tp1_compiled tp2gloo_eager tp2gloo_compiled; do
    [ -f /tmp/$name.safetensors ] && python3 benchmarks/grad_snapshot.py --compare /tmp/$name.safetensors /tmp/tp1_eager.safetensors --top 5 2>&1 | tee -a $LOG
  done
fi
if has gputests && ! late gputests; then echo "== GPU tests $(el)" | tee -a $LOG
  # -v: one line per test as it finishes, so a stage cut by TEST_TMO still names what passed and what failed (a cut -q
  # run shows only bare F's). Compiled tests can take over a minute on a cold Inductor cache: PER_TEST_TMO 150.
  timeout ${TEST_TMO:-240} python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --timeout ${PER_TEST_TMO:-150} -k "not nccl" ${GPU_TESTS:-tests/} > $OUT/gputests.txt 2>&1
  grep -E "^=.*(passed|failed)|^FAILED|^ERROR" $OUT/gputests.txt | cut -c1-300 | tail -60 | tee -a $LOG
fi
for b in fp8bench:fp8_bench.py sdpbench:sdp4bit_bench.py optbench:optimizer_bench.py refreshbench:weight_refresh_bench.py cebench:cross_entropy_bench.py ropebench:rope_bench.py; do
  st=${b%%:*}; f=${b##*:}
  if has $st && ! late $st && [ -f benchmarks/$f ]; then echo "== $f $(el)" | tee -a $LOG
    extra=""; [ $st = fp8bench ] && extra="${FP8_ARGS:-}"; [ $st = optbench ] && extra="${OPT_ARGS:-}"; [ $st = cebench ] && extra="${CE_ARGS:-}"
    [ $st = ropebench ] && extra="${ROPE_ARGS:-}"
    timeout ${BENCH_TMO:-170} python3 benchmarks/$f --out $OUT/${st}.json $extra 2>&1 | grep -v Warning | tail -30 | tee -a $LOG
  fi
done
if has optncu && ! late optncu; then  # Nsight Compute on the fused AdamW kernel: one launch per NCU_CASES entry (case:variant)
  command -v ncu >/dev/null || echo "-- optncu: no ncu on PATH" | tee -a $LOG
  for cv in $(command -v ncu >/dev/null && echo ${NCU_CASES:-fp8_expand_fp32grad:0 fp8_expand_fp32grad:4}); do
    echo "== ncu $cv $(el)" | tee -a $LOG
    timeout ${BENCH_TMO:-170} ncu --clock-control none --kernel-name regex:adamw_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 benchmarks/optimizer_bench.py --out /tmp/unused.json --step-only $cv 2>&1 | grep -v "^==PROF==" \
      > $OUT/ncu_${cv/:/_v}.txt; tail -60 $OUT/ncu_${cv/:/_v}.txt | tee -a $LOG
  done
fi
if has wgrad; then echo "== fused wgrad GEMM check $(el)" | tee -a $LOG
python3 - <<'PY' 2>&1 | tee -a $LOG
import torch, time
from megacoat.kernels.wgrad import wgrad_accumulate, wgrad_accumulate_reference, _FusedSupport
wgrad_accumulate_ = lambda m, g, x, flag: wgrad_accumulate(m, g, x, flag, g.dtype)
for (n, o, i) in [(8192, 2048, 5632), (8192, 11264, 2048), (4096, 4096, 11008)]:
    g = torch.randn(n, o, device="cuda", dtype=torch.bfloat16); x = torch.randn(n, i, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(o, i, device="cuda")
    a = base.clone(); wgrad_accumulate_(a, g, x, torch.tensor([False])); b = base.clone(); wgrad_accumulate_reference(b, g, x, False)
    exact = base.double() + g.double().t() @ x.double()
    def t(fn):
        f = (lambda m: fn(m, g, x, torch.tensor([False]))) if fn is wgrad_accumulate_ else (lambda m: fn(m, g, x, False))
        m = base.clone(); f(m); torch.cuda.synchronize(); s = time.perf_counter()
        for _ in range(20): f(m)
        torch.cuda.synchronize(); return (time.perf_counter() - s) / 20 * 1e3
    print(f"wgrad {n}x{o}x{i}: fused supported={_FusedSupport.ok} err fused {(a.double()-exact).abs().max().item():.3e} "
          f"reference {(b.double()-exact).abs().max().item():.3e} | ms fused {t(wgrad_accumulate_):.3f} reference(mm+add) {t(wgrad_accumulate_reference):.3f} "
          f"| TFLOP/s fused {2*n*o*i/t(wgrad_accumulate_)/1e9:.0f}")
PY
fi
if has mem && ! late mem; then echo "== memory breakdown 7B $(el)" | tee -a $LOG
  timeout 200 python3 benchmarks/memory_peak.py $C $M7 --train-iters 5 --record-steps 1 --out $OUT/memory_7b.txt 2>&1 | grep -v "^  [a-z_0-9]* \.\." | tail -30 | tee -a $LOG
fi
if has small; then
  mc b1_compiled 20 $M1
  peer p1_compiled --compile --iters 10 --warmup 8
  [ "${SKIP_BF16GRAD1:-0}" = 1 ] || mc b1_bf16grad 20 $M1 --grad-reduce-in-bf16
fi
if has big; then
  mc b7_compiled 12 $M7
  [ "${SKIP_PEER7:-0}" = 1 ] || peer p7_compiled --hidden 4096 --layers 32 --heads 32 --ffn 11008 --mbs 2 --compile --iters 6 --warmup 5
  [ "${SKIP_BF16GRAD7:-0}" = 1 ] || mc b7_bf16grad 12 $M7 --grad-reduce-in-bf16
fi
if has eager; then
  mc b1_eager 15 $M1 --no-torch-compile
  peer p1_eager --iters 8 --warmup 4
fi
c1() { [[ " ${C1_RUNS:-bf16 tensorwise coat bf16_gbs32 tensorwise_gbs32 coat_gbs32 torchao coat_fp8states} " == *" $1 "* ]]; }
if has coat1; then
  c1 bf16 && mc c1_bf16${C1_TAG:-} ${C1_ITERS:-20} $M1
  c1 tensorwise && mc c1_tensorwise${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe tensorwise
  c1 coat && mc c1_coat${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe coat
  # without the fused RoPE kernels (--no-rope-fusion; on by default on CUDA; only when named)
  c1 bf16_norope && mc c1_bf16_norope${C1_TAG:-} ${C1_ITERS:-20} $M1 --no-rope-fusion
  c1 coat_norope && mc c1_coat_norope${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe coat --no-rope-fusion
  # Inductor's combo kernels (independent small kernels of a graph launched as one; only when named)
  c1 coat_combo && MC_LAUNCH="benchmarks/run_with_inductor_config.py combo_kernels=True -- " mc c1_coat_combo${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe coat
  c1 coat_heuristic && mc c1_coat_heuristic${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe coat --fp8-gemm-candidates 1
  # The loss through torch operations on an fp32 copy of the logits instead of the fused kernels (only when named)
  c1 bf16_eagerce && mc c1_bf16_eagerce${C1_TAG:-} ${C1_ITERS:-20} $M1 --no-cross-entropy-loss-fusion
  c1 coat_eagerce && mc c1_coat_eagerce${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe coat --no-cross-entropy-loss-fusion
  # FP8 weights cast at each use instead of kept for the step (only when named)
  c1 coat_castperuse && mc c1_coat_castperuse${C1_TAG:-} ${C1_ITERS:-20} $M1 --fp8-format hybrid --fp8-recipe coat --fp8-weight-cache none
  c1 coat_fp8states && mc c1_coat_fp8states${C1_TAG:-} 20 $M1 --fp8-format hybrid --fp8-recipe coat --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8
  # Inductor's CUDA graphs for the compiled layers (an experiment: is the step host-bound?)
  c1 bf16_cudagraphs && TORCHINDUCTOR_CUDAGRAPHS=1 mc c1_bf16_cudagraphs${C1_TAG:-} 20 $M1
  c1 coat_cudagraphs && TORCHINDUCTOR_CUDAGRAPHS=1 mc c1_coat_cudagraphs${C1_TAG:-} 20 $M1 --fp8-format hybrid --fp8-recipe coat
  c1 bf16_gbs32 && mc c1_bf16_gbs32${C1_TAG:-} ${GBS32_ITERS:-8} $M1 --global-batch-size 32
  c1 tensorwise_gbs32 && mc c1_tensorwise_gbs32${C1_TAG:-} ${GBS32_ITERS:-8} $M1 --fp8-format hybrid --fp8-recipe tensorwise --global-batch-size 32
  c1 coat_gbs32 && mc c1_coat_gbs32${C1_TAG:-} ${GBS32_ITERS:-8} $M1 --fp8-format hybrid --fp8-recipe coat --global-batch-size 32
  c1 torchao && setup_torchao && PYTHONPATH=$PYTHONPATH:/tmp/site peer p1_torchao_tensorwise${C1_TAG:-} --compile --float8 tensorwise --iters 10 --warmup 8
fi
if has coat7; then  # 7B: bf16 vs coat (C7_RUNS: base = both at micro-batch 2, castperuse, fp8states, torchao, cachestep), then larger
  # micro-batches (C7_BF16_MBS / C7_COAT_MBS, default C7_MBS=4) to find the largest each fits
  c7() { [[ " ${C7_RUNS:-base fp8states torchao} " == *" $1 "* ]]; }
  if c7 base; then mc c7_bf16 10 $M7; mc c7_coat 10 $M7 --fp8-format hybrid --fp8-recipe coat; fi
  # FP8 weights cast at each use instead of kept for the step (at 7B the kept copies are 1.92 bytes/param)
  if c7 castperuse; then mc c7_coat_castperuse 10 $M7 --fp8-format hybrid --fp8-recipe coat --fp8-weight-cache none; fi
  if c7 fp8states; then
    mc c7_coat_fp8states 10 $M7 --fp8-format hybrid --fp8-recipe coat --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8
  fi
  for mb in ${C7_BF16_MBS:-${C7_MBS:-4}}; do mc c7_bf16_mbs$mb 6 $M7 --micro-batch-size $mb --global-batch-size $mb; done
  for mb in ${C7_COAT_MBS:-${C7_MBS:-4}}; do
    mc c7_coat_mbs$mb 6 $M7 --fp8-format hybrid --fp8-recipe coat --micro-batch-size $mb --global-batch-size $mb
    # the FP8 weight copies kept whatever the memory (auto drops them where the estimated peak would not fit)
    c7 cachestep && mc c7_coat_step_mbs$mb 6 $M7 --fp8-format hybrid --fp8-recipe coat --micro-batch-size $mb \
      --global-batch-size $mb --fp8-weight-cache step
  done
  if c7 torchao; then setup_torchao && PYTHONPATH=$PYTHONPATH:/tmp/site peer p7_torchao_tensorwise --hidden 4096 --layers 32 \
    --heads 32 --ffn 11008 --mbs 2 --compile --float8 tensorwise --iters 6 --warmup 5; fi
fi
if has gradmem; then
  mc g7_mbs1_fp32grad 8 $M7 --micro-batch-size 1 --global-batch-size 1
  mc g7_mbs1_bf16grad 8 $M7 --micro-batch-size 1 --global-batch-size 1 --grad-reduce-in-bf16
fi
if has states125; then
  S125="--num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8 --bf16 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --train-iters ${S125_ITERS:-1000} --log-interval 100 --eval-interval ${S125_ITERS:-1000} --eval-iters 20 --data-path .data/stdlib_text_document --tokenizer-type SentencePieceTokenizer --tokenizer-model .data/tokenizer.model"
  F8="--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
  for v in "s125_fp32states" "s125_fp8states $F8" "s125_fp8states_noexpansion $F8 --no-optimizer-state-expansion"; do
    set -- $v; name=$1; shift; late $name && continue; echo "== $name $(el)" | tee -a $LOG
    timeout ${TMO:-200} python3 pretrain_gpt.py $S125 "$@" --log-json /tmp/$name.jsonl 2>&1 | grep -E "iteration +(500|1000)/|validation|rror|Traceback" | cut -c1-400 | tee -a $LOG
    cp /tmp/$name.jsonl $OUT/ 2>/dev/null
  done
fi
if has states; then
  mc s1_fp8states 20 $M1 --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8
fi
if has profile && ! late profile; then echo "== profile 1.36B compiled $(el)" | tee -a $LOG
  timeout 150 python3 benchmarks/profile_step.py $C $M1 --train-iters 20 --log-interval 100 --profile-steps 3 2>&1 | grep -v '^  [a-z_0-9]* \.\.' | tail -40 > $OUT/profile_1b.txt
fi
if has profile_fp8 && ! late profile_fp8; then echo "== profile 1.36B compiled FP8 ${PROFILE_RECIPE:-tensorwise} $(el)" | tee -a $LOG
  timeout 150 python3 benchmarks/profile_step.py $C $M1 --fp8-format hybrid --fp8-recipe ${PROFILE_RECIPE:-tensorwise} --train-iters 20 \
    --log-interval 100 --profile-steps 3 2>&1 | grep -v '^  [a-z_0-9]* \.\.' | tail -40 > $OUT/profile_1b_fp8.txt
  tail -2 $OUT/profile_1b_fp8.txt | tee -a $LOG
fi
if has prof; then  # PROF_RUNS (bf16 and/or FP8 recipes) profiled at 1.36B with PROFILE_ARGS (e.g. --global-batch-size 32)
  for v in ${PROF_RUNS:-bf16 coat}; do
    late prof_$v && continue; echo "== profile 1.36B $v ${PROFILE_ARGS:-} $(el)" | tee -a $LOG
    extra=""; [ $v != bf16 ] && extra="--fp8-format hybrid --fp8-recipe $v"
    timeout 150 python3 benchmarks/profile_step.py $C $M1 $extra ${PROFILE_ARGS:-} --train-iters ${PROF_ITERS:-20} --log-interval 100 \
      --profile-steps ${PROFILE_STEPS:-3} 2>&1 | grep -v "^  [a-z_0-9]* \.\." | grep -v "^ *$" > $OUT/prof_$v${C1_TAG:-}.txt
    grep -E -A3 "^per step|^guard A/B|^phase times|^marks where|Error" $OUT/prof_$v${C1_TAG:-}.txt | cut -c1-300 | tee -a $LOG
  done
fi
if has before && ! late before && [ -d "$HERE/.before" ]; then echo "== BEFORE (previous commit) memory breakdown 7B $(el)" | tee -a $LOG
  cp benchmarks/memory_peak.py "$HERE/.before/benchmarks/"; cd "$HERE/.before"; export PYTHONPATH=$PWD
  timeout 200 python3 benchmarks/memory_peak.py $C $M7 --train-iters 5 --record-steps 1 --out $OUT/memory_7b_before.txt 2>&1 | grep -v "^  [a-z_0-9]* \.\." | tail -30 | tee -a $LOG
fi
echo "done $(el)" | tee -a $LOG
