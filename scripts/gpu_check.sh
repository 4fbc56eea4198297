#!/usr/bin/env bash
# The GPU check: one prepared command for a lent GPU machine (about 5 minutes on one H200).
#
#   scripts/gpu_check.sh                       # on a machine with CUDA
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh   # every stage on CPU (gloo, world size 1): tests this script
#
# GPU_CHECK_STEPS (default 20) sets the training stages' length; GPU_CHECK_ARGS adds overrides to
# every training stage (the dry run's test passes a smaller model: bf16 matmuls on a CPU without
# bf16 instructions take seconds a step); GPU_CHECK_STRATEGIES (comma-separated) narrows the bf16
# sweep's ten strategies (the dry run's test sweeps three).
#
# Everything goes under ${OUT:-outputs/gpu_check}, removed first (a warm machine must not resume
# old checkpoints). Each stage has a time limit and its own log there; the last lines printed are
# a PASS/FAIL table (what comes back from a remote run). Stages:
#   versions   torch / CUDA / NCCL versions, the GPU and its compute capability
#   tests      tests/test_gpu.py (the helpers on NCCL, DDP and ZeRO against native, sync-free steps, compile,
#              checkpoints sync and async: the staging buffer pinned)
#   tour       the primitives tour on nccl
#   bench      the collective benchmark on nccl, sizes up to 64 MiB
#   bf16       one sweep (recipes/train.py -m) over our and the native strategies in bf16, 20 steps
#   fp16       ddp and native_ddp in fp16 (the gradient scaler)
#   resume     a run stopped at step 10, then resumed to 20 in the same run directory
#   summaries  scripts/gpu_check_summaries.py: losses agree across strategies, exposed communication
#              and MFU are plausible numbers; the summaries are copied to OUT/summaries/
#   compare    with 2+ GPUs: recipes/compare.py on all of them (exit 1 if any strategy differs from native)
# Two NCCL ranks cannot share one GPU ("Duplicate GPU detected"): with one GPU every NCCL run has
# world size 1, which checks the CUDA paths but not communication between GPUs.
# Uses $PYTHON if set, else .venv when present, else the machine's python3 (PYTHONPATH points at this checkout).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu_check}
DRY=${GPU_CHECK_DRY_RUN:-0}
STEPS=${GPU_CHECK_STEPS:-20}
rm -rf "$OUT" && mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT"; exit 2; }
TABLE="$OUT/table.txt"
: > "$TABLE"

if [ "$DRY" = 1 ]; then
    NPROC=1 BACKEND=gloo
    echo "gpu_check: DRY RUN on CPU (gloo, world size 1): every stage as on a GPU, to test this script"
else
    NPROC=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    BACKEND=nccl
    if [ "$NPROC" -lt 1 ]; then
        echo "gpu_check: no CUDA device visible (GPU_CHECK_DRY_RUN=1 runs the stages on CPU)"; exit 1
    fi
fi
[ "$NPROC" -eq 1 ] && echo "gpu_check: world size 1 everywhere: two NCCL ranks cannot share one GPU"
COMMON=(launcher.nproc="$NPROC" launcher.backend="$BACKEND" launcher.timeout_s=120 trainer.progress=false
        trainer.eval_every=0 trainer.eval_batches=2 trainer.log_every=5 ${GPU_CHECK_ARGS:-})

# stage NAME LIMIT_S COMMAND...: run it with a time limit, its output in OUT/NAME.log; one table row.
status=0
stage() {
    local name=$1 limit=$2; shift 2
    local start=$SECONDS result
    echo; echo "=== $name (limit ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    case $? in
        0) result=PASS ;;
        124|137) result=TIMEOUT; status=1 ;;
        *) result=FAIL; status=1 ;;
    esac
    tail -n 15 "$OUT/$name.log"
    printf '%-10s %-8s %5d s  %s\n' "$name" "$result" $((SECONDS - start)) "$OUT/$name.log" >> "$TABLE"
}
skip() { printf '%-10s %-8s %5s    %s\n' "$1" SKIP - "$2" >> "$TABLE"; }

stage versions 60 $PY -c "
import torch, platform
print('python', platform.python_version(), '| torch', torch.__version__, '| cuda', torch.version.cuda)
if torch.cuda.is_available():
    print('nccl', '.'.join(map(str, torch.cuda.nccl.version())))
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f'gpu {i}: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB')
else:
    print('no CUDA device: CPU only')
"
stage tests 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py ${GPU_TESTS:-}
stage tour 120 $PY recipes/tour.py nproc="$NPROC" backend="$BACKEND"
# (the dry run tests this script, not the link: its sweep stops at 1 MiB)
stage bench 180 $PY recipes/bench_collectives.py nproc="$NPROC" backend="$BACKEND" max_bytes=$([ "$DRY" = 1 ] && echo 1048576 || echo 67108864) \
    out_dir="$OUT/bench_collectives"
stage bf16 360 $PY recipes/train.py -m \
    strategy="${GPU_CHECK_STRATEGIES:-ddp,zero1,zero2,zero3,hsdp2,hsdp3,native_ddp,native_zero1,native_fsdp,native_hsdp}" \
    trainer.precision=bf16 trainer.max_steps="$STEPS" "${COMMON[@]}" hydra.sweep.dir="$OUT/sweep_bf16"
stage fp16 180 $PY recipes/train.py -m strategy=ddp,native_ddp trainer.precision=fp16 \
    trainer.max_steps="$STEPS" "${COMMON[@]}" hydra.sweep.dir="$OUT/sweep_fp16"
stage resume 180 bash -c "$PY recipes/train.py trainer.max_steps=$STEPS trainer.stop_at=$((STEPS / 2)) \
    ${COMMON[*]} hydra.run.dir=$OUT/resume && $PY recipes/train.py trainer.max_steps=$STEPS ${COMMON[*]} \
    hydra.run.dir=$OUT/resume && grep -q 'resumed from' $OUT/resume/logs/rank_0.log"
stage summaries 60 $PY scripts/gpu_check_summaries.py "$OUT"
if [ "$NPROC" -ge 2 ]; then
    stage compare 300 $PY recipes/compare.py launcher.nproc="$NPROC" launcher.backend="$BACKEND" \
        compare.strategies=[ddp,native_ddp,zero2,zero3,native_fsdp] compare.steps=10 hydra.run.dir="$OUT/compare"
else
    skip compare "needs 2+ GPUs (world size 1 here)"
fi
find "$OUT" -name '*.csv' -not -path "$OUT/csv/*" -exec sh -c 'mkdir -p "$1/csv"; cp "$2" "$1/csv/$(echo "${2#$1/}" | tr / _)"' _ "$OUT" {} \;

echo; echo "gpu_check: $([ "$DRY" = 1 ] && echo 'DRY RUN on CPU' || echo "$NPROC GPU(s), nccl"), world size $NPROC"
cat "$TABLE"
[ $status -eq 0 ] && echo "gpu_check: PASS" || echo "gpu_check: FAIL"
exit $status
