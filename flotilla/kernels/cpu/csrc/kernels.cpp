// See kernels.h for the packed layouts and the per-element arithmetic every path follows.
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "simd.h"

namespace flotilla_cpu {
namespace {

using namespace simd;

// Signed 4- and 5-bit codes are two's complement fields (GPTQ's q XOR 8 is q - 8 read that way);
// a decoder turns the field of input J of every lane into a float.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// ------------------------------------------------------------------------------- AVX-512
constexpr int kRowBlock = 6;   // M > 1: rows that share each decoded weight vector
constexpr int kBlockVecs = 2;  // M > 1: vectors of kLanes columns per block
constexpr int kWideVecs = 4;   // M == 1: vectors per block (enough independent FMA chains)
inline vi load_w4(const int32_t* p) { return _mm512_loadu_si512(p); }
inline vi load_hi(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <bool Signed>
struct W4Decoder {  // nibble J of each lane through a 16-entry table (vpermps reads 4 index bits)
  const vf table = Signed ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
                          : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  template <int J>
  vf decode(vi q) const {
    if constexpr (J == 0) return _mm512_permutexvar_ps(q, table);
    else return _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4 * J), table);
  }
};
template <bool Signed>
struct W5Decoder {  // nibble J and high bit J as a 5-bit index into a 32-entry table (vpermt2ps)
  const vf lo = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf hi = Signed ? _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1)
                       : _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  const vi low_nibble = _mm512_set1_epi32(0x0F);
  template <int J>
  vf decode(vi q, vi h) const {
    const vi qs = J == 0 ? q : _mm512_srli_epi32(q, 4 * J);
    vi hs;  // bit J of h moved to bit 4
    if constexpr (J < 4) hs = _mm512_slli_epi32(h, 4 - J);
    else if constexpr (J == 4) hs = h;
    else hs = _mm512_srli_epi32(h, J - 4);
    const vi idx = _mm512_ternarylogic_epi32(qs, hs, low_nibble, 0xE4);  // low_nibble ? qs : hs, bitwise
    return _mm512_permutex2var_ps(lo, idx, hi);
  }
};
inline vf load_w8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
constexpr bool kHasScaled = false;  // its table decoders already take one instruction a nibble
template <Format F>
struct ScaledDecoder {};
const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ----------------------------------------------------------------------------------- AVX2
constexpr int kRowBlock = 4;
constexpr int kBlockVecs = 2;
constexpr int kWideVecs = 4;
inline vi load_w4(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi load_hi(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
template <bool Signed>
struct W4Decoder {  // signed: shift nibble J to the top, arithmetic shift down; unsigned: shift, mask
  template <int J>
  vf decode(vi q) const {
    if constexpr (Signed) {
      if constexpr (J == 7) return _mm256_cvtepi32_ps(_mm256_srai_epi32(q, 28));
      else return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 28 - 4 * J), 28));
    } else {
      if constexpr (J == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 28));
      else return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q, 4 * J), _mm256_set1_epi32(0x0F)));
    }
  }
};
template <bool Signed>
struct W5Decoder {  // (nibble J) | (high bit J) << 4, sign-extended from 5 bits when signed
  template <int J>
  vf decode(vi q, vi h) const {
    const vi lo = _mm256_and_si256(_mm256_srli_epi32(q, 4 * J), _mm256_set1_epi32(0x0F));
    vi hs;
    if constexpr (J < 4) hs = _mm256_slli_epi32(h, 4 - J);
    else if constexpr (J == 4) hs = h;
    else hs = _mm256_srli_epi32(h, J - 4);
    vi v = _mm256_or_si256(lo, _mm256_and_si256(hs, _mm256_set1_epi32(0x10)));
    if constexpr (Signed) v = _mm256_srai_epi32(_mm256_slli_epi32(v, 27), 27);
    return _mm256_cvtepi32_ps(v);
  }
};
inline vf load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Decode on prescaled x (see run and scale_x): nibble J of each lane read in place, as its code
// times 2**(4J) for J < 7 (one mask where the plain decoders shift and mask; the high bit of a
// 5-bit code is moved to bit 4J + 4), the code itself for J == 7. Every such value is exact in
// fp32, and x' = x * 2**-(4J) then gives x' c' == x c exactly: the same products, the same sums.
// Signed 5-bit codes are the nibble minus 16 times the stored bit (the code's sign), unsigned
// ones the nibble plus 16 times it.
constexpr bool kHasScaled = true;
template <Format F>
struct ScaledDecoder {
  template <int J>
  vf decode(vi q, vi h) const {
    constexpr bool five = F == Format::W5 || F == Format::U5;
    vi v, hb;
    if constexpr (J == 7) {
      v = _mm256_srli_epi32(q, 28);
      if constexpr (five) hb = _mm256_and_si256(_mm256_srli_epi32(h, 3), _mm256_set1_epi32(16));
    } else {
      v = _mm256_and_si256(q, _mm256_set1_epi32(0xF << (4 * J)));
      if constexpr (five) hb = _mm256_and_si256(_mm256_slli_epi32(h, 3 * J + 4), _mm256_set1_epi32(1 << (4 * J + 4)));
    }
    if constexpr (F == Format::W5) v = _mm256_sub_epi32(v, hb);
    if constexpr (F == Format::U5) v = _mm256_or_si256(v, hb);
    return _mm256_cvtepi32_ps(v);
  }
};
const char* kIsa = "avx2";
#endif

constexpr int kTileVecs = kTile / kLanes;
static_assert(kTileVecs % kBlockVecs == 0 && kWideVecs % kTileVecs == 0, "blocks must tile the columns");

// Weights stream from memory once per call in decode, and a tile's stream is short (a few KB
// for K of a few hundred), too short for the hardware prefetcher to ramp up. So a block
// prefetches into L2, at each position of its tiles, the same position of the tiles the next
// block reads (its own tiles + the block's width): everything one block ahead.
inline void prefetch(const void* p, int64_t ahead) { _mm_prefetch(static_cast<const char*>(p) + ahead, _MM_HINT_T1); }

template <typename F, int... J>
inline void for_each_nibble(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}

// One vector of a group table (already at its columns): fp32, or fp16 widened (exact).
inline vf load_table(const char* t, bool half) {
  return half ? load_f16(reinterpret_cast<const uint16_t*>(t)) : vload(reinterpret_cast<const float*>(t));
}

template <Format F>
constexpr bool kSigned = F == Format::W4 || F == Format::W5;
template <Format F>
constexpr bool kNibbles = F == Format::W4 || F == Format::U4 || F == Format::W5 || F == Format::U5;
template <Format F>
constexpr bool kFive = F == Format::W5 || F == Format::U5;
// Bytes of one row of a tile: one 8-input word per lane (4 and 5 bits), else one input per lane.
template <Format F>
constexpr int64_t kRowBytes = (kNibbles<F> ? 4 : F == Format::W8 ? 1 : F == Format::F16 ? 2 : 4) * kTile;

// Where one group of one vector of kLanes columns lives: its codes (and high bits), its tables.
struct GroupPtrs {
  const char* w;
  const uint8_t* h;
  const char *s, *z, *m;
};

// acc[r][v] = sum over the group's n inputs, ascending, of x[r][k] * c[v][k] (fma chain);
// xr[r] points at the group's first input. `ahead`: the prefetch distance in bytes (0: none).
// Scaled: the codes come from ScaledDecoder, x from scale_x.
template <Format F, int R, int NV, bool Scaled>
inline void accumulate_group(const float* const* xr, const GroupPtrs (&gp)[NV], int64_t n, int64_t ahead,
                             vf (&acc)[R][NV]) {
  if constexpr (kNibbles<F>) {
    const W4Decoder<kSigned<F>> dec4;
    const W5Decoder<kSigned<F>> dec5;
    const ScaledDecoder<F> scaled;
    for (int64_t k = 0; k < n; k += 8) {
      vi q[NV], h[NV];
      for (int v = 0; v < NV; ++v) {
        const char* w = gp[v].w + (k / 8) * kRowBytes<F>;
        if (ahead) prefetch(w, ahead);
        q[v] = load_w4(reinterpret_cast<const int32_t*>(w));
        if constexpr (kFive<F>) {
          const uint8_t* hp = gp[v].h + (k / 8) * kTile;
          if (ahead && v % kTileVecs == 0 && (k / 8) % 2 == 0) prefetch(hp, ahead);  // a line: 2 words x 32 columns
          h[v] = load_hi(hp);
        }
      }
      for_each_nibble([&](auto J) {
        vf c[NV];
        for (int v = 0; v < NV; ++v) {
          if constexpr (Scaled) c[v] = scaled.template decode<J()>(q[v], h[v]);
          else if constexpr (kFive<F>) c[v] = dec5.template decode<J()>(q[v], h[v]);
          else c[v] = dec4.template decode<J()>(q[v]);
        }
        for (int r = 0; r < R; ++r) {
          const vf xv = vset1(xr[r][k + J()]);
          for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xv, c[v], acc[r][v]);
        }
      }, std::make_integer_sequence<int, 8>{});
    }
  } else {
    for (int64_t k = 0; k < n; ++k) {
      vf c[NV];
      for (int v = 0; v < NV; ++v) {
        const char* w = gp[v].w + k * kRowBytes<F>;
        if constexpr (F == Format::W8) {
          if (ahead && v % kTileVecs == 0 && k % 2 == 0) prefetch(w, ahead);  // a line: 2 inputs x 32 columns
          c[v] = load_w8(reinterpret_cast<const int8_t*>(w));
        } else if constexpr (F == Format::F16) {
          if (ahead && v % kTileVecs == 0) prefetch(w, ahead);  // a line: 1 input x 32 columns
          c[v] = load_f16(reinterpret_cast<const uint16_t*>(w));
        } else {
          if (ahead && (v * kLanes) % 16 == 0) prefetch(w, ahead);  // a line: 16 columns
          c[v] = vload(reinterpret_cast<const float*>(w));
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

// Group g of the vector at column col: its codes, high bits and tables, in either layout.
template <Format F>
inline GroupPtrs group_ptrs(const GemmArgs& p, int64_t g, int64_t col) {
  const int64_t tile = col / kTile, lane = col % kTile, tb = p.half_tables ? 2 : 4;
  const int64_t k0 = p.gstart[g], n = p.gstart[g + 1] - k0;
  const int64_t elt = kRowBytes<F> / kTile;  // bytes of one lane of a row
  GroupPtrs gp{};
  if (p.group_bytes) {  // blocked: [codes][high bits][scales][mins] per group of a tile
    const char* rec = static_cast<const char*>(p.w) + (tile * p.G + g) * p.group_bytes;
    const int64_t code_bytes = (kNibbles<F> ? n / 8 : n) * kRowBytes<F>;
    const int64_t hi_bytes = kFive<F> ? n / 8 * kTile : 0;
    gp.w = rec + lane * elt;
    gp.h = reinterpret_cast<const uint8_t*>(rec + code_bytes + lane);
    gp.s = rec + code_bytes + hi_bytes + lane * tb;
    gp.m = p.mins ? gp.s + kTile * tb : nullptr;
    gp.z = nullptr;
    return gp;
  }
  const int64_t rows_per_tile = kNibbles<F> ? p.Kp / 8 : p.Kp;
  const int64_t row0 = kNibbles<F> ? k0 / 8 : k0;
  gp.w = static_cast<const char*>(p.w) + (tile * rows_per_tile + row0) * kRowBytes<F> + lane * elt;
  gp.h = p.hi ? p.hi + (tile * (p.Kp / 8) + k0 / 8) * kTile + lane : nullptr;
  const int64_t at = (g * p.Np + col) * tb;
  gp.s = p.scales ? static_cast<const char*>(p.scales) + at : nullptr;
  gp.z = p.zoff ? static_cast<const char*>(p.zoff) + at : nullptr;
  gp.m = p.mins ? static_cast<const char*>(p.mins) + at : nullptr;
  return gp;
}

// Bytes of one tile's codes (and high bits and tables, blocked), the stride between tiles.
template <Format F>
inline int64_t tile_bytes(const GemmArgs& p) {
  return p.group_bytes ? p.G * p.group_bytes : (kNibbles<F> ? p.Kp / 8 : p.Kp) * kRowBytes<F>;
}

// The next block's table lines of this group: in the blocked layout `ahead` bytes on (between
// the codes, which accumulate_group prefetches), in the classic one the next columns of each table.
template <int NV>
inline void prefetch_tables(const GemmArgs& p, const GroupPtrs (&gp)[NV], int64_t ahead) {
  const int64_t tb = p.half_tables ? 2 : 4;
  for (int v = 0; v < NV; v += kTileVecs) {
    if (p.group_bytes) {
      const char* start = gp[v].s - (gp[v].s - static_cast<const char*>(p.w)) % 64;
      const char* end = gp[v].s + (gp[v].m ? 2 : 1) * kTile * tb;
      for (const char* line = start; line < end; line += 64) prefetch(line, ahead);
    } else {
      for (const char* t : {gp[v].s, gp[v].z, gp[v].m})
        if (t) prefetch(t, NV * kLanes * tb);
    }
  }
}

// R rows [m0, m0 + R) x NV vectors of kLanes columns from column col0. The output is kept in
// y (memory, touched once per group) so that the registers go to the accumulators.
template <Format F, int R, int NV, bool Scaled = false>
void block(const GemmArgs& p, int64_t m0, int64_t col0) {
  // prefetch the next block's tiles while on the first rows (later row blocks reread from cache)
  const int64_t ahead = m0 == 0 ? std::max<int64_t>(1, NV / kTileVecs) * tile_bytes<F>(p) : 0;
  alignas(64) float y[R][NV][kLanes];
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t k0 = p.gstart[g];
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = p.x + (m0 + r) * p.ldx + k0;
    GroupPtrs gp[NV];
    for (int v = 0; v < NV; ++v) gp[v] = group_ptrs<F>(p, g, col0 + v * kLanes);
    if (ahead) prefetch_tables<NV>(p, gp, ahead);
    vf acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
    accumulate_group<F, R, NV, Scaled>(xr, gp, p.gstart[g + 1] - k0, ahead, acc);
    if constexpr (F == Format::F16 || F == Format::F32) {  // one group, no scale
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) vstore(y[r][v], acc[r][v]);
    } else {
      for (int v = 0; v < NV; ++v) {
        const vf s = load_table(gp[v].s, p.half_tables);
        const vf z = gp[v].z ? load_table(gp[v].z, p.half_tables) : vzero();
        const vf mn = gp[v].m ? load_table(gp[v].m, p.half_tables) : vzero();
        for (int r = 0; r < R; ++r) {
          const float* sx = p.sx ? p.sx + (m0 + r) * p.G + g : nullptr;
          const vf t = gp[v].z ? vfnma(z, vset1(*sx), acc[r][v]) : acc[r][v];
          vf out = vfma(s, t, g == 0 ? vzero() : vload(y[r][v]));
          if (gp[v].m) out = vfma(mn, vset1(*sx), out);
          vstore(y[r][v], out);
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

// Formats ScaledDecoder reads (where this build has one).
template <Format F>
constexpr bool kScalable = kHasScaled && (F == Format::U4 || F == Format::U5 || F == Format::W5);

// x'[k] = x[k] * 2**-(4 (k % 8)) (k % 8 < 7; x'[k] = x[k] for k % 8 == 7), the activations
// ScaledDecoder's codes pair with. False (x' unused) when a product would change: some x'[k] not
// exact (x below 2**-102 in magnitude, subnormal or not finite), rare enough for the plain path.
inline bool scale_x(const float* x, int64_t n, float* out) {
  alignas(32) static const float down[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
  alignas(32) static const float up[8] = {1.0f, 0x1p4f, 0x1p8f, 0x1p12f, 0x1p16f, 0x1p20f, 0x1p24f, 1.0f};
  const __m256 d = _mm256_load_ps(down), u = _mm256_load_ps(up);
  __m256 same = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k), s = _mm256_mul_ps(xv, d);
    same = _mm256_and_ps(same, _mm256_cmp_ps(_mm256_mul_ps(s, u), xv, _CMP_EQ_OQ));
    _mm256_storeu_ps(out + k, s);
  }
  return _mm256_movemask_ps(same) == 0xFF;
}

template <Format F, bool Scaled>
void run_decode(const GemmArgs& p, int64_t t0, int64_t t1) {  // wide blocks: more independent FMA chains
  constexpr int wide_tiles = kWideVecs / kTileVecs;
  int64_t t = t0;
  for (; t + wide_tiles <= t1; t += wide_tiles) block<F, 1, kWideVecs, Scaled>(p, 0, t * kTile);
  for (; t < t1; ++t) block<F, 1, kTileVecs, Scaled>(p, 0, t * kTile);
}

template <Format F>
void run(const GemmArgs& p, int64_t t0, int64_t t1) {
  if (p.M == 1) {
    if constexpr (kScalable<F>) {
      thread_local std::vector<float> xs;
      xs.resize(p.Kp);
      if (scale_x(p.x, p.Kp, xs.data())) {
        GemmArgs scaled = p;
        scaled.x = xs.data();
        run_decode<F, true>(scaled, t0, t1);
        return;
      }
    }
    run_decode<F, false>(p, t0, t1);
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
    case Format::U4: run<Format::U4>(a, t0, t1); break;
    case Format::W5: run<Format::W5>(a, t0, t1); break;
    case Format::U5: run<Format::U5>(a, t0, t1); break;
    case Format::W8: run<Format::W8>(a, t0, t1); break;
    case Format::F16: run<Format::F16>(a, t0, t1); break;
    case Format::F32: run<Format::F32>(a, t0, t1); break;
  }
}

float group_sum(const float* x, int64_t n) {
  // part[j] = x[j] + x[j + 8] + ... ascending: one 8-lane vector add per 8 inputs, in any build
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  for (; i < n; ++i) part[i % 8] += x[i];
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

const char* isa_name() { return kIsa; }

}  // namespace flotilla_cpu
