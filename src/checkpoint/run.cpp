// A training run's checkpoints: the collective save, and resuming from the
// latest complete one (include/distopt/checkpoint/run.hpp).
#include "distopt/checkpoint/run.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "distopt/checkpoint/run_state.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fault.hpp"
#include "json_read.hpp"

namespace distopt::checkpoint {

namespace {

// Every rank's LocalState numbers, gathered (collective): [steps, numbers...] per rank.
std::vector<RunState::Gossip::Rank> gather_local_numbers(Communicator& comm, const parallel::LocalState& local) {
  std::vector<double> mine{static_cast<double>(local.steps)};
  mine.insert(mine.end(), local.scalars.begin(), local.scalars.end());
  const auto n = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&n, counts.data(), 1, ElemType::i64);
  std::vector<std::size_t> sizes(counts.begin(), counts.end());
  std::size_t total = 0;
  for (std::size_t c : sizes) total += c;
  std::vector<double> all(total);
  comm.all_gather_v(mine.data(), all.data(), sizes, ElemType::f64);
  std::vector<RunState::Gossip::Rank> out;
  std::size_t at = 0;
  for (std::size_t c : sizes) {
    out.push_back({static_cast<std::uint64_t>(all.at(at)),
                   std::vector<double>(all.begin() + static_cast<std::ptrdiff_t>(at + 1),
                                       all.begin() + static_cast<std::ptrdiff_t>(at + c))});
    at += c;
  }
  return out;
}

// The state the manifest keeps besides the tensors.
RunState state_of(const RunParts& parts) {
  RunState s;
  if (parts.optimizer != nullptr) s.groups = groups_of(*parts.optimizer);
  if (parts.scheduler != nullptr) s.scheduler = parts.scheduler->state_dict();
  if (parts.scaler != nullptr) s.scaler = parts.scaler->state_dict();
  if (parts.averaged != nullptr && parts.averaged->n_averaged() > 0) s.n_averaged = parts.averaged->n_averaged();
  if (parts.swa_scheduler != nullptr) s.swa_scheduler = parts.swa_scheduler->state_dict();
  return s;
}

// Rank `rank`'s pieces of the strategy's state and of the averages (cut
// like the parameters): a rank file's tensors, less a gossip rank's own.
PieceSet rank_pieces(parallel::Strategy& strategy, int rank, const RunParts& parts) {
  PieceSet pieces = strategy_pieces(strategy, rank);
  if (parts.averaged != nullptr && parts.averaged->n_averaged() > 0)
    pieces.append(own_pieces(strategy, rank, parts.averaged->params(), "avg."));
  return pieces;
}

// Whether a gossip checkpoint's ranks go on one by one in this run.
bool same_gossip_run(const RunState::Gossip& saved, const RunInfo& run, int world) {
  return saved.strategy == run.strategy && saved.world == world && saved.options == run.gossip;
}

}  // namespace

std::uint64_t save(Communicator& comm, parallel::Strategy& strategy, const RunInfo& run, const RunParts& parts,
                   const SaveOptions& options, std::uint64_t step, int epoch) {
  namespace fs = std::filesystem;
  const fs::path dir = checkpoint_dir(options.root, step);
  std::int64_t ok = 1;
  std::string failure;
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir, ec);  // an interrupted write of this very step
    fs::create_directories(dir, ec);
    if (ec) {
      ok = 0;
      failure = str(dir.string(), ": cannot create the checkpoint directory: ", ec.message());
    }
  }
  comm.broadcast(&ok, 1, ElemType::i64, 0);
  if (ok == 0) throw IoError(failure.empty() ? str(dir.string(), ": rank 0 could not create it") : failure);
  // Each rank's file; a failure on any rank fails the checkpoint on all.
  FileEntry mine;
  const std::string name = str("rank", comm.rank(), ".safetensors");
  // The collective parts first (gossip: the consensus, the rounds in flight).
  // The pieces are views of the live parameters and optimizer state: the
  // file is streamed from them, never assembled in memory.
  PieceSet pieces = rank_pieces(strategy, comm.rank(), parts);
  const std::optional<parallel::LocalState> local = strategy.local_state();
  std::vector<RunState::Gossip::Rank> ranks;
  if (local) {
    pieces.append(local_pieces(*local, comm.rank()));
    ranks = gather_local_numbers(comm, *local);
  }
  try {
    // DISTOPT_FAULT exit:RANK:STEP:POINT (core/fault.hpp): this rank ends
    // the process while writing, with half of its file written under the
    // temporary name, or with its file in place and no manifest.
    const Fault fault = fault_from_env();
    const bool dies = fault.exits_in_checkpoint(comm.rank(), step);
    if (dies && fault.in_file) {
      // Half the file under its temporary name, as a write cut short leaves it.
      const std::vector<std::byte> bytes = pieces_bytes(pieces);
      std::FILE* f = std::fopen((dir / (name + ".tmp." + std::to_string(::getpid()))).c_str(), "wb");
      if (f != nullptr) std::fwrite(bytes.data(), 1, bytes.size() / 2, f), std::fclose(f);
      std::_Exit(137);
    }
    FileWriter file(dir, name);
    write_pieces(pieces, [&](std::span<const std::byte> b) { file.write(b); });
    mine = file.commit();
    if (dies && !fault.in_file) std::_Exit(137);  // the file in place, no manifest
  } catch (const Error& e) {
    ok = 0;
    failure = e.what();
  }
  const std::int64_t written[3] = {ok, static_cast<std::int64_t>(mine.bytes), static_cast<std::int64_t>(mine.xxh64)};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(written, all.data(), 3, ElemType::i64);
  for (int r = 0; r < comm.size(); ++r)
    if (all[3 * static_cast<std::size_t>(r)] == 0)
      throw IoError(r == comm.rank() ? failure : str("checkpoint of step ", step, ": rank ", r, " could not write its file"));
  if (comm.rank() == 0) {
    Manifest m;
    m.step = step;
    RunState state = state_of(parts);
    if (local) state.gossip = RunState::Gossip{run.strategy, comm.size(), run.gossip, std::move(ranks)};
    nlohmann::ordered_json body;
    body["step"] = step;
    body["epoch"] = epoch;
    body["world"] = comm.size();
    body["strategy"] = run.strategy;
    body["model"] = run.model;
    body["optimizer"] = run.optimizer;
    body["param_order"] = nlohmann::ordered_json::array();  // the model's order (param_hash's)
    for (const ParamSlot& p : strategy.layout().params()) body["param_order"].push_back(p.name);
    body["config"] = nlohmann::ordered_json::parse(run.config);
    body["state"] = nlohmann::ordered_json::parse(run_state_json(state));
    m.body = body.dump();
    for (int r = 0; r < comm.size(); ++r) {
      const auto* v = all.data() + 3 * static_cast<std::size_t>(r);
      m.files.push_back({str("rank", r, ".safetensors"), static_cast<std::uint64_t>(v[1]), static_cast<std::uint64_t>(v[2])});
    }
    write_manifest(dir, m);
    (void)prune(options.root, options.keep, step);
  }
  comm.barrier();
  std::uint64_t bytes = 0;
  for (int r = 0; r < comm.size(); ++r) bytes += static_cast<std::uint64_t>(all[3 * static_cast<std::size_t>(r) + 1]);
  return bytes;
}

Loaded load_latest(const std::filesystem::path& root) {
  const auto latest = latest_complete(root);
  if (!latest) throw InvalidInput(str("--resume: no complete checkpoint in ", root.string()));
  const Manifest m = verify(*latest);
  const nlohmann::json body = nlohmann::json::parse(m.body, nullptr, false);
  const nlohmann::json& config = detail::member(body, "config");
  if (!config.is_object())
    throw InvalidInput(str("checkpoint ", latest->string(), ": manifest.json carries no run configuration"));
  Loaded l;
  l.dir = *latest;
  l.step = m.step;
  l.config = config.dump();
  if (body.contains("state")) l.state = detail::member(body, "state").dump();
  if (is_survivors_state(l))  // (kept in memory only)
    throw InvalidInput(str("checkpoint ", latest->string(), ": its manifest holds a survivor's state in memory"));
  l.wholes = read_wholes(*latest, m);
  return l;
}

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
  put_u64(out, state.wholes.size());
  for (const auto& [name, w] : state.wholes) {
    put_text(out, name);
    put_u64(out, w.shape.size());
    for (std::int64_t d : w.shape) put_u64(out, static_cast<std::uint64_t>(d));
    put_u64(out, w.values.size());
    const char* v = reinterpret_cast<const char*>(w.values.data());
    out.insert(out.end(), v, v + w.values.size() * sizeof(float));
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
      if (extent != 0 && numel > (std::uint64_t{1} << 40) / extent)
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

std::string resume(Communicator& comm, parallel::Strategy& strategy, const Loaded& from, const RunInfo& run,
                   const RunParts& parts, const std::function<Scheduler&()>& start_swa) {
  const RunState st = parse_run_state(from.state);
  std::string warning;
  // A gossip checkpoint goes on rank by rank in a run of the same strategy,
  // world size and gossip options; anything else starts from its consensus.
  std::string prefix;
  if (st.gossip) {
    if (same_gossip_run(*st.gossip, run, comm.size()))
      prefix = local_prefix(comm.rank());
    else
      warning = str("resuming the ", st.gossip->strategy, " checkpoint of ", st.gossip->world, " ranks as ", run.strategy,
                    " at ", comm.size(),
                    " (or with other gossip options): every rank starts from the ranks' mean model and optimizer state");
  }
  load_optimizer_state(strategy, from.wholes, prefix);
  if (!prefix.empty()) {
    const auto me = static_cast<std::size_t>(comm.rank());
    if (me >= st.gossip->ranks.size()) throw InvalidInput(str("checkpoint manifest: no gossip state for rank ", comm.rank()));
    const RunState::Gossip::Rank& r = st.gossip->ranks[me];
    parallel::LocalState local = local_state(from.wholes, comm.rank(), r.steps, r.numbers);
    local.survivor = st.gossip->survivors;
    strategy.resume(local.steps, &local);
  } else {
    strategy.resume(from.step, nullptr);
  }
  // The scheduler's and the scaler's state, then the groups' options as
  // they were (the lr the scheduler had set).
  if ((parts.scheduler != nullptr) != st.scheduler.has_value())
    throw InvalidInput(parts.scheduler != nullptr
                           ? "--resume: the checkpoint's run had no scheduler; one cannot be added on resume"
                           : "--resume: the checkpoint's run had a scheduler; resume it with its --scheduler");
  if (parts.scheduler != nullptr) parts.scheduler->load_state_dict(*st.scheduler);
  if ((parts.scaler != nullptr) != st.scaler.has_value())
    throw InvalidInput(parts.scaler != nullptr
                           ? "--resume: the checkpoint's run had no loss scaling; it cannot be added on resume"
                           : "--resume: the checkpoint's run had loss scaling; resume it with --loss-scale dynamic");
  if (parts.scaler != nullptr) parts.scaler->load_state_dict(*st.scaler);
  // SWA/EMA: the averages (cut like the parameters) and SWALR once SWA has
  // started.
  if (st.n_averaged) {
    if (parts.averaged == nullptr)
      throw InvalidInput("--resume: the checkpoint's run averaged its parameters; resume it with its --swa-start or "
                         "--ema-decay");
    parts.averaged->load_state_dict({*st.n_averaged, own_values(strategy, comm.rank(), from.wholes, prefix + "avg.")});
  }
  if (st.swa_scheduler) start_swa().load_state_dict(*st.swa_scheduler);
  if (st.groups && parts.optimizer != nullptr) load_groups(*parts.optimizer, *st.groups);
  return warning;
}

}  // namespace distopt::checkpoint
