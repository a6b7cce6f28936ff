// A small key-value store over TCP: the gloo backend's rendezvous where the
// machines share no directory (docs/cluster.md, "Rendezvous"). One process
// serves it (StoreServer: rank 0 of a run given `--rendezvous
// tcp://HOST:PORT`); every process, the server's own included, talks to it
// through a StoreClient. It keeps the contract of the rendezvous directory
// (src/comm/gloo/store.hpp): a value is written whole or not at all, and a
// key can be created once, atomically, among all the processes (the
// membership's decisions rely on it).
//
// The wire format (little-endian), after each side has sent the 8 bytes
// of kStoreHello:
//   request   op (1 byte: StoreOp), key length (4), key,
//             and for set and create_once: value length (4), value
//   answer    1 byte: 1 yes / done, 0 no / absent, 2 refused (the store is
//             full); read's yes is followed by the value's length (4) and
//             the value
// Keys are at most kStoreMaxKey bytes, values kStoreMaxValue: a request
// naming more is malformed, and its connection is closed as soon as the
// lengths are read (the server holds at most one declared request per
// connection, and nothing before the greeting but its 8 bytes). There is
// no authentication: whoever reaches the port can read and write the
// keys (a run's machines are trusted with each other, as gloo's are).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace distopt {

enum class StoreOp : std::uint8_t { set = 1, create_once = 2, has = 3, read = 4 };

inline constexpr std::string_view kStoreHello{"dstore1\n", 8};
inline constexpr std::size_t kStoreMaxKey = 1024;
inline constexpr std::size_t kStoreMaxValue = std::size_t{16} << 20;
// What one server holds at most, all values together.
inline constexpr std::size_t kStoreMaxBytes = std::size_t{256} << 20;

struct StoreRequest {
  StoreOp op = StoreOp::has;
  std::string key;
  std::vector<char> value;  // set and create_once
};

// Takes one whole request off the front of `in`: none while `in` holds
// only part of one. A malformed request (an unknown op, a key or value
// longer than the limits) is an InvalidInput naming it.
std::optional<StoreRequest> take_store_request(std::string& in);
std::string encode_store_request(const StoreRequest& r);

// The server's table: applies a request and returns the answer's bytes.
class StoreTable {
 public:
  std::string answer(const StoreRequest& r);
  std::size_t bytes() const { return bytes_; }

 private:
  std::map<std::string, std::vector<char>> values_;
  std::size_t bytes_ = 0;
};

// "tcp://HOST:PORT" (HOST a name, an IPv4 address or a bracketed IPv6
// one; PORT 1..65535): the endpoint. None for anything not starting with
// "tcp://" (a directory); an InvalidInput naming the value where the rest
// does not parse.
struct TcpEndpoint {
  std::string host;
  int port = 0;
  std::string text() const;  // "tcp://HOST:PORT"
};
std::optional<TcpEndpoint> tcp_endpoint(std::string_view rendezvous);

// Serves a StoreTable on `port` (every interface of this machine) from a
// thread of its own. Throws InvalidInput in one line where the port cannot
// be had (in use: another run's store or another service). The destructor
// waits, up to `linger`, until every client has hung up (the other
// processes may still be finishing with the store), then stops.
class StoreServer {
 public:
  StoreServer(int port, std::chrono::milliseconds linger);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A connection to a store. The constructor retries until the server
// answers or `timeout` has passed (the server's process may start later):
// a host with no address is an InvalidInput at once, no answer within the
// time a CommTimeout (a peer that accepts and hangs up without a word is
// retried as one that did not answer), a service that answers other than
// a store does a CommError, each one line naming the endpoint. Each operation waits at most `timeout` for its
// answer; a lost connection is a CommError (the store's process is gone),
// and the client does not reconnect. Safe to use from several threads.
class StoreClient {
 public:
  StoreClient(const TcpEndpoint& at, std::chrono::milliseconds timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  bool create_once(const std::string& key, const std::vector<char>& value);  // true: this call created it
  bool has(const std::string& key);
  std::optional<std::vector<char>> read(const std::string& key);

 private:
  std::string ask(const StoreRequest& r);  // the answer's status byte and value, whole
  TcpEndpoint at_;
  std::chrono::milliseconds timeout_;
  int fd_ = -1;
  std::string broken_;  // why the connection is no longer used, once it is not
  std::mutex m_;
};

}  // namespace distopt
