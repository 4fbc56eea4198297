#!/usr/bin/env bash
# GPU checks, one command, on a machine with CUDA (never needed for `make test`):
#   1. the primitives tour on nccl, one rank per GPU
#   2. the collective benchmark on nccl, one rank per GPU
#   3. the GPU-capable tests (tests/test_gpu.py; more join as issues add them)
#   4. the trainer on nccl, one rank per GPU: every strategy in bf16 (a sweep), ddp in fp16 with
#      the gradient scaler, and the default run (its final validation loss is in the summary)
# Uses .venv when present, else the machine's python3 (PYTHONPATH points at this checkout).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
OUT_DIR=${OUT_DIR:-outputs/gpu_check}
mkdir -p "$OUT_DIR"

NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$NGPU" -lt 1 ]; then echo "gpu_check: no CUDA device visible; nothing to check"; exit 1; fi
$PY -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"

status=0
run() { echo; echo "=== $*"; "$@" || { echo "=== FAILED: $*"; status=1; }; }

run $PY -m torch.distributed.run --standalone --nproc_per_node "$NGPU" recipes/tour.py backend=nccl
run $PY -m torch.distributed.run --standalone --nproc_per_node "$NGPU" recipes/bench_collectives.py \
    backend=nccl max_bytes=${BENCH_MAX_BYTES:-268435456} out_dir="$OUT_DIR/bench_collectives"
run $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py ${GPU_TESTS:-}
run $PY recipes/train.py -m strategy=ddp,zero1,zero2,zero3,native_ddp,native_zero1,native_fsdp \
    trainer.precision=bf16 trainer.max_steps=30 trainer.eval_every=0 trainer.progress=false \
    hydra.sweep.dir="$OUT_DIR/train_sweep_bf16"
run $PY recipes/train.py strategy=ddp trainer.precision=fp16 trainer.max_steps=30 trainer.progress=false \
    hydra.run.dir="$OUT_DIR/train_fp16"
run $PY recipes/train.py trainer.progress=false hydra.run.dir="$OUT_DIR/train_default"

echo; [ $status -eq 0 ] && echo "gpu_check: all passed" || echo "gpu_check: SOME CHECKS FAILED"
exit $status
