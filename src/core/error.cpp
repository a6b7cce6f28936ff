#include "distopt/core/error.hpp"

namespace distopt::detail {

void throw_precondition(const char* file, int line, const char* expr, const std::string& message) {
  std::string_view path(file);
  // Keep the path relative to the project (no machine paths in messages).
  if (auto pos = path.rfind("/src/"); pos != std::string_view::npos) path = path.substr(pos + 1);
  if (auto pos = path.rfind("/include/"); pos != std::string_view::npos) path = path.substr(pos + 1);
  throw PreconditionError(concat(path, ":", line, ": check failed: ", expr,
                                 message.empty() ? "" : " (", message, message.empty() ? "" : ")"));
}

}  // namespace distopt::detail
