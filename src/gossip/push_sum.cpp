#include "distopt/gossip/push_sum.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"

namespace distopt::gossip {

namespace {
constexpr std::size_t kHeader = sizeof(double);  // the weight, then the floats
}

PushSum::PushSum(Communicator& comm, const Topology& topology, std::size_t dim, int tag)
    : comm_(comm), topology_(topology), dim_(dim), tag_(tag) {
  if (topology.world() != comm.size())
    throw InvalidInput(str("topology ", topology.name(), " is for a world of ", topology.world(),
                           " ranks, the communicator has ", comm.size()));
}

PushSum::~PushSum() {
  if (failed_) {
    // A round failed (a peer did not answer): waiting again would only time
    // out again. Receives are cancelled with their requests; the send
    // buffers are left allocated, since a send may still be reading them.
    static std::mutex m;
    static auto* kept = new std::vector<std::vector<Buffer>>;  // reachable, for leak checkers
    std::lock_guard lock(m);
    kept->push_back(std::move(send_));
    return;
  }
  for (auto* reqs : {&sends_, &recvs_})
    for (auto& r : *reqs) try {
        if (r) r->wait();
      } catch (...) {
      }
}

void PushSum::mix(std::span<float> x, double& w) {
  start(x, w);
  finish(x, w);
}

void PushSum::start(std::span<float> x, double& w) {
  DISTOPT_CHECK(x.size() == dim_, "x has ", x.size(), " elements, the gossiper ", dim_);
  DISTOPT_CHECK(!in_flight_, "a push-sum round is already in flight");
  peers_ = topology_.peers(comm_.rank(), iteration_);
  const std::size_t bytes = kHeader + dim_ * sizeof(float);
  send_.resize(peers_.out.size());
  recv_.resize(peers_.in.size());
  sends_.clear();
  recvs_.clear();
  // Receives first, so that a backend that matches eagerly has them posted.
  for (std::size_t i = 0; i < peers_.in.size(); ++i) {
    if (recv_[i].size_bytes() != bytes) recv_[i] = Buffer(bytes, static_cast<int>(i));
    recvs_.push_back(comm_.irecv(recv_[i].data(), bytes, ElemType::u8, peers_.in[i], tag_));
  }
  const float share = static_cast<float>(peers_.out_weight);
  const double wshare = w * peers_.out_weight;
  for (std::size_t i = 0; i < peers_.out.size(); ++i) {
    if (send_[i].size_bytes() != bytes) send_[i] = Buffer(bytes, static_cast<int>(i) + 7);
    auto* msg = send_[i].as<unsigned char>();
    std::memcpy(msg, &wshare, kHeader);
    auto* xs = reinterpret_cast<float*>(msg + kHeader);
    for (std::size_t e = 0; e < dim_; ++e) xs[e] = x[e] * share;
    sends_.push_back(comm_.isend(msg, bytes, ElemType::u8, peers_.out[i], tag_));
  }
  const auto keep = static_cast<float>(peers_.self_weight);
  for (float& v : x) v *= keep;
  w *= peers_.self_weight;
  sent_weight_ = wshare * static_cast<double>(peers_.out.size());
  in_flight_ = true;
}

void PushSum::await_round() {
  DISTOPT_CHECK(in_flight_, "no push-sum round in flight");
  try {
    for (auto& r : recvs_) r->wait();
    for (auto& r : sends_) r->wait();
  } catch (...) {
    failed_ = true;
    in_flight_ = false;
    throw;
  }
  sends_.clear();
  recvs_.clear();
}

void PushSum::finish(std::span<float> x, double& w) {
  DISTOPT_CHECK(x.size() == dim_, "x has ", x.size(), " elements, the gossiper ", dim_);
  await_round();
  for (std::size_t i = 0; i < recv_.size(); ++i) {
    const auto* msg = recv_[i].as<unsigned char>();
    double win = 0;
    std::memcpy(&win, msg, kHeader);
    const auto* xs = reinterpret_cast<const float*>(msg + kHeader);
    for (std::size_t e = 0; e < dim_; ++e) x[e] += xs[e];
    w += win;
  }
  in_flight_ = false;
  ++iteration_;
}

PushSum::Pending PushSum::pending() {
  await_round();
  Pending p;
  p.iteration = iteration_;
  p.sent_weight = sent_weight_;
  for (const Buffer& b : recv_) {
    const auto* msg = b.as<unsigned char>();
    double win = 0;
    std::memcpy(&win, msg, kHeader);
    const auto* xs = reinterpret_cast<const float*>(msg + kHeader);
    p.weights.push_back(win);
    p.shares.emplace_back(xs, xs + dim_);
  }
  return p;
}

void PushSum::restore(const Pending& round) {
  DISTOPT_CHECK(!in_flight_, "a push-sum round is already in flight");
  const Peers peers = topology_.peers(comm_.rank(), round.iteration);
  if (round.weights.size() != peers.in.size() || round.shares.size() != peers.in.size())
    throw InvalidInput(str("a saved push-sum round of iteration ", round.iteration, " has ", round.shares.size(),
                           " in-peer shares; rank ", comm_.rank(), " has ", peers.in.size(), " in-peers on ",
                           topology_.name()));
  const std::size_t bytes = kHeader + dim_ * sizeof(float);
  peers_ = peers;
  recv_.resize(peers_.in.size());
  for (std::size_t i = 0; i < peers_.in.size(); ++i) {
    if (round.shares[i].size() != dim_)
      throw InvalidInput(str("a saved push-sum share has ", round.shares[i].size(), " elements, the gossiper ", dim_));
    if (recv_[i].size_bytes() != bytes) recv_[i] = Buffer(bytes, static_cast<int>(i));
    auto* msg = recv_[i].as<unsigned char>();
    std::memcpy(msg, &round.weights[i], kHeader);
    std::memcpy(msg + kHeader, round.shares[i].data(), dim_ * sizeof(float));
  }
  sends_.clear();
  recvs_.clear();
  iteration_ = round.iteration;
  sent_weight_ = round.sent_weight;
  in_flight_ = true;
}

AverageReport average_random_vectors(Communicator& comm, const Topology& topology, std::uint64_t rounds,
                                     std::size_t dim, std::uint64_t seed) {
  if (dim == 0) throw InvalidInput("--dim must be at least 1");
  // Rank r's vector: standard normal values from stream r of the seed.
  std::vector<float> x(dim);
  Rng rng(seed, static_cast<std::uint64_t>(comm.rank()));
  for (float& v : x) v = static_cast<float>(rng.normal());
  // The exact average, in double, summed in rank order.
  std::vector<double> avg(x.begin(), x.end());
  comm.all_reduce(avg.data(), avg.data(), dim, ElemType::f64, ReduceOp::sum);
  for (double& v : avg) v /= comm.size();
  double w = 1.0;
  AverageReport report;
  auto error = [&] {
    double e = 0;
    for (std::size_t i = 0; i < dim; ++i) e = std::max(e, std::abs(static_cast<double>(x[i]) / w - avg[i]));
    comm.all_reduce(&e, &e, 1, ElemType::f64, ReduceOp::max);
    return e;
  };
  report.errors.push_back(error());
  PushSum gossip(comm, topology, dim);
  for (std::uint64_t k = 0; k < rounds; ++k) {
    const std::uint64_t before = comm.bytes_sent();
    gossip.mix(x, w);
    report.bytes_sent += comm.bytes_sent() - before;  // the gossip only, not the error's reduction
    report.errors.push_back(error());
  }
  report.max_abs_error = report.errors.back();
  double total = w;
  comm.all_reduce(&total, &total, 1, ElemType::f64, ReduceOp::sum);
  report.weight_sum_error = total - comm.size();
  return report;
}

}  // namespace distopt::gossip
