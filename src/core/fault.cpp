// DISTOPT_FAULT's parser (include/distopt/core/fault.hpp).
#include "distopt/core/fault.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "distopt/core/error.hpp"

namespace distopt {

Fault fault_from_env() {
  const char* env = std::getenv("DISTOPT_FAULT");
  if (env == nullptr || *env == '\0') return {};
  Fault f;
  unsigned long long step = 0;
  int used = 0;
  if (std::sscanf(env, "stall:%d:%llu%n", &f.rank, &step, &used) == 2 && env[used] == '\0' && f.rank >= 0) {
    f.kind = Fault::Kind::stall;
    f.step = static_cast<std::size_t>(step);
    return f;
  }
  for (const auto& [name, kind] : {std::pair{"fail", Fault::Kind::fail}, std::pair{"kill", Fault::Kind::kill},
                                   std::pair{"term", Fault::Kind::term}}) {
    used = 0;
    if (std::sscanf(env, (std::string(name) + ":%d:%llu%n").c_str(), &f.rank, &step, &used) == 2 &&
        env[used] == '\0' && f.rank >= 0) {
      f.kind = kind;
      f.step = static_cast<std::size_t>(step);
      return f;
    }
  }
  char point[16] = {};
  used = 0;
  if (std::sscanf(env, "stall:%d:%15[a-z]%n", &f.rank, point, &used) == 2 && env[used] == '\0' && f.rank >= 0 &&
      (std::string(point) == "init" || std::string(point) == "end" || std::string(point) == "finalize")) {
    f.kind = Fault::Kind::stall;
    f.at = std::string(point) == "init" ? Fault::At::init
                                        : (std::string(point) == "end" ? Fault::At::end : Fault::At::finalize);
    return f;
  }
  used = 0;
  if (std::sscanf(env, "exit:%d:%llu:%15[a-z]%n", &f.rank, &step, point, &used) == 3 && env[used] == '\0' &&
      f.rank >= 0 && (std::string(point) == "file" || std::string(point) == "manifest")) {
    f.kind = Fault::Kind::exit;
    f.step = static_cast<std::size_t>(step);
    f.in_file = std::string(point) == "file";
    return f;
  }
  throw InvalidInput(str("DISTOPT_FAULT: '", env,
                         "' is not stall:RANK:STEP, stall:RANK:init|end|finalize, fail:RANK:STEP, kill:RANK:STEP, "
                         "term:RANK:STEP or exit:RANK:STEP:file|manifest"));
}

}  // namespace distopt
