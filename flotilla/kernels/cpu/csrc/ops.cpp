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
                float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t p = 0; p < L; ++p) {
    scores[p] = dot(q, k_rows[p], d) * scale;
    top = std::fmax(top, scores[p]);
  }
  float total = 0.0f;
  int64_t p = 0;
  for (; p + kLanes <= L; p += kLanes) vstore(scores + p, vexp(vsub(vload(scores + p), vset1(top))));
  alignas(64) float tail[kLanes] = {};
  if (p < L) {  // the last partial vector through the same exp
    for (int64_t i = p; i < L; ++i) tail[i - p] = scores[i] - top;
    vstore(tail, vexp(vload(tail)));
    for (int64_t i = p; i < L; ++i) scores[i] = tail[i - p];
  }
  for (int64_t i = 0; i < L; ++i) total += scores[i];
  for (int64_t i = 0; i < d; ++i) out[i] = 0.0f;
  for (int64_t j = 0; j < L; ++j) {  // out += e_j v_j, a vector of the head dim at a time
    const vf e = vset1(scores[j]);
    const float* v = v_rows[j];
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes) vstore(out + i, vfma(e, vload(v + i), vload(out + i)));
    for (; i < d; ++i) out[i] = std::fma(scores[j], v[i], out[i]);
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

}  // namespace flotilla_cpu
