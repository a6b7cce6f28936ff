// The gloo backend's rendezvous: the directory key-value store (DirStore)
// and the connection of a group's ranks through it; see store.hpp.
#include "store.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "distopt/core/error.hpp"
#include "heartbeat.hpp"
#include "mesh.hpp"

namespace distopt::gloo_detail {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

void DirStore::set(const std::string& key, const std::vector<char>& data) {
  const std::string tmp = temp_name();
  write_file(tmp, data);
  if (std::rename(tmp.c_str(), path(key).c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw CommError(str("rendezvous: cannot write ", path(key), ": ", std::strerror(err)));
  }
}

bool DirStore::create_once(const std::string& key, const std::vector<char>& data) {
  const std::string tmp = temp_name();
  write_file(tmp, data);
  const int rc = ::link(tmp.c_str(), path(key).c_str());
  const int err = errno;
  std::remove(tmp.c_str());
  if (rc == 0) return true;
  if (err == EEXIST) return false;
  throw CommError(str("rendezvous: cannot create ", path(key), ": ", std::strerror(err)));
}

bool DirStore::has(const std::string& key) const { return ::access(path(key).c_str(), F_OK) == 0; }

std::vector<char> DirStore::read(const std::string& key) const {
  std::ifstream in(path(key), std::ios::binary);
  if (!in) throw CommError(str("rendezvous: cannot read ", path(key)));
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

std::vector<char> KeyStore::get(const std::string& key) {
  wait({key}, timeout_);
  return read(key);
}

void KeyStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  // Keys are never removed: one found stays found, so each poll asks only
  // for the first key still missing (one question per poll, not one per
  // key: over TCP each is a round trip to rank 0's store).
  const auto start = Clock::now();
  std::size_t found = 0;
  for (;;) {
    while (found < keys.size() && has(keys[found])) ++found;
    if (found == keys.size()) return;
    if (Clock::now() - start > timeout) {
      std::vector<std::string> missing;
      for (std::size_t i = found; i < keys.size(); ++i)
        if (!has(keys[i])) missing.push_back(keys[i]);
      throw CommTimeout(describe_missing(missing, timeout));
    }
    std::this_thread::sleep_for(Clock::now() - start < milliseconds(100) ? milliseconds(1) : milliseconds(5));
  }
}

std::string DirStore::path(const std::string& key) const {
  std::string name = key;
  std::replace(name.begin(), name.end(), '/', '.');
  return dir_ + "/" + name;
}

std::string DirStore::temp_name(const std::string& dir) {
  static std::atomic<std::uint64_t> counter{0};
  static const std::string host = [] {
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    return std::string(name);
  }();
  return str(dir, "/.tmp.", host, ".", ::getpid(), ".", counter.fetch_add(1, std::memory_order_relaxed));
}

void DirStore::write_file(const std::string& name, const std::vector<char>& data) {
  std::ofstream out(name, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) throw CommError(str("rendezvous: cannot write ", name));
}

std::string KeyStore::describe_missing(const std::vector<std::string>& keys, milliseconds timeout) const {
  std::vector<int> ranks;
  for (const std::string& k : keys) {
    const auto slash = k.rfind('/');
    if (slash == std::string::npos)
      return str("rendezvous: timed out after ", seconds(timeout), " waiting for ", k, " in ", name_);
    ranks.push_back(std::atoi(k.c_str() + slash + 1));
  }
  return str("rendezvous: timed out after ", seconds(timeout), " waiting for rank(s) ", rank_list(ranks),
             " to join in ", name_, " (gloo backend)");
}

std::vector<char> bytes_of(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

std::string read_or_empty(const KeyStore& store, const std::string& key) {
  try {
    if (!store.has(key)) return {};
    const std::vector<char> b = store.read(key);
    return std::string(b.begin(), b.end());
  } catch (const CommError&) {
    return {};  // renamed over meanwhile
  }
}

TcpKeyStore::TcpKeyStore(const TcpEndpoint& at, milliseconds timeout, bool serve) : KeyStore(at.text(), timeout) {
  if (serve) server_ = std::make_unique<StoreServer>(at.port, timeout);
  client_ = std::make_unique<StoreClient>(at, timeout);
}

std::vector<char> TcpKeyStore::read(const std::string& key) const {
  std::optional<std::vector<char>> v = client_->read(key);
  if (!v) throw CommError(str("rendezvous: ", where(key), " is not there"));
  return std::move(*v);
}

std::unique_ptr<KeyStore> open_store(const std::string& rendezvous, milliseconds timeout, bool serve) {
  if (const std::optional<TcpEndpoint> at = tcp_endpoint(rendezvous))
    return std::make_unique<TcpKeyStore>(*at, timeout, serve);
  return std::make_unique<DirStore>(rendezvous, timeout);
}

std::shared_ptr<Mesh> connect(Shared& sh, const std::string& prefix, int rank, int size, milliseconds timeout) {
  return Mesh::connect(*sh.store, prefix, sh.host, rank, size, timeout);
}

}  // namespace distopt::gloo_detail

namespace distopt {

std::string published_in(const std::string& rendezvous, const std::string& key) {
  // A TCP store's process may be a moment from answering: a few seconds.
  const auto store = gloo_detail::open_store(rendezvous, std::chrono::seconds(10), false);
  return gloo_detail::read_or_empty(*store, str("published/", key));
}

}  // namespace distopt
