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
constexpr int kVectors = kLanes / kVector;
constexpr int64_t kBlock = 1024;
constexpr int64_t kGrain = 1 << 15;       // values per chunk
// chunks per thread: a tensor over 64K values is read by torch's intra-op threads, each from the part
// the op that wrote it most likely left in its own core's cache; a smaller one on the calling thread
constexpr int64_t kChunksPerThread = 2;

struct Partial {
  float hi = -INFINITY, lo = INFINITY;
  double sum = 0, squares = 0;

  void add(const Partial& o) {
    hi = std::max(hi, o.hi);
    lo = std::min(lo, o.lo);
    sum += o.sum;
    squares += o.squares;
  }
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

// Two vectors of values at once: kVectors / 2 pairs cover a group of kLanes.  For bfloat16, one load
// of 2 * kVector values interleaved with zeros (each value becomes the high half of a float32): in
// another order than memory's, which the statistics do not depend on, and far fewer instructions
// than widening each half.
inline void load_pair(const float* p, Vec& a, Vec& b) {
  a = load(p);
  b = load(p + kVector);
}

typedef uint16_t Halves __attribute__((vector_size(2 * kVector * sizeof(uint16_t))));

inline void load_pair(const uint16_t* p, Vec& a, Vec& b) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Halves z{};
  // within each 16-byte lane (8 values) the low four, then the high four, each after a zero
#define DP_LANE(L, J) (8 * (L) + (J)), (2 * kVector + 8 * (L) + (J))
#define DP_HALF(L, J0) DP_LANE(L, J0), DP_LANE(L, J0 + 1), DP_LANE(L, J0 + 2), DP_LANE(L, J0 + 3)
#if defined(__clang__) || __GNUC__ >= 12
  a = reinterpret_cast<Vec>(__builtin_shufflevector(z, h, DP_HALF(0, 0), DP_HALF(1, 0), DP_HALF(2, 0), DP_HALF(3, 0)));
  b = reinterpret_cast<Vec>(__builtin_shufflevector(z, h, DP_HALF(0, 4), DP_HALF(1, 4), DP_HALF(2, 4), DP_HALF(3, 4)));
#else   // GCC before 12: the same shuffles by mask
  const Halves low{DP_HALF(0, 0), DP_HALF(1, 0), DP_HALF(2, 0), DP_HALF(3, 0)};
  const Halves high{DP_HALF(0, 4), DP_HALF(1, 4), DP_HALF(2, 4), DP_HALF(3, 4)};
  a = reinterpret_cast<Vec>(__builtin_shuffle(z, h, low));
  b = reinterpret_cast<Vec>(__builtin_shuffle(z, h, high));
#endif
#undef DP_HALF
#undef DP_LANE
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

// Reads rows r0..r1 (each_row) into an accumulator in kVectors independent vectors (one vector would
// make each step wait for the last), folded every kBlock values: the same arithmetic whether the
// values come in one run or in many short rows, the accumulator's vectors held in registers from
// row to row.  The values after a row's last whole vector go to acc.scalar.
template <typename Acc, typename T>
typename Acc::Result rows(const T* p, int64_t r0, int64_t r1, at::IntArrayRef sizes, at::IntArrayRef strides,
                          int64_t width) {
  Acc acc;
  int64_t pending = 0;                          // values stepped since the last fold
  each_row(p, r0, r1, sizes, strides, width, [&](const T* row, int64_t n) {
    int64_t i = 0;
    while (i + kVector <= n) {
      const int64_t end = i + std::min(kBlock - pending, (n - i) / kVector * kVector);
      pending += end - i;
      for (; i + kLanes <= end; i += kLanes)
        for (int k = 0; k < kVectors; k += 2) {
          Vec a, b;
          load_pair(row + i + k * kVector, a, b);
          acc.step(a, k);
          acc.step(b, k + 1);
        }
      for (int k = 0; i < end; i += kVector, ++k) acc.step(load(row + i), k);
      if (pending >= kBlock) {
        acc.fold();
        pending = 0;
      }
    }
    for (; i < n; ++i) acc.scalar(value(row, i));
  });
  acc.fold();
  return acc.done();
}

inline Vec fill(float v) { return Vec{} + v; }

// Adds the kVectors float32 vectors of a block into double lanes and clears them.
inline void fold_into(Vec* v, Wide& into) {
  Vec all = v[0];
  for (int k = 1; k < kVectors; ++k) all += v[k];
  for (int k = 0; k < kVectors; ++k) v[k] = Vec{};
  into += __builtin_convertvector(all, Wide);
}

// max, min, sum and sum of squares: float32 sums per block, moved into double lanes.
struct Sums {
  using Result = Partial;
  Vec hi[kVectors], lo[kVectors], s[kVectors], q[kVectors];
  Wide ws{}, wq{};
  double sum = 0, squares = 0;
  float th = -INFINITY, tl = INFINITY;

  Sums() {
    for (int k = 0; k < kVectors; ++k) { hi[k] = fill(-INFINITY); lo[k] = fill(INFINITY); s[k] = q[k] = Vec{}; }
  }
  void step(const Vec v, int k) {
    hi[k] = v > hi[k] ? v : hi[k];               // nan compares false: never kept
    lo[k] = v < lo[k] ? v : lo[k];
    s[k] += v;
    q[k] += v * v;
  }
  void scalar(float v) {
    th = v > th ? v : th;
    tl = v < tl ? v : tl;
    sum += v;
    squares += static_cast<double>(v) * v;
  }
  void fold() {
    fold_into(s, ws);
    fold_into(q, wq);
  }
  Partial done() const {
    Partial out{th, tl, sum, squares};
    for (int m = 0; m < kVector; ++m)
      for (int k = 0; k < kVectors; ++k) out.add({hi[k][m], lo[k][m], k ? 0 : ws[m], k ? 0 : wq[m]});
    return out;
  }
};

// Values holding inf or nan: their counts, max and min without nan (inf kept), finite max and min.
struct ExtremesPartial {
  double nan = 0, inf = 0;
  float hi = -INFINITY, lo = INFINITY, fhi = -INFINITY, flo = INFINITY;

  void add(const ExtremesPartial& o) {
    nan += o.nan;
    inf += o.inf;
    hi = std::max(hi, o.hi);
    lo = std::min(lo, o.lo);
    fhi = std::max(fhi, o.fhi);
    flo = std::min(flo, o.flo);
  }
};

struct Extremes {
  using Result = ExtremesPartial;
  Vec hi[kVectors], lo[kVectors], fhi[kVectors], flo[kVectors], nan[kVectors], inf[kVectors];
  Wide wn{}, wi{};
  ExtremesPartial tail;

  Extremes() {
    for (int k = 0; k < kVectors; ++k) {
      hi[k] = fhi[k] = fill(-INFINITY);
      lo[k] = flo[k] = fill(INFINITY);
      nan[k] = inf[k] = Vec{};
    }
  }
  void step(const Vec v, int k) {
    const Vec a = v < 0 ? -v : v;
    const auto finite = a < INFINITY;                    // false for inf and nan
    hi[k] = v > hi[k] ? v : hi[k];
    lo[k] = v < lo[k] ? v : lo[k];
    fhi[k] = (finite & (v > fhi[k])) ? v : fhi[k];
    flo[k] = (finite & (v < flo[k])) ? v : flo[k];
    nan[k] -= __builtin_convertvector(v != v, Vec);      // a true comparison is -1
    inf[k] -= __builtin_convertvector(a == INFINITY, Vec);
  }
  void scalar(float v) {
    if (v != v) { tail.nan += 1; return; }
    tail.hi = v > tail.hi ? v : tail.hi;
    tail.lo = v < tail.lo ? v : tail.lo;
    if (std::isinf(v)) { tail.inf += 1; return; }
    tail.fhi = v > tail.fhi ? v : tail.fhi;
    tail.flo = v < tail.flo ? v : tail.flo;
  }
  void fold() {                                          // counts of at most kBlock: exact in float32
    fold_into(nan, wn);
    fold_into(inf, wi);
  }
  ExtremesPartial done() const {
    ExtremesPartial out = tail;
    for (int m = 0; m < kVector; ++m)
      for (int k = 0; k < kVectors; ++k)
        out.add({k ? 0 : wn[m], k ? 0 : wi[m], hi[k][m], lo[k][m], fhi[k][m], flo[k][m]});
    return out;
  }
};

template <typename R>
R merged(const std::vector<R>& parts) {
  R all;
  for (const auto& part : parts) all.add(part);
  return all;
}

}  // namespace

template <typename Acc, typename T>
typename Acc::Result run(const T* p, int64_t n) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<typename Acc::Result> parts(chunks);
  at::parallel_for(0, chunks, kChunksPerThread, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t begin = c * kGrain;
      parts[c] = rows<Acc>(p + begin, 0, 1, at::IntArrayRef{}, at::IntArrayRef{}, std::min(n, begin + kGrain) - begin);
    }
  });
  return merged(parts);
}

template <typename Acc, typename T>
typename Acc::Result run_rows(const T* p, at::IntArrayRef sizes, at::IntArrayRef strides) {
  const int64_t dims = sizes.size(), width = sizes[dims - 1];
  int64_t count = 1;
  for (int64_t d = 0; d + 1 < dims; ++d) count *= sizes[d];
  const int64_t per_chunk = std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
  const int64_t chunks = (count + per_chunk - 1) / per_chunk;
  std::vector<typename Acc::Result> parts(chunks);
  at::parallel_for(0, chunks, kChunksPerThread, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c)
      parts[c] = rows<Acc>(p, c * per_chunk, std::min(count, (c + 1) * per_chunk), sizes, strides, width);
  });
  return merged(parts);
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

template <typename Acc, typename T>
typename Acc::Result walk(const Walk& w, const T* p) {
  return w.flat ? run<Acc>(p, w.count) : run_rows<Acc>(p, w.sizes, w.strides);
}

template <typename T>
std::vector<double> stats_of(const Walk& w, const T* p) {
  const Partial all = walk<Sums>(w, p);
  return {all.hi, all.lo, all.sum * w.repeat, all.squares * w.repeat};
}

template <typename T>
std::vector<double> extremes_of(const Walk& w, const T* p) {
  const ExtremesPartial all = walk<Extremes>(w, p);
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
