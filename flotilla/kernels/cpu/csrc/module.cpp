// Python binding of the CPU dequant-GEMM kernels: a PackedLinear holds one linear's packed
// weights (built by flotilla/kernels/cpu/packing.py and ggml_pack.py) and computes
// y = x @ W + bias for fp32 x; a StackedLinear runs several PackedLinears on the same input as
// one linear whose outputs are theirs side by side (a merged linear whose parts differ in form).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"

namespace flotilla_cpu {
namespace {

// Aim for at least this many multiply-adds per thread before splitting a call over threads.
constexpr int64_t kMinWorkPerThread = 1 << 16;

bool known_format(int64_t f) {
  return f == 3 || f == 4 || f == 5 || f == 6 || f == 8 || f == 16 || f == 32;
}

// The operands of one call of one PackedLinear: x as the packing wants it and its group sums.
struct Prepared {
  at::Tensor xp, sx;
};

class PackedLinear {
 public:
  PackedLinear(int64_t format, int64_t in_features, int64_t out_features, at::Tensor codes,
               std::optional<at::Tensor> scales, std::optional<at::Tensor> zoff, at::Tensor gstart,
               std::optional<at::Tensor> src, std::optional<at::Tensor> mins, std::optional<at::Tensor> hi)
      : format_(static_cast<Format>(format)), K_(in_features), N_(out_features),
        codes_(std::move(codes)), gstart_(std::move(gstart)) {
    TORCH_CHECK(known_format(format), "format must be 3, 4, 5, 6, 8, 16 or 32, got ", format);
    TORCH_CHECK(codes_.is_contiguous() && codes_.dim() == 3 && codes_.size(2) == kTile,
                "codes must be a contiguous [tiles, rows, ", kTile, "] tensor");
    tiles_ = codes_.size(0);
    Np_ = tiles_ * kTile;
    TORCH_CHECK(N_ > 0 && N_ <= Np_ && Np_ - N_ < kTile, "out_features ", N_, " does not match ", tiles_, " tiles");
    const bool nibbles = is_nibble_format(format_);
    const auto want = nibbles                  ? at::kInt
                      : format_ == Format::W8  ? at::kChar
                      : format_ == Format::F16 ? at::kShort
                                               : at::kFloat;
    TORCH_CHECK(codes_.scalar_type() == want, "codes have the wrong dtype for format ", format);
    Kp_ = nibbles ? codes_.size(1) * 8 : codes_.size(1);
    TORCH_CHECK(gstart_.scalar_type() == at::kInt && gstart_.dim() == 1 && gstart_.is_contiguous() &&
                gstart_.size(0) >= 2, "gstart must be a contiguous int32 vector of group starts");
    G_ = gstart_.size(0) - 1;
    const int32_t* gs = gstart_.data_ptr<int32_t>();
    TORCH_CHECK(gs[0] == 0 && gs[G_] == Kp_, "groups must cover the ", Kp_, " packed inputs");
    for (int64_t g = 0; g < G_; ++g) {
      TORCH_CHECK(gs[g] <= gs[g + 1], "group starts must not decrease");
      TORCH_CHECK(!nibbles || gs[g] % 8 == 0, "4- and 5-bit groups must start at multiples of 8");
    }
    if (format_ == Format::F16 || format_ == Format::F32) {
      TORCH_CHECK(G_ == 1 && !scales && !zoff && !mins, "fp16 and fp32 weights take one group and no tables");
    } else {
      TORCH_CHECK(scales.has_value(), "quantized weights need scales");
      half_tables_ = scales->scalar_type() == at::kHalf;
      scales_ = check_group_table(*scales, "scales");
      if (zoff) zoff_ = check_group_table(*zoff, "zoff");
      if (mins) mins_ = check_group_table(*mins, "mins");
      TORCH_CHECK(!(zoff_.defined() && mins_.defined()), "zero offsets and mins exclude each other");
    }
    const bool five = format_ == Format::W5 || format_ == Format::U5;
    TORCH_CHECK(five == hi.has_value(), "5-bit formats (and only they) take a high-bit plane");
    if (hi) {
      hi_ = *hi;
      TORCH_CHECK(hi_.scalar_type() == at::kByte && hi_.is_contiguous() && hi_.dim() == 3 && hi_.size(0) == tiles_ &&
                  hi_.size(1) == Kp_ / 8 && hi_.size(2) == kTile, "hi must be a contiguous uint8 [", tiles_, ", ",
                  Kp_ / 8, ", ", kTile, "] tensor");
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

  // The blocked layout (kernels.h): blob uint8 [tiles, K / group, group_bytes], one record per
  // group of a tile: [codes][high bits (5-bit formats)][scales][mins (with_mins)].
  static PackedLinear blocked(int64_t format, int64_t in_features, int64_t out_features, at::Tensor blob,
                              int64_t group, bool half_tables, bool with_mins) {
    TORCH_CHECK(format == 3 || format == 4 || format == 5 || format == 6 || format == 8,
                "the blocked layout holds 4-, 5- or 8-bit codes, not format ", format);
    TORCH_CHECK(group > 0 && group % 8 == 0 && in_features % group == 0, "group ", group,
                " must be a multiple of 8 dividing in_features ", in_features);
    const Format f = static_cast<Format>(format);
    const int64_t tiles = (out_features + kTile - 1) / kTile, G = in_features / group, tb = half_tables ? 2 : 4;
    const int64_t code_bytes = is_nibble_format(f) ? group / 8 * kTile * 4 : group * kTile;
    const int64_t hi_bytes = (f == Format::W5 || f == Format::U5) ? group / 8 * kTile : 0;
    const int64_t group_bytes = code_bytes + hi_bytes + (with_mins ? 2 : 1) * kTile * tb;
    TORCH_CHECK(blob.scalar_type() == at::kByte && blob.is_contiguous() && blob.dim() == 3 && blob.size(0) == tiles &&
                blob.size(1) == G && blob.size(2) == group_bytes, "blob must be a contiguous uint8 [", tiles, ", ",
                G, ", ", group_bytes, "] tensor");
    PackedLinear p;
    p.format_ = f, p.K_ = in_features, p.N_ = out_features, p.Kp_ = in_features, p.G_ = G;
    p.tiles_ = tiles, p.Np_ = tiles * kTile;
    p.codes_ = std::move(blob);
    p.gstart_ = at::arange(0, in_features + 1, group, at::kInt);
    p.half_tables_ = half_tables, p.with_mins_ = with_mins;
    p.group_bytes_ = group_bytes, p.code_bytes_ = code_bytes, p.hi_bytes_ = hi_bytes;
    return p;
  }

  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    const at::Tensor x2 = check_x(x, K_);
    const int64_t M = x2.size(0);
    at::Tensor y = at::empty({M, N_}, x.options());
    if (M > 0) {
      check_bias(bias, N_);
      const Prepared in = prepare(x2);
      const GemmArgs a = args(in, y.data_ptr<float>(), N_, bias ? bias->data_ptr<float>() : nullptr);
      at::parallel_for(0, tiles_, grain(M), [&](int64_t t0, int64_t t1) { run_tiles(a, t0, t1); });
    }
    return y.view(out_shape(x, N_));
  }

  // Rows `ids` of the weight [N, K] (output columns), dequantized: [T, K] fp32, bit for bit what
  // the formats' definitions give (scale * code + min, scale * (code - zoff), or the value).
  at::Tensor rows(const at::Tensor& ids) const {
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(), "ids must be an int64 CPU tensor");
    const at::Tensor flat = ids.reshape({-1}).contiguous();
    const int64_t T = flat.size(0);
    at::Tensor out = at::zeros({T, K_}, at::kFloat);
    const int64_t* id = flat.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N_, "row ", id[t], " out of [0, ", N_, ")");
    const int32_t* gs = gstart_.data_ptr<int32_t>();
    const int64_t* src = src_.defined() ? src_.data_ptr<int64_t>() : nullptr;
    float* o = out.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t g = 0; g < G_; ++g) {
          for (int64_t k = gs[g]; k < gs[g + 1]; ++k) {
            const int64_t i = src ? src[k] : k;
            if (i >= 0) o[t * K_ + i] = weight_at(g, k, id[t]);
          }
        }
      }
    });
    std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
    shape.push_back(K_);
    return out.view(shape);
  }

  // The operands of a call: x gathered through src (act-order, padding) and its group sums.
  Prepared prepare(const at::Tensor& x2) const {
    Prepared in;
    in.xp = src_.defined() ? gather(x2) : x2;
    if (zoff_.defined() || mins_.defined() || with_mins_) in.sx = group_sums(in.xp);
    return in;
  }

  // The kernel arguments for a call whose output columns start at y (row stride ldy).
  GemmArgs args(const Prepared& in, float* y, int64_t ldy, const float* bias) const {
    GemmArgs a{};
    a.format = format_;
    a.x = in.xp.data_ptr<float>();
    a.ldx = in.xp.stride(0);
    a.sx = in.sx.defined() ? in.sx.data_ptr<float>() : nullptr;
    a.M = in.xp.size(0), a.Kp = Kp_, a.N = N_, a.G = G_, a.Np = Np_;
    a.w = codes_.data_ptr();
    a.hi = hi_.defined() ? hi_.data_ptr<uint8_t>() : nullptr;
    a.half_tables = half_tables_;
    a.scales = scales_.defined() ? scales_.data_ptr() : nullptr;
    a.zoff = zoff_.defined() ? zoff_.data_ptr() : nullptr;
    a.mins = mins_.defined() ? mins_.data_ptr() : nullptr;
    a.group_bytes = group_bytes_;
    if (group_bytes_) {  // the tables live in the records: the pointers only flag them
      a.scales = a.w;
      a.mins = with_mins_ ? a.w : nullptr;
    }
    a.gstart = gstart_.data_ptr<int32_t>();
    a.bias = bias;
    a.y = y;
    a.ldy = ldy;
    return a;
  }

  int64_t grain(int64_t M) const {
    const int64_t work_per_tile = M * Kp_ * kTile;
    return std::max<int64_t>(1, (kMinWorkPerThread + work_per_tile - 1) / work_per_tile);
  }

  static at::Tensor check_x(const at::Tensor& x, int64_t K) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x has ", x.size(-1), " features, expected ", K);
    at::Tensor x2 = x.reshape({-1, K});
    return x2.stride(1) == 1 ? x2 : x2.contiguous();
  }

  static void check_bias(const std::optional<at::Tensor>& bias, int64_t N) {
    if (bias) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                  "bias must be a contiguous float32 vector of ", N);
    }
  }

  static std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    return shape;
  }

  std::string name = "cpu";  // shown by the model's repr; callers may relabel (e.g. the lm_head form)

  int64_t in_features() const { return K_; }
  int64_t out_features() const { return N_; }
  int64_t tiles() const { return tiles_; }
  int64_t format() const { return static_cast<int64_t>(format_); }
  int64_t nbytes() const {
    int64_t n = codes_.nbytes() + gstart_.nbytes();
    for (const auto* t : {&scales_, &zoff_, &mins_, &hi_, &src_}) n += t->defined() ? t->nbytes() : 0;
    return n;
  }

 private:
  at::Tensor check_group_table(const at::Tensor& t, const char* what) const {
    const auto dtype = half_tables_ ? at::kHalf : at::kFloat;
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 2 && t.size(0) == G_ &&
                t.size(1) == Np_, what, " must be a contiguous ", half_tables_ ? "float16" : "float32",
                " [", G_, ", ", Np_, "] tensor (every table in the scales' dtype)");
    return t;
  }

  float table_at(const at::Tensor& t, int64_t g, int64_t n) const {
    const void* p = t.const_data_ptr();
    return half_tables_ ? static_cast<float>(static_cast<const at::Half*>(p)[g * Np_ + n])
                        : static_cast<const float*>(p)[g * Np_ + n];
  }

  // The record of group g of the tile holding column n (blocked layout).
  const char* record(int64_t g, int64_t n) const {
    return static_cast<const char*>(codes_.const_data_ptr()) + ((n / kTile) * G_ + g) * group_bytes_;
  }

  // The code of packed input k (in group g) of column n, as the kernels decode it.
  float code_at(int64_t g, int64_t k, int64_t n) const {
    int64_t tile = n / kTile, lane = n % kTile, rows = Kp_;
    const void* w = codes_.const_data_ptr();
    const uint8_t* hi = hi_.defined() ? static_cast<const uint8_t*>(hi_.const_data_ptr()) : nullptr;
    if (group_bytes_) {  // address inside the group's record, as if it were a tile of its own
      const int64_t k0 = gstart_.const_data_ptr<int32_t>()[g];
      w = record(g, n), hi = reinterpret_cast<const uint8_t*>(record(g, n) + code_bytes_);
      k -= k0, tile = 0, rows = Kp_ / G_;
    }
    switch (format_) {
      case Format::W4: case Format::U4: case Format::W5: case Format::U5: {
        const int64_t at = (tile * (rows / 8) + k / 8) * kTile + lane;
        int32_t v = (static_cast<const int32_t*>(w)[at] >> (4 * (k % 8))) & 0xF;
        if (format_ == Format::W5 || format_ == Format::U5) v |= ((hi[at] >> (k % 8)) & 1) << 4;
        if (format_ == Format::W4 && v >= 8) v -= 16;
        if (format_ == Format::W5 && v >= 16) v -= 32;
        return static_cast<float>(v);
      }
      case Format::W8: return static_cast<const int8_t*>(w)[(tile * rows + k) * kTile + lane];
      case Format::F16:
        return static_cast<float>(c10::Half(static_cast<const uint16_t*>(w)[(tile * Kp_ + k) * kTile + lane],
                                            c10::Half::from_bits()));
      case Format::F32: return static_cast<const float*>(w)[(tile * Kp_ + k) * kTile + lane];
    }
    return 0.0f;
  }

  float weight_at(int64_t g, int64_t k, int64_t n) const {
    const float c = code_at(g, k, n);
    if (group_bytes_) {
      const char* t = record(g, n) + code_bytes_ + hi_bytes_;
      const int64_t tb = half_tables_ ? 2 : 4, lane = n % kTile;
      auto entry = [&](const char* base) {
        return half_tables_ ? static_cast<float>(reinterpret_cast<const at::Half*>(base)[lane])
                            : reinterpret_cast<const float*>(base)[lane];
      };
      return with_mins_ ? entry(t) * c + entry(t + kTile * tb) : entry(t) * c;
    }
    if (!scales_.defined()) return c;
    const float s = table_at(scales_, g, n);
    if (zoff_.defined()) return s * (c - table_at(zoff_, g, n));
    if (mins_.defined()) return s * c + table_at(mins_, g, n);
    return s * c;
  }

  // x'[m, k] = x[m, src[k]] (0 where src[k] == -1): act-order permutation and group padding.
  at::Tensor gather(const at::Tensor& x2) const {
    const int64_t M = x2.size(0);
    at::Tensor xp = at::empty({M, Kp_}, x2.options());
    const float* in = x2.data_ptr<float>();
    const int64_t ld = x2.stride(0);
    float* out = xp.data_ptr<float>();
    const int64_t* s = src_.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < Kp_; ++k) out[m * Kp_ + k] = s[k] >= 0 ? in[m * ld + s[k]] : 0.0f;
    return xp;
  }

  // sx[m, g] = the sum of x'[m, gstart[g] .. gstart[g + 1]) (group_sum: one order in every build).
  at::Tensor group_sums(const at::Tensor& xp) const {
    const int64_t M = xp.size(0);
    at::Tensor sx = at::empty({M, G_}, xp.options());
    const float* in = xp.data_ptr<float>();
    const int64_t ld = xp.stride(0);
    float* out = sx.data_ptr<float>();
    const int32_t* gs = gstart_.data_ptr<int32_t>();
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t g = 0; g < G_; ++g) out[m * G_ + g] = group_sum(in + m * ld + gs[g], gs[g + 1] - gs[g]);
    });
    return sx;
  }

  PackedLinear() = default;

  Format format_ = Format::F32;
  int64_t K_ = 0, N_ = 0, Kp_ = 0, Np_ = 0, G_ = 0, tiles_ = 0;
  bool half_tables_ = false, with_mins_ = false;
  int64_t group_bytes_ = 0, code_bytes_ = 0, hi_bytes_ = 0;  // the blocked layout
  at::Tensor codes_, gstart_, scales_, zoff_, mins_, hi_, src_;
};

class StackedLinear {
 public:
  explicit StackedLinear(std::vector<PackedLinear> parts) : parts_(std::move(parts)) {
    TORCH_CHECK(!parts_.empty(), "a stacked linear needs at least one part");
    K_ = parts_[0].in_features();
    for (const auto& p : parts_) {
      TORCH_CHECK(p.in_features() == K_, "every part must take ", K_, " inputs, got ", p.in_features());
      offsets_.push_back(N_);
      tile_offsets_.push_back(tiles_);
      N_ += p.out_features();
      tiles_ += p.tiles();
    }
    tile_offsets_.push_back(tiles_);
  }

  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    const at::Tensor x2 = PackedLinear::check_x(x, K_);
    const int64_t M = x2.size(0);
    at::Tensor y = at::empty({M, N_}, x.options());
    if (M > 0) {
      PackedLinear::check_bias(bias, N_);
      std::vector<Prepared> in;
      std::vector<GemmArgs> args;
      int64_t grain = 1;
      for (size_t i = 0; i < parts_.size(); ++i) {
        in.push_back(parts_[i].prepare(x2));
        const float* b = bias ? bias->data_ptr<float>() + offsets_[i] : nullptr;
        args.push_back(parts_[i].args(in.back(), y.data_ptr<float>() + offsets_[i], N_, b));
        grain = std::max(grain, parts_[i].grain(M));
      }
      at::parallel_for(0, tiles_, grain, [&](int64_t t0, int64_t t1) {
        for (size_t i = 0; i < parts_.size(); ++i) {  // this thread's tiles of each part
          const int64_t lo = std::max(t0, tile_offsets_[i]), hi = std::min(t1, tile_offsets_[i + 1]);
          if (lo < hi) run_tiles(args[i], lo - tile_offsets_[i], hi - tile_offsets_[i]);
        }
      });
    }
    return y.view(PackedLinear::out_shape(x, N_));
  }

  std::string name = "cpu";
  int64_t in_features() const { return K_; }
  int64_t out_features() const { return N_; }
  int64_t nbytes() const {
    int64_t n = 0;
    for (const auto& p : parts_) n += p.nbytes();
    return n;
  }

 private:
  std::vector<PackedLinear> parts_;
  std::vector<int64_t> offsets_, tile_offsets_;
  int64_t K_ = 0, N_ = 0, tiles_ = 0;
};

}  // namespace

void register_ops(pybind11::module_& m);  // ops_module.cpp

}  // namespace flotilla_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using flotilla_cpu::PackedLinear;
  using flotilla_cpu::StackedLinear;
  namespace py = pybind11;
  m.doc() = "flotilla CPU dequant-GEMM kernels (fp32 activations; 4-, 5-, 8-bit, fp16 and fp32 weights)";
  m.def("isa", &flotilla_cpu::isa_name, "the instruction set the kernels were compiled for");
  m.attr("TILE") = flotilla_cpu::kTile;
  flotilla_cpu::register_ops(m);
  py::class_<PackedLinear>(m, "PackedLinear", py::dynamic_attr())
      .def(py::init<int64_t, int64_t, int64_t, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                    at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>(),
           py::arg("format"), py::arg("in_features"), py::arg("out_features"), py::arg("codes"), py::arg("scales"),
           py::arg("zoff"), py::arg("gstart"), py::arg("src"), py::arg("mins") = py::none(),
           py::arg("hi") = py::none())
      .def_static("blocked", &PackedLinear::blocked, py::arg("format"), py::arg("in_features"),
                  py::arg("out_features"), py::arg("blob"), py::arg("group"), py::arg("half_tables"),
                  py::arg("with_mins"))
      .def("forward", &PackedLinear::forward, py::arg("x"), py::arg("bias") = py::none())
      .def("__call__", &PackedLinear::forward, py::arg("x"), py::arg("bias") = py::none())
      .def("rows", &PackedLinear::rows, py::arg("ids"), "weight rows (output columns) `ids`, dequantized")
      .def_readwrite("name", &PackedLinear::name)
      .def_property_readonly("in_features", &PackedLinear::in_features)
      .def_property_readonly("out_features", &PackedLinear::out_features)
      .def_property_readonly("format", &PackedLinear::format)
      .def_property_readonly("nbytes", &PackedLinear::nbytes);
  py::class_<StackedLinear>(m, "StackedLinear", py::dynamic_attr())
      .def(py::init<std::vector<PackedLinear>>(), py::arg("parts"))
      .def("forward", &StackedLinear::forward, py::arg("x"), py::arg("bias") = py::none())
      .def("__call__", &StackedLinear::forward, py::arg("x"), py::arg("bias") = py::none())
      .def_readwrite("name", &StackedLinear::name)
      .def_property_readonly("in_features", &StackedLinear::in_features)
      .def_property_readonly("out_features", &StackedLinear::out_features)
      .def_property_readonly("nbytes", &StackedLinear::nbytes);
}
