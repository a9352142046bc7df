// Template instances of the kernels in wqa16.cuh for one (activation type, bit width): each
// instance_*.cu file includes this with FLOTILLA_T and FLOTILLA_BITS set, so the instances
// compile in parallel. api.cu dispatches to them.
#pragma once
#include "wqa16.cuh"

namespace flotilla {

enum Op { OP_LAUNCH = 0, OP_SMEM = 1, OP_OCCUPANCY = 2, OP_PREPARE = 3 };
constexpr int STAGES = 4;

template <typename K>
int fused_op(int op, const Params* p, int grid, cudaStream_t stream, int* out) {
  auto fn = wqa16_kernel<K>;
  if (op == OP_SMEM) {
    *out = K::SMEM;
    return 0;
  }
  if (op == OP_PREPARE || op == OP_OCCUPANCY) {
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, K::SMEM);
    if (e != cudaSuccess || op == OP_PREPARE) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, fn, K::THREADS, K::SMEM);
  }
  fn<<<grid, K::THREADS, K::SMEM, stream>>>(*p);
  return cudaGetLastError();
}

template <typename T, int BITS, int MB, typename TL>
int fused_zp(int op, int zp, const Params* p, int grid, cudaStream_t stream, int* out) {
  return zp ? fused_op<Kernel<T, BITS, MB, TL, true, STAGES>>(op, p, grid, stream, out)
            : fused_op<Kernel<T, BITS, MB, TL, false, STAGES>>(op, p, grid, stream, out);
}

// cfg 0: ThinTile, 1: WideTile; mb: 16-row tiles per block (1..4)
template <typename T, int BITS>
int fused_dispatch(int op, const Params* p, int mb, int cfg, int zp, int grid, cudaStream_t stream, int* out) {
  if (cfg < 0 || cfg > 1) return cudaErrorInvalidValue;
  switch (mb * 2 + cfg) {
    case 2: return fused_zp<T, BITS, 1, ThinTile>(op, zp, p, grid, stream, out);
    case 3: return fused_zp<T, BITS, 1, WideTile>(op, zp, p, grid, stream, out);
    case 4: return fused_zp<T, BITS, 2, ThinTile>(op, zp, p, grid, stream, out);
    case 5: return fused_zp<T, BITS, 2, WideTile>(op, zp, p, grid, stream, out);
    case 6: return fused_zp<T, BITS, 3, ThinTile>(op, zp, p, grid, stream, out);
    case 7: return fused_zp<T, BITS, 3, WideTile>(op, zp, p, grid, stream, out);
    case 8: return fused_zp<T, BITS, 4, ThinTile>(op, zp, p, grid, stream, out);
    case 9: return fused_zp<T, BITS, 4, WideTile>(op, zp, p, grid, stream, out);
  }
  return cudaErrorInvalidValue;
}

template <typename T, int BITS>
int dequant_dispatch(int op, const DequantParams* p, int zp, cudaStream_t stream) {
  auto fn = zp ? dequant_kernel<T, BITS, true> : dequant_kernel<T, BITS, false>;
  if (op == OP_PREPARE) {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, fn);  // loads the module now, not inside a graph capture
  }
  const int units = (p->K_pad / 16) * (p->N_pad / 64);
  fn<<<(units + 7) / 8, 256, 0, stream>>>(*p);
  return cudaGetLastError();
}

#define FLOTILLA_DECLARE(T, BITS)                                                                  \
  extern template int fused_dispatch<T, BITS>(int, const Params*, int, int, int, int, cudaStream_t, int*); \
  extern template int dequant_dispatch<T, BITS>(int, const DequantParams*, int, cudaStream_t);

#define FLOTILLA_INSTANTIATE(T, BITS)                                                               \
  template int fused_dispatch<T, BITS>(int, const Params*, int, int, int, int, cudaStream_t, int*); \
  template int dequant_dispatch<T, BITS>(int, const DequantParams*, int, cudaStream_t);

}  // namespace flotilla
