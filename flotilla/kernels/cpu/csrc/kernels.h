// Dequant-GEMM micro-kernels for fp32 activations on x86 CPUs (AVX2+FMA+F16C, AVX-512 when
// compiled with it). No torch headers here: module.cpp owns tensors, threads and Python.
//
// Weights are packed in tiles of kTile output columns. Within a tile, the codes of one input
// row (or one 8-row word for 4 bits) for all kTile columns are contiguous, so a kernel streams
// each tile front to back:
//
//   W4   int32  [tiles, Kp / 8, kTile]  lane c of word w holds the codes of inputs 8w..8w+7 of
//                                       column c, LSB first (the GPTQ packing, transposed), each
//                                       XOR 8: read as a signed nibble, a field is code - 8
//   W8   int8   [tiles, Kp, kTile]      signed codes (for GPTQ: code - 128)
//   F16  uint16 [tiles, Kp, kTile]      IEEE half bit patterns
//   F32  float  [tiles, Kp, kTile]      the weights themselves
//
// Every output element is computed by the same sequence of fp32 operations whatever the
// number of rows M, the row block or the column block it falls in, and whatever the thread
// split (threads own whole tiles). That makes results batch-invariant:
//
//   for each group g (inputs [gstart[g], gstart[g+1])):
//       a = 0;  for k in the group, ascending:  a = fma(x[k], c[k], a)     c: W4 q - 8, W8 the code
//       t = zoff ? fnma(zoff[g], sx[g], a) : a                            sx[g] = sum of x over g
//       y = fma(scale[g], t, y)            (F16, F32: y = a, one group, no scale)
//   y = y + bias                           (when there is a bias)
#pragma once

#include <cstdint>

namespace flotilla_cpu {

enum class Format : int { W4 = 4, W8 = 8, F16 = 16, F32 = 32 };

constexpr int kTile = 32;  // output columns per packed tile

struct GemmArgs {
  Format format;
  const float* x;         // [M, Kp] activations (already permuted and zero-padded), row stride ldx
  int64_t ldx;
  const float* sx;        // [M, G] per-group sums of x, or nullptr when there are no zero offsets
  int64_t M, Kp, N, G;    // N: real output columns; the packing covers ceil(N / kTile) tiles
  int64_t Np;             // padded output columns: tiles * kTile (row stride of scales and zoff)
  const void* w;          // packed codes, see above
  const float* scales;    // [G, Np], or nullptr for F16 and F32
  const float* zoff;      // [G, Np] zero offsets (zero - offset of the codes), or nullptr
  const int32_t* gstart;  // [G + 1] group boundaries in inputs (multiples of 8 for W4)
  const float* bias;      // [N] or nullptr
  float* y;               // [M, N], row stride ldy
  int64_t ldy;
};

// Compute output tiles [t0, t1) for all M rows.
void run_tiles(const GemmArgs& a, int64_t t0, int64_t t1);

// The instruction set this translation unit was compiled for ("avx512" or "avx2").
const char* isa_name();

}  // namespace flotilla_cpu
