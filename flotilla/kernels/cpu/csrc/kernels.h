// Dequant-GEMM micro-kernels for fp32 activations on x86 CPUs (AVX2+FMA+F16C, AVX-512 when
// compiled with it). No torch headers here: module.cpp owns tensors, threads and Python.
//
// Weights are packed in tiles of kTile output columns. Within a tile, the codes of one input
// row (or one 8-row word for 4 and 5 bits) for all kTile columns are contiguous, so a kernel
// streams each tile front to back:
//
//   W4, U4  int32  [tiles, Kp / 8, kTile]  lane c of word w holds the codes of inputs 8w..8w+7 of
//                                          column c, LSB first (the GPTQ packing, transposed).
//                                          W4: a nibble is a signed 4-bit code (-8..7; GPTQ
//                                          stores q XOR 8, i.e. q - 8), U4: unsigned (0..15)
//   W5, U5  the W4 words holding the low 4 bits, plus
//           uint8  [tiles, Kp / 8, kTile]  bit j of byte (w, c): bit 4 of the code of input 8w + j.
//                                          W5: a signed 5-bit code (-16..15), U5: unsigned (0..31)
//   W8      int8   [tiles, Kp, kTile]      signed codes (for GPTQ: code - 128)
//   F16     uint16 [tiles, Kp, kTile]      IEEE half bit patterns
//   F32     float  [tiles, Kp, kTile]      the weights themselves
//
// Quantized formats have per-group tables [G, Np] (fp32, or fp16 when `half_tables`): scales,
// and optionally zero offsets (GPTQ: the weight is scale * (code - zoff)) or mins (GGUF: the
// weight is scale * code + min). GGUF forms use the blocked layout (GemmArgs::group_bytes):
// each group's codes and tables in one record, so that a decode step reads one stream per tile.
//
// Every output element is computed by the same sequence of fp32 operations whatever the
// number of rows M, the row block or the column block it falls in, whatever the thread split
// (threads own whole tiles) and whatever the instruction set. That makes results
// batch-invariant, and the AVX2 and AVX-512 builds bit-identical:
//
//   for each group g (inputs [gstart[g], gstart[g+1])):
//       a = 0;  for k in the group, ascending:  a = fma(x[k], c[k], a)     c: the decoded code
//       t = zoff ? fnma(zoff[g], sx[g], a) : a                            sx[g] = sum of x over g
//       y = fma(scale[g], t, y)            (F16, F32: y = a, one group, no scale)
//       y = mins ? fma(min[g], sx[g], y) : y
//   y = y + bias                           (when there is a bias)
//
// and the group sums sx are computed by `group_sum` in one fixed order.
//
// A build may read the codes scaled by a power of two against x scaled by its inverse where both
// are exact (AVX2 decode rows: see ScaledDecoder in kernels.cpp): every product x[k] * c[k], so
// every fma above, is then the same.
#pragma once

#include <cstdint>

namespace flotilla_cpu {

enum class Format : int { W4 = 4, U4 = 3, W5 = 5, U5 = 6, W8 = 8, F16 = 16, F32 = 32 };

constexpr int kTile = 32;  // output columns per packed tile

inline bool is_nibble_format(Format f) {
  return f == Format::W4 || f == Format::U4 || f == Format::W5 || f == Format::U5;
}

struct GemmArgs {
  Format format;
  const float* x;         // [M, Kp] activations (already permuted and zero-padded), row stride ldx
  int64_t ldx;
  const float* sx;        // [M, G] per-group sums of x, or nullptr when there are no zoff/mins
  int64_t M, Kp, N, G;    // N: real output columns; the packing covers ceil(N / kTile) tiles
  int64_t Np;             // padded output columns: tiles * kTile (row stride of the tables)
  const void* w;          // packed codes, see above
  const uint8_t* hi;      // W5/U5: the high-bit plane, else nullptr
  bool half_tables;       // scales, zoff and mins are fp16 (uint16) instead of fp32
  const void* scales;     // [G, Np], or nullptr for F16 and F32
  const void* zoff;       // [G, Np] zero offsets (zero - offset of the codes), or nullptr
  const void* mins;       // [G, Np] per-group offsets added to the weights, or nullptr
  const int32_t* gstart;  // [G + 1] group boundaries in inputs (multiples of 8 for 4 and 5 bits)
  // Blocked layout (group_bytes > 0; equal groups, no zoff): group g of tile t is one record of
  // group_bytes bytes at w + (t * G + g) * group_bytes, [codes][high bits][scales][mins], each
  // part laid out as above for that group's inputs; then `scales` and `mins` are only flags
  // (non-null: present) and `hi` is unused.
  int64_t group_bytes;
  const float* bias;      // [N] or nullptr
  float* y;               // [M, N], row stride ldy
  int64_t ldy;
};

// Compute output tiles [t0, t1) for all M rows.
void run_tiles(const GemmArgs& a, int64_t t0, int64_t t1);

// The sum of x[0..n) in the order every build uses (eight strided partial sums, then a fixed tree).
float group_sum(const float* x, int64_t n);

// The instruction set this translation unit was compiled for ("avx512" or "avx2").
const char* isa_name();

}  // namespace flotilla_cpu
