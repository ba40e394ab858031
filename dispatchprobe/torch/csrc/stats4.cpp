// max, min, sum and sum of squares of a float32 or bfloat16 CPU tensor in one pass over memory (torch
// needs three: aminmax, sum, dot or norm), read in place without a copy: contiguous, a permutation of
// dense memory, expanded, or strided with a dimension of stride 1 (see Walk).  The sums follow
// statistics.tree_sums' order (see tree_chunk), the Python path's, so both give the same bits.  Where
// the sums are not finite (inf or nan among the values), `extremes` gives the counts and the finite
// max and min in a second pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cerrno>
#include <cstring>
#include <unistd.h>
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

// ---- sums in statistics.tree_sums' order ------------------------------------------------------
// The values are taken in the order they lie in memory (the walk's order), in blocks of kTreeRows
// rows of kTreeLanes float32 lanes; each block's rows are added by pairwise halving, then its
// lanes down to kFolded, widened to double; the blocks of a chunk (kChunkBlocks) by halving, the
// chunk's lanes by halving, and the chunks by halving.  Squares are rounded to float32 before they
// are added (the build turns off fused multiply-adds).  Python's statistics.tree_sums is the same
// sum, value for value, so every path gives the same bits.
constexpr int kTreeRows = 16, kTreeLanes = 64, kFolded = 16, kChunkBlocks = 32;
constexpr int64_t kTreeBlock = kTreeRows * kTreeLanes;            // 1024 values
constexpr int64_t kTreeChunk = kTreeBlock * kChunkBlocks;         // 32768 values
static_assert(kTreeLanes == kVectors * kVector && kFolded == kVector, "a block row is kVectors vectors");

struct TreeChunk {
  float hi = -INFINITY, lo = INFINITY;
  double sum = 0, squares = 0;
};

typedef double Folded __attribute__((vector_size(kFolded * sizeof(double))));

// Halves v[0..n) pairwise in place down to v[0] (n a power of two).
template <typename V>
inline void halve(V* v, int n) {
  for (int h = n / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
}

// One whole block of float32 values (or bfloat16 bits) at q: its folded sums and squares, and
// its max and min into hi/lo.  Rows r and r + 8 are read together (the first halving), each of
// the four vector columns with its own max and min, all held in locals (the values read cannot
// alias them).
template <typename T>
inline void tree_block(const T* __restrict q, Folded& sum, Folded& squares, Vec& hi_io, Vec& lo_io) {
  Vec hi[kVectors], lo[kVectors], a[kTreeRows / 2][kVectors], s[kTreeRows / 2][kVectors];
  for (int k = 0; k < kVectors; ++k) { hi[k] = hi_io; lo[k] = lo_io; }
  for (int r = 0; r < kTreeRows / 2; ++r)
    for (int k = 0; k < kVectors; ++k) {
      const Vec x = load(q + r * kTreeLanes + k * kVector);
      const Vec y = load(q + (r + kTreeRows / 2) * kTreeLanes + k * kVector);
      hi[k] = x > hi[k] ? x : hi[k];               // nan compares false: never kept
      lo[k] = x < lo[k] ? x : lo[k];
      hi[k] = y > hi[k] ? y : hi[k];
      lo[k] = y < lo[k] ? y : lo[k];
      a[r][k] = x + y;
      s[r][k] = x * x + y * y;                      // each square rounded (no fused multiply-add)
    }
  for (int h = kTreeRows / 4; h >= 1; h /= 2)
    for (int r = 0; r < h; ++r)
      for (int k = 0; k < kVectors; ++k) {
        a[r][k] = a[r][k] + a[r + h][k];
        s[r][k] = s[r][k] + s[r + h][k];
      }
  Vec h = hi[0], l = lo[0];
  for (int k = 1; k < kVectors; ++k) {
    h = hi[k] > h ? hi[k] : h;
    l = lo[k] < l ? lo[k] : l;
  }
  hi_io = h;
  lo_io = l;
  // lanes 64 -> 32 -> 16: lane j + lane j + 32, then j + 16
  sum = __builtin_convertvector((a[0][0] + a[0][2]) + (a[0][1] + a[0][3]), Folded);
  squares = __builtin_convertvector((s[0][0] + s[0][2]) + (s[0][1] + s[0][3]), Folded);
}

// Reads the walk's values from sequence position `begin` on, a run at a time (a contiguous
// stretch of memory: the whole tensor when flat, else one row).
template <typename T>
struct Cursor {
  const T* p;
  const Walk& w;
  int64_t width;
  std::vector<int64_t> index;                     // the outer dims' index of the current row
  int64_t offset = 0, col = 0;

  Cursor(const T* p_, const Walk& w_, int64_t begin) : p(p_), w(w_), width(0) {
    if (w.flat) return;                             // read in place, block by block
    const int64_t dims = static_cast<int64_t>(w.sizes.size());
    width = w.sizes[dims - 1];
    index.assign(dims - 1, 0);
    int64_t row = begin / width;
    col = begin % width;
    for (int64_t d = dims - 2; d >= 0; --d) {
      index[d] = row % w.sizes[d];
      offset += index[d] * w.strides[d];
      row /= w.sizes[d];
    }
  }
  // copies the next n values into dst (float32), moving on
  void copy(float* dst, int64_t n) {
    while (n > 0) {
      const int64_t take = std::min(n, width - col);
      const T* src = p + offset + col;
      for (int64_t i = 0; i < take; ++i) dst[i] = value(src, i);
      dst += take;
      n -= take;
      col += take;
      if (col == width) next_row();
    }
  }
  void next_row() {
    col = 0;
    for (int64_t d = static_cast<int64_t>(index.size()) - 1; d >= 0; --d) {
      offset += w.strides[d];
      if (++index[d] < w.sizes[d]) return;
      offset -= index[d] * w.strides[d];
      index[d] = 0;
    }
  }
};

// Chunk c of the walk's values (kTreeChunk values from c * kTreeChunk, fewer at the end).
template <typename T>
TreeChunk tree_chunk(const T* p, const Walk& w, int64_t c) {
  const int64_t begin = c * kTreeChunk, n = std::min(w.count - begin, kTreeChunk);
  Folded sums[kChunkBlocks] = {}, squares[kChunkBlocks] = {};
  Vec hi = fill(-INFINITY), lo = fill(INFINITY);
  TreeChunk out;
  alignas(64) float staged[kTreeBlock];
  Cursor<T> cursor(p, w, begin);
  for (int64_t b = 0; b * kTreeBlock < n; ++b) {
    const int64_t m = std::min(n - b * kTreeBlock, kTreeBlock);
    if (m == kTreeBlock && w.flat) {
      tree_block(p + begin + b * kTreeBlock, sums[b], squares[b], hi, lo);
      continue;
    }
    std::memset(staged, 0, sizeof staged);          // padding zeros: they change no sum
    if (w.flat) {
      const T* src = p + begin + b * kTreeBlock;
      for (int64_t i = 0; i < m; ++i) staged[i] = value(src, i);
    } else {
      cursor.copy(staged, m);
    }
    if (m == kTreeBlock) {
      tree_block(static_cast<const float*>(staged), sums[b], squares[b], hi, lo);
      continue;
    }
    Vec unused_hi = hi, unused_lo = lo;             // max and min of the m values only
    tree_block(static_cast<const float*>(staged), sums[b], squares[b], unused_hi, unused_lo);
    for (int64_t i = 0; i < m; ++i) {
      const float v = staged[i];
      out.hi = v > out.hi ? v : out.hi;
      out.lo = v < out.lo ? v : out.lo;
    }
  }
  halve(sums, kChunkBlocks);
  halve(squares, kChunkBlocks);
  double ls[kFolded], lq[kFolded];
  for (int j = 0; j < kFolded; ++j) { ls[j] = sums[0][j]; lq[j] = squares[0][j]; }
  halve(ls, kFolded);
  halve(lq, kFolded);
  out.sum = ls[0];
  out.squares = lq[0];
  for (int j = 0; j < kVector; ++j) {
    out.hi = hi[j] > out.hi ? hi[j] : out.hi;
    out.lo = lo[j] < out.lo ? lo[j] : out.lo;
  }
  return out;
}

template <typename T>
std::vector<double> stats_of(const Walk& w, const T* p) {
  const int64_t chunks = (w.count + kTreeChunk - 1) / kTreeChunk;
  std::vector<TreeChunk> parts(chunks);
  at::parallel_for(0, chunks, kChunksPerThread, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) parts[c] = tree_chunk(p, w, c);
  });
  int64_t width = 1;
  while (width < chunks) width *= 2;
  std::vector<double> sums(width, 0.0), squares(width, 0.0);
  float hi = -INFINITY, lo = INFINITY;
  for (int64_t c = 0; c < chunks; ++c) {
    sums[c] = parts[c].sum;
    squares[c] = parts[c].squares;
    hi = std::max(hi, parts[c].hi);
    lo = std::min(lo, parts[c].lo);
  }
  for (int64_t h = width / 2; h >= 1; h /= 2)
    for (int64_t i = 0; i < h; ++i) { sums[i] += sums[i + h]; squares[i] += squares[i + h]; }
  return {hi, lo, (sums[0] + 0.0) * w.repeat, (squares[0] + 0.0) * w.repeat};
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

// The per-op path's description of a tensor in one call: (meta, identity, dense key), the values
// backend.describe's Python path gives (the record's fields, the value cache's keys), built here
// because every recorded op asks for them of each of its tensors.  None where the tensor is not a
// plain torch.Tensor or Parameter in strided memory the probe may read (a subclass, no storage,
// nested, an inference tensor, memory not allocated): the Python path decides those.
namespace {
struct Names {
  PyObject* param_type = nullptr;        // torch.nn.Parameter
  PyObject* unseen = nullptr;            // tensor_kinds._unseen_writes: storage address -> writes
  PyObject* keys[7] = {};                // "type", "dtype", "shape", "stride", "device", "requires_grad", "param"
  PyObject* tensor = nullptr;            // "tensor"
  std::vector<std::pair<PyObject*, PyObject*>> dtypes;          // scalar type -> (torch.dtype, its name)
  std::vector<std::pair<int64_t, std::pair<PyObject*, PyObject*>>> devices;   // -> (torch.device, its name)
};
Names names;

void configure(py::handle param_type, py::handle unseen) {
  names.param_type = param_type.inc_ref().ptr();
  names.unseen = unseen.inc_ref().ptr();
  const char* keys[] = {"type", "dtype", "shape", "stride", "device", "requires_grad", "param"};
  for (int i = 0; i < 7; ++i) names.keys[i] = PyUnicode_InternFromString(keys[i]);
  names.tensor = PyUnicode_InternFromString("tensor");
}

// The cache's keys and entries hold numbers, strings, dtypes, devices, statistics and a weak
// reference without a callback: they can be part of no reference cycle, so Python's cyclic
// collector is told not to follow them (CPython does the same for such tuples and dicts, but
// only once a collection has looked at them).  A step caches hundreds of values; tracked, each
// collection would walk them all.
PyObject* untracked(PyObject* o) {
  if (PyObject_IS_GC(o)) PyObject_GC_UnTrack(o);
  return o;
}

// Whether `o` can be part of no reference cycle: not a GC object, or a weak reference without a
// callback, or a dict or tuple of such values (a cache entry, a statistics record).
bool acyclic(PyObject* o, int depth = 0) {
  if (!PyObject_IS_GC(o)) return true;
  if (depth > 2) return false;
  if (PyWeakref_CheckRefExact(o)) return reinterpret_cast<PyWeakReference*>(o)->wr_callback == nullptr;
  if (PyDict_CheckExact(o)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v))
      if (!acyclic(k, depth + 1) || !acyclic(v, depth + 1)) return false;
    return true;
  }
  if (PyTuple_CheckExact(o)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i)
      if (!acyclic(PyTuple_GET_ITEM(o, i), depth + 1)) return false;
    return true;
  }
  return false;
}

// backend.cache_entry: the recorder's (weak reference, value) pair, untracked with its parts
// where none of them can hold a cycle (the Python path's cache entries, as the encoder's are)
py::object cache_entry(py::handle ref, py::handle value) {
  py::tuple pair = py::make_tuple(ref, value);
  if (acyclic(pair.ptr())) {
    untracked(ref.ptr());
    if (PyDict_CheckExact(value.ptr())) {
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      while (PyDict_Next(value.ptr(), &pos, &k, &v)) untracked(v);
    }
    untracked(value.ptr());
    untracked(pair.ptr());
  }
  return std::move(pair);
}

std::pair<PyObject*, PyObject*> dtype_of(at::ScalarType type) {
  const size_t i = static_cast<size_t>(type);
  if (i >= names.dtypes.size()) names.dtypes.resize(i + 1, {nullptr, nullptr});
  auto& entry = names.dtypes[i];
  if (entry.first == nullptr) {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(type));
    Py_INCREF(dtype);
    std::string name = py::str(dtype);
    if (name.rfind("torch.", 0) == 0) name = name.substr(6);
    entry = {dtype, PyUnicode_InternFromString(name.c_str())};
  }
  return entry;
}

std::pair<PyObject*, PyObject*> device_of(const c10::Device& device) {
  const int64_t key = static_cast<int64_t>(device.type()) * 65536 + device.index() + 1;
  for (const auto& [k, v] : names.devices)
    if (k == key) return v;
  PyObject* obj = THPDevice_New(device);
  PyObject* name = PyObject_Str(obj);
  names.devices.emplace_back(key, std::make_pair(obj, name));
  return {obj, name};
}

PyObject* int_list(at::IntArrayRef values, bool tuple) {
  PyObject* out = tuple ? PyTuple_New(values.size()) : PyList_New(values.size());
  for (size_t d = 0; d < values.size(); ++d) {
    PyObject* v = PyLong_FromLongLong(values[d]);
    if (tuple) PyTuple_SET_ITEM(out, d, v); else PyList_SET_ITEM(out, d, v);
  }
  return out;
}

// What describe() finds of a plain tensor: the record's fields and the cache keys.
struct Described {
  const at::Tensor* t = nullptr;
  bool param = false;
  PyObject* dtype_name = nullptr;         // borrowed: interned, kept in names
  PyObject* device_name = nullptr;
  py::object ident, dense;               // dense: None where the values do not fill a block
};

// A torch.Tensor or Parameter itself, not a subclass (whose values the Python path decides)
bool plain_tensor(PyObject* obj) {
  PyObject* cls = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  return names.param_type != nullptr && (cls == THPVariableClass || cls == names.param_type);
}

// [max, min, sum, sum of squares] of integers (or bools) at strided positions, in double; empty
// where a sum could round: below 2**53 for the sum of squares, every square and every partial sum
// is an exact integer (and |sum| <= sum of squares), so the result is exact whatever the order of
// the elements: the one torch's or numpy's float64 reductions give these values (statistics.source)
template <typename T>
std::vector<double> exact_sums(const T* p, at::IntArrayRef sizes, at::IntArrayRef strides) {
  double hi = -std::numeric_limits<double>::infinity(), lo = std::numeric_limits<double>::infinity();
  double total = 0, squares = 0;
  const int64_t dims = static_cast<int64_t>(sizes.size());
  const int64_t inner = dims ? sizes[dims - 1] : 1, step = dims ? strides[dims - 1] : 1;
  std::vector<int64_t> index(dims > 1 ? dims - 1 : 0, 0);
  for (;;) {
    int64_t offset = 0;
    for (int64_t d = 0; d + 1 < dims; ++d) offset += index[d] * strides[d];
    for (int64_t i = 0; i < inner; ++i) {
      const double v = static_cast<double>(p[offset + i * step]);
      hi = std::max(hi, v);
      lo = std::min(lo, v);
      total += v;
      squares += v * v;
    }
    int64_t d = dims - 2;          // the next row: the outer index counted like an odometer
    for (; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
    if (d < 0) break;
  }
  if (!(squares < 9007199254740992.0)) return {};
  return {hi, lo, total, squares};
}

// exact_sums of a non-empty integer or bool CPU tensor, in any layout; empty for other dtypes
std::vector<double> integer_sums(const at::Tensor& t) {
  const void* p = t.data_ptr();
  switch (t.scalar_type()) {
    case at::kLong: return exact_sums(static_cast<const int64_t*>(p), t.sizes(), t.strides());
    case at::kInt: return exact_sums(static_cast<const int32_t*>(p), t.sizes(), t.strides());
    case at::kShort: return exact_sums(static_cast<const int16_t*>(p), t.sizes(), t.strides());
    case at::kChar: return exact_sums(static_cast<const int8_t*>(p), t.sizes(), t.strides());
    case at::kByte: return exact_sums(static_cast<const uint8_t*>(p), t.sizes(), t.strides());
    case at::kBool: return exact_sums(static_cast<const bool*>(p), t.sizes(), t.strides());
    default: return {};
  }
}

// fn() for tensor t, with the GIL released where t is large enough for that to pay
template <typename Fn>
std::vector<double> released_for_large(const at::Tensor& t, Fn&& fn) {
  if (t.numel() >= kGrain) {
    py::gil_scoped_release no_gil;
    return fn();
  }
  return fn();
}

// [max, min, sum, sum of squares] of a float32/bfloat16 CPU tensor read in place (integers and
// bools: integer_sums, exact or empty); empty where the Python path decides: another dtype or
// device, a layout not read in place, integers whose sums are not exact.  Float sums may be inf
// or nan (values holding inf or nan: see nonfinite_extremes; or float32 block sums that overflowed).
std::vector<double> sums(const at::Tensor& t) {
  const auto type = t.scalar_type();
  if (!t.device().is_cpu() || t.numel() == 0) return {};
  const bool integral = at::isIntegralType(type, /*includeBool=*/true);
  if (!integral && type != at::kFloat && type != at::kBFloat16) return {};
  return released_for_large(t, [&] { return integral ? integer_sums(t) : stats4(t); });
}

// extremes() of a float32/bfloat16 tensor whose sums() were not finite, where its values hold inf
// or nan; empty where they do not (finite values whose float32 block sums overflowed: the Python
// path's float64 sums)
std::vector<double> nonfinite_extremes(const at::Tensor& t) {
  std::vector<double> e = released_for_large(t, [&] { return extremes(t); });
  if (!e.empty() && e[0] == 0 && e[1] == 0) e.clear();
  return e;
}

bool describe_into(PyObject* obj, Described& d) {
  if (!plain_tensor(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.layout() != at::kStrided || !t.has_storage() || t.is_nested() || t.is_inference() ||
      t.key_set().has(c10::DispatchKey::Functionalize))
    return false;
  const void* ptr = nullptr;
  try {
    ptr = t.data_ptr();
  } catch (const c10::Error&) {
    return false;
  }
  const int64_t n = t.numel();
  if (ptr == nullptr && n != 0) return false;
  bool param = reinterpret_cast<PyObject*>(Py_TYPE(obj)) == names.param_type;
  if (!param && t.is_view()) {
    PyObject* base = THPVariable_Wrap(t._base());
    param = base != nullptr && reinterpret_cast<PyObject*>(Py_TYPE(base)) == names.param_type;
    Py_XDECREF(base);
  }
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const auto [dtype, dtype_name] = dtype_of(t.scalar_type());
  const auto [device, device_name] = device_of(t.device());
  // the version: the in-place counter, paired with the writes it did not see once any were counted
  py::object version = py::int_(t._version());
  if (PyDict_GET_SIZE(names.unseen)) {
    py::int_ storage(reinterpret_cast<uintptr_t>(t.storage().data_ptr().get()));
    PyObject* writes = PyDict_GetItem(names.unseen, storage.ptr());
    version = py::make_tuple(version, writes ? py::reinterpret_borrow<py::object>(writes) : py::int_(0));
  }
  py::object shape = py::reinterpret_steal<py::object>(int_list(sizes, true));
  py::object stride = py::reinterpret_steal<py::object>(int_list(strides, true));
  py::int_ address(reinterpret_cast<uintptr_t>(ptr));
  py::handle dt(dtype), dev(device);
  d.t = &t;
  d.param = param;
  d.dtype_name = dtype_name;
  d.device_name = device_name;
  d.ident = py::make_tuple(address, shape, stride, dt, dev, version);
  const bool dense = n != 0 && (t.is_contiguous() || fills_block(sizes, strides));
  d.dense = dense ? py::object(py::make_tuple(address, py::int_(n), dt, dev, version)) : py::none();
  for (PyObject* o : {shape.ptr(), stride.ptr(), version.ptr(), d.ident.ptr(), d.dense.ptr()}) untracked(o);
  return true;
}

// the record's fields of a described tensor (backend.describe's meta)
py::dict meta_of(const Described& d) {
  py::dict meta;
  PyObject* m = meta.ptr();
  PyDict_SetItem(m, names.keys[0], names.tensor);
  PyDict_SetItem(m, names.keys[1], d.dtype_name);
  py::object shape_list = py::reinterpret_steal<py::object>(int_list(d.t->sizes(), false));
  py::object stride_list = py::reinterpret_steal<py::object>(int_list(d.t->strides(), false));
  PyDict_SetItem(m, names.keys[2], shape_list.ptr());
  PyDict_SetItem(m, names.keys[3], stride_list.ptr());
  PyDict_SetItem(m, names.keys[4], d.device_name);
  PyDict_SetItem(m, names.keys[5], d.t->requires_grad() ? Py_True : Py_False);
  if (d.param) PyDict_SetItem(m, names.keys[6], Py_True);
  return meta;
}

py::object describe(py::handle obj) {
  Described d;
  if (!describe_into(obj.ptr(), d)) return py::none();
  return py::make_tuple(meta_of(d), d.ident, d.dense);
}


// Whether every element of strided `t` lies in its storage's allocated bytes (not a storage
// freed to size 0 between uses, as FSDP2 does with its parameters)
bool within_storage(const at::Tensor& t) {
  if (t.storage().data() == nullptr) return false;
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return false;
    last += (t.size(d) - 1) * t.stride(d);
  }
  return (last + 1) * static_cast<int64_t>(t.element_size()) <= static_cast<int64_t>(t.storage().nbytes());
}

// One window of a compiled graph's CPU values (compile/runtime.py): the device stats row of each,
// [max, min, sum, L2 norm, nan count, inf count], into row i of `out` (float64, (len, 6)), where
// sums() reads a plain tensor (float32/bfloat16, integers and bools with exact sums); float values
// holding inf or nan take nonfinite_extremes() too, their row made by `nonfinite_row`
// (statistics.nonfinite_row).  Returns the indexes of the others, which the Python path completes
// (other dtypes, layouts not read in place, finite values whose float32 sums overflowed, ...).
std::vector<int64_t> rows_into(const py::list& values, torch::Tensor out, py::handle nonfinite_row) {
  TORCH_CHECK(out.scalar_type() == at::kDouble && out.is_contiguous() && out.dim() == 2 && out.size(1) == 6 &&
                  out.size(0) == static_cast<int64_t>(values.size()), "rows_into: a contiguous float64 (len, 6) tensor");
  double* o = out.data_ptr<double>();
  std::vector<int64_t> left;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* obj = values[i].ptr();
    const at::Tensor* t = plain_tensor(obj) ? &THPVariable_Unpack(obj) : nullptr;
    std::vector<double> s;
    if (t != nullptr && t->layout() == at::kStrided && t->has_storage() && within_storage(*t)) s = sums(*t);
    double* row = o + 6 * i;
    if (!s.empty() && std::isfinite(s[2]) && std::isfinite(s[3])) {
      row[0] = s[0], row[1] = s[1], row[2] = s[2], row[3] = std::sqrt(s[3]), row[4] = 0, row[5] = 0;
      continue;
    }
    const std::vector<double> e = s.empty() ? s : nonfinite_extremes(*t);
    if (!e.empty()) {
      py::list r = nonfinite_row(s[2], s[3], static_cast<int64_t>(e[0]), static_cast<int64_t>(e[1]), e[2], e[3], e[4],
                                 e[5]);
      TORCH_CHECK(r.size() == 6, "rows_into: nonfinite_row gives six numbers");
      for (int k = 0; k < 6; ++k) row[k] = r[k].cast<double>();
      continue;
    }
    left.push_back(i);
  }
  return left;
}

// A JSON line written as json.dumps(obj, separators=(",", ":")) reads back (the record writer's
// json_line): floats in their shortest round-trip digits, NaN/Infinity for non-finite floats, strings in UTF-8 with
// quotes, backslashes and control characters escaped.  A value it cannot write (a big integer, a
// string with lone surrogates, a type outside JSON) makes `put` return false.
// A float's shortest round-trip digits (no sign, no leading or trailing zeros) and kk, the
// position of the decimal point: |v| = 0.digits * 10**kk.
inline int shortest_digits(double v, char* digits, int& kk) {
  char buf[40];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::scientific);
  int n = 0;
  const char* p = buf;
  for (; p < end && *p != 'e'; ++p)
    if (*p != '.') digits[n++] = *p;
  while (n > 1 && digits[n - 1] == '0') --n;
  int exponent = 0;
  std::from_chars(p + 1 + (p[1] == '+'), end, exponent);
  kk = exponent + 1;
  return n;
}

// A JSON line as the record writer's json_line writes it: orjson's text for finite floats (the
// shortest digits, plain from 1e-5 to 1e16, else d.ddde-7), except in a line holding a
// non-finite float, which json_line leaves to json.dumps: there every float as repr writes it
// and NaN/Infinity.  Strings in UTF-8 with quotes, backslashes and control characters escaped.
// A value it cannot write (a big integer, a string with lone surrogates, a type outside JSON)
// makes `put` return false.
struct Json {
  std::string s;
  bool nonfinite = false;
  std::vector<std::pair<size_t, double>> floats;   // where each finite float starts, and its value

  void raw(const char* p) { s += p; }
  void number(long long v) { s += std::to_string(v); }
  void number(double v) {
    if (!std::isfinite(v)) {
      s += std::isnan(v) ? "NaN" : v > 0 ? "Infinity" : "-Infinity";
      nonfinite = true;
      return;
    }
    floats.emplace_back(s.size(), v);
    orjson_float(s, v);
  }
  static void orjson_float(std::string& out, double v) {
    if (std::signbit(v)) out += '-';
    if (v == 0) { out += "0.0"; return; }
    char d[24];
    int kk = 0;
    const int n = shortest_digits(v, d, kk), k = kk - n;
    if (0 <= k && kk <= 16) {
      out.append(d, n).append(k, '0') += ".0";
    } else if (0 < kk && kk <= 16) {
      out.append(d, kk) += '.';
      out.append(d + kk, n - kk);
    } else if (-5 < kk && kk <= 0) {
      out.append("0.").append(-kk, '0').append(d, n);
    } else {
      out += d[0];
      if (n > 1) out.append(".").append(d + 1, n - 1);
      out += 'e';
      out += std::to_string(kk - 1);
    }
  }
  static void repr_float(std::string& out, double v) {
    if (std::signbit(v)) out += '-';
    if (v == 0) { out += "0.0"; return; }
    char d[24];
    int kk = 0;
    const int n = shortest_digits(v, d, kk), exponent = kk - 1;
    if (-4 <= exponent && exponent < 16) {
      if (kk <= 0) out.append("0.").append(-kk, '0').append(d, n);
      else if (kk >= n) out.append(d, n).append(kk - n, '0') += ".0";
      else { out.append(d, kk) += '.'; out.append(d + kk, n - kk); }
    } else {
      out += d[0];
      if (n > 1) out.append(".").append(d + 1, n - 1);
      out += exponent < 0 ? "e-" : "e+";
      const int a = std::abs(exponent);
      if (a < 10) out += '0';
      out += std::to_string(a);
    }
  }
  // The line as json_line gives it: its floats rewritten as repr writes them where it holds a
  // non-finite one.
  void finish() {
    if (!nonfinite || floats.empty()) return;
    std::string out;
    out.reserve(s.size() + 8 * floats.size());
    size_t at = 0;
    for (const auto& [start, v] : floats) {
      out.append(s, at, start - at);
      std::string old;
      orjson_float(old, v);
      repr_float(out, v);
      at = start + old.size();
    }
    out.append(s, at, std::string::npos);
    s.swap(out);
  }
  bool text(PyObject* u) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(u, &n);
    if (p == nullptr) {
      PyErr_Clear();
      return false;
    }
    s += '"';
    for (Py_ssize_t i = 0; i < n; ++i) {
      const unsigned char ch = static_cast<unsigned char>(p[i]);
      if (ch == '"' || ch == '\\') {
        s += '\\';
        s += static_cast<char>(ch);
      } else if (ch < 0x20) {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\u%04x", ch);
        s += esc;
      } else {
        s += static_cast<char>(ch);
      }
    }
    s += '"';
    return true;
  }
  bool put(PyObject* v) {
    PyTypeObject* tp = Py_TYPE(v);
    if (v == Py_None) {
      s += "null";
    } else if (v == Py_True || v == Py_False) {
      s += v == Py_True ? "true" : "false";
    } else if (tp == &PyLong_Type) {
      int overflow = 0;
      const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
      if (overflow) return false;
      number(x);
    } else if (tp == &PyFloat_Type) {
      number(PyFloat_AS_DOUBLE(v));
    } else if (tp == &PyUnicode_Type) {
      return text(v);
    } else if (tp == &PyList_Type || tp == &PyTuple_Type) {
      s += '[';
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (i) s += ',';
        if (!put(PySequence_Fast_GET_ITEM(v, i))) return false;
      }
      s += ']';
    } else if (tp == &PyDict_Type) {
      s += '{';
      PyObject *k, *x;
      Py_ssize_t pos = 0;
      bool first = true;
      while (PyDict_Next(v, &pos, &k, &x)) {
        if (Py_TYPE(k) != &PyUnicode_Type) return false;
        if (!first) s += ',';
        first = false;
        if (!text(k)) return false;
        s += ':';
        if (!put(x)) return false;
      }
      s += '}';
    } else {
      return false;
    }
    return true;
  }
  void ints(at::IntArrayRef values) {
    s += '[';
    for (size_t d = 0; d < values.size(); ++d) {
      if (d) s += ',';
      number(static_cast<long long>(values[d]));
    }
    s += ']';
  }
};


// Recorder.encode's per-value work for the statistics task, on CPU tensors, in one call per
// argument list: each value as the record's JSON, and each plain float32/bfloat16 CPU tensor
// given its statistics the way Recorder._fill_tensors gives them, through the recorder's own
// cache dictionaries (keys from describe; a weak reference to the storage's Python object for
// its memory): a hit, a reshape of measured memory, or one pass of sums (stats4, or integer_sums
// for integers and bools, exact) whose sums are finite (the record made from them by
// statistics.finite_record, what statistics.finish gives them), a second pass, extremes, for
// float values holding inf or nan (statistics.nonfinite_record, as backend._one_pass makes it).
// Anything else (subclasses, accelerator tensors, other dtypes, finite float values whose float32
// block sums overflowed, objects other than None/bool/int/float/str/list/tuple) goes to `fallback(found, value)`, the
// Python path, which collects its tensors in `found` for Recorder._fill_tensors.
PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

struct Keys {
  PyObject *type = intern("type"), *value = intern("value"), *none = intern("none"), *boolean = intern("bool"),
           *integer = intern("int"), *floating = intern("float"), *str = intern("str"), *list = intern("list"),
           *tuple = intern("tuple"), *stats = intern("stats"), *undefined = intern("undefined"),
           *spec = intern("spec");
};

bool alive(PyObject* ref) {      // backend.memory_alive: the storage's Python object still lives
  if (!PyWeakref_Check(ref)) return false;
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(ref, &obj) <= 0) return false;
  Py_DECREF(obj);
  return true;
#else
  return PyWeakref_GetObject(ref) != Py_None;
#endif
}

class Encoder {
 public:
  Encoder(py::dict cache, py::dict dense, py::handle measured, py::handle finite, py::handle nonfinite)
      : cache_(std::move(cache)), dense_(std::move(dense)), measured_(py::reinterpret_borrow<py::object>(measured)),
        finite_(py::reinterpret_borrow<py::object>(finite)), nonfinite_(py::reinterpret_borrow<py::object>(nonfinite)) {}

  int64_t measured = 0;     // values read by sums here (the others are the Python path's)

  // `values`: a tuple or list (-> a list) or a dict (-> a dict) of an op's arguments or outputs
  py::object operator()(py::handle values, py::list found, py::handle undefined, py::handle fallback) {
    Call c{found, undefined, fallback};
    if (PyDict_Check(values.ptr())) {
      py::dict out;
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      while (PyDict_Next(values.ptr(), &pos, &k, &v)) PyDict_SetItem(out.ptr(), k, value(v, c).ptr());
      return std::move(out);
    }
    return items(values.ptr(), c);
  }

  // The whole record of an op call as one JSON line (Recorder.encode's record, as json_line writes
  // it), appended to the file `fd` in one write (True), or None where a value needs the Python
  // path (it then encodes the call again; what was measured here is in the cache).  `head`: the
  // skeleton's fields in order; `inputs`/`outputs`: whether the config records them.  Runs, the
  // Python path's `fallback` included, with autograd off (the session's _quiet).
  py::object line(int fd, py::dict head, py::handle args, py::handle kwargs, py::handle outputs, bool inputs,
                  bool with_outputs, py::handle undefined, py::handle fallback) {
    c10::AutoGradMode no_grad(false);
    py::list found;
    Call c{found, undefined, fallback};
    Json j;
    j.s.reserve(1024);
    if (!j.put(head.ptr())) return py::none();
    j.s.pop_back();                 // the head's closing brace: the values follow
    if (inputs) {
      j.raw(",\"inputs\":");
      if (!items_json(args.ptr(), c, j)) return py::none();
      j.raw(",\"kwargs\":{");
      if (kwargs.ptr() != Py_None) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        bool first = true;
        while (PyDict_Next(kwargs.ptr(), &pos, &k, &v)) {
          if (Py_TYPE(k) != &PyUnicode_Type) return py::none();
          if (!first) j.s += ',';
          first = false;
          if (!j.text(k)) return py::none();
          j.s += ':';
          if (!value_json(v, c, j)) return py::none();
        }
      }
      j.s += '}';
    }
    if (with_outputs) {
      PyObject* out = outputs.ptr();
      if (PyTuple_Check(out) || PyList_Check(out)) {
        j.raw(PyTuple_Check(out) ? ",\"output_type\":\"tuple\",\"outputs\":" : ",\"output_type\":\"list\",\"outputs\":");
        if (!items_json(out, c, j)) return py::none();
      } else {
        j.raw(",\"output_type\":\"single\",\"outputs\":[");
        if (!value_json(out, c, j)) return py::none();
        j.s += ']';
      }
    }
    j.raw("}\n");
    j.finish();
    const char* p = j.s.data();
    size_t left = j.s.size();
    while (left) {                     // os.write's loop: a write may be partial or interrupted
      const ssize_t n = ::write(fd, p, left);
      if (n < 0) {
        if (errno == EINTR && PyErr_CheckSignals() == 0) continue;
        if (!PyErr_Occurred()) PyErr_SetFromErrno(PyExc_OSError);
        throw py::error_already_set();
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    return py::bool_(true);
  }

 private:
  struct Call {
    py::list& found;
    py::handle undefined, fallback;
  };

  py::list items(PyObject* seq, const Call& c) {
    PyObject* fast = PySequence_Fast(seq, "a sequence");
    if (fast == nullptr) throw py::error_already_set();
    py::object owner = py::reinterpret_steal<py::object>(fast);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    py::list out(n);
    for (Py_ssize_t i = 0; i < n; ++i) PyList_SET_ITEM(out.ptr(), i, value(PySequence_Fast_GET_ITEM(fast, i), c).release().ptr());
    return out;
  }

  py::dict tagged(PyObject* type, PyObject* v) {
    py::dict d;
    PyDict_SetItem(d.ptr(), k_.type, type);
    if (v != nullptr) PyDict_SetItem(d.ptr(), k_.value, v);
    return d;
  }

  py::object value(PyObject* v, const Call& c) {
    PyTypeObject* tp = Py_TYPE(v);
    if (v == Py_None) return tagged(k_.none, nullptr);
    if (tp == &PyBool_Type) return tagged(k_.boolean, v);
    if (tp == &PyLong_Type) return tagged(k_.integer, v);
    if (tp == &PyFloat_Type) {
      if (std::isfinite(PyFloat_AS_DOUBLE(v))) return tagged(k_.floating, v);
      return tagged(k_.floating, py::str(v).ptr());
    }
    if (tp == &PyUnicode_Type) return tagged(k_.str, v);
    if (tp == &PyList_Type || tp == &PyTuple_Type)
      return tagged(tp == &PyList_Type ? k_.list : k_.tuple, items(v, c).ptr());
    if (reinterpret_cast<PyObject*>(tp) == measured_.ptr()) {
      PyObject* spec = PyObject_GetAttr(v, k_.spec);
      if (spec == nullptr) throw py::error_already_set();
      return py::reinterpret_steal<py::object>(spec);
    }
    Described d;
    if (describe_into(v, d)) return tensor(v, d, c);
    return c.fallback(c.found, py::handle(v));
  }

  py::object tensor(PyObject* v, Described& d, const Call& c) {
    py::dict meta = meta_of(d);
    PyObject* m = meta.ptr();
    if (unwritten(v, c)) {      // uninitialised memory: no values
      PyDict_SetItem(m, k_.undefined, Py_True);
      return std::move(meta);
    }
    py::object st = stats_of(v, d);
    if (st) {
      PyDict_SetItem(m, k_.stats, st.ptr());
      return std::move(meta);
    }
    c.found.append(py::make_tuple(py::handle(v), meta, d.ident, d.dense));
    return std::move(meta);
  }

  bool unwritten(PyObject* v, const Call& c) {
    if (c.undefined.is_none()) return false;
    py::int_ id(reinterpret_cast<uintptr_t>(v));
    return PySet_Contains(c.undefined.ptr(), id.ptr()) == 1;
  }

  // The statistics of a described tensor as Recorder._fill_tensors gives them: from the cache (its
  // identity, then a reshape or transpose of measured memory), else sums() of a float32, bfloat16,
  // integer or bool CPU tensor (and nonfinite_extremes() where float values hold inf or nan), remembered.  A
  // null object: the Python path's.
  py::object stats_of(PyObject* v, Described& d) {
    PyObject* hit = PyDict_GetItem(cache_.ptr(), d.ident.ptr());
    if (hit != nullptr && alive(PyTuple_GET_ITEM(hit, 0))) {
      PyObject* st = PyDict_GetItem(PyTuple_GET_ITEM(hit, 1), k_.stats);
      if (st != nullptr) return py::reinterpret_borrow<py::object>(st);
    }
    const at::Tensor& t = *d.t;
    if (!d.dense.is_none()) {
      PyObject* same = PyDict_GetItem(dense_.ptr(), d.dense.ptr());
      if (same != nullptr && alive(PyTuple_GET_ITEM(same, 0))) {
        PyObject* st = PyTuple_GET_ITEM(same, 1);
        py::dict entry;
        PyDict_SetItem(entry.ptr(), k_.stats, st);
        remember(t, d.ident.ptr(), nullptr, entry, st);
        return py::reinterpret_borrow<py::object>(st);
      }
    }
    const int64_t n = t.numel();
    if (!t.device().is_cpu()) return py::object();
    if (n == 0) {                     // no values: no statistics (statistics.record's None)
      py::dict entry;
      PyDict_SetItem(entry.ptr(), k_.stats, Py_None);
      remember(t, d.ident.ptr(), nullptr, entry, Py_None);
      return py::none();
    }
    const std::vector<double> r = sums(t);
    if (r.empty()) return py::object();
    // the record from the sums by the one definition in statistics: finite_record (finish uses
    // it), or for values holding inf or nan nonfinite_record, from a second pass for their counts
    // and finite max and min (as backend._one_pass makes it)
    py::object st;
    if (std::isfinite(r[2]) && std::isfinite(r[3])) {
      st = finite_(r[0], r[1], r[2], std::sqrt(r[3]), n);
    } else {
      const std::vector<double> e = nonfinite_extremes(t);
      if (e.empty()) return py::object();
      st = nonfinite_(r[2], r[3], static_cast<int64_t>(e[0]), static_cast<int64_t>(e[1]), e[2], e[3], e[4], e[5], n);
    }
    py::dict entry;
    PyDict_SetItem(entry.ptr(), k_.stats, st.ptr());
    remember(t, d.ident.ptr(), d.dense.ptr(), entry, st.ptr());
    ++measured;
    return st;
  }

  // value() and tensor() writing JSON instead of building dicts; false: the Python path's
  bool items_json(PyObject* seq, const Call& c, Json& j) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);      // a list or tuple (or a subclass)
    j.s += '[';
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i) j.s += ',';
      if (!value_json(PySequence_Fast_GET_ITEM(seq, i), c, j)) return false;
    }
    j.s += ']';
    return true;
  }

  bool value_json(PyObject* v, const Call& c, Json& j) {
    PyTypeObject* tp = Py_TYPE(v);
    if (v == Py_None) {
      j.raw("{\"type\":\"none\"}");
      return true;
    }
    if (tp == &PyBool_Type) {
      j.raw(v == Py_True ? "{\"type\":\"bool\",\"value\":true}" : "{\"type\":\"bool\",\"value\":false}");
      return true;
    }
    if (tp == &PyLong_Type || tp == &PyUnicode_Type) {
      j.raw(tp == &PyLong_Type ? "{\"type\":\"int\",\"value\":" : "{\"type\":\"str\",\"value\":");
      if (!j.put(v)) return false;
      j.s += '}';
      return true;
    }
    if (tp == &PyFloat_Type) {
      j.raw("{\"type\":\"float\",\"value\":");
      if (std::isfinite(PyFloat_AS_DOUBLE(v))) {
        j.number(PyFloat_AS_DOUBLE(v));
      } else {
        py::str name(v);
        j.text(name.ptr());
      }
      j.s += '}';
      return true;
    }
    if (tp == &PyList_Type || tp == &PyTuple_Type) {
      j.raw(tp == &PyList_Type ? "{\"type\":\"list\",\"value\":" : "{\"type\":\"tuple\",\"value\":");
      if (!items_json(v, c, j)) return false;
      j.s += '}';
      return true;
    }
    if (reinterpret_cast<PyObject*>(tp) == measured_.ptr()) {
      py::object spec = py::reinterpret_steal<py::object>(PyObject_GetAttr(v, k_.spec));
      if (!spec) throw py::error_already_set();
      return j.put(spec.ptr());
    }
    Described d;
    if (describe_into(v, d)) return tensor_json(v, d, c, j);
    // other objects (dtypes, devices, ...) as the Python path encodes them; a tensor it collects
    // for its statistics leaves the record to it
    const size_t before = static_cast<size_t>(PyList_GET_SIZE(c.found.ptr()));
    py::object encoded = c.fallback(c.found, py::handle(v));
    if (static_cast<size_t>(PyList_GET_SIZE(c.found.ptr())) != before) return false;
    return j.put(encoded.ptr());
  }

  bool tensor_json(PyObject* v, Described& d, const Call& c, Json& j) {
    j.raw("{\"type\":\"tensor\",\"dtype\":");
    j.text(d.dtype_name);
    j.raw(",\"shape\":");
    j.ints(d.t->sizes());
    j.raw(",\"stride\":");
    j.ints(d.t->strides());
    j.raw(",\"device\":");
    j.text(d.device_name);
    j.raw(d.t->requires_grad() ? ",\"requires_grad\":true" : ",\"requires_grad\":false");
    if (d.param) j.raw(",\"param\":true");
    if (unwritten(v, c)) {
      j.raw(",\"undefined\":true}");
      return true;
    }
    py::object st = stats_of(v, d);
    if (!st) return false;
    j.raw(",\"stats\":");
    if (!j.put(st.ptr())) return false;
    j.s += '}';
    return true;
  }

  // Recorder._measured / _remember: the entry under the identity (and the statistics under the
  // dense key), with a weak reference to the memory
  void remember(const at::Tensor& t, PyObject* ident, PyObject* dense, py::dict& entry, PyObject* st) {
    PyObject* storage = torch::createPyObject(t.storage());
    if (storage == nullptr) throw py::error_already_set();
    PyObject* ref = PyWeakref_NewRef(storage, nullptr);
    Py_DECREF(storage);
    if (ref == nullptr) throw py::error_already_set();
    py::object owned = py::reinterpret_steal<py::object>(ref);
    PyDict_SetItem(cache_.ptr(), ident, cache_entry(owned, entry).ptr());
    if (dense != nullptr && dense != Py_None) PyDict_SetItem(dense_.ptr(), dense, cache_entry(owned, st).ptr());
  }

  py::dict cache_, dense_;
  py::object measured_, finite_, nonfinite_;
  Keys k_;
};
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stats4", &stats4, py::call_guard<py::gil_scoped_release>());
  m.def("extremes", &extremes, py::call_guard<py::gil_scoped_release>());
  m.def("rows_into", &rows_into);
  m.def("describe", &describe);
  m.def("configure", &configure);
  m.def("cache_entry", &cache_entry);
  py::class_<Encoder>(m, "Encoder")
      .def(py::init<py::dict, py::dict, py::handle, py::handle, py::handle>())
      .def("__call__", &Encoder::operator())
      .def("line", &Encoder::line)
      .def_readonly("measured", &Encoder::measured);
}
