// ParallelFor: every element visited exactly once, chunks no smaller than
// the grain, the work really spread over threads, and reuse across runs.
#include "common/parallel_for.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pshard {
namespace {

TEST(ParallelForTest, CoversEveryElementOnceInChunksOfAtLeastTheGrain) {
  ParallelFor parallel(4);
  EXPECT_EQ(parallel.threads(), 4);
  for (int64_t n : {1, 7, 100, 1000, 4096, 100003}) {
    for (int64_t grain : {1, 10, 1000}) {
      std::vector<std::atomic<int>> visits(n);
      absl::Mutex mu;
      std::vector<std::pair<int64_t, int64_t>> chunks;
      parallel.Run(n, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) visits[i].fetch_add(1);
        absl::MutexLock lock(&mu);
        chunks.emplace_back(begin, end);
      });
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(visits[i].load(), 1) << "n " << n << " grain " << grain << " at " << i;
      }
      for (const auto& [begin, end] : chunks) {
        if (end != n) {
          EXPECT_GE(end - begin, grain) << "n " << n;
        }
      }
      EXPECT_LE(chunks.size(), 4u);
    }
  }
}

TEST(ParallelForTest, SpreadsLargeLoopsOverThreads) {
  ParallelFor parallel(3);
  absl::Mutex mu;
  std::set<std::thread::id> ids;
  // Each chunk waits until all three have started, so only three distinct
  // threads running at once can finish.
  std::atomic<int> started{0};
  parallel.Run(3000, 1000, [&](int64_t, int64_t) {
    started.fetch_add(1);
    while (started.load() < 3) std::this_thread::yield();
    absl::MutexLock lock(&mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 1u) << "the caller takes part";
}

TEST(ParallelForTest, SmallLoopsAndOneThreadRunInline) {
  ParallelFor one(1);
  std::thread::id where;
  one.Run(1000000, 1, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 1000000);
    where = std::this_thread::get_id();
  });
  EXPECT_EQ(where, std::this_thread::get_id());
  ParallelFor four(4);
  int calls = 0;
  four.Run(10, 100, [&](int64_t begin, int64_t end) {
    ++calls;
    EXPECT_EQ(end - begin, 10);
  });
  EXPECT_EQ(calls, 1);
  four.Run(0, 1, [&](int64_t, int64_t) { ADD_FAILURE() << "called for an empty range"; });
}

TEST(ParallelForTest, ManyRunsInARow) {
  ParallelFor parallel(4);
  std::atomic<int64_t> sum{0};
  for (int run = 0; run < 2000; ++run) {
    parallel.Run(64, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) sum.fetch_add(i);
    });
  }
  EXPECT_EQ(sum.load(), 2000 * (63 * 64 / 2));
}

}  // namespace
}  // namespace pshard
