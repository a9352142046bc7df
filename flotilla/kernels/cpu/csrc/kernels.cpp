// See kernels.h for the packed layouts and the per-element arithmetic every path follows.
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <utility>

namespace flotilla_cpu {
namespace {

// 4-bit codes are packed XOR 8, so that a nibble read as a signed 4-bit number is q - 8.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// ------------------------------------------------------------------------------- AVX-512
constexpr int kLanes = 16;
constexpr int kRowBlock = 6;   // M > 1: rows that share each decoded weight vector
constexpr int kBlockVecs = 2;  // M > 1: vectors of kLanes columns per block
constexpr int kWideVecs = 4;   // M == 1: vectors per block (enough independent FMA chains)
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float v) { return _mm512_set1_ps(v); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vi load_w4(const int32_t* p) { return _mm512_loadu_si512(p); }
struct W4Decoder {  // nibble J of each lane through a 16-entry table (vpermps reads 4 index bits)
  const vf table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  template <int J>
  vf decode(vi q) const {
    if constexpr (J == 0) return _mm512_permutexvar_ps(q, table);
    else return _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4 * J), table);
  }
};
inline vf load_w8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ----------------------------------------------------------------------------------- AVX2
constexpr int kLanes = 8;
constexpr int kRowBlock = 4;
constexpr int kBlockVecs = 2;
constexpr int kWideVecs = 4;
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float v) { return _mm256_set1_ps(v); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vi load_w4(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
struct W4Decoder {  // sign-extend nibble J (shift it to the top, arithmetic shift down), convert
  template <int J>
  vf decode(vi q) const {
    if constexpr (J == 7) return _mm256_cvtepi32_ps(_mm256_srai_epi32(q, 28));
    else return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 28 - 4 * J), 28));
  }
};
inline vf load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
const char* kIsa = "avx2";
#else
#error "flotilla CPU kernels need AVX2, FMA and F16C (compile with -mavx2 -mfma -mf16c)"
#endif

constexpr int kTileVecs = kTile / kLanes;
static_assert(kTileVecs % kBlockVecs == 0 && kWideVecs % kTileVecs == 0, "blocks must tile the columns");

// Weights stream from memory once per call in decode; the hardware prefetcher alone keeps too
// few lines in flight for a core that is also busy decoding, so each stream is prefetched into
// L2 this far ahead (measured: ~1.3x faster on weights that are not in cache).
constexpr int kPrefetchBytes = 4096;
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1); }

template <typename F, int... J>
inline void for_each_nibble(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}

// acc[r][v] = sum over inputs k in [k0, k1), ascending, of x[r][k] * c[v][k] (fma chain).
template <Format F, int R, int NV>
inline void accumulate_group(const float* const* xr, const void* const* wv, int64_t k0, int64_t k1,
                             vf (&acc)[R][NV]) {
  if constexpr (F == Format::W4) {
    const W4Decoder dec;
    for (int64_t k = k0; k < k1; k += 8) {
      vi q[NV];
      for (int v = 0; v < NV; ++v) {
        const int32_t* w = static_cast<const int32_t*>(wv[v]) + (k / 8) * kTile;
        prefetch(w);
        q[v] = load_w4(w);
      }
      for_each_nibble([&](auto J) {
        vf c[NV];
        for (int v = 0; v < NV; ++v) c[v] = dec.template decode<J()>(q[v]);
        for (int r = 0; r < R; ++r) {
          const vf xv = vset1(xr[r][k + J()]);
          for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xv, c[v], acc[r][v]);
        }
      }, std::make_integer_sequence<int, 8>{});
    }
  } else {
    for (int64_t k = k0; k < k1; ++k) {
      vf c[NV];
      for (int v = 0; v < NV; ++v) {
        if constexpr (F == Format::W8) {
          const int8_t* w = static_cast<const int8_t*>(wv[v]) + k * kTile;
          if (v % kTileVecs == 0 && k % 2 == 0) prefetch(w);  // one 64-byte line: 2 inputs x 32 columns
          c[v] = load_w8(w);
        } else if constexpr (F == Format::F16) {
          const uint16_t* w = static_cast<const uint16_t*>(wv[v]) + k * kTile;
          if (v % kTileVecs == 0) prefetch(w);  // one 64-byte line: 1 input x 32 columns
          c[v] = load_f16(w);
        } else {
          const float* w = static_cast<const float*>(wv[v]) + k * kTile;
          if ((v * kLanes) % 16 == 0) prefetch(w);  // one 64-byte line: 16 columns
          c[v] = vload(w);
        }
      }
      for (int r = 0; r < R; ++r) {
        const vf xv = vset1(xr[r][k]);
        for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xv, c[v], acc[r][v]);
      }
    }
  }
}

// Write one output vector (columns [col, col + kLanes)), adding the bias, masking the tail.
inline void store_out(const GemmArgs& p, int64_t m, int64_t col, vf y) {
  float* out = p.y + m * p.ldy + col;
  const int64_t valid = p.N - col;
  if (valid >= kLanes) {
    if (p.bias) y = vadd(y, vload(p.bias + col));
    vstore(out, y);
    return;
  }
  alignas(64) float tmp[kLanes];
  vstore(tmp, y);
  for (int64_t i = 0; i < valid; ++i) out[i] = p.bias ? tmp[i] + p.bias[col + i] : tmp[i];
}

// R rows [m0, m0 + R) x NV vectors of kLanes columns from column col0. The output is kept in
// y (memory, touched once per group) so that the registers go to the accumulators.
template <Format F, int R, int NV>
void block(const GemmArgs& p, int64_t m0, int64_t col0) {
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + (m0 + r) * p.ldx;
  const void* wv[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t col = col0 + v * kLanes, tile = col / kTile, lane = col % kTile;
    if constexpr (F == Format::W4)
      wv[v] = static_cast<const int32_t*>(p.w) + tile * (p.Kp / 8) * kTile + lane;
    else if constexpr (F == Format::W8)
      wv[v] = static_cast<const int8_t*>(p.w) + tile * p.Kp * kTile + lane;
    else if constexpr (F == Format::F16)
      wv[v] = static_cast<const uint16_t*>(p.w) + tile * p.Kp * kTile + lane;
    else
      wv[v] = static_cast<const float*>(p.w) + tile * p.Kp * kTile + lane;
  }
  alignas(64) float y[R][NV][kLanes];
  for (int64_t g = 0; g < p.G; ++g) {
    vf acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
    accumulate_group<F, R, NV>(xr, wv, p.gstart[g], p.gstart[g + 1], acc);
    if constexpr (F == Format::F16 || F == Format::F32) {  // one group, no scale
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) vstore(y[r][v], acc[r][v]);
    } else {
      for (int v = 0; v < NV; ++v) {
        const int64_t col = col0 + v * kLanes;
        const vf s = vload(p.scales + g * p.Np + col);
        const vf z = p.zoff ? vload(p.zoff + g * p.Np + col) : vzero();
        for (int r = 0; r < R; ++r) {
          const vf t = p.zoff ? vfnma(z, vset1(p.sx[(m0 + r) * p.G + g]), acc[r][v]) : acc[r][v];
          vstore(y[r][v], vfma(s, t, g == 0 ? vzero() : vload(y[r][v])));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store_out(p, m0 + r, col0 + v * kLanes, vload(y[r][v]));
}

// block<F, rows, kBlockVecs> for a run-time rows in [1, R].
template <Format F, int R>
void rows_block(const GemmArgs& p, int rows, int64_t m0, int64_t col0) {
  if constexpr (R > 0) {
    if (rows == R) block<F, R, kBlockVecs>(p, m0, col0);
    else rows_block<F, R - 1>(p, rows, m0, col0);
  }
}

template <Format F>
void run(const GemmArgs& p, int64_t t0, int64_t t1) {
  if (p.M == 1) {  // decode: wide blocks for more independent FMA chains
    constexpr int wide_tiles = kWideVecs / kTileVecs;
    int64_t t = t0;
    for (; t + wide_tiles <= t1; t += wide_tiles) block<F, 1, kWideVecs>(p, 0, t * kTile);
    for (; t < t1; ++t)
      for (int v = 0; v < kTileVecs; v += kBlockVecs) block<F, 1, kBlockVecs>(p, 0, t * kTile + v * kLanes);
    return;
  }
  for (int64_t t = t0; t < t1; ++t) {  // the tile's codes stay in cache across row blocks
    for (int v = 0; v < kTileVecs; v += kBlockVecs) {
      for (int64_t m0 = 0; m0 < p.M; m0 += kRowBlock) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, p.M - m0));
        rows_block<F, kRowBlock>(p, rows, m0, t * kTile + v * kLanes);
      }
    }
  }
}

}  // namespace

void run_tiles(const GemmArgs& a, int64_t t0, int64_t t1) {
  switch (a.format) {
    case Format::W4: run<Format::W4>(a, t0, t1); break;
    case Format::W8: run<Format::W8>(a, t0, t1); break;
    case Format::F16: run<Format::F16>(a, t0, t1); break;
    case Format::F32: run<Format::F32>(a, t0, t1); break;
  }
}

const char* isa_name() { return kIsa; }

}  // namespace flotilla_cpu
