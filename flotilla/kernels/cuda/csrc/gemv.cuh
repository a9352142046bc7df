// flotilla's CUDA-core GEMV for small batches (M <= 8) over the Triton layout
// (flotilla/kernels/triton_layout.py): y[m, n] = sum_k x[m, k] * W[k, n] (+ bias), the weight read
// in place, no second copy.
//
// The layout: words [N, KW] int32, one row of words per output column; within a block of BK input
// rows (R = BK * bits / 32 words per column, P = 16 / bits pair positions a word) field t + P*j of
// word r holds row t*2R + 2r + j, so (word >> t*bits) & (mask | mask << 16) is the pair of rows
// (2r, 2r+1) of run t in the low / high 16 bits: fp16's magic-number decode gives both at once.
//
// Work split: a block owns C consecutive output columns; its warps split the input axis into
// strips of 128 words a column (32 lanes x one 16-byte load); lane l of a strip reads words
// 4l..4l+3, i.e. 8 consecutive rows of every run t, so one 16-byte load of x per (run, row)
// serves all C columns. Weights stream with ld.global.nc.L1::no_allocate and an L2 evict-first
// policy, the next strip's loads issued before the current one is decoded; x, scales and zeros
// are read through L1 (x is a few KB and every block of an SM reads all of it). Each lane sums
// its products, the warp reduces by shuffles, the block adds its warps' sums in a fixed order:
// no split over blocks, so results are deterministic and no workspace or counter is needed.
//
// fp16 activations: per pair 1 LOP3 (+1 SHF a word for runs 2, 3), HADD2 / HFMA2 by 1/16 to
// q - z (exact), HMUL2 by the group scale first (the reference's rounding: the products cannot
// overflow half2 beyond what the output itself would), then one HFMA2 per row into half2 partial
// sums for one strip (two chains of at most 8), added into fp32 per strip.
// bf16 activations: the codes decode straight to fp32 (a nibble or byte ORed under the exponent
// of 2^23, one fused multiply-add to q - z), products summed in fp32 per run, the scale (and the
// offset times the sum of x) applied per run: no precision lost to bf16 arithmetic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

namespace flotilla::gemv {

// f(std::integral_constant<int, 0>{}), ..., f(<N - 1>): a loop whose index is a compile-time constant
template <typename F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

struct GemvParams {
  const void* x;            // [M, >= KW * 32 / bits] act dtype, row stride lda elements; 16-byte aligned rows;
                            // zero past the real input features (the layout's padding rows)
  const uint32_t* words;    // [N, KW]
  const uint16_t* scales;   // [G, N] fp16, or bf16 when scale_bf16
  const uint8_t* zeros;     // [G, N] uint8 (mode ZP)
  const uint16_t* offsets;  // [G, N] like scales (mode OFF: GGUF forms, w = s * (q - z) + m)
  const void* bias;         // [N] act dtype, or null
  void* y;                  // [M, N] act dtype, row stride ldy
  int M, N, KW, lda, ldy;
  int log2r;                // log2 of R, words per column per block (8, 16 or 32)
  int zero_const;           // the zero of modes SYM and OFF
  unsigned group_magic;     // ceil(2^31 / runs per group): group of run u = umulhi(2u, magic)
  int scale_bf16;           // bf16 activations only: scales and offsets are bf16 (GGUF tables), else fp16
  int stages;               // the tensor-core plan: 0 a register double buffer, 2..8 a cp.async ring of
                            // that many blocks a warp (gemv_mma.cuh); the CUDA-core plans: 1 the tables a
                            // strip ahead (group-32 layouts), else 0
  int pdl;                  // the tensor-core plan on sm_90+: launched as a programmatic dependent of the
                            // kernel before it (gemv_mma.cuh); the CUDA-core plans ignore it
  int silu_half;            // the tensor-core plan only, 0: off; else N / 2 (a multiple of 8): the weight is
                            // [gate | up] and y [M, N / 2] = silu(x @ gate) * (x @ up), each rounded as
                            // kernels/fused.silu_mul rounds it (a block: gate columns n0..n0+7, up n0 + N/2..)
  // The residual add and the RMSNorm between two GEMVs, folded into them (the tensor-core plan only;
  // cuda/gemv.py NormedResidual). Producer (resid set): r = half(resid + half(x @ W + bias)), rounded
  // as torch's add, written to y; half(r * gamma) to y_gamma; and each block's sum of r^2 over its 16
  // columns, per batch row, to partials[m * gridDim.x + block]. Consumer (n_partials > 0): x is such a
  // y_gamma and y = (x @ W) * rstd (+ bias), rstd = post_scale / sqrt(sum of partials[m, :] * inv_k + eps),
  // the partials summed in a fixed order; under silu_half gate and up are both scaled before the silu.
  const void* resid;        // [M, N] act dtype, row stride ldr, or null
  void* y_gamma;            // [M, N] act dtype, row stride ldy
  const void* gamma;        // [N] act dtype: the next norm's weight (times a power of two, post_scale's inverse)
  float* partials;          // producer: [M, gridDim.x] written; consumer: [M, n_partials] read
  int ldr;
  int n_partials;
  float inv_k, eps, post_scale;
};

// How a group's zero point and offset are given: one zero for all (SYM), uint8 zeros (ZP), the
// zero constant plus float offsets (OFF)
enum Mode { SYM = 0, ZP = 1, OFF = 2 };

constexpr int MAX_WARPS = 8;

// ---------------------------------------------------------------------------------------------
// Loads

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// a weight strip: streamed once, kept out of L1, first out of L2
__device__ __forceinline__ uint4 load_stream(const uint4* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// x: read by every block of the SM, so cached in L1
__device__ __forceinline__ uint4 load_x(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The C consecutive entries of one row of a [G, N] table at a block's first column (C divides N,
// so one aligned load): 16-bit entries as the 32-bit words holding them (entry c in half c % 2 of
// word c / 2), uint8 entries packed in one word (byte c).
template <int C>
__device__ __forceinline__ void load_row16(const uint16_t* p, uint32_t* out) {
  if constexpr (C == 4) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    out[0] = v.x, out[1] = v.y;
  } else if constexpr (C == 2) {
    out[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    out[0] = __ldg(p);
  }
}

template <int C>
__device__ __forceinline__ uint32_t load_row8(const uint8_t* p) {
  if constexpr (C == 4) return __ldg(reinterpret_cast<const unsigned int*>(p));
  else if constexpr (C == 2) return __ldg(reinterpret_cast<const unsigned short*>(p));
  else return __ldg(p);
}

// load_row16 / load_row8 as volatile loads: issued where they are written (a strip ahead of their use,
// beside its weights), not sunk to the use by the compiler
template <int C>
__device__ __forceinline__ void load_row16_now(const uint16_t* p, uint32_t* out) {
  static_assert(C == 2 || C == 4, "the CUDA-core plans' columns");
  if constexpr (C == 4)
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];\n" : "=r"(out[0]), "=r"(out[1]) : "l"(p));
  else
    asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(out[0]) : "l"(p));
}

template <int C>
__device__ __forceinline__ uint32_t load_row8_now(const uint8_t* p) {
  uint32_t v;
  if constexpr (C == 4) asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  else asm volatile("ld.global.nc.u16 %0, [%1];\n" : "=r"(v) : "l"(p));  // C == 2, zero-extended
  return v;
}

// One strip's tables for one lane (PF plans: loaded with the strip's weights, a strip ahead): the scales
// (offsets, zeros) of its NG = P / TPG groups for the block's C columns, as load_row16 / load_row8 give them.
// The per-run loads of the other plans wait on the L2 in the middle of the strip; at group 32 (a group each
// run) they are most of a strip's loads.
template <int C, int MODE, int NG>
struct StripTables {
  uint32_t s[NG][(C + 1) / 2];
  uint32_t m[MODE == OFF ? NG : 1][(C + 1) / 2];
  uint32_t z[MODE == ZP ? NG : 1];
};

// entry c of load_row16's words, in both halves of a word / in the low half
__device__ __forceinline__ uint32_t dup16(const uint32_t* w, int c) {
  return __byte_perm(w[c / 2], 0, c % 2 ? 0x3232 : 0x1010);
}

// ---------------------------------------------------------------------------------------------
// Bit tricks

// (a & B) | C in one LOP3 (written in C the compiler emits two)
template <uint32_t B, uint32_t C>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "n"(B), "n"(C));
  return r;
}

// v, as a value the compiler cannot recompute from its inputs: it stays in a register instead of
// being rematerialized (64-bit address arithmetic) at every use
template <typename V>
__device__ __forceinline__ V pinned(V v) {
  if constexpr (sizeof(V) == 8) asm volatile("" : "+l"(v));
  else asm volatile("" : "+r"(v));
  return v;
}

__device__ __forceinline__ half2 as_h2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }
__device__ __forceinline__ uint32_t h2_bits(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// group of run u (block b, position t: u = b * P + t)
__device__ __forceinline__ unsigned group_of(int u, unsigned magic) { return __umulhi(2u * u, magic); }

// ---------------------------------------------------------------------------------------------
// fp16: the packed pair decode of run T of a word w (w8 = w >> 8) to (q - z) for rows (2r, 2r+1)

template <int BITS>
struct PairF16;

template <>
struct PairF16<4> {
  static constexpr int P = 4;
  // T even: (w & 0x000F000F) | 0x6400 = 1024 + q, plus -(1024 + z); T odd: the second nibble in
  // place, 1024 + 16 q, times 1/16 plus -(64 + z). Runs 2, 3 read w >> 8.
  template <int T>
  static __device__ __forceinline__ half2 get(uint32_t w, uint32_t w8, uint32_t zz_even, uint32_t zz_odd) {
    const uint32_t src = T < 2 ? w : w8;
    if (T % 2 == 0) return __hadd2(as_h2(and_or<0x000F000Fu, 0x64006400u>(src)), as_h2(zz_even));
    return __hfma2(as_h2(and_or<0x00F000F0u, 0x64006400u>(src)), as_h2(0x2C002C00u), as_h2(zz_odd));
  }
};

template <>
struct PairF16<8> {
  static constexpr int P = 2;
  template <int T>
  static __device__ __forceinline__ half2 get(uint32_t w, uint32_t w8, uint32_t zz_even, uint32_t) {
    return __hadd2(as_h2(and_or<0x00FF00FFu, 0x64006400u>(T == 0 ? w : w8)), as_h2(zz_even));
  }
};

// packed -(1024 + z) and -(64 + z) (z < 64) as fp16 pairs, from z | z << 16
__device__ __forceinline__ uint32_t zz_even_of(uint32_t zz) { return zz + 0xE400E400u; }
__device__ __forceinline__ uint32_t zz_odd_of(uint32_t zz) { return zz * 16 + 0xD400D400u; }

// Where one strip of a lane lies: u0 the run of t = 0 of its words' block, row0 the first input
// row of its strip (the lane's 8 rows of run t: xm[m] + row0 + t * 2R, xm including the lane's offset).
struct StripAt {
  int u0, row0;
};

// TPG: runs of a block that share a group (a power of two; P: one group a block)
// PF: the tables come from tb (loaded a strip ahead), else they are loaded here, run by run
template <int BITS, int MT, int C, int MODE, int TPG, bool PF, int NG>
__device__ __forceinline__ void strip_f16(const GemvParams& p, const uint4* cur, StripAt at, const half* const* xm,
                                          const uint16_t* sc, const uint8_t* zp, const uint16_t* of,
                                          const uint32_t* zz_sym, const StripTables<C, MODE, NG>& tb,
                                          float (*acc)[MT]) {
  constexpr int P = PairF16<BITS>::P;
  uint32_t w8[C][4];
#pragma unroll
  for (int c = 0; c < C; c++) {
    w8[c][0] = cur[c].x >> 8, w8[c][1] = cur[c].y >> 8, w8[c][2] = cur[c].z >> 8, w8[c][3] = cur[c].w >> 8;
  }
  uint32_t s2[C], m2[C], zze[C], zzo[C];
  half2 h[C][MT][2];  // two chains of partial sums (even and odd runs), summed into fp32 per strip
  static_for<P>([&](auto tc) {
    constexpr int t = decltype(tc)::value;
    if constexpr (t % TPG == 0) {  // a new group: its scales (zeros, offsets) for the C columns
      [[maybe_unused]] constexpr int g = t / TPG;
      [[maybe_unused]] const unsigned off = PF ? 0u : group_of(at.u0 + t, p.group_magic) * p.N;
      [[maybe_unused]] uint32_t v[(C + 1) / 2];
      if constexpr (PF) {
#pragma unroll
        for (int c = 0; c < C; c++) s2[c] = dup16(tb.s[g], c);
      } else {
        load_row16<C>(sc + off, v);
#pragma unroll
        for (int c = 0; c < C; c++) s2[c] = dup16(v, c);
      }
      if constexpr (MODE == OFF) {
        if constexpr (PF) {
#pragma unroll
          for (int c = 0; c < C; c++) m2[c] = dup16(tb.m[g], c);
        } else {
          load_row16<C>(of + off, v);
#pragma unroll
          for (int c = 0; c < C; c++) m2[c] = dup16(v, c);
        }
      }
      if constexpr (MODE == ZP) {
        uint32_t z4;
        if constexpr (PF) z4 = tb.z[g];
        else z4 = load_row8<C>(zp + off);
#pragma unroll
        for (int c = 0; c < C; c++) {
          const uint32_t zz = __byte_perm(z4, 0, 0x4040 + 0x0101 * c);  // z | z << 16
          zze[c] = zz_even_of(zz), zzo[c] = zz_odd_of(zz);
        }
      }
    }
    if constexpr (MODE != ZP) {
#pragma unroll
      for (int c = 0; c < C; c++) zze[c] = zz_sym[0], zzo[c] = zz_sym[1];
    }
    const int row = at.row0 + (t << (p.log2r + 1));
    uint4 xv[MT];
#pragma unroll
    for (int m = 0; m < MT; m++) xv[m] = load_x(xm[m] + row);
#pragma unroll
    for (int c = 0; c < C; c++) {
      const uint32_t wd[4] = {cur[c].x, cur[c].y, cur[c].z, cur[c].w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const half2 q = PairF16<BITS>::template get<t>(wd[j], w8[c][j], zze[c], zzo[c]);
        const half2 w = MODE == OFF ? __hfma2(q, as_h2(s2[c]), as_h2(m2[c])) : __hmul2(q, as_h2(s2[c]));
#pragma unroll
        for (int m = 0; m < MT; m++) {
          const uint32_t xs[4] = {xv[m].x, xv[m].y, xv[m].z, xv[m].w};
          if (t < 2 && j == 0)
            h[c][m][t & 1] = __hmul2(w, as_h2(xs[j]));
          else
            h[c][m][t & 1] = __hfma2(w, as_h2(xs[j]), h[c][m][t & 1]);
        }
      }
    }
  });
#pragma unroll
  for (int c = 0; c < C; c++)
#pragma unroll
    for (int m = 0; m < MT; m++) {
      const float2 f = __half22float2(__hadd2(h[c][m][0], h[c][m][1]));
      acc[c][m] += f.x + f.y;
    }
}

// ---------------------------------------------------------------------------------------------
// bf16: codes to fp32 q - z directly

__device__ __forceinline__ float f32(uint32_t u) { return __uint_as_float(u); }

// a scale / offset table entry (the low 16 bits of raw) in fp32
__device__ __forceinline__ float table_f32(uint32_t raw, bool bf16) {
  return bf16 ? f32(raw << 16) : __half2float(__ushort_as_half(static_cast<unsigned short>(raw)));
}

template <int BITS>
struct ValsF32;

template <>
struct ValsF32<4> {
  static constexpr int P = 4, NKZ = 5;
  // field position f of a word: the nibble ORed under 2^23 in place at bits 4f (f <= 4), giving
  // 2^23 + 16^f q, exact; times 16^-f plus kz[f] = -(2^(23-4f) + z) leaves q - z. Fields 5..7 are
  // read from w >> 12 at positions 2..4. Run T holds field T (row 2r) and field T + 4 (row 2r+1).
  template <int T>
  static __device__ __forceinline__ void get(uint32_t w, uint32_t w12, const float* kz, float& lo, float& hi) {
    constexpr float SCALE[5] = {1.f, 0.0625f, 0.00390625f, 0.000244140625f, 0.0000152587890625f};
    lo = fmaf(f32(and_or<(0xFu << (4 * T)), 0x4B000000u>(w)), SCALE[T], kz[T]);
    if constexpr (T == 0)
      hi = fmaf(f32(and_or<0xF0000u, 0x4B000000u>(w)), SCALE[4], kz[4]);
    else
      hi = fmaf(f32(and_or<(0xFu << (4 * (T + 1))), 0x4B000000u>(w12)), SCALE[T + 1], kz[T + 1]);
  }
  static __device__ __forceinline__ void zero_consts(float z, float* kz) {
#pragma unroll
    for (int f = 0; f < 5; f++) kz[f] = -(static_cast<float>(1 << (23 - 4 * f)) + z);
  }
};

template <>
struct ValsF32<8> {
  static constexpr int P = 2, NKZ = 1;
  // byte T + 2j under the exponent of 2^23: 2^23 + q, plus -(2^23 + z)
  template <int T>
  static __device__ __forceinline__ void get(uint32_t w, uint32_t, const float* kz, float& lo, float& hi) {
    lo = f32(__byte_perm(w, 0x4B000000u, 0x7440 + T)) + kz[0];
    hi = f32(__byte_perm(w, 0x4B000000u, 0x7442 + T)) + kz[0];
  }
  static __device__ __forceinline__ void zero_consts(float z, float* kz) { kz[0] = -(8388608.f + z); }
};

template <int BITS, int MT, int C, int MODE, int TPG, bool PF, int NG>
__device__ __forceinline__ void strip_bf16(const GemvParams& p, const uint4* cur, StripAt at,
                                           const __nv_bfloat16* const* xm, const uint16_t* sc, const uint8_t* zp,
                                           const uint16_t* of, const float* kz_sym, const StripTables<C, MODE, NG>& tb,
                                           float (*acc)[MT]) {
  constexpr int P = ValsF32<BITS>::P, NKZ = ValsF32<BITS>::NKZ;
  const bool sbf = p.scale_bf16 != 0;
  float s[C], mo[C], kz[C][NKZ];
  if constexpr (MODE != ZP) {
#pragma unroll
    for (int c = 0; c < C; c++)
#pragma unroll
      for (int f = 0; f < NKZ; f++) kz[c][f] = kz_sym[f];
  }
  static_for<P>([&](auto tc) {
    constexpr int t = decltype(tc)::value;
    if constexpr (t % TPG == 0) {
      [[maybe_unused]] constexpr int g = t / TPG;
      [[maybe_unused]] const unsigned off = PF ? 0u : group_of(at.u0 + t, p.group_magic) * p.N;
      [[maybe_unused]] uint32_t v[(C + 1) / 2];
      if constexpr (PF) {
#pragma unroll
        for (int e = 0; e < (C + 1) / 2; e++) v[e] = tb.s[g][e];
      } else {
        load_row16<C>(sc + off, v);
      }
#pragma unroll
      for (int c = 0; c < C; c++) s[c] = table_f32(v[c / 2] >> (16 * (c % 2)), sbf);
      if constexpr (MODE == OFF) {
        if constexpr (PF) {
#pragma unroll
          for (int e = 0; e < (C + 1) / 2; e++) v[e] = tb.m[g][e];
        } else {
          load_row16<C>(of + off, v);
        }
#pragma unroll
        for (int c = 0; c < C; c++) mo[c] = table_f32(v[c / 2] >> (16 * (c % 2)), sbf);
      }
      if constexpr (MODE == ZP) {
        uint32_t z4;
        if constexpr (PF) z4 = tb.z[g];
        else z4 = load_row8<C>(zp + off);
#pragma unroll
        for (int c = 0; c < C; c++) ValsF32<BITS>::zero_consts(static_cast<float>((z4 >> (8 * c)) & 0xFF), kz[c]);
      }
    }
    const int row = at.row0 + (t << (p.log2r + 1));
#pragma unroll
    for (int m = 0; m < MT; m++) {
      const uint4 xr = load_x(xm[m] + row);
      const uint32_t xw[4] = {xr.x, xr.y, xr.z, xr.w};
      float xf[8];
#pragma unroll
      for (int j = 0; j < 4; j++) xf[2 * j] = f32(xw[j] << 16), xf[2 * j + 1] = f32(xw[j] & 0xFFFF0000u);
      float sx = 0.f;  // OFF: the offset multiplies the sum of x over the run's rows
      if constexpr (MODE == OFF) {
#pragma unroll
        for (int e = 0; e < 8; e++) sx += xf[e];
      }
#pragma unroll
      for (int c = 0; c < C; c++) {
        const uint32_t wd[4] = {cur[c].x, cur[c].y, cur[c].z, cur[c].w};
        float part = 0.f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          float lo, hi;
          ValsF32<BITS>::template get<t>(wd[j], wd[j] >> 12, kz[c], lo, hi);
          part = fmaf(lo, xf[2 * j], part);
          part = fmaf(hi, xf[2 * j + 1], part);
        }
        acc[c][m] = fmaf(s[c], part, acc[c][m]);
        if constexpr (MODE == OFF) acc[c][m] = fmaf(mo[c], sx, acc[c][m]);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The kernel

template <typename T>
__device__ __forceinline__ float act_to_f32(T v);
template <>
__device__ __forceinline__ float act_to_f32<half>(half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float act_to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T f32_to_act(float v);
template <>
__device__ __forceinline__ half f32_to_act<half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 f32_to_act<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// grid: N / C blocks of 32 * warps threads (C divides N; warps <= MAX_WARPS). PF: each strip's tables are
// loaded with its weights, a strip ahead (StripTables), not run by run inside it.
template <typename T, int BITS, int MT, int C, int MODE, int TPG, bool PF>
__global__ void __launch_bounds__(32 * MAX_WARPS) gemv_kernel(const GemvParams p) {
  constexpr int P = 16 / BITS, NG = PF ? P / TPG : 1;
  using Tables = StripTables<C, MODE, NG>;
  __shared__ float red[MAX_WARPS][C * MT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int n0 = blockIdx.x * C;
  // Strip i covers words [128 i, 128 i + 128) of every column, 128 / R whole blocks; this lane's
  // words 128 i + 4 lane .. + 3 sit in block 128 i / R + lb at word offset r0 of it, so they hold
  // rows i * 256 P + lb * 2RP + 2 r0 + [0, 8) of run 0 (of run t: + t * 2R).
  const int lb = (4 * lane) >> p.log2r, r0 = (4 * lane) & ((1 << p.log2r) - 1);
  const int lane_row = (lb << (p.log2r + 1)) * P + 2 * r0;
  const int blocks_per_strip = 128 >> p.log2r;
  const int strips = (p.KW + 127) >> 7;
  const uint4* col[C];  // this lane's 16 bytes of strip 0 of each column; strip i: + 32 i
#pragma unroll
  for (int c = 0; c < C; c++)
    col[c] = pinned(reinterpret_cast<const uint4*>(p.words + static_cast<size_t>(n0 + c) * p.KW) + lane);
  const T* xm[MT];
#pragma unroll
  for (int m = 0; m < MT; m++)
    xm[m] = pinned(static_cast<const T*>(p.x) + static_cast<size_t>(min(m, p.M - 1)) * p.lda + lane_row);
  const uint16_t* sc = pinned(p.scales + n0);
  const uint8_t* zp = MODE == ZP ? pinned(p.zeros + n0) : nullptr;
  const uint16_t* of = MODE == OFF ? pinned(p.offsets + n0) : nullptr;
  const uint64_t policy = evict_first_policy();
  float acc[C][MT];
#pragma unroll
  for (int c = 0; c < C; c++)
#pragma unroll
    for (int m = 0; m < MT; m++) acc[c][m] = 0.f;
  // the zero constants of SYM / OFF
  const uint32_t zz1 = static_cast<uint32_t>(p.zero_const) * 0x00010001u;
  const uint32_t zz_sym[2] = {zz_even_of(zz1), zz_odd_of(zz1)};
  float kz_sym[ValsF32<BITS>::NKZ];
  ValsF32<BITS>::zero_consts(static_cast<float>(p.zero_const), kz_sym);

  // strip i of the C columns (none past the last word), and under PF its tables
  auto load = [&](uint4* dst, Tables& tdst, int i) {
    if (128 * i + 4 * lane < p.KW) {
#pragma unroll
      for (int c = 0; c < C; c++) dst[c] = load_stream(col[c] + 32 * i, policy);
      if constexpr (PF) {
        const int u0 = (i * blocks_per_strip + lb) * P;
#pragma unroll
        for (int g = 0; g < NG; g++) {
          const unsigned off = group_of(u0 + g * TPG, p.group_magic) * p.N;
          load_row16_now<C>(sc + off, tdst.s[g]);
          if constexpr (MODE == OFF) load_row16_now<C>(of + off, tdst.m[g]);
          if constexpr (MODE == ZP) tdst.z[g] = load_row8_now<C>(zp + off);
        }
      }
    }
  };
  // Two register buffers: strip i + warps loads into one while strip i, in the other, is decoded.
  uint4 buf[2][C];
  Tables tbuf[2];
  load(buf[0], tbuf[0], warp);
  auto step = [&](const uint4* cur, const Tables& tcur, uint4* nxt, Tables& tnxt, int i) {
    load(nxt, tnxt, i + warps);
    if (128 * i + 4 * lane < p.KW) {
      const StripAt at = {(i * blocks_per_strip + lb) * P, i * 256 * P};
      if constexpr (std::is_same_v<T, half>)
        strip_f16<BITS, MT, C, MODE, TPG, PF, NG>(p, cur, at, xm, sc, zp, of, zz_sym, tcur, acc);
      else
        strip_bf16<BITS, MT, C, MODE, TPG, PF, NG>(p, cur, at, xm, sc, zp, of, kz_sym, tcur, acc);
    }
  };
  for (int i = warp; i < strips; i += 2 * warps) {
    step(buf[0], tbuf[0], buf[1], tbuf[1], i);
    if (i + warps < strips) step(buf[1], tbuf[1], buf[0], tbuf[0], i + warps);
  }

#pragma unroll
  for (int c = 0; c < C; c++)
#pragma unroll
    for (int m = 0; m < MT; m++) {
      float v = acc[c][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
      if (lane == 0) red[warp][c * MT + m] = v;
    }
  __syncthreads();
  for (int e = threadIdx.x; e < C * MT; e += blockDim.x) {
    const int c = e / MT, m = e % MT, n = n0 + c;
    if (m >= p.M) continue;
    float v = 0.f;
    for (int w = 0; w < warps; w++) v += red[w][e];  // a fixed order: deterministic
    if (p.bias != nullptr) v += act_to_f32<T>(static_cast<const T*>(p.bias)[n]);
    static_cast<T*>(p.y)[static_cast<size_t>(m) * p.ldy + n] = f32_to_act<T>(v);
  }
}

}  // namespace flotilla::gemv
