// The training loop (docs/architecture.md, "The training loop"): the
// configuration's checks, DISTOPT_FAULT, and train(), a loop over segments
// (segment.hpp) with a re-forming of the world between two (membership.hpp).
#include "distopt/train/trainer.hpp"

#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "distopt/core/error.hpp"
#include "distopt/data/sampler.hpp"
#include "membership.hpp"
#include "segment.hpp"

namespace distopt::train {

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
  if (c.parallel.grad_compression == parallel::GradCompression::onebit && (c.clip_grad_norm || c.clip_grad_value))
    throw InvalidInput(
        "--clip-grad-norm/--clip-grad-value with --grad-compression onebit: after its warm-up the step takes the "
        "ranks' averaged moment, not a gradient that could be clipped");
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
    // int8 and PowerSGD carry what they could not send into the next step,
    // in the units of the gradient they saw: a scale that changes (or a
    // skipped step, whose sum is discarded) would leave the residual in
    // the wrong units. They compress f32 gradients, which need no scale.
    const parallel::GradCompression gc = c.parallel.grad_compression;
    if (gc == parallel::GradCompression::int8 || gc == parallel::GradCompression::powersgd ||
        gc == parallel::GradCompression::onebit)
      throw InvalidInput(str("--loss-scale with --grad-compression ", parallel::name_of(gc),
                             ": its error feedback is kept in the gradient's units, which a loss scale changes; "
                             "compressed gradients are f32 and need no loss scale"));
  }
}

std::string hash_params(const std::vector<float>& params) {
  return hex64(XXH3_64bits(params.data(), params.size() * sizeof(float)));
}

TrainResult train(Communicator& comm, const data::Split& data, const TrainConfig& config, Observer* observer) {
  membership::World world{&comm, nullptr};
  TrainConfig c = config;
  c.joining = false;
  std::vector<MembershipChange> changes;
  TrainResult counts;  // the counters of the segments before
  const parallel::StrategyInfo& info = parallel::strategy_or_throw(config.strategy);
  std::optional<Interruption> pending;
  if (config.joining) pending = membership::joining();
  for (;;) {
    if (!pending) {
      try {
        TrainResult r = Segment(*world.comm, data, c, observer, changes.empty() && !config.joining).run();
        r.membership = std::move(changes);
        r.rank_at_end = world.comm->rank();
        add_counts(r, counts);
        return r;
      } catch (Interruption& s) {
        pending = std::move(s);
      } catch (const RankLost& e) {
        if (config.on_rank_failure != TrainConfig::OnRankFailure::go_on) throw;
        pending = membership::lost_in_setup(e, c, info);
      }
    }
    add_counts(counts, pending->counts);
    membership::Resumption next = membership::reform(world, std::move(*pending), c, info);
    pending.reset();
    c.resume = std::move(next.resume);
    reporting_of(*world.comm, observer, config).on_membership(next.change);
    changes.push_back(std::move(next.change));
  }
}

}  // namespace distopt::train
