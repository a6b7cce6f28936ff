#include "distopt/train/trainer.hpp"

#include <xxhash.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "distopt/core/error.hpp"
#include "distopt/core/fp_mode.hpp"
#include "distopt/data/sampler.hpp"
#include "distopt/models/model.hpp"
#include "distopt/optim/clip.hpp"

namespace distopt::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sums of a data set's loss, correct predictions and count over all ranks:
// each rank evaluates its contiguous piece.
models::BatchStats evaluate(Communicator& comm, models::Model& model, models::UnitAccess& access,
                            const data::Dataset& d) {
  const Piece piece = piece_of(d.size(), comm.size(), comm.rank());
  const models::BatchStats s =
      model.evaluate(access, d.sample(piece.offset), d.y.data() + piece.offset, piece.count);
  double sums[3] = {s.loss_sum, s.correct, s.count};
  comm.all_reduce(sums, sums, 3, ElemType::f64, ReduceOp::sum);
  return {sums[0], sums[1], sums[2]};
}

void validate(const Communicator& comm, const data::Split& data, const TrainConfig& c) {
  if (c.epochs < 1) throw InvalidInput(str("--epochs must be at least 1 (got ", c.epochs, ")"));
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
  if (c.swa_start > 0 && c.max_steps > 0) {
    // A run cut short by --max-steps ends in epoch ceil(max_steps / per_epoch).
    const std::size_t per_epoch =
        data::BatchSampler(data.train.size(), c.batch_size, c.seed, c.drop_last).batches_per_epoch();
    const std::size_t last = (c.max_steps + per_epoch - 1) / per_epoch;
    if (last < static_cast<std::size_t>(c.swa_start))
      throw InvalidInput(str("--max-steps ", c.max_steps, " ends training in epoch ", last, " (", per_epoch,
                             " steps each), before --swa-start ", c.swa_start, ": nothing would be averaged"));
  }
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
  }
}

}  // namespace

std::string hash_params(const std::vector<float>& params) {
  const XXH64_hash_t h = XXH3_64bits(params.data(), params.size() * sizeof(float));
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

TrainResult train(Communicator& comm, const data::Split& data, const TrainConfig& config, Observer* observer) {
  validate(comm, data, config);
  const DenormalMode denormals(config.flush_denormals ? DenormalMode::flush : DenormalMode::ieee);
  auto model = models::make_model(config.model, data.train.features, data.train.classes, config.hidden);
  const parallel::FlatLayout layout = parallel::flat_layout(*model);
  std::vector<float> initial(layout.elements);
  model->init(initial, config.seed);
  auto strategy = parallel::make_strategy(config.strategy, comm, layout, initial, config.optimizer, config.parallel);
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
  const std::size_t own_elements = strategy->own_params().size();
  if (config.swa_start > 0) averaged.emplace(own_elements, AveragingOptions{AveragingKind::swa, 0.0, {}});
  if (config.ema_decay) averaged.emplace(own_elements, AveragingOptions{AveragingKind::ema, *config.ema_decay, {}});
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
  const bool report = observer != nullptr && comm.rank() == 0;
  if (report) observer->on_start(config.epochs, per_epoch);

  // This rank's piece of a batch, gathered contiguously.
  // (A batch never holds more than the training set.)
  const std::size_t per_rank = std::min(config.batch_size, data.train.size()) / comm.size() + 1;
  std::vector<float> xb(per_rank * features), yb(per_rank);

  // The per-step loss reduction runs while the step does; if the step
  // throws, the request must not outlive `sums`.
  double sums[2] = {0, 0};
  std::unique_ptr<Request> loss_sum;
  struct WaitOnExit {
    std::unique_ptr<Request>& r;
    ~WaitOnExit() {
      if (r) try {
          r->wait();
        } catch (...) {
        }
    }
  } wait_on_exit{loss_sum};

  TrainResult result;
  const auto start = Clock::now();
  double train_seconds = 0, train_samples = 0;
  bool stop = false;
  for (int epoch = 1; epoch <= config.epochs && !stop; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch - 1));
    const auto epoch_start = Clock::now();
    double epoch_loss = 0, epoch_count = 0;
    for (std::size_t k = 0; k < per_epoch; ++k) {
      const auto global = sampler.global_batch(k);
      const auto local = sampler.local_batch(k, comm.rank(), comm.size());
      for (std::size_t i = 0; i < local.size(); ++i) {
        const float* src = data.train.sample(local[i]);
        std::copy(src, src + features, xb.data() + i * features);
        yb[i] = data.train.y[local[i]];
      }
      float scale = 1.0f / static_cast<float>(global.size());
      const double lr = optimizer.lr(0);
      // With loss scaling, backward computes the gradient of loss * scale.
      const double loss_scale = scaler ? scaler->scale(1.0f) : 0.0;
      if (scaler) scale *= static_cast<float>(loss_scale);
      const models::BatchStats s =
          model->forward_backward(strategy->access(), xb.data(), yb.data(), local.size(), scale);
      // The batch's loss is summed over ranks while the step runs.
      sums[0] = s.loss_sum;
      sums[1] = s.count;
      loss_sum = comm.iall_reduce(sums, sums, 2, ElemType::f64, ReduceOp::sum);
      stepped = true;
      strategy->step(update);
      if (scaler) {
        scaler->update();
        if (!stepped) ++result.skipped_steps;
      }
      if (config.ema_decay) averaged->update(strategy->own_params());
      const bool main_scheduler_active = !swa_scheduler;
      if (step_scheduler_per_batch && main_scheduler_active) scheduler->step();
      loss_sum->wait();
      loss_sum.reset();
      epoch_loss += sums[0];
      epoch_count += sums[1];
      ++result.steps;
      if (report) {
        const double t = seconds_since(epoch_start);
        observer->on_step({epoch, result.steps, k + 1, per_epoch, sums[0] / sums[1], lr, seconds_since(start),
                           t > 0 ? epoch_count / t : 0, grad_norm, loss_scale, !stepped});
      }
      if (config.max_steps != 0 && result.steps >= config.max_steps) {
        stop = true;
        break;
      }
    }
    const double epoch_seconds = seconds_since(epoch_start);
    train_seconds += epoch_seconds;
    train_samples += epoch_count;
    const models::BatchStats test = evaluate(comm, *model, strategy->access(), data.test);
    result.train_loss = epoch_count > 0 ? epoch_loss / epoch_count : 0;
    result.test_loss = test.count > 0 ? test.loss_sum / test.count : 0;
    result.test_accuracy = test.count > 0 ? test.correct / test.count : 0;
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
      if (scheduler->needs_metric())
        scheduler->step(result.test_loss);
      else
        scheduler->step();
    }
    EpochMetrics em{epoch, result.steps, result.train_loss, result.test_loss, result.test_accuracy,
                    epoch_seconds > 0 ? epoch_count / epoch_seconds : 0, /*wall_s, below*/ 0};
    if (averaged && averaged->n_averaged() > 0) {
      // Each rank holds the average of its own values; each evaluates its piece of the test set.
      const auto access = strategy->access_to(averaged->params());
      const models::BatchStats a = evaluate(comm, *model, *access, data.test);
      em.averaged = true;
      em.avg_test_loss = a.count > 0 ? a.loss_sum / a.count : 0;
      em.avg_test_accuracy = a.count > 0 ? a.correct / a.count : 0;
      if (!result.averaged) result.averaged.emplace();
      result.averaged->test_loss = em.avg_test_loss;
      result.averaged->test_accuracy = em.avg_test_accuracy;
    }
    em.wall_s = seconds_since(start);
    if (report) observer->on_epoch(em);
  }
  result.samples_per_s = train_seconds > 0 ? train_samples / train_seconds : 0;
  result.memory = strategy->memory();
  result.params = strategy->gather_params();
  result.bytes_sent = strategy->bytes_sent();
  std::size_t offset = 0;
  for (const ParamSlot& s : layout.params) {
    result.slots.push_back({s.name, offset, s.shape});
    offset += s.numel();
  }
  result.param_hash = hash_params(result.params);
  if (scaler) result.loss_scale = scaler->get_scale();
  if (result.averaged) {
    result.averaged->kind = averaged->options().kind;
    result.averaged->n_averaged = averaged->n_averaged();
    result.averaged->params = strategy->gather(averaged->params());
    result.averaged->param_hash = hash_params(result.averaged->params);
  }
  return result;
}

}  // namespace distopt::train
