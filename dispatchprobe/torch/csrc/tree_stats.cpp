// The statistics of a tensor's values over raw memory, for dispatchprobe's CPU records: numbers
// only (no torch, no Python: pointers, sizes, strides and a dtype code in; numbers out), loaded with
// ctypes by dispatchprobe/torch/fused_stats.py.
//
// Float32 and bfloat16 values: max, min, sum and sum of squares in one pass over memory (torch needs
// three reductions), read in place without a copy: contiguous, a permutation of dense memory,
// expanded, or strided with a dimension of stride 1 (see Walk).  The sums follow
// standards/statistics.tree_sums' order (see tree_chunk), the Python path's, so both give the same
// bits.  Where the sums are not finite (inf or nan among the values), a second pass gives the
// counts and the finite max and min.  Integers and bools: one pass summing in double, exact below
// 2**53 (declined otherwise).  Tensors over 64K values are split over OpenMP threads where the
// build has OpenMP (torch's CPU runtime, libgomp, is the one loaded).
// The grad probe's pass (dp_grad_stats) adds, per block of a gradient while it is in cache, the
// L0 checksum's sums, the packed signs and the L2 interval counts.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {
// A list of sizes or strides (a pointer and a length).
struct Dims {
  const int64_t* p = nullptr;
  size_t n = 0;
  size_t size() const { return n; }
  int64_t operator[](size_t i) const { return p[i]; }
};
// chunks per thread: a tensor over 64K values is read by torch's intra-op threads (the same OpenMP
// runtime), each from the part the op that wrote it most likely left in its own core's cache; a
// smaller one on the calling thread
constexpr int64_t kChunksPerThread = 2;

// fn(c) for every chunk c in [0, chunks): split over the OpenMP threads where there are more than
// two chunks per thread's share (as torch's at::parallel_for with that grain), else on this thread.
template <typename Fn>
void parallel_chunks(int64_t chunks, Fn&& fn) {
#ifdef _OPENMP
  if (chunks > kChunksPerThread && !omp_in_parallel()) {
    const int64_t wanted = (chunks + kChunksPerThread - 1) / kChunksPerThread;
    const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), wanted));
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
      {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t per = (chunks + nt - 1) / nt, b = tid * per, e = std::min(chunks, b + per);
        for (int64_t c = b; c < e; ++c) fn(c);
      }
      return;
    }
  }
#endif
  for (int64_t c = 0; c < chunks; ++c) fn(c);
}
constexpr int kLanes = 64;          // float32 lanes: four vectors of kVector
constexpr int kVector = 16;         // float32 values per vector (one AVX-512 register, two AVX2 ones)
constexpr int kVectors = kLanes / kVector;
constexpr int64_t kBlock = 1024;
constexpr int64_t kGrain = 1 << 15;       // values per chunk

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

// A vector of W float32 lanes from float32 or bfloat16 memory (bfloat16: the high half of a
// float32); V, H and B are the float, uint16 and uint32 vector types of that width.
template <class V, class H, class B>
inline V load_lanes(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class V, class H, class B>
inline V load_lanes(const uint16_t* p) {
  H h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<V>(__builtin_convertvector(h, B) << 16);
}

template <class T>
inline Vec load(const T* p) { return load_lanes<Vec, Half, Bits>(p); }

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
void each_row(const T* p, int64_t r0, int64_t r1, const Dims& sizes, const Dims& strides, int64_t width, Fn&& fn) {
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
typename Acc::Result rows(const T* p, int64_t r0, int64_t r1, const Dims& sizes, const Dims& strides,
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

template <typename Acc, typename T>
typename Acc::Result run(const T* p, int64_t n) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<typename Acc::Result> parts(chunks);
  parallel_chunks(chunks, [&](int64_t c) {
    const int64_t begin = c * kGrain;
    parts[c] = rows<Acc>(p + begin, 0, 1, Dims{}, Dims{}, std::min(n, begin + kGrain) - begin);
  });
  return merged(parts);
}

template <typename Acc, typename T>
typename Acc::Result run_rows(const T* p, const Dims& sizes, const Dims& strides) {
  const int64_t dims = sizes.size(), width = sizes[dims - 1];
  int64_t count = 1;
  for (int64_t d = 0; d + 1 < dims; ++d) count *= sizes[d];
  const int64_t per_chunk = std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
  const int64_t chunks = (count + per_chunk - 1) / per_chunk;
  std::vector<typename Acc::Result> parts(chunks);
  parallel_chunks(chunks, [&](int64_t c) {
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


// The walk of a strided tensor of `ndim` dimensions (sizes and strides in elements, none negative)
Walk walk_of(int64_t ndim, const int64_t* sizes, const int64_t* strides) {
  Walk w;
  // (stride, size) of the dimensions read: on the stack for the usual few (no allocation per call)
  std::pair<int64_t, int64_t> few[8];
  std::vector<std::pair<int64_t, int64_t>> many(ndim > 8 ? ndim : 0);
  std::pair<int64_t, int64_t>* dims = ndim > 8 ? many.data() : few;
  int64_t used = 0;
  for (int64_t d = 0; d < ndim; ++d) {
    if (sizes[d] == 1) continue;
    if (strides[d] == 0) { w.repeat *= sizes[d]; continue; }
    dims[used++] = {strides[d], sizes[d]};
    w.count *= sizes[d];
  }
  std::sort(dims, dims + used);
  int64_t expected = 1;
  bool block = true;
  for (int64_t d = 0; d < used; ++d) {
    if (dims[d].first != expected) { block = false; break; }
    expected *= dims[d].second;
  }
  if (block) {            // contiguous, a permutation of dense memory, a single value: one run
    w.flat = true;
    return w;
  }
  if (dims[0].first != 1) {
    w.readable = false;
    return w;
  }
  // rows along the stride-1 dimension, the others outermost first (descending strides)
  for (int64_t d = used - 1; d > 0; --d) {
    w.sizes.push_back(dims[d].second);
    w.strides.push_back(dims[d].first);
  }
  w.sizes.push_back(dims[0].second);
  w.strides.push_back(1);
  return w;
}

template <typename Acc, typename T>
typename Acc::Result walk(const Walk& w, const T* p) {
  return w.flat ? run<Acc>(p, w.count) : run_rows<Acc>(p, Dims{w.sizes.data(), w.sizes.size()}, Dims{w.strides.data(), w.strides.size()});
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

// Halves the first `live` of v[0..n) pairwise (n a power of two) as if the rest were zeros, which
// are not added: a padding zero changes no sum (up to the sign of a zero, which the caller's
// final + 0.0 makes +0.0).
template <typename V>
inline void halve_live(V* v, int n, int live) {
  for (int h = n / 2; h >= 1; h /= 2) {
    for (int i = 0; i < h && i + h < live; ++i) v[i] = v[i] + v[i + h];
    live = std::min(live, h);
  }
}

// The float32 lanes one register holds (AVX-512: 16, AVX: 8, else 4): a block's columns are
// summed this wide, since a wider vector type than the registers is split into halves that
// spill.  Every lane is summed alone, so the width does not change a sum.
#if defined(__AVX512F__)
constexpr int kNarrow = 16;
#elif defined(__AVX__)
constexpr int kNarrow = 8;
#else
constexpr int kNarrow = 4;
#endif
typedef float Narrow __attribute__((vector_size(kNarrow * sizeof(float))));
typedef uint16_t NarrowHalf __attribute__((vector_size(kNarrow * sizeof(uint16_t))));
typedef uint32_t NarrowBits __attribute__((vector_size(kNarrow * sizeof(uint32_t))));

template <class T>
inline Narrow load_narrow(const T* p) { return load_lanes<Narrow, NarrowHalf, NarrowBits>(p); }

// How a column's lanes take their values: kInOrder, kNarrow values one after another; kEven and
// kOdd (bfloat16, little-endian), the even and the odd ones of 2 * kNarrow values, each lane from
// one 32-bit word holding two values: shifted up or masked, one operation, where widening kNarrow
// values in order takes two (a shuffle and a shift).  in_order puts such a pair back in order.
enum Lanes { kInOrder, kEven, kOdd };
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
constexpr bool kPairedHalves = true;
#else
constexpr bool kPairedHalves = false;
#endif

template <Lanes L, class T>
inline Narrow column_load(const T* p) {
  if constexpr (L == kInOrder) {
    return load_narrow(p);
  } else {
    NarrowBits bits;
    std::memcpy(&bits, p, sizeof bits);
    return reinterpret_cast<Narrow>(L == kEven ? bits << 16 : bits & 0xffff0000u);
  }
}

// The kEven and kOdd columns of the same 2 * kNarrow values, as the two kInOrder columns of them.
inline void in_order(Narrow& even, Narrow& odd) {
#if defined(__AVX512F__)
#define DP_FIRST 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define DP_SECOND 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#elif defined(__AVX__)
#define DP_FIRST 0, 8, 1, 9, 2, 10, 3, 11
#define DP_SECOND 4, 12, 5, 13, 6, 14, 7, 15
#else
#define DP_FIRST 0, 4, 1, 5
#define DP_SECOND 2, 6, 3, 7
#endif
#if defined(__clang__) || __GNUC__ >= 12
  const Narrow first = __builtin_shufflevector(even, odd, DP_FIRST);
  const Narrow second = __builtin_shufflevector(even, odd, DP_SECOND);
#else
  const NarrowBits first_mask{DP_FIRST}, second_mask{DP_SECOND};
  const Narrow first = __builtin_shuffle(even, odd, first_mask);
  const Narrow second = __builtin_shuffle(even, odd, second_mask);
#endif
#undef DP_FIRST
#undef DP_SECOND
  even = first;
  odd = second;
}

// What a block prefetches while it is summed (tree_block): nothing, the block kNearBlocks on into
// the first-level cache, or that and the block kFarBlocks on into the second level.  Lines
// prefetched with the columns (no loop of their own) kept cached tensors fast; the far block
// keeps tensors read from main memory as fast as one loop prefetching the next block ahead.
enum { kNone = 0, kNear = 1, kFar = 2 };
constexpr int64_t kNearBlocks = 1, kFarBlocks = 4;

// x + y computed as fma(x, one, y) where the build has fused multiply-adds (`one` holds 1.0 in
// every lane): x * 1 is exact, so the one rounding is the sum's, the same bits as x + y.  AMD's
// cores (Zen) add, compare and take max and min on two pipes and multiply on two others; a
// block's max, min and sums all on the adding pipes left the multiplying ones mostly idle.  On
// cores that do both on the same pipes it changes nothing.
inline Narrow add_as_fma(Narrow x, Narrow y, Narrow one) {
#if defined(__AVX512F__)
  return reinterpret_cast<Narrow>(_mm512_fmadd_ps(reinterpret_cast<__m512>(x), reinterpret_cast<__m512>(one),
                                                  reinterpret_cast<__m512>(y)));
#elif defined(__AVX__) && defined(__FMA__)
  return reinterpret_cast<Narrow>(_mm256_fmadd_ps(reinterpret_cast<__m256>(x), reinterpret_cast<__m256>(one),
                                                  reinterpret_cast<__m256>(y)));
#else
  (void)one;
  return x + y;
#endif
}

// A vector of 1.0 the compiler cannot see through, so that it keeps add_as_fma a multiply-add
// (it would otherwise turn fma(x, 1, y) back into an add).
inline Narrow opaque_one() {
  Narrow one = Narrow{} + 1.0f;
#if defined(__AVX512F__)
  asm("" : "+v"(one));
#elif defined(__AVX__)
  asm("" : "+x"(one));
#endif
  return one;
}

// One column of a block (kTreeRows rows of kNarrow lanes, kTreeLanes apart): its rows' sum and
// sum of squares by pairwise halving (row r + row r + 8 first), its max and min into hi and lo.
// A column at a time keeps the live vectors within the registers (the whole block's partial
// vectors at once spilled to the stack); the order of max and min does not matter.  The first
// level's additions and the squares' halving go to the multiply-add pipes (add_as_fma), the
// sums' halving stays with max and min: about as many operations on each pair of pipes.
template <int Ahead, Lanes L = kInOrder, typename T>
inline void tree_column(const T* __restrict q, const T* ahead, Narrow& sum, Narrow& squares, Narrow& hi, Narrow& lo,
                        Narrow one) {
  Narrow a[kTreeRows / 2], s[kTreeRows / 2], up[kTreeRows / 2], down[kTreeRows / 2];
  for (int r = 0; r < kTreeRows / 2; ++r) {
    if constexpr (Ahead >= kNear) {
      __builtin_prefetch(ahead + r * kTreeLanes, 0, 3);
      __builtin_prefetch(ahead + (r + kTreeRows / 2) * kTreeLanes, 0, 3);
    }
    if constexpr (Ahead >= kFar) {
      const T* far = ahead + (kFarBlocks - kNearBlocks) * kTreeBlock;
      __builtin_prefetch(far + r * kTreeLanes, 0, 2);
      __builtin_prefetch(far + (r + kTreeRows / 2) * kTreeLanes, 0, 2);
    }
    const Narrow x = column_load<L>(q + r * kTreeLanes);
    const Narrow y = column_load<L>(q + (r + kTreeRows / 2) * kTreeLanes);
    up[r] = y > x ? y : x;                          // nan compares false: never kept over a number
    down[r] = y < x ? y : x;
    a[r] = add_as_fma(x, y, one);
    s[r] = add_as_fma(x * x, y * y, one);           // each square rounded before it is added
  }
  halve(a, kTreeRows / 2);
  for (int h = kTreeRows / 4; h >= 1; h /= 2)     // halve(s), on the multiply-add pipes
    for (int r = 0; r < h; ++r) s[r] = add_as_fma(s[r], s[r + h], one);
  for (int h = kTreeRows / 4; h >= 1; h /= 2)
    for (int r = 0; r < h; ++r) {
      up[r] = up[r + h] > up[r] ? up[r + h] : up[r];
      down[r] = down[r + h] < down[r] ? down[r + h] : down[r];
    }
  hi = up[0] > hi ? up[0] : hi;
  lo = down[0] < lo ? down[0] : lo;
  sum = a[0];
  squares = s[0];
}

// One whole block of float32 values (or bfloat16 bits) at q: its folded sums and squares, and
// its max and min into hi/lo.  Meanwhile the block at `ahead` (kNearBlocks on) is prefetched
// into the first-level cache (Ahead >= kNear), and the one kFarBlocks on into the second level
// (Ahead == kFar): a cache line of each with each column that starts one, no loop of their own.
template <int Ahead, typename T>
inline void tree_block(const T* __restrict q, const T* ahead, Folded& sum, Folded& squares, Vec& hi_io, Vec& lo_io) {
  constexpr int kPieces = kTreeLanes / kNarrow, kPerVector = kVector / kNarrow;
  constexpr int kLine = 64 / (kNarrow * sizeof(T));        // columns per cache line (at least 1)
  static_assert(kLine >= 1 && kPieces % kLine == 0, "a column is at most a cache line");
  Narrow a[kPieces], s[kPieces], hi[kPerVector], lo[kPerVector];
  std::memcpy(hi, &hi_io, sizeof hi);
  std::memcpy(lo, &lo_io, sizeof lo);
  const Narrow one = opaque_one();
  if constexpr (std::is_same_v<T, uint16_t> && kPairedHalves) {   // bfloat16: columns in even/odd pairs
    for (int k = 0; k < kPieces; k += 2) {
      const T* pair = q + k * kNarrow;
      if ((k * kNarrow * sizeof(T)) % 64 == 0)
        tree_column<Ahead, kEven>(pair, ahead + k * kNarrow, a[k], s[k], hi[k % kPerVector], lo[k % kPerVector], one);
      else
        tree_column<kNone, kEven>(pair, ahead, a[k], s[k], hi[k % kPerVector], lo[k % kPerVector], one);
      tree_column<kNone, kOdd>(pair, ahead, a[k + 1], s[k + 1], hi[(k + 1) % kPerVector], lo[(k + 1) % kPerVector],
                               one);
      in_order(a[k], a[k + 1]);
      in_order(s[k], s[k + 1]);
    }
  } else {
    for (int k = 0; k < kPieces; k += kLine) {
      tree_column<Ahead>(q + k * kNarrow, ahead + k * kNarrow, a[k], s[k], hi[k % kPerVector], lo[k % kPerVector], one);
      for (int j = 1; j < kLine; ++j)
        tree_column<kNone>(q + (k + j) * kNarrow, ahead, a[k + j], s[k + j], hi[(k + j) % kPerVector],
                           lo[(k + j) % kPerVector], one);
    }
  }
  std::memcpy(&hi_io, hi, sizeof hi);
  std::memcpy(&lo_io, lo, sizeof lo);
  // lanes 64 -> 32 -> 16: lane j + lane j + 32, then j + 16
  Vec row[kVectors], sq[kVectors];
  std::memcpy(row, a, sizeof a);
  std::memcpy(sq, s, sizeof s);
  sum = __builtin_convertvector((row[0] + row[2]) + (row[1] + row[3]), Folded);
  squares = __builtin_convertvector((sq[0] + sq[2]) + (sq[1] + sq[3]), Folded);
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

// Nothing more to do with a block (tree_chunk's default).
struct NoBlock {
  template <typename T>
  void operator()(const T*, int64_t, int64_t) const {}
};

// Chunk c of the walk's values (kTreeChunk values from c * kTreeChunk, fewer at the end).  A flat
// walk's blocks ahead are prefetched while one is summed (tree_block; the hardware's prefetcher
// alone left the sums at a third of memory's speed); on_block(q, first, m) is called with each block of a flat
// walk (m values at q, the first-th of the tensor) after it is summed, while it is in cache.
template <typename T, typename OnBlock = NoBlock>
TreeChunk tree_chunk(const T* p, const Walk& w, int64_t c, OnBlock&& on_block = OnBlock{}) {
  const int64_t begin = c * kTreeChunk, n = std::min(w.count - begin, kTreeChunk);
  Folded sums[kChunkBlocks], squares[kChunkBlocks];       // the first `blocks` are written
  const int blocks = static_cast<int>((n + kTreeBlock - 1) / kTreeBlock);
  Vec hi = fill(-INFINITY), lo = fill(INFINITY);
  TreeChunk out;
  alignas(64) float staged[kTreeBlock];
  Cursor<T> cursor(p, w, begin);
  for (int64_t b = 0; b * kTreeBlock < n; ++b) {
    const int64_t m = std::min(n - b * kTreeBlock, kTreeBlock);
    if (m == kTreeBlock && w.flat) {
      const T* q = p + begin + b * kTreeBlock;
      const int64_t after = w.count - (begin + (b + 1) * kTreeBlock);   // values after this block
      if (after >= kFarBlocks * kTreeBlock)                              // also past this chunk
        tree_block<kFar>(q, q + kNearBlocks * kTreeBlock, sums[b], squares[b], hi, lo);
      else if (after >= kNearBlocks * kTreeBlock)
        tree_block<kNear>(q, q + kNearBlocks * kTreeBlock, sums[b], squares[b], hi, lo);
      else
        tree_block<kNone>(q, q, sums[b], squares[b], hi, lo);
      on_block(q, begin + b * kTreeBlock, m);
      continue;
    }
    std::memset(staged + m, 0, sizeof(float) * (kTreeBlock - m));   // padding zeros: they change no sum
    if (w.flat) {
      const T* src = p + begin + b * kTreeBlock;
      for (int64_t i = 0; i < m; ++i) staged[i] = value(src, i);
      on_block(src, begin + b * kTreeBlock, m);
    } else {
      cursor.copy(staged, m);
    }
    if (m == kTreeBlock) {
      tree_block<kNone>(static_cast<const float*>(staged), static_cast<const float*>(staged), sums[b], squares[b], hi, lo);
      continue;
    }
    Vec unused_hi = hi, unused_lo = lo;             // max and min of the m values only
    tree_block<kNone>(static_cast<const float*>(staged), static_cast<const float*>(staged), sums[b], squares[b],
                      unused_hi, unused_lo);
    for (int64_t i = 0; i < m; ++i) {
      const float v = staged[i];
      out.hi = v > out.hi ? v : out.hi;
      out.lo = v < out.lo ? v : out.lo;
    }
  }
  halve_live(sums, kChunkBlocks, blocks);
  halve_live(squares, kChunkBlocks, blocks);
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

// [max, min, sum, sum of squares] of the walk's values.  A tensor of one chunk (most) is summed
// without an allocation; chunk sums beyond it are added by halving, padded with zeros.
template <typename T>
std::array<double, 4> stats_of(const Walk& w, const T* p) {
  const int64_t chunks = (w.count + kTreeChunk - 1) / kTreeChunk;
  if (chunks == 1) {
    const TreeChunk c = tree_chunk(p, w, 0);
    return {c.hi, c.lo, (c.sum + 0.0) * w.repeat, (c.squares + 0.0) * w.repeat};
  }
  std::vector<TreeChunk> parts(chunks);
  parallel_chunks(chunks, [&](int64_t c) { parts[c] = tree_chunk(p, w, c); });
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


// [max, min, sum, sum of squares] of integers (or bools) at strided positions, in double; false
// where a sum could round: below 2**53 for the sum of squares, every square and every partial sum
// is an exact integer (and |sum| <= sum of squares), so the result is exact whatever the order of
// the elements: the one torch's or numpy's float64 reductions give these values (statistics.source)
template <typename T>
bool exact_sums(const T* p, int64_t dims, const int64_t* sizes, const int64_t* strides, double* out) {
  double hi = -std::numeric_limits<double>::infinity(), lo = std::numeric_limits<double>::infinity();
  double total = 0, squares = 0;
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
  if (!(squares < 9007199254740992.0)) return false;
  out[0] = hi, out[1] = lo, out[2] = total, out[3] = squares;
  return true;
}

// The dtype codes of the C interface (fused_stats.DTYPE_CODES).
enum Code : int64_t { kFloat32 = 0, kBFloat16 = 1, kInt64 = 2, kInt32 = 3, kInt16 = 4, kInt8 = 5, kUInt8 = 6, kBool = 7 };

// A row of the C interface (fused_stats.ROW), kRow doubles: what the caller makes a record of.
enum Kind { kDeclined = 0, kFinite = 1, kNonfinite = 2, kOverflowed = 3 };
constexpr int kRow = 11;   // kind, max, min, sum, squares, nan, inf, max and min without nan, finite max, finite min

template <typename T>
void float_row(const T* p, const Walk& w, double* row) {
  const std::array<double, 4> s = stats_of(w, p);
  for (int k = 0; k < 4; ++k) row[1 + k] = s[k];
  if (std::isfinite(s[2]) && std::isfinite(s[3])) {
    row[0] = kFinite;
    return;
  }
  const std::vector<double> e = extremes_of(w, p);
  for (int k = 0; k < 6; ++k) row[5 + k] = e[k];
  row[0] = e[0] != 0 || e[1] != 0 ? kNonfinite : kOverflowed;
}

void one_row(const void* data, int64_t code, int64_t ndim, const int64_t* sizes, const int64_t* strides, double* row) {
  std::fill(row, row + kRow, 0.0);
  for (int64_t d = 0; d < ndim; ++d)
    if (sizes[d] == 0 || strides[d] < 0) return;            // no values, or a layout torch does not make
  if (data == nullptr) return;
  if (code == kFloat32 || code == kBFloat16) {
    const Walk w = walk_of(ndim, sizes, strides);
    if (!w.readable) return;
    if (code == kFloat32) float_row(static_cast<const float*>(data), w, row);
    else float_row(static_cast<const uint16_t*>(data), w, row);
    return;
  }
  bool exact = false;
  switch (code) {
    case kInt64: exact = exact_sums(static_cast<const int64_t*>(data), ndim, sizes, strides, row + 1); break;
    case kInt32: exact = exact_sums(static_cast<const int32_t*>(data), ndim, sizes, strides, row + 1); break;
    case kInt16: exact = exact_sums(static_cast<const int16_t*>(data), ndim, sizes, strides, row + 1); break;
    case kInt8: exact = exact_sums(static_cast<const int8_t*>(data), ndim, sizes, strides, row + 1); break;
    case kUInt8: case kBool: exact = exact_sums(static_cast<const uint8_t*>(data), ndim, sizes, strides, row + 1); break;
    default: break;
  }
  row[0] = exact ? kFinite : kDeclined;
}

// ---- the grad probe's one read of a gradient ---------------------------------------------------
// Beside the statistics of a chunk (tree_chunk: max, min, sum of squares in tree_sums' order), what
// the grad probe records of it, read while the chunk is still in cache: the checksum sums of its
// bytes as little-endian 64-bit words (S0 = sum w_j, S1 = sum (j + 1) w_j, modulo 2**64:
// core/grad_probe.checksum_of), its signs (x > 0) packed 8 to a byte with the first value in the
// highest bit (np.packbits), and the counts of values <= each bound and == 0 (compared in float32,
// as numpy and torch compare a float32 array with a Python float).
typedef uint64_t Words __attribute__((vector_size(8 * sizeof(uint64_t))));
typedef int32_t Counts __attribute__((vector_size(kVector * sizeof(int32_t))));
constexpr int64_t kMaxBounds = 64;      // bounds counted in one pass (the caller measures more its own way)

struct GradChunk {
  TreeChunk stats;
  uint64_t s0 = 0, s1 = 0;          // the chunk's words: S0, and S1 with the tensor's weights
  int64_t zero = 0;
  int64_t below[kMaxBounds] = {};
};

// S0 and S1 of m words at q (any alignment), weighted from 1: each of 8 lanes takes every 8th
// word; per lane A (the running sum) and B (the sum of A after each step) give
// sum_g (g + 1) w = (G + 1) A - B over its G words without a multiply in the loop.
inline void word_sums(const unsigned char* q, int64_t m, uint64_t& s0, uint64_t& s1) {
  const int64_t groups = m / 8;
  Words a{}, b{};
  for (int64_t g = 0; g < groups; ++g) {
    Words v;
    std::memcpy(&v, q + 64 * g, sizeof v);
    a += v;
    b += a;
  }
  uint64_t t0 = 0, t1 = 0;
  const uint64_t big = static_cast<uint64_t>(groups);
  for (int l = 0; l < 8; ++l) {        // word 8g + l weighs 8 g + l + 1
    t0 += a[l];
    t1 += 8 * (big * a[l] - b[l]) + static_cast<uint64_t>(l + 1) * a[l];
  }
  for (int64_t j = groups * 8; j < m; ++j) {
    uint64_t v;
    std::memcpy(&v, q + 8 * j, sizeof v);
    t0 += v;
    t1 += static_cast<uint64_t>(j + 1) * v;
  }
  s0 = t0;
  s1 = t1;
}

// bit-reversed bytes: a comparison mask's first value (lowest bit) becomes packbits' highest bit
struct Reversed {
  unsigned char table[256];
  Reversed() {
    for (int i = 0; i < 256; ++i) {
      int r = 0;
      for (int k = 0; k < 8; ++k) r |= ((i >> k) & 1) << (7 - k);
      table[i] = static_cast<unsigned char>(r);
    }
  }
};
const Reversed kReversed;

// Bit k (lowest first) set where v[k] > 0, for the kVector values of v (false for nan).
inline uint32_t positive_mask(const Vec v) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
#elif defined(__AVX__)
  __m256 x[2];
  std::memcpy(x, &v, sizeof x);
  const __m256 z = _mm256_setzero_ps();
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x[0], z, _CMP_GT_OQ))) |
         static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x[1], z, _CMP_GT_OQ))) << 8;
#else
  const Counts m = v > 0;                        // -1 where true
  uint32_t out = 0;
  for (int k = 0; k < kVector; ++k) out |= static_cast<uint32_t>(m[k] & 1) << k;
  return out;
#endif
}

// How many of the vectors of values at q (n a multiple of kVector) are <= bound (== 0 with Equal).
template <bool Equal, typename T>
inline int64_t count_vectors(const T* q, int64_t n, float bound) {
  const Vec b = fill(bound);
  Counts acc{};
  for (int64_t i = 0; i < n; i += kVector) {
    const Vec v = load(q + i);
    acc -= Equal ? (v == b) : (v <= b);          // a true comparison is -1
  }
  int64_t out = 0;
  for (int k = 0; k < kVector; ++k) out += acc[k];
  return out;
}

// What the grad probe records of a block of m values at q (the first-th of the tensor), beside
// its statistics, while the block is in cache.
template <typename T>
struct GradBlock {
  GradChunk& out;
  const float* bounds;
  int64_t nb;
  bool checksum;
  unsigned char* signs;

  void operator()(const T* q, int64_t first, int64_t m) const {
    if (checksum) {                                   // whole words: first * sizeof(T) is a multiple of 8
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(q);
      const int64_t nbytes = m * static_cast<int64_t>(sizeof(T)), whole = nbytes / 8;
      const uint64_t before = static_cast<uint64_t>(first * static_cast<int64_t>(sizeof(T)) / 8);
      uint64_t s0 = 0, s1 = 0;
      word_sums(bytes, whole, s0, s1);
      if (whole * 8 < nbytes) {                       // the tensor's last word, zero-padded
        uint64_t v = 0;
        std::memcpy(&v, bytes + whole * 8, nbytes - whole * 8);
        s0 += v;
        s1 += static_cast<uint64_t>(whole + 1) * v;
      }
      out.s0 += s0;
      out.s1 += s1 + before * s0;
    }
    const int64_t vectors = m / kVector * kVector;
    if (signs != nullptr) {                           // first is a multiple of 8
      unsigned char* s = signs + first / 8;
      for (int64_t i = 0; i < vectors; i += kVector) {
        const uint32_t mask = positive_mask(load(q + i));
        for (int k = 0; k < kVector / 8; ++k) s[i / 8 + k] = kReversed.table[(mask >> (8 * k)) & 0xff];
      }
      for (int64_t byte = vectors / 8; byte < (m + 7) / 8; ++byte) s[byte] = 0;
      for (int64_t i = vectors; i < m; ++i)
        if (value(q, i) > 0) s[i / 8] |= static_cast<unsigned char>(0x80 >> (i % 8));
    }
    if (nb == 0) return;
    for (int64_t b = 0; b < nb; ++b) {
      out.below[b] += count_vectors<false>(q, vectors, bounds[b]);
      for (int64_t i = vectors; i < m; ++i) out.below[b] += value(q, i) <= bounds[b];
    }
    out.zero += count_vectors<true>(q, vectors, 0.0f);
    for (int64_t i = vectors; i < m; ++i) out.zero += value(q, i) == 0;
  }
};

template <typename T>
GradChunk grad_chunk(const T* p, const Walk& w, int64_t c, const float* bounds, int64_t nb, bool checksum,
                     unsigned char* signs) {
  GradChunk out;
  out.stats = tree_chunk(p, w, c, GradBlock<T>{out, bounds, nb, checksum, signs});
  return out;
}

// The grad probe's row of one contiguous float32 or bfloat16 tensor of n values: kind (kFinite,
// or kOverflowed where the sum of squares is inf or nan: the caller measures those values its own
// way), max, min, sum of squares, count == 0, then count <= bounds[b] for each bound; the
// checksum's S0 and S1 into sums; the packed signs into signs (if given, (n + 7) / 8 bytes).
template <typename T>
void grad_row(const T* p, int64_t n, const float* bounds, int64_t nb, bool checksum, unsigned char* signs,
              double* row, uint64_t* sums) {
  Walk w;
  w.count = n;
  w.flat = true;
  const int64_t chunks = (n + kTreeChunk - 1) / kTreeChunk;
  std::vector<GradChunk> parts(chunks);
  parallel_chunks(chunks, [&](int64_t c) { parts[c] = grad_chunk(p, w, c, bounds, nb, checksum, signs); });
  int64_t width = 1;
  while (width < chunks) width *= 2;
  std::vector<double> squares(width, 0.0);
  float hi = -INFINITY, lo = INFINITY;
  uint64_t s0 = 0, s1 = 0;
  double zero = 0;
  std::vector<double> below(nb, 0.0);
  for (int64_t c = 0; c < chunks; ++c) {
    const GradChunk& g = parts[c];
    squares[c] = g.stats.squares;
    hi = std::max(hi, g.stats.hi);
    lo = std::min(lo, g.stats.lo);
    s0 += g.s0;
    s1 += g.s1;
    zero += static_cast<double>(g.zero);
    for (int64_t b = 0; b < nb; ++b) below[b] += static_cast<double>(g.below[b]);
  }
  for (int64_t h = width / 2; h >= 1; h /= 2)
    for (int64_t i = 0; i < h; ++i) squares[i] += squares[i + h];
  const double sq = squares[0] + 0.0;
  row[0] = std::isfinite(sq) ? kFinite : kOverflowed;
  row[1] = hi;
  row[2] = lo;
  row[3] = sq;
  row[4] = zero;
  for (int64_t b = 0; b < nb; ++b) row[5 + b] = below[b];
  sums[0] = s0;
  sums[1] = s1;
}
}  // namespace

extern "C" {
// The interface's version: fused_stats checks it matches the one it speaks.
int64_t dp_tree_stats_abi(void) { return 1; }

// The rows (kRow doubles each, into `out`) of `count` tensors described one after another in
// `desc`: data address, dtype code, ndim, then ndim sizes and ndim strides (in elements).
void dp_tree_stats(int64_t count, const int64_t* desc, double* out) {
  for (int64_t i = 0; i < count; ++i) {
    const void* data = reinterpret_cast<const void*>(static_cast<uintptr_t>(desc[0]));
    const int64_t code = desc[1], ndim = desc[2];
    one_row(data, code, ndim, desc + 3, desc + 3 + ndim, out + i * kRow);
    desc += 3 + 2 * ndim;
  }
}

// The grad probe's rows (dp_grad_row_size(nb) doubles each, into `rows`) and checksum sums (two
// uint64 each, into `sums`) of `count` contiguous float32 or bfloat16 tensors, described one after
// another in `desc`: data address, dtype code, number of values, address for the packed signs (0:
// none).  `bounds`: nb float32 bounds counted (nb 0: none); `checksum` 0: no sums.
void dp_grad_stats(int64_t count, const int64_t* desc, int64_t nb, const float* bounds, int64_t checksum,
                   double* rows, uint64_t* sums) {
  for (int64_t i = 0; i < count; ++i, desc += 4) {
    const void* data = reinterpret_cast<const void*>(static_cast<uintptr_t>(desc[0]));
    unsigned char* signs = reinterpret_cast<unsigned char*>(static_cast<uintptr_t>(desc[3]));
    double* row = rows + i * (5 + nb);
    std::fill(row, row + 5 + nb, 0.0);
    sums[2 * i] = sums[2 * i + 1] = 0;
    if (data == nullptr || desc[2] <= 0 || nb > kMaxBounds || (desc[1] != kFloat32 && desc[1] != kBFloat16)) continue;
    if (desc[1] == kFloat32)
      grad_row(static_cast<const float*>(data), desc[2], bounds, nb, checksum != 0, signs, row, sums + 2 * i);
    else
      grad_row(static_cast<const uint16_t*>(data), desc[2], bounds, nb, checksum != 0, signs, row, sums + 2 * i);
  }
}
}
