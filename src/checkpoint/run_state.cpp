// A run's state between two steps as the manifest's JSON, and back
// (include/distopt/checkpoint/run_state.hpp). The reader takes every
// member through detail::member (json_read.hpp) and checks its type
// before using it: a manifest is outside input.
#include "distopt/checkpoint/run_state.hpp"

#include <cmath>
#include <nlohmann/json.hpp>

#include "distopt/core/error.hpp"
#include "json_read.hpp"

namespace distopt::checkpoint {

namespace {

using Json = nlohmann::json;
using OJson = nlohmann::ordered_json;
using detail::member;

[[noreturn]] void malformed(const std::string& what) { throw InvalidInput(str("checkpoint manifest: ", what)); }

// JSON has no inf or NaN: they are written as strings.
OJson number_json(double v) {
  if (std::isfinite(v)) return v;
  return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
}
double json_number(const Json& j, const std::string& what) {
  if (j.is_number()) return j.get<double>();
  if (j.is_string()) {
    const std::string t = j.get<std::string>();
    if (t == "nan") return std::nan("");
    if (t == "inf" || t == "-inf") return t == "inf" ? HUGE_VAL : -HUGE_VAL;
  }
  malformed(str(what, " is not a number"));
}

OJson scheduler_json(const SchedulerState& s) {
  OJson j;
  j["kind"] = s.kind;
  j["values"] = OJson::object();
  for (const auto& [name, values] : s.values) {
    OJson list = OJson::array();
    for (double v : values) list.push_back(number_json(v));
    j["values"][name] = list;
  }
  j["children"] = OJson::array();
  for (const SchedulerState& c : s.children) j["children"].push_back(scheduler_json(c));
  return j;
}
// Schedulers nest (SequentialLR, ChainedScheduler) a few levels deep; a
// manifest nesting deeper is refused before the recursion could exhaust
// the stack.
constexpr int kMaxSchedulerDepth = 64;
SchedulerState scheduler_state(const Json& j, int depth = 0) {
  if (depth > kMaxSchedulerDepth) malformed(str("schedulers nested deeper than ", kMaxSchedulerDepth, " levels"));
  const Json &kind = member(j, "kind"), &values = member(j, "values"), &children = member(j, "children");
  if (!kind.is_string() || !values.is_object() || !children.is_array()) malformed("a malformed scheduler state");
  SchedulerState s;
  s.kind = kind.get<std::string>();
  for (const auto& [name, list] : values.items()) {
    if (!list.is_array()) malformed(str("scheduler value ", name, " is not a list"));
    for (const Json& v : list) s.values[name].push_back(json_number(v, name));
  }
  for (const Json& c : children) s.children.push_back(scheduler_state(c, depth + 1));
  return s;
}

OJson scaler_json(const GradScalerState& s) {
  return {{"scale", number_json(s.scale)}, {"growth_factor", number_json(s.growth_factor)},
          {"backoff_factor", number_json(s.backoff_factor)},
          {"growth_interval", s.growth_interval}, {"growth_tracker", s.growth_tracker}};
}
GradScalerState scaler_state(const Json& j) {
  const Json &interval = member(j, "growth_interval"), &tracker = member(j, "growth_tracker");
  if (!j.is_object() || !interval.is_number_integer() || !tracker.is_number_integer())
    malformed("a malformed loss-scaler state");
  GradScalerState s;
  s.scale = json_number(member(j, "scale"), "scale");
  s.growth_factor = json_number(member(j, "growth_factor"), "growth_factor");
  s.backoff_factor = json_number(member(j, "backoff_factor"), "backoff_factor");
  s.growth_interval = interval.get<std::int64_t>();
  s.growth_tracker = tracker.get<std::int64_t>();
  return s;
}

OJson gossip_options_json(const parallel::GossipOptions& g) {
  return {{"topology", g.topology},
          {"peers_per_iteration", g.peers_per_iteration},
          {"synch_freq", g.synch_freq},
          {"slowmo_base", g.slowmo_base},
          {"localsgd_frequency", g.localsgd_frequency},
          {"slowmo_frequency", g.slowmo_frequency},
          {"slowmo_momentum", g.slowmo_momentum},
          {"slowmo_lr", g.slowmo_lr},
          {"sync_every", g.sync_every},
          {"outer_optimizer", g.outer_optimizer},
          {"outer_lr", g.outer_lr},
          {"outer_momentum", g.outer_momentum},
          {"fragments", g.fragments},
          {"sync_delay", g.sync_delay},
          {"fragment_alpha", g.fragment_alpha},
          {"outer_dtype", g.outer_dtype},
          {"outer_error_feedback", g.outer_error_feedback},
          {"fragment_carry", g.fragment_carry}};
}
// The options as written by gossip_options_json, or none where a member is
// missing or of another type (then no run is the same as the saved one).
std::optional<parallel::GossipOptions> gossip_options(const Json& j) {
  const Json &topology = member(j, "topology"), &peers = member(j, "peers_per_iteration"),
             &synch = member(j, "synch_freq"), &base = member(j, "slowmo_base"),
             &local = member(j, "localsgd_frequency"), &slow = member(j, "slowmo_frequency"),
             &momentum = member(j, "slowmo_momentum"), &lr = member(j, "slowmo_lr");
  auto is_int = [](const Json& v) {
    return v.is_number_integer() && v.get<std::int64_t>() >= INT32_MIN && v.get<std::int64_t>() <= INT32_MAX;
  };
  if (!topology.is_string() || !is_int(peers) || !is_int(synch) || !base.is_string() || !is_int(local) ||
      !is_int(slow) || !momentum.is_number() || !lr.is_number())
    return std::nullopt;
  parallel::GossipOptions g{topology.get<std::string>(), peers.get<int>(),   synch.get<int>(),
                            base.get<std::string>(),     local.get<int>(),   slow.get<int>(),
                            momentum.get<double>(),      lr.get<double>()};
  // diloco's members (checkpoints of 0.2 have none: the defaults).
  if (j.size() == 8) return g;
  const Json &every = member(j, "sync_every"), &outer = member(j, "outer_optimizer"),
             &outer_lr = member(j, "outer_lr"), &outer_momentum = member(j, "outer_momentum");
  if ((j.size() != 12 && j.size() != 17 && j.size() != 18) || !is_int(every) || !outer.is_string() ||
      !outer_lr.is_number() || !outer_momentum.is_number())
    return std::nullopt;
  g.sync_every = every.get<int>();
  g.outer_optimizer = outer.get<std::string>();
  g.outer_lr = outer_lr.get<double>();
  g.outer_momentum = outer_momentum.get<double>();
  // Streaming DiLoCo's and the compressed pseudo-gradient's (none in the
  // first diloco checkpoints: the defaults).
  if (j.size() == 12) return g;
  const Json &fragments = member(j, "fragments"), &delay = member(j, "sync_delay"),
             &alpha = member(j, "fragment_alpha"), &dtype = member(j, "outer_dtype"),
             &feedback = member(j, "outer_error_feedback");
  if (!is_int(fragments) || !is_int(delay) || !alpha.is_number() || !dtype.is_string() || !feedback.is_boolean())
    return std::nullopt;
  g.fragments = fragments.get<int>();
  g.sync_delay = delay.get<int>();
  g.fragment_alpha = alpha.get<double>();
  g.outer_dtype = dtype.get<std::string>();
  g.outer_error_feedback = feedback.get<bool>();
  // --fragment-carry (none in the checkpoints before it: off).
  if (j.size() == 17) return g;
  const Json& carry = member(j, "fragment_carry");
  if (!carry.is_boolean()) return std::nullopt;
  g.fragment_carry = carry.get<bool>();
  return g;
}

}  // namespace

std::vector<RunState::Group> groups_of(const Optimizer& opt) {
  std::vector<RunState::Group> groups;
  for (std::size_t g = 0; g < opt.num_groups(); ++g) {
    RunState::Group group;
    for (const auto& [name, v] : opt.group(g).options)
      if (v.kind() == OptionValue::Kind::number || v.kind() == OptionValue::Kind::pair) group.options.emplace(name, v);
    for (const auto& [name, v] : opt.group(g).extras) group.extras.emplace(name, v);
    groups.push_back(std::move(group));
  }
  return groups;
}

void load_groups(Optimizer& opt, const std::vector<RunState::Group>& groups) {
  if (groups.size() != opt.num_groups())
    malformed(str(groups.size(), " parameter groups, the run has ", opt.num_groups()));
  for (std::size_t g = 0; g < opt.num_groups(); ++g) {
    for (const auto& [name, saved] : groups[g].options) {
      const auto now = opt.group(g).options.find(name);
      if (now == opt.group(g).options.end() || now->second.kind() != saved.kind())
        malformed(str("group ", g, " has a ", name_of(saved.kind()), " option ", name, " that the run's group lacks"));
      if (!(saved == now->second)) opt.set_option(g, name, saved);
    }
    for (const auto& [name, v] : groups[g].extras) opt.set_extra(g, name, v);
  }
}

std::string run_state_json(const RunState& s) {
  OJson j;
  if (s.groups) j["groups"] = OJson::array();
  for (const RunState::Group& g : s.groups ? *s.groups : std::vector<RunState::Group>{}) {
    OJson options = OJson::object(), extras = OJson::object();
    for (const auto& [name, v] : g.options)
      options[name] = v.kind() == OptionValue::Kind::pair
                          ? OJson{number_json(v.pair()[0]), number_json(v.pair()[1])}
                          : number_json(v.number());
    for (const auto& [name, v] : g.extras) extras[name] = number_json(v);
    j["groups"].push_back({{"options", options}, {"extras", extras}});
  }
  if (s.scheduler) j["scheduler"] = scheduler_json(*s.scheduler);
  if (s.scaler) j["scaler"] = scaler_json(*s.scaler);
  if (s.n_averaged) j["averaged"] = {{"n_averaged", *s.n_averaged}};
  if (s.swa_scheduler) j["swa_scheduler"] = scheduler_json(*s.swa_scheduler);
  if (s.gossip) {
    OJson g;
    g["strategy"] = s.gossip->strategy;
    g["world"] = s.gossip->world;
    if (s.gossip->options) g["options"] = gossip_options_json(*s.gossip->options);
    g["ranks"] = OJson::array();
    for (const RunState::Gossip::Rank& r : s.gossip->ranks) g["ranks"].push_back({{"steps", r.steps}, {"numbers", r.numbers}});
    if (s.gossip->survivors) g["survivors"] = true;
    j["gossip"] = g;
  }
  return j.dump();
}

RunState parse_run_state(std::string_view text) {
  const Json j = Json::parse(text, nullptr, false);
  if (!j.is_object()) throw InvalidInput("--resume: the checkpoint manifest's state is not a JSON object");
  RunState s;
  if (j.contains("groups")) {
    const Json& groups = member(j, "groups");
    if (!groups.is_array()) malformed("groups is not a list");
    s.groups.emplace();
    for (const Json& g : groups) {
      const Json &options = member(g, "options"), &extras = member(g, "extras");
      if (!options.is_object() || !extras.is_object()) malformed("a parameter group lacks options or extras");
      RunState::Group group;
      for (const auto& [name, v] : options.items()) {
        if (v.is_array() && v.size() != 2) malformed(str("option ", name, " is neither a number nor a pair"));
        group.options.emplace(name, v.is_array() ? OptionValue(json_number(v[0], name), json_number(v[1], name))
                                                 : OptionValue(json_number(v, name)));
      }
      for (const auto& [name, v] : extras.items()) group.extras.emplace(name, json_number(v, name));
      s.groups->push_back(std::move(group));
    }
  }
  if (j.contains("scheduler")) s.scheduler = scheduler_state(member(j, "scheduler"));
  if (j.contains("swa_scheduler")) s.swa_scheduler = scheduler_state(member(j, "swa_scheduler"));
  if (j.contains("scaler")) s.scaler = scaler_state(member(j, "scaler"));
  if (j.contains("averaged")) {
    const Json& n = member(member(j, "averaged"), "n_averaged");
    if (!n.is_number_integer()) malformed("a malformed averaging state");
    s.n_averaged = n.get<std::int64_t>();
  }
  if (j.contains("gossip")) {
    const Json &g = member(j, "gossip"), &ranks = member(g, "ranks"), &strategy = member(g, "strategy"),
               &world = member(g, "world");
    if (!ranks.is_array() || !strategy.is_string()) malformed("a malformed gossip state");
    RunState::Gossip gossip;
    gossip.strategy = strategy.get<std::string>();
    gossip.world = world.is_number_integer() && world.get<std::int64_t>() > 0 && world.get<std::int64_t>() <= INT32_MAX
                       ? world.get<int>()
                       : 0;
    gossip.options = gossip_options(member(g, "options"));
    if (g.contains("survivors")) {
      const Json& v = member(g, "survivors");
      if (!v.is_boolean()) malformed("a malformed gossip state");
      gossip.survivors = v.get<bool>();
    }
    for (const Json& r : ranks) {
      const Json &steps = member(r, "steps"), &numbers = member(r, "numbers");
      if (!steps.is_number_unsigned() || !numbers.is_array())
        malformed(str("no gossip state for rank ", gossip.ranks.size()));
      RunState::Gossip::Rank rank;
      rank.steps = steps.get<std::uint64_t>();
      for (const Json& v : numbers) rank.numbers.push_back(json_number(v, "a gossip state number"));
      gossip.ranks.push_back(std::move(rank));
    }
    s.gossip = std::move(gossip);
  }
  return s;
}

}  // namespace distopt::checkpoint
