#!/usr/bin/env bash
# One GPU-host call: build the CUDA core, run the chosen stages, leave logs and JSON under $OUT.
# Usage (from the repo root on the GPU host): bash benchmarks/gpu_run.sh core,vllm,deepspeed,...
# Stages, run in the order given: core (GPU tests of pool/swap/engine), transfer (python -m colomem.bench),
# smallbench (its small-tensor part alone), wall (its wall-clock part alone: WALL_SETS; wallprime: one set with its
# first re-growth primed; wallexp: the same with
# torch's expandable segments), diagrelease (where a
# swap's release and re-growth time goes), slab (GPU tests of small storages packed onto shared slabs),
# ipc (bridge tests), vllm (adapter tests), runner (GPU tests of the GRPO runner), deepspeed, dsstep (its tests of
# the optimizer state reloaded inside the optimizer step, and sent out behind the training for it), dsckpt, partial
# (offload(keep=...) tests), mergerounding (how the shared base's merge rounds), syncbench,
# dsbench, cudawaits (bounded CUDA waits, alone), faults1 / faults2 (the default job under faults; faults: the
# chain FAULTS_LIST names), soak
# (SOAK_S seconds of the default job), inrank / inranktest (the in-rank vLLM engine against the cross-process one: bench, GPU tests),
# coldcompile (the in-process engine's CUDA graphs through the trainer's offloads, on an empty compile cache), kvsleep (vLLM's KV-only sleep), sharedbase (GPU tests of one copy of a LoRA base shared by vLLM and the
# trainer), syncinloop (the weight sync from the pool's host views against the H2D peak),
# grpo (the default job: its 40 steps are configs/default.yaml's), grpobench, realjob / realjoblora
# (a chat dataset job with eval, checkpoints and a resume; the checkpoint loaded in transformers and vLLM), diag (where a bridge
# sync's time goes, DIAG_CONFIGS="1GiB:2 2GiB:1"), diagreload (per-cycle reload rates after a pool's
# creation), diagdecode (vLLM's rollout after sleep / wake and beside a resident trainer), diagtrain (the training
# phase alone, variant by variant: DIAGTRAIN_CONFIGS, DIAGTRAIN_ARGS; diagcompile: the same with --torch-compile). GRPOBENCH_ARGS adds arguments to grpobench and GRPOBENCH_TIMEOUT_S bounds it (grpobench2: GRPOBENCH2_*), SYNC_BUCKETS sets
# the bucket sizes of syncbench. Each stage is bounded by its own timeout. benchmarks/README.md says what
# each stage measures.
set -uo pipefail
# Everything goes to a work folder, packed into $OUT/results.tgz after every stage (the device tool
# returns at most 8 files, and a stage cut by the call's time limit must not lose the earlier ones).
RESULTS=${OUT:-/tmp/colomem-results}
OUT=/tmp/colomem-out
# A warm machine keeps /tmp between calls: start empty, or an earlier call's files are packed again. Weights
# and checkpoints never travel back (the returned files have a size limit): only logs, JSON and plots.
rm -rf "$OUT"
mkdir -p "$OUT" "$RESULTS"
pack() { tar czf "$RESULTS/results.tgz.tmp" -C "$OUT" --exclude=checkpoints --exclude='*.safetensors' \
  --exclude='*.pt' --exclude='*.bin' . && mv "$RESULTS/results.tgz.tmp" "$RESULTS/results.tgz"; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
stamp() { echo "=== [$((SECONDS - t0)) s] $*"; }
if [ -d .gpukit/p1 ]; then eval "$(bash .gpukit/p1/install.sh)" || exit 1; fi
# pure-Python packages the host lacks (datasets for --dataset jobs), carried as wheels in .whl/
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
stamp "build"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# where the CPUs sit against the GPU: a rollout's speed depends on the cores vLLM's engine process lands on
{ lscpu | grep -iE "^(model name|numa|cpu\(s\)|thread|socket)"; nvidia-smi topo -m; } > "$OUT/host_topology.txt" 2>&1
MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import colomem; print(colomem.build_info())" || exit 1
# how fast this machine is (host, kernel launches, GPU, link): machines of one kind have differed twofold, and
# only figures of one machine compare
timeout 120 python3 benchmarks/host_speed.py --out "$OUT" --label start 2> "$OUT/host_speed.log" \
  || echo "[gpu_run] host_speed failed: see host_speed.log"
# WARM_IMPORTS=1: the kit's packages imported once in the background from here on (a fresh machine compiles
# their Python files and DeepSpeed's FusedAdam: about a minute), beside the first stages, so a later bench's
# own warm-up takes seconds. Off by default: started after host_speed so it cannot slow that measurement, but
# whether an import touches the GPU (a context beside a test that reads the device's free memory) is unproven
if [ "${WARM_IMPORTS:-0}" = 1 ]; then
  python3 benchmarks/warm_imports.py > "$OUT/warm_imports_background.json" 2> "$OUT/warm_imports_background.log" &
fi
# CALL_S: the device call's own limit. A stage is cut before it (its bound shrinks to what the call has
# left, minus time to pack), so a stage that runs long loses itself, never the call's earlier results.
CALL_S=${CALL_S:-600}
gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' '; }
gpu_idle() {  # gpu_idle SECONDS: waits until no process holds the GPU; non-zero when some still does
  local until=$((SECONDS + $1))
  while [ -n "$(gpu_pids | tr -d ' ')" ]; do
    [ "$SECONDS" -ge "$until" ] && return 1
    sleep 1
  done
}
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local left=$((CALL_S - (SECONDS - t0) - 15))
  if [ "$left" -lt "$limit" ]; then
    echo "[gpu_run] $name: bound $limit s cut to $left s (the call has $CALL_S s in all)"; limit=$left
  fi
  if [ "$limit" -le 0 ]; then stamp "$name skipped: no time left in the call"; return; fi
  stamp "$name"
  # PACK_EVERY (s): pack while the stage runs too, so a call the device cuts (its own limit, unknown here
  # when the machine's start took part of the device time) still returns what the stage wrote so far
  local packer=""
  if [ "${PACK_EVERY:-0}" -gt 0 ]; then (while sleep "$PACK_EVERY"; do pack; done) & packer=$!; fi
  # its own session, so what a stage cut by its bound leaves running (vLLM's engine process, a runner in
  # its teardown) is killed with it and cannot hold GPU memory through the next stage's baselines
  # STAGE_DEADLINE_EPOCH: the stage's end, so a bench bounds its runs to finish (and write) before it
  STAGE_DEADLINE_EPOCH=$(($(date +%s) + limit)) setsid timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  local sid=$!
  wait "$sid"
  local rc=$?
  pkill -9 -s "$sid" 2>/dev/null; kill -9 -- "-$sid" 2>/dev/null
  # up to 60 s for the stage's processes to leave the GPU, never past the call's end (the pack must fit)
  local idle=$((CALL_S - (SECONDS - t0) - 10))
  [ "$idle" -gt 60 ] && idle=60
  [ "$idle" -lt 1 ] && idle=1
  gpu_idle "$idle" || echo "[gpu_run] $name: GPU processes still running $idle s after the stage: $(gpu_pids)"
  if [ -n "$packer" ]; then kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null; fi
  tail -${TAIL:-15} "$OUT/$name.log"
  stamp "$name rc=$rc"
  pack
}
stage() {  # the stages run in the order given on the command line
  case $1 in
    # tests: the GPU test files TESTS names alone (e.g. one changed kernel's), bounded by TESTS_TIMEOUT_S
    tests) run gpu_tests "${TESTS_TIMEOUT_S:-180}" python3 -m pytest -q -rs ${TESTS:?name the test files in TESTS} ;;
    core) run core_tests 120 python3 -m pytest -q -rs -m "gpu and not vllm and not deepspeed and not ipc" tests \
      --deselect tests/gpu/test_cuda_waits_gpu.py ;;
    # held streams and a copy that fails part-way: in a process of their own, each test's stack dumped when it
    # runs past 60 s (a bound that does not fire shows where it waits)
    cudawaits) run cuda_waits_tests 150 python3 -m pytest -v -s -rs -o faulthandler_timeout=60 \
      tests/gpu/test_cuda_waits_gpu.py ;;
    # FAULTS_BUDGET_S: how long each fault chain may start new runs (a run under way finishes)
    faults1) run faults_engine $((${FAULTS_BUDGET_S:-560} + 30)) python3 benchmarks/faults.py --out "$OUT/faults" \
      --faults engine_rollout,engine_sync,trainer_sync --time-budget-s "${FAULTS_BUDGET_S:-560}" --min-job-s "${FAULTS_MIN_JOB_S:-100}" ;;
    faults2) run faults_stop $((${FAULTS_BUDGET_S:-560} + 30)) python3 benchmarks/faults.py --out "$OUT/faults-stop" \
      --faults sigterm_step,sigterm_group,wake_oom --time-budget-s "${FAULTS_BUDGET_S:-560}" --min-job-s "${FAULTS_MIN_JOB_S:-100}" ;;
    faults) run faults_list $((${FAULTS_BUDGET_S:-560} + 30)) python3 benchmarks/faults.py --out "$OUT/faults-list" \
      --faults "${FAULTS_LIST:-engine_sync,trainer_sync}" --time-budget-s "${FAULTS_BUDGET_S:-560}" \
      --min-job-s "${FAULTS_MIN_JOB_S:-100}" ;;
    soak) run soak $((${SOAK_S:-240} + 90)) python3 benchmarks/soak.py --out "$OUT/soak" --steps 1000 --time-limit-s "${SOAK_S:-240}" \
      ${SOAK_HEAP:+--heap-every "$SOAK_HEAP"} ${SOAK_ARGS:-} ;;  # SOAK_ARGS="-- --offload all --rollout-sleep always": the
      # moving path; SOAK_HEAP=N: where the runner's Python heap grew, every N steps
    transfer) run bench_transfer 240 python3 -m colomem.bench --out "$OUT/transfer" ;;
    # the small-tensor set alone (per tensor, coalesced, on slabs) with the raw peaks it is measured against
    smallbench) run bench_small 150 python3 -m colomem.bench --out "$OUT/small" --only small ;;
    # each shape's offload and reload by the wall clock: the pipelined reload against growing every storage first
    wall) run bench_wall "${WALL_TIMEOUT_S:-240}" python3 -m colomem.bench --out "$OUT/wall" --only wall --sets "${WALL_SETS:-1.5b,7b,llama3-8b}" ;;
    # the same for one set, expandable memory of its size mapped and filled once before its first cycle
    wallprime) run bench_wall_primed 150 python3 -m colomem.bench --out "$OUT/wall-primed" --only wall --prime \
      --sets "${WALLPRIME_SETS:-1.5b}" ;;
    # the same with torch's expandable segments (memory mapped in physical chunks, unmapped without a device sync)
    wallexp) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run bench_wall_expandable 180 python3 -m colomem.bench \
      --out "$OUT/wall-expandable" --only wall --sets "${WALL_SETS:-1.5b,7b,llama3-8b}" ;;
    # where the release and re-growth time goes, and whether it overlaps copies (expandable segments in a child)
    diagrelease) run diag_release 120 python3 benchmarks/diag_release.py --out "$OUT/diag_release" ;;
    # small results read back by a kernel (checksums of the sync), the GPU checksum against the host's
    readback) run readback_tests 120 python3 -m pytest -q -rs tests/gpu/test_read_back_gpu.py \
      tests/gpu/test_bridge_ipc.py -k "read_back or small_read or checksum" ;;
    # whether a long copy on colomem's stream holds up short work on the process's other streams
    diagqueues) run diag_queues 240 python3 benchmarks/diag_queues.py --out "$OUT/diag_queues" ;;
    # whether the weight sync waits for the optimizer state still copying out behind it
    diagbehind) run diag_behind 300 python3 benchmarks/diag_behind.py --out "$OUT/diag_behind" ;;
    # memory filled right after another process (or this one) gave it back: the switch's handovers
    diaghandover) run diag_handover 200 python3 benchmarks/diag_handover.py --out "$OUT/diag_handover" ${DIAGHANDOVER_ARGS:-} ;;
    # how the shared base's merge rounds on this GPU: the fused GEMM and the fp32 path against the exact sum
    mergerounding) run merge_rounding 90 python3 benchmarks/diag_merge_rounding.py --out "$OUT/merge_rounding" ;;
    slab) run swap_slab_tests 120 python3 -m pytest -q -rs tests/gpu/test_swap_slab_gpu.py ;;
    ipc) run ipc_tests 100 python3 -m pytest -q -rs -m ipc tests ;;
    vllm) run vllm_tests 360 python3 -m pytest -q -rs -x -m vllm tests/gpu/test_vllm_adapter.py \
      tests/gpu/test_seeded_noise_gpu.py ;;
    kvsleep) run kvsleep_tests 300 python3 -m pytest -q -rs -x -m vllm tests/gpu/test_vllm_kv_sleep_gpu.py ;;
    # one pytest process per file: each builds an in-process vLLM with sleep mode, and vLLM allows one a process
    # (SHAREDBASE_FILES: which of them, e.g. "shared_base_runner")
    sharedbase) run base_restore_tests 120 python3 -m pytest -q -rs -m gpu tests/gpu/test_base_restore_gpu.py
      for f in ${SHAREDBASE_FILES:-shared_base lora_inplace shared_base_runner}; do
        run "${f}_tests" "${SHAREDBASE_TIMEOUT_S:-240}" python3 -m pytest -q -rs -s -m vllm "tests/gpu/test_${f}_gpu.py"
      done ;;
    runner) run runner_tests "${RUNNER_TIMEOUT_S:-560}" python3 -m pytest -q -rs -m vllm tests/gpu/test_grpo_runner_gpu.py ${RUNNER_ARGS:-} ;;
    diag) for cfg in ${DIAG_CONFIGS:-1GiB:2}; do  # bucket:buffers
        run "diag_bridge_${cfg/:/x}" 90 python3 benchmarks/diag_bridge.py --out "$OUT/diag/${cfg/:/x}" \
          --bucket "${cfg%%:*}" --buffers "${cfg##*:}"; done ;;
    # the training phase alone: micro-batch and recompute variants, one profiled step each, per config
    diagtrain) for cfg in ${DIAGTRAIN_CONFIGS:-configs/grpo_1p5b_full.yaml}; do
        name=$(basename "$cfg" .yaml)
        run "diag_train_$name" "${DIAGTRAIN_TIMEOUT_S:-360}" python3 benchmarks/diag_train.py --config "$cfg" \
          --out "$OUT/diag_train/$name" --profile ${DIAGTRAIN_ARGS:-}
      done ;;
    # the same with the decoder layers' parts compiled (--torch-compile), beside the eager figures
    diagcompile) for cfg in ${DIAGTRAIN_CONFIGS:-configs/grpo_1p5b_full.yaml}; do
        name=$(basename "$cfg" .yaml)
        run "diag_train_compile_$name" "${DIAGTRAIN_TIMEOUT_S:-360}" python3 benchmarks/diag_train.py --config "$cfg" \
          --out "$OUT/diag_train_compile/$name" --torch-compile ${DIAGTRAIN_ARGS:-}
      done ;;
    diagdecode) run diag_decode 400 python3 benchmarks/diag_decode.py --out "$OUT/diag_decode" ${DIAGDECODE_ARGS:-} ;;
    diagreload) run diag_reload 150 python3 benchmarks/diag_reload.py --out "$OUT/diag"
      # the same with torch's expandable segments (cuMemMap'd physical chunks instead of cudaMalloc segments)
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run diag_reload_expandable 150 \
        python3 benchmarks/diag_reload.py --out "$OUT/diag/expandable" ;;
    deepspeed) run ds_tests 360 python3 -m pytest -q -rs -x -m deepspeed tests/gpu/test_deepspeed_adapter.py \
      tests/gpu/test_deepspeed_optimizer_step.py tests/gpu/test_deepspeed_checkpoint.py ;;  # the runner stage runs the runner tests
    # the optimizer state reloaded inside the optimizer step (optimizer_reload "step"), alone
    dsstep) run ds_step_tests 240 python3 -m pytest -q -s -rs -m deepspeed tests/gpu/test_deepspeed_optimizer_step.py \
      tests/gpu/test_deepspeed_adapter.py -k "optimizer_state or deferred_offload or moments or reduced_once or compiled" ;;
    dsckpt) run ds_checkpoint_tests 200 python3 -m pytest -q -rs -x -m deepspeed tests/gpu/test_deepspeed_checkpoint.py ;;
    partial) run partial_offload_tests 200 python3 -m pytest -q -rs -x -m deepspeed tests/gpu/test_partial_offload_gpu.py ;;
    realjob) run real_job 420 python3 benchmarks/real_job.py --out "$OUT/realjob" --work /tmp/realjob ;;
    realjoblora) run real_job_lora 420 python3 benchmarks/real_job.py --out "$OUT/realjob-lora" --work /tmp/realjob-lora \
      --lora ;;
    syncbench) run bench_sync 380 python3 benchmarks/bench_sync.py --out "$OUT/sync" --sizes "${SYNC_SIZES:-7b}" --reps 6 \
      --buckets "${SYNC_BUCKETS:-512MiB,1GiB,2GiB}" --slow-reps 3 --reload-reps 1 --sw-reps 2 ;;
    syncinloop) run bench_sync_inloop 300 python3 benchmarks/bench_sync_inloop.py --out "$OUT/syncinloop" --sets 1.5b,7b --buckets "${SYNCINLOOP_BUCKETS:-loop,512MiB,1GiB}" --reps 7 ;;
    dsbench) run bench_ds 240 python3 benchmarks/bench_deepspeed_offload.py --out "$OUT/ds" ;;
    grpo) run grpo_default 240 python3 runners/grpo_colocated.py --out "$OUT/grpo" ;;
    grpobench) run bench_grpo "${GRPOBENCH_TIMEOUT_S:-400}" python3 benchmarks/bench_grpo.py --out "$OUT/grpobench" ${GRPOBENCH_ARGS:-} ;;
    # a second bench in the same call with its own arguments (another micro-batch for every run, say)
    grpobench2) run bench_grpo2 "${GRPOBENCH2_TIMEOUT_S:-400}" python3 benchmarks/bench_grpo.py --out "$OUT/grpobench2" \
      ${GRPOBENCH2_ARGS:-} ;;
    inrank) run bench_inrank "${INRANK_TIMEOUT_S:-560}" python3 benchmarks/bench_inrank.py --out "$OUT/inrank" ${INRANK_ARGS:-} ;;
    inranktest) run inrank_tests 400 python3 -m pytest -q -rs -s -m vllm tests/gpu/test_inrank_engine_gpu.py ;;
    # vLLM in the trainer's process on an empty compile cache: its graphs through the trainer's offloads
    coldcompile) run cold_compile_tests "${COLDCOMPILE_TIMEOUT_S:-560}" python3 -m pytest -q -rs -s -m vllm \
      tests/gpu/test_inrank_cold_compile_gpu.py ${COLDCOMPILE_ARGS:-} ;;
    *) echo "unknown stage $1" ;;
  esac
}
IFS=, read -ra wanted <<< "${1:-core}"
for s in "${wanted[@]}"; do stage "$s"; done
# the clocks after the stages: a GPU held back by heat or power shows it here
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv > "$OUT/gpu_clocks_end.txt" 2>&1
stamp "all done"
pack
