// The gloo backend's rendezvous (private to src/comm/gloo; see
// include/distopt/comm/gloo.hpp and docs/reliability.md, "Processes"): the
// run's rendezvous directory as a key-value store (DirStore), where the
// processes leave their addresses, heartbeats and membership decisions,
// and the connection of a group's ranks through it (connect).
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "distopt/comm/gloo.hpp"

namespace distopt::gloo_detail {

using Clock = Communicator::Clock;
using std::chrono::milliseconds;

std::string seconds(milliseconds t);
std::string rank_list(const std::vector<int>& ranks);

// A key-value store in a directory: one file per key, written under a
// temporary name and renamed, so that a reader sees a whole value or none.
class DirStore final : public gloo::rendezvous::Store {
 public:
  DirStore(std::string dir, milliseconds timeout) : dir_(std::move(dir)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override;
  // Creates the key unless it exists; true when this call created it.
  bool create_once(const std::string& key, const std::vector<char>& data);
  bool has(const std::string& key) const;
  std::vector<char> read(const std::string& key) const;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override;
  std::string path(const std::string& key) const;
  const std::string& dir() const { return dir_; }

 private:
  // Unique among the machines (host), their processes (pid) and the
  // stores of this one (a process-wide count).
  static std::string temp_name(const std::string& dir);
  std::string temp_name() const { return temp_name(dir_); }
  static void write_file(const std::string& name, const std::vector<char>& data);
  // gloo waits for "e<epoch>/<rank>": the address of that rank.
  std::string describe_missing(const std::vector<std::string>& keys, milliseconds timeout) const;
  std::string dir_;
  milliseconds timeout_;
};

std::vector<char> bytes_of(const std::string& s);

// A small value of the store, or "" where there is none (yet).
std::string read_or_empty(const DirStore& store, const std::string& key);

struct Shared;

// Connects rank `rank` of a group of `size` to the others, through the
// rendezvous (their addresses under `prefix` in sh.store) and this
// process's device (sh.device; Shared is heartbeat.hpp's), with the
// time-out `timeout`.
std::shared_ptr<gloo::rendezvous::Context> connect(Shared& sh, const std::string& prefix, int rank, int size,
                                                   milliseconds timeout);

}  // namespace distopt::gloo_detail
