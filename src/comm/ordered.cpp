// The rank-ordered reduce-scatter, all-gather and all-to-all on point-to-point
// messages (comm/communicator.hpp, "The rank-ordered collectives"): one
// algorithm for the backends whose transport only moves bytes (MPI, gloo,
// torch.distributed's groups in the Python front end), each supplying
// exchange(). The sums are reduce_ordered's, over all n contributions in
// rank order: the threads backend's bits.
#include <cstring>
#include <vector>

#include "distopt/comm/communicator.hpp"
#include "distopt/core/copy.hpp"
#include "distopt/core/error.hpp"

namespace distopt {

void Communicator::exchange(const char* op, std::span<const Message>, std::span<const Message>) {
  throw PreconditionError(str(op, ": this backend has no point-to-point exchange"));
}

void Communicator::ordered_reduce_scatter_v(const void* send, void* recv, std::span<const std::size_t> counts,
                                            ElemType type, ReduceOp op) {
  const int n = size(), me = rank();
  const std::size_t es = size_of(type);
  const auto offsets = offsets_of(counts);
  const std::size_t mine = counts[me] * es;
  if (scratch_.size_bytes() < mine * n) scratch_ = Buffer(mine * n, 5);
  std::vector<Message> sends, recvs;
  for (int j = 1; j < n; ++j) {
    const int to = (me + j) % n, from = (me + n - j) % n;
    sends.push_back({to, const_cast<char*>(static_cast<const char*>(send)) + offsets[to] * es, counts[to] * es});
    recvs.push_back({from, scratch_.as<char>() + from * mine, mine});
  }
  exchange("reduce_scatter", sends, recvs);
  std::vector<const void*> inputs(n);
  for (int r = 0; r < n; ++r)
    inputs[r] = r == me ? static_cast<const char*>(send) + offsets[me] * es : scratch_.as<char>() + r * mine;
  reduce_ordered(inputs.data(), n, recv, counts[me], type, op);
}

void Communicator::ordered_all_gather_v(const void* send, void* recv, std::span<const std::size_t> counts,
                                        ElemType type) {
  const int n = size(), me = rank();
  const std::size_t es = size_of(type);
  const auto offsets = offsets_of(counts);
  std::vector<Message> sends, recvs;
  for (int j = 1; j < n; ++j) {
    const int to = (me + j) % n, from = (me + n - j) % n;
    sends.push_back({to, const_cast<char*>(static_cast<const char*>(send)), counts[me] * es});
    recvs.push_back({from, static_cast<char*>(recv) + offsets[from] * es, counts[from] * es});
  }
  exchange("all_gather", sends, recvs);
  // The own piece last: copying while messages are in flight would stall
  // MPI's shared-memory transport, which progresses only inside MPI calls.
  char* own = static_cast<char*>(recv) + offsets[me] * es;
  if (own != send) copy_bytes(own, send, counts[me] * es);
}

void Communicator::ordered_all_to_all(const void* send, void* recv, std::size_t bytes) {
  const int n = size(), me = rank();
  const auto* in = static_cast<const char*>(send);
  auto* out = static_cast<char*>(recv);
  std::vector<Message> sends, recvs;
  for (int j = 1; j < n; ++j) {
    const int to = (me + j) % n, from = (me + n - j) % n;
    sends.push_back({to, const_cast<char*>(in) + static_cast<std::size_t>(to) * bytes, bytes});
    recvs.push_back({from, out + static_cast<std::size_t>(from) * bytes, bytes});
  }
  exchange("all_to_all", sends, recvs);
  copy_bytes(out + static_cast<std::size_t>(me) * bytes, in + static_cast<std::size_t>(me) * bytes,
             bytes);  // last, as above
}

}  // namespace distopt
