#include "shard_server/norm_coordinator.h"

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Records the one answer to a Report.
struct Answer {
  absl::Notification done;
  absl::StatusOr<StepNorm> total = absl::UnknownError("no answer");
  std::function<void(absl::StatusOr<StepNorm>)> Callback() {
    return [this](absl::StatusOr<StepNorm> t) {
      total = std::move(t);
      done.Notify();
    };
  }
  bool WaitFor(absl::Duration timeout) { return done.WaitForNotificationWithTimeout(timeout); }
};

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

absl::Time Far() { return absl::Now() + absl::Seconds(60); }

// A partial norm whose sum of squares is `ones` (that many squares of 1).
StepNorm Norm(int ones, bool non_finite) {
  StepNorm norm;
  const std::vector<float> values(ones, 1.0f);
  norm.sum_of_squares.AddSquares(values);
  norm.non_finite = non_finite;
  return norm;
}

TEST(NormCoordinatorTest, TotalIsExactWhateverTheArrivalOrder) {
  NormCoordinator coordinator(3);
  // In doubles, 1e16 + 1 rounds back to 1e16: the sum would depend on the
  // order of addition. The exact sum is 1e16 + 2 in every order.
  const float partials[] = {1e8f, 1.0f, 1.0f};
  Answer answers[3];
  for (int shard : {1, 2, 0}) {
    StepNorm partial;
    partial.sum_of_squares.AddSquares(std::span<const float>(&partials[shard], 1));
    coordinator.Report(4, shard, partial, Far(), answers[shard].Callback());
  }
  for (int shard = 0; shard < 3; ++shard) {
    ASSERT_TRUE(answers[shard].WaitFor(absl::Seconds(10))) << "shard " << shard;
    ASSERT_TRUE(answers[shard].total.ok()) << answers[shard].total.status();
    EXPECT_TRUE(SameBits(answers[shard].total->total(), 1e16 + 2)) << answers[shard].total->total();
    EXPECT_FALSE(answers[shard].total->non_finite);
  }
}

TEST(NormCoordinatorTest, NobodyIsAnsweredBeforeEveryShardReported) {
  NormCoordinator coordinator(3);
  Answer a0, a2;
  coordinator.Report(0, 0, Norm(1, false), Far(), a0.Callback());
  coordinator.Report(0, 2, Norm(2, false), Far(), a2.Callback());
  // Another step's report does not complete this one.
  Answer other;
  coordinator.Report(1, 1, Norm(3, false), Far(), other.Callback());
  EXPECT_FALSE(a0.done.HasBeenNotified());
  EXPECT_FALSE(a2.done.HasBeenNotified());
  EXPECT_FALSE(other.done.HasBeenNotified());
  Answer a1;
  coordinator.Report(0, 1, Norm(4, false), Far(), a1.Callback());
  for (Answer* a : {&a0, &a1, &a2}) {
    ASSERT_TRUE(a->WaitFor(absl::Seconds(10)));
    ASSERT_TRUE(a->total.ok()) << a->total.status();
    EXPECT_EQ(a->total->total(), 7.0);
  }
  EXPECT_FALSE(other.done.HasBeenNotified());
}

TEST(NormCoordinatorTest, AllConcurrentReportersGetTheSameTotal) {
  constexpr int kShards = 8;
  for (int round = 0; round < 20; ++round) {
    NormCoordinator coordinator(kShards);
    std::vector<std::unique_ptr<Answer>> answers;
    for (int s = 0; s < kShards; ++s) answers.push_back(std::make_unique<Answer>());
    std::vector<std::thread> threads;
    for (int s = 0; s < kShards; ++s) {
      threads.emplace_back([&, s] {
        // Shard 5 saw a non-finite gradient: everybody must learn it.
        StepNorm partial;
        const float x = 0.1f * static_cast<float>(s + 1);
        partial.sum_of_squares.AddSquares(std::span<const float>(&x, 1));
        partial.non_finite = s == 5;
        coordinator.Report(round, s, partial, Far(), answers[s]->Callback());
      });
    }
    for (auto& t : threads) t.join();
    SquareSum all;  // the same squares, added in the other order in one sum
    for (int s = kShards - 1; s >= 0; --s) {
      const float x = 0.1f * static_cast<float>(s + 1);
      all.AddSquares(std::span<const float>(&x, 1));
    }
    const double want = all.ToDouble();
    for (int s = 0; s < kShards; ++s) {
      ASSERT_TRUE(answers[s]->WaitFor(absl::Seconds(10))) << "shard " << s;
      ASSERT_TRUE(answers[s]->total.ok()) << answers[s]->total.status();
      EXPECT_TRUE(SameBits(answers[s]->total->total(), want)) << "shard " << s;
      EXPECT_TRUE(answers[s]->total->non_finite) << "shard " << s;
    }
  }
}

TEST(NormCoordinatorTest, RepeatedReportReplacesTheFirstUntilTheRoundCompletes) {
  NormCoordinator coordinator(2);
  Answer first, second, other;
  coordinator.Report(3, 0, Norm(100, true), Far(), first.Callback());
  coordinator.Report(3, 0, Norm(1, false), Far(), second.Callback());  // a retry
  coordinator.Report(3, 1, Norm(2, false), Far(), other.Callback());
  for (Answer* a : {&first, &second, &other}) {
    ASSERT_TRUE(a->WaitFor(absl::Seconds(10)));
    ASSERT_TRUE(a->total.ok()) << a->total.status();
    EXPECT_EQ(a->total->total(), 3.0);
    EXPECT_FALSE(a->total->non_finite);
  }
}

TEST(NormCoordinatorTest, LateReportGetsTheStoredAnswer) {
  NormCoordinator coordinator(2);
  Answer a0, a1;
  coordinator.Report(0, 0, Norm(1, false), Far(), a0.Callback());
  coordinator.Report(0, 1, Norm(3, false), Far(), a1.Callback());
  ASSERT_TRUE(a1.WaitFor(absl::Seconds(10)));
  ASSERT_TRUE(a1.total.ok());
  // A retried report after completion (its first answer was lost) gets the
  // same total at once, whatever it now says.
  Answer late;
  coordinator.Report(0, 1, Norm(99, true), Far(), late.Callback());
  ASSERT_TRUE(late.done.HasBeenNotified());
  ASSERT_TRUE(late.total.ok()) << late.total.status();
  EXPECT_EQ(late.total->total(), 4.0);
  EXPECT_FALSE(late.total->non_finite);
  // ... also after the coordinator moved on a few steps.
  for (int64_t step = 1; step <= 3; ++step) {
    Answer x, y;
    coordinator.Report(step, 0, Norm(1, false), Far(), x.Callback());
    coordinator.Report(step, 1, Norm(1, false), Far(), y.Callback());
    ASSERT_TRUE(x.WaitFor(absl::Seconds(10)));
    ASSERT_TRUE(y.WaitFor(absl::Seconds(10)));
  }
  Answer later;
  coordinator.Report(0, 0, Norm(7, false), Far(), later.Callback());
  ASSERT_TRUE(later.done.HasBeenNotified());
  ASSERT_TRUE(later.total.ok()) << later.total.status();
  EXPECT_EQ(later.total->total(), 4.0);
}

TEST(NormCoordinatorTest, DeadlineNamesTheMissingShards) {
  NormCoordinator coordinator(4);
  Answer a0, a2;
  const absl::Time start = absl::Now();
  coordinator.Report(7, 0, Norm(1, false), start + absl::Milliseconds(150), a0.Callback());
  coordinator.Report(7, 2, Norm(1, false), start + absl::Milliseconds(150), a2.Callback());
  for (Answer* a : {&a0, &a2}) {
    ASSERT_TRUE(a->WaitFor(absl::Seconds(30)));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(140));
    EXPECT_EQ(a->total.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(a->total.status().message(), HasSubstr("step 7"));
    EXPECT_THAT(a->total.status().message(), HasSubstr("shard(s) 1,3"));
  }
  // The round is still open: the missing shards report, and the retries of
  // the ones that timed out get the total.
  Answer a1, a3, retry0;
  coordinator.Report(7, 1, Norm(2, false), Far(), a1.Callback());
  coordinator.Report(7, 3, Norm(3, false), Far(), a3.Callback());
  coordinator.Report(7, 0, Norm(1, false), Far(), retry0.Callback());
  for (Answer* a : {&a1, &a3, &retry0}) {
    ASSERT_TRUE(a->WaitFor(absl::Seconds(10)));
    ASSERT_TRUE(a->total.ok()) << a->total.status();
    EXPECT_EQ(a->total->total(), 7.0);
  }
}

TEST(NormCoordinatorTest, OnlyTheWaiterWhoseDeadlinePassedIsAnswered) {
  NormCoordinator coordinator(2);
  Answer soon, later;
  coordinator.Report(0, 0, Norm(1, false), absl::Now() + absl::Milliseconds(100), soon.Callback());
  coordinator.Report(0, 0, Norm(1, false), Far(), later.Callback());
  ASSERT_TRUE(soon.WaitFor(absl::Seconds(30)));
  EXPECT_EQ(soon.total.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(soon.total.status().message(), HasSubstr("shard(s) 1"));
  EXPECT_FALSE(later.done.HasBeenNotified());
  Answer other;
  coordinator.Report(0, 1, Norm(2, false), Far(), other.Callback());
  ASSERT_TRUE(later.WaitFor(absl::Seconds(10)));
  ASSERT_TRUE(later.total.ok()) << later.total.status();
  EXPECT_EQ(later.total->total(), 3.0);
}

// Finished rounds are forgotten a few steps later, together with any round
// still open below them; a report waiting in such a round must still be
// answered by its deadline, never left hanging.
TEST(NormCoordinatorTest, ReportInAForgottenRoundIsAnsweredAtItsDeadline) {
  NormCoordinator coordinator(2);
  Answer stale;
  coordinator.Report(0, 0, Norm(1, false), absl::Now() + absl::Milliseconds(200),
                     stale.Callback());
  for (int64_t step = 10; step <= 12; ++step) {
    Answer x, y;
    coordinator.Report(step, 0, Norm(1, false), Far(), x.Callback());
    coordinator.Report(step, 1, Norm(1, false), Far(), y.Callback());
    ASSERT_TRUE(x.WaitFor(absl::Seconds(10)));
    ASSERT_TRUE(y.WaitFor(absl::Seconds(10)));
  }
  ASSERT_TRUE(stale.WaitFor(absl::Seconds(30))) << "a report was never answered";
  EXPECT_EQ(stale.total.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(stale.total.status().message(), HasSubstr("step 0"));
}

}  // namespace
}  // namespace pshard
