// Reading a launcher's environment (include/distopt/comm/launch_env.hpp).
#include "distopt/comm/launch_env.hpp"

#include <cstdlib>
#include <limits>

#include "distopt/core/error.hpp"

namespace distopt {
namespace {

// A whole number in [lo, hi] from variable `name`'s value, or InvalidInput.
int whole(const char* name, const char* value, long lo, long hi) {
  const std::string v = value;
  std::size_t digits = 0;
  while (digits < v.size() && v[digits] >= '0' && v[digits] <= '9') ++digits;
  if (v.empty() || digits != v.size() || v.size() > 9)
    throw InvalidInput(str(name, "=", v.substr(0, 40), " is not a whole number"));
  const long n = std::strtol(v.c_str(), nullptr, 10);
  if (n < lo || n > hi) throw InvalidInput(str(name, "=", n, " is out of range (", lo, " .. ", hi, ")"));
  return static_cast<int>(n);
}

void check_rank(const LaunchEnv& e) {
  if (e.rank >= e.world)
    throw InvalidInput(
        str(e.rank_var, "=", e.rank, " is not a rank of ", e.world_var, "=", e.world, " (0 .. ", e.world - 1, ")"));
}

}  // namespace

std::string first_host(std::string_view list) {
  auto bad = [&](std::string_view why) {
    return InvalidInput(str("the SLURM node list '", list.substr(0, 80), "' ", why));
  };
  std::size_t i = 0;
  while (i < list.size() && list[i] != '[' && list[i] != ',') ++i;
  const std::string_view prefix = list.substr(0, i);
  if (prefix.empty()) throw bad("does not start with a host name");
  if (i == list.size() || list[i] == ',') return std::string(prefix);
  // "[07-09,11]": the first number, padding kept.
  std::size_t j = i + 1;
  while (j < list.size() && list[j] >= '0' && list[j] <= '9') ++j;
  if (j == i + 1) throw bad("has a '[' not followed by a number");
  if (j == list.size() || (list[j] != '-' && list[j] != ',' && list[j] != ']')) throw bad("has an unclosed '['");
  if (list.find(']', j) == std::string_view::npos) throw bad("has an unclosed '['");
  return str(prefix, list.substr(i + 1, j - i - 1));
}

std::optional<LaunchEnv> launch_env(const EnvLookup& lookup) {
  auto get = [&](const char* name) -> const char* {
    const char* v = lookup ? lookup(name) : std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  constexpr long kMost = std::numeric_limits<int>::max();
  // A launcher's rank and world, with its rank checked, and its local rank.
  auto launched = [&](const char* launcher, const char* rank, const char* world, const char* local) {
    LaunchEnv e;
    e.launcher = launcher;
    e.rank_var = rank;
    e.world_var = world;
    e.world = whole(world, get(world), 1, kMost);
    e.rank = whole(rank, get(rank), 0, kMost);
    check_rank(e);
    if (const char* v = get(local)) e.local_rank = whole(local, v, 0, kMost);
    return e;
  };
  // torchrun first: it may itself run inside a SLURM step.
  if (get("RANK") != nullptr && get("WORLD_SIZE") != nullptr) {
    LaunchEnv e = launched("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK");
    // LOCAL_WORLD_SIZE not said: not known to be one machine.
    const char* local_world = get("LOCAL_WORLD_SIZE");
    e.one_machine = local_world != nullptr && whole("LOCAL_WORLD_SIZE", local_world, 1, kMost) == e.world;
    e.machines = e.one_machine ? 1 : 0;
    if (const char* v = get("MASTER_ADDR")) e.master_addr = v;
    if (const char* v = get("MASTER_PORT")) e.master_port = whole("MASTER_PORT", v, 1, 65535);
    const char* run = get("TORCHELASTIC_RUN_ID");
    e.job = str(run != nullptr ? run : "run", "-", e.master_addr, "-", e.master_port);
    const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
    e.agent_store = agent != nullptr && std::string_view(agent) == "True";
    return e;
  }
  if (get("SLURM_PROCID") != nullptr && get("SLURM_STEP_NUM_TASKS") != nullptr) {
    LaunchEnv e = launched("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID");
    const char* nodes = get("SLURM_STEP_NUM_NODES");
    e.machines = nodes != nullptr ? whole("SLURM_STEP_NUM_NODES", nodes, 1, kMost) : 0;
    e.one_machine = e.machines == 1;
    if (const char* v = get("SLURM_STEP_NODELIST")) e.master_addr = first_host(v);
    if (const char* v = get("MASTER_ADDR"); v != nullptr && *v != '\0') e.master_addr = v;
    const char* job = get("SLURM_JOB_ID");
    const char* step = get("SLURM_STEP_ID");
    e.job = str(job != nullptr ? job : "job", ".", step != nullptr ? step : "step");
    const char* port = get("MASTER_PORT");
    e.master_port = port != nullptr && *port != '\0' ? whole("MASTER_PORT", port, 1, 65535) : slurm_port(e.job);
    return e;
  }
  return std::nullopt;
}

int slurm_port(std::string_view job) {
  std::string digits;
  for (const char c : job)
    if (c >= '0' && c <= '9') digits += c;
  if (digits.size() > 9) digits.erase(0, digits.size() - 9);
  long n = 0;
  for (const char c : digits) n = n * 10 + (c - '0');
  return 15000 + static_cast<int>(n % 20000);
}

}  // namespace distopt
