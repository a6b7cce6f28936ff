// libFuzzer target: the TCP rendezvous store's server side (include/distopt/
// comm/tcp_store.hpp) on what a connection sends after the greeting: whole
// requests taken off the stream (take_store_request, in pieces as recv
// gives them) and answered by a StoreTable; each request taken, encoded
// again, must be the bytes it came from. The input's first byte chooses:
// even, the stream; odd, the rest is a --rendezvous value (tcp_endpoint),
// whose text() must parse back to the same endpoint. Only InvalidInput may
// escape as an answer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distopt/comm/tcp_store.hpp"
#include "distopt/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 2 == 1) {
      const auto e = distopt::tcp_endpoint(rest);
      if (e) {
        const auto again = distopt::tcp_endpoint(e->text());
        if (!again || again->host != e->host || again->port != e->port) __builtin_trap();
      }
      return 0;
    }
    distopt::StoreTable table;
    std::string in;
    std::size_t fed = 0, taken = 0;
    const std::size_t piece = 1 + data[0] / 2;  // as recv might hand the bytes over
    while (fed < rest.size()) {
      const std::size_t n = std::min(piece, rest.size() - fed);
      in.append(rest.substr(fed, n));
      fed += n;
      while (auto r = distopt::take_store_request(in)) {
        const std::string wire = distopt::encode_store_request(*r);
        if (rest.substr(taken, wire.size()) != wire) __builtin_trap();
        taken += wire.size();
        const std::string a = table.answer(*r);
        if (a.empty() || a[0] > 2) __builtin_trap();
      }
    }
    if (taken + in.size() != rest.size()) __builtin_trap();
  } catch (const distopt::InvalidInput&) {
  }
  return 0;
}
