#!/bin/bash
# One device call: the GPU checks and tables of bench/NOTES-gpu-decode.md and NOTES-kernels.md.
# Run from the repository root on the GPU machine; logs go to $OUT (default ./gpu-out).
#   PARTS="pytest checks decode bench spec spec_k kernels sweep" bash bench/gpu_run.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PARTS=${PARTS:-"pytest decode bench spec kernels sweep"}  # any of these
export PYTHONUNBUFFERED=1
T0=$SECONDS
mark() { echo "=== $* [t=$((SECONDS - T0))s]"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if has pytest; then
  mark pytest
  OMP_NUM_THREADS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_triton_kernels.py \
    tests/test_fused_triton.py tests/test_cuda_graphs.py tests/test_paged_attention_triton.py \
    tests/test_spec_verify.py tests/test_gemv.py 2>&1 | tail -15 | tee "$OUT/pytest.log"
fi
if has checks; then
  mark gpu_checks
  timeout 120 python3 bench/gpu_checks.py 2>&1 | grep -v "Writing model shards" | tee "$OUT/gpu_checks.log"
fi
if has spec_k; then
  for k in 2 8; do
    mark "gpu_spec --k $k"
    timeout 100 python3 bench/gpu_spec.py --k $k --batches 1 2>&1 | tee "$OUT/gpu_spec_k$k.log"
  done
fi
if has decode; then
  mark gpu_decode
  timeout 230 python3 bench/gpu_decode.py 2>&1 | tee "$OUT/gpu_decode.log"
fi
if has bench; then
  mark runtime bench
  timeout 90 python3 -m flotilla.server.cli bench --random llama-3-8b --bits 4 --batch 1,16,64 2>&1 | tee "$OUT/runtime_bench.log"
fi
if has spec; then
  mark gpu_spec
  timeout 170 python3 bench/gpu_spec.py 2>&1 | tee "$OUT/gpu_spec.log"
fi
if has kernels; then
  mark kernels
  SW=""; has sweep && SW="--sweep --sweep-shapes 8192x28672,14336x4096,4096x14336,4096x4096 --sweep-batches 1,16 --sweep-bits 4 --sweep-block-k 256"
  timeout 200 python3 bench/kernels.py --graph --shapes 4096x4096,4096x14336,14336x4096,8192x28672 \
    --batches 1,16 $SW 2>&1 | tee "$OUT/kernels.log"
fi
mark done
