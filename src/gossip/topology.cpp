#include "distopt/gossip/topology.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <complex>
#include <numeric>

#include "distopt/core/error.hpp"

namespace distopt::gossip {

namespace {

constexpr std::array<std::string_view, 8> kNames{"exponential",   "exponential-pm",        "exponential-k",
                                                 "static-exponential", "ring", "directed-ring",
                                                 "bipartite-exponential", "complete"};

std::string known() {
  std::string out;
  for (auto n : kNames) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

// Appends distance d (any sign) as a distance in [1, n) unless it is a
// rank's own or repeats one already there.
void add(std::vector<int>& book, long long d, int n) {
  const auto r = static_cast<int>(((d % n) + n) % n);
  if (r == 0 || std::find(book.begin(), book.end(), r) != book.end()) return;
  book.push_back(r);
}

// floor(log_base(x)) for x >= 1, in integers (SGP computes it in floating
// point, which misses exact powers such as log_3(243)).
int ilog(long long x, long long base) {
  int i = 0;
  for (long long p = base; p <= x; p *= base) ++i;
  return i;
}

}  // namespace

std::span<const std::string_view> topology_names() { return kNames; }

Topology::Topology(std::string_view name, int world, int peers_per_iteration)
    : name_(name), world_(world), k_(peers_per_iteration) {
  if (std::find(kNames.begin(), kNames.end(), name) == kNames.end())
    throw InvalidInput(str("unknown topology '", name, "' (known: ", known(), ")"));
  if (world < 1) throw InvalidInput(str("world size must be at least 1, got ", world));
  if (k_ < 1) throw InvalidInput(str("--peers-per-iteration must be at least 1 (got ", k_, ")"));
  if (name != "exponential-k" && k_ != 1)
    throw InvalidInput(str("--peers-per-iteration applies to topology exponential-k only (topology ", name, ")"));
  if (name == "exponential-k" && k_ >= world)
    throw InvalidInput(str("--peers-per-iteration ", k_, " needs a world of more than ", k_, " ranks (world ", world,
                           ")"));
  const int n = world;
  if (n == 1) return;  // no peers at all
  const int m = std::bit_width(static_cast<unsigned>(n - 1));  // distances 2^0 .. 2^(m-1) < n
  if (name == "exponential" || name == "exponential-k") {
    dynamic_ = true;
    const int levels = ilog(n - 1, k_ + 1) + 1;
    long long base = 1;
    for (int i = 0; i < levels; ++i, base *= k_ + 1)
      for (int j = 1; j <= k_; ++j) add(book_, j * base, n);
  } else if (name == "exponential-pm") {
    dynamic_ = true;
    for (int i = 0; i < m; ++i) {
      add(book_, 1LL << i, n);
      add(book_, -(1LL << i), n);
    }
  } else if (name == "bipartite-exponential") {
    if (n % 2 != 0)
      throw InvalidInput(str("topology bipartite-exponential needs an even world size (got ", n,
                             "): it pairs odd ranks with even ones"));
    bipartite_ = true;
    dynamic_ = true;
    for (int i = 0; i < m; ++i) {
      const long long d = i == 0 ? 1 : 1 + (1LL << i);
      add(book_, d, n);
      add(book_, -d, n);
    }
  } else if (name == "static-exponential") {
    for (int i = 0; i < m; ++i) add(book_, 1LL << i, n);
  } else if (name == "ring") {
    add(book_, 1, n);
    add(book_, -1, n);
  } else if (name == "directed-ring") {
    add(book_, 1, n);
  } else {  // complete
    for (int d = 1; d < n; ++d) add(book_, d, n);
  }
}

std::uint64_t Topology::period() const {
  if (!dynamic_ || book_.empty()) return 1;
  const auto len = static_cast<std::uint64_t>(book_.size());
  return len / std::gcd(len, static_cast<std::uint64_t>(k_));
}

std::vector<int> Topology::distances(std::uint64_t k) const {
  if (!dynamic_) return book_;
  std::vector<int> out;
  const std::uint64_t len = book_.size();
  // SGP's group indices: k_ consecutive entries, advanced by k_ per iteration.
  for (int j = 0; j < k_ && len > 0; ++j) out.push_back(book_[(j + (k % len) * static_cast<std::uint64_t>(k_)) % len]);
  return out;
}

Peers Topology::peers(int rank, std::uint64_t k) const {
  Peers p;
  const std::vector<int> ds = distances(k);
  const double w = 1.0 / static_cast<double>(ds.size() + 1);
  p.self_weight = w;
  p.out_weight = ds.empty() ? 0.0 : w;
  for (int d : ds) {
    p.out.push_back((rank + d) % world_);
    p.in.push_back((rank - d + world_) % world_);
    p.in_weights.push_back(w);  // circulant: every sender has the same degree
  }
  return p;
}

std::vector<double> Topology::mixing_matrix(std::uint64_t k) const {
  const auto n = static_cast<std::size_t>(world_);
  std::vector<double> w(n * n, 0.0);
  for (int j = 0; j < world_; ++j) {
    const Peers p = peers(j, k);
    w[j * n + j] += p.self_weight;
    for (int to : p.out) w[static_cast<std::size_t>(to) * n + j] += p.out_weight;
  }
  return w;
}

double Topology::predicted_rate() const {
  if (world_ == 1) return 0.0;
  const double pi = std::acos(-1.0);
  const std::uint64_t t = period();
  double worst = 0.0;
  for (int f = 1; f < world_; ++f) {
    double modulus = 1.0;
    for (std::uint64_t k = 0; k < t; ++k) {
      const std::vector<int> ds = distances(k);
      const double w = 1.0 / static_cast<double>(ds.size() + 1);
      std::complex<double> lambda = w;
      for (int d : ds) lambda += w * std::polar(1.0, -2.0 * pi * f * d / world_);
      modulus *= std::abs(lambda);
    }
    worst = std::max(worst, modulus);
  }
  // Exact averaging in one period (a product of 0 in exact arithmetic):
  // what is left is rounding of the order of 1e-16.
  if (worst < 1e-12) return 0.0;
  return std::pow(worst, 1.0 / static_cast<double>(t));
}

}  // namespace distopt::gossip
