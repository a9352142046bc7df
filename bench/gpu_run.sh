#!/bin/bash
# GPU checks, tests and the tables of bench/NOTES-gpu-decode.md and NOTES-kernels.md (issue 18's "must show"),
# in parts that each fit one device call (10 minutes). Run from the repository root on the GPU machine; logs go
# to $OUT (default ./gpu-out).
#   PARTS="pytest checks decode bench" bash bench/gpu_run.sh    # then, in a second call:
#   PARTS="kernels decode70" bash bench/gpu_run.sh
# Parts: pytest (the GPU test files, one process; the Triton interpreter's files run in CI), checks
# (bench/gpu_checks.py), decode (llama-3-8b INT4 with every peer), decode70 (llama-3-70b INT4 at batch 1 with its
# checks), kernels (the kernel table: 4 shapes x batch 1-2048 with fp16, tinygemm, bitsandbytes), bench
# (`runtime bench` with the default device: the CLI's own GPU path, which the benchmarks' cuda:0 skip), spec (bench/gpu_spec.py), spec_k (its k = 2 and 8). Wheels in .whl/ (carry it; e.g.
# bitsandbytes for the kernel table's peers) are installed into /tmp/site first. wide: the GEMV's wide plan (its GPU
# tests and the 8B decode at batch 12 and 16 with FLOTILLA_GEMV_WIDE=0 and 1, twice). record: the kernel table and the
# decode without the transformers peers, in one call (round 14's table of record on an H100 ran so). steps: the
# decode with the 4-bit-head rows and the batch-16 / 64 step profiles; sweep64: the Triton tiles' configs at 16 / 64 rows;
# tilesilu: the 8B decode at 16 / 64 with the Triton tiles' silu epilogue off and on. gguf: `runtime bench` on the 8B
# shape as GGUF files of four types load, beside the INT4 GPTQ model (round 17); tile48: the tile GEMM against the
# Triton tiles at 40-64 rows on the widest weights (the 70B shapes; round 17's open question). probe: which fused ops
# fall back to torch on the GPU in a GGUF model's step (bench/fallback_probe.py). gguftune: the Triton tiles' configs
# for the GGUF forms at 32 / 64 rows (kernels_gguf --tune). ggufrule: round 19's group-32
# rule end to end (the GGUF kernels at 16-64 rows, then `runtime bench` as gguf's part without Q8_0). offsets: round
# 21's float offsets on the GEMV's tensor-core plan (test_gemv, the GEMV sweep of Q4_K / Q5_K / Q4_0);
# offsets_decode: the 8B as Q4_K_M with FLOTILLA_GEMV_OFFSETS=0 and 1; features: bench/gpu_features.py (prompt
# logprobs, Qwen3, the tokenizer endpoints on the GPU) and the Qwen3 8B decode beside the Llama 3 8B. group32: round
# 22's CUDA-core plans with the tables a strip ahead (test_gemv, the GGUF GEMV sweep, the 8B as Q4_K_M and Q4_0
# with FLOTILLA_GEMV_GROUP32 unset and =cores). group32on: round 23's default (those plans at 1 row) against
# FLOTILLA_GEMV_GROUP32=0: test_gemv, the 8B as Q4_K_M, Q4_0 and Q8_0 at batch 1, 2, 4. phi3: Phi-3-mini's shape
# INT4 at batch 1, 16, 64. gemma3: sliding-window attention and Gemma 3 on the GPU (tests/test_window_cuda.py), then
# Gemma 3 4B's shape INT4 at batch 1, 16, 64. hybrid: the hybrid KV cache's GPU tests, runtime bench with it and
# without, and bench/hybrid_kv.py's decode past the window (hybrid against plain).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PARTS=${PARTS:-"pytest checks decode bench"}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the repository (not installed there)
T0=$SECONDS
mark() { echo "=== $* [t=$((SECONDS - T0))s]"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if has pytest; then
  mark pytest
  timeout 280 python3 -m pytest -q -rf -p no:cacheprovider tests/test_tile.py tests/test_gemv.py \
    tests/test_fused_cuda.py tests/test_cuda_kernels.py tests/test_quant_lm_head.py tests/test_pipeline_stages.py \
    tests/test_sampler.py tests/test_cuda_graphs.py > "$OUT/pytest.log" 2>&1
  tail -15 "$OUT/pytest.log"
fi
if has checks; then
  mark gpu_checks
  timeout 120 python3 -P bench/gpu_checks.py 2>&1 | grep -v "Writing model shards" | tee "$OUT/gpu_checks.log"
fi
if has spec_k; then
  for k in 2 8; do
    mark "gpu_spec --k $k"
    timeout 100 python3 -P bench/gpu_spec.py --k $k --batches 1 2>&1 | tee "$OUT/gpu_spec_k$k.log"
  done
fi
if has decode; then
  mark gpu_decode
  timeout 300 python3 -P bench/gpu_decode.py --batches 1,16,64 2>&1 | tee "$OUT/gpu_decode.log"
fi
if has decode70; then
  mark "gpu_decode llama-3-70b"
  timeout 200 python3 -P bench/gpu_decode.py --shape llama-3-70b --batches 1 --tokens 48 \
    --skip eager,hf,nf4,cuda,sync,fp16,spec-check,nopdl,nofuse,head8,profile 2>&1 | tee "$OUT/gpu_decode_70b.log"
fi
if has bench; then
  mark runtime bench
  timeout 90 python3 -m flotilla.server.cli bench --random llama-3-8b --bits 4 --batch 1,16,64 2>&1 | tee "$OUT/runtime_bench.log"
fi
if has spec; then
  mark gpu_spec
  timeout 170 python3 -P bench/gpu_spec.py 2>&1 | tee "$OUT/gpu_spec.log"
fi
kernel_table() {  # the kernel table of record (parts kernels and record)
  timeout 330 python3 -P bench/kernels.py --graph --skip-cuda --shapes 4096x4096,4096x14336,14336x4096,8192x28672 \
    --batches 1,16,64,256,2048 > "$OUT/kernels.log" 2>&1
  grep -E "^\||FAIL|correctness" "$OUT/kernels.log"
}
if has kernels; then
  mark kernels
  kernel_table
fi
if has wide; then  # the GEMV's wide plan at 9-16 rows (round 13): its GPU tests, then the 8B decode with and without it
  mark "wide: test_gemv"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py 2>&1 | tail -3
  for E in 0 1 0 1; do
    mark "wide: gpu_decode FLOTILLA_GEMV_WIDE=$E"
    FLOTILLA_GEMV_WIDE=$E timeout 90 python3 -P bench/gpu_decode.py --batches 12,16 \
      --skip eager,profile,hf,nf4,fp16,cuda,sync,nopdl,nofuse,head8,slow-checks,spec-check 2>&1 | grep -E "tok/s|OK|FAIL"
  done
fi
if has record; then  # the kernel table, then the decode without the slow transformers peers: one call (~300 s on an H100)
  mark "record: kernels"
  kernel_table
  mark "record: gpu_decode"
  timeout 200 python3 -P bench/gpu_decode.py --batches 1,16,64 --skip hf,nf4,eager,nopdl,nofuse,spec-check,slow-checks \
    2>&1 | grep -v "Writing model shards" | tee "$OUT/gpu_decode.log" | grep -E "tok/s|OK|FAIL|span|GEMV|^\|"
fi
if has steps; then  # the decode with the 4-bit head rows and the batch-16 / 64 step profiles (round 15)
  mark "steps: gpu_decode"
  timeout 280 python3 -P bench/gpu_decode.py --batches 1,16,64 --also head4 --profile-batches 16,64 \
    --skip hf,nf4,eager,nopdl,nofuse,sync,cuda,spec-check,slow-checks 2>&1 | grep -v "Writing model shards" \
    | tee "$OUT/gpu_decode_steps.log" | grep -vE "^\[" | cut -c1-150
fi
if has tilesilu; then  # the Triton tiles' silu epilogue (round 15) on and off, the 8B decode at 16 and 64, twice
  for E in ${TILESILU_RUNS:-0 1 0 1}; do
    mark "tilesilu: gpu_decode FLOTILLA_TILE_SILU=$E"
    FLOTILLA_TILE_SILU=$E timeout 100 python3 -P bench/gpu_decode.py --batches 16,64 \
      --skip eager,profile,hf,nf4,fp16,cuda,sync,nopdl,nofuse,head8,slow-checks,spec-check 2>&1 | grep -E "tok/s|OK|FAIL"
  done
fi
if has sweep64; then  # the Triton tiles' configs at 16 and 64 rows, W4 g128 (round 15: 256-wide tiles added)
  mark "sweep64"
  timeout 400 python3 -P bench/kernels.py --graph --only-sweeps --sweep --skip-check --sweep-bits 4 --sweep-block-k 256 \
    --sweep-shapes 4096x4096,4096x14336,14336x4096,8192x28672 --sweep-batches 16,64 --json 2>&1 | tee "$OUT/sweep64.log" \
    | grep -E "^sweep|^ +[0-9.]+us"
fi
if has gguf; then
  for g in "--bits 4" "--gguf Q4_0" "--gguf Q4_K_M" "--gguf Q8_0" "--gguf Q6_K"; do
    mark "gguf: runtime bench $g"
    timeout 90 python3 -m flotilla.server.cli bench --random llama-3-8b $g --batch 1,16,64 2>&1 | tee -a "$OUT/gguf.log"
  done
fi
if has tile48; then
  mark "tile48"
  timeout 200 python3 -P bench/kernels.py --graph --only-sweeps --skip-check --tile-sweep --tile-rows 40,48,64 \
    --tile-heights 64 --shapes 8192x28672,8192x57344,28672x8192,4096x28672 2>&1 | tee "$OUT/tile48.log" | grep -v "^\["
fi
if has gguftune; then  # the Triton tiles' configs for the GGUF forms (group 32) at 32 / 64 rows: never tuned there
  mark "gguftune"
  timeout 330 python3 -P bench/kernels.py --gguf --graph --only-sweeps --skip-check --tune \
    --shapes 4096x14336,14336x4096,8192x28672 --batches 32,64 2>&1 | tee "$OUT/gguftune.log" | grep -E "^tune|FAIL"
fi
if has ggufrule; then  # round 19's group-32 rule end to end: the GGUF kernels at 16-64 rows, then the 8B decode as GGUF
  mark "ggufrule: kernels --gguf"
  timeout 150 python3 -P bench/kernels.py --gguf --graph --shapes 4096x14336,14336x4096,8192x28672 --batches 16,32,64 \
    > "$OUT/ggufrule_kernels.log" 2>&1
  grep -E "^\||FAIL|correct" "$OUT/ggufrule_kernels.log"
  for g in "--bits 4" "--gguf Q4_0" "--gguf Q4_K_M" "--gguf Q6_K"; do
    mark "ggufrule: runtime bench $g"
    timeout 90 python3 -m flotilla.server.cli bench --random llama-3-8b $g --batch 1,16,64 2>&1 | tee -a "$OUT/ggufrule.log" \
      | grep -vE "^\[|Writing"
  done
fi
if has probe; then  # which fused ops hand CUDA tensors to a torch fallback in a GGUF model's step (and a GPTQ one's)
  for g in "--gguf Q4_K_M" "--gguf Q6_K" "--bits 4"; do
    mark "probe: $g"
    timeout 120 python3 -P bench/fallback_probe.py --random llama-3-8b $g --layers 4 --batch 1,16 --tokens 32 2>&1 \
      | tee -a "$OUT/probe.log" | grep -vE "^\[|Writing"
  done
fi
if has offsets; then  # round 21: the GGUF float-offset forms (Q4_K, Q4_1, Q5_K, Q5_1) on the GEMV's tensor-core plan
  mark "offsets: test_gemv"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py ${OFFSET_TESTS:+-k "$OFFSET_TESTS"} 2>&1 \
    | tail -4
  mark "offsets: gemv sweep"
  timeout 280 python3 -P bench/kernels.py --gguf --graph --only-sweeps --gemv-sweep --gemv-chain \
    --gemv-forms ${OFFSET_FORMS:-Q4_K,Q5_K,Q4_0} --gemv-rows ${OFFSET_ROWS:-1,4,8,16} \
    --shapes ${OFFSET_SHAPES:-4096x14336,14336x4096,8192x28672} 2>&1 | tee "$OUT/offsets_sweep.log" \
    | grep -E "^gguf|chain|FAIL"
fi
if has offsets_decode; then  # the 8B as GGUF Q4_K_M (OFFSET_MODELS) at 1-16 rows, the offsets' GEMV plan off and on
  for E in 0 1; do
    for g in ${OFFSET_MODELS:-Q4_K_M}; do
      mark "offsets_decode: runtime bench --gguf $g FLOTILLA_GEMV_OFFSETS=$E"
      FLOTILLA_GEMV_OFFSETS=$E timeout 100 python3 -m flotilla.server.cli bench --random llama-3-8b --gguf $g \
        --batch ${OFFSET_BATCHES:-1,4,8,16} 2>&1 | tee -a "$OUT/offsets_decode.log" | grep -vE "^\[|Writing"
    done
  done
fi
if has group32; then  # round 22: the group-32 layouts' CUDA-core plans with the tables a strip ahead ("2c1wt")
  mark "group32: test_gemv"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k "${GROUP32_TESTS:-every_plan or gguf}" \
    2>&1 | tail -4
  mark "group32: gemv sweep"
  timeout 280 python3 -P bench/kernels.py --gguf --graph --only-sweeps --gemv-sweep --gemv-chain \
    --gemv-forms ${GROUP32_FORMS:-Q4_K,Q4_0,Q5_K,Q6_K,Q8_0} --gemv-rows ${GROUP32_ROWS:-1,4,8} \
    --shapes ${GROUP32_SHAPES:-4096x14336,14336x4096,8192x28672} 2>&1 | tee "$OUT/group32_sweep.log" \
    | grep -E "^gguf|chain|FAIL"
  for g in ${GROUP32_MODELS:-Q4_K_M Q4_0}; do  # the 8B decode: as shipped, then FLOTILLA_GEMV_GROUP32=cores
    for E in "" cores; do
      mark "group32: runtime bench --gguf $g FLOTILLA_GEMV_GROUP32=$E"
      FLOTILLA_GEMV_GROUP32=$E timeout 100 python3 -m flotilla.server.cli bench --random llama-3-8b --gguf $g \
        --batch ${GROUP32_BATCHES:-1,4,8} 2>&1 | tee -a "$OUT/group32_decode.log" | grep -vE "^\[|Writing"
    done
  done
fi
if has group32on; then  # round 23: the group-32 CUDA-core plans at 1 row on by default; checked against =0
  mark "group32on: test_gemv"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py 2>&1 | tail -3
  for g in ${GROUP32_MODELS:-Q4_K_M Q4_0 Q8_0}; do
    for E in "" 0; do
      mark "group32on: runtime bench --gguf $g FLOTILLA_GEMV_GROUP32=$E"
      FLOTILLA_GEMV_GROUP32=$E timeout 100 python3 -m flotilla.server.cli bench --random llama-3-8b --gguf $g \
        --batch ${GROUP32_BATCHES:-1,2,4} 2>&1 | tee -a "$OUT/group32on_decode.log" | grep -vE "^\[|Writing"
    done
  done
fi
if has phi3; then  # Phi-3-mini's shape (heads 96 wide: torch's rope and KV store on the GPU; round 24)
  mark "phi3: runtime bench --random phi-3-mini"
  timeout 200 python3 -m flotilla.server.cli bench --random phi-3-mini --bits 4 --batch ${PHI3_BATCHES:-1,16,64} \
    2>&1 | tee "$OUT/phi3_decode.log" | grep -vE "^\[|Writing"
fi
if has gemma3; then  # the sliding window in the Triton decode and the prefill masks; Gemma 3 (round 26)
  mark "gemma3: test_window_cuda"
  timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_window_cuda.py > "$OUT/window_cuda.log" 2>&1
  tail -15 "$OUT/window_cuda.log"
  mark "gemma3: runtime bench --random gemma-3-4b"
  timeout 200 python3 -m flotilla.server.cli bench --random gemma-3-4b --bits 4 --batch ${GEMMA3_BATCHES:-1,16,64} \
    2>&1 | tee "$OUT/gemma3_decode.log" | grep -vE "^\[|Writing"
fi
if has hybrid; then  # the hybrid KV cache on the GPU: its tests, runtime bench hybrid / plain, decode past the window
  mark "hybrid: test_window_cuda -k hybrid"
  timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_window_cuda.py -k hybrid > "$OUT/hybrid_cuda.log" 2>&1
  tail -5 "$OUT/hybrid_cuda.log"
  for flag in "" --disable-hybrid-kv-cache-manager; do
    mark "hybrid: runtime bench --random gemma-3-4b $flag"
    timeout 150 python3 -m flotilla.server.cli bench --random gemma-3-4b --bits 4 --batch 1,16,64 $flag 2>&1 \
      | tee -a "$OUT/hybrid_bench.log" | grep -vE "^\[|Writing"
  done
  mark "hybrid: bench/hybrid_kv.py --measure"
  timeout 150 python3 -P bench/hybrid_kv.py --measure --device cuda --layers 34 --batch 16 --prompt 1100 --tokens 128 \
    2>&1 | tee "$OUT/hybrid_measure.log" | tail -8
fi
if has features; then  # the features that had never run on a GPU (bench/gpu_features.py) and the Qwen3 decode
  mark "features: gpu_features"
  timeout 200 python3 -P bench/gpu_features.py 2>&1 | tee "$OUT/gpu_features.log" | grep -vE "^\[|Writing"
  mark "features: runtime bench --random qwen3-8b"
  timeout 120 python3 -m flotilla.server.cli bench --random qwen3-8b --bits 4 --batch 1,16,64 2>&1 \
    | tee "$OUT/qwen3_bench.log" | grep -vE "^\[|Writing"
  timeout 100 python3 -m flotilla.server.cli bench --random llama-3-8b --bits 4 --batch 1,16,64 2>&1 \
    | tee -a "$OUT/qwen3_bench.log" | grep -vE "^\[|Writing"
fi
mark done
