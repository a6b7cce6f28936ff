// The engine's compressed reductions (engine.hpp; docs/sharding.md): int8
// with error feedback, PowerSGD's factors, and 1-bit Adam's sign packets and
// moment. What they share with the plain wire (the buckets in flight, the
// delivery into the gradients) is in engine.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "distopt/core/error.hpp"
#include "engine.hpp"
#include "int8_wire.hpp"
#include "onebit_wire.hpp"

namespace distopt::parallel::detail {

void Engine::reduce_int8(InFlight& f, std::size_t b, const char* g) {
  const auto& bucket = layout_.buckets()[b];
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  std::size_t bytes = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) bytes += n * int8_packet_bytes(layout_.units()[u].shard);
  Held out(grad_pool_, bytes, 8), in(grad_pool_, bytes, 9);
  const auto* grad = reinterpret_cast<const float*>(g);
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  std::size_t at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = int8_packet_bytes(unit.shard), local = unit.padded_offset - bucket.padded_offset;
    for (std::size_t d = 0; d < n; ++d)
      int8_pack(grad + local + d * unit.shard, residual + unit.padded_offset + d * unit.shard, unit.shard,
                out.bytes() + at + d * packet);
    f.requests.push_back(comm_.iall_to_all(out.bytes() + at, in.bytes() + at, packet, ElemType::u8));
    at += n * packet;
  }
  f.scratch = std::move(out);  // zero2/3: their fp32 scratch goes back to the pool
  f.received = std::move(in);
  f.then = [this, b, received = f.received.bytes()] { land_int8(b, received); };
}

void Engine::land_int8(std::size_t b, const char* received) {
  const auto& bucket = layout_.buckets()[b];
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  auto* grads = reinterpret_cast<float*>(grads_.bytes());
  std::size_t at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = int8_packet_bytes(unit.shard);
    float* sum = grads + own_grad_offset(unit);
    for (std::size_t s = 0; s < n; ++s) int8_unpack(received + at + s * packet, unit.shard, sum, s > 0);
    at += n * packet;
  }
  if (!info_.replicated_params) return;
  // ddp: the owners' sums back to every rank, as int8 with their own feedback.
  Held out(grad_pool_, at / n, 8), in(grad_pool_, at, 9);
  auto* residual = reinterpret_cast<float*>(sum_residual_.bytes());
  std::vector<std::unique_ptr<Request>> gathers;
  at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = int8_packet_bytes(unit.shard);
    int8_pack(grads + unit.padded_offset + rank_ * unit.shard, residual + unit.shard_offset, unit.shard,
              out.bytes() + at / n);
    gathers.push_back(comm_.iall_gather(out.bytes() + at / n, in.bytes() + at, packet, ElemType::u8));
    at += n * packet;
  }
  try {
    at = 0;
    for (std::size_t u = bucket.first; u < bucket.last; ++u) {
      finish(gathers[u - bucket.first]);
      const auto& unit = layout_.units()[u];
      const std::size_t packet = int8_packet_bytes(unit.shard);
      for (std::size_t s = 0; s < n; ++s)
        int8_unpack(in.bytes() + at + s * packet, unit.shard, grads + unit.padded_offset + s * unit.shard, false);
      at += n * packet;
    }
  } catch (...) {
    for (auto& r : gathers) finish_quietly(r);  // before their buffers go
    throw;
  }
}

void Engine::reduce_powersgd(InFlight& f, std::size_t b, const char* g) {
  const PowerSgd::Bucket& plan = powersgd_->bucket(b);
  const std::size_t first = layout_.buckets()[b].padded_offset;
  const auto* grad = reinterpret_cast<const float*>(g);
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  float* q = powersgd_->qs().data();
  const std::size_t count = plan.whole_elements + plan.p_elements;
  Held sent(grad_pool_, std::max<std::size_t>(count, 1) * sizeof(float), 8);
  auto* reduced = reinterpret_cast<float*>(sent.bytes());
  float *whole = reduced, *p = reduced + plan.whole_elements;
  for (const PowerSgd::Matrix& m : plan.matrices) {
    const std::size_t at = layout_.padded_offset(m.param), n = m.rows * m.cols;
    const float* from = grad + (at - first);
    if (m.rank == 0) {
      whole = std::copy_n(from, n, whole);
      continue;
    }
    float* mat = residual + at;  // M = g + e, kept where e was until the residual is known
    for (std::size_t i = 0; i < n; ++i) mat[i] = from[i] + mat[i];
    orthogonalize(q + m.q_at, m.cols, m.rank);
    times(mat, q + m.q_at, p, m.rows, m.cols, m.rank);
    p += m.rows * m.rank;
  }
  f.requests.push_back(comm_.iall_reduce(reduced, reduced, count, ElemType::f32, ReduceOp::sum));
  f.scratch = std::move(sent);  // zero2/3: their fp32 scratch goes back to the pool
  f.then = [this, b, reduced] { land_powersgd(b, reduced); };
}

void Engine::land_powersgd(std::size_t b, float* reduced) {
  const PowerSgd::Bucket& plan = powersgd_->bucket(b);
  const auto& bucket = layout_.buckets()[b];
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  float* q = powersgd_->qs().data();
  Held factors(grad_pool_, std::max<std::size_t>(plan.q_elements, 1) * sizeof(float), 9);
  auto* qs = reinterpret_cast<float*>(factors.bytes());
  float *p = reduced + plan.whole_elements, *qk = qs;
  for (const PowerSgd::Matrix& m : plan.matrices) {
    if (m.rank == 0) continue;
    orthogonalize(p, m.rows, m.rank);  // the ranks' sum: the same on every rank
    transposed_times(residual + layout_.padded_offset(m.param), p, qk, m.rows, m.cols, m.rank);
    p += m.rows * m.rank;
    qk += m.cols * m.rank;
  }
  comm_.all_reduce(qs, qs, plan.q_elements, ElemType::f32, ReduceOp::sum);
  Held out(grad_pool_, bucket.padded * sizeof(float), 10);
  auto* sum = reinterpret_cast<float*>(out.bytes());
  std::fill_n(sum, bucket.padded, 0.0f);
  const auto n = static_cast<float>(comm_.size());
  const float* whole = reduced;
  p = reduced + plan.whole_elements;
  qk = qs;
  for (const PowerSgd::Matrix& m : plan.matrices) {
    const std::size_t at = layout_.padded_offset(m.param), count = m.rows * m.cols;
    float* to = sum + (at - bucket.padded_offset);
    if (m.rank == 0) {
      std::copy_n(whole, count, to);
      whole += count;
      continue;
    }
    outer(p, qk, to, m.rows, m.cols, m.rank);
    // What this rank still owes, and the next step's warm start. A
    // non-finite gradient (the step will not be taken) must not stay in
    // either: its residual is dropped, and Q -- the ranks' sum, so every
    // rank decides alike -- keeps its last finite value.
    float* mat = residual + at;
    bool finite = true;
    for (std::size_t i = 0; i < count; ++i) {
      mat[i] = mat[i] - to[i] / n;
      finite = finite && std::fabs(mat[i]) <= std::numeric_limits<float>::max();
    }
    if (!finite) std::fill_n(mat, count, 0.0f);
    const std::size_t qn = m.cols * m.rank;
    if (std::all_of(qk, qk + qn, [](float x) { return std::isfinite(x); })) std::copy_n(qk, qn, q + m.q_at);
    p += m.rows * m.rank;
    qk += m.cols * m.rank;
  }
  deliver(b, sum);
}

void Engine::zero_gaps(std::size_t u, std::size_t lo, std::size_t hi, float* at) const {
  for (const auto& [begin, end] : gaps_[u]) {
    const std::size_t from = std::max(begin, lo), to = std::min(end, hi);
    if (from < to) std::fill(at + (from - lo), at + (to - lo), 0.0f);
  }
}

namespace {
// Zeroes what 1-bit Adam holds (denominator inf) among n values.
void zero_held(float* at, const float* denominator, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (std::isinf(denominator[i])) at[i] = 0.0f;
}
}  // namespace

void Engine::gather_moment() {
  auto* m = reinterpret_cast<float*>(moment_.bytes());
  auto* d = reinterpret_cast<float*>(denominator_.bytes());
  std::fill_n(m, layout_.padded_elements(), 0.0f);
  std::fill_n(d, layout_.padded_elements(), 1.0f);
  const std::vector<ShardLayout::Piece> pieces = layout_.pieces(comm_.rank());
  RuleBlob parsed;
  for (std::size_t i = 0; i < optimizer_->num_params(); ++i) {
    if (!optimizer_->has_state(i)) continue;
    const std::size_t g = param_group_[i];
    const MomentForm& form = *optimizer_->rule_of_group(g).moment;
    optimizer_->rule_of_group(g).parse(optimizer_->group(g).options, parsed);
    const std::size_t at = info_.replicated_params ? layout_.padded_offset(i) : pieces[i].padded_offset;
    const std::span<const float> moment = optimizer_->state_tensor(i, form.state);
    const std::span<const float> variance = optimizer_->state_tensor(i, form.variance(parsed));
    std::copy(moment.begin(), moment.end(), m + at);
    form.denominator(parsed, variance.data(), onebit_warmup_, d + at, variance.size());
    // Elements whose gradient was 0 all through the warm-up are held
    // (DeepSpeed's momentum mask, found from v): inf, so their share is 0.
    for (std::size_t k = 0; k < variance.size(); ++k)
      if (variance[k] == 0.0f) d[at + k] = std::numeric_limits<float>::infinity();
  }
  if (!info_.replicated_params)
    for (const auto& unit : layout_.units()) {
      float* at = m + unit.padded_offset;
      comm_.all_gather(at + rank_ * unit.shard, at, unit.shard, ElemType::f32);
      at = d + unit.padded_offset;
      comm_.all_gather(at + rank_ * unit.shard, at, unit.shard, ElemType::f32);
    }
  moment_known_ = true;
  moment_loads_ = optimizer_->state_loads();
}

void Engine::reduce_onebit(InFlight& f, std::size_t b, const char* g) {
  blocked([&] {
    finish_param_reads();  // L2 decay reads the parameters
    if (!moment_known_ || moment_loads_ != optimizer_->state_loads()) gather_moment();
  });
  const auto& bucket = layout_.buckets()[b];
  const auto& params = layout_.params();
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  const auto world = static_cast<float>(n);
  // Each rank's share of the averaged moment: the rule's moment advanced
  // with the rank's own gradient (n times its part of the mean), over n.
  Held shares(grad_pool_, bucket.padded * sizeof(float), 12);
  auto* x = reinterpret_cast<float*>(shares.bytes());
  std::fill_n(x, bucket.padded, 0.0f);
  const auto* grad = reinterpret_cast<const float*>(g);
  const auto* values = reinterpret_cast<const float*>(params_.bytes());
  const auto* moment = reinterpret_cast<const float*>(moment_.bytes());
  RuleBlob parsed;
  for (std::size_t p = 0; p < params.size(); ++p) {
    const std::size_t u = layout_.unit_of(p);
    if (u < bucket.first || u >= bucket.last) continue;
    const std::size_t at = layout_.padded_offset(p), count = params[p].numel();
    float* share = x + (at - bucket.padded_offset);
    const float* mine = grad + (at - bucket.padded_offset);
    for (std::size_t i = 0; i < count; ++i) share[i] = mine[i] * world;
    const std::size_t group = param_group_[p];
    const RuleInfo& rule = optimizer_->rule_of_group(group);
    rule.parse(optimizer_->group(group).options, parsed);
    rule.moment->local(parsed, moment + at, share, values + at, share, count);
    const float* d = reinterpret_cast<const float*>(denominator_.bytes()) + at;
    for (std::size_t i = 0; i < count; ++i) share[i] = share[i] / d[i] / world;
  }
  std::size_t bytes = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) bytes += n * onebit_packet_bytes(layout_.units()[u].shard);
  Held out(grad_pool_, bytes, 8), in(grad_pool_, bytes, 9);
  auto* residual = reinterpret_cast<float*>(residual_.bytes());
  const auto* denominator = reinterpret_cast<const float*>(denominator_.bytes());
  std::size_t at = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = onebit_packet_bytes(unit.shard), local = unit.padded_offset - bucket.padded_offset;
    for (std::size_t d = 0; d < n; ++d)
      onebit_pack(x + local + d * unit.shard, residual + unit.padded_offset + d * unit.shard, unit.shard,
                  out.bytes() + at + d * packet);
    zero_gaps(u, 0, unit.padded, residual + unit.padded_offset);  // no parameter there owes anything
    zero_held(residual + unit.padded_offset, denominator + unit.padded_offset, unit.padded);
    f.requests.push_back(comm_.iall_to_all(out.bytes() + at, in.bytes() + at, packet, ElemType::u8));
    at += n * packet;
  }
  f.scratch = std::move(out);  // zero2: its fp32 scratch goes back to the pool
  f.received = std::move(in);
  f.then = [this, b, received = f.received.bytes()] { land_onebit(b, received); };
}

void Engine::land_onebit(std::size_t b, const char* received) {
  const auto& bucket = layout_.buckets()[b];
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  std::size_t bytes = 0, elements = 0;
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    bytes += onebit_packet_bytes(layout_.units()[u].shard);
    elements += layout_.units()[u].shard;
  }
  Held sums(grad_pool_, elements * sizeof(float), 12), out(grad_pool_, bytes, 8), in(grad_pool_, n * bytes, 9);
  auto* server = reinterpret_cast<float*>(sum_residual_.bytes());
  const auto* denominator = reinterpret_cast<const float*>(denominator_.bytes());
  std::vector<std::unique_ptr<Request>> gathers;
  // The owners: the shares summed in rank order, packed again with their
  // own residual, and gathered by every rank.
  std::size_t at = 0, o = 0;
  auto* acc = reinterpret_cast<float*>(sums.bytes());
  for (std::size_t u = bucket.first; u < bucket.last; ++u) {
    const auto& unit = layout_.units()[u];
    const std::size_t packet = onebit_packet_bytes(unit.shard), lo = rank_ * unit.shard, hi = lo + unit.shard;
    for (std::size_t s = 0; s < n; ++s) onebit_unpack(received + at + s * packet, unit.shard, acc, s > 0);
    const float* held = denominator + unit.padded_offset + lo;
    zero_gaps(u, lo, hi, acc);
    zero_held(acc, held, unit.shard);
    onebit_pack(acc, server + unit.shard_offset, unit.shard, out.bytes() + o);
    zero_gaps(u, lo, hi, server + unit.shard_offset);
    zero_held(server + unit.shard_offset, held, unit.shard);
    gathers.push_back(comm_.iall_gather(out.bytes() + o, in.bytes() + at, packet, ElemType::u8));
    acc += unit.shard;
    at += n * packet;
    o += packet;
  }
  auto* moment = reinterpret_cast<float*>(moment_.bytes());
  try {
    at = 0;
    for (std::size_t u = bucket.first; u < bucket.last; ++u) {
      finish(gathers[u - bucket.first]);
      const auto& unit = layout_.units()[u];
      const std::size_t packet = onebit_packet_bytes(unit.shard);
      float* m = moment + unit.padded_offset;
      for (std::size_t s = 0; s < n; ++s)
        onebit_unpack(in.bytes() + at + s * packet, unit.shard, m + s * unit.shard, false);
      zero_gaps(u, 0, unit.padded, m);
      const float* d = denominator + unit.padded_offset;
      for (std::size_t i = 0; i < unit.padded; ++i) m[i] = std::isinf(d[i]) ? 0.0f : m[i] * d[i];  // the moment again
      at += n * packet;
    }
  } catch (...) {
    for (auto& r : gathers) finish_quietly(r);  // before their buffers go
    throw;
  }
  deliver(b, moment + bucket.padded_offset);
}

}  // namespace distopt::parallel::detail
