// Python binding of the CPU dequant-GEMM kernels: a PackedLinear holds one linear's packed
// weights (built by flotilla/kernels/cpu/packing.py) and computes y = x @ W + bias for fp32 x.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <string>

#include "kernels.h"

namespace flotilla_cpu {
namespace {

// Aim for at least this many multiply-adds per thread before splitting a call over threads.
constexpr int64_t kMinWorkPerThread = 1 << 16;

class PackedLinear {
 public:
  PackedLinear(int64_t format, int64_t in_features, int64_t out_features, at::Tensor codes,
               std::optional<at::Tensor> scales, std::optional<at::Tensor> zoff, at::Tensor gstart,
               std::optional<at::Tensor> src)
      : format_(static_cast<Format>(format)), K_(in_features), N_(out_features),
        codes_(std::move(codes)), gstart_(std::move(gstart)) {
    TORCH_CHECK(format == 4 || format == 8 || format == 16 || format == 32, "format must be 4, 8, 16 or 32, got ",
                format);
    TORCH_CHECK(codes_.is_contiguous() && codes_.dim() == 3 && codes_.size(2) == kTile,
                "codes must be a contiguous [tiles, rows, ", kTile, "] tensor");
    tiles_ = codes_.size(0);
    Np_ = tiles_ * kTile;
    TORCH_CHECK(N_ > 0 && N_ <= Np_ && Np_ - N_ < kTile, "out_features ", N_, " does not match ", tiles_, " tiles");
    const auto want = format_ == Format::W4    ? at::kInt
                      : format_ == Format::W8  ? at::kChar
                      : format_ == Format::F16 ? at::kShort
                                               : at::kFloat;
    TORCH_CHECK(codes_.scalar_type() == want, "codes have the wrong dtype for format ", format);
    Kp_ = format_ == Format::W4 ? codes_.size(1) * 8 : codes_.size(1);
    TORCH_CHECK(gstart_.scalar_type() == at::kInt && gstart_.dim() == 1 && gstart_.is_contiguous() &&
                gstart_.size(0) >= 2, "gstart must be a contiguous int32 vector of group starts");
    G_ = gstart_.size(0) - 1;
    const int32_t* gs = gstart_.data_ptr<int32_t>();
    TORCH_CHECK(gs[0] == 0 && gs[G_] == Kp_, "groups must cover the ", Kp_, " packed inputs");
    for (int64_t g = 0; g < G_; ++g) {
      TORCH_CHECK(gs[g] <= gs[g + 1], "group starts must not decrease");
      TORCH_CHECK(format_ != Format::W4 || gs[g] % 8 == 0, "4-bit groups must start at multiples of 8");
    }
    if (format_ == Format::F16 || format_ == Format::F32) {
      TORCH_CHECK(G_ == 1 && !scales && !zoff, "fp16 and fp32 weights take one group and no scales");
    } else {
      TORCH_CHECK(scales.has_value(), "quantized weights need scales");
      scales_ = check_group_table(*scales, "scales");
      if (zoff) zoff_ = check_group_table(*zoff, "zoff");
    }
    if (src) {
      src_ = *src;
      TORCH_CHECK(src_.scalar_type() == at::kLong && src_.dim() == 1 && src_.size(0) == Kp_ &&
                  src_.is_contiguous(), "src must be a contiguous int64 vector of ", Kp_, " input indices");
      const int64_t* s = src_.data_ptr<int64_t>();
      for (int64_t k = 0; k < Kp_; ++k) TORCH_CHECK(s[k] >= -1 && s[k] < K_, "src index out of range");
    } else {
      TORCH_CHECK(Kp_ == K_, "packed inputs ", Kp_, " differ from in_features ", K_, " but no src map was given");
    }
  }

  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K_, "x has ", x.size(-1), " features, expected ", K_);
    const at::Tensor x2 = x.reshape({-1, K_}).contiguous();
    const int64_t M = x2.size(0);
    std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
    out_shape.back() = N_;
    at::Tensor y = at::empty({M, N_}, x.options());
    if (M == 0) return y.view(out_shape);
    if (bias) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N_,
                  "bias must be a contiguous float32 vector of ", N_);
    }
    at::Tensor xp = src_.defined() ? gather(x2) : x2;
    at::Tensor sx = zoff_.defined() ? group_sums(xp) : at::Tensor();

    GemmArgs a{};
    a.format = format_;
    a.x = xp.data_ptr<float>();
    a.ldx = xp.size(1);
    a.sx = sx.defined() ? sx.data_ptr<float>() : nullptr;
    a.M = M, a.Kp = Kp_, a.N = N_, a.G = G_, a.Np = Np_;
    a.w = codes_.data_ptr();
    a.scales = scales_.defined() ? scales_.data_ptr<float>() : nullptr;
    a.zoff = zoff_.defined() ? zoff_.data_ptr<float>() : nullptr;
    a.gstart = gstart_.data_ptr<int32_t>();
    a.bias = bias ? bias->data_ptr<float>() : nullptr;
    a.y = y.data_ptr<float>();
    a.ldy = N_;
    const int64_t work_per_tile = M * Kp_ * kTile;
    const int64_t grain = std::max<int64_t>(1, (kMinWorkPerThread + work_per_tile - 1) / work_per_tile);
    at::parallel_for(0, tiles_, grain, [&](int64_t t0, int64_t t1) { run_tiles(a, t0, t1); });
    return y.view(out_shape);
  }

  std::string name = "cpu";  // shown by the model's repr; callers may relabel (e.g. the lm_head form)

  int64_t in_features() const { return K_; }
  int64_t out_features() const { return N_; }
  int64_t format() const { return static_cast<int64_t>(format_); }
  int64_t nbytes() const {
    int64_t n = codes_.nbytes() + gstart_.nbytes();
    for (const auto* t : {&scales_, &zoff_, &src_}) n += t->defined() ? t->nbytes() : 0;
    return n;
  }

 private:
  at::Tensor check_group_table(const at::Tensor& t, const char* what) const {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == G_ &&
                t.size(1) == Np_, what, " must be a contiguous float32 [", G_, ", ", Np_, "] tensor");
    return t;
  }

  // x'[m, k] = x[m, src[k]] (0 where src[k] == -1): act-order permutation and group padding.
  at::Tensor gather(const at::Tensor& x2) const {
    const int64_t M = x2.size(0);
    at::Tensor xp = at::empty({M, Kp_}, x2.options());
    const float* in = x2.data_ptr<float>();
    float* out = xp.data_ptr<float>();
    const int64_t* s = src_.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < Kp_; ++k) out[m * Kp_ + k] = s[k] >= 0 ? in[m * K_ + s[k]] : 0.0f;
    return xp;
  }

  // sx[m, g] = x'[m, gstart[g]] + ... in ascending order, one row at a time (batch-invariant).
  at::Tensor group_sums(const at::Tensor& xp) const {
    const int64_t M = xp.size(0);
    at::Tensor sx = at::empty({M, G_}, xp.options());
    const float* in = xp.data_ptr<float>();
    const int64_t ld = xp.size(1);
    float* out = sx.data_ptr<float>();
    const int32_t* gs = gstart_.data_ptr<int32_t>();
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < G_; ++g) {
        float s = 0.0f;
        for (int64_t k = gs[g]; k < gs[g + 1]; ++k) s += in[m * ld + k];
        out[m * G_ + g] = s;
      }
    }
    return sx;
  }

  Format format_;
  int64_t K_, N_, Kp_ = 0, Np_ = 0, G_ = 0, tiles_ = 0;
  at::Tensor codes_, gstart_, scales_, zoff_, src_;
};

}  // namespace
}  // namespace flotilla_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using flotilla_cpu::PackedLinear;
  m.doc() = "flotilla CPU dequant-GEMM kernels (fp32 activations; 4-bit, 8-bit, fp16 and fp32 weights)";
  m.def("isa", &flotilla_cpu::isa_name, "the instruction set the kernels were compiled for");
  m.attr("TILE") = flotilla_cpu::kTile;
  pybind11::class_<PackedLinear>(m, "PackedLinear")
      .def(pybind11::init<int64_t, int64_t, int64_t, at::Tensor, std::optional<at::Tensor>,
                          std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>>(),
           pybind11::arg("format"), pybind11::arg("in_features"), pybind11::arg("out_features"),
           pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("zoff"), pybind11::arg("gstart"),
           pybind11::arg("src"))
      .def("forward", &PackedLinear::forward, pybind11::arg("x"), pybind11::arg("bias") = pybind11::none())
      .def("__call__", &PackedLinear::forward, pybind11::arg("x"), pybind11::arg("bias") = pybind11::none())
      .def_readwrite("name", &PackedLinear::name)
      .def_property_readonly("in_features", &PackedLinear::in_features)
      .def_property_readonly("out_features", &PackedLinear::out_features)
      .def_property_readonly("format", &PackedLinear::format)
      .def_property_readonly("nbytes", &PackedLinear::nbytes);
}
