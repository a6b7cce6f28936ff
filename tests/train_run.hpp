// Runs train::train on `world` threads and returns rank 0's result,
// checking that every rank ends with the same parameters.
#pragma once

#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "distopt/comm/threads.hpp"
#include "distopt/train/trainer.hpp"

namespace distopt::test_support {

inline train::TrainResult run_ranks(int world, const data::Split& d, const train::TrainConfig& c) {
  train::TrainResult r0;
  std::mutex m;
  std::vector<std::string> hashes(world);
  spawn(world, [&](Communicator& comm) {
    train::TrainResult r = train::train(comm, d, c);
    std::lock_guard lock(m);
    hashes[comm.rank()] = r.param_hash;
    if (comm.rank() == 0) r0 = std::move(r);
  });
  for (int r = 1; r < world; ++r) EXPECT_EQ(hashes[r], hashes[0]) << "rank " << r << " of " << world << " diverged";
  return r0;
}

}  // namespace distopt::test_support
