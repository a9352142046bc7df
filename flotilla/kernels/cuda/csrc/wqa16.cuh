// flotilla's W4A16 / W8A16 dequant-matmul for NVIDIA GPUs (sm_80 and later): y = x @ W (+ bias).
//
// The weight is repacked at load (flotilla/kernels/cuda/layout.py) so that one 16-byte load per
// lane holds, for a 16 (k) x 64 (n) tile, exactly the B fragments of eight m16n8k16 tensor-core
// MMAs (W4: one load; W8: two). Codes become fp16/bf16 pairs with a few integer ops (the magic
// exponent trick: OR a nibble / byte under the exponent of 1024 or 128, subtract the zero), get
// the group scale, and feed mma.sync straight from registers. Activations, weights and scales
// stream global -> shared through a STAGES-deep cp.async pipeline; each block's 8 warps split
// its tile along n (NW warps of 64 columns) and k (KW warps), and reduce across k at the end.
// Thin problems are split along k over the grid; the last block of a tile to finish (an atomic
// counter that it resets) sums the fp32 partials in split order, so results are deterministic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace flotilla {

struct Params {
  const void* x;         // [M, K] activations (T), row stride lda elements, 16-byte aligned rows
  const int4* w;         // packed codes: [K_pad/16][N_pad/64][bits/4][32 lanes] x 16 bytes
  const void* scales;    // [G_pad][N_pad/64][8][8] T: scale of (group, c*64 + 8*i + g) at [g][i]
  const void* zeros;     // same layout as scales (zero points as T), or null: symmetric
  const void* bias;      // [N] T, or null
  void* y;               // [M, N] T, row stride ldy
  float* ws;             // [splits][M][N_pad] fp32 partial sums (splits > 1)
  int* counters;         // [m_blocks * n_tiles], zero between launches
  int M, K, N, K_pad, N_pad, lda, ldy;
  int splits;
  int zero;              // the zero point of a symmetric weight
  unsigned group_magic;  // ceil(2^32 / slices per group), slices per group >= 2: slice -> group
};

// ---------------------------------------------------------------------------------------------
// PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const int n = pred ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}

__device__ __forceinline__ void cp_async16_stream(void* smem, const void* gmem, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "l"(policy));
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b);

template <>
__device__ __forceinline__ void mma16816<half>(float* c, const uint32_t* a, const uint32_t* b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const uint32_t* a, const uint32_t* b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// (a & b) | c in one LOP3: written in C, the compiler splits it in two (a SASS LOP3 takes one
// immediate), so the constants go in as registers.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Number types

template <typename T>
struct Num;

template <>
struct Num<half> {
  using T2 = half2;
  static __device__ __forceinline__ float to_float(half v) { return __half2float(v); }
  static __device__ __forceinline__ half2 pair(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ half2 dup(half v) { return __half2half2(v); }
  static __device__ __forceinline__ half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Num<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat162 pair(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ __nv_bfloat162 dup(__nv_bfloat16 v) { return __bfloat162bfloat162(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <typename V>
__device__ __forceinline__ uint32_t as_u32(V v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename V>
__device__ __forceinline__ V from_u32(uint32_t u) {
  return *reinterpret_cast<V*>(&u);
}

// ---------------------------------------------------------------------------------------------
// Dequantization of one lane's words into B fragments: frag[i][0] = rows (2t, 2t+1), frag[i][1] =
// rows (2t+8, 2t+9) of column 8i+g of the tile, as a T pair with the lower row in the low half.
//
// W4 word j of a lane holds tiles a = 2j and b = 2j+1 (layout.py): nibble p = a' + 4*r where
// r is the row parity, a' & 1 picks the tile and a' >> 1 adds 8 rows. So (w & 0x000f000f) holds
// tile a's rows (2t, 2t+1), (w & 0x00f000f0) tile b's, and the same of w >> 8 the rows + 8.
// W8 word i holds tile i: bytes (2t, 2t+1, 2t+8, 2t+9).

template <typename T, int BITS>
struct Deq;

template <>
struct Deq<half, 4> {
  struct Z {
    half2 lo, hi;  // 1024 + z, and -(64 + z)
  };
  static __device__ __forceinline__ Z zconst(float z) {
    return {__float2half2_rn(1024.f + z), __float2half2_rn(-64.f - z)};
  }
  static __device__ __forceinline__ void slice(const uint32_t* w, const half* s, const Z* z, uint32_t (*frag)[2]) {
    const half2 sixteenth = __float2half2_rn(0.0625f);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int a = 2 * j, b = 2 * j + 1;
      const uint32_t u = w[j], v = w[j] >> 8;
      half2 p0 = __hsub2(from_u32<half2>(and_or(u, 0x000f000fu, 0x64006400u)), z[a].lo);
      half2 p1 = __hfma2(from_u32<half2>(and_or(u, 0x00f000f0u, 0x64006400u)), sixteenth, z[b].hi);
      half2 p2 = __hsub2(from_u32<half2>(and_or(v, 0x000f000fu, 0x64006400u)), z[a].lo);
      half2 p3 = __hfma2(from_u32<half2>(and_or(v, 0x00f000f0u, 0x64006400u)), sixteenth, z[b].hi);
      const half2 sa = __half2half2(s[a]), sb = __half2half2(s[b]);
      frag[a][0] = as_u32(__hmul2(p0, sa));
      frag[b][0] = as_u32(__hmul2(p1, sb));
      frag[a][1] = as_u32(__hmul2(p2, sa));
      frag[b][1] = as_u32(__hmul2(p3, sb));
    }
  }
};

template <>
struct Deq<__nv_bfloat16, 4> {
  using B2 = __nv_bfloat162;
  struct Z {
    B2 lo;  // 128 + z
  };
  static __device__ __forceinline__ Z zconst(float z) { return {__float2bfloat162_rn(128.f + z)}; }
  static __device__ __forceinline__ void slice(const uint32_t* w, const __nv_bfloat16* s, const Z* z,
                                               uint32_t (*frag)[2]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int a = 2 * j, b = 2 * j + 1;
      const uint32_t u = w[j];
      B2 p0 = __hsub2(from_u32<B2>(and_or(u, 0x000f000fu, 0x43004300u)), z[a].lo);
      B2 p1 = __hsub2(from_u32<B2>(and_or(u >> 4, 0x000f000fu, 0x43004300u)), z[b].lo);
      B2 p2 = __hsub2(from_u32<B2>(and_or(u >> 8, 0x000f000fu, 0x43004300u)), z[a].lo);
      B2 p3 = __hsub2(from_u32<B2>(and_or(u >> 12, 0x000f000fu, 0x43004300u)), z[b].lo);
      const B2 sa = __bfloat162bfloat162(s[a]), sb = __bfloat162bfloat162(s[b]);
      frag[a][0] = as_u32(__hmul2(p0, sa));
      frag[b][0] = as_u32(__hmul2(p1, sb));
      frag[a][1] = as_u32(__hmul2(p2, sa));
      frag[b][1] = as_u32(__hmul2(p3, sb));
    }
  }
};

template <>
struct Deq<half, 8> {
  struct Z {
    half2 lo;  // 1024 + z
  };
  static __device__ __forceinline__ Z zconst(float z) { return {__float2half2_rn(1024.f + z)}; }
  static __device__ __forceinline__ void slice(const uint32_t* w, const half* s, const Z* z, uint32_t (*frag)[2]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const half2 si = __half2half2(s[i]);
      half2 p0 = __hsub2(from_u32<half2>(__byte_perm(w[i], 0x64646464u, 0x4140)), z[i].lo);
      half2 p1 = __hsub2(from_u32<half2>(__byte_perm(w[i], 0x64646464u, 0x4342)), z[i].lo);
      frag[i][0] = as_u32(__hmul2(p0, si));
      frag[i][1] = as_u32(__hmul2(p1, si));
    }
  }
};

template <>
struct Deq<__nv_bfloat16, 8> {
  using B2 = __nv_bfloat162;
  struct Z {
    float lo;  // 2^23 + z
  };
  static __device__ __forceinline__ Z zconst(float z) { return {8388608.f + z}; }
  static __device__ __forceinline__ void slice(const uint32_t* w, const __nv_bfloat16* s, const Z* z,
                                               uint32_t (*frag)[2]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      // byte k under the exponent of 2^23: the float 2^23 + q, exact; q - z is exact in bf16
      const float f0 = __uint_as_float(__byte_perm(w[i], 0x4B000000u, 0x7440)) - z[i].lo;
      const float f1 = __uint_as_float(__byte_perm(w[i], 0x4B000000u, 0x7441)) - z[i].lo;
      const float f2 = __uint_as_float(__byte_perm(w[i], 0x4B000000u, 0x7442)) - z[i].lo;
      const float f3 = __uint_as_float(__byte_perm(w[i], 0x4B000000u, 0x7443)) - z[i].lo;
      const B2 si = __bfloat162bfloat162(s[i]);
      frag[i][0] = as_u32(__hmul2(__floats2bfloat162_rn(f0, f1), si));
      frag[i][1] = as_u32(__hmul2(__floats2bfloat162_rn(f2, f3), si));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Tile configurations. THREADS = 256 = 32 * NW * KW; a stage covers SLICES = KW * KS slices of
// 16 input rows and NW chunks of 64 output columns.

template <int NW_, int KS_>
struct Tile {
  static constexpr int NW = NW_, KW = 8 / NW_, KS = KS_;
  static constexpr int THREADS = 256;
  static constexpr int SLICES = KW * KS;
  static constexpr int TILE_K = 16 * SLICES;
  static constexpr int TILE_N = 64 * NW;
};

using ThinTile = Tile<2, 2>;  // 128 (n) x 128 (k): decode, narrow outputs
using WideTile = Tile<4, 2>;  // 256 (n) x 64 (k): more rows, less activation traffic per weight

// Swizzled 16-byte chunk of an activation row in shared memory, so that the 8 rows one ldmatrix
// phase reads land in 8 different bank groups (rows are TILE_K * 2 bytes apart).
template <int CHUNKS>
__device__ __forceinline__ int swizzle(int row, int ch) {
  static_assert(CHUNKS >= 8, "rows of at least 128 bytes");
  return ch ^ (row & 7);
}

constexpr int K_ALIGN = 256;  // K_pad: a multiple of every TILE_K (layout.py K_ALIGN)
constexpr int N_ALIGN = 256;  // N_pad: a multiple of every TILE_N (layout.py N_ALIGN)

// floor(slice / d) as one multiply-high, with magic = ceil(2^32 / d): exact for slice * d < 2^32.
__device__ __forceinline__ int group_of(int slice, unsigned magic) {
  return static_cast<int>(__umulhi(static_cast<unsigned>(slice), magic));
}

template <typename T, int BITS, int MB, typename TL, bool ZP, int STAGES>
struct Kernel {
  static constexpr int NW = TL::NW, KW = TL::KW, KS = TL::KS, SLICES = TL::SLICES;
  static constexpr int TILE_K = TL::TILE_K, TILE_N = TL::TILE_N, THREADS = TL::THREADS;
  static constexpr int U = BITS / 4;  // 16-byte loads per lane per (slice, chunk)
  static constexpr int BUNIT = 32 * U;
  static constexpr int A_BYTES = MB * 16 * TILE_K * 2;
  static constexpr int B_BYTES = SLICES * NW * BUNIT * 16;
  static constexpr int S_BYTES = SLICES * NW * 128;  // at most SLICES group rows a stage
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + S_BYTES * (ZP ? 2 : 1);
  static constexpr int RED_BYTES = (KW - 1) * NW * MB * 32 * 32 * 4;
  static constexpr int SMEM = STAGES * STAGE_BYTES > RED_BYTES ? STAGES * STAGE_BYTES : RED_BYTES;
  static constexpr int MIN_BLOCKS = MB <= 2 ? 2 : 1;
  using D = Deq<T, BITS>;
  using T2 = typename Num<T>::T2;

  // Per-thread copy state: what this thread copies into every stage, as pointers that advance
  // by a constant each k-tile (the index arithmetic runs once, not once per stage).
  static constexpr int ACH = TILE_K / 8;  // 16-byte chunks per activation row
  static constexpr int A_ITERS = (MB * 16 * ACH + THREADS - 1) / THREADS;
  static constexpr int B_ITERS = SLICES * NW * BUNIT / THREADS;
  struct Loader {
    const T* a_src[A_ITERS];
    int a_dst[A_ITERS];  // element offset in the stage's activation tile
    int a_k[A_ITERS];    // input column of the chunk at the current k-tile (K: out of range)
    const int4* b_src;
    size_t b_iter;  // int4 stride between this thread's weight copies of one stage
    size_t b_step;  // int4 stride between k-tiles
    int kk;         // first slice of the current k-tile
  };

  static __device__ __forceinline__ Loader make_loader(const Params& p, int kt, int ntile, int mblock) {
    Loader ld;
    const int tid = threadIdx.x;
    const T* x = static_cast<const T*>(p.x);
#pragma unroll
    for (int it = 0; it < A_ITERS; it++) {
      const int i = it * THREADS + tid;
      const int row = i / ACH, ch = i % ACH;
      const int m = mblock * MB * 16 + row;
      const bool ok = i < MB * 16 * ACH && m < p.M;
      ld.a_src[it] = x + (ok ? static_cast<size_t>(m) * p.lda + kt * TILE_K + ch * 8 : 0);
      ld.a_dst[it] = row * TILE_K + swizzle<ACH>(row, ch) * 8;
      ld.a_k[it] = ok ? kt * TILE_K + ch * 8 : (i < MB * 16 * ACH ? p.K : -1);  // -1: no copy at all
    }
    const int nc = p.N_pad / 64;
    static_assert(THREADS % (NW * BUNIT) == 0 && SLICES * NW * BUNIT % THREADS == 0, "whole slices a copy round");
    const int s = tid / (NW * BUNIT), r = tid % (NW * BUNIT);
    ld.kk = kt * SLICES;
    ld.b_src = p.w + (static_cast<size_t>(ld.kk + s) * nc + ntile * NW) * BUNIT + r;
    ld.b_iter = static_cast<size_t>(THREADS / (NW * BUNIT)) * nc * BUNIT;  // slices a copy round covers
    ld.b_step = static_cast<size_t>(SLICES) * nc * BUNIT;
    return ld;
  }

  static __device__ __forceinline__ void advance(Loader& ld) {
#pragma unroll
    for (int it = 0; it < A_ITERS; it++) {
      ld.a_src[it] += TILE_K;
      ld.a_k[it] += ld.a_k[it] >= 0 ? TILE_K : 0;
    }
    ld.b_src += ld.b_step;
    ld.kk += SLICES;
  }

  static __device__ __forceinline__ void load_stage(char* st, const Params& p, const Loader& ld, int ntile,
                                                    uint64_t policy) {
    const int tid = threadIdx.x;
    T* as = reinterpret_cast<T*>(st);
#pragma unroll
    for (int it = 0; it < A_ITERS; it++)
      if (ld.a_k[it] >= 0) {
        const bool in = ld.a_k[it] < p.K;  // else zero-fill, reading nothing (the source stays x itself)
        cp_async16(as + ld.a_dst[it], in ? ld.a_src[it] : static_cast<const T*>(p.x), in);
      }
    int4* bs = reinterpret_cast<int4*>(st + A_BYTES);
#pragma unroll
    for (int it = 0; it < B_ITERS; it++)
      cp_async16_stream(bs + it * THREADS + tid, ld.b_src + it * ld.b_iter, policy);
    const int gf = group_of(ld.kk, p.group_magic), gl = group_of(ld.kk + SLICES - 1, p.group_magic);
    int4* ss = reinterpret_cast<int4*>(st + A_BYTES + B_BYTES);
    if (tid < (gl - gf + 1) * NW * 8) {
      const int rr = tid / (NW * 8), q = tid % (NW * 8);
      const size_t off = (static_cast<size_t>(gf + rr) * (p.N_pad / 64) + ntile * NW) * 8 + q;
      cp_async16(ss + tid, static_cast<const int4*>(p.scales) + off, true);
      if (ZP) cp_async16(ss + S_BYTES / 16 + tid, static_cast<const int4*>(p.zeros) + off, true);
    }
  }

  // Per-thread shared-memory read offsets, the same in every stage.
  struct Reader {
    uint32_t a[KS][MB];  // byte offsets of the ldmatrix rows
    int b[KS];           // int4 offsets of the weight loads
  };

  static __device__ __forceinline__ Reader make_reader() {
    Reader rd;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nw = warp % NW, kw = warp / NW;
#pragma unroll
    for (int j = 0; j < KS; j++) {
      const int s = kw * KS + j;
#pragma unroll
      for (int mt = 0; mt < MB; mt++) {
        const int row = mt * 16 + (lane & 15), ch = 2 * s + (lane >> 4);
        rd.a[j][mt] = 2 * (row * TILE_K + swizzle<TILE_K / 8>(row, ch) * 8);
      }
      rd.b[j] = (s * NW + nw) * BUNIT + lane;
    }
    return rd;
  }

  static __device__ __forceinline__ void compute_stage(const char* st, const Params& p, int kk0, const Reader& rd,
                                                       float (*acc)[8][4], const typename D::Z* zsym) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nw = warp % NW, kw = warp / NW;
    const int4* bs = reinterpret_cast<const int4*>(st + A_BYTES);
    const int4* ss = reinterpret_cast<const int4*>(st + A_BYTES + B_BYTES);
    const int gf = group_of(kk0, p.group_magic);
#pragma unroll
    for (int j = 0; j < KS; j++) {
      const int s = kw * KS + j;
      uint32_t a[MB][4];
#pragma unroll
      for (int mt = 0; mt < MB; mt++) ldmatrix_x4(a[mt], st + rd.a[j][mt]);
      uint32_t w[4 * U];
#pragma unroll
      for (int h = 0; h < U; h++) {
        const int4 v = bs[rd.b[j] + h * 32];
        w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
      }
      const int gr = group_of(kk0 + s, p.group_magic) - gf;
      const int so = (gr * NW + nw) * 8 + lane / 4;
      const int4 sv = ss[so];
      const T* sc = reinterpret_cast<const T*>(&sv);
      typename D::Z zz[8];
      if (ZP) {
        const int4 zv = ss[S_BYTES / 16 + so];
        const T* zt = reinterpret_cast<const T*>(&zv);
#pragma unroll
        for (int i = 0; i < 8; i++) zz[i] = D::zconst(Num<T>::to_float(zt[i]));
      }
      uint32_t frag[8][2];
      D::slice(w, sc, ZP ? zz : zsym, frag);
#pragma unroll
      for (int mt = 0; mt < MB; mt++)
#pragma unroll
        for (int i = 0; i < 8; i++) mma16816<T>(acc[mt][i], a[mt], frag[i]);
    }
  }

  static __device__ __forceinline__ void store2(const Params& p, int m, int n, float v0, float v1) {
    T* y = static_cast<T*>(p.y);
    const T* bias = static_cast<const T*>(p.bias);
    if (bias != nullptr) {
      if (n < p.N) v0 += Num<T>::to_float(bias[n]);
      if (n + 1 < p.N) v1 += Num<T>::to_float(bias[n + 1]);
    }
    T* dst = y + static_cast<size_t>(m) * p.ldy + n;
    if ((p.N & 1) == 0 && (p.ldy & 1) == 0) {
      if (n < p.N) *reinterpret_cast<T2*>(dst) = Num<T>::pair(v0, v1);
    } else {
      if (n < p.N) dst[0] = Num<T>::from_float(v0);
      if (n + 1 < p.N) dst[1] = Num<T>::from_float(v1);
    }
  }

  static __device__ void run(const Params& p) {
    extern __shared__ __align__(16) char smem[];
    __shared__ int s_last;
    const int n_tiles = p.N_pad / TILE_N;
    const int m_blocks = (p.M + MB * 16 - 1) / (MB * 16);
    // blocks of one (n tile, split) are adjacent, so their shared weight tiles meet in L2
    const int mblock = blockIdx.x % m_blocks;
    const int split = (blockIdx.x / m_blocks) % p.splits;
    const int ntile = blockIdx.x / (m_blocks * p.splits);
    const int kt_total = p.K_pad / TILE_K;
    const int kt_begin = static_cast<int>(static_cast<long long>(split) * kt_total / p.splits);
    const int kt_end = static_cast<int>(static_cast<long long>(split + 1) * kt_total / p.splits);
    const int nt = kt_end - kt_begin;
    const uint64_t policy = evict_first_policy();

    float acc[MB][8][4];
#pragma unroll
    for (int mt = 0; mt < MB; mt++)
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[mt][i][r] = 0.f;
    typename D::Z zsym[8];
#pragma unroll
    for (int i = 0; i < 8; i++) zsym[i] = D::zconst(static_cast<float>(p.zero));

    Loader ld = make_loader(p, kt_begin, ntile, mblock);
    const Reader rd = make_reader();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
      if (s < nt) {
        load_stage(smem + s * STAGE_BYTES, p, ld, ntile, policy);
        advance(ld);
      }
      cp_async_commit();
    }
    for (int t = 0; t < nt; t++) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage t landed for everyone; everyone is done with stage t - 1's buffer
      if (t + STAGES - 1 < nt) {
        load_stage(smem + ((t + STAGES - 1) % STAGES) * STAGE_BYTES, p, ld, ntile, policy);
        advance(ld);
      }
      cp_async_commit();
      compute_stage(smem + (t % STAGES) * STAGE_BYTES, p, (kt_begin + t) * SLICES, rd, acc, zsym);
    }
    cp_async_wait<0>();
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nw = warp % NW, kw = warp / NW;
    if (KW > 1) {  // sum the KW warps of each column chunk into the kw == 0 warp
      float* red = reinterpret_cast<float*>(smem);
      if (kw > 0) {
#pragma unroll
        for (int mt = 0; mt < MB; mt++)
#pragma unroll
          for (int i = 0; i < 8; i++)
#pragma unroll
            for (int r = 0; r < 4; r++)
              red[(((((kw - 1) * NW + nw) * MB + mt) * 8 + i) * 4 + r) * 32 + lane] = acc[mt][i][r];
      }
      __syncthreads();
      if (kw == 0) {
#pragma unroll
        for (int q = 1; q < KW; q++)
#pragma unroll
          for (int mt = 0; mt < MB; mt++)
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
              for (int r = 0; r < 4; r++)
                acc[mt][i][r] += red[(((((q - 1) * NW + nw) * MB + mt) * 8 + i) * 4 + r) * 32 + lane];
      }
    }

    const int m0 = mblock * MB * 16, n0 = ntile * TILE_N;
    const int g = lane / 4, tq = lane % 4;
    if (p.splits == 1) {
      if (kw == 0) {
#pragma unroll
        for (int mt = 0; mt < MB; mt++)
#pragma unroll
          for (int i = 0; i < 8; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
              const int m = m0 + mt * 16 + g + 8 * h, n = n0 + nw * 64 + 8 * i + 2 * tq;
              if (m < p.M) store2(p, m, n, acc[mt][i][2 * h], acc[mt][i][2 * h + 1]);
            }
      }
      return;
    }
    if (kw == 0) {
      float* ws = p.ws + static_cast<size_t>(split) * p.M * p.N_pad;
#pragma unroll
      for (int mt = 0; mt < MB; mt++)
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const int m = m0 + mt * 16 + g + 8 * h, n = n0 + nw * 64 + 8 * i + 2 * tq;
            if (m < p.M)
              __stcg(reinterpret_cast<float2*>(ws + static_cast<size_t>(m) * p.N_pad + n),
                     make_float2(acc[mt][i][2 * h], acc[mt][i][2 * h + 1]));
          }
      __threadfence();
    }
    __syncthreads();
    const int tile_id = mblock * n_tiles + ntile;
    if (threadIdx.x == 0) {
      const int prev = atomicAdd(p.counters + tile_id, 1);
      s_last = prev == p.splits - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int rows = min(MB * 16, p.M - m0);
    for (int idx = threadIdx.x; idx < rows * (TILE_N / 2); idx += THREADS) {
      const int r = idx / (TILE_N / 2), n = n0 + 2 * (idx % (TILE_N / 2));
      const size_t off = static_cast<size_t>(m0 + r) * p.N_pad + n;
      float2 sum = make_float2(0.f, 0.f);
      for (int sp = 0; sp < p.splits; sp++) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(p.ws + static_cast<size_t>(sp) * p.M * p.N_pad + off));
        sum.x += v.x, sum.y += v.y;
      }
      store2(p, m0 + r, n, sum.x, sum.y);
    }
    if (threadIdx.x == 0) p.counters[tile_id] = 0;  // ready for the next launch (graph replays)
  }
};



template <typename K>
__global__ void __launch_bounds__(256, K::MIN_BLOCKS) wqa16_kernel(const Params p) {
  K::run(p);
}

// ---------------------------------------------------------------------------------------------
// Dequantize the whole weight to a dense [K_pad, N_pad] T matrix (for large batches: then cuBLAS).
// One warp per 16 x 64 unit; through shared memory so that the stores are whole 128-byte rows.

struct DequantParams {
  const int4* w;
  const void* scales;
  const void* zeros;
  void* out;  // [K_pad, N_pad] T
  int K_pad, N_pad, zero;
  unsigned group_magic;
};

template <typename T, int BITS, bool ZP>
__global__ void __launch_bounds__(256) dequant_kernel(const DequantParams p) {
  using D = Deq<T, BITS>;
  constexpr int U = BITS / 4;
  __shared__ __align__(16) T tile[8][16][64 + 8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nc = p.N_pad / 64;
  const int unit = blockIdx.x * 8 + warp;
  if (unit >= (p.K_pad / 16) * nc) return;
  const int kk = unit / nc, c = unit % nc;
  uint32_t w[4 * U];
#pragma unroll
  for (int h = 0; h < U; h++) {
    const int4 v = p.w[static_cast<size_t>(unit) * 32 * U + h * 32 + lane];
    w[4 * h] = v.x, w[4 * h + 1] = v.y, w[4 * h + 2] = v.z, w[4 * h + 3] = v.w;
  }
  const size_t so = (static_cast<size_t>(group_of(kk, p.group_magic)) * nc + c) * 8 + lane / 4;
  const int4 sv = static_cast<const int4*>(p.scales)[so];
  typename D::Z zz[8];
  if (ZP) {
    const int4 zv = static_cast<const int4*>(p.zeros)[so];
    const T* zt = reinterpret_cast<const T*>(&zv);
#pragma unroll
    for (int i = 0; i < 8; i++) zz[i] = D::zconst(Num<T>::to_float(zt[i]));
  } else {
#pragma unroll
    for (int i = 0; i < 8; i++) zz[i] = D::zconst(static_cast<float>(p.zero));
  }
  uint32_t frag[8][2];
  D::slice(w, reinterpret_cast<const T*>(&sv), zz, frag);
  const int g = lane / 4, tq = lane % 4;
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const typename Num<T>::T2 v = from_u32<typename Num<T>::T2>(frag[i][h]);
      tile[warp][2 * tq + 8 * h][8 * i + g] = v.x;
      tile[warp][2 * tq + 8 * h + 1][8 * i + g] = v.y;
    }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int q = lane + 32 * r, row = q / 8, col = (q % 8) * 8;
    *reinterpret_cast<int4*>(out + static_cast<size_t>(kk * 16 + row) * p.N_pad + c * 64 + col) =
        *reinterpret_cast<const int4*>(&tile[warp][row][col]);
  }
}

}  // namespace flotilla
