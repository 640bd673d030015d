#include "shard_server/shard_state.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard {
namespace {

ContributionId Id(int trainer, int64_t step, int unit) {
  ContributionId id;
  id.trainer = trainer;
  id.step = step;
  id.unit = unit;
  return id;
}

using ::testing::HasSubstr;
using ::testing::Not;

// Units: embed (160 elements), block0 (872), head (144).
JobConfig SmallJob(int shards, int trainers) {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 1, .d_model = 8, .num_heads = 2, .context = 4, .vocab = 16}).value();
  job.optimizer.lr = 1e-2;
  job.optimizer.min_lr = 1e-3;
  job.optimizer.warmup_steps = 2;  // lr(0) = lr / 2, lr(1) = lr
  job.optimizer.total_steps = 0;   // constant after warm-up
  job.optimizer.beta1 = 0.9;
  job.optimizer.beta2 = 0.95;
  job.optimizer.eps = 1e-8;
  job.optimizer.weight_decay = 0.1;
  job.optimizer.grad_clip = 1.0;
  job.seed = 99;
  job.num_shards = shards;
  job.num_trainers = trainers;
  job.slice_alignment = 8;
  job.deterministic = true;
  return job;
}

std::unique_ptr<ShardState> MakeState(const JobConfig& job, int shard) {
  auto state = ShardState::Create(job, shard);
  EXPECT_TRUE(state.ok()) << state.status();
  return state.ok() ? std::move(*state) : nullptr;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A gradient slice with mixed signs and magnitudes that differ per trainer;
// the padding (past `valid`) is zero, as trainers send it.
std::vector<float> GradientSlice(int64_t length, int64_t valid, int trainer, int unit, int64_t step) {
  std::vector<float> g(length, 0.0f);
  for (int64_t i = 0; i < valid; ++i) {
    g[i] = static_cast<float>(0.05 * (trainer + 1) *
                              std::sin(0.37 * static_cast<double>(i) + 1.3 * trainer + 0.7 * unit + 2.1 * step));
  }
  return g;
}

// Feeds one gradient per (trainer, unit) of `step` in the given trainer
// order, expecting each to be accepted. The values are those of
// `values_of_step` (default: `step`).
void ContributeAll(ShardState& state, int64_t step, const std::vector<int>& trainer_order,
                   int64_t values_of_step = -1) {
  if (values_of_step < 0) values_of_step = step;
  for (int unit = 0; unit < state.num_units(); ++unit) {
    const SliceRange slice = state.layout().partitions[unit].Slice(state.shard_index());
    for (int t : trainer_order) {
      auto d = state.Contribute(Id(t, step, unit),
                                GradientSlice(slice.length, slice.valid, t, unit, values_of_step));
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(*d, PushDisposition::kAccepted);
    }
  }
}

// Records the one call of a OneShotWaiter.
struct Recorder {
  absl::Notification done;
  absl::Status status;
  std::shared_ptr<OneShotWaiter> Waiter() {
    return std::make_shared<OneShotWaiter>([this](absl::Status s) {
      status = std::move(s);
      done.Notify();
    });
  }
  bool WaitFor(absl::Duration timeout) { return done.WaitForNotificationWithTimeout(timeout); }
};

// ---------------------------------------------------------------------------

TEST(ShardStateTest, InitialSlicesAreTheUnshardedInitialization) {
  for (int shards : {1, 2, 3, 5}) {
    const JobConfig job = SmallJob(shards, 1);
    auto layout = MakeJobLayout(job);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<std::vector<float>> joined(layout->partitions.size());
    for (int s = 0; s < shards; ++s) {
      auto state = MakeState(job, s);
      ASSERT_NE(state, nullptr);
      ASSERT_EQ(state->num_units(), 3);
      for (int u = 0; u < state->num_units(); ++u) {
        const SliceRange slice = layout->partitions[u].Slice(s);
        std::vector<float> want(slice.length);
        InitializeUnitRange(layout->spec.units[u], job.seed, slice.begin, want);
        auto [version, master] = state->ReadMaster(u);
        EXPECT_EQ(version, 0);
        EXPECT_EQ(state->slice_length(u), slice.length);
        EXPECT_TRUE(SameBits(master, want)) << "N=" << shards << " shard " << s << " unit " << u;
        joined[u].insert(joined[u].end(), master.begin(), master.end());
      }
      EXPECT_EQ(state->current_step(), 0);
    }
    // Concatenated, the slices are the unsharded initialisation plus zero
    // padding, whatever N is.
    for (size_t u = 0; u < joined.size(); ++u) {
      const UnitSpec& unit = layout->spec.units[u];
      std::vector<float> whole(unit.numel);
      InitializeUnitRange(unit, job.seed, 0, whole);
      ASSERT_EQ(static_cast<int64_t>(joined[u].size()), layout->partitions[u].padded_numel());
      EXPECT_TRUE(SameBits(std::vector<float>(joined[u].begin(), joined[u].begin() + unit.numel), whole))
          << "N=" << shards << " unit " << u;
      for (size_t i = unit.numel; i < joined[u].size(); ++i) EXPECT_EQ(joined[u][i], 0.0f);
      EXPECT_TRUE(std::any_of(whole.begin(), whole.end(), [](float x) { return x != 0.0f && x != 1.0f; }))
          << "unit " << u << " has no random initialisation to compare";
    }
  }
}

TEST(ShardStateTest, CreateRefusesABadShardIndex) {
  EXPECT_EQ(ShardState::Create(SmallJob(2, 1), 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardState::Create(SmallJob(2, 1), -1).status().code(), absl::StatusCode::kInvalidArgument);
}

// torch.optim.AdamW for one element, in double.
struct HandAdamW {
  double p = 0.0, m = 0.0, v = 0.0;
  void Step(const OptimizerConfig& c, double lr, int64_t t, double g, bool decay) {
    if (decay) p *= 1.0 - lr * c.weight_decay;
    m = c.beta1 * m + (1.0 - c.beta1) * g;
    v = c.beta2 * v + (1.0 - c.beta2) * g * g;
    const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(t));
    p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + c.eps);
  }
};

// Whether element `i` of a unit's flat vector belongs to a matrix.
bool Decays(const UnitSpec& unit, int64_t i) {
  for (const TensorSpec& t : unit.tensors) {
    if (i >= t.offset && i < t.offset + t.numel) return t.shape.size() >= 2;
  }
  return false;  // padding
}

TEST(ShardStateTest, StepAveragesContributionsAndAppliesAdamW) {
  const int kTrainers = 3;
  const int kShard = 1;
  const JobConfig job = SmallJob(2, kTrainers);
  auto state = MakeState(job, kShard);
  ASSERT_NE(state, nullptr);
  const JobLayout& layout = state->layout();
  const int units = state->num_units();

  std::vector<std::vector<HandAdamW>> hand(units);
  for (int u = 0; u < units; ++u) {
    for (float p : state->ReadMaster(u).second) hand[u].push_back(HandAdamW{.p = p});
  }
  // The other shard's share of the norm: large at step 0 (so clipping
  // engages, and only through the agreed norm), small at step 1.
  // (2^2 and 0.01^2, as squares of floats.)
  const float other_shard_gradient[] = {2.0f, 0.01f};
  for (int64_t step = 0; step < 2; ++step) {
    ASSERT_NO_FATAL_FAILURE(ContributeAll(*state, step, {0, 1, 2}));
    ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());

    // The average of the three contributions, by hand.
    std::vector<std::vector<double>> average(units);
    double sum_of_squares = 0.0;
    for (int u = 0; u < units; ++u) {
      const SliceRange slice = layout.partitions[u].Slice(kShard);
      average[u].assign(slice.length, 0.0);
      for (int t = 0; t < kTrainers; ++t) {
        const std::vector<float> g = GradientSlice(slice.length, slice.valid, t, u, step);
        for (int64_t i = 0; i < slice.length; ++i) average[u][i] += g[i] / 3.0;
      }
      for (double a : average[u]) sum_of_squares += a * a;
    }
    const StepNorm partial = state->FinishReduction();
    EXPECT_FALSE(partial.non_finite);
    EXPECT_NEAR(partial.total(), sum_of_squares, 1e-6 * sum_of_squares);

    StepNorm agreed;
    agreed.sum_of_squares = partial.sum_of_squares;
    agreed.sum_of_squares.AddSquares(std::span<const float>(&other_shard_gradient[step], 1));
    const double norm = std::sqrt(agreed.total());
    const double clip = std::min(1.0, job.optimizer.grad_clip / (norm + 1e-6));
    EXPECT_EQ(clip < 0.6, step == 0) << "clipping engages at step 0 only";
    state->ApplyStep(agreed);

    const double lr = job.optimizer.lr * static_cast<double>(step + 1) / 2.0;  // warm-up
    for (int u = 0; u < units; ++u) {
      const SliceRange slice = layout.partitions[u].Slice(kShard);
      auto [version, master] = state->ReadMaster(u);
      EXPECT_EQ(version, step + 1);
      for (int64_t i = 0; i < slice.length; ++i) {
        hand[u][i].Step(job.optimizer, lr, step + 1, average[u][i] * clip,
                        Decays(layout.spec.units[u], slice.begin + i));
        ASSERT_NEAR(master[i], hand[u][i].p, 2e-7 + 1e-6 * std::abs(hand[u][i].p))
            << "step " << step << " unit " << u << " element " << i;
      }
    }
    EXPECT_EQ(state->current_step(), step + 1);
    const ShardState::Counters c = state->counters();
    EXPECT_EQ(c.applied_updates, step + 1);
    EXPECT_EQ(c.skipped_steps, 0);
    EXPECT_DOUBLE_EQ(c.last_grad_norm, norm);
  }
}

TEST(ShardStateTest, DeterministicModeIgnoresArrivalOrder) {
  const JobConfig job = SmallJob(1, 3);
  auto in_order = MakeState(job, 0);
  auto shuffled = MakeState(job, 0);
  ASSERT_NE(in_order, nullptr);
  ASSERT_NE(shuffled, nullptr);
  // Contributions whose float sum depends on the order of addition.
  auto contribution = [&](int t, int unit, int64_t length) {
    std::vector<float> g(length);
    const float scale[] = {1.0f, 3.0e3f, 1.0e-3f};
    for (int64_t i = 0; i < length; ++i) {
      g[i] = scale[t] * static_cast<float>(std::sin(0.91 * static_cast<double>(i) + t + 0.3 * unit));
    }
    return g;
  };
  bool order_matters = false;
  for (int u = 0; u < in_order->num_units(); ++u) {
    const int64_t n = in_order->slice_length(u);
    const auto g0 = contribution(0, u, n), g1 = contribution(1, u, n), g2 = contribution(2, u, n);
    for (int64_t i = 0; i < n; ++i) order_matters |= ((g0[i] + g1[i]) + g2[i]) != ((g2[i] + g0[i]) + g1[i]);
    for (int t : {0, 1, 2}) ASSERT_TRUE(in_order->Contribute(Id(t, 0, u), contribution(t, u, n)).ok());
    for (int t : {2, 0, 1}) ASSERT_TRUE(shuffled->Contribute(Id(t, 0, u), contribution(t, u, n)).ok());
  }
  ASSERT_TRUE(order_matters) << "the contributions do not exercise the order of addition";
  for (ShardState* s : {in_order.get(), shuffled.get()}) {
    ASSERT_TRUE(s->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
  }
  const StepNorm a = in_order->FinishReduction();
  const StepNorm b = shuffled->FinishReduction();
  EXPECT_TRUE(a.sum_of_squares == b.sum_of_squares);
  in_order->ApplyStep(a);
  shuffled->ApplyStep(b);
  for (int u = 0; u < in_order->num_units(); ++u) {
    EXPECT_TRUE(SameBits(in_order->ReadMaster(u).second, shuffled->ReadMaster(u).second)) << "unit " << u;
  }
}

TEST(ShardStateTest, ContributeRefusesBadPushesAndIgnoresDuplicates) {
  const JobConfig job = SmallJob(2, 2);
  auto state = MakeState(job, 0);
  ASSERT_NE(state, nullptr);
  const int64_t n = state->slice_length(1);
  const std::vector<float> g(n, 0.5f);
  EXPECT_EQ(state->Contribute(Id(0, 0, 3), g).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(state->Contribute(Id(0, 0, -1), g).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(state->Contribute(Id(2, 0, 1), g).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state->Contribute(Id(-1, 0, 1), g).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state->Contribute(Id(0, 1, 1), g).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(state->Contribute(Id(0, 0, 1), std::vector<float>(n - 1, 0.5f)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(state->DescribeWait(), HasSubstr("trainer 0 (units 0,1,2)"));

  auto first = state->Contribute(Id(0, 0, 1), g);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, PushDisposition::kAccepted);
  auto again = state->Contribute(Id(0, 0, 1), std::vector<float>(n, 100.0f));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, PushDisposition::kDuplicate);

  for (int u = 0; u < state->num_units(); ++u) {
    for (int t = 0; t < 2; ++t) {
      if (u == 1 && t == 0) continue;
      ASSERT_TRUE(state->Contribute(Id(t, 0, u), std::vector<float>(state->slice_length(u), 0.0f)).ok());
    }
  }
  ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
  // Only the first push of (trainer 0, unit 1) counts: average 0.25 over n.
  const StepNorm norm = state->FinishReduction();
  EXPECT_EQ(norm.total(), 0.0625 * static_cast<double>(n));
  state->ApplyStep(norm);
  EXPECT_EQ(state->CheckPush(Id(0, 0, 1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(state->CheckPush(Id(0, 0, 1)).message(), HasSubstr("already applied"));
  EXPECT_EQ(state->Contribute(Id(0, 0, 1), g).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShardStateTest, NonFiniteContributionSkipsTheUpdate) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    JobConfig job = SmallJob(1, 2);
    job.optimizer.warmup_steps = 0;  // the same lr at steps 0 and 1
    auto state = MakeState(job, 0);
    auto clean = MakeState(job, 0);  // never sees the bad step
    ASSERT_NE(state, nullptr);
    ASSERT_NE(clean, nullptr);
    std::vector<std::vector<float>> initial;
    for (int u = 0; u < state->num_units(); ++u) initial.push_back(state->ReadMaster(u).second);

    const int64_t n = state->slice_length(2);
    std::vector<float> poisoned = GradientSlice(n, n, 0, 2, 0);
    poisoned[5] = bad;
    auto d = state->Contribute(Id(0, 0, 2), poisoned);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(*d, PushDisposition::kAcceptedNonFinite);
    for (int u = 0; u < state->num_units(); ++u) {
      for (int t = 0; t < 2; ++t) {
        if (u == 2 && t == 0) continue;
        const int64_t len = state->slice_length(u);
        ASSERT_TRUE(state->Contribute(Id(t, 0, u), GradientSlice(len, len, t, u, 0)).ok());
      }
    }
    ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
    const StepNorm partial = state->FinishReduction();
    EXPECT_TRUE(partial.non_finite);
    EXPECT_TRUE(std::isfinite(partial.total())) << "the bad values must be dropped";
    state->ApplyStep(partial);
    EXPECT_EQ(state->current_step(), 1);
    for (int u = 0; u < state->num_units(); ++u) {
      auto [version, master] = state->ReadMaster(u);
      EXPECT_EQ(version, 1);
      EXPECT_TRUE(SameBits(master, initial[u])) << "unit " << u;
    }
    EXPECT_EQ(state->counters().skipped_steps, 1);
    EXPECT_EQ(state->counters().applied_updates, 0);

    // The next step is the first update: the same as a state that applies
    // these gradients as its first step.
    ASSERT_NO_FATAL_FAILURE(ContributeAll(*state, 1, {0, 1}));
    ASSERT_NO_FATAL_FAILURE(ContributeAll(*clean, 0, {0, 1}, /*values_of_step=*/1));
    for (ShardState* s : {state.get(), clean.get()}) {
      ASSERT_TRUE(s->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
      const StepNorm norm = s->FinishReduction();
      EXPECT_FALSE(norm.non_finite);
      s->ApplyStep(norm);
    }
    EXPECT_EQ(state->counters().applied_updates, 1);
    for (int u = 0; u < state->num_units(); ++u) {
      EXPECT_TRUE(SameBits(state->ReadMaster(u).second, clean->ReadMaster(u).second)) << "unit " << u;
      EXPECT_FALSE(SameBits(state->ReadMaster(u).second, initial[u])) << "unit " << u;
    }
  }
}

TEST(ShardStateTest, WhenPublishedAnswersNowLaterGoneOrAtTheDeadline) {
  const JobConfig job = SmallJob(2, 2);
  auto state = MakeState(job, 1);
  ASSERT_NE(state, nullptr);
  const absl::Time far = absl::Now() + absl::Seconds(60);

  Recorder now;
  state->WhenPublished(1, 0, far, now.Waiter());
  ASSERT_TRUE(now.done.HasBeenNotified()) << "the current version must be answered at once";
  EXPECT_TRUE(now.status.ok()) << now.status;
  EXPECT_TRUE(state->CheckFetch(1, 0).ok());
  EXPECT_TRUE(state->CheckFetch(1, 1).ok());
  EXPECT_EQ(state->CheckFetch(3, 0).code(), absl::StatusCode::kNotFound);

  Recorder next, far_future;
  state->WhenPublished(1, 1, far, next.Waiter());
  state->WhenPublished(1, 2, far, far_future.Waiter());
  ASSERT_NO_FATAL_FAILURE(ContributeAll(*state, 0, {1, 0}));
  ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
  const StepNorm norm = state->FinishReduction();
  EXPECT_FALSE(next.done.HasBeenNotified()) << "version 1 is not published before ApplyStep";
  state->ApplyStep(norm);
  ASSERT_TRUE(next.WaitFor(absl::Seconds(10)));
  EXPECT_TRUE(next.status.ok()) << next.status;
  EXPECT_FALSE(far_future.done.HasBeenNotified());

  Recorder gone;
  state->WhenPublished(1, 0, far, gone.Waiter());
  ASSERT_TRUE(gone.done.HasBeenNotified());
  EXPECT_EQ(gone.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(gone.status.message(), HasSubstr("gone"));
  EXPECT_EQ(state->CheckFetch(1, 0).code(), absl::StatusCode::kFailedPrecondition);

  // Step 1: trainer 0 sends every unit, trainer 1 only unit 0.
  for (int u = 0; u < state->num_units(); ++u) {
    ASSERT_TRUE(state->Contribute(Id(0, 1, u), std::vector<float>(state->slice_length(u), 0.1f)).ok());
  }
  ASSERT_TRUE(state->Contribute(Id(1, 1, 0), std::vector<float>(state->slice_length(0), 0.1f)).ok());
  Recorder late;
  const absl::Time start = absl::Now();
  state->WhenPublished(2, 2, start + absl::Milliseconds(200), late.Waiter());
  ASSERT_TRUE(late.WaitFor(absl::Seconds(30)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_EQ(late.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(late.status.message(), HasSubstr("unit 2 version 2"));
  EXPECT_THAT(late.status.message(), HasSubstr("step 1"));
  EXPECT_THAT(late.status.message(), HasSubstr("trainer 1 (units 1,2)"));
  EXPECT_THAT(late.status.message(), Not(HasSubstr("trainer 0")));
  // The earlier waiter for version 2 has its own, later deadline.
  EXPECT_FALSE(far_future.done.HasBeenNotified());
}

TEST(ShardStateTest, DescribeWaitNamesMissingTrainersAndUnits) {
  const JobConfig job = SmallJob(2, 3);
  auto state = MakeState(job, 0);
  ASSERT_NE(state, nullptr);
  for (int u = 0; u < state->num_units(); ++u) {
    ASSERT_TRUE(state->Contribute(Id(0, 0, u), std::vector<float>(state->slice_length(u), 0.0f)).ok());
  }
  ASSERT_TRUE(state->Contribute(Id(1, 0, 0), std::vector<float>(state->slice_length(0), 0.0f)).ok());

  const std::string wait = state->DescribeWait();
  EXPECT_THAT(wait, HasSubstr("shard 0, step 0"));
  EXPECT_THAT(wait, HasSubstr("trainer 1 (units 1,2)"));
  EXPECT_THAT(wait, HasSubstr("trainer 2 (units 0,1,2)"));
  EXPECT_THAT(wait, Not(HasSubstr("trainer 0")));

  const absl::Status s = state->AwaitContributions(absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("trainer 1 (units 1,2), trainer 2 (units 0,1,2)"));

  for (int u = 0; u < state->num_units(); ++u) {
    for (int t : {1, 2}) {
      if (u == 0 && t == 1) continue;
      ASSERT_TRUE(state->Contribute(Id(t, 0, u), std::vector<float>(state->slice_length(u), 0.0f)).ok());
    }
  }
  EXPECT_THAT(state->DescribeWait(), HasSubstr("all gradients received"));
  EXPECT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
}

// A push for step k+1 may arrive as soon as its unit is published at
// version k+1, while ApplyStep is still publishing the other units. What it
// records (here: that it was non-finite) must survive the end of step k.
TEST(ShardStateTest, PushForTheNextStepDuringPublishIsKept) {
  const JobConfig job = SmallJob(1, 1);
  auto state = MakeState(job, 0);
  ASSERT_NE(state, nullptr);
  ASSERT_NO_FATAL_FAILURE(ContributeAll(*state, 0, {0}));
  ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
  const StepNorm norm = state->FinishReduction();

  absl::StatusOr<PushDisposition> early = absl::UnknownError("not pushed");
  int64_t step_seen = -1;
  auto waiter = std::make_shared<OneShotWaiter>([&](absl::Status s) {
    ASSERT_TRUE(s.ok()) << s;
    step_seen = state->current_step();
    std::vector<float> g(state->slice_length(0), 0.0f);
    g[0] = std::numeric_limits<float>::quiet_NaN();
    early = state->Contribute(Id(0, 1, 0), std::move(g));
  });
  state->WhenPublished(0, 1, absl::Now() + absl::Seconds(60), waiter);
  state->ApplyStep(norm);  // unit 0's waiter runs inside, before units 1 and 2 publish
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_EQ(*early, PushDisposition::kAcceptedNonFinite);
  EXPECT_EQ(step_seen, 1) << "a published version must already be the current step";

  for (int u = 1; u < state->num_units(); ++u) {
    ASSERT_TRUE(state->Contribute(Id(0, 1, u), std::vector<float>(state->slice_length(u), 0.1f)).ok());
  }
  ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(state->FinishReduction().non_finite)
      << "the non-finite push of step 1 was forgotten: the step would not be skipped";
}

// Units are averaged as soon as their gradients are in, before the step's
// last one arrives; a rollback in between forgets them, so that the step
// waits for every unit again and its norm is that of the redone pushes.
TEST(ShardStateTest, AUnitReducedEarlyIsForgottenByARollBack) {
  const JobConfig job = SmallJob(1, 1);
  auto state = MakeState(job, 0);
  ASSERT_NE(state, nullptr);
  absl::StatusOr<Checkpoint> start = state->Snapshot();
  ASSERT_TRUE(start.ok()) << start.status();
  auto push = [&](int unit, int64_t values_of_step) {
    const SliceRange slice = state->layout().partitions[unit].Slice(0);
    auto d = state->Contribute(Id(0, 0, unit), GradientSlice(slice.length, slice.valid, 0, unit, values_of_step));
    ASSERT_TRUE(d.ok()) << d.status();
  };
  ASSERT_NO_FATAL_FAILURE(push(0, 7));
  EXPECT_TRUE(absl::IsDeadlineExceeded(state->AwaitContributions(absl::Now() + absl::Milliseconds(50))))
      << "units 1 and 2 are missing";
  ASSERT_TRUE(state->RollBack(*start, /*asked_by=*/0).ok());

  for (int unit = 1; unit < state->num_units(); ++unit) ASSERT_NO_FATAL_FAILURE(push(unit, 0));
  const absl::Status waiting = state->AwaitContributions(absl::Now() + absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsDeadlineExceeded(waiting)) << "unit 0, reduced before the rollback, counted after it: "
                                                  << waiting;
  ASSERT_NO_FATAL_FAILURE(push(0, 0));
  ASSERT_TRUE(state->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());

  auto fresh = MakeState(job, 0);
  ASSERT_NE(fresh, nullptr);
  ASSERT_NO_FATAL_FAILURE(ContributeAll(*fresh, 0, {0}));
  ASSERT_TRUE(fresh->AwaitContributions(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(state->FinishReduction().sum_of_squares == fresh->FinishReduction().sum_of_squares)
      << "the norm still holds unit 0's gradient from before the rollback";
}

}  // namespace
}  // namespace pshard
