// A process whose libraries keep more static thread-local storage than the
// 100 KiB stacks civetweb gives its threads cannot serve /metrics; the error
// says why. (CUDA's libraries hold ~190 KiB: that is why a trainer loads
// them only when it runs on a GPU, see trainer_client/gpu_plugin.h.)
#include <cstring>

#include "common/metrics/metrics.h"
#include "common/metrics/metrics_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard::metrics {
namespace {

// 160 KiB of static TLS in this executable, as a large library would add.
thread_local char g_large_thread_state[160 << 10];

TEST(MetricsServerTlsTest, TooMuchThreadLocalStorageIsNamedInTheError) {
  std::memset(g_large_thread_state, 1, sizeof(g_large_thread_state));  // keep it
  Registry registry;
  auto server = MetricsServer::Start("127.0.0.1:0", &registry);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(server.status().message()), ::testing::HasSubstr("Cannot create threads"));
  EXPECT_THAT(std::string(server.status().message()), ::testing::ContainsRegex("keep 1[6-9][0-9] KiB of thread-local"));
}

}  // namespace
}  // namespace pshard::metrics
