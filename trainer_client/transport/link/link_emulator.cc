#include "trainer_client/transport/link/link_emulator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/link_rate.h"
#include "common/rng.h"

namespace pshard {
namespace {

absl::StatusOr<absl::Duration> ParseDelay(const std::string& what, const std::string& text) {
  if (text.empty() || text == "0") return absl::ZeroDuration();
  absl::Duration d;
  if (!absl::ParseDuration(text, &d) || d < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("link ", what, " '", text, "' is not a duration such as 10ms"));
  }
  return d;
}

// A bucket file: two 64-bit words (out, in), on their own cache lines.
constexpr size_t kBucketFileBytes = 128;
constexpr size_t kSlotStride = 64;

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<LinkSpec> LinkSpec::Parse(const std::string& rate, const std::string& latency,
                                         const std::string& jitter) {
  LinkSpec spec;
  absl::StatusOr<double> r = ParseLinkRate(rate);
  if (!r.ok()) return r.status();
  spec.bytes_per_second = *r;
  absl::StatusOr<absl::Duration> l = ParseDelay("delay", latency);
  if (!l.ok()) return l.status();
  spec.latency = *l;
  absl::StatusOr<absl::Duration> j = ParseDelay("jitter", jitter);
  if (!j.ok()) return j.status();
  spec.jitter = *j;
  return spec;
}

std::string LinkSpec::ToString() const {
  if (!enabled()) return "unshaped";
  const std::string rate =
      bytes_per_second > 0 ? absl::StrFormat("%.1f Mbit/s", bytes_per_second * 8 / 1e6) : std::string("unlimited");
  return absl::StrCat(rate, ", ", absl::FormatDuration(latency), " latency, ", absl::FormatDuration(jitter),
                      " jitter");
}

std::shared_ptr<LinkBucket> LinkBucket::InProcess() {
  std::shared_ptr<LinkBucket> bucket(new LinkBucket(nullptr, nullptr, 0));
  bucket->free_at_ = &bucket->own_;
  return bucket;
}

absl::StatusOr<std::shared_ptr<LinkBucket>> LinkBucket::Shared(const std::string& path, int slot) {
  if (slot < 0 || slot > 1) return absl::InvalidArgumentError(absl::StrCat("bucket slot ", slot, " is not 0 or 1"));
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot open the link bucket file", path);
  // Growing a file to its size is idempotent: every process may do it.
  struct stat st;
  if (fstat(fd, &st) != 0 || (st.st_size < static_cast<off_t>(kBucketFileBytes) &&
                              ftruncate(fd, static_cast<off_t>(kBucketFileBytes)) != 0)) {
    const absl::Status s = Errno("cannot size the link bucket file", path);
    close(fd);
    return s;
  }
  void* mapping = mmap(nullptr, kBucketFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (mapping == MAP_FAILED) return Errno("cannot map the link bucket file", path);
  static_assert(std::atomic<int64_t>::is_always_lock_free, "shared buckets need lock-free 64-bit atomics");
  auto* word = reinterpret_cast<std::atomic<int64_t>*>(static_cast<char*>(mapping) + slot * kSlotStride);
  return std::shared_ptr<LinkBucket>(new LinkBucket(word, mapping, kBucketFileBytes));
}

LinkBucket::~LinkBucket() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

absl::Time LinkBucket::Pass(absl::Time ready, absl::Duration transmission) {
  const int64_t ready_ns = absl::ToUnixNanos(ready);
  const int64_t length_ns = absl::ToInt64Nanoseconds(transmission);
  int64_t free_at = free_at_->load(std::memory_order_relaxed);
  int64_t done = 0;
  do {
    done = std::max(free_at, ready_ns) + length_ns;
  } while (!free_at_->compare_exchange_weak(free_at, done, std::memory_order_acq_rel, std::memory_order_relaxed));
  return absl::FromUnixNanos(done);
}

EmulatedTransport::EmulatedTransport(std::unique_ptr<Transport> inner, LinkSpec spec, LinkPath path,
                                     DeadlineTimer* timer, uint64_t seed)
    : inner_(std::move(inner)), spec_(spec), path_(std::move(path)), timer_(timer), seed_(seed) {}

absl::Time EmulatedTransport::Arrival(const std::vector<std::shared_ptr<LinkBucket>>& path, absl::Time ready,
                                      int64_t bytes) {
  absl::Time through = ready;
  if (spec_.bytes_per_second > 0) {
    // The interface's rate counts frames: the message's TCP segments and their headers.
    const absl::Duration transmission =
        absl::Seconds(static_cast<double>(EthernetBytes(bytes)) / spec_.bytes_per_second);
    for (const auto& bucket : path) through = std::max(through, bucket->Pass(ready, transmission));
  }
  absl::Duration jitter;
  if (spec_.jitter > absl::ZeroDuration()) jitter = spec_.jitter * UniformAt(seed_, 0, messages_++);
  return through + spec_.latency + jitter;
}

void EmulatedTransport::At(absl::Time when, std::function<void()> f) {
  if (when <= absl::Now()) return f();
  timer_->Schedule(when, std::move(f));
}

void EmulatedTransport::Fetch(const FetchArgs& args, float* dest, TransferDone done) {
  // The request is small: it pays the latency only. The server sends the
  // slice when it has it; its bytes then cross both interfaces.
  At(absl::Now() + spec_.latency, [this, args, dest, done = std::move(done)]() mutable {
    inner_->Fetch(args, dest, [this, done = std::move(done)](absl::Status status, int64_t bytes) mutable {
      const absl::Time arrival = Arrival(path_.down, absl::Now(), bytes);
      At(arrival, [done = std::move(done), status = std::move(status), bytes]() mutable {
        done(std::move(status), bytes);
      });
    });
  });
}

void EmulatedTransport::Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads,
                             TransferDone done) {
  // The server sees the gradient once its bytes have crossed; its answer
  // comes back one latency later.
  const int64_t bytes = static_cast<int64_t>(args.format.EncodedBytes(static_cast<size_t>(args.slice.length)));
  const absl::Time arrival = Arrival(path_.up, absl::Now(), bytes);
  At(arrival, [this, args, grads = std::move(grads), done = std::move(done)]() mutable {
    inner_->Push(args, std::move(grads), [this, done = std::move(done)](absl::Status status, int64_t wire) mutable {
      At(absl::Now() + spec_.latency, [done = std::move(done), status = std::move(status), wire]() mutable {
        done(std::move(status), wire);
      });
    });
  });
}

}  // namespace pshard
