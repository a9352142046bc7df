// The small per-layer ops of a CPU decode step (fp32): each one pass over its rows, where torch
// runs several kernels with an overhead each (a decode step of a small model is mostly those).
// Every row is computed alone, in one fixed order: results do not depend on the batch.
#pragma once

#include <cstdint>

namespace flotilla_cpu {

// y[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, rows of n; `sum_out`, if not null, first gets
// x + delta (x is then read as x + delta): the residual add fused in.
void rms_norm_rows(const float* x, const float* delta, const float* w, float* y, float* sum_out, int64_t rows,
                   int64_t n, float eps);

// out[t, i] = silu(g[t, i]) * u[t, i] with g, u the halves of gate_up rows of 2n.
void silu_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t n);

// out[t, h, i] = x[t, h, i] * c[t, i] + x[t, h, (i + d/2) % d] * s[t, i] (rotate-half rope; the sign
// of sin is in s), for x rows at stride (xt, xh) and out [rows, heads, d] contiguous.
void rope_rows(const float* x, int64_t xt, int64_t xh, const float* c, const float* s, float* out, int64_t rows,
               int64_t heads, int64_t d);

// One query head of a decode: out[d] = sum_p softmax_p(scale * q . k_p) v_p over the L keys whose
// rows are k_rows[p], v_rows[p] (each d floats); softcap > 0: each score s becomes softcap * tanh(s / softcap)
// first (Gemma 2's soft-capping).
void attend_one(const float* q, const float* const* k_rows, const float* const* v_rows, int64_t L, int64_t d,
                float scale, float* scores, float* out, float softcap = 0.0f);

}  // namespace flotilla_cpu
