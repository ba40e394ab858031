// max, min, sum and sum of squares of a float32 or bfloat16 CPU tensor in one pass over memory (torch
// needs three: aminmax, sum, dot or norm), read in place without a copy: contiguous, a permutation of
// dense memory, expanded, or strided with a dimension of stride 1 (see Walk).  Blocks of 1024 values are summed in 64
// float32 lanes (four vectors, so that no add waits on the last), blocks in double lanes.  Where the sums
// are not finite (inf or nan among the values), `extremes` gives the counts and the finite max and min in
// a second pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int kLanes = 64;          // float32 lanes: four vectors of kVector
constexpr int kVector = 16;         // float32 values per vector (one AVX-512 register, two AVX2 ones)
constexpr int64_t kBlock = 1024;
constexpr int64_t kGrain = 1 << 15;       // values per chunk
// chunks per thread: a tensor over 64K values is read by torch's intra-op threads, each from the part
// the op that wrote it most likely left in its own core's cache; a smaller one on the calling thread
constexpr int64_t kChunksPerThread = 2;

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

typedef float Vec __attribute__((vector_size(kVector * sizeof(float))));
typedef double Wide __attribute__((vector_size(kVector * sizeof(double))));
typedef uint16_t Half __attribute__((vector_size(kVector * sizeof(uint16_t))));
typedef uint32_t Bits __attribute__((vector_size(kVector * sizeof(uint32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec load(const uint16_t* p) {               // bfloat16: the high half of a float32
  Half h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Vec>(__builtin_convertvector(h, Bits) << 16);
}

// Calls fn(row pointer, width) for rows r0..r1 of the last dimension (stride 1), wherever the other
// strides put them; a contiguous run is one row.
template <typename T, typename Fn>
void each_row(const T* p, int64_t r0, int64_t r1, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t width, Fn&& fn) {
  const int64_t outer = static_cast<int64_t>(sizes.size()) - 1;
  std::vector<int64_t> index(std::max<int64_t>(outer, 0));
  int64_t offset = 0, rest = r0;
  for (int64_t d = outer - 1; d >= 0; --d) {
    index[d] = rest % sizes[d];
    offset += index[d] * strides[d];
    rest /= sizes[d];
  }
  for (int64_t r = r0; r < r1; ++r) {
    fn(p + offset, width);
    for (int64_t d = outer - 1; d >= 0; --d) {        // the next row: an odometer over the outer dims
      offset += strides[d];
      if (++index[d] < sizes[d]) break;
      offset -= index[d] * strides[d];
      index[d] = 0;
    }
  }
}

// The statistics of rows r0..r1 (each_row).  Running max/min and float32 sums in kVectors independent
// vectors (one vector would make each add wait for the last), the sums moved into double lanes every
// kBlock values: the same arithmetic whether the values come in one run or in many short rows, whose
// accumulators stay in registers from row to row.
template <typename T>
Partial rows(const T* p, int64_t r0, int64_t r1, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t width) {
  constexpr int kVectors = kLanes / kVector;
  Vec hi[kVectors], lo[kVectors], s[kVectors], q[kVectors];
  for (int k = 0; k < kVectors; ++k) {
    hi[k] = Vec{} - INFINITY;
    lo[k] = Vec{} + INFINITY;
    s[k] = q[k] = Vec{};
  }
  Wide ws{}, wq{};
  double sum = 0, squares = 0;                 // the values after the last whole vector of a row
  float th = -INFINITY, tl = INFINITY;
  int64_t pending = 0;                          // values in s/q since they were moved into ws/wq
  auto fold = [&] {
    Vec a = s[0], b = q[0];
    for (int k = 1; k < kVectors; ++k) { a += s[k]; b += q[k]; s[k] = q[k] = Vec{}; }
    s[0] = q[0] = Vec{};
    ws += __builtin_convertvector(a, Wide);
    wq += __builtin_convertvector(b, Wide);
    pending = 0;
  };
  auto step = [&](const Vec v, int k) {
    hi[k] = v > hi[k] ? v : hi[k];
    lo[k] = v < lo[k] ? v : lo[k];
    s[k] += v;
    q[k] += v * v;
  };
  each_row(p, r0, r1, sizes, strides, width, [&](const T* row, int64_t n) {
    int64_t i = 0;
    while (i + kVector <= n) {
      const int64_t end = i + std::min(kBlock - pending, (n - i) / kVector * kVector);
      pending += end - i;
      for (; i + kLanes <= end; i += kLanes)
        for (int k = 0; k < kVectors; ++k) step(load(row + i + k * kVector), k);
      for (int k = 0; i < end; i += kVector, ++k) step(load(row + i), k);
      if (pending >= kBlock) fold();
    }
    for (; i < n; ++i) {
      const float v = value(row, i);
      th = v > th ? v : th;
      tl = v < tl ? v : tl;
      sum += v;
      squares += static_cast<double>(v) * v;
    }
  });
  fold();
  Partial out;
  out.sum = sum;
  out.squares = squares;
  out.hi = th;
  out.lo = tl;
  for (int m = 0; m < kVector; ++m) {
    out.sum += ws[m];
    out.squares += wq[m];
    for (int k = 0; k < kVectors; ++k) {
      out.hi = std::max(out.hi, hi[k][m]);
      out.lo = std::min(out.lo, lo[k][m]);
    }
  }
  return out;
}

// Values holding inf or nan: their counts, max and min without nan (inf kept), finite max and min.
struct Extremes {
  double nan = 0, inf = 0;
  float hi = -INFINITY, lo = INFINITY, fhi = -INFINITY, flo = INFINITY;

  template <typename T>
  void add(const T* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = value(p, i);
      if (v != v) { nan += 1; continue; }
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
      if (std::isinf(v)) { inf += 1; continue; }
      fhi = v > fhi ? v : fhi;
      flo = v < flo ? v : flo;
    }
  }
};

}  // namespace

Partial combine(const std::vector<Partial>& parts) {
  Partial all;
  for (const auto& part : parts) {
    all.hi = std::max(all.hi, part.hi);
    all.lo = std::min(all.lo, part.lo);
    all.sum += part.sum;
    all.squares += part.squares;
  }
  return all;
}

template <typename T>
Partial run(const T* p, int64_t n) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<Partial> parts(chunks);
  at::parallel_for(0, chunks, kChunksPerThread, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t begin = c * kGrain;
      parts[c] = rows(p + begin, 0, 1, at::IntArrayRef{}, at::IntArrayRef{}, std::min(n, begin + kGrain) - begin);
    }
  });
  return combine(parts);
}

template <typename T>
Partial run_rows(const T* p, at::IntArrayRef sizes, at::IntArrayRef strides) {
  const int64_t dims = sizes.size(), width = sizes[dims - 1];
  int64_t count = 1;
  for (int64_t d = 0; d + 1 < dims; ++d) count *= sizes[d];
  const int64_t per_chunk = std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
  const int64_t chunks = (count + per_chunk - 1) / per_chunk;
  std::vector<Partial> parts(chunks);
  at::parallel_for(0, chunks, kChunksPerThread, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c)
      parts[c] = rows(p, c * per_chunk, std::min(count, (c + 1) * per_chunk), sizes, strides, width);
  });
  return combine(parts);
}

// How the kernel walks a tensor's memory: each distinct element once.  Dimensions of size 1 are
// dropped; a dimension of stride 0 (an expand) repeats the same values, read once and counted
// `repeat` times; elements filling one block of memory in any order (a transpose or permute of
// dense memory) are read as that block; otherwise a dimension of stride 1 is moved last and read
// as rows (the statistics do not depend on the order of the values).  `readable` is false when
// no dimension has stride 1 (every other element, say): the caller reduces a copy instead.
struct Walk {
  std::vector<int64_t> sizes, strides;
  int64_t repeat = 1, count = 1;
  bool flat = false, readable = true;
};

Walk walk_of(const torch::Tensor& t) {
  Walk w;
  if (t.is_contiguous()) {
    w.flat = true;
    w.count = t.numel();
    return w;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;        // (stride, size) of the dimensions read
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (t.stride(d) == 0) { w.repeat *= t.size(d); continue; }
    dims.emplace_back(t.stride(d), t.size(d));
    w.count *= t.size(d);
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  bool block = true;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) { block = false; break; }
    expected *= size;
  }
  if (block) {            // also a single value, or none left: one run of `count` values
    w.flat = true;
    return w;
  }
  if (dims.front().first != 1) {
    w.readable = false;
    return w;
  }
  // rows along the stride-1 dimension, the others outermost first (descending strides)
  for (size_t d = dims.size() - 1; d > 0; --d) {
    w.sizes.push_back(dims[d].second);
    w.strides.push_back(dims[d].first);
  }
  w.sizes.push_back(dims.front().second);
  w.strides.push_back(1);
  return w;
}

template <typename T>
std::vector<double> stats_of(const Walk& w, const T* p) {
  const Partial all = w.flat ? run(p, w.count) : run_rows(p, w.sizes, w.strides);
  return {all.hi, all.lo, all.sum * w.repeat, all.squares * w.repeat};
}

template <typename T>
std::vector<double> extremes_of(const Walk& w, const T* p) {
  const int64_t width = w.flat ? w.count : w.sizes.back();
  const int64_t rows = w.flat ? 1 : w.count / std::max<int64_t>(width, 1);
  Extremes all;
  each_row(p, 0, rows, w.flat ? at::IntArrayRef{} : at::IntArrayRef(w.sizes),
           w.flat ? at::IntArrayRef{} : at::IntArrayRef(w.strides), width, [&](const T* row, int64_t n) { all.add(row, n); });
  return {all.nan * w.repeat, all.inf * w.repeat, all.hi, all.lo, all.fhi, all.flo};
}

// Calls fn with the walk and the tensor's values (float32, or bfloat16 bits), after the checks
// both passes share; an empty result where the walk cannot read the tensor in place.
template <typename Fn>
std::vector<double> on_values(const torch::Tensor& t, const char* name, Fn&& fn) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, name, ": a strided CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
  const Walk w = walk_of(t);
  if (!w.readable || t.numel() == 0) return {};
  if (t.scalar_type() == at::kFloat) return fn(w, t.data_ptr<float>());
  return fn(w, reinterpret_cast<const uint16_t*>(t.data_ptr()));
}

// [max, min, sum, sum of squares], or [] where the tensor is not read in place (see Walk).
std::vector<double> stats4(const torch::Tensor& t) {
  return on_values(t, "stats4", [&](const Walk& w, auto p) { return stats_of(w, p); });
}

// For values where stats4's sums are not finite: nan count, inf count, max and min without nan,
// finite max and min (rare tensors: one plain pass).
std::vector<double> extremes(const torch::Tensor& t) {
  return on_values(t, "extremes", [&](const Walk& w, auto p) { return extremes_of(w, p); });
}

// Whether the elements of a strided tensor fill one block of memory, without gap or overlap (a
// permutation of dense memory): backend._fills_block's rule.
bool fills_block(at::IntArrayRef sizes, at::IntArrayRef strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] != 1) dims.emplace_back(strides[d], sizes[d]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

// What the per-op path reads of every tensor it records, in one call: (scalar type, shape, stride,
// requires_grad, data pointer, version, number of elements, whether its elements fill one block).
// None where the tensor is not plain strided memory the probe may read (no storage, a wrapper,
// nested, an inference tensor, memory not allocated): the Python path decides those.
py::object describe(const torch::Tensor& t) {
  if (t.layout() != at::kStrided || !t.has_storage() || t.is_nested() || t.is_inference() ||
      t.key_set().has(c10::DispatchKey::Functionalize))
    return py::none();
  const void* ptr = nullptr;
  try {
    ptr = t.data_ptr();
  } catch (const c10::Error&) {
    return py::none();
  }
  const int64_t n = t.numel();
  if (ptr == nullptr && n != 0) return py::none();
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  py::tuple shape(sizes.size()), stride(strides.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    shape[d] = py::int_(sizes[d]);
    stride[d] = py::int_(strides[d]);
  }
  const bool dense = n != 0 && (t.is_contiguous() || fills_block(sizes, strides));
  return py::make_tuple(static_cast<int>(t.scalar_type()), shape, stride, t.requires_grad(),
                        reinterpret_cast<uintptr_t>(ptr), t._version(), n, dense);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stats4", &stats4, py::call_guard<py::gil_scoped_release>());
  m.def("extremes", &extremes, py::call_guard<py::gil_scoped_release>());
  m.def("describe", &describe);
}
