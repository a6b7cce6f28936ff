// libFuzzer target: the gloo backend's data path (src/comm/gloo/mesh.hpp)
// on what a peer sends. The input's first byte chooses: even, the rest is
// the byte stream of a connection (message headers and bytes, then the
// end of the connection), read by a mesh over a socket pair while it waits
// for receives posted on slots 0-3 of 0, 4 and 64 bytes; odd, the rest is a
// greeting's first 16 bytes, checked as an acceptor of rank 0..3 in a group
// of 4. Only MeshError may escape a wait; a size in a header is not
// trusted (nothing is allocated for bytes that did not come).
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../src/comm/gloo/mesh.hpp"

using distopt::gloo_detail::Mesh;
using distopt::gloo_detail::MeshError;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 1) {
    if (size < 17) return 0;
    for (int rank = 0; rank < 4; ++rank) {
      const int from = Mesh::greeting(data + 1, 3, rank, 4).rank;
      if (from != -1 && (from <= rank || from >= 4)) __builtin_trap();
    }
    return 0;
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 0;
  // The stream first, whole (inputs are far below a socket's buffer).
  const std::uint8_t* p = data + 1;
  std::size_t left = size - 1;
  while (left > 0) {
    const ssize_t k = ::send(sv[1], p, left, MSG_NOSIGNAL);
    if (k <= 0) break;
    p += k;
    left -= static_cast<std::size_t>(k);
  }
  ::close(sv[1]);
  auto mesh = Mesh::over(0, {-1, sv[0]});
  std::vector<char> a(0), b(4), c(64);
  std::vector<std::shared_ptr<Mesh::Op>> ops;
  for (std::uint64_t slot = 0; slot < 4; ++slot) {
    ops.push_back(mesh->recv(1, slot, a.data(), a.size()));
    ops.push_back(mesh->recv(1, slot, b.data(), b.size()));
    ops.push_back(mesh->recv(1, slot, c.data(), c.size()));
  }
  const auto until = Mesh::Clock::now() + std::chrono::seconds(5);
  for (auto& op : ops) {
    try {
      mesh->wait(*op, until);
    } catch (const MeshError&) {
    }
  }
  return 0;
}
