// Errors in distopt come in two classes (docs/errors.md):
//  * recoverable failures -- bad input files, I/O, communication, time-outs --
//    throw a subclass of distopt::Error with a one-line message that names
//    the problem;
//  * violated preconditions (a caller bug: wrong sizes, out-of-range values
//    passed to an API) throw distopt::PreconditionError whose message carries
//    file:line and the offending values.
// Hot loops use DISTOPT_DCHECK, compiled out in release builds.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace distopt {

// Base of every recoverable error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Malformed or inconsistent input (a file, a JSON case, an option value).
class InvalidInput : public Error {
 public:
  using Error::Error;
};

// Files that cannot be opened, read or written.
class IoError : public Error {
 public:
  using Error::Error;
};

// Training produced a non-finite loss or gradient norm (divergence); the
// message names the step, the rank and the last finite loss. Every rank
// throws it at the same step; rank() is the thrower's rank in the world it
// then trained in (a run that went on after losses: the one that reports).
class NonFiniteError : public Error {
 public:
  explicit NonFiniteError(const std::string& what, int rank = 0) : Error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// A CUDA failure: out of device memory, a kernel error, a lost device. The
// message names what was being done and, for memory, the tensor and size.
class DeviceError : public Error {
 public:
  using Error::Error;
};

// A violated precondition: a bug in the caller.
class PreconditionError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

[[noreturn]] void throw_precondition(const char* file, int line, const char* expr,
                                     const std::string& message);

}  // namespace detail

// Builds a message from any streamable arguments.
template <class... Args>
std::string str(const Args&... args) {
  return detail::concat(args...);
}

}  // namespace distopt

// Checks a precondition; on failure throws PreconditionError with file:line,
// the failed expression and the streamed message (include the values).
#define DISTOPT_CHECK(cond, ...)                                                           \
  do {                                                                                     \
    if (!(cond)) [[unlikely]]                                                              \
      ::distopt::detail::throw_precondition(__FILE__, __LINE__, #cond,                     \
                                            ::distopt::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)

#ifdef NDEBUG
#define DISTOPT_DCHECK(cond, ...) \
  do {                            \
  } while (0)
#else
#define DISTOPT_DCHECK(cond, ...) DISTOPT_CHECK(cond __VA_OPT__(, ) __VA_ARGS__)
#endif
