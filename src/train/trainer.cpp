#include "distopt/train/trainer.hpp"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/clip.hpp"

namespace distopt::train {

namespace {

using Clock = std::chrono::steady_clock;

// A figure in a message: "nan" whatever its sign bit, "inf", "-inf", or the number.
std::string show(double v) { return std::isnan(v) ? std::string("nan") : str(v); }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sums of a data set's loss, correct predictions and count over all ranks:
// each rank evaluates its contiguous piece, all at once or (chunk > 0) in
// chunks of that many samples. Every rank runs as many chunks as the
// largest piece needs (the model's unit calls are collective under zero3),
// the ones past its own end with no samples.
models::BatchStats evaluate(Communicator& comm, models::Model& model, models::UnitAccess& access,
                            const data::Dataset& d, std::size_t chunk = 0) {
  const Piece piece = piece_of(d.size(), comm.size(), comm.rank());
  std::size_t largest = 0;
  for (int r = 0; r < comm.size(); ++r) largest = std::max(largest, piece_of(d.size(), comm.size(), r).count);
  if (chunk == 0) chunk = std::max<std::size_t>(largest, 1);
  models::BatchStats s;
  for (std::size_t at = 0; at < std::max<std::size_t>(largest, 1); at += chunk) {
    const std::size_t begin = std::min(at, piece.count), n = std::min(chunk, piece.count - begin);
    const models::BatchStats c =
        model.evaluate(access, d.sample(piece.offset + begin), d.y.data() + piece.offset + begin, n);
    s.loss_sum += c.loss_sum;
    s.correct += c.correct;
    s.count += c.count;
  }
  double sums[3] = {s.loss_sum, s.correct, s.count};
  comm.all_reduce(sums, sums, 3, ElemType::f64, ReduceOp::sum);
  return {sums[0], sums[1], sums[2]};
}

void validate(const Communicator& comm, const data::Split& data, const TrainConfig& c) {
  if (c.epochs < 1) throw InvalidInput(str("--epochs must be at least 1 (got ", c.epochs, ")"));
  if (!c.checkpoint_dir.empty() && c.keep_checkpoints == 0) throw InvalidInput("--keep-checkpoints must be at least 1");
  if (c.batch_size == 0) throw InvalidInput("--batch-size must be at least 1");
  if (c.batch_size < static_cast<std::size_t>(comm.size()))
    throw InvalidInput(str("batch size ", c.batch_size, " is smaller than the world size ", comm.size(),
                           ": every rank needs at least one sample per step"));
  if (data.train.size() == 0) throw InvalidInput("the training set is empty");
  if (c.clip_grad_norm && !(*c.clip_grad_norm > 0 && std::isfinite(*c.clip_grad_norm)))
    throw InvalidInput(str("--clip-grad-norm must be a positive number (got ", *c.clip_grad_norm, ")"));
  if (!(c.clip_norm_type > 0)) throw InvalidInput(str("--clip-norm-type must be positive or inf (got ", c.clip_norm_type, ")"));
  if (c.clip_grad_value && !(*c.clip_grad_value > 0 && std::isfinite(*c.clip_grad_value)))
    throw InvalidInput(str("--clip-grad-value must be a positive number (got ", *c.clip_grad_value, ")"));
  if (c.swa_start < 0) throw InvalidInput(str("--swa-start must be an epoch number, 1 or more (got ", c.swa_start, ")"));
  if (c.swa_start > c.epochs)
    throw InvalidInput(str("--swa-start ", c.swa_start, " is after the last epoch (", c.epochs, "): nothing would be averaged"));
  if (c.drop_last && data.train.size() < c.batch_size)
    throw InvalidInput(str("with --drop-last, batch size ", c.batch_size, " leaves no batch of the ",
                           data.train.size(), " training samples"));
  if (c.swa_start > 0 && c.max_steps > 0 && c.checkpoint_dir.empty()) {
    // A run cut short by --max-steps ends in epoch ceil(max_steps / per_epoch)
    // (with checkpoints it may be the first part of a resumed run).
    const std::size_t per_epoch =
        data::BatchSampler(data.train.size(), c.batch_size, c.seed, c.drop_last).batches_per_epoch();
    const std::size_t last = (c.max_steps + per_epoch - 1) / per_epoch;
    if (last < static_cast<std::size_t>(c.swa_start))
      throw InvalidInput(str("--max-steps ", c.max_steps, " ends training in epoch ", last, " (", per_epoch,
                             " steps each), before --swa-start ", c.swa_start, ": nothing would be averaged"));
  }
  if (c.scheduler && c.scheduler->name == "reducelronplateau" && data.test.size() == 0)
    throw InvalidInput("reducelronplateau steps on the test loss: it needs a test set (--test-size above 0)");
  if (c.swa_start > 0 && c.ema_decay) throw InvalidInput("--swa-start and --ema-decay cannot be combined: choose one average");
  if (c.swa_lr && c.swa_start == 0) throw InvalidInput("--swa-lr needs --swa-start");
  if (c.swa_lr && !(*c.swa_lr >= 0 && std::isfinite(*c.swa_lr)))
    throw InvalidInput(str("--swa-lr must be a non-negative number, like --lr (got ", *c.swa_lr, ")"));
  if (c.ema_decay && !(*c.ema_decay >= 0 && *c.ema_decay <= 1))
    throw InvalidInput(str("--ema-decay must be in [0, 1] (got ", *c.ema_decay, ")"));
  if (c.loss_scale) {
    // The scale is a float32: a value that is not a positive finite float
    // (NaN, 1e39 -> inf, 1e-50 -> 0) would make every step skip or vanish.
    const auto init = static_cast<float>(c.loss_scale->init_scale);
    if (!(init > 0 && std::isfinite(init)))
      throw InvalidInput(str("--init-scale must be a positive finite float32 number (got ", c.loss_scale->init_scale,
                             ")"));
    GradScaler check(*c.loss_scale);  // torch's checks on the factors
    // ... and what torch lets through but makes no sense for a run: an
    // infinite growth (the scale turns inf) or a non-positive backoff (a
    // negative or zero scale).
    if (!std::isfinite(c.loss_scale->growth_factor))
      throw InvalidInput(str("--growth-factor must be finite (got ", c.loss_scale->growth_factor, ")"));
    if (!(c.loss_scale->backoff_factor > 0))
      throw InvalidInput(str("--backoff-factor must be in (0, 1) (got ", c.loss_scale->backoff_factor, ")"));
  }
}

}  // namespace

Fault fault_from_env() {
  const char* env = std::getenv("DISTOPT_FAULT");
  if (env == nullptr || *env == '\0') return {};
  Fault f;
  unsigned long long step = 0;
  int used = 0;
  if (std::sscanf(env, "stall:%d:%llu%n", &f.rank, &step, &used) == 2 && env[used] == '\0' && f.rank >= 0) {
    f.kind = Fault::Kind::stall;
    f.step = static_cast<std::size_t>(step);
    return f;
  }
  for (const auto& [name, kind] : {std::pair{"fail", Fault::Kind::fail}, std::pair{"kill", Fault::Kind::kill}}) {
    used = 0;
    if (std::sscanf(env, (std::string(name) + ":%d:%llu%n").c_str(), &f.rank, &step, &used) == 2 &&
        env[used] == '\0' && f.rank >= 0) {
      f.kind = kind;
      f.step = static_cast<std::size_t>(step);
      return f;
    }
  }
  char point[16] = {};
  used = 0;
  if (std::sscanf(env, "stall:%d:%15[a-z]%n", &f.rank, point, &used) == 2 && env[used] == '\0' && f.rank >= 0 &&
      (std::string(point) == "init" || std::string(point) == "end" || std::string(point) == "finalize")) {
    f.kind = Fault::Kind::stall;
    f.at = std::string(point) == "init" ? Fault::At::init
                                        : (std::string(point) == "end" ? Fault::At::end : Fault::At::finalize);
    return f;
  }
  used = 0;
  if (std::sscanf(env, "exit:%d:%llu:%15[a-z]%n", &f.rank, &step, point, &used) == 3 && env[used] == '\0' &&
      f.rank >= 0 && (std::string(point) == "file" || std::string(point) == "manifest")) {
    f.kind = Fault::Kind::exit;
    f.step = static_cast<std::size_t>(step);
    f.in_file = std::string(point) == "file";
    return f;
  }
  throw InvalidInput(str("DISTOPT_FAULT: '", env,
                         "' is not stall:RANK:STEP, stall:RANK:init|end|finalize, fail:RANK:STEP, kill:RANK:STEP or "
                         "exit:RANK:STEP:file|manifest"));
}

namespace {

std::string hex64(std::uint64_t h) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace

std::string hash_params(const std::vector<float>& params) {
  return hex64(XXH3_64bits(params.data(), params.size() * sizeof(float)));
}

namespace {

// What a rank reports to: the run's observer (rank 0's only) and
// TrainConfig::every_rank_observer; either may be null.
BothObservers reporting_of(const Communicator& comm, Observer* observer, const TrainConfig& config) {
  return BothObservers(comm.rank() == 0 ? observer : nullptr, config.every_rank_observer);
}

// Thrown out of a segment whose world lost ranks, under OnRankFailure::go_on:
// the state of the last step every survivor completed, kept in memory.
struct Survivable {
  // What the survivors go on from: this state (ddp), or the last
  // checkpoint, read once they have re-formed (zero1-3).
  std::optional<checkpoint::Loaded> state;
  std::string what;           // the loss, as the survivor saw it
  Clock::time_point since;    // when this rank's last step ended
  std::size_t done = 0;       // the steps this rank had completed
  TrainResult counts;         // the segment's counters (checkpoints, skipped and non-finite steps)
  // > 0: no rank was lost; this many processes wait to join (grow). < 0:
  // this process is the one joining (its state comes from the others).
  int joins = 0;
  std::vector<checkpoint::InMemory> memory = {};  // --memory-checkpoint's, newest first
};

// The counters a run sums over its segments.
void add_counts(TrainResult& into, const TrainResult& from) {
  into.checkpoints_written += from.checkpoints_written;
  into.checkpoints_in_memory += from.checkpoints_in_memory;
  into.checkpoint_seconds += from.checkpoint_seconds;
  into.skipped_steps += from.skipped_steps;
  into.nonfinite_steps += from.nonfinite_steps;
}

// One segment of a run: to its end, or until its world loses a rank.
TrainResult train_segment(Communicator& comm, const data::Split& data, const TrainConfig& config, Observer* observer,
                          bool first) {
  validate(comm, data, config);
  const DenormalMode denormals(config.flush_denormals ? DenormalMode::flush : DenormalMode::ieee);
  auto model = models::make_model(config.model, data.train.features, data.train.classes,
                                  models::ModelOptions{config.hidden, config.gpt, config.threads, config.matmul_precision,
                                                       config.activation_checkpointing, config.tile_rows});
  const parallel::FlatLayout layout = parallel::flat_layout(*model);
  std::size_t model_bytes[2] = {};  // the largest activation_bytes(), workspace_bytes() after a step
  // A fresh run's strategy reads the model's initial values a unit (or its
  // shard of one) at a time: no rank holds a whole model to start from.
  std::unique_ptr<parallel::Strategy> strategy;
  if (config.resume) {
    std::vector<float> initial = checkpoint::initial_params(layout, config.resume->wholes);
    strategy = parallel::make_strategy(config.strategy, comm, layout, initial, config.optimizer, config.parallel);
  } else {
    const parallel::InitialParams initial(layout.elements, [&](std::size_t begin, std::span<float> out) {
      model->init_range(begin, out, config.seed);
    });
    strategy = parallel::make_strategy(config.strategy, comm, layout, initial, config.optimizer, config.parallel);
  }
  if (config.on_rank_failure == TrainConfig::OnRankFailure::go_on && !strategy->info().cannot_go_on.empty())
    throw InvalidInput(str("--on-rank-failure continue: --strategy ", config.strategy, " (",
                           strategy->info().cannot_go_on, ") cannot go on without a lost rank"));
  Optimizer& optimizer = strategy->optimizer();
  std::unique_ptr<Scheduler> scheduler;
  if (config.scheduler) scheduler = make_scheduler(optimizer, *config.scheduler);
  const bool step_scheduler_per_batch = scheduler && !config.scheduler_per_epoch && !scheduler->needs_metric();
  std::unique_ptr<Scheduler> swa_scheduler;  // SWALR, built when SWA starts

  std::optional<GradScaler> scaler;
  if (config.loss_scale) {
    GradScalerOptions o = *config.loss_scale;
    o.allow_fp16 = config.parallel.param_dtype == DType::f16;  // f16 parameters have fp32 masters
    scaler.emplace(o);
  }
  std::optional<AveragedParams> averaged;
  // Averages of the parameter values this rank keeps (its shard, or all of
  // them where they are replicated): averaging is pointwise.
  const std::size_t own_elements = strategy->own_elements();
  if (config.swa_start > 0) averaged.emplace(own_elements, AveragingOptions{AveragingKind::swa, 0.0, {}});
  if (config.ema_decay) averaged.emplace(own_elements, AveragingOptions{AveragingKind::ema, *config.ema_decay, {}});
  const checkpoint::RunInfo run{config.strategy, config.model, config.optimizer.name, config.parallel.gossip,
                                config.checkpoint_run};
  auto parts = [&] {
    return checkpoint::RunParts{&optimizer, scheduler.get(), swa_scheduler.get(), scaler ? &*scaler : nullptr,
                                averaged ? &*averaged : nullptr};
  };
  auto start_swa = [&]() -> Scheduler& {
    if (!config.swa_lr) throw InvalidInput("--resume: the checkpoint's run had --swa-lr; resume it with it");
    swa_scheduler = std::make_unique<SWALR>(optimizer, std::vector<double>{*config.swa_lr}, config.swa_anneal_epochs,
                                            config.swa_anneal_strategy);
    return *swa_scheduler;
  };
  if (config.resume) {
    const std::string warning = checkpoint::resume(comm, *strategy, *config.resume, run, parts(), start_swa);
    if (!warning.empty()) reporting_of(comm, observer, config).on_warning(warning);
  }
  double grad_norm = -1;
  bool stepped = true;
  // torch's order: unscale, clip, then the scaler's step (skipped on inf/NaN);
  // with none of them, just opt.step(). The norm is taken over the rank's
  // owned gradient elements and reduced, the same numbers in the same order
  // under every strategy; the coefficient then scales what the rank steps.
  const parallel::UpdateFn update = [&](Optimizer& opt, const parallel::GradShard& g) {
    if (scaler) scaler->unscale(opt, g.reduce);
    if (config.clip_grad_norm)
      grad_norm = clip_grad_norm(opt, g.owned, *config.clip_grad_norm, config.clip_norm_type, false, g.reduce);
    if (config.clip_grad_value) clip_grad_value(opt, *config.clip_grad_value);
    if (scaler)
      stepped = scaler->step(opt, g.reduce);
    else
      opt.step();
  };

  data::BatchSampler sampler(data.train.size(), config.batch_size, config.seed, config.drop_last);
  const std::size_t per_epoch = sampler.batches_per_epoch();
  const std::size_t features = data.train.features;
  BothObservers reporting = reporting_of(comm, observer, config);
  const bool report = reporting.any();
  if (report && first) reporting.on_start(config.epochs, per_epoch);

  // This rank's piece of a batch, gathered contiguously.
  // (A batch never holds more than the training set.)
  const std::size_t per_rank = std::min(config.batch_size, data.train.size()) / comm.size() + 1;
  std::vector<float> xb(per_rank * features), yb(per_rank);
  // A model keeps activations for its whole input, so evaluation runs in
  // pieces of a rank's share of a training batch: within the training
  // step's memory (a whole test piece at once held 250 MB a rank for a
  // 784-2048x3-10 MLP; pieces of 256 samples still 12 MB a rank above a
  // step's). zero3 gathers the model once per piece.
  const std::size_t piece = (std::min(config.batch_size, data.train.size()) + comm.size() - 1) / comm.size();
  const std::size_t eval_chunk = piece;

  // Per step, every rank contributes {loss sum, sample count, stop request}
  // to a gather that runs while the step does: the loss is summed in rank
  // order, a non-finite one is traced to its rank, and a stop request on any
  // rank stops all of them after the same step. If the step throws, the
  // request must not outlive the buffers.
  const int world = comm.size();
  // Per rank: loss sum, count, stop request and, in an elastic world,
  // processes waiting to join (rank 0's count).
  const bool elastic = config.on_rank_failure == TrainConfig::OnRankFailure::go_on;
  const std::size_t per = elastic ? 4 : 3;
  double mine[4] = {0, 0, 0, 0};
  std::vector<double> all(per * static_cast<std::size_t>(world));
  std::unique_ptr<Request> gather;
  struct WaitOnExit {
    std::unique_ptr<Request>& r;
    ~WaitOnExit() {
      if (r) try {
          r->wait();
        } catch (...) {
        }
    }
  } wait_on_exit{gather};
  double last_finite_loss = std::nan("");
  std::size_t last_finite_step = 0;
  bool warned = false;

  const Fault fault = fault_from_env();
  if (fault.kind == Fault::Kind::kill && !config.process_per_rank)
    throw InvalidInput("DISTOPT_FAULT kill:RANK:STEP needs a process per rank (--backend mpi or gloo); use fail:RANK:STEP");
  TrainResult result;
  const auto start = Clock::now();
  double train_seconds = 0, train_samples = 0;
  bool stop = false;
  // A resumed run goes on from the batch after its checkpoint's step.
  const std::size_t start_step = config.resume ? static_cast<std::size_t>(config.resume->step) : 0;
  const int first_epoch = static_cast<int>(start_step / per_epoch) + 1;
  result.steps = start_step;
  const bool checkpointing = !config.checkpoint_dir.empty();
  std::size_t last_saved = start_step;
  int epoch_now = first_epoch;
  bool evaluated = false;
  bool save_after_epoch = false;
  // --memory-checkpoint: the checkpoints kept in memory, newest first (two
  // only until the next step shows that every rank kept the newest).
  const bool in_memory = config.memory_checkpoint && elastic;
  std::vector<checkpoint::InMemory> kept;
  const auto keep_in_memory = [&] {
    kept.insert(kept.begin(), checkpoint::keep_in_memory(comm, *strategy, run, parts(), result.steps));
    if (kept.size() > 2) kept.pop_back();
  };
  auto save = [&](int epoch) {
    const auto t0 = Clock::now();
    checkpoint::SaveOptions where{config.checkpoint_dir, config.keep_checkpoints, checkpoint::SaveOptions::Die::no};
    if (fault.kind == Fault::Kind::exit && fault.rank == comm.rank() && fault.step == result.steps)
      where.die = fault.in_file ? checkpoint::SaveOptions::Die::in_file : checkpoint::SaveOptions::Die::after_file;
    if (checkpointing) {
      result.checkpoint_bytes = checkpoint::save(comm, *strategy, run, parts(), where, result.steps, epoch);
      ++result.checkpoints_written;
    }
    if (in_memory) {
      keep_in_memory();
      ++result.checkpoints_in_memory;
    }
    result.checkpoint_seconds += seconds_since(t0);
  };
  if (config.max_steps != 0 && start_step >= config.max_steps) stop = true;
  bool applied = false;  // the step in progress has updated the parameters
  const bool may_grow = elastic &&
                        (!config.checkpoint_dir.empty() || in_memory || strategy->info().replicated_params) &&
                        strategy->can_run_at(world + 1);
  // What follows a step's update: the scaler's, the EMA's and the
  // scheduler's steps.
  const auto after_update = [&] {
    if (scaler) {
      scaler->update();
      if (!stepped) ++result.skipped_steps;
    }
    if (config.ema_decay) averaged->update(strategy->own_params());
    if (step_scheduler_per_batch && !swa_scheduler) scheduler->step();
  };
  Clock::time_point last_step_end = Clock::now();
  try {
    if (in_memory) keep_in_memory();  // where this segment starts
    for (int epoch = first_epoch; epoch <= config.epochs && !stop; ++epoch) {
      epoch_now = epoch;
      sampler.set_epoch(static_cast<std::uint64_t>(epoch - 1));
      const auto epoch_start = Clock::now();
      double epoch_loss = 0, epoch_count = 0;
      for (std::size_t k = epoch == first_epoch ? start_step % per_epoch : 0; k < per_epoch; ++k) {
        const auto global = sampler.global_batch(k);
        const auto local = sampler.local_batch(k, comm.rank(), comm.size());
        for (std::size_t i = 0; i < local.size(); ++i) {
          data.train.fill(static_cast<std::uint64_t>(epoch - 1), local[i], xb.data() + i * features);
          yb[i] = data.train.y[local[i]];
        }
        float scale = 1.0f / static_cast<float>(global.size());
        const double lr = optimizer.lr(0);
        // With loss scaling, backward computes the gradient of loss * scale.
        const double loss_scale = scaler ? scaler->scale(1.0f) : 0.0;
        if (scaler) scale *= static_cast<float>(loss_scale);
        const models::BatchStats s =
            model->forward_backward(strategy->access(), xb.data(), yb.data(), local.size(), scale);
        if (!evaluated) {  // evaluation may grow the model's buffers past a step's
          model_bytes[0] = std::max(model_bytes[0], model->activation_bytes());
          model_bytes[1] = std::max(model_bytes[1], model->workspace_bytes());
        }
        mine[0] = s.loss_sum;
        mine[1] = s.count;
        mine[2] = config.stop_flag ? static_cast<double>(config.stop_flag->load(std::memory_order_relaxed)) : 0.0;
        // (New ranks of a sharded run take the checkpoint written or kept
        // in memory when they are admitted: none without either; a gossip
        // graph may not exist at one rank more.)
        if (may_grow && comm.rank() == 0) mine[3] = comm.pending_joins();
        gather = comm.iall_gather(mine, all.data(), per, ElemType::f64);
        stepped = true;
        strategy->step(update);
        applied = true;
        after_update();
        gather->wait();
        gather.reset();
        // Every rank has contributed to this step's gather, so every rank
        // finished keeping the last checkpoint in memory: the one before
        // it is no longer needed.
        if (kept.size() > 1) kept.pop_back();
        double loss_sum = 0, count = 0, stop_request = 0, joins = 0;
        int nonfinite_rank = -1;
        for (int r = 0; r < world; ++r) {
          const double* v = all.data() + per * static_cast<std::size_t>(r);
          loss_sum += v[0];
          count += v[1];
          stop_request = std::max(stop_request, v[2]);
          if (elastic) joins = std::max(joins, v[3]);
          if (nonfinite_rank < 0 && !std::isfinite(v[0])) nonfinite_rank = r;
        }
        epoch_loss += loss_sum;
        epoch_count += count;
        ++result.steps;
        applied = false;
        last_step_end = Clock::now();
        const double loss = loss_sum / count;
        if (report) {
          const double t = seconds_since(epoch_start);
          reporting.on_step({epoch, result.steps, k + 1, per_epoch, loss, lr, seconds_since(start),
                             t > 0 ? epoch_count / t : 0, grad_norm, loss_scale, !stepped, strategy->bytes_sent()});
        }
        // Loss scaling skips steps with inf/NaN gradients on purpose: only a
        // step it took counts with its norm.
        const bool bad_norm = config.clip_grad_norm && stepped && !std::isfinite(grad_norm);
        if (!std::isfinite(loss) || bad_norm) {
          ++result.nonfinite_steps;
          const std::string what = !std::isfinite(loss)
                                       ? str("the loss is ", show(loss),
                                             nonfinite_rank >= 0 ? str(" on rank ", nonfinite_rank) : std::string())
                                       : str("the total gradient norm is ", show(grad_norm));
          const std::string last = std::isfinite(last_finite_loss) ? str("the last finite loss was ", last_finite_loss,
                                                                         ", at step ", last_finite_step)
                                                                   : std::string("no step had a finite loss");
          if (config.on_nonfinite == TrainConfig::OnNonFinite::error)
            throw NonFiniteError(str("step ", result.steps, ": ", what, " (", last,
                                     "); lower --lr or clip gradients (--clip-grad-norm), or pass --on-nonfinite "
                                     "warn|ignore to train on"),
                                 comm.rank());
          if (config.on_nonfinite == TrainConfig::OnNonFinite::warn && !warned && report)
            reporting.on_warning(
                str("step ", result.steps, ": ", what, " (", last, "); training goes on (--on-nonfinite warn)"));
          warned = true;
        } else {
          last_finite_loss = loss;
          last_finite_step = result.steps;
        }
        // A checkpoint records the state between two steps. At an epoch's
        // last step that is after the epoch's own work (evaluation, a
        // per-epoch scheduler step), so it waits for it; a run stopping
        // mid-epoch saves first, and resumes inside the same epoch.
        const bool stopping = stop_request > 0 || (config.max_steps != 0 && result.steps >= config.max_steps);
        if ((checkpointing || in_memory) &&
            (stopping || (config.checkpoint_every > 0 && result.steps % config.checkpoint_every == 0))) {
          if (k + 1 < per_epoch) {
            save(epoch);
            last_saved = result.steps;
          } else {
            save_after_epoch = true;
          }
        }
        // A rank of the world the run started with: survivors that go back
        // to a checkpoint pass the step again, with that rank number held
        // by another rank.
        const bool fault_here = first && fault.rank == comm.rank() && fault.step == result.steps &&
                                (fault.kind == Fault::Kind::fail || fault.kind == Fault::Kind::kill ||
                                   fault.stalls(comm.rank(), Fault::At::step));
        if (fault_here) {
          if (fault.kind == Fault::Kind::fail)
            throw Error(str("rank ", comm.rank(), " failed after step ", result.steps, " (DISTOPT_FAULT)"));
          if (config.process_per_rank) std::raise(fault.kind == Fault::Kind::kill ? SIGKILL : SIGSTOP);
          for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
        }
        if (stop_request > 0) {
          result.interrupted = true;
          result.stop_signal = static_cast<int>(stop_request);
          stop = true;
          break;
        }
        if (config.max_steps != 0 && result.steps >= config.max_steps) {
          stop = true;
          break;
        }
        // Processes wait to join: the world grows between this step and the
        // next (not after an epoch's last step: its end-of-epoch work first).
        if (joins > 0 && k + 1 < per_epoch && strategy->admits_new_ranks() &&
            strategy->can_run_at(world + static_cast<int>(joins))) {
          Survivable out{std::nullopt, str("admitting ", joins, " new rank(s)"), last_step_end, result.steps, {}};
          out.joins = static_cast<int>(joins);
          if (strategy->info().per_rank_models) strategy->complete_in_flight();  // nothing dropped
          const std::optional<parallel::LocalState> local = strategy->survivor_state();
          if (strategy->info().replicated_params && !strategy->info().per_rank_models) {
            out.state = checkpoint::capture(*strategy, run, parts(), result.steps);
          } else if (local) {
            // Gossip ranks go on from their own models (the new ones from
            // rank 0's), as after a loss, but with nothing lost.
            out.state = checkpoint::capture_survivor(*strategy, run, parts(), *local, comm.rank(), comm.size());
          } else if (last_saved != result.steps) {
            save(epoch);  // the new ranks read their shards from it (on disk or kept in memory)
            last_saved = result.steps;
          }
          add_counts(out.counts, result);
          out.memory = std::move(kept);
          throw out;
        }
      }
      const double epoch_seconds = seconds_since(epoch_start);
      train_seconds += epoch_seconds;
      train_samples += epoch_count;
      const models::BatchStats test = evaluate(comm, *model, strategy->eval_access(), data.test, eval_chunk);
      evaluated = true;
      result.consensus_distance = strategy->consensus_distance();
      const double none = std::nan("");  // nothing measured: reported as null
      result.train_loss = epoch_count > 0 ? epoch_loss / epoch_count : none;
      result.test_loss = test.count > 0 ? test.loss_sum / test.count : none;
      result.test_accuracy = test.count > 0 ? test.correct / test.count : none;
      // SWA: average at the end of epoch swa_start and every later one; with
      // swa_lr, SWALR then steps per epoch in place of the main scheduler
      // (torch's recipe: update_parameters, then swa_scheduler.step()).
      const bool swa_epoch = config.swa_start > 0 && epoch >= config.swa_start;
      if (swa_epoch) {
        averaged->update(strategy->own_params());
        if (config.swa_lr && !swa_scheduler)
          swa_scheduler = std::make_unique<SWALR>(optimizer, std::vector<double>{*config.swa_lr},
                                                  config.swa_anneal_epochs, config.swa_anneal_strategy);
      }
      if (swa_scheduler) {
        swa_scheduler->step();
      } else if (scheduler && !step_scheduler_per_batch) {
        if (scheduler->needs_metric()) scheduler->step(result.test_loss);
        else scheduler->step();
      }
      EpochMetrics em{epoch,
                      result.steps,
                      result.train_loss,
                      result.test_loss,
                      result.test_accuracy,
                      epoch_seconds > 0 ? epoch_count / epoch_seconds : 0,
                      /*wall_s, below*/ 0};
      em.consensus_distance = result.consensus_distance;
      if (averaged && averaged->n_averaged() > 0) {
        // Each rank holds the average of its own values; each evaluates its piece of the test set.
        const auto access = strategy->access_to(averaged->params());
        const models::BatchStats a = evaluate(comm, *model, *access, data.test, eval_chunk);
        em.averaged = true;
        em.avg_test_loss = a.count > 0 ? a.loss_sum / a.count : none;
        em.avg_test_accuracy = a.count > 0 ? a.correct / a.count : none;
        if (!result.averaged) result.averaged.emplace();
        result.averaged->test_loss = em.avg_test_loss;
        result.averaged->test_accuracy = em.avg_test_accuracy;
      }
      em.wall_s = seconds_since(start);
      if (report) reporting.on_epoch(em);
      if (save_after_epoch) {
        save(epoch);
        last_saved = result.steps;
        save_after_epoch = false;
      }
    }
    if (!evaluated) {
      // A resumed run with nothing left to train still reports its model.
      const models::BatchStats test = evaluate(comm, *model, strategy->eval_access(), data.test, eval_chunk);
      result.train_loss = std::nan("");
      result.test_loss = test.count > 0 ? test.loss_sum / test.count : std::nan("");
      result.test_accuracy = test.count > 0 ? test.correct / test.count : std::nan("");
    }
    if (checkpointing && last_saved != result.steps) save(epoch_now);
    result.samples_per_s = train_seconds > 0 ? train_samples / train_seconds : 0;
    result.memory = strategy->memory();
    result.memory.activations = model_bytes[0];  // a training step's, before any evaluation
    result.memory.workspaces = model_bytes[1];
    using KeepParams = TrainConfig::KeepParams;
    const bool keep =
        config.keep_params == KeepParams::every_rank || (config.keep_params == KeepParams::rank0 && comm.rank() == 0);
    // Hashed as they are gathered (XXH3 of the concatenation, as
    // hash_params), kept where asked.
    // `own`: values shaped like own_params(); null: the current parameters.
    auto gathered = [&](const std::span<const float>* own, std::vector<float>& params, std::string& hash) {
      const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> owner(XXH3_createState(), XXH3_freeState);
      XXH3_state_t* state = owner.get();
      DISTOPT_CHECK(state != nullptr && XXH3_64bits_reset(state) == XXH_OK);
      if (keep) params.reserve(strategy->layout().param_elements());
      const parallel::Strategy::ParamVisitor visit = [&](std::size_t, std::span<const float> values) {
        XXH3_64bits_update(state, values.data(), values.size_bytes());
        if (keep) params.insert(params.end(), values.begin(), values.end());
      };
      if (own != nullptr) strategy->for_each_param(*own, visit);
      else strategy->for_each_current_param(visit);
      hash = hex64(XXH3_64bits_digest(state));
    };
    gathered(nullptr, result.params, result.param_hash);
    result.bytes_sent = strategy->bytes_sent();
    std::size_t offset = 0;
    for (const ParamSlot& s : layout.params) {
      result.slots.push_back({s.name, offset, s.shape});
      offset += s.numel();
    }
    if (scaler) result.loss_scale = scaler->get_scale();
    if (result.averaged) {
      result.averaged->kind = averaged->options().kind;
      result.averaged->n_averaged = averaged->n_averaged();
      const std::span<const float> own = averaged->params();
      gathered(&own, result.averaged->params, result.averaged->param_hash);
    }
  } catch (const RankLost& e) {
    if (config.on_rank_failure != TrainConfig::OnRankFailure::go_on) throw;
    if (gather) {  // the step's loss gather, failed too: done with its buffers
      try {
        gather->wait();
      } catch (const CommError&) {
      }
      gather.reset();
    }
    // Every survivor is in the same collective (the first the lost rank
    // missed), so they agree on the step: one that updated the parameters
    // counts as done (its loss is not known).
    std::size_t done = result.steps + (applied ? 1 : 0);
    const parallel::StrategyInfo& info = strategy->info();
    // A gossip survivor goes on from its own model.
    const std::optional<parallel::LocalState> local = strategy->survivor_state();
    if (local && local->steps > done) {
      // Its update was applied and its mixing failed: the step counts as
      // done, and what follows an update follows it.
      after_update();
      done = local->steps;
    }
    Survivable out{std::nullopt, e.what(), last_step_end, done, {}};
    add_counts(out.counts, result);
    if (info.replicated_params && !info.per_rank_models) {
      out.state = checkpoint::capture(*strategy, run, parts(), done);
    } else if (local) {
      out.state = checkpoint::capture_survivor(*strategy, run, parts(), *local, comm.rank(), comm.size());
    } else if (config.checkpoint_dir.empty() && !in_memory) {
      // A sharded strategy: the lost rank held the only copy of its shard.
      throw InvalidInput(str("--strategy ", config.strategy, ": a rank was lost and there is no checkpoint to go back to"));
    }
    out.memory = std::move(kept);
    throw out;
  }
  return result;
}

}  // namespace

TrainResult train(Communicator& comm, const data::Split& data, const TrainConfig& config, Observer* observer) {
  Communicator* now = &comm;
  std::unique_ptr<Communicator> owned;  // the communicator after a change of world
  TrainConfig c = config;
  c.joining = false;
  std::vector<MembershipChange> changes;
  TrainResult counts;  // the counters of the segments before
  const parallel::StrategyInfo& info = parallel::strategy_or_throw(config.strategy);
  const bool replicated = info.replicated_params && !info.per_rank_models;
  bool joining = config.joining;
  for (;;) {
    Survivable lost;
    if (joining) {
      // This process was admitted into a running run (comm is the grown
      // world): the state comes from the others below.
      joining = false;
      lost = Survivable{std::nullopt, "joined a running run", Clock::now(), 0, {}};
      lost.joins = -1;
    } else {
      try {
        TrainResult r = train_segment(*now, data, c, observer, changes.empty() && !config.joining);
        r.membership = std::move(changes);
        r.rank_at_end = now->rank();
        add_counts(r, counts);
        return r;
      } catch (Survivable& s) {
        lost = std::move(s);
      } catch (const RankLost& e) {
        // In a segment's setup (the strategy's agreement, a resume): nothing
        // trained in it, the survivors start it again.
        if (config.on_rank_failure != TrainConfig::OnRankFailure::go_on) throw;
        const std::size_t at = c.resume ? static_cast<std::size_t>(c.resume->step) : 0;
        lost = Survivable{c.resume ? std::optional<checkpoint::Loaded>(*c.resume) : std::nullopt, e.what(),
                          Clock::now(), at, {}};
        if (!c.resume) lost.state.emplace();  // a fresh start: nothing to load
        // A sharded run's ranks look for the last checkpoint together, as
        // the ranks that trained do.
        if (!info.replicated_params) lost.state.reset();
      }
    }
    add_counts(counts, lost.counts);
    const int before = now->size(), rank_before = lost.joins < 0 ? -1 : now->rank();
    std::int64_t from = 0;
    std::vector<std::int64_t> all, ranks_before;  // each rank's step to go on from, and its rank before (-1: new)
    bool from_memory = false;  // lost.state is the survivors' checkpoint kept in memory
    for (;;) {  // re-form (grow, or shrink); shrink again if ranks are lost meanwhile
      try {
        if (lost.joins >= 0) {
          std::unique_ptr<Communicator> next = lost.joins > 0 ? now->grow(lost.joins) : now->shrink();
          owned = std::move(next);
          now = owned.get();
        }
        // A replica's state, from rank `src` to every rank that has none or
        // an older one (`take`).
        const auto share = [&](int src, bool take) {
          std::vector<char> bytes = now->rank() == src ? checkpoint::to_bytes(*lost.state) : std::vector<char>();
          now->broadcast_bytes(bytes, src);
          if (take) lost.state = checkpoint::from_bytes(bytes);
        };
        // Whether the group admitted new ranks (a re-forming admits none
        // where a rank was lost, though some ranks asked it to grow).
        const std::int64_t was = rank_before;
        ranks_before.assign(static_cast<std::size_t>(now->size()), 0);
        now->all_gather(&was, ranks_before.data(), 1, ElemType::i64);
        const bool admitted = std::find(ranks_before.begin(), ranks_before.end(), -1) != ranks_before.end();
        if (lost.joins > 0 && !admitted && now->size() < before)
          lost.what = str("a rank was lost in the step that was to admit ", lost.joins,
                          " new rank(s); they wait for the next that can");
        if (admitted && (replicated || info.per_rank_models)) {
          share(0, !lost.state);  // the new ranks take rank 0's state; the others have their own
        } else if (!lost.state) {
          // Back to the last checkpoint kept in memory (--memory-checkpoint),
          if (c.memory_checkpoint) {
            if (auto m = checkpoint::restore_from_memory(*now, lost.memory, rank_before < 0)) {
              lost.state = std::move(*m);
              from_memory = true;
            }
          }
        }
        if (!lost.state) {
          // or to the last complete one on disk, read once every survivor
          // has left the collective it was in (rank 0 may have been writing
          // or pruning one).
          now->barrier();
          if (checkpoint::latest_complete(c.checkpoint_dir))
            lost.state = checkpoint::load_latest(c.checkpoint_dir);
          else if (rank_before < 0)
            throw CommError(str("a rank of the run was lost while this process joined it, and the checkpoint it was ",
                                "to take went with it: start it again"));
          else if (c.resume)
            lost.state = *c.resume;  // none written since the run resumed: from where it resumed
          else
            lost.state.emplace();  // none written yet: the run starts again
        }
        // The ranks' states are of one kind: a rank lost while some ranks
        // were still setting a segment up and others training leaves the
        // first with the segment's starting state and the others with
        // their own (gossip). Then all go on from where the segment started.
        {
          const std::int64_t kind = checkpoint::is_survivors_state(*lost.state) ? 1 : 0;
          std::vector<std::int64_t> kinds(static_cast<std::size_t>(now->size()));
          now->all_gather(&kind, kinds.data(), 1, ElemType::i64);
          if (std::any_of(kinds.begin(), kinds.end(), [&](std::int64_t k) { return k != kinds[0]; })) {
            if (rank_before < 0)
              throw CommError("a rank of the run was lost while this process joined it, and the others go back to "
                              "where they started: start it again");
            if (c.resume)
              lost.state = *c.resume;
            else
              lost.state.emplace();
          }
        }
        // The ranks agree on the step they go on from (a commit vote). A
        // lost process may have delivered a step's last messages to some
        // ranks and not to others: those completed the step, these did not.
        // The step counts as done by all: under ddp the first rank that
        // completed it sends its replica to the others (replicas of one
        // step are identical). Sharded runs read one checkpoint (on disk or
        // kept in memory); gossip and diloco ones take the greater step.
        from = static_cast<std::int64_t>(lost.state->step);
        all.assign(static_cast<std::size_t>(now->size()), 0);
        now->all_gather(&from, all.data(), 1, ElemType::i64);
        std::int64_t most = from;
        int src = now->rank();
        for (int r = now->size() - 1; r >= 0; --r)
          if (all[static_cast<std::size_t>(r)] >= most) {
            most = all[static_cast<std::size_t>(r)];
            src = r;
          }
        bool behind = false;
        for (int r = 0; r < now->size(); ++r) behind = behind || all[static_cast<std::size_t>(r)] != most;
        if (behind && replicated) {
          share(src, from != most);
        } else if (checkpoint::is_survivors_state(*lost.state)) {
          // Gossip survivors: each goes on from its own model, in step
          // with the one ahead, whose run state (schedulers, scaler) all take.
          std::string run_state = lost.state->state;
          if (behind) now->broadcast_bytes(run_state, src);
          checkpoint::rebase_survivor(*lost.state, now->rank(), now->size(), static_cast<std::uint64_t>(most), run_state);
        }
        if (behind) {
          from = most;
          std::fill(all.begin(), all.end(), most);
        }
        break;
      } catch (const RankLost&) {
        if (rank_before < 0 && !lost.state)
          throw CommError("a rank of the run was lost while this process joined it, before it had the run's state: "
                          "start it again");
        lost.joins = 0;  // the ones still there re-form without the lost
        if (lost.state && (!lost.state->dir.empty() || from_memory)) lost.state.reset();  // again in the new group
        from_memory = false;
      }
    }
    MembershipChange change;
    change.step = static_cast<std::size_t>(from);
    change.steps_redone = lost.done > change.step ? lost.done - change.step : 0;
    change.world = now->size();
    std::vector<char> alive(static_cast<std::size_t>(std::max(before, 0)), 0);
    for (int r = 0; r < now->size(); ++r) {
      if (all[static_cast<std::size_t>(r)] != from)
        throw CommError(str("the ranks of a changed world disagree on the step to go on from: ", from, " here, ",
                            all[static_cast<std::size_t>(r)], " on rank ", r));
      const std::int64_t old = ranks_before[static_cast<std::size_t>(r)];
      if (old < 0)
        change.joined.push_back(r);
      else if (old < before)
        alive[static_cast<std::size_t>(old)] = 1;
    }
    if (rank_before < 0) {
      change.world_before = now->size() - static_cast<int>(change.joined.size());
    } else {
      change.world_before = before;
      for (int r = 0; r < before; ++r)
        if (!alive[static_cast<std::size_t>(r)]) change.lost.push_back(r);
    }
    change.reason = lost.what;
    // A fresh start (a loss before any step of a new run) has nothing to load.
    if (from == 0 && lost.state->wholes.empty())
      c.resume.reset();
    else
      c.resume = std::make_shared<const checkpoint::Loaded>(std::move(*lost.state));
    change.seconds = seconds_since(lost.since);
    reporting_of(*now, observer, config).on_membership(change);
    changes.push_back(std::move(change));
  }
}

}  // namespace distopt::train
