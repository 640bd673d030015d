// The fabric groups' meeting point: a round completes once every member
// posted, bad posts change nothing, and nobody waits past a deadline.
#include "shard_server/rendezvous.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Collects one post's answer.
struct Answer {
  absl::Notification done;
  std::optional<absl::StatusOr<std::vector<std::string>>> result;
  RendezvousTable::Done Callback() {
    return [this](absl::StatusOr<std::vector<std::string>> r) {
      result = std::move(r);
      done.Notify();
    };
  }
  absl::StatusOr<std::vector<std::string>> Wait() {
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return result.value_or(absl::InternalError("no answer"));
  }
};

absl::Time Later() { return absl::Now() + absl::Seconds(30); }

TEST(RendezvousTable, CompletesWithEveryPayloadInMemberOrder) {
  RendezvousTable table;
  Answer a2, a0, a1;
  table.Post("g", 2, 3, "two", Later(), a2.Callback());
  table.Post("g", 0, 3, "zero", Later(), a0.Callback());
  EXPECT_FALSE(a0.done.HasBeenNotified());
  EXPECT_EQ(table.open_rounds(), 1);
  table.Post("g", 1, 3, "one", Later(), a1.Callback());
  for (Answer* a : {&a0, &a1, &a2}) {
    absl::StatusOr<std::vector<std::string>> r = a->Wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(*r, ElementsAre("zero", "one", "two"));
  }
  EXPECT_EQ(table.open_rounds(), 0);
  // The same group meets again in a new round.
  Answer b0, b1, b2;
  table.Post("g", 0, 3, "x", Later(), b0.Callback());
  table.Post("g", 1, 3, "y", Later(), b1.Callback());
  table.Post("g", 2, 3, "z", Later(), b2.Callback());
  EXPECT_THAT(*b1.Wait(), ElementsAre("x", "y", "z"));
}

TEST(RendezvousTable, GroupsAreIndependentAndASingleMemberMeetsItself) {
  RendezvousTable table;
  Answer a, b, solo;
  table.Post("a", 0, 2, "a0", Later(), a.Callback());
  table.Post("b", 0, 2, "b0", Later(), b.Callback());
  table.Post("solo", 0, 1, "me", Later(), solo.Callback());
  EXPECT_THAT(*solo.Wait(), ElementsAre("me"));
  EXPECT_FALSE(a.done.HasBeenNotified());
  EXPECT_EQ(table.open_rounds(), 2);
  Answer b1;
  table.Post("b", 1, 2, "b1", Later(), b1.Callback());
  EXPECT_THAT(*b.Wait(), ElementsAre("b0", "b1"));
  EXPECT_FALSE(a.done.HasBeenNotified());
}

TEST(RendezvousTable, BadPostsAreRefusedAndChangeNothing) {
  RendezvousTable table;
  Answer first;
  table.Post("g", 0, 2, "p", Later(), first.Callback());
  struct Case {
    std::string group;
    int member, size;
    std::string payload, message;
  };
  const std::vector<Case> cases = {
      {"g", 1, 3, "p", "says 3 members, others said 2"},
      {"g", 2, 2, "p", "member 2 is outside [0, 2)"},
      {"g", -1, 2, "p", "member -1 is outside"},
      {"g", 0, 0, "p", "size 0 is outside"},
      {"", 0, 1, "p", "no name"},
      {"g", 1, 2, std::string(RendezvousTable::kMaxPayloadBytes + 1, 'x'), "exceeds"},
  };
  for (const Case& c : cases) {
    Answer a;
    table.Post(c.group, c.member, c.size, c.payload, Later(), a.Callback());
    absl::StatusOr<std::vector<std::string>> r = a.Wait();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
  EXPECT_FALSE(first.done.HasBeenNotified());
  Answer second;
  table.Post("g", 1, 2, "q", Later(), second.Callback());
  EXPECT_THAT(*first.Wait(), ElementsAre("p", "q"));
}

TEST(RendezvousTable, DeadlineNamesTheMissingMembersAndWithdrawsThePost) {
  RendezvousTable table;
  Answer early;
  const absl::Time start = absl::Now();
  table.Post("g", 0, 3, "stale", absl::Now() + absl::Milliseconds(200), early.Callback());
  absl::StatusOr<std::vector<std::string>> r = early.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("member(s) 1,2 did not arrive"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(table.open_rounds(), 0);
  // The withdrawn address is not handed to later members.
  Answer m0, m1, m2;
  table.Post("g", 1, 3, "one", Later(), m1.Callback());
  table.Post("g", 2, 3, "two", Later(), m2.Callback());
  EXPECT_FALSE(m1.done.HasBeenNotified());
  table.Post("g", 0, 3, "fresh", Later(), m0.Callback());
  EXPECT_THAT(*m2.Wait(), ElementsAre("fresh", "one", "two"));
}

TEST(RendezvousTable, AWithdrawnPostIsAnsweredCancelledAndLeavesNothingBehind) {
  RendezvousTable table;
  Answer gone, stays;
  RendezvousTable::Withdraw withdraw_gone = table.Post("alone", 0, 2, "gone", Later(), gone.Callback());
  table.Post("g", 0, 2, "stays", Later(), stays.Callback());
  EXPECT_EQ(table.open_rounds(), 2);
  withdraw_gone();
  absl::StatusOr<std::vector<std::string>> r = gone.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(r.status().message(), HasSubstr("rendezvous alone: member 0 went away"));
  EXPECT_EQ(table.open_rounds(), 1);  // its round was empty: closed
  withdraw_gone();                    // a second time: nothing
  // A member of a round others still wait in leaves only its own seat.
  Answer leaves;
  RendezvousTable::Withdraw withdraw_leaves = table.Post("three", 1, 3, "leaves", Later(), leaves.Callback());
  Answer waits;
  table.Post("three", 0, 3, "zero", Later(), waits.Callback());
  withdraw_leaves();
  EXPECT_EQ(leaves.Wait().status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(waits.done.HasBeenNotified());
  Answer one, two;
  table.Post("three", 1, 3, "one", Later(), one.Callback());
  table.Post("three", 2, 3, "two", Later(), two.Callback());
  EXPECT_THAT(*waits.Wait(), ElementsAre("zero", "one", "two"));
  // Withdrawing a post whose round completed changes nothing.
  Answer other;
  RendezvousTable::Withdraw too_late = table.Post("g", 1, 2, "other", Later(), other.Callback());
  EXPECT_THAT(*stays.Wait(), ElementsAre("stays", "other"));
  too_late();
  EXPECT_THAT(*other.Wait(), ElementsAre("stays", "other"));
  EXPECT_EQ(table.open_rounds(), 0);
}

TEST(RendezvousTable, APostAgainReplacesTheEarlierOne) {
  RendezvousTable table;
  Answer old_post, new_post, other;
  table.Post("g", 0, 2, "old", Later(), old_post.Callback());
  table.Post("g", 0, 2, "new", Later(), new_post.Callback());
  EXPECT_EQ(old_post.Wait().status().code(), absl::StatusCode::kAborted);
  table.Post("g", 1, 2, "other", Later(), other.Callback());
  EXPECT_THAT(*new_post.Wait(), ElementsAre("new", "other"));
}

TEST(RendezvousTable, CloseAnswersEveryoneWaitingAndLaterPosts) {
  RendezvousTable table;
  Answer waiting, later;
  table.Post("g", 0, 2, "p", Later(), waiting.Callback());
  table.Close();
  EXPECT_EQ(waiting.Wait().status().code(), absl::StatusCode::kUnavailable);
  table.Post("g", 1, 2, "q", Later(), later.Callback());
  EXPECT_THAT(later.Wait().status().message(), HasSubstr("shutting down"));
  EXPECT_EQ(table.open_rounds(), 0);
}

// Whoever posts, the table holds at most its limits: rounds beyond the open
// limit, groups larger than the job and long names are refused at once,
// and the rounds already open still complete.
TEST(RendezvousTable, PostsBeyondTheLimitsAreRefusedAndChangeNothing) {
  RendezvousTable table(RendezvousTable::Limits{.max_group_size = 4, .max_open_rounds = 3});
  std::vector<std::unique_ptr<Answer>> open;
  for (int g = 0; g < 3; ++g) {
    open.push_back(std::make_unique<Answer>());
    table.Post(absl::StrCat("g", g), 0, 2, "first", Later(), open.back()->Callback());
  }
  EXPECT_EQ(table.open_rounds(), 3);
  Answer over, big, named;
  table.Post("g3", 0, 2, "x", Later(), over.Callback());
  EXPECT_EQ(over.Wait().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.Wait().status().message()), HasSubstr("3 rounds are open already"));
  table.Post("g0", 0, 5, "x", Later(), big.Callback());
  EXPECT_THAT(std::string(big.Wait().status().message()), HasSubstr("size 5 is outside [1, 4]"));
  table.Post(std::string(300, 'n'), 0, 2, "x", Later(), named.Callback());
  EXPECT_THAT(std::string(named.Wait().status().message()), HasSubstr("group name of 300 bytes"));
  EXPECT_EQ(table.open_rounds(), 3);
  // An open round still completes, and frees its place.
  Answer second;
  table.Post("g1", 1, 2, "second", Later(), second.Callback());
  EXPECT_THAT(*second.Wait(), ElementsAre("first", "second"));
  EXPECT_EQ(table.open_rounds(), 2);
  Answer now;
  table.Post("g3", 0, 1, "solo", Later(), now.Callback());
  EXPECT_THAT(*now.Wait(), ElementsAre("solo"));
  table.Close();
}

}  // namespace
}  // namespace pshard
