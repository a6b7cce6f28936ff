// The gloo backend's data movement: GlooComm's messages and collectives;
// see transport.hpp, include/distopt/comm/gloo.hpp and docs/reliability.md
// ("Processes").
//
// Data: every message goes to one peer on a slot of the group's Mesh;
// collectives use a slot of their own each (a per-communicator sequence, the
// same on every rank since ranks issue collectives in the same order),
// point-to-point messages the slot of their tag. Sums are reduce_ordered's.
#include "transport.hpp"

#include <chrono>
#include <utility>

#include "distopt/core/copy.hpp"

namespace distopt::gloo_detail {

void Shared::abort_upto(int epoch, const std::string& why, bool group_left) {
  std::lock_guard lock(lives_m);
  for (auto [e, live] : lives)
    if (e <= epoch) live->abort_all(why, group_left);
}

GlooComm::GlooComm(std::shared_ptr<Shared> shared, std::shared_ptr<Mesh> mesh, bool top, int epoch)
    : shared_(std::move(shared)), mesh_(std::move(mesh)), top_(top), epoch_(epoch) {
  live_.attach(mesh_.get());
  std::lock_guard lock(shared_->lives_m);
  shared_->lives.emplace_back(epoch, &live_);
}

GlooComm::~GlooComm() {
  stop_progress();
  std::lock_guard lock(shared_->lives_m);
  std::erase_if(shared_->lives, [&](const auto& l) { return l.second == &live_; });
}

void GlooComm::fail(const std::string& op, int peer, const std::exception& e, Clock::time_point until) {
  mesh_->close();
  // In an elastic world every communicator of this epoch is done: the
  // group re-forms.
  if (shared_->elastic == Elastic::on)
    shared_->abort_upto(epoch_, "another operation of this process lost a peer");
  else
    live_.abort_all("another operation of this communicator lost a peer");
  const bool timed_out = Clock::now() >= until - milliseconds(5) ||
                         std::string_view(e.what()).find("Timed out") != std::string_view::npos;
  const std::string who = peer >= 0 ? str("rank ", peer) : std::string("the other ranks");
  const auto* aborted = dynamic_cast<const WaitAborted*>(&e);
  const bool left = aborted != nullptr && aborted->group_left();
  const std::string msg = timed_out ? str(op, " on rank ", rank(), ": timed out after ", seconds(timeout()),
                                          " waiting for ", who, " (gloo backend)")
                          : left    ? str(op, " on rank ", rank(), ": ", e.what(), " (gloo backend)")
                                    : str(op, " on rank ", rank(), ": lost ", who, " (gloo: ", e.what(), ")");
  if (shared_->elastic == Elastic::on) throw RankLost(msg);  // (only the top communicator shrinks)
  if (timed_out) throw CommTimeout(msg);
  throw CommError(msg);
}

std::unique_ptr<Request> GlooComm::do_isend(const void* buf, std::size_t bytes, int peer, int tag) {
  auto op = mesh_->send(peer, p2p_slot(tag), buf, bytes);
  count_sent(bytes);
  return std::make_unique<GlooRequest>(*this, std::move(op), true, peer, tag);
}

std::unique_ptr<Request> GlooComm::do_irecv(void* buf, std::size_t bytes, int peer, int tag) {
  return std::make_unique<GlooRequest>(*this, mesh_->recv(peer, p2p_slot(tag), buf, bytes), false, peer, tag);
}

void GlooComm::do_broadcast(void* buf, std::size_t bytes, int root) {
  std::vector<Message> sends, recvs;
  if (rank() == root) {
    for (int r = 0; r < size(); ++r)
      if (r != root) sends.push_back({r, static_cast<char*>(buf), bytes});
  } else {
    recvs.push_back({root, static_cast<char*>(buf), bytes});
  }
  exchange("broadcast", sends, recvs);
}

void GlooComm::do_barrier() {
  const int n = size(), me = rank();
  std::vector<char> out(1, 1), in(static_cast<std::size_t>(n), 0);
  std::vector<Message> sends, recvs;
  for (int j = 1; j < n; ++j) {
    sends.push_back({(me + j) % n, out.data(), 1});
    recvs.push_back({(me + n - j) % n, in.data() + (me + n - j) % n, 1});
  }
  exchange("barrier", sends, recvs);
}

std::unique_ptr<Communicator> GlooComm::do_split(int color, int key) {
  const int n = size();
  const std::int64_t mine[3] = {color, key, rank()};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(n));
  all_gather(mine, all.data(), 3, ElemType::i64);
  std::uint64_t seq = 0;
  int epoch = 0;
  {
    std::lock_guard lock(shared_->m);
    seq = ++shared_->splits;
    epoch = shared_->epoch;
  }
  if (color < 0) return nullptr;
  std::vector<std::pair<std::int64_t, std::int64_t>> group;  // (key, rank)
  for (int r = 0; r < n; ++r)
    if (all[3 * r] == color) group.emplace_back(all[3 * r + 1], all[3 * r + 2]);
  std::sort(group.begin(), group.end());
  int new_rank = 0;
  for (std::size_t i = 0; i < group.size(); ++i)
    if (group[i].second == rank()) new_rank = static_cast<int>(i);
  // The count restarts with each membership epoch (a joiner's is 0).
  const std::string prefix = str("split/", epoch, ".", seq, ".", color);
  try {
    auto ctx = connect(*shared_, prefix, new_rank, static_cast<int>(group.size()), timeout());
    return std::make_unique<GlooComm>(shared_, std::move(ctx), false, epoch);
  } catch (const std::exception& e) {
    const std::string msg = str("split on rank ", rank(), ": ", e.what(), " (gloo backend)");
    if (shared_->elastic == Elastic::on) throw RankLost(msg);
    throw CommError(msg);
  }
}

void GlooComm::exchange(const char* op, std::span<const Message> sends, std::span<const Message> recvs) {
  const std::uint64_t slot = kCollective + seq_++;
  const auto until = deadline();
  std::vector<std::shared_ptr<Mesh::Op>> in(recvs.size()), out(sends.size());
  int peer = -1;
  try {
    for (std::size_t i = 0; i < recvs.size(); ++i) {
      if (recvs[i].bytes == 0) continue;
      peer = recvs[i].peer;
      in[i] = mesh_->recv(peer, slot, recvs[i].data, recvs[i].bytes);
    }
    for (std::size_t i = 0; i < sends.size(); ++i) {
      if (sends[i].bytes == 0) continue;
      peer = sends[i].peer;
      out[i] = mesh_->send(peer, slot, sends[i].data, sends[i].bytes);
      count_sent(sends[i].bytes);
    }
    for (std::size_t i = 0; i < recvs.size(); ++i) {
      if (!in[i]) continue;
      peer = recvs[i].peer;
      if (!mesh_->wait(*in[i], until)) live_.aborted();
    }
    for (std::size_t i = 0; i < sends.size(); ++i) {
      if (!out[i]) continue;
      peer = sends[i].peer;
      if (!mesh_->wait(*out[i], until)) live_.aborted();
    }
  } catch (const std::exception& e) {
    fail(op, std::string_view(op) == "barrier" ? -1 : peer, e, until);
  }
}

GlooRequest::~GlooRequest() {
  if (!done_) comm_.mesh_->cancel(*op_);
}

void GlooRequest::wait() {
  if (done_) return;
  const auto until = Clock::now() + comm_.timeout();
  try {
    if (!comm_.mesh_->wait(*op_, until)) comm_.live_.aborted();
  } catch (const std::exception& e) {
    comm_.fail(str(send_ ? "send" : "recv", " (tag ", tag_, ")"), peer_, e, until);
  }
  done_ = true;
}

}  // namespace distopt::gloo_detail
