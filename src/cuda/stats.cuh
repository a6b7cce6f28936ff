// The tensor_stats rules on the device (LAMB, LARS, Adafactor; docs/gpu.md),
// included by stats_ieee.cu and stats_ftz.cu, which build it with and
// without -ftz=true inside namespace DISTOPT_FP_NS.
//
// A pass is the rule's transform over every element (a multi-tensor launch
// as in pointwise.cuh: block b finds its tensor in a table of first
// chunks), then its statistics: each chunk of a tensor's statistics range
// sums the squares of one or two arrays in double, each thread over a
// fixed stride and the block's threads in a fixed tree, and the chunks'
// sums are added on the host in chunk order -- the same bits run to run
// and whatever the grid, and within double rounding of the CPU's lane sums
// (rule_impl.hpp). Adafactor's factored tensors also sum q = g^2 + eps1
// over each row (one block per row, a fixed tree) and each column (one
// thread per column and band of kBand rows, the bands added on the host in
// order). The host waits for the sums: it finishes the pass (finish_pass,
// the ranks' reduction) as on the CPU. The update is one more launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "../core/cuda_backend.hpp"
#include "../optim/cuda_step.hpp"
#include "../optim/rules/stats.hpp"
#include "check.cuh"
#include "table.cuh"

namespace distopt::cuda::DISTOPT_FP_NS {
namespace {

using rules::Place;
using rules::Source;
using rules::Typed;

constexpr int kThreads = kSumThreads;
constexpr std::size_t kChunk = kSumChunk;  // elements per block
constexpr std::size_t kBand = 256;     // rows per thread of a column sum

struct Entry {
  float* p;
  void* lp;
  const void* g;
  float* s[kMaxStateTensors];
  float* work;
  Place at;
  std::size_t n;
  std::size_t begin, end;  // the statistics' range
  unsigned coeffs;
  unsigned dtype;
  std::size_t squares_at;  // index of the first chunk's sums in the output (x2)
  std::size_t rows_at;     // of the first row sum
  std::size_t cols_at;     // of the first band's column sums
  bool row_cols;           // whether it has row and column sums
  std::size_t aux_at;      // its small state's first float in the staged copy
};

template <class T>
__device__ __forceinline__ Typed<T> typed(const Entry& e) {
  return {e.p, static_cast<T*>(e.lp), static_cast<const T*>(e.g), e.s, e.n};
}

template <class M>
__device__ __forceinline__ const typename M::Coeffs& coeffs_of(const RuleBlob* blobs, const Entry& e) {
  return *reinterpret_cast<const typename M::Coeffs*>(blobs[e.coeffs].bytes);
}

template <class T>
__device__ __forceinline__ double square_of(Source src, const Entry& e, std::size_t i) {
  double v = 0.0;
  if (src == Source::param) v = e.p[i];
  else if (src == Source::grad) v = to_float(static_cast<const T*>(e.g)[i]);
  else if (src == Source::work) v = e.work[i];
  return v * v;
}

__device__ __forceinline__ double block_sum(double v, double* shared) {
  return block_reduce(v, shared, Plus{});
}

template <class M, class T>
__global__ void __launch_bounds__(kThreads)
    transform_kernel(const RuleBlob* __restrict__ blobs, const Entry* __restrict__ entries,
                     const unsigned* __restrict__ first, unsigned count, int pass) {
  const unsigned k = entry_of_block(first, count);
  const Entry& e = entries[k];
  const auto& c = coeffs_of<M>(blobs, e);
  const Typed<T> s = typed<T>(e);
  const std::size_t begin = (blockIdx.x - first[k]) * kChunk, end = begin + kChunk < e.n ? begin + kChunk : e.n;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads)
    M::template transform<T>(c, pass, s, e.at, e.work, i);
}

// Sums of squares of each chunk of the statistics' range: out[2j], out[2j+1].
template <class M, class T>
__global__ void __launch_bounds__(kThreads)
    squares_kernel(const Entry* __restrict__ entries, const unsigned* __restrict__ first, unsigned count,
                   rules::Squares what, double* __restrict__ out) {
  __shared__ double shared[kThreads];
  const unsigned k = entry_of_block(first, count);
  const Entry& e = entries[k];
  const std::size_t chunk = blockIdx.x - first[k];
  const std::size_t begin = e.begin + chunk * kChunk, end = begin + kChunk < e.end ? begin + kChunk : e.end;
  double a = 0.0, b = 0.0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    a += square_of<T>(what.of[0], e, i);
    b += square_of<T>(what.of[1], e, i);
  }
  a = block_sum(a, shared);
  b = block_sum(b, shared);
  if (threadIdx.x == 0) {
    out[e.squares_at + 2 * chunk] = a;
    out[e.squares_at + 2 * chunk + 1] = b;
  }
}

// The row sums of row_col(c, g) over the statistics' range: one block per
// row of the tensor (rows outside the range sum to 0).
template <class M, class T>
__global__ void __launch_bounds__(kThreads)
    row_sums_kernel(const RuleBlob* __restrict__ blobs, const Entry* __restrict__ entries,
                    const unsigned* __restrict__ first, unsigned count, double* __restrict__ out) {
  __shared__ double shared[kThreads];
  const unsigned k = entry_of_block(first, count);
  const Entry& e = entries[k];
  const auto& c = coeffs_of<M>(blobs, e);
  const std::size_t r = blockIdx.x - first[k];
  const std::size_t lo = e.at.offset + e.begin, hi = e.at.offset + e.end;  // in the whole tensor
  const std::size_t row_begin = r * e.at.cols;
  double a = 0.0;
  for (std::size_t j = threadIdx.x; j < e.at.cols; j += kThreads) {
    const std::size_t el = row_begin + j;
    if (el >= lo && el < hi) a += M::row_col(c, to_float(static_cast<const T*>(e.g)[el - e.at.offset]));
  }
  a = block_sum(a, shared);
  if (threadIdx.x == 0) out[e.rows_at + r] = a;
}

// The column sums over bands of kBand rows: block (b, band, tile) of a
// tensor has a thread per column of its tile, which sums its band's rows
// in order into out[cols_at + (b*bands + band)*cols + j].
template <class M, class T>
__global__ void __launch_bounds__(kThreads)
    col_sums_kernel(const RuleBlob* __restrict__ blobs, const Entry* __restrict__ entries,
                    const unsigned* __restrict__ first, unsigned count, double* __restrict__ out) {
  const unsigned k = entry_of_block(first, count);
  const Entry& e = entries[k];
  const auto& c = coeffs_of<M>(blobs, e);
  const std::size_t bands = (e.at.rows + kBand - 1) / kBand, tiles = (e.at.cols + kThreads - 1) / kThreads;
  const std::size_t local = blockIdx.x - first[k];
  const std::size_t tile = local % tiles, band = local / tiles % bands, b = local / tiles / bands;
  const std::size_t j = tile * kThreads + threadIdx.x;
  if (j >= e.at.cols) return;
  const std::size_t lo = e.at.offset + e.begin, hi = e.at.offset + e.end;
  const std::size_t r_end = (band + 1) * kBand < e.at.rows ? (band + 1) * kBand : e.at.rows;
  double a = 0.0;
  for (std::size_t r = band * kBand; r < r_end; ++r) {
    const std::size_t el = (b * e.at.rows + r) * e.at.cols + j;
    if (el >= lo && el < hi) a += M::row_col(c, to_float(static_cast<const T*>(e.g)[el - e.at.offset]));
  }
  out[e.cols_at + (b * bands + band) * e.at.cols + j] = a;
}

template <class M, class T>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const RuleBlob* __restrict__ blobs, const Entry* __restrict__ entries,
                  const unsigned* __restrict__ first, unsigned count) {
  const unsigned k = entry_of_block(first, count);
  const Entry& e = entries[k];
  const auto& c = coeffs_of<M>(blobs, e);
  const Typed<T> s = typed<T>(e);
  const std::size_t begin = (blockIdx.x - first[k]) * kChunk, end = begin + kChunk < e.n ? begin + kChunk : e.n;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) M::template update<T>(c, s, e.work, i);
}

std::size_t bands(const Entry& e) {
  return (e.at.rows + kBand - 1) / kBand;
}

// The launches of a sequence, each over runs of entries of one element type.
enum Kind { kElements, kSquares, kRows, kCols, kKinds };

std::size_t blocks_of(Kind kind, const Entry& e, bool row_cols) {
  switch (kind) {
    case kElements:
      return sum_chunks(e.n);
    case kSquares:
      return sum_chunks(e.end - e.begin);
    case kRows:
      return row_cols ? e.at.blocks * e.at.rows : 0;
    case kCols:
      return row_cols ? e.at.blocks * bands(e) * ((e.at.cols + kThreads - 1) / kThreads) : 0;
    default:
      return 0;
  }
}

struct Run {
  std::size_t begin, end;  // entries
  DType dtype;
  std::size_t blocks[kKinds];
};

// One step's (or pass's) metadata: coefficient blocks, entries sorted by
// element type, for each kind of launch a table of each entry's first block
// within its run, and the statistics the kernels write.
struct Layout {
  std::vector<RuleBlob> blobs;
  std::vector<Entry> entries;
  std::vector<std::size_t> slice_of;  // entry -> slice
  std::vector<unsigned> first;        // kind * entries + entry
  std::vector<Run> runs;
  std::size_t stats = 0;  // doubles
  std::vector<std::span<const float>> aux;  // each entry's small state (host), staged after the metadata
  std::size_t aux_floats = 0;
};

template <class M>
Layout lay_out(std::string_view what, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
               std::span<const StatRange> ranges, std::span<const std::span<const float>> aux, int pass) {
  Layout l;
  std::vector<std::size_t> order(slices.size());
  for (std::size_t j = 0; j < order.size(); ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return slices[a].dtype < slices[b].dtype; });
  const bool row_cols = M::kRowColSums && pass == 0;
  for (std::size_t j : order) {
    const Slice& sl = slices[j];
    if (sl.n == 0) continue;
    Entry e{};
    set_arrays(e, sl);
    e.work = sl.work;
    e.at = rules::place_of(sl, nullptr);  // the staged copy of the small state: set by stage()
    l.aux.push_back(aux.empty() ? std::span<const float>{} : aux[j]);
    e.aux_at = l.aux_floats;
    l.aux_floats += l.aux.back().size();
    e.n = sl.n;
    e.begin = ranges.empty() ? 0 : std::min(ranges[j].begin, sl.n);
    e.end = ranges.empty() ? sl.n : std::min(std::max(ranges[j].end, e.begin), sl.n);
    if (l.blobs.empty() || std::memcmp(&l.blobs.back(), coeffs[j], sizeof(RuleBlob)) != 0)
      l.blobs.push_back(*coeffs[j]);
    e.coeffs = static_cast<unsigned>(l.blobs.size() - 1);
    e.dtype = static_cast<unsigned>(sl.dtype);
    if (pass >= 0) {
      e.squares_at = l.stats;
      l.stats += 2 * sum_chunks(e.end - e.begin);
      if (row_cols && e.at.factored) {
        e.row_cols = true;
        e.rows_at = l.stats;
        l.stats += e.at.blocks * e.at.rows;
        e.cols_at = l.stats;
        l.stats += e.at.blocks * bands(e) * e.at.cols;
      }
    }
    l.entries.push_back(e);
    l.slice_of.push_back(j);
  }
  const std::size_t n = l.entries.size();
  l.first.assign(kKinds * n, 0);
  for (std::size_t a = 0; a < n;) {
    Run run{a, a, static_cast<DType>(l.entries[a].dtype), {}};
    for (; run.end < n && l.entries[run.end].dtype == l.entries[a].dtype; ++run.end)
      for (int k = 0; k < kKinds; ++k) {
        l.first[k * n + run.end] = static_cast<unsigned>(run.blocks[k]);
        const Entry& e = l.entries[run.end];
        run.blocks[k] += blocks_of(static_cast<Kind>(k), e, e.row_cols);
        if (run.blocks[k] > 0x7fffffffu) throw InvalidInput(str(what, ": more than 2^31 blocks in one launch"));
      }
    a = run.end;
    l.runs.push_back(run);
  }
  return l;
}

// The layout's metadata in a staging area (copy_metadata sends it to the
// device), and where the kernels write the statistics and the host reads
// them.
struct Staged {
  const RuleBlob* blobs;
  const Entry* entries;
  const unsigned* first;
  double* stats_dev;
  const double* stats_host;
  const unsigned char* host;
  unsigned char* device;
  std::size_t meta;  // bytes of metadata
};

Staged stage(const Layout& l) {
  const std::size_t blob_bytes = l.blobs.size() * sizeof(RuleBlob), entry_bytes = l.entries.size() * sizeof(Entry);
  const std::size_t first_bytes = l.first.size() * sizeof(unsigned), aux_bytes = l.aux_floats * sizeof(float);
  // Metadata, the small state (both copied to the device), then the statistics (copied back).
  const std::size_t aux_at = blob_bytes + entry_bytes + first_bytes;
  const std::size_t meta = aux_at + aux_bytes;
  const std::size_t stats_at = (meta + alignof(double) - 1) / alignof(double) * alignof(double);
  const Staging area = staging(stats_at + l.stats * sizeof(double));
  std::memcpy(area.host, l.blobs.data(), blob_bytes);
  std::memcpy(area.host + blob_bytes, l.entries.data(), entry_bytes);
  std::memcpy(area.host + blob_bytes + entry_bytes, l.first.data(), first_bytes);
  auto* entries = reinterpret_cast<Entry*>(area.host + blob_bytes);
  for (std::size_t k = 0; k < l.entries.size(); ++k) {
    if (l.aux[k].empty()) continue;
    std::memcpy(area.host + aux_at + entries[k].aux_at * sizeof(float), l.aux[k].data(), l.aux[k].size_bytes());
    entries[k].at.aux = reinterpret_cast<const float*>(area.device + aux_at) + entries[k].aux_at;
  }
  return {reinterpret_cast<const RuleBlob*>(area.device),
          reinterpret_cast<const Entry*>(area.device + blob_bytes),
          reinterpret_cast<const unsigned*>(area.device + blob_bytes + entry_bytes),
          reinterpret_cast<double*>(area.device + stats_at),
          reinterpret_cast<const double*>(area.host + stats_at),
          area.host,
          area.device,
          meta};
}

void copy_metadata(std::string_view what, const Staged& at, cudaStream_t stream) {
  check(cudaMemcpyAsync(at.device, at.host, at.meta, cudaMemcpyHostToDevice, stream), str(what, ": metadata"));
}

// Runs launch(run, kind's first blocks on the device) for every run with
// blocks of that kind, then marks the staging area used by `stream`.
template <class Launch>
void for_runs(std::string_view what, const Layout& l, const Staged& at, Kind kind, Launch&& launch) {
  const std::size_t n = l.entries.size();
  for (const Run& run : l.runs) {
    if (run.blocks[kind] == 0) continue;
    dispatch_dtype(run.dtype, [&]<class T>() {
      launch.template operator()<T>(at.entries + run.begin, at.first + kind * n + run.begin,
                                    static_cast<unsigned>(run.end - run.begin),
                                    static_cast<unsigned>(run.blocks[kind]));
    });
    check(cudaGetLastError(), str(what, ": kernel launch"));
  }
}

// Adds the kernels' statistics to each slice's, laid out as the rule's
// partial lays them out: the pass's sums of squares, then (factored, pass 0
// of Adafactor) the row sums and the column sums.
void gather(const Layout& l, const double* stats, int count, std::span<double* const> out) {
  for (std::size_t k = 0; k < l.entries.size(); ++k) {
    const Entry& e = l.entries[k];
    double* o = out[l.slice_of[k]];
    if (o == nullptr) continue;
    for (int q = 0; q < count; ++q) {
      double sum = 0.0;
      for (std::size_t c = 0; c < sum_chunks(e.end - e.begin); ++c) sum += stats[e.squares_at + 2 * c + q];
      o[q] += sum;
    }
    if (!e.row_cols) continue;
    const std::size_t rows = e.at.blocks * e.at.rows;
    for (std::size_t r = 0; r < rows; ++r) o[count + r] += stats[e.rows_at + r];
    double* cols = o + count + rows;
    for (std::size_t b = 0; b < e.at.blocks; ++b)
      for (std::size_t j = 0; j < e.at.cols; ++j) {
        double sum = 0.0;
        for (std::size_t band = 0; band < bands(e); ++band)
          sum += stats[e.cols_at + (b * bands(e) + band) * e.at.cols + j];
        cols[b * e.at.cols + j] += sum;
      }
  }
}

template <class M>
void pass_of(std::string_view rule, int pass, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
             std::span<const StatRange> ranges, std::span<const std::span<const float>> aux,
             std::span<double* const> out, cudaStream_t stream) {
  const std::string what = str(rule, " pass ", pass);
  // Statistics nobody uses (LARS without adaptation) are not gathered: they
  // stay 0, which finish_pass ignores.
  bool used = false;
  for (const RuleBlob* c : coeffs) used = used || M::gathers(c->as<typename M::Coeffs>(), pass);
  if (!used && !M::kTransforms[pass]) return;
  const Layout l = lay_out<M>(what, coeffs, slices, ranges, aux, used ? pass : -1);
  if (l.entries.empty()) return;
  const Staged at = stage(l);
  enqueue_staged(stream, [&] {
    copy_metadata(what, at, stream);
    if (M::kTransforms[pass])
      for_runs(what, l, at, kElements,
               [&]<class T>(const Entry* e, const unsigned* first, unsigned count, unsigned blocks) {
                 transform_kernel<M, T><<<blocks, kThreads, 0, stream>>>(at.blobs, e, first, count, pass);
               });
    if (!used) return;
    const rules::Squares what_squares = M::kSquares[pass];
    for_runs(what, l, at, kSquares,
             [&]<class T>(const Entry* e, const unsigned* first, unsigned count, unsigned blocks) {
               squares_kernel<M, T><<<blocks, kThreads, 0, stream>>>(e, first, count, what_squares, at.stats_dev);
             });
    for_runs(what, l, at, kRows, [&]<class T>(const Entry* e, const unsigned* first, unsigned count, unsigned blocks) {
      row_sums_kernel<M, T><<<blocks, kThreads, 0, stream>>>(at.blobs, e, first, count, at.stats_dev);
    });
    for_runs(what, l, at, kCols, [&]<class T>(const Entry* e, const unsigned* first, unsigned count, unsigned blocks) {
      col_sums_kernel<M, T><<<blocks, kThreads, 0, stream>>>(at.blobs, e, first, count, at.stats_dev);
    });
    check(cudaMemcpyAsync(const_cast<double*>(at.stats_host), at.stats_dev, l.stats * sizeof(double),
                          cudaMemcpyDeviceToHost, stream),
          str(what, ": statistics"));
  });
  if (!used) return;
  check(cudaStreamSynchronize(stream), str(what, ": statistics"));
  gather(l, at.stats_host, M::kSquares[pass].count(), out);
}

template <class M>
void update_of(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
               cudaStream_t stream) {
  const std::string what = str(rule, " step");
  const Layout l = lay_out<M>(what, coeffs, slices, {}, {}, -1);
  if (l.entries.empty()) return;
  const Staged at = stage(l);
  enqueue_staged(stream, [&] {
    copy_metadata(what, at, stream);
    for_runs(what, l, at, kElements,
             [&]<class T>(const Entry* e, const unsigned* first, unsigned count, unsigned blocks) {
               update_kernel<M, T><<<blocks, kThreads, 0, stream>>>(at.blobs, e, first, count);
             });
  });
}

}  // namespace

bool run_pass(std::string_view rule, int pass, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
              std::span<const StatRange> ranges, std::span<const std::span<const float>> aux,
              std::span<double* const> out, std::optional<std::uintptr_t> stream) {
  const cudaStream_t s = stream ? as_stream(*stream) : cudaStream_t{0};
  return rules::with_math(rules::kTensorStats, rule,
                          [&]<class M>() { pass_of<M>(rule, pass, coeffs, slices, ranges, aux, out, s); });
}

bool run_update(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                std::optional<std::uintptr_t> stream) {
  const cudaStream_t s = stream ? as_stream(*stream) : cudaStream_t{0};
  const bool ran =
      rules::with_math(rules::kTensorStats, rule, [&]<class M>() { update_of<M>(rule, coeffs, slices, s); });
  if (ran && !stream) check(cudaStreamSynchronize(s), str(rule, " step"));
  return ran;
}

}  // namespace distopt::cuda::DISTOPT_FP_NS
