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
#define FLOTILLA_TILE_CASE(BITS, NR, NS, WNS) \
  if (bits == BITS && rows == NR) return tile_launch<BITS, NR, NS, WNS>(*p, s);
  FLOTILLA_TILE_INSTANCES(FLOTILLA_TILE_CASE, 4)
  FLOTILLA_TILE_INSTANCES(FLOTILLA_TILE_CASE, 8)
#undef FLOTILLA_TILE_CASE
  return cudaErrorInvalidValue;
}

FLOTILLA_API const char* flotilla_tile_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

FLOTILLA_API int flotilla_tile_param_size() { return static_cast<int>(sizeof(TileParams)); }

// the TileParams layout's version (tile.py PARAM_VERSION): 2 since group_magic replaced stages_per_group (round 11), a
// change of meaning that the size alone does not show (bench/tile_variants.py loads other builds)
FLOTILLA_API int flotilla_tile_param_version() { return 2; }

// 1 where the driver can encode the tensor maps the kernel's copies read (CUDA 12.0+ drivers), else 0
FLOTILLA_API int flotilla_tile_available() { return flotilla::tile::tensor_map_encoder() != nullptr ? 1 : 0; }
}
