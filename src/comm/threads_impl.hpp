// The threads backend's shared state (private to src/comm): the World that
// every group of one world shares (abort and membership) and the Group its
// ranks rendezvous in. threads.cpp has the communicator (its collectives,
// point-to-point messages, shrink and split); threads_spawn.cpp runs a
// world's ranks as threads (spawn).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "distopt/comm/threads.hpp"
#include "distopt/core/error.hpp"
#include "seconds.hpp"

// Internal to the library: hidden from libdistopt.so (src/exports.map), as in src/optim/rule_impl.hpp.
#define DISTOPT_INTERNAL __attribute__((visibility("hidden")))

namespace distopt::threads_detail {

using comm_detail::seconds;

// Abort and membership state shared by every group of one world. Lock
// order: World::m may be taken while holding a group's mutex (split makes a
// group), never a group's mutex while holding World::m.
struct DISTOPT_INTERNAL World {
  World(int n, Elastic e) : size(n), elastic(e == Elastic::on), lost(new std::atomic<bool>[n]), arrived(n, 0) {
    for (int r = 0; r < n; ++r) lost[r] = false;
  }
  const int size;
  const bool elastic;
  std::atomic<bool> aborted{false};
  // Elastic: the ranks (of the world, as first numbered) lost so far.
  std::unique_ptr<std::atomic<bool>[]> lost;
  std::mutex m;
  std::string reason;
  std::vector<std::weak_ptr<struct Group>> groups;
  // shrink(): the top-level group, the round being formed, the ranks that
  // arrived for it, and the group each round formed.
  const struct Group* root = nullptr;
  std::uint64_t round = 0;
  std::vector<char> arrived;
  // Held until every member has taken it (a group holds its world: a
  // reference kept longer would be a cycle).
  struct Formed {
    std::shared_ptr<struct Group> group;
    int taken = 0;
  };
  std::map<std::uint64_t, Formed> formed;
  std::condition_variable shrink_cv;
  void abort(const std::string& why);
  void lose(const std::vector<int>& ranks);
  void wake_all();
};

struct DISTOPT_INTERNAL Slot {
  const void* send = nullptr;
  void* recv = nullptr;
  int color = 0, key = 0;
};

struct DISTOPT_INTERNAL Group {
  Group(int n, std::shared_ptr<World> w) : size(n), world(std::move(w)), arrived_gen(n, 0), slots(n), members(n) {
    for (int r = 0; r < n; ++r) members[r] = r;
  }
  const int size;
  std::shared_ptr<World> world;
  std::mutex m;
  std::condition_variable cv;
  // Written under m; also read without it by ranks spinning in rendezvous.
  std::atomic<std::uint64_t> generation{0};
  int arrived = 0;
  std::vector<std::uint64_t> arrived_gen;  // generation + 1 once a rank arrived
  std::vector<Slot> slots;
  std::map<std::pair<std::uint64_t, int>, std::shared_ptr<Group>> children;  // (split #, color)
  std::map<std::tuple<int, int, int>, std::deque<std::vector<unsigned char>>> mail;  // (src, dst, tag)
  std::vector<int> members;  // the world rank of each rank of the group (set before use)
  bool top = false;          // the world's first group or one shrink() formed
  // Elastic: the group's ranks the world has lost ("" for none).
  std::string lost_members() const {
    std::string out;
    for (int r = 0; r < size; ++r)
      if (world->lost[members[r]]) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }
  bool broken() const { return world->elastic && !lost_members().empty(); }
};

// The World of a communicator that make_threads_world made (spawn's ranks).
DISTOPT_INTERNAL World& world_of(Communicator& comm);

}  // namespace distopt::threads_detail
