// MPI backend checks, run under `mpiexec -n N` (N = 2, 3, 4 in CTest).
// Every rank runs every check; failures are summed over ranks and rank 0
// prints "mpi comm (N ranks): P passed, F failed". Exit status 1 on any
// failure.
//
// --scenario throw|kill|stall makes rank 1 fail (throw an exception, die by
// SIGKILL, or stop answering) after one collective, for
// tests/mpi_failure_test.sh, which checks that the job ends with a clear
// error within the time-out.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "comm_values.hpp"
#include "distopt/comm/mpi.hpp"
#include "distopt/comm/threads.hpp"

using namespace distopt;
using namespace distopt::testing;

namespace {

struct Checks {
  int rank;
  long passed = 0, failed = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) {
      ++passed;
      return;
    }
    ++failed;
    std::fprintf(stderr, "FAIL (rank %d): %s\n", rank, what.c_str());
  }
};

void closed_form(Communicator& c, Checks& k) {
  const int n = c.size();
  for (ElemType t : all_types())
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, (std::size_t{1} << 20) + 3}) {
      if (count > 100000 && !(t == ElemType::f32 || t == ElemType::bf16 || t == ElemType::i64)) continue;
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        if (op == ReduceOp::avg && !is_floating(t)) continue;
        for (bool in_place : {false, true}) {
          auto send = filled(t, count, c.rank());
          std::vector<unsigned char> out(count * size_of(t) + 1);
          void* recv = in_place ? send.data() : out.data();
          c.all_reduce(send.data(), recv, count, t, op);
          std::size_t bad = 0;
          for (std::size_t i = 0; i < count; ++i) bad += get(t, recv, i) != expected(op, n, i);
          k.expect(bad == 0, str("all_reduce ", name_of(t), " ", name_of(op), " count ", count, in_place ? " in place" : "",
                                 ": ", bad, " wrong"));
        }
      }
      // reduce_scatter / all_gather / broadcast on the same type.
      const std::size_t per = count / 16 + 1;
      auto send = filled(t, per * n, c.rank());
      std::vector<unsigned char> piece(per * size_of(t) + 1), all(per * n * size_of(t) + 1);
      c.reduce_scatter(send.data(), piece.data(), per, t, ReduceOp::sum);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < per; ++i) bad += get(t, piece.data(), i) != expected(ReduceOp::sum, n, c.rank() * per + i);
      k.expect(bad == 0, str("reduce_scatter ", name_of(t), " per ", per));
      auto mine = filled(t, per, c.rank());
      c.all_gather(mine.data(), all.data(), per, t);
      bad = 0;
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < per; ++i) bad += get(t, all.data(), r * per + i) != value(r, i);
      k.expect(bad == 0, str("all_gather ", name_of(t), " per ", per));
      // In place: the rank's piece of the input receives the reduction, and
      // the own piece of the output is the gather's send buffer.
      auto inplace = filled(t, per * n, c.rank());
      char* own = reinterpret_cast<char*>(inplace.data()) + c.rank() * per * size_of(t);
      c.reduce_scatter(inplace.data(), own, per, t, ReduceOp::sum);
      bad = 0;
      for (std::size_t i = 0; i < per; ++i) bad += get(t, own, i) != expected(ReduceOp::sum, n, c.rank() * per + i);
      k.expect(bad == 0, str("reduce_scatter in place ", name_of(t), " per ", per));
      c.all_gather(own, inplace.data(), per, t);
      bad = 0;
      for (std::size_t i = 0; i < per * n; ++i) bad += get(t, inplace.data(), i) != expected(ReduceOp::sum, n, i);
      k.expect(bad == 0, str("all_gather in place ", name_of(t), " per ", per));
      for (int root = 0; root < n; ++root) {
        auto buf = filled(t, per, c.rank());
        c.broadcast(buf.data(), per, t, root);
        bad = 0;
        for (std::size_t i = 0; i < per; ++i) bad += get(t, buf.data(), i) != value(root, i);
        k.expect(bad == 0, str("broadcast ", name_of(t), " root ", root));
      }
    }
}

// all_to_all: rank s's piece d lands as rank d's piece s.
void all_to_all(Communicator& c, Checks& k) {
  const int n = c.size();
  for (std::size_t per : {std::size_t{1}, std::size_t{70001}}) {
    std::vector<std::uint8_t> send(per * n), recv(per * n);
    for (int d = 0; d < n; ++d)
      for (std::size_t i = 0; i < per; ++i) send[d * per + i] = std::uint8_t(31 * c.rank() + 7 * d + i);
    c.all_to_all(send.data(), recv.data(), per, ElemType::u8);
    std::size_t bad = 0;
    for (int s = 0; s < n; ++s)
      for (std::size_t i = 0; i < per; ++i) bad += recv[s * per + i] != std::uint8_t(31 * s + 7 * c.rank() + i);
    k.expect(bad == 0, str("all_to_all per ", per));
  }
}

// all_reduce of noisy() inputs on an in-process threads world of n ranks.
std::vector<float> threads_all_reduce(int n, std::size_t count) {
  std::vector<float> result(count);
  spawn(n, [&](Communicator& t) {
    const auto in = noisy(count, t.rank());
    std::vector<float> out(count);
    t.all_reduce(in.data(), out.data(), count, ElemType::f32, ReduceOp::sum);
    if (t.rank() == 0) result = out;
  });
  return result;
}

// Determinism: (a) all_reduce == all_gather(reduce_scatter) bitwise;
// (b) the MPI result is bitwise the threads backend's on the same inputs.
void determinism(Communicator& c, Checks& k) {
  const int n = c.size();
  for (std::size_t per : {std::size_t{7}, std::size_t{100003}}) {
    const std::size_t count = per * n;
    const auto mine = noisy(count, c.rank());
    std::vector<float> a(count), piece(per), b(count);
    c.all_reduce(mine.data(), a.data(), count, ElemType::f32, ReduceOp::sum);
    c.reduce_scatter(mine.data(), piece.data(), per, ElemType::f32, ReduceOp::sum);
    c.all_gather(piece.data(), b.data(), per, ElemType::f32);
    k.expect(std::memcmp(a.data(), b.data(), count * 4) == 0, str("(a) all_reduce != all_gather(reduce_scatter), count ", count));
    std::vector<float> threads_result = threads_all_reduce(n, count);
    k.expect(std::memcmp(a.data(), threads_result.data(), count * 4) == 0,
             str("(b) mpi all_reduce differs from threads all_reduce, count ", count));
    // Uneven count: all_reduce pieces of different sizes, same comparison.
    const std::size_t odd = count + 3;
    const auto mine_odd = noisy(odd, c.rank());
    std::vector<float> c_odd(odd);
    c.all_reduce(mine_odd.data(), c_odd.data(), odd, ElemType::f32, ReduceOp::sum);
    threads_result = threads_all_reduce(n, odd);
    k.expect(std::memcmp(c_odd.data(), threads_result.data(), odd * 4) == 0,
             str("(b) uneven count ", odd, ": mpi differs from threads"));
  }
}

void point_to_point(Communicator& c, Checks& k) {
  const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  std::int64_t tagged = 1000 + c.rank(), plain[2] = {c.rank(), 7}, in[2] = {-1, -1}, in_tagged = -1;
  auto s1 = c.isend(&tagged, 1, ElemType::i64, next, 9);
  auto s2 = c.isend(plain, 2, ElemType::i64, next, 0);
  c.recv(in, 2, ElemType::i64, prev, 0);
  auto r = c.irecv(&in_tagged, 1, ElemType::i64, prev, 9);
  r->wait();
  s1->wait();
  s2->wait();
  k.expect(in[0] == prev && in[1] == 7 && in_tagged == 1000 + prev, "send/recv ring with tags");
  // Non-blocking collectives keep issue order with blocking ones.
  std::vector<float> a(50000, 1.0f + c.rank()), b(3, 2.0f);
  auto ra = c.iall_reduce(a.data(), a.data(), a.size(), ElemType::f32, ReduceOp::sum);
  c.all_reduce(b.data(), b.data(), b.size(), ElemType::f32, ReduceOp::max);
  ra->wait();
  k.expect(a[49999] == n * (n + 1) / 2.0f && b[0] == 2.0f, "iall_reduce then all_reduce");
  // split: even and odd ranks.
  auto sub = c.split(c.rank() % 2, c.rank());
  std::int32_t one = 1;
  sub->all_reduce(std::span<std::int32_t>(&one, 1), ReduceOp::sum);
  k.expect(one == (n + 1 - c.rank() % 2) / 2, str("split: ", one, " members"));
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnvironment env(&argc, &argv);
  std::string scenario = "none";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--scenario") scenario = argv[i + 1];
  auto comm = make_mpi_world();
  Communicator& c = *comm;
  try {
    if (scenario != "none") {
      c.set_timeout(std::chrono::milliseconds(2000));
      float x = 1.0f;
      c.all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
      if (c.rank() == 1) {
        if (scenario == "throw") throw std::runtime_error("rank 1 failed on purpose");
        if (scenario == "kill") std::raise(SIGKILL);
        if (scenario == "stall") std::this_thread::sleep_for(std::chrono::seconds(60));
      }
      c.all_reduce(&x, &x, 1, ElemType::f32, ReduceOp::sum);
      std::fprintf(stderr, "rank %d: the collective after the failure completed\n", c.rank());
      return 0;
    }
    Checks k{c.rank()};
    closed_form(c, k);
    determinism(c, k);
    all_to_all(c, k);
    point_to_point(c, k);
    long counts[2] = {k.passed, k.failed};
    c.all_reduce(counts, counts, 2, ElemType::i64, ReduceOp::sum);
    if (c.rank() == 0) std::printf("mpi comm (%d ranks): %ld passed, %ld failed\n", c.size(), counts[0], counts[1]);
    comm.reset();
    return counts[1] == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", c.rank(), e.what());
    std::fflush(stderr);
    MpiEnvironment::abort(2);
  }
}
