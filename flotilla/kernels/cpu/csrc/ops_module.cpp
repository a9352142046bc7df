// Python binding of the per-layer CPU ops (ops.h): checks, threads, tensors.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#include "ops.h"

namespace flotilla_cpu {
namespace {

at::Tensor rows_of(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.size(-1) == n, what,
              " must be a float32 CPU tensor of rows of ", n);
  return t.reshape({-1, n}).contiguous();
}

std::vector<at::Tensor> rms_norm_impl(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                      const at::Tensor& w, double eps) {
  const int64_t n = w.numel();
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1, "weight must be float32 [n]");
  const at::Tensor x2 = rows_of(x, n, "x");
  const at::Tensor d2 = delta ? rows_of(*delta, n, "delta") : at::Tensor();
  TORCH_CHECK(!delta || d2.size(0) == x2.size(0), "x and delta differ in rows");
  at::Tensor y = at::empty_like(x2), sum = delta ? at::empty_like(x2) : at::Tensor();
  at::parallel_for(0, x2.size(0), 64, [&](int64_t t0, int64_t t1) {
    rms_norm_rows(x2.data_ptr<float>() + t0 * n, delta ? d2.data_ptr<float>() + t0 * n : nullptr, w.data_ptr<float>(),
                  y.data_ptr<float>() + t0 * n, delta ? sum.data_ptr<float>() + t0 * n : nullptr, t1 - t0, n,
                  static_cast<float>(eps));
  });
  if (!delta) return {y.view(x.sizes())};
  return {sum.view(x.sizes()), y.view(x.sizes())};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm_impl(x, {}, w, eps)[0]; }

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, delta, w, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up must have an even last dimension");
  const int64_t n = gate_up.size(-1) / 2;
  const at::Tensor g2 = rows_of(gate_up, 2 * n, "gate_up");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty({g2.size(0), n}, g2.options());
  at::parallel_for(0, g2.size(0), 16, [&](int64_t t0, int64_t t1) {
    silu_mul_rows(g2.data_ptr<float>() + t0 * 2 * n, out.data_ptr<float>() + t0 * n, t1 - t0, n);
  });
  return out.view(shape);
}

// x [T, H, D] (rows and heads at any stride, dims contiguous); cos, sin [T, 1, D] -> [T, H, D]
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1, "x must be float32 [T, H, D], D contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const at::Tensor c = cos.reshape({T, D}).contiguous(), s = sin.reshape({T, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && D % 2 == 0,
              "cos and sin must be float32 [T, 1, D] with D even");
  at::Tensor out = at::empty({T, H, D}, x.options());
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    rope_rows(x.data_ptr<float>() + t0 * x.stride(0), x.stride(0), x.stride(1), c.data_ptr<float>() + t0 * D,
              s.data_ptr<float>() + t0 * D, out.data_ptr<float>() + t0 * H * D, t1 - t0, H, D);
  });
  return out;
}

// q [B, Hq, D]; caches [blocks, block_size, Hkv, D]; block_tables [B, W]; seq_lens [B] -> [B, Hq, D];
// window > 0: each query reads only its sequence's last `window` keys (sliding-window attention)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 [B, Hq, D]");
  TORCH_CHECK(key_cache.scalar_type() == at::kFloat && key_cache.dim() == 4 && key_cache.is_contiguous() &&
              value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
              value_cache.scalar_type() == at::kFloat, "the caches must be contiguous float32 [blocks, bs, Hkv, D]");
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = key_cache.size(1), hkv = key_cache.size(2), blocks = key_cache.size(0);
  TORCH_CHECK(key_cache.size(3) == d && hq % hkv == 0, "q and the caches disagree on heads or head size");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == B &&
              seq_lens.scalar_type() == at::kLong && seq_lens.numel() == B, "block tables [B, W] and seq_lens [B], int64");
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t W = tables.size(1), group = hq / hkv;
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= W * bs, "sequence ", b, " has ", len[b], " tokens, its table covers ", W * bs);
    for (int64_t j = 0; j < (len[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tab[b * W + j] >= 0 && tab[b * W + j] < blocks, "block table entry out of range");
  }
  at::Tensor out = at::empty_like(q);
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  at::parallel_for(0, B * hq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const float*> k_rows, v_rows;
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / hq, h = i % hq, kv = h / group;
      const int64_t first = window > 0 && len[b] > window ? len[b] - window : 0, L = len[b] - first;
      k_rows.resize(L), v_rows.resize(L), scores.resize(L);
      for (int64_t n = 0; n < L; ++n) {
        const int64_t p = first + n, slot = tab[b * W + p / bs] * bs + p % bs;
        k_rows[n] = kc + (slot * hkv + kv) * d;
        v_rows[n] = vc + (slot * hkv + kv) * d;
      }
      attend_one(q.data_ptr<float>() + i * d, k_rows.data(), v_rows.data(), L, d, static_cast<float>(scale),
                 scores.data(), out.data_ptr<float>() + i * d, static_cast<float>(softcap));
    }
  });
  return out;
}

}  // namespace

void register_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"),
        "(x + delta, rms_norm(x + delta))");
  m.def("silu_mul", &silu_mul, py::arg("gate_up"));
  m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
}

}  // namespace flotilla_cpu
