// The GEMV's template instances for one (activation type, bit width): gemv_*.cu include this with
// their pair, so the instances compile in parallel; gemv_api.cu dispatches to them.
#pragma once
#include "gemv.cuh"
#include "gemv_mma.cuh"
#include "gemv_wide.cuh"

namespace flotilla::gemv {

// op 0: launch N / cols blocks of 32 * warps threads; op 1: prepare (load the module now, not
// inside a CUDA-graph capture). The CUDA-core plans; p->stages 1: the tables a strip ahead (PF, group-32
// layouts: TPG 1), else 0.
template <typename T, int BITS, int MT, int C, int MODE, int TPG, bool PF>
int gemv_op_pf(int op, const GemvParams* p, int warps, cudaStream_t stream) {
  auto fn = gemv_kernel<T, BITS, MT, C, MODE, TPG, PF>;
  if (op == 1) {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, fn);
  }
  if (warps < 1 || warps > MAX_WARPS) return cudaErrorInvalidValue;
  fn<<<p->N / C, 32 * warps, 0, stream>>>(*p);
  return cudaGetLastError();
}

template <typename T, int BITS, int MT, int C, int MODE, int TPG>
int gemv_op(int op, const GemvParams* p, int warps, cudaStream_t stream) {
  if (p->stages == 0) return gemv_op_pf<T, BITS, MT, C, MODE, TPG, false>(op, p, warps, stream);
  if constexpr (TPG == 1)
    if (p->stages == 1) return gemv_op_pf<T, BITS, MT, C, MODE, TPG, true>(op, p, warps, stream);
  return cudaErrorInvalidValue;
}

// launch the tensor-core plan, as a programmatic dependent of the stream's previous kernel when p.pdl
// (sm_90+: its weight loads overlap that kernel's tail; gemv_mma.cuh), else as a plain launch
template <typename K>
cudaError_t launch_mma(K kernel, const GemvParams& p, int warps, int smem, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.N / MMA_COLS);
  cfg.blockDim = dim3(32 * warps);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// the tensor-core plan (cols 16): one launch for any M <= 8; p->stages picks the register double
// buffer (0) or the shared-memory ring (2..MAX_STAGES slots a warp). Prepare loads both and lets the
// ring take the dynamic shared memory of its deepest launch.
template <int BITS, int MODE, int TPG, int LOG2R>
int gemv_mma_op(int op, const GemvParams* p, int warps, cudaStream_t stream) {
  constexpr int fixed = mma_slot_bytes<BITS, MODE, TPG, LOG2R>(), x_row = mma_x_row_bytes<BITS, LOG2R>();
  static int most = 0;  // dynamic shared memory the ring may take (set by prepare; the fused instance's static is larger)
  if (op == 1) {  // what the GPU allows a block beyond its static arrays, for both instances (plain, fused)
    int device = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    const void* kernels[4] = {reinterpret_cast<const void*>(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, false, false>),
                              reinterpret_cast<const void*>(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, false, true>),
                              reinterpret_cast<const void*>(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, true, false>),
                              reinterpret_cast<const void*>(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, true, true>)};
    int static_max = 0;
    for (int k = 0; k < 4 && e == cudaSuccess; k++) {
      cudaFuncAttributes attr;
      e = cudaFuncGetAttributes(&attr, kernels[k]);
      if (e == cudaSuccess) static_max = max(static_max, static_cast<int>(attr.sharedSizeBytes));
    }
    if (e != cudaSuccess) return e;
    most = min(MAX_WARPS * MAX_STAGES * (fixed + 8 * x_row), optin - static_max);
    for (int k = 2; k < 4 && e == cudaSuccess; k++)
      e = cudaFuncSetAttribute(kernels[k], cudaFuncAttributeMaxDynamicSharedMemorySize, most);
    return e;
  }
  if (warps < 1 || warps > MAX_WARPS) return cudaErrorInvalidValue;
  const bool fuse = p->resid != nullptr || p->n_partials > 0;
  if (p->stages == 0)
    return fuse ? launch_mma(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, false, true>, *p, warps, 0, stream)
                : launch_mma(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, false, false>, *p, warps, 0, stream);
  if (p->stages < 2 || p->stages > MAX_STAGES) return cudaErrorInvalidValue;
  // the ring's depth: p->stages, or as many as fit the shared memory (at least 2)
  const int slot = fixed + min(p->M, 8) * x_row;
  GemvParams q = *p;
  q.stages = min(p->stages, most / (warps * slot));
  if (q.stages < 2) return cudaErrorInvalidValue;
  return fuse ? launch_mma(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, true, true>, q, warps, warps * q.stages * slot, stream)
              : launch_mma(gemv_mma_kernel<BITS, MODE, TPG, LOG2R, true, false>, q, warps, warps * q.stages * slot, stream);
}

// fp16, a zero constant or uint8 zeros, blocks of 16 or 32 words; float offsets (the GGUF forms' layouts)
// at blocks of 16 words only (op 1 reads log2r too)
template <typename T, int BITS, int MODE, int TPG>
int gemv_mma_dispatch(int op, const GemvParams* p, int warps, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, half>) {
    if (p->log2r == 4) return gemv_mma_op<BITS, MODE, TPG, 4>(op, p, warps, stream);
    if constexpr (MODE != OFF)
      if (p->log2r == 5) return gemv_mma_op<BITS, MODE, TPG, 5>(op, p, warps, stream);
  }
  return cudaErrorInvalidValue;
}

// the wide tensor-core plan (gemv_wide.cuh) at M <= 16: 16 columns a block (NC = 2 octets; 32 and 64, measured
// no faster where it is picked in round 13, are on branch wide-deep)
template <int BITS, int MODE, int TPG, int LOG2R, int NC>
int gemv_wide_op(int op, const GemvParams* p, int warps, cudaStream_t stream) {
  auto fn = gemv_wide_kernel<BITS, MODE, TPG, LOG2R, NC>;
  if (op == 1) {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, fn);
  }
  if (warps < 1 || warps > MAX_WARPS || p->M < 1 || p->M > WIDE_ROWS || p->N % (8 * NC) || p->stages != 0 ||
      p->resid != nullptr || p->n_partials != 0)  // no ring, no residual and norm fusion
    return cudaErrorInvalidValue;
  if (p->silu_half && (2 * p->silu_half != p->N || p->silu_half % (4 * NC))) return cudaErrorInvalidValue;
  fn<<<p->N / (8 * NC), 32 * warps, 0, stream>>>(*p);
  return cudaGetLastError();
}

template <typename T, int BITS, int MODE, int TPG>
int gemv_wide_dispatch(int op, const GemvParams* p, int cols, int warps, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, half> && MODE != OFF) {
    if (cols == 16 && p->log2r == 4) return gemv_wide_op<BITS, MODE, TPG, 4, 2>(op, p, warps, stream);
    if (cols == 16 && p->log2r == 5) return gemv_wide_op<BITS, MODE, TPG, 5, 2>(op, p, warps, stream);
  }
  return cudaErrorInvalidValue;
}

// (rows a block computes, columns a block computes): the shapes the plans use (gemv.py ROW_TILES)
#define FLOTILLA_GEMV_SHAPES(X) X(1, 2) X(1, 4) X(2, 2) X(2, 4) X(4, 2) X(4, 4) X(8, 2)

template <typename T, int BITS, int MODE, int TPG>
int gemv_shape(int op, const GemvParams* p, int mt, int cols, int warps, cudaStream_t stream) {
  if (mt == WIDE_ROWS) return gemv_wide_dispatch<T, BITS, MODE, TPG>(op, p, cols, warps, stream);
  if (op == 0 && cols != MMA_COLS && p->silu_half) return cudaErrorInvalidValue;  // the tensor-core plan's epilogue
  if (cols == MMA_COLS) return mt == 8 ? gemv_mma_dispatch<T, BITS, MODE, TPG>(op, p, warps, stream)
                                       : cudaErrorInvalidValue;
#define FLOTILLA_GEMV_CASE(MT, C) \
  if (mt == MT && cols == C) return gemv_op<T, BITS, MT, C, MODE, TPG>(op, p, warps, stream);
  FLOTILLA_GEMV_SHAPES(FLOTILLA_GEMV_CASE)
#undef FLOTILLA_GEMV_CASE
  return cudaErrorInvalidValue;
}

// mode: SYM, ZP or OFF (gemv.cuh Mode); tpg: runs of a block that share a group, 1, 2 or P (OFF: 1,
// the GGUF forms' layouts)
template <typename T, int BITS>
int gemv_dispatch(int op, const GemvParams* p, int mt, int cols, int mode, int tpg, int warps, cudaStream_t stream) {
  constexpr int P = 16 / BITS;
  if (mode == OFF) return tpg == 1 ? gemv_shape<T, BITS, OFF, 1>(op, p, mt, cols, warps, stream) : cudaErrorInvalidValue;
  if (mode != SYM && mode != ZP) return cudaErrorInvalidValue;
  const bool zp = mode == ZP;
  if (tpg == 1) return zp ? gemv_shape<T, BITS, ZP, 1>(op, p, mt, cols, warps, stream)
                          : gemv_shape<T, BITS, SYM, 1>(op, p, mt, cols, warps, stream);
  if (tpg == 2) return zp ? gemv_shape<T, BITS, ZP, 2>(op, p, mt, cols, warps, stream)
                          : gemv_shape<T, BITS, SYM, 2>(op, p, mt, cols, warps, stream);
  if (tpg == P && P > 2) return zp ? gemv_shape<T, BITS, ZP, P>(op, p, mt, cols, warps, stream)
                                   : gemv_shape<T, BITS, SYM, P>(op, p, mt, cols, warps, stream);
  return cudaErrorInvalidValue;
}

#define FLOTILLA_GEMV_DECLARE(T, BITS) \
  extern template int gemv_dispatch<T, BITS>(int, const GemvParams*, int, int, int, int, int, cudaStream_t);
#define FLOTILLA_GEMV_INSTANTIATE(T, BITS) \
  template int gemv_dispatch<T, BITS>(int, const GemvParams*, int, int, int, int, int, cudaStream_t);

}  // namespace flotilla::gemv
