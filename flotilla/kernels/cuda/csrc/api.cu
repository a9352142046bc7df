// The C interface that flotilla/kernels/cuda/build.py loads with ctypes: no torch headers, so
// the library does not depend on torch's C++ ABI; tensors arrive as device pointers and the
// stream as a cudaStream_t. Every function returns a cudaError_t (0: success).
#include "instances.cuh"

namespace flotilla {
FLOTILLA_DECLARE(half, 4)
FLOTILLA_DECLARE(half, 8)
FLOTILLA_DECLARE(__nv_bfloat16, 4)
FLOTILLA_DECLARE(__nv_bfloat16, 8)
}  // namespace flotilla

using flotilla::DequantParams;
using flotilla::Params;

// the library is built with -fvisibility=hidden: only these four functions are exported
#define FLOTILLA_API __attribute__((visibility("default")))

extern "C" {

// op: 0 launch (grid blocks on stream), 1 dynamic shared memory bytes -> *out, 2 resident blocks
// per multiprocessor -> *out, 3 prepare (raise the shared-memory limit, load the module).
// dtype: 0 float16, 1 bfloat16.
FLOTILLA_API int flotilla_wqa16(int op, const Params* p, int dtype, int bits, int mb, int cfg, int zp, int grid,
                   void* stream, int* out) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0 && bits == 4) return flotilla::fused_dispatch<half, 4>(op, p, mb, cfg, zp, grid, s, out);
  if (dtype == 0 && bits == 8) return flotilla::fused_dispatch<half, 8>(op, p, mb, cfg, zp, grid, s, out);
  if (dtype == 1 && bits == 4) return flotilla::fused_dispatch<__nv_bfloat16, 4>(op, p, mb, cfg, zp, grid, s, out);
  if (dtype == 1 && bits == 8) return flotilla::fused_dispatch<__nv_bfloat16, 8>(op, p, mb, cfg, zp, grid, s, out);
  return cudaErrorInvalidValue;
}

FLOTILLA_API int flotilla_dequant(int op, const DequantParams* p, int dtype, int bits, int zp, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0 && bits == 4) return flotilla::dequant_dispatch<half, 4>(op, p, zp, s);
  if (dtype == 0 && bits == 8) return flotilla::dequant_dispatch<half, 8>(op, p, zp, s);
  if (dtype == 1 && bits == 4) return flotilla::dequant_dispatch<__nv_bfloat16, 4>(op, p, zp, s);
  if (dtype == 1 && bits == 8) return flotilla::dequant_dispatch<__nv_bfloat16, 8>(op, p, zp, s);
  return cudaErrorInvalidValue;
}

FLOTILLA_API const char* flotilla_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

FLOTILLA_API int flotilla_param_sizes(int* out) {  // lets Python check that its ctypes structs match
  out[0] = static_cast<int>(sizeof(Params));
  out[1] = static_cast<int>(sizeof(DequantParams));
  return 0;
}
}
