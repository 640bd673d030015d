#include "trainer_client/transport/grpc/grpc_transport.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "proto/rpc_util.h"

namespace pshard {
namespace {

std::string Where(int shard, const std::string& address) {
  return absl::StrCat("shard ", shard, " (", address, ")");
}

// Reads one shard's slice of a unit into its place in the unit buffer.
class FetchPart final : public grpc::ClientReadReactor<v1::FetchChunk> {
 public:
  FetchPart(v1::ShardService::Stub* stub, float* dest, TransferDone done, int shard,
            std::string address, const SliceRange& slice, int unit, int64_t version,
            WireEncoding encoding, int trainer, absl::Duration timeout, EmulatedLink* up,
            EmulatedLink* down, DeadlineTimer* timer)
      : dest_(dest), done_(std::move(done)), shard_(shard), address_(std::move(address)), slice_(slice),
        unit_(unit), version_(version), encoding_(encoding), down_(down), timer_(timer) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    request_.set_unit(unit);
    request_.set_version(version);
    request_.set_encoding(EncodingToProto(encoding));
    request_.set_trainer_rank(trainer);
    request_arrival_ = up->Admit(static_cast<int64_t>(request_.ByteSizeLong()));
    stub->async()->Fetch(&ctx_, &request_, this);
    StartRead(&chunk_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows with the final status
    if (absl::Status s = Accept(); !s.ok()) {
      error_ = s;
      ctx_.TryCancel();
      return;
    }
    // On an emulated link the chunk is usable only once it has "arrived";
    // reading the next one waits until then (flow control does the rest).
    arrival_ = down_->Admit(static_cast<int64_t>(chunk_.ByteSizeLong()), request_arrival_);
    if (arrival_ <= absl::Now()) return StartRead(&chunk_);
    AddHold();
    timer_->Schedule(arrival_, [this] {
      StartRead(&chunk_);
      RemoveHold();
    });
  }

  void OnDone(const grpc::Status& status) override {
    absl::Status result = error_;
    if (result.ok()) result = FromGrpcStatus(status);
    if (result.ok() && received_ != slice_.length) {
      result = absl::DataLossError(absl::StrCat("stream ended after ", received_, " of ",
                                                slice_.length, " elements"));
    }
    if (result.ok() && crc_ != expected_crc_) {
      result = absl::DataLossError(absl::StrCat("checksum mismatch: got ", crc_, ", published ",
                                                expected_crc_));
    }
    if (!result.ok()) {
      result = absl::Status(result.code(), absl::StrCat("fetch of unit ", unit_, " version ", version_,
                                                        " from ", Where(shard_, address_), ": ",
                                                        result.message()));
    }
    if (arrival_ > absl::Now()) {
      timer_->Schedule(arrival_, [done = std::move(done_), result, bytes = wire_bytes_]() mutable {
        done(std::move(result), bytes);
      });
    } else {
      done_(std::move(result), wire_bytes_);
    }
    delete this;
  }

 private:
  absl::Status Accept() {
    if (received_ == 0) {
      if (chunk_.slice_length() != slice_.length || chunk_.version() != version_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "server sent slice of ", chunk_.slice_length(), " elements at version ", chunk_.version(),
            "; expected ", slice_.length, " at version ", version_));
      }
      expected_crc_ = chunk_.checksum();
    }
    const size_t width = BytesPerElement(encoding_);
    const int64_t count = static_cast<int64_t>(chunk_.data().size() / width);
    if (chunk_.offset() != received_ || chunk_.data().size() % width != 0 ||
        received_ + count > slice_.length) {
      return absl::DataLossError(absl::StrCat("malformed chunk at element ", chunk_.offset()));
    }
    crc_ = DecodeAndChecksum(encoding_, reinterpret_cast<const std::byte*>(chunk_.data().data()),
                             std::span<float>(dest_ + received_, count), crc_);
    received_ += count;
    wire_bytes_ += static_cast<int64_t>(chunk_.ByteSizeLong());
    return absl::OkStatus();
  }

  float* const dest_;
  TransferDone done_;
  const int shard_;
  const std::string address_;
  const SliceRange slice_;
  const int unit_;
  const int64_t version_;
  const WireEncoding encoding_;
  EmulatedLink* const down_;
  DeadlineTimer* const timer_;
  absl::Time request_arrival_;
  absl::Time arrival_ = absl::InfinitePast();
  grpc::ClientContext ctx_;
  v1::FetchRequest request_;
  v1::FetchChunk chunk_;
  absl::Status error_;
  int64_t received_ = 0;
  uint32_t crc_ = 0;
  uint32_t expected_crc_ = 0;
  int64_t wire_bytes_ = 0;
};

// Streams one shard's slice of a gradient to its owner.
class PushPart final : public grpc::ClientWriteReactor<v1::PushChunk> {
 public:
  PushPart(v1::ShardService::Stub* stub, TransferDone done,
           std::shared_ptr<const std::vector<float>> grads, int shard, std::string address,
           const SliceRange& slice, int unit, int64_t step, WireEncoding encoding, int trainer,
           int64_t chunk_bytes, absl::Duration timeout, EmulatedLink* up, EmulatedLink* down,
           DeadlineTimer* timer, int micro_batch, int rank_count)
      : done_(std::move(done)), grads_(std::move(grads)), shard_(shard),
        address_(std::move(address)), slice_(slice), unit_(unit), step_(step), encoding_(encoding),
        up_(up), down_(down), timer_(timer),
        chunk_elements_(std::max<int64_t>(1, chunk_bytes / static_cast<int64_t>(BytesPerElement(encoding)))) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    chunk_.set_trainer_rank(trainer);
    chunk_.set_step(step);
    chunk_.set_unit(unit);
    chunk_.set_encoding(EncodingToProto(encoding));
    chunk_.set_slice_length(slice.length);
    chunk_.set_micro_batch(micro_batch);
    chunk_.set_rank_count(rank_count);
    stub->async()->Push(&ctx_, &response_, this);
    WriteNext();
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call failed; OnDone reports why
    WriteNext();
  }

  void OnDone(const grpc::Status& status) override {
    absl::Status result = FromGrpcStatus(status);
    if (!result.ok()) {
      result = absl::Status(result.code(), absl::StrCat("push of unit ", unit_, " step ", step_, " to ",
                                                        Where(shard_, address_), ": ", result.message()));
    } else if (response_.disposition() == v1::PushResponse::ACCEPTED_NON_FINITE) {
      std::fprintf(stderr, "pshard-trainer: %s: %s\n", Where(shard_, address_).c_str(),
                   response_.detail().c_str());
    }
    // The response travels back over the emulated link too.
    const absl::Time arrival = down_->Admit(static_cast<int64_t>(response_.ByteSizeLong()));
    if (arrival > absl::Now()) {
      timer_->Schedule(arrival, [done = std::move(done_), result, bytes = wire_bytes_]() mutable {
        done(std::move(result), bytes);
      });
    } else {
      done_(std::move(result), wire_bytes_);
    }
    delete this;
  }

 private:
  void WriteNext() {
    if (offset_ >= slice_.length) {
      StartWritesDone();
      return;
    }
    const int64_t count = std::min(chunk_elements_, slice_.length - offset_);
    std::string* data = chunk_.mutable_data();
    data->resize(count * BytesPerElement(encoding_));
    EncodeElements(encoding_, std::span<const float>(grads_->data() + slice_.begin + offset_, count),
                   reinterpret_cast<std::byte*>(data->data()));
    chunk_.set_chunk_index(index_++);
    chunk_.set_offset(offset_);
    offset_ += count;
    wire_bytes_ += static_cast<int64_t>(chunk_.ByteSizeLong());
    // On an emulated link the chunk reaches the server when it has crossed it.
    const absl::Time arrival = up_->Admit(static_cast<int64_t>(chunk_.ByteSizeLong()));
    if (arrival <= absl::Now()) return StartWrite(&chunk_);
    AddHold();
    timer_->Schedule(arrival, [this] {
      StartWrite(&chunk_);
      RemoveHold();
    });
  }

  TransferDone done_;
  std::shared_ptr<const std::vector<float>> grads_;
  const int shard_;
  const std::string address_;
  const SliceRange slice_;
  const int unit_;
  const int64_t step_;
  const WireEncoding encoding_;
  EmulatedLink* const up_;
  EmulatedLink* const down_;
  DeadlineTimer* const timer_;
  const int64_t chunk_elements_;
  grpc::ClientContext ctx_;
  v1::PushChunk chunk_;
  v1::PushResponse response_;
  int64_t offset_ = 0;
  int index_ = 0;
  int64_t wire_bytes_ = 0;
};

}  // namespace

GrpcTransport::GrpcTransport(Spec spec)
    : spec_(std::move(spec)),
      down_(spec_.link, 2 * static_cast<uint64_t>(spec_.shard)),
      up_(spec_.link, 2 * static_cast<uint64_t>(spec_.shard) + 1) {}

void GrpcTransport::Fetch(const FetchArgs& args, float* dest, TransferDone done) {
  new FetchPart(spec_.stub, dest, std::move(done), spec_.shard, spec_.address, args.slice, args.unit, args.version,
                args.encoding, args.trainer, spec_.rpc_timeout, &up_, &down_, spec_.timer);
}

void GrpcTransport::Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) {
  new PushPart(spec_.stub, std::move(done), std::move(grads), spec_.shard, spec_.address, args.slice, args.unit,
               args.step, args.encoding, args.first_rank, spec_.chunk_bytes, spec_.rpc_timeout, &up_, &down_,
               spec_.timer, args.micro_batch, args.rank_count);
}

}  // namespace pshard
