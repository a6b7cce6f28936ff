// Push-sum gossip averaging (Kempe et al. 2003; SGP's PushSum), usable on
// its own: every rank holds a numerator x (floats) and a weight w (starting
// at 1). A round keeps self_weight of (x, w), sends out_weight of it to each
// out-peer of the topology's current iteration, and adds what the in-peers
// sent; x / w converges to the average of the ranks' initial x, and the
// weights, counting messages in flight, always sum to the world size.
//
// A round is split in two for overlap (OSGP): start() posts this rank's
// share and keeps its own part, finish() waits for and adds the in-peers'
// shares. mix() is both. Peers exchange one message per edge per round:
// the weight (a double) followed by the numerator (dim floats).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "distopt/comm/communicator.hpp"
#include "distopt/core/buffer.hpp"
#include "distopt/gossip/topology.hpp"

namespace distopt::gossip {

class PushSum {
 public:
  // Point-to-point tag of the gossip messages; distinct gossipers on one
  // communicator need distinct tags.
  static constexpr int kTag = 0x6055;
  // `topology` must outlive the PushSum and have the communicator's size.
  PushSum(Communicator& comm, const Topology& topology, std::size_t dim, int tag = kTag);
  // Waits for a round still in flight (its buffers are ours), unless a
  // round failed: then the send buffers are leaked, not freed under a send.
  ~PushSum();
  PushSum(const PushSum&) = delete;
  PushSum& operator=(const PushSum&) = delete;

  // One synchronous round at iteration(), which then advances.
  void mix(std::span<float> x, double& w);
  // The first half: scales (x, w) by the self weight after sending the
  // out-peers their shares. At most one round may be in flight.
  void start(std::span<float> x, double& w);
  // The second half: waits for the in-peers' shares and adds them (in
  // in-peer order, so every backend gives the same bits); the iteration
  // advances.
  void finish(std::span<float> x, double& w);
  bool in_flight() const { return in_flight_; }
  // The weight this rank has sent in the round in flight (0 when none):
  // with it, the weights of all ranks sum to the world size.
  double weight_in_flight() const { return in_flight_ ? sent_weight_ : 0.0; }
  std::uint64_t iteration() const { return iteration_; }
  // The topology iteration of the next round (several PushSums taking
  // turns on one schedule, as osgp's pipeline does).
  void set_iteration(std::uint64_t k) { iteration_ = k; }

  // A round in flight, for a checkpoint: the in-peers' shares, in in-peer
  // order, that finish() will add.
  struct Pending {
    std::uint64_t iteration = 0;
    double sent_weight = 0;
    std::vector<double> weights;              // each in-peer's weight share
    std::vector<std::vector<float>> shares;   // each in-peer's numerator share (dim floats)
  };
  // Waits for the round in flight to arrive (its sends to complete too) and
  // returns it; finish() then adds it as it would have. Every rank must
  // call it for its round in flight (its peers wait for the sends).
  Pending pending();
  // Puts back a round saved by pending() on a PushSum with none in flight
  // (a resumed run): finish() adds its shares. InvalidInput if it does not
  // fit this rank's in-peers or dimension.
  void restore(const Pending& round);

 private:
  // Waits for the round in flight's receives and sends (a failure marks
  // the gossiper failed and the round over) and lets go of the requests.
  void await_round();

  Communicator& comm_;
  const Topology& topology_;
  std::size_t dim_;
  int tag_;
  std::uint64_t iteration_ = 0;
  bool in_flight_ = false, failed_ = false;
  double sent_weight_ = 0.0;
  Peers peers_;
  std::vector<Buffer> send_, recv_;
  std::vector<std::unique_ptr<Request>> sends_, recvs_;
};

// What `distopt gossip-average` measures: each rank starts with its own
// random vector, push-sum runs `rounds` rounds, and the de-biased vectors
// x / w are compared with the exact average (computed in double).
struct AverageReport {
  double max_abs_error = 0;     // over ranks and elements, after the last round
  double weight_sum_error = 0;  // sum of the weights (none in flight) minus the world size
  std::vector<double> errors;   // max_abs_error before round 1, after round 1, ..., after the last
  std::uint64_t bytes_sent = 0;  // by this rank in the gossip rounds
};
// Collective: every rank calls it with the same arguments.
AverageReport average_random_vectors(Communicator& comm, const Topology& topology, std::uint64_t rounds,
                                     std::size_t dim, std::uint64_t seed);

}  // namespace distopt::gossip
