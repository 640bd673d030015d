// Link buckets: the interface time every connection of a node shares, in
// one process and across processes (mapped files).
#include "trainer_client/transport/link/link_emulator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace pshard {
namespace {

std::string TempPath(const char* name) {
  char dir[] = "/tmp/pshard-link-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return std::string(dir) + "/" + name;
}

TEST(LinkBucketTest, MessagesQueueBehindEachOther) {
  auto bucket = LinkBucket::InProcess();
  const absl::Time t0 = absl::FromUnixSeconds(1'000'000);
  EXPECT_EQ(bucket->Pass(t0, absl::Milliseconds(10)), t0 + absl::Milliseconds(10));
  // Handed over before the first has passed: it waits for it.
  EXPECT_EQ(bucket->Pass(t0 + absl::Milliseconds(5), absl::Milliseconds(10)), t0 + absl::Milliseconds(20));
  // Handed over after the bucket is free: it starts at once.
  EXPECT_EQ(bucket->Pass(t0 + absl::Milliseconds(50), absl::Milliseconds(1)), t0 + absl::Milliseconds(51));
}

TEST(LinkBucketTest, TwoMappingsOfAFileAreOneBucketAndSlotsAreApart) {
  const std::string path = TempPath("node.link");
  auto a = LinkBucket::Shared(path, 0);
  auto b = LinkBucket::Shared(path, 0);
  auto other_direction = LinkBucket::Shared(path, 1);
  ASSERT_TRUE(a.ok() && b.ok() && other_direction.ok()) << a.status();
  const absl::Time t0 = absl::FromUnixSeconds(2'000'000);
  EXPECT_EQ((*a)->Pass(t0, absl::Milliseconds(10)), t0 + absl::Milliseconds(10));
  EXPECT_EQ((*b)->Pass(t0, absl::Milliseconds(10)), t0 + absl::Milliseconds(20));
  EXPECT_EQ((*other_direction)->Pass(t0, absl::Milliseconds(10)), t0 + absl::Milliseconds(10));
}

// Another process's messages through the node's file hold this one's up.
TEST(LinkBucketTest, ProcessesSharingANodeShareItsInterface) {
  const std::string path = TempPath("node.link");
  const absl::Time t0 = absl::FromUnixSeconds(3'000'000);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto bucket = LinkBucket::Shared(path, 1);
    if (!bucket.ok()) _exit(2);
    for (int i = 0; i < 5; ++i) (*bucket)->Pass(t0, absl::Milliseconds(100));
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  auto bucket = LinkBucket::Shared(path, 1);
  ASSERT_TRUE(bucket.ok()) << bucket.status();
  EXPECT_EQ((*bucket)->Pass(t0, absl::Milliseconds(100)), t0 + absl::Milliseconds(600));
}

TEST(LinkBucketTest, AnUnwritableFolderIsAnError) {
  auto bucket = LinkBucket::Shared("/nonexistent-folder/node.link", 0);
  EXPECT_FALSE(bucket.ok());
  EXPECT_NE(bucket.status().message().find("/nonexistent-folder/node.link"), std::string::npos) << bucket.status();
  EXPECT_EQ(LinkBucket::Shared(TempPath("x.link"), 2).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pshard
