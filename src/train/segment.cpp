// A training segment (segment.hpp): its setup, its steps and epochs, its
// end, and what it throws when its world changes.
#include "segment.hpp"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <thread>

#include "distopt/checkpoint/state.hpp"
#include "distopt/core/error.hpp"
#include "distopt/optim/clip.hpp"

namespace distopt::train {

namespace {

// A figure in a message: "nan" whatever its sign bit, "inf", "-inf", or the number.
std::string show(double v) { return std::isnan(v) ? std::string("nan") : str(v); }

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

}  // namespace

std::string hex64(std::uint64_t h) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

BothObservers reporting_of(const Communicator& comm, Observer* observer, const TrainConfig& config) {
  return BothObservers(comm.rank() == 0 ? observer : nullptr, config.every_rank_observer);
}

Segment::Segment(Communicator& comm, const data::Split& data, const TrainConfig& config, Observer* observer,
                 bool first)
    : validated_((validate(comm, data, config), true)),
      comm_(comm),
      data_(data),
      config_(config),
      observer_(observer),
      first_(first),
      denormals_(config.flush_denormals ? DenormalMode::flush : DenormalMode::ieee),
      model_(models::make_model(config.model, data.train.features, data.train.classes,
                                models::ModelOptions{config.hidden, config.gpt, config.threads, config.matmul_precision,
                                                     config.activation_checkpointing, config.tile_rows})),
      layout_(parallel::flat_layout(*model_)),
      run_info_{config.strategy, config.model, config.optimizer.name, config.parallel.gossip, config.checkpoint_run},
      reporting_(reporting_of(comm, observer, config)) {
  // A fresh run's strategy reads the model's initial values a unit (or its
  // shard of one) at a time: no rank holds a whole model to start from.
  const auto set_up = Clock::now();
  if (config.resume) {
    const checkpoint::LoadedTensors saved(*config.resume);
    strategy_ = parallel::make_strategy(config.strategy, comm, layout_, checkpoint::initial_params(layout_, saved),
                                        config.optimizer, config.parallel);
  } else {
    const parallel::InitialParams initial(layout_.elements, [&](std::size_t begin, std::span<float> out) {
      model_->init_range(begin, out, config.seed);
    });
    strategy_ = parallel::make_strategy(config.strategy, comm, layout_, initial, config.optimizer, config.parallel);
  }
  if (config.on_rank_failure == TrainConfig::OnRankFailure::go_on && !strategy_->info().cannot_go_on.empty())
    throw InvalidInput(str("--on-rank-failure continue: --strategy ", config.strategy, " (",
                           strategy_->info().cannot_go_on, ") cannot go on without a lost rank"));
  optimizer_ = &strategy_->optimizer();
  if (config.scheduler) scheduler_ = make_scheduler(*optimizer_, *config.scheduler);
  step_scheduler_per_batch_ = scheduler_ && !config.scheduler_per_epoch && !scheduler_->needs_metric();
  if (config.loss_scale) {
    GradScalerOptions o = *config.loss_scale;
    o.allow_fp16 = config.parallel.param_dtype == DType::f16;  // f16 parameters have fp32 masters
    scaler_.emplace(o);
  }
  // Averages of the parameter values this rank keeps (its shard, or all of
  // them where they are replicated): averaging is pointwise.
  const std::size_t own_elements = strategy_->own_elements();
  if (config.swa_start > 0) averaged_.emplace(own_elements, AveragingOptions{AveragingKind::swa, 0.0, {}});
  if (config.ema_decay) averaged_.emplace(own_elements, AveragingOptions{AveragingKind::ema, *config.ema_decay, {}});
  if (config.resume) {
    resume();
    result_.resume_seconds = seconds_since(set_up);
  }
  build_chain();

  sampler_.emplace(data.train.size(), config.batch_size, config.seed, config.drop_last);
  per_epoch_ = sampler_->batches_per_epoch();
  features_ = data.train.features;
  report_ = reporting_.any();
  if (report_ && first) reporting_.on_start(config.epochs, per_epoch_);

  // This rank's piece of a batch, gathered contiguously.
  // (A batch never holds more than the training set.)
  const std::size_t per_rank = std::min(config.batch_size, data.train.size()) / comm.size() + 1;
  xb_.resize(per_rank * features_);
  yb_.resize(per_rank);
  // A model keeps activations for its whole input, so evaluation runs in
  // pieces of a rank's share of a training batch: within the training
  // step's memory (a whole test piece at once held 250 MB a rank for a
  // 784-2048x3-10 MLP; pieces of 256 samples still 12 MB a rank above a
  // step's). zero3 gathers the model once per piece.
  eval_chunk_ = (std::min(config.batch_size, data.train.size()) + comm.size() - 1) / comm.size();

  // The loss is summed in rank order, a non-finite one is traced to its
  // rank, and a stop request on any rank stops all of them after the same
  // step. If the step throws, the request must not outlive the buffers.
  world_ = comm.size();
  elastic_ = config.on_rank_failure == TrainConfig::OnRankFailure::go_on;
  per_ = elastic_ ? 4 : 3;
  all_.resize(per_ * static_cast<std::size_t>(world_));
  last_finite_loss_ = std::nan("");

  fault_ = fault_from_env();
  if (fault_.kind == Fault::Kind::kill && !config.process_per_rank)
    throw InvalidInput("DISTOPT_FAULT kill:RANK:STEP needs a process per rank (--backend mpi or gloo); use fail:RANK:STEP");
  start_ = Clock::now();
  start_step_ = config.resume ? static_cast<std::size_t>(config.resume->step) : 0;
  first_epoch_ = static_cast<int>(start_step_ / per_epoch_) + 1;
  result_.steps = start_step_;
  checkpointing_ = !config.checkpoint_dir.empty();
  last_saved_ = start_step_;
  epoch_now_ = first_epoch_;
  in_memory_ = config.memory_checkpoint && elastic_;
  if (config.max_steps != 0 && start_step_ >= config.max_steps) stop_ = true;
  may_grow_ = elastic_ && (!config.checkpoint_dir.empty() || in_memory_ || strategy_->info().replicated_params) &&
              strategy_->can_run_at(world_ + 1);
  last_step_end_ = Clock::now();
}

Segment::~Segment() {
  if (gather_) try {
      gather_->wait();
    } catch (...) {
    }
}

checkpoint::RunParts Segment::parts() {
  return checkpoint::RunParts{optimizer_, scheduler_.get(), swa_scheduler_.get(), scaler_ ? &*scaler_ : nullptr,
                              averaged_ ? &*averaged_ : nullptr};
}

void Segment::resume() {
  auto start_swa = [&]() -> Scheduler& {
    if (!config_.swa_lr) throw InvalidInput("--resume: the checkpoint's run had --swa-lr; resume it with it");
    swa_scheduler_ = std::make_unique<SWALR>(*optimizer_, std::vector<double>{*config_.swa_lr},
                                             config_.swa_anneal_epochs, config_.swa_anneal_strategy);
    return *swa_scheduler_;
  };
  const std::string warning = checkpoint::resume(comm_, *strategy_, *config_.resume, run_info_, parts(), start_swa);
  if (!warning.empty()) reporting_of(comm_, observer_, config_).on_warning(warning);
}

// torch's order: unscale, clip, then the scaler's step (skipped on inf/NaN);
// with none of them, just opt.step(). The norm is taken over the rank's
// owned gradient elements and reduced, the same numbers in the same order
// under every strategy; the coefficient then scales what the rank steps.
// After the update: the scaler's, the EMA's and the scheduler's steps.
void Segment::build_chain() {
  if (scaler_) chain_.then([this](Optimizer& opt, const parallel::GradShard& g) { scaler_->unscale(opt, g.reduce); });
  if (config_.clip_grad_norm)
    chain_.then([this](Optimizer& opt, const parallel::GradShard& g) {
      grad_norm_ = clip_grad_norm(opt, g.owned, *config_.clip_grad_norm, config_.clip_norm_type, false, g.reduce);
    });
  if (config_.clip_grad_value)
    chain_.then([this](Optimizer& opt, const parallel::GradShard&) { clip_grad_value(opt, *config_.clip_grad_value); });
  if (scaler_)
    chain_.step_with([this](Optimizer& opt, const parallel::GradShard& g) { return scaler_->step(opt, g.reduce); });
  if (scaler_)
    chain_.after([this](bool stepped) {
      scaler_->update();
      if (!stepped) ++result_.skipped_steps;
    });
  if (config_.ema_decay) chain_.after([this](bool) { averaged_->update(strategy_->own_params()); });
  if (step_scheduler_per_batch_)
    chain_.after([this](bool) {
      if (!swa_scheduler_) scheduler_->step();
    });
}

void Segment::keep_in_memory() {
  kept_.insert(kept_.begin(), checkpoint::keep_in_memory(comm_, *strategy_, run_info_, parts(), result_.steps));
  if (kept_.size() > 2) kept_.pop_back();
}

void Segment::save(int epoch) {
  const auto t0 = Clock::now();
  const checkpoint::SaveOptions where{config_.checkpoint_dir, config_.keep_checkpoints};
  if (checkpointing_) {
    result_.checkpoint_bytes = checkpoint::save(comm_, *strategy_, run_info_, parts(), where, result_.steps, epoch);
    ++result_.checkpoints_written;
  }
  if (in_memory_) {
    keep_in_memory();
    ++result_.checkpoints_in_memory;
  }
  result_.checkpoint_seconds += seconds_since(t0);
}

TrainResult Segment::run() {
  try {
    if (in_memory_) keep_in_memory();  // where this segment starts
    for (int epoch = first_epoch_; epoch <= config_.epochs && !stop_; ++epoch) train_epoch(epoch);
    finish();
  } catch (const RankLost& e) {
    if (config_.on_rank_failure != TrainConfig::OnRankFailure::go_on) throw;
    throw on_rank_lost(e);
  }
  return result_;
}

Segment::After Segment::train_epoch(int epoch) {
  epoch_now_ = epoch;
  sampler_->set_epoch(static_cast<std::uint64_t>(epoch - 1));
  epoch_start_ = Clock::now();
  epoch_loss_ = 0;
  epoch_count_ = 0;
  for (std::size_t k = epoch == first_epoch_ ? start_step_ % per_epoch_ : 0; k < per_epoch_; ++k)
    if (train_step(epoch, k) == After::stop) {
      stop_ = true;
      break;
    }
  end_epoch(epoch);  // also after a stop inside it
  return stop_ ? After::stop : After::next;
}

std::size_t Segment::load_batch(int epoch, std::size_t k) {
  const auto local = sampler_->local_batch(k, comm_.rank(), comm_.size());
  for (std::size_t i = 0; i < local.size(); ++i) {
    data_.train.fill(static_cast<std::uint64_t>(epoch - 1), local[i], xb_.data() + i * features_);
    yb_[i] = data_.train.y[local[i]];
  }
  return local.size();
}

Segment::After Segment::train_step(int epoch, std::size_t k) {
  // Forward and backward on this rank's piece of the batch.
  const auto global = sampler_->global_batch(k);
  const std::size_t local = load_batch(epoch, k);
  float scale = 1.0f / static_cast<float>(global.size());
  const double lr = optimizer_->lr(0);
  // With loss scaling, backward computes the gradient of loss * scale.
  const double loss_scale = scaler_ ? scaler_->scale(1.0f) : 0.0;
  if (scaler_) scale *= static_cast<float>(loss_scale);
  const models::BatchStats s = model_->forward_backward(strategy_->access(), xb_.data(), yb_.data(), local, scale);
  if (!evaluated_) {  // evaluation may grow the model's buffers past a step's
    model_bytes_[0] = std::max(model_bytes_[0], model_->activation_bytes());
    model_bytes_[1] = std::max(model_bytes_[1], model_->workspace_bytes());
  }
  // The step's loss gather starts, and runs while the strategy reduces and steps.
  mine_[0] = s.loss_sum;
  mine_[1] = s.count;
  mine_[2] = config_.stop_flag ? static_cast<double>(config_.stop_flag->load(std::memory_order_relaxed)) : 0.0;
  // (New ranks of a sharded run take the checkpoint written or kept
  // in memory when they are admitted: none without either; a gossip
  // graph may not exist at one rank more.)
  if (may_grow_ && comm_.rank() == 0) mine_[3] = comm_.pending_joins();
  gather_ = comm_.iall_gather(mine_, all_.data(), per_, ElemType::f64);
  chain_.begin_step();
  strategy_->step(chain_.update());
  applied_ = true;
  chain_.after_update();
  gather_->wait();
  gather_.reset();
  // Every rank has contributed to this step's gather, so every rank
  // finished keeping the last checkpoint in memory: the one before
  // it is no longer needed.
  if (kept_.size() > 1) kept_.pop_back();
  const Observed o = observe(epoch, k, lr, loss_scale);
  const bool stopping = o.stop_request > 0 || (config_.max_steps != 0 && result_.steps >= config_.max_steps);
  checkpoint_if_due(epoch, k, stopping);
  inject_fault();
  if (o.stop_request > 0) {
    result_.interrupted = true;
    result_.stop_signal = static_cast<int>(o.stop_request);
    return After::stop;
  }
  if (config_.max_steps != 0 && result_.steps >= config_.max_steps) return After::stop;
  // Processes wait to join: the world grows between this step and the
  // next (not after an epoch's last step: its end-of-epoch work first).
  if (o.joins > 0 && k + 1 < per_epoch_ && strategy_->admits_new_ranks() &&
      strategy_->can_run_at(world_ + static_cast<int>(o.joins)))
    admit(static_cast<int>(o.joins), epoch);
  return After::next;
}

Segment::Observed Segment::observe(int epoch, std::size_t k, double lr, double loss_scale) {
  Observed o;
  double loss_sum = 0, count = 0;
  int nonfinite_rank = -1;
  for (int r = 0; r < world_; ++r) {
    const double* v = all_.data() + per_ * static_cast<std::size_t>(r);
    loss_sum += v[0];
    count += v[1];
    o.stop_request = std::max(o.stop_request, v[2]);
    if (elastic_) o.joins = std::max(o.joins, v[3]);
    if (nonfinite_rank < 0 && !std::isfinite(v[0])) nonfinite_rank = r;
  }
  epoch_loss_ += loss_sum;
  epoch_count_ += count;
  ++result_.steps;
  applied_ = false;
  last_step_end_ = Clock::now();
  const double loss = loss_sum / count;
  const bool stepped = chain_.stepped();
  if (report_) {
    const double t = seconds_since(epoch_start_);
    reporting_.on_step({epoch, result_.steps, k + 1, per_epoch_, loss, lr, seconds_since(start_),
                        t > 0 ? epoch_count_ / t : 0, grad_norm_, loss_scale, !stepped, strategy_->bytes_sent()});
  }
  // Loss scaling skips steps with inf/NaN gradients on purpose: only a
  // step it took counts with its norm.
  const bool bad_norm = config_.clip_grad_norm && stepped && !std::isfinite(grad_norm_);
  if (!std::isfinite(loss) || bad_norm) {
    ++result_.nonfinite_steps;
    const std::string what = !std::isfinite(loss)
                                 ? str("the loss is ", show(loss),
                                       nonfinite_rank >= 0 ? str(" on rank ", nonfinite_rank) : std::string())
                                 : str("the total gradient norm is ", show(grad_norm_));
    const std::string last = std::isfinite(last_finite_loss_) ? str("the last finite loss was ", last_finite_loss_,
                                                                    ", at step ", last_finite_step_)
                                                              : std::string("no step had a finite loss");
    if (config_.on_nonfinite == TrainConfig::OnNonFinite::error)
      throw NonFiniteError(str("step ", result_.steps, ": ", what, " (", last,
                               "); lower --lr or clip gradients (--clip-grad-norm), or pass --on-nonfinite "
                               "warn|ignore to train on"),
                           comm_.rank());
    if (config_.on_nonfinite == TrainConfig::OnNonFinite::warn && !warned_ && report_)
      reporting_.on_warning(
          str("step ", result_.steps, ": ", what, " (", last, "); training goes on (--on-nonfinite warn)"));
    warned_ = true;
  } else {
    last_finite_loss_ = loss;
    last_finite_step_ = result_.steps;
  }
  return o;
}

// A checkpoint records the state between two steps. At an epoch's last step
// that is after the epoch's own work (evaluation, a per-epoch scheduler
// step), so it waits for it; a run stopping mid-epoch saves first, and
// resumes inside the same epoch.
void Segment::checkpoint_if_due(int epoch, std::size_t k, bool stopping) {
  if (!(checkpointing_ || in_memory_)) return;
  if (!(stopping || (config_.checkpoint_every > 0 && result_.steps % config_.checkpoint_every == 0))) return;
  if (k + 1 < per_epoch_) {
    save(epoch);
    last_saved_ = result_.steps;
  } else {
    save_after_epoch_ = true;
  }
}

// DISTOPT_FAULT (fault_from_env) on a rank of the world the run started
// with: survivors that go back to a checkpoint pass the step again, with
// that rank number held by another rank.
void Segment::inject_fault() const {
  const bool fault_here = first_ && fault_.rank == comm_.rank() && fault_.step == result_.steps &&
                          (fault_.kind == Fault::Kind::fail || fault_.kind == Fault::Kind::kill ||
                           fault_.kind == Fault::Kind::term || fault_.stalls(comm_.rank(), Fault::At::step));
  if (!fault_here) return;
  if (fault_.kind == Fault::Kind::term) {
    std::raise(SIGTERM);  // (the tool's handler asks the ranks to stop)
    return;
  }
  if (fault_.kind == Fault::Kind::fail)
    throw Error(str("rank ", comm_.rank(), " failed after step ", result_.steps, " (DISTOPT_FAULT)"));
  if (config_.process_per_rank) std::raise(fault_.kind == Fault::Kind::kill ? SIGKILL : SIGSTOP);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

void Segment::admit(int joins, int epoch) {
  Interruption out{std::nullopt, str("admitting ", joins, " new rank(s)"), last_step_end_, result_.steps, {}};
  out.joins = joins;
  if (strategy_->info().per_rank_models) strategy_->complete_in_flight();  // nothing dropped
  const std::optional<parallel::LocalState> local = strategy_->survivor_state();
  if (strategy_->info().replicated_params && !strategy_->info().per_rank_models) {
    out.state = checkpoint::capture(*strategy_, run_info_, parts(), result_.steps);
  } else if (local) {
    // Gossip ranks go on from their own models (the new ones from
    // rank 0's), as after a loss, but with nothing lost.
    out.state = checkpoint::capture_survivor(*strategy_, run_info_, parts(), *local, comm_.rank(), comm_.size());
  } else if (last_saved_ != result_.steps) {
    save(epoch);  // the new ranks read their shards from it (on disk or kept in memory)
    last_saved_ = result_.steps;
  }
  add_counts(out.counts, result_);
  out.memory = std::move(kept_);
  throw out;
}

void Segment::end_epoch(int epoch) {
  const double epoch_seconds = seconds_since(epoch_start_);
  train_seconds_ += epoch_seconds;
  train_samples_ += epoch_count_;
  const models::BatchStats test = evaluate(comm_, *model_, strategy_->eval_access(), data_.test, eval_chunk_);
  evaluated_ = true;
  result_.consensus_distance = strategy_->consensus_distance();
  const double none = std::nan("");  // nothing measured: reported as null
  result_.train_loss = epoch_count_ > 0 ? epoch_loss_ / epoch_count_ : none;
  result_.test_loss = test.count > 0 ? test.loss_sum / test.count : none;
  result_.test_accuracy = test.count > 0 ? test.correct / test.count : none;
  // SWA: average at the end of epoch swa_start and every later one; with
  // swa_lr, SWALR then steps per epoch in place of the main scheduler
  // (torch's recipe: update_parameters, then swa_scheduler.step()).
  const bool swa_epoch = config_.swa_start > 0 && epoch >= config_.swa_start;
  if (swa_epoch) {
    averaged_->update(strategy_->own_params());
    if (config_.swa_lr && !swa_scheduler_)
      swa_scheduler_ = std::make_unique<SWALR>(*optimizer_, std::vector<double>{*config_.swa_lr},
                                               config_.swa_anneal_epochs, config_.swa_anneal_strategy);
  }
  if (swa_scheduler_) {
    swa_scheduler_->step();
  } else if (scheduler_ && !step_scheduler_per_batch_) {
    if (scheduler_->needs_metric()) scheduler_->step(result_.test_loss);
    else scheduler_->step();
  }
  EpochMetrics em{epoch,
                  result_.steps,
                  result_.train_loss,
                  result_.test_loss,
                  result_.test_accuracy,
                  epoch_seconds > 0 ? epoch_count_ / epoch_seconds : 0,
                  /*wall_s, below*/ 0};
  em.consensus_distance = result_.consensus_distance;
  if (averaged_ && averaged_->n_averaged() > 0) {
    // Each rank holds the average of its own values; each evaluates its piece of the test set.
    const auto access = strategy_->access_to(averaged_->params());
    const models::BatchStats a = evaluate(comm_, *model_, *access, data_.test, eval_chunk_);
    em.averaged = true;
    em.avg_test_loss = a.count > 0 ? a.loss_sum / a.count : none;
    em.avg_test_accuracy = a.count > 0 ? a.correct / a.count : none;
    if (!result_.averaged) result_.averaged.emplace();
    result_.averaged->test_loss = em.avg_test_loss;
    result_.averaged->test_accuracy = em.avg_test_accuracy;
  }
  em.wall_s = seconds_since(start_);
  if (report_) reporting_.on_epoch(em);
  if (save_after_epoch_) {
    save(epoch);
    last_saved_ = result_.steps;
    save_after_epoch_ = false;
  }
}

// The run's end: its model evaluated (a resumed run with nothing left to
// train too), its last checkpoint, and the parameters hashed as they are
// gathered (XXH3 of the concatenation, as hash_params), kept where asked.
void Segment::finish() {
  if (!evaluated_) {
    const models::BatchStats test = evaluate(comm_, *model_, strategy_->eval_access(), data_.test, eval_chunk_);
    result_.train_loss = std::nan("");
    result_.test_loss = test.count > 0 ? test.loss_sum / test.count : std::nan("");
    result_.test_accuracy = test.count > 0 ? test.correct / test.count : std::nan("");
  }
  if (checkpointing_ && last_saved_ != result_.steps) save(epoch_now_);
  result_.samples_per_s = train_seconds_ > 0 ? train_samples_ / train_seconds_ : 0;
  result_.memory = strategy_->memory();
  result_.memory.activations = model_bytes_[0];  // a training step's, before any evaluation
  result_.memory.workspaces = model_bytes_[1];
  using KeepParams = TrainConfig::KeepParams;
  const bool keep = config_.keep_params == KeepParams::every_rank ||
                    (config_.keep_params == KeepParams::rank0 && comm_.rank() == 0);
  // `own`: values shaped like own_params(); null: the current parameters.
  auto gathered = [&](const std::span<const float>* own, std::vector<float>& params, std::string& hash) {
    const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> owner(XXH3_createState(), XXH3_freeState);
    XXH3_state_t* state = owner.get();
    DISTOPT_CHECK(state != nullptr && XXH3_64bits_reset(state) == XXH_OK);
    if (keep) params.reserve(strategy_->layout().param_elements());
    const parallel::Strategy::ParamVisitor visit = [&](std::size_t, std::span<const float> values) {
      XXH3_64bits_update(state, values.data(), values.size_bytes());
      if (keep) params.insert(params.end(), values.begin(), values.end());
    };
    if (own != nullptr) strategy_->for_each_param(*own, visit);
    else strategy_->for_each_current_param(visit);
    hash = hex64(XXH3_64bits_digest(state));
  };
  gathered(nullptr, result_.params, result_.param_hash);
  result_.bytes_sent = strategy_->bytes_sent();
  std::size_t offset = 0;
  for (const ParamSlot& s : layout_.params) {
    result_.slots.push_back({s.name, offset, s.shape});
    offset += s.numel();
  }
  if (scaler_) result_.loss_scale = scaler_->get_scale();
  if (result_.averaged) {
    result_.averaged->kind = averaged_->options().kind;
    result_.averaged->n_averaged = averaged_->n_averaged();
    const std::span<const float> own = averaged_->params();
    gathered(&own, result_.averaged->params, result_.averaged->param_hash);
  }
}

// A rank was lost: what the survivors go on from.
Interruption Segment::on_rank_lost(const RankLost& e) {
  if (gather_) {  // the step's loss gather, failed too: done with its buffers
    try {
      gather_->wait();
    } catch (const CommError&) {
    }
    gather_.reset();
  }
  // Every survivor is in the same collective (the first the lost rank
  // missed), so they agree on the step: one that updated the parameters
  // counts as done (its loss is not known).
  std::size_t done = result_.steps + (applied_ ? 1 : 0);
  const parallel::StrategyInfo& info = strategy_->info();
  // A gossip survivor goes on from its own model.
  const std::optional<parallel::LocalState> local = strategy_->survivor_state();
  if (local && local->steps > done) {
    // Its update was applied and its mixing failed: the step counts as
    // done, and what follows an update follows it.
    chain_.after_update();
    done = local->steps;
  }
  Interruption out{std::nullopt, e.what(), last_step_end_, done, {}};
  add_counts(out.counts, result_);
  if (info.replicated_params && !info.per_rank_models) {
    out.state = checkpoint::capture(*strategy_, run_info_, parts(), done);
  } else if (local) {
    out.state = checkpoint::capture_survivor(*strategy_, run_info_, parts(), *local, comm_.rank(), comm_.size());
  } else if (config_.checkpoint_dir.empty() && !in_memory_) {
    // A sharded strategy: the lost rank held the only copy of its shard.
    throw InvalidInput(
        str("--strategy ", config_.strategy, ": a rank was lost and there is no checkpoint to go back to"));
  }
  out.memory = std::move(kept_);
  return out;
}

}  // namespace distopt::train
