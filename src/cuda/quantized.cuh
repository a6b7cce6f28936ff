// The steps of pointwise rules whose state is kept quantized
// (optim/cuda_step.hpp's quantized_step; include/distopt/optim/quant.hpp),
// included by pointwise_ieee.cu and pointwise_ftz.cu after pointwise.cuh,
// so that they flush denormals exactly when the CPU's quantizer does.
//
// A block of threads holds one block of the storage, an element a thread
// (int8: 256, int4: 128; bf16, which has no blocks: 256 elements): each
// thread reads its codes to fp32 (code value times the block's scale, or
// bf16's bits), runs the rule's element() on registers -- the function the
// CPU loop runs -- and stores the parameter. Then per quantized state
// tensor: the block's scale is max |x| on the bits, reduced over the
// block (exact in any order); each element's code is quant_code.hpp's
// search of x / scale (IEEE division, as the CPU's) over the book's
// thresholds in shared memory; a block whose scale is 0 or not finite takes
// the zero code, as on the CPU. int4's two codes of a byte meet by a warp
// shuffle: the even element's thread writes the byte.
#include "../optim/quant_code.hpp"

namespace distopt::cuda::DISTOPT_FP_NS {
namespace {

// The rules with quantizable state (RuleInfo::quantized): only theirs are built.
inline constexpr std::tuple kQuantizable{
    rules::Pointwise<rules::SgdMath>{"sgd"},
    rules::Pointwise<rules::AdamMath>{"adam"},
    rules::Pointwise<rules::AdamMath>{"adamw"},
    rules::Pointwise<rules::LionMath>{"lion"},
};

struct QEntry {
  float* p;
  void* lp;
  const void* g;
  float* s[kMaxStateTensors];  // fp32 state (not quantized), or null
  std::uint8_t* codes[kMaxStateTensors];
  float* absmax[kMaxStateTensors];
  std::uint8_t book[kMaxStateTensors];  // 0: the signed book, 1: the unsigned
  std::size_t n;
  unsigned coeffs;
};

// Whether this build flushes denormals (pointwise_ftz.cu) or keeps them.
constexpr bool kFlush = DISTOPT_FP_FLUSH;

// kBits: 8 (int8), 4 (int4), 16 (bf16).
template <int kBits>
constexpr int kQThreads = kBits == 4 ? 128 : 256;
template <int kBits>
constexpr int kCodes = kBits == 16 ? 1 : 1 << kBits;  // bf16 has no book

// max over the block's threads of v; `shared` holds a value per warp.
template <int kThreadsPerBlock>
__device__ __forceinline__ unsigned block_max(unsigned v, unsigned* shared) {
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // the last call's readers are done with `shared`
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned m = 0;
#pragma unroll
  for (int w = 0; w < kThreadsPerBlock / 32; ++w) m = max(m, shared[w]);
  return m;
}

template <class M, class T, int kBits, bool... F>
__global__ void __launch_bounds__(kQThreads<kBits>)
    quantized_kernel(const RuleBlob* __restrict__ coeffs, const QEntry* __restrict__ entries,
                     const unsigned* __restrict__ first, unsigned count, const quant::BookTable* __restrict__ books,
                     const float* __restrict__ skip) {
  constexpr int kB = kQThreads<kBits>;
  if (skip != nullptr && *skip != 0.0f) return;  // GradScaler's found_inf: nothing changes
  __shared__ float values[2][kCodes<kBits>], thresholds[2][kCodes<kBits>];
  __shared__ unsigned warp_max[kB / 32];
  if constexpr (kBits != 16) {
    for (int j = threadIdx.x; j < kCodes<kBits>; j += kB)
      for (int b = 0; b < 2; ++b) values[b][j] = books[b].values[j], thresholds[b][j] = books[b].thresholds[j];
    __syncthreads();
  }
  const unsigned lo = entry_of_block(first, count);
  const QEntry& e = entries[lo];
  const typename M::Coeffs c = *reinterpret_cast<const typename M::Coeffs*>(coeffs[e.coeffs].bytes);
  const std::size_t blk = blockIdx.x - first[lo];
  const std::size_t i = blk * kB + threadIdx.x;
  const bool active = i < e.n;

  float p[1] = {0.0f};
  T g[1] = {}, lp[1] = {};
  float st[kMaxStateTensors][1] = {};
  if (active) {
    p[0] = e.p[i];
    g[0] = static_cast<const T*>(e.g)[i];
#pragma unroll
    for (int k = 0; k < kMaxStateTensors; ++k) {
      if (e.codes[k] != nullptr) {
        if constexpr (kBits == 16) {
          st[k][0] = bf16_bits_to_float(reinterpret_cast<const std::uint16_t*>(e.codes[k])[i]);
        } else {
          const unsigned byte = e.codes[k][kBits == 8 ? i : i / 2];
          const unsigned code = kBits == 8 ? byte : (i % 2 == 0 ? byte & 0x0Fu : byte >> 4);
          st[k][0] = values[e.book[k]][code] * e.absmax[k][blk];
        }
      } else if (e.s[k] != nullptr) {
        st[k][0] = e.s[k][i];
      }
    }
    // element() touches only the state its flags use, which are the present ones.
    float* const state[kMaxStateTensors] = {st[0], st[1], st[2], st[3]};
    const rules::Typed<T> s{p, lp, g, state, 1};
    M::template element<F...>(c, s, 0);
    e.p[i] = p[0];
    if constexpr (!std::is_same_v<T, float>) static_cast<T*>(e.lp)[i] = lp[0];
#pragma unroll
    for (int k = 0; k < kMaxStateTensors; ++k)
      if (e.codes[k] == nullptr && e.s[k] != nullptr) e.s[k][i] = st[k][0];
  }

  // The same branches for every thread of the block (one entry's tensors).
#pragma unroll
  for (int k = 0; k < kMaxStateTensors; ++k) {
    if (e.codes[k] == nullptr) continue;
    const float x = st[k][0];
    if constexpr (kBits == 16) {
      if (active) reinterpret_cast<std::uint16_t*>(e.codes[k])[i] = quant::bf16_of(x);
      continue;
    } else {
      const unsigned bits = block_max<kB>(active ? hd::bits_of(x) & 0x7FFFFFFFu : 0u, warp_max);
      // Any NaN's bits lie above the infinity's.
      const float a = bits > 0x7F800000u ? hd::float_of(0x7FC00000u) : hd::float_of(bits);
      // A scale that is 0 -- or denormal where denormals flush, as the
      // CPU's `a == 0.0f` reads it under DAZ -- or not finite: the zero code.
      const bool zero = bits < (kFlush ? 0x00800000u : 1u);
      const bool none = zero || bits >= 0x7F800000u;
      const unsigned b = e.book[k];
      const unsigned code =
          none ? books[b].zero : quant::code_of(thresholds[b], books[b].size, books[b].floor_positive, x / a);
      if (threadIdx.x == 0) e.absmax[k][blk] = none ? (zero ? 0.0f : hd::float_of(0x7FC00000u)) : a;
      if constexpr (kBits == 8) {
        if (active) e.codes[k][i] = static_cast<std::uint8_t>(code);
      } else {
        const unsigned odd = __shfl_down_sync(0xffffffffu, code, 1);  // element i + 1's
        if (active && i % 2 == 0)
          e.codes[k][i / 2] =
              static_cast<std::uint8_t>(i + 1 < e.n ? code | (odd << 4) : (e.codes[k][i / 2] & 0xF0u) | code);
      }
    }
  }
}

template <class M>
void launch_quantized(std::string_view rule, quant::StateDType storage, std::span<const RuleBlob* const> coeffs,
                      std::span<const Slice> slices, std::span<const QuantizedSlice> codes,
                      std::optional<std::uintptr_t> caller, const float* skip) {
  const bool scaled = quant::has_scales(storage);
  quant::BookTable books[2] = {};
  if (scaled) books[0] = quant::book_table(storage, true), books[1] = quant::book_table(storage, false);
  const std::span<const unsigned char> extra =
      scaled ? std::span(reinterpret_cast<const unsigned char*>(books), sizeof books)
             : std::span<const unsigned char>{};
  const int bits = storage == quant::StateDType::int8 ? 8 : storage == quant::StateDType::int4 ? 4 : 16;
  const std::size_t threads = bits == 4 ? kQThreads<4> : kQThreads<8>;
  auto fill = [&](std::size_t j, QEntry& e) {
    const Slice& sl = slices[j];
    set_arrays(e, sl);
    e.n = sl.n;
    for (int k = 0; k < kMaxStateTensors; ++k) {
      e.codes[k] = codes[j].codes[k];
      e.absmax[k] = codes[j].absmax[k];
      e.book[k] = codes[j].is_signed[k] ? 0 : 1;
      if (e.codes[k] != nullptr) e.s[k] = nullptr;
      if (e.codes[k] != nullptr && scaled != (e.absmax[k] != nullptr))
        throw PreconditionError(str(rule, " step: quantized state ", k, " without its scales"));
    }
  };
  auto blocks = [&](std::size_t j) { return (slices[j].n + threads - 1) / threads; };
  auto kernel = [&](const Run<QEntry>& r, cudaStream_t stream) {
    const auto* table = reinterpret_cast<const quant::BookTable*>(r.extra);
    const unsigned flags = M::flags(coeffs[r.slice]->as<typename M::Coeffs>());
    rules::dispatch_mask<M::kFlags>(flags, [&](auto... f) {
      dispatch_dtype(slices[r.slice].dtype, [&]<class T>() {
        if (bits == 8)
          quantized_kernel<M, T, 8, decltype(f)::value...>
              <<<r.blocks, kQThreads<8>, 0, stream>>>(r.blobs, r.entries, r.first, r.count, table, skip);
        else if (bits == 4)
          quantized_kernel<M, T, 4, decltype(f)::value...>
              <<<r.blocks, kQThreads<4>, 0, stream>>>(r.blobs, r.entries, r.first, r.count, table, skip);
        else
          quantized_kernel<M, T, 16, decltype(f)::value...>
              <<<r.blocks, kQThreads<16>, 0, stream>>>(r.blobs, r.entries, r.first, r.count, table, skip);
      });
    });
  };
  launch_planned<M, QEntry>(rule, coeffs, slices, caller, extra, fill, blocks, kernel);
}

}  // namespace

bool run_quantized(std::string_view rule, quant::StateDType storage, std::span<const RuleBlob* const> coeffs,
                   std::span<const Slice> slices, std::span<const QuantizedSlice> codes,
                   std::optional<std::uintptr_t> stream, const float* skip) {
  return rules::with_math(kQuantizable, rule,
                          [&]<class M>() { launch_quantized<M>(rule, storage, coeffs, slices, codes, stream, skip); });
}

}  // namespace distopt::cuda::DISTOPT_FP_NS
