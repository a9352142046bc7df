// The GEMV's C interface (flotilla/kernels/cuda/gemv.py loads it with ctypes, as api.cu's): device
// pointers in a GemvParams, the stream as a cudaStream_t; every function returns a cudaError_t.
#include "gemv_instances.cuh"

namespace flotilla::gemv {
FLOTILLA_GEMV_DECLARE(half, 4)
FLOTILLA_GEMV_DECLARE(half, 8)
FLOTILLA_GEMV_DECLARE(__nv_bfloat16, 4)
FLOTILLA_GEMV_DECLARE(__nv_bfloat16, 8)
}  // namespace flotilla::gemv

using flotilla::gemv::GemvParams;
using flotilla::gemv::gemv_dispatch;

#define FLOTILLA_API __attribute__((visibility("default")))

extern "C" {

// op 0: launch; 1: prepare. dtype 0: float16, 1: bfloat16. mt: rows a block computes (1, 2, 4, 8),
// cols: columns a block computes (divides N), mode: 0 one zero for all, 1 uint8 zeros, 2 float offsets
// (gemv.cuh Mode), tpg: runs of a block that share a group (1, 2, or 16 / bits), warps: 1..8 a block.
FLOTILLA_API int flotilla_gemv(int op, const GemvParams* p, int dtype, int bits, int mt, int cols, int mode,
                               int tpg, int warps, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0 && bits == 4) return gemv_dispatch<half, 4>(op, p, mt, cols, mode, tpg, warps, s);
  if (dtype == 0 && bits == 8) return gemv_dispatch<half, 8>(op, p, mt, cols, mode, tpg, warps, s);
  if (dtype == 1 && bits == 4) return gemv_dispatch<__nv_bfloat16, 4>(op, p, mt, cols, mode, tpg, warps, s);
  if (dtype == 1 && bits == 8) return gemv_dispatch<__nv_bfloat16, 8>(op, p, mt, cols, mode, tpg, warps, s);
  return cudaErrorInvalidValue;
}

FLOTILLA_API const char* flotilla_gemv_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

FLOTILLA_API int flotilla_gemv_param_size() { return static_cast<int>(sizeof(GemvParams)); }
}
