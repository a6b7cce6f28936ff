// The gloo backend's membership: see include/distopt/comm/gloo.hpp and
// docs/reliability.md ("Processes"). The world a process opens (World,
// open_gloo_world: the first group, or joining a run), and GlooComm's
// members that re-form the group (do_shrink, do_grow, reform,
// pending_joins). The rendezvous is store.hpp's, the heartbeat
// heartbeat.hpp's, the messages transport.hpp's.
//
// Membership: every process beats (a counter in its heartbeat file, 10 times
// a second). To re-form after a loss or to admit waiting processes, each
// member announces itself for the next epoch and waits until every member
// of the current one has announced itself or fallen silent (its heartbeat
// unchanged for kSilent), at most the time-out. The new member list is
// created exclusively, so that there is one decision, which every member
// reads: the first member's, admitting new ranks, where every member came;
// otherwise that of the first to finish waiting, without the silent ones
// and admitting none (GlooComm::reform). A member that re-forms because it
// lost a peer marks the group as left ("leaving/<epoch>"), which aborts
// the other members' waits on it (Shared::watch_for_leavers, with each
// heartbeat).
#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "transport.hpp"

namespace distopt::gloo_detail {

namespace {

std::vector<char> encode(const std::vector<int>& ranks) { return bytes_of(rank_list(ranks)); }
std::vector<int> decode(const std::vector<char>& text) {
  std::vector<int> out;
  std::stringstream in(std::string(text.begin(), text.end()));
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(std::atoi(item.c_str()));
  return out;
}

// A re-forming's decision ("members/<epoch>", created once): the join
// counters after it, then the members. Its new members (first numbered
// from the counters before it) are the processes it admitted.
struct Decision {
  std::vector<int> members;
  int next_join = 0, next_id = 0;
};
std::vector<char> encode(const Decision& d) {
  std::vector<int> all = {d.next_join, d.next_id};
  all.insert(all.end(), d.members.begin(), d.members.end());
  return encode(all);
}
Decision read_decision(const KeyStore& store, int epoch) {
  const std::string key = str("members/", epoch);
  std::vector<int> all = decode(store.read(key));
  if (all.size() < 3 || all[0] < 0 || all[1] < 0)
    throw CommError(str("rendezvous: ", store.where(key), " is malformed"));
  return {std::vector<int>(all.begin() + 2, all.end()), all[0], all[1]};
}

}  // namespace

std::unique_ptr<Communicator> GlooComm::do_shrink() { return reform(0); }

std::unique_ptr<Communicator> GlooComm::do_grow(int joins) {
  if (joins < 1) throw CommError(str("grow: ", joins, " new ranks"));
  return reform(joins);
}

// Survivors and admissions decide together: a rank lost in the step where
// processes wait to join makes some ranks shrink and others grow, and both
// come here. Each member announces itself for the next epoch and waits
// until every member has announced itself or fallen silent (its heartbeat
// unchanged for kSilent), at most the time-out. Where every member came,
// the first one decides, admitting up to `joins` waiting processes (its
// own count: 0 where it shrinks); where some did not, the first to finish
// waiting decides the group of those that came, and admits none.
std::unique_ptr<Communicator> GlooComm::reform(int joins) {
  if (!top_) throw CommError("only a world's top communicator re-forms (without its lost ranks, or with new ones)");
  if (shared_->elastic != Elastic::on)
    throw CommError("this gloo world was opened without Elastic::on: it does not re-form");
  // After a loss, the peers still waiting on this rank learn of it at once.
  // Not where this rank grows: gloo closes hard (a reset), which would drop
  // the step's last messages still in this side's socket buffer, and no
  // peer waits on a rank that passed the step (the ranks that shrink
  // meanwhile failed on the lost one).
  // So do this process's other waits on the group (a progress thread's, a
  // split communicator's).
  if (joins == 0) {
    mesh_->close();
    shared_->abort_upto(epoch_, "this process re-forms the group (it lost a peer)");
  }
  Shared& sh = *shared_;
  std::lock_guard lock(sh.m);
  const int next = sh.epoch + 1;
  const std::vector<int> before = sh.members;
  const std::string decision = str("members/", next);
  // Re-forming after a loss: the other members' waits on the group are
  // aborted (Shared::watch_for_leavers).
  if (joins == 0) sh.store->create_once(str("leaving/", next), bytes_of(std::to_string(sh.first)));
  sh.store->set(str("alive/", next, "/", sh.first), bytes_of("1"));
  const auto start = Clock::now();
  struct Seen {
    std::string beat;
    Clock::time_point since;
  };
  std::map<int, Seen> beats;
  // Whether member m's heartbeat has changed within kSilent.
  const auto beating = [&](int m) {
    std::string beat;
    try {
      const auto b = sh.store->read(str("hb/", m));
      beat.assign(b.begin(), b.end());
    } catch (const CommError&) {
    }
    auto [it, fresh] = beats.try_emplace(m, Seen{beat, Clock::now()});
    if (!fresh && it->second.beat != beat) it->second = Seen{beat, Clock::now()};
    return Clock::now() - it->second.since < kSilent;
  };
  while (!sh.store->has(decision)) {
    std::vector<int> present;
    bool pending = false;
    for (int m : before) {
      if (sh.store->has(str("alive/", next, "/", m))) {
        present.push_back(m);
        continue;
      }
      if (beating(m)) pending = true;
    }
    const bool late = Clock::now() - start > timeout();
    Decision d{present, sh.next_join, sh.next_id};
    if (present.size() == before.size() && sh.first == before.front()) {
      // The answers first, then the decision: a request withdrawn
      // meanwhile keeps its "withdrawn"; one answered for a decision that
      // another member made first asks again (join()).
      for (int taken = 0; taken < joins && sh.store->has(str("join/", d.next_join)); ++d.next_join) {
        if (!sh.store->create_once(str("joined/", d.next_join), bytes_of(str(next, " ", d.next_id)))) continue;
        d.members.push_back(d.next_id++);
        ++taken;
      }
      sh.store->create_once(decision, encode(d));
      break;
    }
    // Every member came: the first decides; another only once it is late,
    // or once the first fell silent after it came (then without it).
    if (present.size() == before.size() && sh.first != before.front() && !beating(before.front())) {
      d.members.erase(d.members.begin());
      sh.store->create_once(decision, encode(d));
      break;
    }
    // Some did not come: the first to see the others all come or fall
    // silent decides.
    if ((present.size() < before.size() && !pending) || late) {
      sh.store->create_once(decision, encode(d));
      break;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  const Decision d = read_decision(*sh.store, next);
  const std::vector<int>& after = d.members;
  const auto at = std::find(after.begin(), after.end(), sh.first);
  if (at == after.end())
    throw CommError(str("rank ", rank(), " (first rank ", sh.first,
                        ") was left out when the others re-formed the group ",
                        "without their lost ranks (it answered after the time-out or after they had decided)"));
  const auto stayed = static_cast<std::size_t>(std::count_if(
      after.begin(), after.end(), [&](int m) { return std::find(before.begin(), before.end(), m) != before.end(); }));
  if (2 * stayed <= before.size())
    throw CommError(
        str("only ", stayed, " of the ", before.size(), " ranks (first ranks ", rank_list(after),
            ") are left after a loss: a group goes on only with more than half of its ranks (no split brain)"));
  sh.epoch = next;
  sh.next_join = d.next_join;
  sh.next_id = d.next_id;
  sh.splits = 0;
  // The members change at once where no process was admitted, and once the
  // grown group is connected where some were: a rank lost meanwhile makes
  // the others re-form from the group they had (the new ones, who cannot
  // connect either, end).
  const bool grown = stayed < after.size();
  if (!grown) sh.members = after;
  try {
    auto ctx = connect(sh, str("e", next), static_cast<int>(at - after.begin()), static_cast<int>(after.size()),
                       timeout());
    sh.members = after;
    return std::make_unique<GlooComm>(shared_, std::move(ctx), true, next);
  } catch (const std::exception& e) {
    throw RankLost(str(grown ? "admitting new ranks" : "re-forming the group", " (first ranks ", rank_list(after),
                       "): ", e.what()));
  }
}

int GlooComm::pending_joins() {
  if (!top_ || shared_->elastic != Elastic::on) return 0;
  Shared& sh = *shared_;
  std::lock_guard lock(sh.m);
  int n = 0;
  for (int k = sh.next_join; sh.store->has(str("join/", k)); ++k)
    if (!sh.store->has(str("joined/", k))) ++n;  // not withdrawn
  if (n > 0 && Clock::now() - sh.joins_seen_at > kBeat) {
    try {
      sh.store->set("joins-seen", bytes_of(std::to_string(++sh.joins_seen)));
    } catch (const CommError&) {
      // (a full disk: the joining process will withdraw at its time-out)
    }
    sh.joins_seen_at = Clock::now();
  }
  return n;
}

namespace {

class World final : public GlooWorld {
 public:
  explicit World(const GlooOptions& o) {
    if (o.size < 1) throw InvalidInput(str("gloo backend: the world size must be at least 1 (got ", o.size, ")"));
    if (o.rank < 0 || o.rank >= o.size)
      throw InvalidInput(str("gloo backend: rank ", o.rank, " is not a rank of a world of ", o.size));
    if (o.rendezvous.empty())
      throw InvalidInput("gloo backend: a rendezvous is needed (--rendezvous DIR, or tcp://HOST:PORT)");
    const bool tcp = tcp_endpoint(o.rendezvous).has_value();
    if (!tcp) {
      std::error_code ec;
      std::filesystem::create_directories(o.rendezvous, ec);
      if (!std::filesystem::is_directory(o.rendezvous))
        throw InvalidInput(str("--rendezvous ", o.rendezvous, ": not a directory, and cannot be created",
                               ec ? str(" (", ec.message(), ")") : std::string()));
    }
    // Rank 0 serves a TCP rendezvous; the others (and processes that join) connect to it.
    shared_ = std::make_shared<Shared>(o.rendezvous, o.timeout, o.elastic, o.rank, tcp && !o.join && o.rank == 0);
    Shared& sh = *shared_;
    if (sh.store->has("closed"))
      throw InvalidInput(str("--rendezvous ", o.rendezvous,
                             tcp ? ": an earlier run ended there; give each run a port of its own"
                                 : ": an earlier run ended in this directory; give each run a directory of its own"));
    char machine[256] = {};
    if (::gethostname(machine, sizeof machine - 1) != 0)
      throw InvalidInput("gloo backend: this machine has no host name");
    const std::string host = o.host.empty() ? std::string(machine) : o.host;
    // gloo reads getaddrinfo's failures as success (and crashes): asked first.
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0)
      throw InvalidInput(str("gloo backend: the host ", host, " has no address here (", ::gai_strerror(rc),
                             "); give this machine's address with --gloo-host"));
    ::freeaddrinfo(found);
    const std::string owner = str(machine, " ", ::getpid());
    make_device(sh, host);
    // A write to a peer that is gone must fail, not end this process.
    std::signal(SIGPIPE, SIG_IGN);
    if (o.join) {
      join(o, owner);
      return;
    }
    // The rank, taken: "<machine> <pid>". Never taken over: the keys an
    // earlier start left (its addresses) would mislead the others.
    const std::string rank_key = str("rank/", o.rank);
    if (!sh.store->create_once(rank_key, bytes_of(owner))) {
      const std::vector<char> held = sh.store->read(rank_key);
      throw InvalidInput(str("--rendezvous ", o.rendezvous, ": rank ", o.rank, " is already taken there (by process ",
                             std::string(held.begin(), held.end()),
                             "); each process needs a rank of its own, and each "
                             "run (or new start of one) a rendezvous of its own"));
    }
    for (int r = 0; r < o.size; ++r) sh.members.push_back(r);
    sh.next_id = o.size;
    sh.start_beating();
    try {
      comm_ = std::make_unique<GlooComm>(shared_, connect(sh, "e0", o.rank, o.size, o.timeout), true, 0);
    } catch (const CommTimeout&) {
      std::vector<int> missing;
      for (int r = 0; r < o.size; ++r)
        if (!sh.store->has(str("rank/", r))) missing.push_back(r);
      if (missing.empty()) throw;
      throw CommTimeout(str("rendezvous: timed out after ", seconds(o.timeout), " waiting for rank(s) ",
                            rank_list(missing), " to start in ", o.rendezvous, " (gloo backend)"));
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(str("gloo backend: rank ", o.rank, " could not connect to the others: ", e.what()));
    }
    comm_->set_timeout(o.timeout);
  }
  ~World() override { comm_.reset(); }

  void publish(const std::string& key, const std::string& value) override {
    shared_->store->set(str("published/", key), bytes_of(value));
  }
  std::string published(const std::string& key) const override {
    return read_or_empty(*shared_->store, str("published/", key));
  }

  Communicator& comm() override { return *comm_; }
  std::vector<int> members() const override {
    std::lock_guard lock(shared_->m);
    return shared_->members;
  }
  int first_rank() const override { return shared_->first; }
  void finish() override {
    Shared& sh = *shared_;
    std::vector<int> members;
    int epoch = 0;
    {
      std::lock_guard lock(sh.m);
      members = sh.members;
      epoch = sh.epoch;
    }
    sh.store->set(str("done/", epoch, "/", sh.first), bytes_of("1"));
    const auto start = Clock::now();
    for (;;) {
      std::vector<int> missing;
      for (int m : members)
        if (!sh.store->has(str("done/", epoch, "/", m))) missing.push_back(m);
      if (missing.empty()) break;
      if (Clock::now() - start > comm_->timeout())
        throw CommTimeout(str("the run's end on rank ", sh.first, ": timed out after ", seconds(comm_->timeout()),
                              " waiting for rank(s) ", rank_list(missing), " (gloo backend)"));
      std::this_thread::sleep_for(milliseconds(5));
    }
    if (members.front() == sh.first) sh.store->set("closed", bytes_of("1"));
  }

 private:
  // The address of this process's connections, if it can listen there.
  static void make_device(Shared& sh, const std::string& host) {
    try {
      Mesh::check_listen(host);
    } catch (const std::exception& e) {
      throw InvalidInput(str("gloo backend: ", e.what(), "; give this machine's address with --gloo-host"));
    }
    sh.host = host;
  }

  // Asks to join ("join/<k>", the first k free) and waits for the answer
  // ("joined/<k>": the epoch and this process's rank number), withdrawing
  // the request once the run has not seen it for the time-out ("joins-seen"
  // unchanged); then connects to the grown group. An answer whose epoch's
  // group left this process out (a member decided it without admissions:
  // GlooComm::reform) is answered by asking again.
  void join(const GlooOptions& o, const std::string& owner) {
    Shared& sh = *shared_;
    if (!sh.store->has("rank/0")) throw InvalidInput(str("--join ", o.rendezvous, ": no run has started there"));
    int k = 0, epoch = 0, id = -1;
    Decision d;
    for (;;) {
      while (!sh.store->create_once(str("join/", k), bytes_of(owner))) ++k;
      const std::string answer = str("joined/", k);
      auto start = Clock::now();
      std::string seen = read_or_empty(*sh.store, "joins-seen");
      for (int polls = 0; !sh.store->has(answer); ++polls) {
        if (polls % 20 == 19) {  // every 0.1 s: the run saw the request again
          std::string now = read_or_empty(*sh.store, "joins-seen");
          if (now != seen) seen = std::move(now), start = Clock::now();
        }
        const bool ended = sh.store->has("closed");
        if ((ended || Clock::now() - start > o.timeout) && sh.store->create_once(answer, bytes_of("withdrawn"))) {
          if (ended) throw CommError(str("--join ", o.rendezvous, ": the run ended before it admitted this process"));
          throw CommTimeout(str("--join ", o.rendezvous, ": the run did not admit this process within ",
                                seconds(o.timeout), " (it admits new ranks between two steps)"));
        }
        std::this_thread::sleep_for(milliseconds(5));
      }
      std::istringstream in([&] {
        const auto a = sh.store->read(answer);
        return std::string(a.begin(), a.end());
      }());
      in >> epoch >> id;
      if (epoch <= 0 || id < 0) throw CommError(str("--join ", o.rendezvous, ": a malformed answer in ", answer));
      sh.store->wait({str("members/", epoch)});
      d = read_decision(*sh.store, epoch);
      if (std::find(d.members.begin(), d.members.end(), id) != d.members.end()) break;
    }
    const std::vector<int>& after = d.members;
    const auto at = std::find(after.begin(), after.end(), id);
    {
      std::lock_guard lock(sh.m);
      sh.first = id;
      sh.epoch = epoch;
      sh.members = after;
      sh.next_join = d.next_join;
      sh.next_id = d.next_id;
    }
    sh.start_beating();
    try {
      comm_ = std::make_unique<GlooComm>(
          shared_, connect(sh, str("e", epoch), static_cast<int>(at - after.begin()), static_cast<int>(after.size()),
                           o.timeout),
          true, epoch);
    } catch (const std::exception& e) {
      throw CommError(str("--join ", o.rendezvous, ": could not connect to the run's ranks: ", e.what()));
    }
    comm_->set_timeout(o.timeout);
  }

  std::shared_ptr<Shared> shared_;
  std::unique_ptr<Communicator> comm_;
};

}  // namespace

}  // namespace distopt::gloo_detail

namespace distopt {

std::unique_ptr<GlooWorld> open_gloo_world(const GlooOptions& options) {
  return std::make_unique<gloo_detail::World>(options);
}

}  // namespace distopt
