// One step of a rule over K tensors in few launches (pointwise.cuh,
// quantized.cuh): the tensors ordered by their key (the rule's
// compile-time flags and the element type), one launch per run of equal
// keys; the distinct coefficient blocks, the entries, each entry's first
// block of the grid and any extra bytes (quantized.cuh's code books) go to
// the device in one copy.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "../optim/cuda_step.hpp"
#include "check.cuh"

namespace distopt::cuda {

// Where one launch's metadata lies on the device.
template <class E>
struct Run {
  std::size_t slice;  // a slice of the run (its flags and dtype are the run's)
  const RuleBlob* blobs;
  const E* entries;
  const unsigned* first;  // entries[k] owns blocks [first[k], first[k+1]) of the grid
  unsigned count;         // entries
  unsigned blocks;        // the grid
  const unsigned char* extra;
};

// fill(j, entry) sets slice j's entry (all but E::coeffs, the index of its
// coefficient block), blocks(j) its number of grid blocks, and
// launch(run, stream) enqueues one run's kernel. On this thread's own
// stream (caller empty) the step is complete when this returns, as on the
// CPU; on a caller's it is ordered with the caller's other work.
template <class M, class E, class Fill, class Blocks, class Launch>
void launch_planned(std::string_view rule, std::span<const RuleBlob* const> coeffs, std::span<const Slice> slices,
                    std::optional<std::uintptr_t> caller, std::span<const unsigned char> extra, Fill&& fill,
                    Blocks&& blocks, Launch&& launch) {
  const cudaStream_t stream = caller ? as_stream(*caller) : cudaStream_t{0};
  const std::size_t k = slices.size();
  std::vector<unsigned> key(k);
  for (std::size_t j = 0; j < k; ++j)
    key[j] = M::flags(coeffs[j]->as<typename M::Coeffs>()) * 4u + static_cast<unsigned>(slices[j].dtype);
  std::vector<std::size_t> order(k);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return key[a] < key[b]; });

  // Distinct coefficient blocks (neighbours usually share theirs), then entries.
  std::vector<RuleBlob> blobs;
  std::vector<unsigned> blob_of(k);
  for (std::size_t j = 0; j < k; ++j) {
    if (blobs.empty() || std::memcmp(&blobs.back(), coeffs[j], sizeof(RuleBlob)) != 0) blobs.push_back(*coeffs[j]);
    blob_of[j] = static_cast<unsigned>(blobs.size() - 1);
  }
  std::vector<E> entries;
  std::vector<unsigned> first;
  entries.reserve(k);
  first.reserve(k);
  std::vector<std::size_t> run_begin, run_blocks, run_src;
  for (std::size_t r = 0; r < k; ++r) {
    const std::size_t j = order[r];
    if (slices[j].n == 0) continue;
    if (run_src.empty() || key[j] != key[run_src.back()]) {
      run_begin.push_back(entries.size());
      run_blocks.push_back(0);
      run_src.push_back(j);
    }
    E e{};
    fill(j, e);
    e.coeffs = blob_of[j];
    first.push_back(static_cast<unsigned>(run_blocks.back()));
    run_blocks.back() += blocks(j);
    if (run_blocks.back() > 0x7fffffffu) throw InvalidInput(str(rule, " step: more than 2^31 blocks in one launch"));
    entries.push_back(e);
  }
  if (entries.empty()) return;

  // One copy: the coefficient blocks, the entries, their first blocks, the extra bytes.
  const std::size_t blob_bytes = blobs.size() * sizeof(RuleBlob);
  const std::size_t entry_bytes = entries.size() * sizeof(E);
  const std::size_t first_bytes = (first.size() * sizeof(unsigned) + 15) / 16 * 16;
  const std::size_t bytes = blob_bytes + entry_bytes + first_bytes + extra.size();
  const Staging area = staging(bytes);
  std::memcpy(area.host, blobs.data(), blob_bytes);
  std::memcpy(area.host + blob_bytes, entries.data(), entry_bytes);
  std::memcpy(area.host + blob_bytes + entry_bytes, first.data(), first.size() * sizeof(unsigned));
  if (!extra.empty()) std::memcpy(area.host + blob_bytes + entry_bytes + first_bytes, extra.data(), extra.size());
  const auto* dev_blobs = reinterpret_cast<const RuleBlob*>(area.device);
  const auto* dev_entries = reinterpret_cast<const E*>(area.device + blob_bytes);
  const auto* dev_first = reinterpret_cast<const unsigned*>(area.device + blob_bytes + entry_bytes);
  const unsigned char* dev_extra = area.device + blob_bytes + entry_bytes + first_bytes;

  enqueue_staged(stream, [&] {
    check(cudaMemcpyAsync(area.device, area.host, bytes, cudaMemcpyHostToDevice, stream), str(rule, " step: metadata"));
    for (std::size_t r = 0; r < run_begin.size(); ++r) {
      const std::size_t begin = run_begin[r];
      const std::size_t end = r + 1 < run_begin.size() ? run_begin[r + 1] : entries.size();
      const Run<E> run{run_src[r],
                       dev_blobs,
                       dev_entries + begin,
                       dev_first + begin,
                       static_cast<unsigned>(end - begin),
                       static_cast<unsigned>(run_blocks[r]),
                       dev_extra};
      launch(run, stream);
      check(cudaGetLastError(), str(rule, " step: kernel launch over ", run.count, " tensors"));
    }
  });
  if (!caller) check(cudaStreamSynchronize(stream), str(rule, " step"));
}

}  // namespace distopt::cuda
