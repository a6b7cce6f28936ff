// Where a process of a multi-process job learns its place: the environment
// its launcher set (docs/cluster.md, "What distopt reads"). torchrun sets
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
// and TORCHELASTIC_RUN_ID; srun sets, in each task of a job step,
// SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_NUM_NODES,
// SLURM_STEP_NODELIST, SLURM_JOB_ID and SLURM_STEP_ID (a batch script's own
// environment has no step's task count, so it is no task). mpirun's
// processes are MPI's (comm/mpi.hpp), not read here.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace distopt {

struct LaunchEnv {
  std::string launcher;  // "torchrun" or "srun"
  int rank = 0;          // this process's, 0 .. world - 1
  int world = 1;         // the processes of the job (step)
  int local_rank = 0;    // its index among those on this machine
  std::string rank_var;  // the variables they came from, for messages
  std::string world_var;
  bool one_machine = true;  // every process on this machine
  int machines = 1;         // (srun: SLURM_STEP_NUM_NODES; torchrun: 1 where it says so, else 0: unknown)
  std::string job;          // an identifier of this run: SLURM_JOB_ID.SLURM_STEP_ID, or torchrun's run id and port
  std::string master_addr;  // MASTER_ADDR; srun: else the step's first node
  int master_port = 0;      // MASTER_PORT; srun: else slurm_port(job)
  // torchrun's agent serves its own store on MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): the port is taken.
  bool agent_store = false;
};

// The launcher's environment, read through `get` (std::getenv by default):
// none when no launcher's variables are set. A malformed value (a rank that
// is not a whole number, a rank outside the world, a node list that does not
// parse) is an InvalidInput naming the variable, in one line.
using EnvLookup = std::function<const char*(const char*)>;
std::optional<LaunchEnv> launch_env(const EnvLookup& get = {});

// The port a job step's rank 0 serves its store on when MASTER_PORT is not
// set: 15000 + the step's number ("SLURM_JOB_ID.SLURM_STEP_ID", its digits,
// the last nine) modulo 20000; the same on every task of the step.
int slurm_port(std::string_view job);

// The first host of a SLURM host list ("node[07-09,11],gpu2" -> "node07"):
// a prefix, then optionally a bracketed list of numbers and ranges whose
// first number keeps its zero padding. InvalidInput where it does not parse.
std::string first_host(std::string_view nodelist);

}  // namespace distopt
