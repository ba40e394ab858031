// max, min, sum and sum of squares of a contiguous float32 or bfloat16 CPU tensor in one pass over
// memory (torch needs three: aminmax, sum, dot or norm).  Blocks of 1024 values are summed in 16
// float32 lanes, blocks in double; values that are not all finite are left to the caller (NaN
// ordering).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int kLanes = 16;
constexpr int64_t kBlock = 1024;
constexpr int64_t kGrain = 1 << 15;

struct Partial {
  float hi = -INFINITY, lo = INFINITY;
  double sum = 0, squares = 0;
};

inline float value(const float* p, int64_t i) { return p[i]; }

inline float value(const uint16_t* p, int64_t i) {     // bfloat16: the high half of a float32
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <typename T>
Partial reduce(const T* p, int64_t begin, int64_t end) {
  Partial out;
  float hi[kLanes], lo[kLanes];
  for (int k = 0; k < kLanes; ++k) { hi[k] = -INFINITY; lo[k] = INFINITY; }
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    float s[kLanes] = {0}, q[kLanes] = {0};
    for (int64_t j = i; j < i + kBlock; j += kLanes) {
#pragma omp simd
      for (int k = 0; k < kLanes; ++k) {
        const float v = value(p, j + k);
        hi[k] = v > hi[k] ? v : hi[k];
        lo[k] = v < lo[k] ? v : lo[k];
        s[k] += v;
        q[k] += v * v;
      }
    }
    for (int k = 0; k < kLanes; ++k) { out.sum += s[k]; out.squares += q[k]; }
  }
  for (; i < end; ++i) {
    const float v = value(p, i);
    hi[0] = v > hi[0] ? v : hi[0];
    lo[0] = v < lo[0] ? v : lo[0];
    out.sum += v;
    out.squares += static_cast<double>(v) * v;
  }
  for (int k = 0; k < kLanes; ++k) { out.hi = std::max(out.hi, hi[k]); out.lo = std::min(out.lo, lo[k]); }
  return out;
}
}  // namespace

template <typename T>
std::vector<double> run(const T* p, int64_t n) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<Partial> parts(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) parts[c] = reduce(p, c * kGrain, std::min(n, (c + 1) * kGrain));
  });
  Partial all;
  for (const auto& part : parts) {
    all.hi = std::max(all.hi, part.hi);
    all.lo = std::min(all.lo, part.lo);
    all.sum += part.sum;
    all.squares += part.squares;
  }
  return {all.hi, all.lo, all.sum, all.squares};
}

std::vector<double> stats4(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "stats4: a contiguous CPU tensor");
  if (t.scalar_type() == at::kFloat) return run(t.data_ptr<float>(), t.numel());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "stats4: float32 or bfloat16");
  return run(reinterpret_cast<const uint16_t*>(t.data_ptr()), t.numel());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stats4", &stats4, py::call_guard<py::gil_scoped_release>());
}
