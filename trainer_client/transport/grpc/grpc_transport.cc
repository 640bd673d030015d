#include "trainer_client/transport/grpc/grpc_transport.h"

#include <algorithm>
#include <cstdio>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "proto/chunk_frame.h"
#include "proto/rpc_util.h"

namespace pshard {
namespace {

std::string Where(int shard, const std::string& address) {
  return absl::StrCat("shard ", shard, " (", address, ")");
}

// The full names of the data-carrying methods, for the generic stub.
std::string MethodName(const char* method) {
  return absl::StrCat("/", v1::ShardService::service_full_name(), "/", method);
}

// Reads one shard's slice of a unit into its place in the unit buffer: each
// chunk is decoded and checksummed in one pass straight out of the slices
// gRPC received it in (an element may straddle two of them).
class FetchPart final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  FetchPart(grpc::GenericStub* stub, float* dest, TransferDone done, int shard, std::string address,
            const SliceRange& slice, int unit, int64_t version, const WireFormat& format, int trainer,
            absl::Duration timeout, const std::shared_ptr<CancelScope>& cancel)
      : dest_(dest), done_(std::move(done)), shard_(shard), address_(std::move(address)), slice_(slice),
        unit_(unit), version_(version), format_(format) {
    ctx_->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::FetchRequest request;
    request.set_unit(unit);
    request.set_version(version);
    request.set_encoding(EncodingToProto(format.encoding()));
    request.set_quant_block(format.block());
    request.set_trainer_rank(trainer);
    request_ = SerializeMessage(request);
    stub->PrepareBidiStreamingCall(ctx_.get(), MethodName("Fetch"), grpc::StubOptions(), this);
    if (cancel) cancel->OnCancel([ctx = ctx_] { ctx->TryCancel(); });
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&frame_);
    StartCall();
  }

  void OnWriteDone(bool) override {}

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows with the final status
    const int64_t frame_bytes = static_cast<int64_t>(frame_.Length());
    absl::Status s = Accept();
    frame_.Clear();
    if (!s.ok()) {
      error_ = s;
      ctx_->TryCancel();
      return;
    }
    wire_bytes_ += frame_bytes;
    StartRead(&frame_);
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
    done_(std::move(result), wire_bytes_);
    delete this;
  }

 private:
  absl::Status Accept() {
    v1::FetchChunk chunk;
    FrameData data;
    if (absl::Status s = ParseFrame(frame_, kFetchChunkDataField, &chunk, &data); !s.ok()) {
      return absl::DataLossError(s.message());
    }
    if (received_ == 0) {
      if (chunk.slice_length() != slice_.length || chunk.version() != version_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "server sent slice of ", chunk.slice_length(), " elements at version ", chunk.version(),
            "; expected ", slice_.length, " at version ", version_));
      }
      expected_crc_ = chunk.checksum();
    }
    const std::optional<size_t> count = format_.ElementsIn(data.size, static_cast<size_t>(slice_.length - received_));
    if (chunk.offset() != received_ || !count) {
      return absl::DataLossError(absl::StrCat("malformed chunk at element ", chunk.offset(), " (", data.size,
                                              " bytes of ", format_.ToString(), ")"));
    }
    crc_ = DecodeFrameData(format_, data, std::span<float>(dest_ + received_, *count), crc_);
    received_ += static_cast<int64_t>(*count);
    return absl::OkStatus();
  }

  float* const dest_;
  TransferDone done_;
  const int shard_;
  const std::string address_;
  const SliceRange slice_;
  const int unit_;
  const int64_t version_;
  const WireFormat format_;
  // Shared with the cancel scope, which may call TryCancel after the call ended.
  const std::shared_ptr<grpc::ClientContext> ctx_ = std::make_shared<grpc::ClientContext>();
  grpc::ByteBuffer request_;
  grpc::ByteBuffer frame_;
  absl::Status error_;
  int64_t received_ = 0;
  uint32_t crc_ = 0;
  uint32_t expected_crc_ = 0;
  int64_t wire_bytes_ = 0;
};

// Streams one shard's slice of a gradient to its owner. fp32 chunks are
// slices over the gradient itself (held until gRPC has sent them); other
// encodings are encoded once, straight into the slice that is sent.
class PushPart final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PushPart(grpc::GenericStub* stub, TransferDone done, std::shared_ptr<const std::vector<float>> grads, int shard,
           std::string address, const PushArgs& args, int64_t chunk_bytes, absl::Duration timeout)
      : done_(std::move(done)), grads_(std::move(grads)), shard_(shard),
        address_(std::move(address)), slice_(args.slice), unit_(args.unit), step_(args.step), format_(args.format),
        chunk_elements_(static_cast<int64_t>(args.format.ElementsPerPiece(static_cast<size_t>(chunk_bytes)))) {
    ctx_->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    header_.set_trainer_rank(args.first_rank);
    header_.set_step(args.step);
    header_.set_unit(args.unit);
    header_.set_encoding(EncodingToProto(args.format.encoding()));
    header_.set_quant_block(args.format.block());
    header_.set_non_finite(args.non_finite);
    header_.set_slice_length(args.slice.length);
    header_.set_micro_batch(args.micro_batch);
    header_.set_rank_count(args.rank_count);
    stub->PrepareBidiStreamingCall(ctx_.get(), MethodName("Push"), grpc::StubOptions(), this);
    if (args.cancel) args.cancel->OnCancel([ctx = ctx_] { ctx->TryCancel(); });
    StartRead(&response_frame_);
    WriteNext();
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call failed; OnDone reports why
    WriteNext();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // no response: OnDone has the status
    got_response_ = ParseMessage(response_frame_, &response_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::Status result = FromGrpcStatus(status);
    if (result.ok() && !got_response_.ok()) result = absl::DataLossError(got_response_.message());
    if (!result.ok()) {
      result = absl::Status(result.code(), absl::StrCat("push of unit ", unit_, " step ", step_, " to ",
                                                        Where(shard_, address_), ": ", result.message()));
    } else if (response_.disposition() == v1::PushResponse::ACCEPTED_NON_FINITE) {
      std::fprintf(stderr, "pshard-trainer: %s: %s\n", Where(shard_, address_).c_str(),
                   response_.detail().c_str());
    }
    done_(std::move(result), wire_bytes_);
    delete this;
  }

 private:
  void WriteNext() {
    if (offset_ >= slice_.length) {
      StartWritesDone();
      return;
    }
    const int64_t count = std::min(chunk_elements_, slice_.length - offset_);
    const std::span<const float> values(grads_->data() + slice_.begin + offset_, count);
    grpc::Slice data;
    if (format_.encoding() == WireEncoding::kFp32) {
      data = SliceOver(std::as_bytes(values), grads_);
    } else {
      // The chunk starts on a block boundary: its blocks are the slice's.
      data = grpc::Slice(format_.EncodedBytes(static_cast<size_t>(count)));
      EncodeElements(format_, values, reinterpret_cast<std::byte*>(const_cast<uint8_t*>(data.begin())));
    }
    header_.set_chunk_index(index_++);
    header_.set_offset(offset_);
    offset_ += count;
    frame_ = MakeFrame(header_, kPushChunkDataField, std::move(data));
    wire_bytes_ += static_cast<int64_t>(frame_.Length());
    StartWrite(&frame_);
  }

  TransferDone done_;
  std::shared_ptr<const std::vector<float>> grads_;
  const int shard_;
  const std::string address_;
  const SliceRange slice_;
  const int unit_;
  const int64_t step_;
  const WireFormat format_;
  const int64_t chunk_elements_;
  // Shared with the cancel scope, which may call TryCancel after the call ended.
  const std::shared_ptr<grpc::ClientContext> ctx_ = std::make_shared<grpc::ClientContext>();
  v1::PushChunk header_;  // every field but the data, repeated in each chunk
  grpc::ByteBuffer frame_;
  grpc::ByteBuffer response_frame_;
  v1::PushResponse response_;
  absl::Status got_response_ = absl::DataLossError("the server sent no response");
  int64_t offset_ = 0;
  int index_ = 0;
  int64_t wire_bytes_ = 0;
};

}  // namespace

GrpcTransport::GrpcTransport(Spec spec)
    : spec_(std::move(spec)), generic_(spec_.channel) {}

void GrpcTransport::Fetch(const FetchArgs& args, float* dest, TransferDone done) {
  new FetchPart(&generic_, dest, std::move(done), spec_.shard, spec_.address, args.slice, args.unit, args.version,
                args.format, args.trainer, spec_.rpc_timeout, args.cancel);
}

void GrpcTransport::Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) {
  new PushPart(&generic_, std::move(done), std::move(grads), spec_.shard, spec_.address, args, spec_.chunk_bytes,
               spec_.rpc_timeout);
}

}  // namespace pshard
