#include "trainer_client/trainer.h"

#include <algorithm>
#include <cmath>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/optimizer.h"
#include "common/status_macros.h"

namespace pshard {
Trainer::Trainer(ShardClient* client, const TokenDataset* data, TrainerOptions options,
                 std::unique_ptr<UnitModel> model)
    : client_(client), data_(data), options_(options), model_(std::move(model)) {
  tokens_.resize(static_cast<size_t>(options.batch) * options.seq_len);
  targets_.resize(tokens_.size());
}

UnitModelOptions Trainer::ModelOptions(const ShardClient& client, const TrainerOptions& options) {
  UnitModelOptions model;
  model.batch = options.batch;
  model.seq_len = options.seq_len;
  model.recompute_blocks = options.recompute_blocks;
  model.device = options.device;
  model.prefetch_depth = options.prefetch_depth;
  model.lanes = options.fetch_once_per_step ? client.job().micro_batches : 1;
  model.attention = options.attention;
  return model;
}

absl::Status Trainer::CheckOptions(const ShardClient& client, const TrainerOptions& options) {
  if (options.prefetch_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch depth ", options.prefetch_depth, " < 0"));
  }
  if (options.stage < 1 || options.stage > 3) {
    return absl::InvalidArgumentError(absl::StrCat("ZeRO stage ", options.stage, " is not 1, 2 or 3"));
  }
  if (options.secondary_shard > 0 &&
      (options.group == nullptr || options.group->size() != options.secondary_shard)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resharding to a group of ", options.secondary_shard,
        " after forward keeps a secondary shard within the trainer's fabric group, which ",
        options.group == nullptr ? std::string("it has not")
                                 : absl::StrCat("has ", options.group->size(), " members"),
        ": the group size must be ", options.secondary_shard, " (--fabric_group_size, or the topology's groups)"));
  }
  if (options.group != nullptr) {
    const int first = client.options().trainer_rank - options.group->rank();
    if (!IsReductionTreeNode(client.job().num_trainers, first, options.group->size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a fabric group of ranks [", first, ", ", first + options.group->size(), ") does not align with the ",
          client.job().num_trainers, " trainers' reduction tree (use aligned power-of-two groups)"));
    }
  }
  if (options.fetch_once_per_step && client.job().micro_batches > 1 && !client.job().accumulate_on_trainer) {
    return absl::InvalidArgumentError(
        "fetching once per step runs all micro-batches in one pass and pushes their sum: it needs a job that "
        "accumulates on the trainer (accumulate_on_trainer)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(ShardClient* client, const TokenDataset* data,
                                                         TrainerOptions options, std::unique_ptr<UnitModel> model) {
  RETURN_IF_ERROR(CheckOptions(*client, options));
  if (model == nullptr || model->lanes() != ModelOptions(*client, options).lanes ||
      model->num_units() != static_cast<int>(client->layout().spec.units.size())) {
    return absl::InvalidArgumentError("the model given does not fit the trainer's options and job");
  }
  return std::unique_ptr<Trainer>(new Trainer(client, data, options, std::move(model)));
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(ShardClient* client, const TokenDataset* data,
                                                         TrainerOptions options) {
  RETURN_IF_ERROR(CheckOptions(*client, options));
  ASSIGN_OR_RETURN(std::unique_ptr<UnitModel> model,
                   CreateUnitModel(client->layout().spec, ModelOptions(*client, options)));
  return Create(client, data, options, std::move(model));
}

absl::StatusOr<StepReport> Trainer::RunStep(int64_t step) {
  const absl::Time step_start = absl::Now();
  const JobConfig& job = client_->job();
  const int units = model_->num_units();
  StepReport report;
  report.step = step;
  TransferLog log;
  IntervalUnion data;
  std::vector<TreeReducer> accumulated;
  if (job.accumulate_on_trainer) accumulated.assign(units, TreeReducer(job.micro_batches));
  std::vector<std::shared_ptr<UnitTransfer>> pushes;
  auto wait_pushes = [&pushes] {
    absl::Status first;
    for (auto& p : pushes) {
      absl::Status s = p->Wait();
      if (first.ok()) first = s;
    }
    return first;
  };

  // One pass per micro-batch, or one for all of them (fetch_once_per_step):
  // the model then sums them and each unit is pushed as soon as it is done.
  const int lanes = model_->lanes();
  const bool one_pass = lanes == job.micro_batches && lanes > 1;
  // Stage 2 (and 1): the step's replica, fetched by its first pass.
  std::vector<std::shared_ptr<UnitTransfer>> resident(options_.stage < 3 ? units : 0);
  absl::Status status;
  for (int micro = 0; micro < job.micro_batches && status.ok(); micro += lanes) {
    status = RunPass(step, micro, &report, &log, &data,
                     job.accumulate_on_trainer && !one_pass ? &accumulated : nullptr, &pushes,
                     resident.empty() ? nullptr : &resident);
  }
  for (int u = units - 1; u >= 0 && status.ok() && job.accumulate_on_trainer && !one_pass; --u) {
    status = PushUnit(u, step, /*micro=*/0, accumulated[u].TakeTotal(), &log, &pushes);
  }
  const absl::Time wait_start = absl::Now();
  absl::Status pushed = wait_pushes();
  const absl::Time wait_end = absl::Now();
  log.busy.Add(wait_start, wait_end);
  log.waits.Add(wait_start, wait_end);
  // Also waits for whatever the model still runs (nothing, after a good
  // step), so it is taken on failure too.
  absl::StatusOr<ModelTimeline> timeline = model_->TakeTimeline();
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(pushed);
  RETURN_IF_ERROR(timeline.status());

  for (auto& p : pushes) {
    log.busy.Add(p->started(), p->finished());
    log.bytes_pushed += p->wire_bytes();
    log.payload_pushed += p->payload_bytes();
    log.push_latencies.push_back(p->finished() - p->started());
  }
  // The model's copies to and from its device are communication; time spent
  // waiting on communication is exposed only while the model is not
  // computing (a device model computes while this thread waits).
  log.busy.Add(timeline->transfer);
  log.waits.Add(timeline->transfer);
  IntervalUnion compute;
  compute.Add(timeline->compute);
  IntervalUnion compute_or_comm = compute;
  compute_or_comm.Add(log.waits);
  IntervalUnion any = compute_or_comm;
  any.Add(data);
  StepTimes& times = report.times;
  times.wall = absl::Now() - step_start;
  times.compute = compute.Total();
  times.comm_exposed = compute_or_comm.Total() - times.compute;
  times.data = any.Total() - compute_or_comm.Total();
  times.comm_busy = log.busy.Total();
  times.other = times.wall - times.compute - times.comm_exposed - times.data;
  report.loss /= job.micro_batches;
  report.grad_norm = std::sqrt(report.grad_norm / job.micro_batches);
  report.tokens = static_cast<int64_t>(tokens_.size()) * job.micro_batches;
  report.flops = model_->FlopsPerMicroBatch() * job.micro_batches;
  report.bytes_fetched = log.bytes_fetched;
  report.bytes_pushed = log.bytes_pushed;
  report.payload_fetched = log.payload_fetched;
  report.payload_pushed = log.payload_pushed;
  report.fabric_gathered = log.fabric_gathered;
  report.fabric_reduced = log.fabric_reduced;
  report.fetch_latencies = std::move(log.fetch_latencies);
  report.push_latencies = std::move(log.push_latencies);
  return report;
}

absl::StatusOr<EvalReport> Trainer::Evaluate(int64_t version, const TokenDataset& data, int batches,
                                             uint64_t seed) {
  if (batches < 1) return absl::InvalidArgumentError(absl::StrCat("evaluation batches ", batches, " must be >= 1"));
  const absl::Time start = absl::Now();
  const int lanes = model_->lanes();
  const int k = model_->num_units();
  std::vector<int> schedule(k);
  for (int u = 0; u < k; ++u) schedule[u] = u;
  EvalReport report;
  report.version = version;
  absl::Status status;
  for (int micro = 0; micro < batches && status.ok(); micro += lanes) {
    for (int lane = 0; lane < lanes && status.ok(); ++lane) {
      // Step 0 and rank 0 for every evaluation and trainer: the same text.
      status = data.SampleBatch(seed, /*step=*/0, /*rank=*/0, micro + lane, options_.batch, options_.seq_len, tokens_,
                                targets_);
      if (status.ok()) status = model_->SetBatch(lane, tokens_, targets_);
    }
    TransferLog log;
    {
      Prefetcher prefetch(client_, options_.group, schedule, version, options_.prefetch_depth, &log);
      for (int u = 0; u < k && status.ok(); ++u) {
        absl::StatusOr<std::shared_ptr<UnitTransfer>> w = prefetch.Get(u);
        status = w.ok() ? model_->ForwardUnit(u, (*w)->values()) : w.status();
      }
    }
    report.bytes_fetched += log.bytes_fetched;
    for (int lane = 0; lane < lanes && status.ok(); ++lane) {
      absl::StatusOr<double> loss = model_->Loss(lane);
      if (!loss.ok()) {
        status = loss.status();
        break;
      }
      report.loss += *loss;
      ++report.batches;
    }
  }
  // The evaluation's compute belongs to no step.
  absl::StatusOr<ModelTimeline> timeline = model_->TakeTimeline();
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(timeline.status());
  report.loss /= report.batches;
  report.tokens = static_cast<int64_t>(tokens_.size()) * report.batches;
  report.wall = absl::Now() - start;
  return report;
}

absl::Status Trainer::RunPass(int64_t step, int first_micro, StepReport* report, TransferLog* log,
                              IntervalUnion* data, std::vector<TreeReducer>* accumulated,
                              std::vector<std::shared_ptr<UnitTransfer>>* pushes,
                              std::vector<std::shared_ptr<UnitTransfer>>* resident) {
  const absl::Time data_start = absl::Now();
  const int lanes = model_->lanes();
  for (int lane = 0; lane < lanes; ++lane) {
    RETURN_IF_ERROR(data_->SampleBatch(options_.data_seed, step, rank(), first_micro + lane, options_.batch,
                                       options_.seq_len, tokens_, targets_));
    RETURN_IF_ERROR(model_->SetBatch(lane, tokens_, targets_));
  }
  data->Add(data_start, absl::Now());

  // Forward 0..K-1, then backward K-2..0: the last unit stays from forward.
  // Without resharding after forward, every unit stays, and backward
  // fetches nothing; at stage 2 the step's first pass fetches every unit
  // once, in forward, and the others fetch nothing.
  // With a secondary shard, each unit but the last keeps this member's
  // part from forward, and backward all-gathers the rest in the group.
  const int k = model_->num_units();
  const bool keep = !options_.reshard_after_forward || resident != nullptr;
  const bool regather = !keep && options_.secondary_shard > 0;
  std::vector<int> schedule;
  for (int u = 0; u < k; ++u) {
    if (resident == nullptr || (*resident)[u] == nullptr) schedule.push_back(u);
  }
  for (int u = k - 2; u >= 0 && !keep && !regather; --u) schedule.push_back(u);
  Prefetcher prefetch(client_, options_.group, schedule, step, options_.prefetch_depth, log);
  std::vector<std::shared_ptr<UnitTransfer>> kept(k);
  std::vector<std::vector<float>> parts(regather ? k : 0);  // this member's part of each unit

  // A device model returns from each call at once: while a unit computes,
  // this thread waits for the next unit's fetch and hands it over.
  size_t position = 0;
  for (int u = 0; u < k; ++u) {
    std::shared_ptr<UnitTransfer> w = resident != nullptr ? (*resident)[u] : nullptr;
    if (w == nullptr) {
      ASSIGN_OR_RETURN(w, prefetch.Get(position++));
      if (resident != nullptr) (*resident)[u] = w;
    }
    RETURN_IF_ERROR(model_->ForwardUnit(u, w->values()));
    if (keep || u == k - 1) {
      kept[u] = w;
    } else if (regather) {
      const GroupOwnership owned = ShardOwnership(client_->layout().partitions[u], options_.group->size());
      const std::vector<ElementRange>& mine = owned[options_.group->rank()];
      parts[u].resize(static_cast<size_t>(RangeElements(mine)));
      PackRanges(w->values(), mine, parts[u].data());
    }
  }

  // Backward: a device model keeps a second backward running while the
  // previous unit's gradient comes back and is pushed.
  struct PendingGradient {
    int unit;
    std::vector<float> grads;
  };
  std::deque<PendingGradient> pending;
  const size_t max_pending = model_->asynchronous() ? UnitModel::kMaxPendingBackward : 1;
  double grad_sum_of_squares = 0.0;
  auto finish_oldest = [&]() -> absl::Status {
    PendingGradient done = std::move(pending.front());
    pending.pop_front();
    RETURN_IF_ERROR(model_->FinishBackward(done.unit));
    grad_sum_of_squares += SumOfSquares(done.grads);
    if (accumulated != nullptr) return (*accumulated)[done.unit].Add(first_micro, lanes, std::move(done.grads));
    // A pass over every micro-batch pushes their sum, as accumulation does.
    return PushUnit(done.unit, step, lanes > 1 ? 0 : first_micro, std::move(done.grads), log, pushes);
  };
  for (int u = k - 1; u >= 0; --u) {
    std::shared_ptr<UnitTransfer> w = std::move(kept[u]);
    std::vector<float> regathered;
    if (w == nullptr && regather) {
      ASSIGN_OR_RETURN(regathered, Regather(u, parts[u], log));
      parts[u] = {};
    } else if (w == nullptr) {
      ASSIGN_OR_RETURN(w, prefetch.Get(position++));
    }
    pending.push_back({u, client_->GradientBuffer(u)});
    RETURN_IF_ERROR(model_->BackwardUnit(u, w != nullptr ? w->values() : regathered, pending.back().grads));
    w.reset();  // drop the weights as soon as the model has them
    regathered = {};
    while (pending.size() >= max_pending) RETURN_IF_ERROR(finish_oldest());
  }
  while (!pending.empty()) RETURN_IF_ERROR(finish_oldest());
  for (int lane = 0; lane < lanes; ++lane) {
    ASSIGN_OR_RETURN(const double loss, model_->Loss(lane));
    report->loss += loss;
  }
  // Squared; RunStep divides by the micro-batches and takes the root: the
  // RMS of the micro-batches' gradient norms, or with all of them in one
  // pass, the norm of their mean gradient.
  report->grad_norm += grad_sum_of_squares / lanes;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Trainer::Regather(int unit, const std::vector<float>& part, TransferLog* log) {
  // Group communication on this thread: exposed, as a fetch's wait is.
  const absl::Time t0 = absl::Now();
  GroupCollective* group = options_.group;
  const UnitPartition& p = client_->layout().partitions[unit];
  const GroupOwnership owned = ShardOwnership(p, group->size());
  std::vector<float> buffer(static_cast<size_t>(p.padded_numel()), 0.0f);
  UnpackRanges(part.data(), owned[group->rank()], buffer);
  absl::StatusOr<int64_t> gathered =
      AllGatherWeights(*group, buffer, owned, client_->options().encodings.weight_format());
  const absl::Time t1 = absl::Now();
  log->busy.Add(t0, t1);
  log->waits.Add(t0, t1);
  RETURN_IF_ERROR(gathered.status());
  log->fabric_gathered += *gathered;
  return buffer;
}

absl::Status Trainer::PushUnit(int unit, int64_t step, int micro, std::vector<float> grads, TransferLog* log,
                               std::vector<std::shared_ptr<UnitTransfer>>* pushes) {
  // Reducing within the group and issuing the push are communication work
  // on this thread: exposed.
  const absl::Time t0 = absl::Now();
  ShardClient::PushOptions push;
  push.micro_batch = micro;
  if (GroupCollective* group = options_.group; group != nullptr) {
    const GroupOwnership owned = ShardOwnership(client_->layout().partitions[unit], group->size());
    ASSIGN_OR_RETURN(const int64_t reduced,
                     ReduceScatterGradients(*group, grads, owned, client_->options().encodings.grad_format(),
                                            client_->GroupResidual(unit)));
    log->fabric_reduced += reduced;
    push.first_rank = rank() - group->rank();
    push.rank_count = group->size();
    push.shards = MemberShards(client_->job().num_shards, group->size(), group->rank());
  }
  pushes->push_back(client_->StartPush(unit, step, std::move(grads), push));
  const absl::Time t1 = absl::Now();
  log->busy.Add(t0, t1);
  log->waits.Add(t0, t1);
  return absl::OkStatus();
}

}  // namespace pshard
