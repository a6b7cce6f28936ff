// The gloo backend's rendezvous (private to src/comm/gloo; see
// include/distopt/comm/gloo.hpp and docs/reliability.md, "Processes"): the
// run's rendezvous as a key-value store (a directory, DirStore, or rank 0's
// TCP store, TcpKeyStore), where the processes leave their addresses,
// heartbeats and membership decisions, and the connection of a group's
// ranks through it (connect).
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../seconds.hpp"
#include "distopt/comm/gloo.hpp"
#include "distopt/comm/tcp_store.hpp"

namespace distopt::gloo_detail {

using Clock = Communicator::Clock;
using std::chrono::milliseconds;

using comm_detail::seconds;
std::string rank_list(const std::vector<int>& ranks);

// The rendezvous as a key-value store, with the operations the membership
// needs beyond gloo's: a value is written whole or not at all, and a key can
// be created once among all the processes. Two kinds: a directory every
// process sees (DirStore), or the TCP store of rank 0's process
// (TcpKeyStore; include/distopt/comm/tcp_store.hpp).
class KeyStore : public gloo::rendezvous::Store {
 public:
  KeyStore(std::string name, milliseconds timeout) : name_(std::move(name)), timeout_(timeout) {}

  // Creates the key unless it exists; true when this call created it.
  virtual bool create_once(const std::string& key, const std::vector<char>& data) = 0;
  virtual bool has(const std::string& key) const = 0;
  // The value; a CommError where there is none.
  virtual std::vector<char> read(const std::string& key) const = 0;
  // Where the key is, for messages (a file, or the key at tcp://HOST:PORT).
  virtual std::string where(const std::string& key) const = 0;

  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override;
  // The rendezvous as given: a directory or tcp://HOST:PORT.
  const std::string& name() const { return name_; }

 private:
  // gloo waits for "e<epoch>/<rank>": the address of that rank.
  std::string describe_missing(const std::vector<std::string>& keys, milliseconds timeout) const;
  std::string name_;
  milliseconds timeout_;
};

// A key-value store in a directory: one file per key, written under a
// temporary name and renamed, so that a reader sees a whole value or none.
class DirStore final : public KeyStore {
 public:
  DirStore(std::string dir, milliseconds timeout) : KeyStore(dir, timeout), dir_(std::move(dir)) {}

  void set(const std::string& key, const std::vector<char>& data) override;
  bool create_once(const std::string& key, const std::vector<char>& data) override;
  bool has(const std::string& key) const override;
  std::vector<char> read(const std::string& key) const override;
  std::string where(const std::string& key) const override { return path(key); }
  std::string path(const std::string& key) const;

 private:
  // Unique among the machines (host), their processes (pid) and the
  // stores of this one (a process-wide count).
  static std::string temp_name(const std::string& dir);
  std::string temp_name() const { return temp_name(dir_); }
  static void write_file(const std::string& name, const std::vector<char>& data);
  std::string dir_;
};

// The TCP store at `at`, served by this process where `serve` (rank 0).
class TcpKeyStore final : public KeyStore {
 public:
  TcpKeyStore(const TcpEndpoint& at, milliseconds timeout, bool serve);

  void set(const std::string& key, const std::vector<char>& data) override { client_->set(key, data); }
  bool create_once(const std::string& key, const std::vector<char>& data) override {
    return client_->create_once(key, data);
  }
  bool has(const std::string& key) const override { return client_->has(key); }
  std::vector<char> read(const std::string& key) const override;
  std::string where(const std::string& key) const override { return str(key, " at ", name()); }

 private:
  std::unique_ptr<StoreServer> server_;  // (declared first: the client hangs up before it stops)
  std::unique_ptr<StoreClient> client_;
};

// The store of a rendezvous: TCP for "tcp://HOST:PORT" (served here where
// `serve`), else the directory (which must exist).
std::unique_ptr<KeyStore> open_store(const std::string& rendezvous, milliseconds timeout, bool serve);

std::vector<char> bytes_of(const std::string& s);

// A small value of the store, or "" where there is none (yet).
std::string read_or_empty(const KeyStore& store, const std::string& key);

struct Shared;

class Mesh;

// Connects rank `rank` of a group of `size` to the others (mesh.hpp),
// through the rendezvous (their addresses under `prefix` in sh.store) on
// this process's address (sh.host; Shared is heartbeat.hpp's), with the
// time-out `timeout`.
std::shared_ptr<Mesh> connect(Shared& sh, const std::string& prefix, int rank, int size, milliseconds timeout);

}  // namespace distopt::gloo_detail
