// The tile GEMM's C interface (flotilla/kernels/cuda/tile.py loads it with ctypes): device pointers in
// a TileParams, the stream as a cudaStream_t; every function returns a cudaError_t.
#include "tile.cuh"

namespace flotilla::tile {
FLOTILLA_TILE_DECLARE(4)
FLOTILLA_TILE_DECLARE(8)
}  // namespace flotilla::tile

using flotilla::tile::TileParams;
using flotilla::tile::tile_launch;

#define FLOTILLA_API __attribute__((visibility("default")))

extern "C" {

// bits: 4 or 8; rows: batch rows a block (64, 128, 256)
FLOTILLA_API int flotilla_tile(const TileParams* p, int bits, int rows, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (bits == 4 && rows == 64) return tile_launch<4, 64, 6>(*p, s);
  if (bits == 4 && rows == 128) return tile_launch<4, 128, 5>(*p, s);
  if (bits == 4 && rows == 256) return tile_launch<4, 256, 5>(*p, s);
  if (bits == 8 && rows == 64) return tile_launch<8, 64, 6>(*p, s);
  if (bits == 8 && rows == 128) return tile_launch<8, 128, 5>(*p, s);
  if (bits == 8 && rows == 256) return tile_launch<8, 256, 5>(*p, s);
  return cudaErrorInvalidValue;
}

FLOTILLA_API const char* flotilla_tile_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

FLOTILLA_API int flotilla_tile_param_size() { return static_cast<int>(sizeof(TileParams)); }

// 1 where the driver can encode the tensor maps the kernel's copies read (CUDA 12.0+ drivers), else 0
FLOTILLA_API int flotilla_tile_available() { return flotilla::tile::tensor_map_encoder() != nullptr ? 1 : 0; }
}
