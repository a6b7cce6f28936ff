// Checkpoints kept in memory for a change of world (docs/reliability.md,
// "Survivors"; include/distopt/checkpoint/survival.hpp): a replica's state,
// a gossip survivor's own, the buddy copies of --memory-checkpoint, and a
// state as bytes for a rank that joins.
#include "distopt/checkpoint/survival.hpp"

#include <algorithm>
#include <cstring>

#include "distopt/checkpoint/run_state.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/core/error.hpp"
#include "run_internal.hpp"

namespace distopt::checkpoint {

using detail::gather_local_numbers;
using detail::rank_pieces;
using detail::state_of;

Loaded capture(parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts, std::uint64_t step) {
  if (!strategy.info().replicated_params || strategy.info().per_rank_models)
    throw InvalidInput(str("--strategy ", run.strategy, ": a rank does not hold the whole state, so survivors cannot go on "
                           "from their own (ddp's ranks each hold it)"));
  // Every rank's pieces, cut from this rank's replica: replicated values
  // cut as the ranks' files would hold them, which assemble joins.
  std::vector<Piece> pieces;
  for (int r = 0; r < strategy.layout().world(); ++r)
    for (Piece& p : rank_pieces(strategy, r, parts).copies()) pieces.push_back(std::move(p));
  Loaded out;
  out.step = step;
  out.config = run.config;
  out.state = run_state_json(state_of(parts));
  out.wholes = assemble(pieces);
  return out;
}

Loaded capture_survivor(parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                        const parallel::LocalState& local, int rank, int world) {
  std::span<const float> averaged;
  if (parts.averaged != nullptr && parts.averaged->n_averaged() > 0) averaged = parts.averaged->params();
  PieceSet set = survivor_pieces(strategy, rank, local, averaged);
  std::vector<Piece> pieces;
  for (Piece& p : set.copies()) pieces.push_back(std::move(p));
  RunState st = state_of(parts);
  st.gossip = RunState::Gossip{run.strategy, world, run.gossip,
                               std::vector<RunState::Gossip::Rank>(static_cast<std::size_t>(world), {local.steps, local.scalars}),
                               /*survivors=*/true};
  Loaded out;
  out.step = local.steps;
  out.config = run.config;
  out.state = run_state_json(st);
  out.wholes = assemble(pieces);
  return out;
}

bool is_survivors_state(const Loaded& state) {
  const RunState st = parse_run_state(state.state);
  return st.gossip && st.gossip->survivors;
}

void rebase_survivor(Loaded& state, int rank, int world, std::uint64_t step, std::string_view run_state) {
  const RunState mine = parse_run_state(state.state);
  DISTOPT_CHECK(mine.gossip && mine.gossip->survivors && !mine.gossip->ranks.empty(), "not a survivor's state");
  RunState out = parse_run_state(run_state);
  RunState::Gossip::Rank me = mine.gossip->ranks[0];
  me.steps = step;
  RunState::Gossip gossip = *mine.gossip;
  gossip.world = world;
  gossip.ranks = std::vector<RunState::Gossip::Rank>(static_cast<std::size_t>(world), me);
  out.gossip = std::move(gossip);
  std::map<std::string, Whole> wholes;
  for (auto& [name, w] : state.wholes) {
    const std::size_t dot = name.rfind("gossip.", 0) == 0 ? name.find('.', 7) : std::string::npos;
    wholes.emplace(dot == std::string::npos ? name : local_prefix(rank) + name.substr(dot + 1), std::move(w));
  }
  state.wholes = std::move(wholes);
  state.state = run_state_json(out);
  state.step = step;
}

namespace {

constexpr int kBuddyTag = 0x4d43;  // keep_in_memory's messages

}  // namespace

InMemory keep_in_memory(Communicator& comm, parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                        std::uint64_t step) {
  const PieceSet pieces = rank_pieces(strategy, comm.rank(), parts);
  InMemory m;
  m.step = step;
  m.world = comm.size();
  m.rank = comm.rank();
  m.mine = pieces_bytes(pieces);
  m.config = run.config;
  m.state = run_state_json(state_of(parts));
  const int n = comm.size();
  if (n > 1) {
    const int to = (m.rank + 1) % n, from = (m.rank + n - 1) % n;
    const std::uint64_t out = m.mine.size();
    std::uint64_t in = 0;
    auto r = comm.irecv(&in, 1, ElemType::i64, from, kBuddyTag);
    auto s = comm.isend(&out, 1, ElemType::i64, to, kBuddyTag);
    r->wait();
    s->wait();
    m.buddy.resize(in);
    r = comm.irecv(m.buddy.data(), in, ElemType::u8, from, kBuddyTag + 1);
    s = comm.isend(m.mine.data(), out, ElemType::u8, to, kBuddyTag + 1);
    r->wait();
    s->wait();
  }
  return m;
}

std::optional<Loaded> restore_from_memory(Communicator& comm, std::span<const InMemory> kept, bool joining) {
  // Per rank: its rank and world when it kept them (a joining rank: -1, 0),
  // and the steps kept (-1: none).
  constexpr std::size_t kMost = 2, kPer = 2 + kMost;
  DISTOPT_CHECK(kept.size() <= kMost, kept.size(), " checkpoints kept in memory");
  DISTOPT_CHECK(!joining || kept.empty(), "a joining rank keeps no checkpoint");
  std::int64_t mine[kPer] = {joining ? -1 : kept.empty() ? -2 : kept[0].rank, kept.empty() ? 0 : kept[0].world, -1, -1};
  for (std::size_t i = 0; i < kept.size(); ++i) mine[2 + i] = static_cast<std::int64_t>(kept[i].step);
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> all(kPer * n);
  comm.all_gather(mine, all.data(), kPer, ElemType::i64);
  // The ranks that kept checkpoints (all but the joining ones); the first
  // of them sends the run's configuration and state to the joining ones.
  std::vector<std::size_t> keepers;
  for (std::size_t s = 0; s < n; ++s)
    if (all[s * kPer] != -1) keepers.push_back(s);
  if (keepers.empty()) return std::nullopt;
  const std::size_t first = keepers[0];
  const auto keeps = [&](std::size_t s, std::int64_t step) {
    return all[s * kPer + 2] == step || all[s * kPer + 3] == step;
  };
  std::int64_t step = -1;
  for (std::size_t i = 2; i < kPer; ++i) {
    const std::int64_t candidate = all[first * kPer + i];
    bool everyone = candidate >= 0;
    for (std::size_t s : keepers)
      everyone = everyone && keeps(s, candidate) && all[s * kPer + 1] == all[first * kPer + 1];
    if (everyone) step = std::max(step, candidate);
  }
  if (step < 0) return std::nullopt;
  const auto world = static_cast<int>(all[first * kPer + 1]);
  std::vector<char> alive(static_cast<std::size_t>(world), 0);
  for (std::size_t s : keepers) alive.at(static_cast<std::size_t>(all[s * kPer])) = 1;
  for (int q = 0; q < world; ++q)
    if (!alive[static_cast<std::size_t>(q)] && !alive[static_cast<std::size_t>((q + 1) % world)]) return std::nullopt;
  Loaded out;
  out.step = static_cast<std::uint64_t>(step);
  const InMemory* at = joining ? nullptr : kept[0].step == static_cast<std::uint64_t>(step) ? &kept[0] : &kept[1];
  if (keepers.size() < n) {  // the joining ones take the first keeper's
    std::string config = at != nullptr ? at->config : std::string(), state = at != nullptr ? at->state : std::string();
    for (std::string* text : {&config, &state}) comm.broadcast_bytes(*text, static_cast<int>(first));
    out.config = std::move(config);
    out.state = std::move(state);
  } else {
    out.config = at->config;
    out.state = at->state;
  }
  // This rank's file, and its buddy's where the buddy was lost: each a
  // rank number and a size, then the bytes.
  std::vector<std::byte> blob;
  const auto put = [&](std::int64_t rank, const std::vector<std::byte>& bytes) {
    const std::uint64_t head[2] = {static_cast<std::uint64_t>(rank), bytes.size()};
    const auto* h = reinterpret_cast<const std::byte*>(head);
    blob.insert(blob.end(), h, h + sizeof head);
    blob.insert(blob.end(), bytes.begin(), bytes.end());
  };
  if (at != nullptr) {
    put(at->rank, at->mine);
    const int buddy = (at->rank + world - 1) % world;
    if (!alive[static_cast<std::size_t>(buddy)]) put(buddy, at->buddy);
  }
  const auto size = static_cast<std::int64_t>(blob.size());
  std::vector<std::int64_t> sizes(n);
  comm.all_gather(&size, sizes.data(), 1, ElemType::i64);
  std::vector<std::size_t> counts(sizes.begin(), sizes.end());
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  std::vector<std::byte> everything(total);
  comm.all_gather_v(blob.data(), everything.data(), counts, ElemType::u8);
  std::vector<Piece> pieces;
  for (std::size_t off = 0; off < total;) {
    std::uint64_t head[2];
    DISTOPT_CHECK(total - off >= sizeof head, "a malformed checkpoint in memory");
    std::memcpy(head, everything.data() + off, sizeof head);
    off += sizeof head;
    DISTOPT_CHECK(head[1] <= total - off, "a malformed checkpoint in memory");
    const std::string name = str("rank", head[0], " in memory");
    auto mine_pieces = pieces_of(parse_safetensors(std::span(everything.data() + off, head[1]), name), name);
    pieces.insert(pieces.end(), std::make_move_iterator(mine_pieces.begin()), std::make_move_iterator(mine_pieces.end()));
    off += head[1];
  }
  out.wholes = assemble(pieces);
  return out;
}

namespace {

// Little-endian 64-bit sizes, then the bytes they count.
void put_u64(std::vector<char>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_text(std::vector<char>& out, const std::string& s) {
  put_u64(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

class Reader {
 public:
  explicit Reader(std::span<const char> b) : b_(b) {}
  std::uint64_t u64(const char* what) {
    need(8, what);
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(b_[at_ + i])) << (8 * i);
    at_ += 8;
    return v;
  }
  std::string text(const char* what) {
    const std::uint64_t n = u64(what);
    need(n, what);
    std::string s(b_.data() + at_, n);
    at_ += n;
    return s;
  }
  void floats(std::vector<float>& out, std::uint64_t n, const char* what) {
    if (n > (b_.size() - at_) / sizeof(float)) fail(what);
    out.resize(n);
    if (n > 0) std::memcpy(out.data(), b_.data() + at_, n * sizeof(float));  // (data() may be null when empty)
    at_ += n * sizeof(float);
  }
  bool done() const { return at_ == b_.size(); }

 private:
  void need(std::uint64_t n, const char* what) {
    if (n > b_.size() - at_) fail(what);
  }
  [[noreturn]] static void fail(const char* what) {
    throw InvalidInput(str("a run's state in memory: its ", what, " runs past the end of the bytes"));
  }
  std::span<const char> b_;
  std::size_t at_ = 0;
};

}  // namespace

std::vector<char> to_bytes(const Loaded& state) {
  std::vector<char> out;
  put_u64(out, state.step);
  put_text(out, state.config);
  put_text(out, state.state);
  const LoadedTensors tensors(state);  // (a checkpoint on disk is read whole here)
  const std::vector<std::string> names = tensors.names();
  put_u64(out, names.size());
  for (const std::string& name : names) {
    const Shape& shape = *tensors.shape(name);
    put_text(out, name);
    put_u64(out, shape.size());
    for (std::int64_t d : shape) put_u64(out, static_cast<std::uint64_t>(d));
    const std::vector<float> values = tensors.whole(name);
    put_u64(out, values.size());
    const char* v = reinterpret_cast<const char*>(values.data());
    out.insert(out.end(), v, v + values.size() * sizeof(float));
  }
  return out;
}

Loaded from_bytes(std::span<const char> bytes) {
  Reader in(bytes);
  Loaded out;
  out.step = in.u64("step");
  out.config = in.text("configuration");
  out.state = in.text("state");
  const std::uint64_t n = in.u64("tensor count");
  for (std::uint64_t i = 0; i < n; ++i) {
    std::string name = in.text("tensor name");
    Whole w;
    const std::uint64_t dims = in.u64("shape");
    if (dims > 16) throw InvalidInput(str("a run's state in memory: tensor ", name, " has ", dims, " dimensions"));
    std::uint64_t numel = 1;
    for (std::uint64_t d = 0; d < dims; ++d) {
      const std::uint64_t extent = in.u64("shape");
      if (extent > kMaxElements)  // (a dimension beside a 0 would leave numel 0)
        throw InvalidInput(str("a run's state in memory: tensor ", name, " has a dimension of ", extent));
      if (extent != 0 && numel > kMaxElements / extent)
        throw InvalidInput(str("a run's state in memory: tensor ", name, " is too large"));
      numel *= extent;
      w.shape.push_back(static_cast<std::int64_t>(extent));
    }
    const std::uint64_t count = in.u64("values");
    if (count != numel)
      throw InvalidInput(str("a run's state in memory: tensor ", name, " has ", count, " values for its shape's ", numel));
    in.floats(w.values, count, "values");
    out.wholes.emplace(std::move(name), std::move(w));
  }
  if (!in.done()) throw InvalidInput("a run's state in memory: bytes after its last tensor");
  return out;
}

}  // namespace distopt::checkpoint
