// See ops.h. Vector code through simd.h; tails of rows that are not whole vectors run scalar.
#include "ops.h"

#include <cmath>

#include "kernels.h"
#include "simd.h"

namespace flotilla_cpu {

using namespace simd;

namespace {

// sum of a[i] * b[i] over n, in the fixed order of group_sum's eight partial sums
float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  for (; i < n; ++i) part[i % 8] = std::fma(a[i], b[i], part[i % 8]);
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// dot(q, k[j], n) * scale for the eight rows k[0..8) (n a multiple of 8): the same eight partial
// sums each, reduced in the same tree, side by side (eight independent chains instead of one).
void dot8(const float* q, const float* const* k, int64_t n, float scale, float* out) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + i), acc[j]);
  }
  // transpose: part[i] holds partial sum i of each of the eight rows (row j in lane j)
  const __m256 t0 = _mm256_unpacklo_ps(acc[0], acc[1]), t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
  const __m256 t2 = _mm256_unpacklo_ps(acc[2], acc[3]), t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
  const __m256 t4 = _mm256_unpacklo_ps(acc[4], acc[5]), t5 = _mm256_unpackhi_ps(acc[4], acc[5]);
  const __m256 t6 = _mm256_unpacklo_ps(acc[6], acc[7]), t7 = _mm256_unpackhi_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  __m256 part[8];
  part[0] = _mm256_permute2f128_ps(u0, u4, 0x20), part[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  part[1] = _mm256_permute2f128_ps(u1, u5, 0x20), part[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  part[2] = _mm256_permute2f128_ps(u2, u6, 0x20), part[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  part[3] = _mm256_permute2f128_ps(u3, u7, 0x20), part[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(part[0], part[4]), _mm256_add_ps(part[2], part[6])),
                                   _mm256_add_ps(_mm256_add_ps(part[1], part[5]), _mm256_add_ps(part[3], part[7])));
  _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

}  // namespace

void rms_norm_rows(const float* x, const float* delta, const float* w, float* y, float* sum_out, int64_t rows,
                   int64_t n, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * n;
    if (delta) {  // the residual sum first
      float* s = sum_out + t * n;
      const float* dr = delta + t * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) vstore(s + i, vadd(vload(xr + i), vload(dr + i)));
      for (; i < n; ++i) s[i] = xr[i] + dr[i];
      xr = s;
    }
    const float r = 1.0f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
    float* yr = y + t * n;
    const vf rv = vset1(r);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) vstore(yr + i, vmul(vmul(vload(xr + i), rv), vload(w + i)));
    for (; i < n; ++i) yr[i] = (xr[i] * r) * w[i];
  }
}

void silu_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t n) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gate_up + t * 2 * n;
    const float* u = g + n;
    float* o = out + t * n;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const vf gv = vload(g + i);
      const vf silu = vdiv(gv, vadd(vset1(1.0f), vexp(vsub(vzero(), gv))));
      vstore(o + i, vmul(silu, vload(u + i)));
    }
    for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void rope_rows(const float* x, int64_t xt, int64_t xh, const float* c, const float* s, float* out, int64_t rows,
               int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const float* ct = c + t * d;
    const float* st = s + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = x + t * xt + h * xh;
      float* o = out + (t * heads + h) * d;
      // two products, one sum (torch's x * cos + roll(x) * sin); each half reads the other
      for (int64_t i = 0; i < half; ++i) o[i] = xr[i] * ct[i] + xr[i + half] * st[i];
      for (int64_t i = half; i < d; ++i) o[i] = xr[i] * ct[i] + xr[i - half] * st[i];
    }
  }
}

void attend_one(const float* q, const float* const* k_rows, const float* const* v_rows, int64_t L, int64_t d,
                float scale, float* scores, float* out, float softcap) {
  int64_t p = 0;
  if (d % 8 == 0)
    for (; p + 8 <= L; p += 8) dot8(q, k_rows + p, d, scale, scores + p);
  for (; p < L; ++p) scores[p] = dot(q, k_rows[p], d) * scale;
  if (softcap > 0.0f)
    for (p = 0; p < L; ++p) scores[p] = softcap * std::tanh(scores[p] / softcap);
  float top = -INFINITY;
  for (p = 0; p < L; ++p) top = std::fmax(top, scores[p]);
  float total = 0.0f;
  for (p = 0; p + kLanes <= L; p += kLanes) vstore(scores + p, vexp(vsub(vload(scores + p), vset1(top))));
  alignas(64) float tail[kLanes] = {};
  if (p < L) {  // the last partial vector through the same exp
    for (int64_t i = p; i < L; ++i) tail[i - p] = scores[i] - top;
    vstore(tail, vexp(vload(tail)));
    for (int64_t i = p; i < L; ++i) scores[i] = tail[i - p];
  }
  for (int64_t i = 0; i < L; ++i) total += scores[i];
  int64_t i = 0;
  constexpr int kChunk = 64 / kLanes;  // out += e_j v_j over j, 64 floats at a time held in registers
  for (; i + kChunk * kLanes <= d; i += kChunk * kLanes) {
    vf acc[kChunk];
    for (int c = 0; c < kChunk; ++c) acc[c] = vzero();
    for (int64_t j = 0; j < L; ++j) {
      const vf e = vset1(scores[j]);
      for (int c = 0; c < kChunk; ++c) acc[c] = vfma(e, vload(v_rows[j] + i + c * kLanes), acc[c]);
    }
    for (int c = 0; c < kChunk; ++c) vstore(out + i + c * kLanes, acc[c]);
  }
  for (; i + kLanes <= d; i += kLanes) {
    vf acc = vzero();
    for (int64_t j = 0; j < L; ++j) acc = vfma(vset1(scores[j]), vload(v_rows[j] + i), acc);
    vstore(out + i, acc);
  }
  for (; i < d; ++i) {
    float acc = 0.0f;
    for (int64_t j = 0; j < L; ++j) acc = std::fma(scores[j], v_rows[j][i], acc);
    out[i] = acc;
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

}  // namespace flotilla_cpu
