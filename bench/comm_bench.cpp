// Collectives benchmark in the style of nccl-tests: per collective and size,
// time per operation, algbw = size / time and busbw = algbw x factor, where
// factor = 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter and
// all_gather, 1 for broadcast, so figures compare across world sizes.
// "size" is the full buffer: all_reduce's and broadcast's buffer,
// reduce_scatter's input, all_gather's output. #wrong counts elements that
// differ from the closed-form result in a checked run after the timed ones.
//
// The peer measured in the same run, per size: under MPI the raw MPI
// primitive on the same buffers; under threads the machine's copy bandwidth
// at that size -- every rank's thread memcpy-ing `size` bytes between the
// same two buffers at once (glibc's memcpy, which switches to non-temporal
// stores for large sizes).
#include "distopt/bench/comm_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "distopt/comm/threads.hpp"
#include "distopt/core/buffer.hpp"

namespace distopt::bench {

namespace {

using Clock = std::chrono::steady_clock;

const char* name_of(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::broadcast: return "broadcast";
  }
  return "?";
}

double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::all_reduce: return 2.0 * (n - 1) / n;
    case Collective::reduce_scatter:
    case Collective::all_gather: return static_cast<double>(n - 1) / n;
    case Collective::broadcast: return 1.0;
  }
  return 1.0;
}

std::vector<Collective> parse_collectives(const std::vector<std::string>& names) {
  const std::vector<Collective> all = {Collective::all_reduce, Collective::reduce_scatter, Collective::all_gather,
                                       Collective::broadcast};
  if (names.empty()) return all;
  std::vector<Collective> out;
  for (const auto& s : names) {
    auto it = std::find_if(all.begin(), all.end(), [&](Collective c) { return s == name_of(c); });
    if (it == all.end())
      throw InvalidInput(str("unknown collective '", s, "' (known: all_reduce, reduce_scatter, all_gather, broadcast)"));
    out.push_back(*it);
  }
  return out;
}

void run_op(Communicator& comm, Collective c, const float* send, float* recv, std::size_t total) {
  const std::size_t per = total / comm.size();
  switch (c) {
    case Collective::all_reduce: return comm.all_reduce(send, recv, total, ElemType::f32, ReduceOp::sum);
    case Collective::reduce_scatter: return comm.reduce_scatter(send, recv, per, ElemType::f32, ReduceOp::sum);
    case Collective::all_gather: return comm.all_gather(send, recv, per, ElemType::f32);
    case Collective::broadcast: return comm.broadcast(recv, total, ElemType::f32, 0);
  }
}

// In place, as nccl-tests' second column: all_reduce on one buffer,
// reduce_scatter leaving the rank's piece where it lies, all_gather with the
// rank's piece already in place (what sharded training does).
void run_op_in_place(Communicator& comm, Collective c, float* buf, std::size_t total) {
  const std::size_t per = total / comm.size();
  float* mine = buf + comm.rank() * per;
  switch (c) {
    case Collective::all_reduce: return comm.all_reduce(buf, buf, total, ElemType::f32, ReduceOp::sum);
    case Collective::reduce_scatter: return comm.reduce_scatter(buf, mine, per, ElemType::f32, ReduceOp::sum);
    case Collective::all_gather: return comm.all_gather_v(mine, buf, std::vector<std::size_t>(comm.size(), per), ElemType::f32);
    case Collective::broadcast: return comm.broadcast(buf, total, ElemType::f32, 0);
  }
}

int iterations(std::size_t bytes) {
  return static_cast<int>(std::clamp<std::size_t>((std::size_t{1} << 28) / std::max<std::size_t>(bytes, 1), 2, 100));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

float value(int rank, std::size_t i) { return static_cast<float>((rank + 1) * (i % 7 + 1)); }

// Elements that differ from the closed form, summed over ranks.
long check(Communicator& comm, Collective c, float* send, float* recv, std::size_t total) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t per = total / n;
  const std::size_t send_count = c == Collective::all_gather ? per : total;
  for (std::size_t i = 0; i < send_count; ++i) send[i] = value(r, i);
  if (c == Collective::broadcast)
    for (std::size_t i = 0; i < total; ++i) recv[i] = value(r, i);
  run_op(comm, c, send, recv, total);
  long wrong = 0;
  const float k = static_cast<float>(n * (n + 1) / 2);
  switch (c) {
    case Collective::all_reduce:
      for (std::size_t i = 0; i < total; ++i) wrong += recv[i] != k * (i % 7 + 1);
      break;
    case Collective::reduce_scatter:
      for (std::size_t i = 0; i < per; ++i) wrong += recv[i] != k * ((r * per + i) % 7 + 1);
      break;
    case Collective::all_gather:
      for (std::size_t i = 0; i < per * n; ++i) wrong += recv[i] != value(static_cast<int>(i / per), i % per);
      break;
    case Collective::broadcast:
      for (std::size_t i = 0; i < total; ++i) wrong += recv[i] != value(0, i);
      break;
  }
  std::int64_t w = wrong;
  comm.all_reduce(&w, &w, 1, ElemType::i64, ReduceOp::sum);
  return static_cast<long>(w);
}

template <class Op>
double seconds_per_op(Communicator& comm, int iters, Op op) {
  op();  // warm-up
  comm.barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  comm.barrier();
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

struct Row {
  Collective c;
  std::size_t bytes;
  double us, algbw, busbw;
  double inplace_busbw;
  double raw_busbw;  // the backend's primitive (NaN under threads)
  double copy_gbps;  // memcpy of `bytes` per rank, all ranks at once (NaN under MPI)
  long wrong;
};

std::vector<Row> sweep(Communicator& comm, RawCollectives* raw, const CommBenchOptions& o) {
  const int n = comm.size();
  const std::size_t max_floats = o.max_bytes / 4;
  Buffer send_buf(max_floats * 4, 0), recv_buf(max_floats * 4, 1);
  float* send = send_buf.as<float>();
  float* recv = recv_buf.as<float>();
  for (std::size_t i = 0; i < max_floats; ++i) send[i] = 1.0f;
  std::vector<Row> rows;
  for (Collective c : parse_collectives(o.collectives)) {
    for (std::size_t size = o.min_bytes; size <= o.max_bytes; size *= 2) {
      // Round down to whole float pieces per rank, as nccl-tests does.
      const std::size_t total = size / 4 / n * n;
      if (total == 0) continue;
      const std::size_t bytes = total * 4;
      // Rounds (default 5), each timing ours, the peer and ours in place
      // back to back; medians keep a shared machine's drift out of the
      // ratios (with 3 rounds, one slow round of two could move a
      // 2-rank MPI broadcast cell from 1.0 to 0.86).
      const int iters = iterations(bytes);
      std::vector<double> t_ours, t_peer, t_in_place;
      for (int round = 0; round < o.rounds; ++round) {
        t_ours.push_back(seconds_per_op(comm, iters, [&] { run_op(comm, c, send, recv, total); }));
        if (raw) t_peer.push_back(seconds_per_op(comm, iters, [&] { raw->run(c, send, recv, total); }));
        else t_peer.push_back(seconds_per_op(comm, iters, [&] { std::memcpy(recv, send, bytes); }));
        t_in_place.push_back(seconds_per_op(comm, iters, [&] { run_op_in_place(comm, c, recv, total); }));
      }
      const double t = median(t_ours), tp = median(t_peer), tip = median(t_in_place);
      const double raw_busbw = raw ? bytes / tp / 1e9 * bus_factor(c, n) : NAN;
      const double copy_gbps = raw ? NAN : bytes / tp / 1e9;
      const long wrong = check(comm, c, send, recv, total);
      for (std::size_t i = 0; i < max_floats; ++i) send[i] = 1.0f;
      const double algbw = bytes / t / 1e9;
      rows.push_back({c, bytes, t * 1e6, algbw, algbw * bus_factor(c, n), bytes / tip / 1e9 * bus_factor(c, n), raw_busbw,
                      copy_gbps, wrong});
    }
  }
  return rows;
}

std::string human(std::size_t bytes) {
  if (bytes >= (1u << 20)) return str(bytes >> 20, " MiB");
  return str(bytes >> 10, " KiB");
}

int report(const std::vector<Row>& rows, const std::string& backend, int n, const std::string& peer, bool json) {
  FILE* table = json ? stderr : stdout;
  std::fprintf(table, "# distopt bench comm: backend %s, %d ranks, float32 sum; ratio = busbw / %s\n", backend.c_str(),
               n, peer.c_str());
  Collective last = Collective::broadcast;
  bool first = true;
  for (const Row& r : rows) {
    if (first || r.c != last) {
      std::fprintf(table, "\n# %s (GB/s)\n%10s %12s %10s %10s %8s %10s %8s %14s %7s\n", name_of(r.c), "size", "time (us)",
                   "algbw", "busbw", "ratio", "in-place", "ratio", peer.c_str(), "#wrong");
      first = false;
      last = r.c;
    }
    const double ref = std::isnan(r.raw_busbw) ? r.copy_gbps : r.raw_busbw;
    std::fprintf(table, "%10s %12.1f %10.2f %10.2f %8.3f %10.2f %8.3f %14.2f %7ld\n", human(r.bytes).c_str(), r.us, r.algbw,
                 r.busbw, r.busbw / ref, r.inplace_busbw, r.inplace_busbw / ref, ref, r.wrong);
  }
  if (json) {
    std::string out = "{\"backend\": \"" + backend + "\", \"world\": " + std::to_string(n);
    out += ", \"results\": [";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      char buf[512];
      std::snprintf(buf, sizeof(buf),
                    "%s{\"backend\": \"%s\", \"collective\": \"%s\", \"bytes\": %zu, \"time_us\": %.2f, "
                    "\"algbw_gbps\": %.3f, \"busbw_gbps\": %.3f, \"inplace_busbw_gbps\": %.3f, \"raw_busbw_gbps\": %s, \"copy_gbps\": %s, "
                    "\"wrong\": %ld}",
                    i ? ", " : "", backend.c_str(), name_of(r.c), r.bytes, r.us, r.algbw, r.busbw, r.inplace_busbw,
                    std::isnan(r.raw_busbw) ? "null" : str(r.raw_busbw).c_str(),
                    std::isnan(r.copy_gbps) ? "null" : str(r.copy_gbps).c_str(), r.wrong);
      out += buf;
    }
    std::printf("%s]}\n", out.c_str());
  }
  long wrong = 0;
  for (const Row& r : rows) wrong += r.wrong;
  return wrong == 0 ? 0 : 1;
}

void validate(const CommBenchOptions& o) {
  if (o.min_bytes < 4 || o.max_bytes < o.min_bytes)
    throw InvalidInput(str("invalid size range ", o.min_bytes, "..", o.max_bytes, " bytes"));
  (void)parse_collectives(o.collectives);
}

}  // namespace

int run_comm_bench(Communicator& comm, RawCollectives* raw, const CommBenchOptions& o) {
  validate(o);
  const auto rows = sweep(comm, raw, o);
  if (comm.rank() != 0) return 0;
  return report(rows, std::string(comm.backend()), comm.size(), raw ? raw->name() : "copy GB/s", o.json);
}

int run_comm_bench_threads(const CommBenchOptions& o) {
  validate(o);
  if (o.world < 1 || o.world > 64) throw InvalidInput(str("--world must be between 1 and 64, got ", o.world));
  std::vector<Row> rows;
  spawn(o.world, [&](Communicator& comm) {
    auto result = sweep(comm, nullptr, o);
    if (comm.rank() == 0) rows = std::move(result);
  });
  return report(rows, "threads", o.world, "copy GB/s", o.json);
}

}  // namespace distopt::bench
