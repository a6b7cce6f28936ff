// Gossip topologies: who sends to whom at iteration k, as pure functions of
// (rank, world, iteration), with uniform mixing weights (docs/gossip.md has
// the graphs, their sources and their mixing rates).
//
//   exponential            1 peer per iteration at distance 2^(k mod m),
//                          m = bit_width(n - 1): SGP's default
//                          (NPeerDynamicDirectedExponentialGraph)
//   exponential-pm         1 peer per iteration from the cycle +1, -1, +2,
//                          -2, +4, ... (duplicates removed): the paper-era
//                          scripts' DynamicDirectedExponentialGraph
//   exponential-k          k peers per iteration (peers_per_iteration) from
//                          the distances j (k+1)^i, j = 1..k, in turn
//   static-exponential     every distance 2^j < n, every iteration
//   ring                   +1 and -1 every iteration
//   directed-ring          +1 every iteration
//   bipartite-exponential  1 peer per iteration from +1, -1, +3, -3, +5,
//                          ... (1 + 2^i): odd distances, so odd ranks pair
//                          with even ones (SGP's DynamicBipartiteExponential
//                          Graph, for D-PSGD and AD-PSGD); even worlds only
//   complete               every other rank every iteration
//
// Every graph here is circulant: rank i sends to i + d and receives from
// i - d for the same distances d, so in- and out-degrees are equal and the
// mixing matrix of each iteration is doubly stochastic. A distance that is
// a multiple of n (a rank's own) is skipped, and one that repeats an
// earlier peer modulo n is dropped, as SGP's phone book does.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace distopt::gossip {

// One rank's view of one iteration. Mixing is uniform: the rank keeps
// self_weight of its own value and sends out_weight of it to each out-peer;
// it receives in_weights[i] of in-peer in[i]'s value.
struct Peers {
  std::vector<int> out, in;
  double self_weight = 1.0, out_weight = 0.0;
  std::vector<double> in_weights;
};

class Topology {
 public:
  // Throws InvalidInput for an unknown name (listing the known ones), a
  // peers_per_iteration below 1 or, for a world of n ranks, one of n or
  // more, and a bipartite graph on an odd world.
  Topology(std::string_view name, int world, int peers_per_iteration = 1);

  const std::string& name() const { return name_; }
  int world() const { return world_; }
  int peers_per_iteration() const { return k_; }
  // Iterations after which the peers repeat (1 for static graphs).
  std::uint64_t period() const;
  // Whether the graph changes with the iteration.
  bool dynamic() const { return period() > 1; }
  // Active ranks start AD-PSGD's pairwise averages (odd ranks of a
  // bipartite graph); every rank is active elsewhere.
  bool passive(int rank) const { return bipartite_ && rank % 2 == 0; }

  // The peers of `rank` at iteration k.
  Peers peers(int rank, std::uint64_t k) const;
  // The distances (out-peer = rank + d mod n) used at iteration k.
  std::vector<int> distances(std::uint64_t k) const;

  // W of iteration k, row-major n x n: W[i][j] is the weight with which
  // rank i's new value takes rank j's current value (column-stochastic).
  std::vector<double> mixing_matrix(std::uint64_t k) const;
  // The consensus rate the graph predicts per iteration: the second-largest
  // eigenvalue modulus of the product of one period's mixing matrices, to
  // the power 1/period (exact for these circulant graphs, computed from the
  // discrete Fourier transform of the distances). 0 for one rank.
  double predicted_rate() const;

 private:
  std::string name_;
  int world_, k_;
  bool bipartite_ = false;
  // Static graphs: one list used every iteration. Dynamic ones: the phone
  // book of distances, k entries per iteration in turn.
  std::vector<int> book_;
  bool dynamic_ = false;
};

// The topology names --topology accepts.
std::span<const std::string_view> topology_names();

}  // namespace distopt::gossip
