// Joining servers that are not there yet, or never will be: a trainer says
// every few seconds which servers it waits for and why, joins a server that
// comes up late, and gives up within seconds when waiting cannot help (a
// name that does not resolve past its grace period, a server of another
// job), naming the server and the reason.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shard_server/server.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/shard_client.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;

// A loopback port that nothing listens on (bound once, then released).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Options whose progress lines are collected into `lines`.
struct Joining {
  ShardClient::Options options;
  absl::Mutex mu;
  std::vector<std::string> lines;

  Joining(std::vector<std::string> addresses, absl::Duration timeout) {
    options.server_addresses = std::move(addresses);
    options.join_timeout = timeout;
    options.join_log_every = absl::Milliseconds(300);
    options.join_log = [this](const std::string& line) {
      absl::MutexLock lock(&mu);
      lines.push_back(line);
    };
  }
  std::string Log() {
    absl::MutexLock lock(&mu);
    std::string all;
    for (const std::string& l : lines) all += l + "\n";
    return all;
  }
};

TEST(JoinTest, ANameThatDoesNotResolveEndsTheJoinAfterItsGracePeriod) {
  Joining join({"no-such-server.invalid:7070"}, absl::Seconds(60));
  join.options.join_resolve_grace = absl::Seconds(2);
  const absl::Time start = absl::Now();
  auto client = ShardClient::Connect(join.options);
  ASSERT_FALSE(client.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kNotFound) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr("no-such-server.invalid:7070: the name does not resolve"));
  EXPECT_THAT(join.Log(), HasSubstr("waiting for 1 of 1 shard servers"));
  EXPECT_THAT(join.Log(), HasSubstr("no such name"));
}

TEST(JoinTest, ARefusingPortIsRetriedUntilTheDeadlineAndNamed) {
  const std::string address = absl::StrCat("127.0.0.1:", UnusedPort());
  Joining join({address}, absl::Seconds(3));
  const absl::Time start = absl::Now();
  auto client = ShardClient::Connect(join.options);
  ASSERT_FALSE(client.ok());
  EXPECT_GE(absl::Now() - start, absl::Seconds(3));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kDeadlineExceeded) << client.status();
  EXPECT_THAT(std::string(client.status().message()), HasSubstr(absl::StrCat(address, " (connection refused")));
  EXPECT_THAT(join.Log(), HasSubstr(absl::StrCat(address, " (connection refused")));
}

TEST(JoinTest, AServerOfAnotherJobEndsTheJoinAtOnceWhileAnotherIsStillDown) {
  auto a = LocalCluster::Start(TinyGptJob(3, 1));
  JobConfig other = TinyGptJob(3, 1);
  other.seed = 99;
  auto b = LocalCluster::Start(other);
  ASSERT_TRUE(a.ok() && b.ok());
  Joining join({(*a)->addresses()[0], absl::StrCat("127.0.0.1:", UnusedPort()), (*b)->addresses()[2]},
               absl::Seconds(60));
  const absl::Time start = absl::Now();
  auto client = ShardClient::Connect(join.options);
  ASSERT_FALSE(client.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr(absl::StrCat((*b)->addresses()[2], " runs a different job")));
}

TEST(JoinTest, AServerThatComesUpLateIsJoined) {
  const int port = UnusedPort();
  Joining join({absl::StrCat("127.0.0.1:", port)}, absl::Seconds(30));
  join.options.trainer_rank = 0;
  absl::StatusOr<std::unique_ptr<ShardClient>> client;
  std::thread trainer([&] { client = ShardClient::Connect(join.options); });
  absl::SleepFor(absl::Seconds(1.5));
  ShardServer::Spec spec;
  spec.job = TinyGptJob(1, 1);
  spec.address = absl::StrCat("127.0.0.1:", port);
  auto server = ShardServer::Start(spec);
  trainer.join();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(client.ok()) << client.status() << "\n" << join.Log();
  EXPECT_EQ((*client)->job().num_shards, 1);
  EXPECT_THAT(join.Log(), HasSubstr("connection refused"));
}

}  // namespace
}  // namespace pshard::testing
