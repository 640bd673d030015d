#include "trainer_client/group/nccl/nccl_group.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "trainer_client/model/cuda/cuda_check.h"

namespace pshard {
namespace {

absl::Status NcclStatus(const char* call, ncclResult_t r) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, " failed: ", ncclGetErrorString(r)));
}

#define PSHARD_NCCL(call) \
  if (absl::Status s = NcclStatus(#call, call); !s.ok()) return s

class NcclGroupMember final : public GroupCollective {
 public:
  NcclGroupMember(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream)
      : rank_(rank), size_(size), device_(device), comm_(comm), stream_(stream) {}

  ~NcclGroupMember() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaFree(send_);
    cudaFree(recv_);
    cudaStreamDestroy(stream_);
  }

  int size() const override { return size_; }
  int rank() const override { return rank_; }

  absl::Status AllGather(std::span<float> buffer, const GroupOwnership& owned) override {
    if (absl::Status s = CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size_); !s.ok()) return s;
    const int64_t part = LongestPart(owned);
    if (absl::Status s = Reserve(part, part * size_); !s.ok()) return s;
    std::vector<float> packed(part, 0.0f);
    PackRanges(buffer, owned[rank_], packed.data());
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send_, packed.data(), part * sizeof(float), cudaMemcpyHostToDevice, stream_));
    PSHARD_NCCL(ncclAllGather(send_, recv_, part, ncclFloat32, comm_, stream_));
    std::vector<float> gathered(part * size_);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(gathered.data(), recv_, gathered.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    for (int m = 0; m < size_; ++m) {
      if (m != rank_) UnpackRanges(gathered.data() + m * part, owned[m], buffer);
    }
    return absl::OkStatus();
  }

  absl::Status ReduceScatter(std::span<float> buffer, const GroupOwnership& owned) override {
    if (absl::Status s = CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size_); !s.ok()) return s;
    const int64_t part = LongestPart(owned);
    if (absl::Status s = Reserve(part * size_, part); !s.ok()) return s;
    std::vector<float> packed(part * size_, 0.0f);
    for (int m = 0; m < size_; ++m) PackRanges(buffer, owned[m], packed.data() + m * part);
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send_, packed.data(), packed.size() * sizeof(float), cudaMemcpyHostToDevice,
                                stream_));
    PSHARD_NCCL(ncclReduceScatter(send_, recv_, part, ncclFloat32, ncclSum, comm_, stream_));
    std::vector<float> mine(part);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(mine.data(), recv_, part * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    UnpackRanges(mine.data(), owned[rank_], buffer);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::vector<float>>> Exchange(const std::vector<std::vector<float>>& outgoing,
                                                           const std::vector<int64_t>& expected) override {
    if (static_cast<int>(outgoing.size()) != size_ || static_cast<int>(expected.size()) != size_) {
      return absl::InvalidArgumentError(absl::StrCat("NCCL group exchange: parts for ", outgoing.size(),
                                                     " members and sizes for ", expected.size(), "; the group has ",
                                                     size_));
    }
    std::vector<int64_t> send_at(size_ + 1, 0), recv_at(size_ + 1, 0);
    for (int m = 0; m < size_; ++m) {
      send_at[m + 1] = send_at[m] + (m == rank_ ? 0 : static_cast<int64_t>(outgoing[m].size()));
      recv_at[m + 1] = recv_at[m] + (m == rank_ ? 0 : expected[m]);
    }
    if (absl::Status s = Reserve(std::max<int64_t>(send_at[size_], 1), std::max<int64_t>(recv_at[size_], 1)); !s.ok()) {
      return s;
    }
    std::vector<float> packed(send_at[size_]);
    for (int m = 0; m < size_; ++m) {
      if (m != rank_) std::copy(outgoing[m].begin(), outgoing[m].end(), packed.begin() + send_at[m]);
    }
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send_, packed.data(), packed.size() * sizeof(float), cudaMemcpyHostToDevice,
                                         stream_));
    // Point-to-point pairs in one group call: NCCL's all-to-all. The group
    // is always closed, whatever a send or receive returned.
    PSHARD_NCCL(ncclGroupStart());
    absl::Status posted;
    for (int m = 0; m < size_ && posted.ok(); ++m) {
      if (m == rank_) continue;
      if (!outgoing[m].empty()) {
        posted = NcclStatus("ncclSend", ncclSend(send_ + send_at[m], outgoing[m].size(), ncclFloat32, m, comm_, stream_));
      }
      if (posted.ok() && expected[m] > 0) {
        posted = NcclStatus("ncclRecv", ncclRecv(recv_ + recv_at[m], expected[m], ncclFloat32, m, comm_, stream_));
      }
    }
    PSHARD_NCCL(ncclGroupEnd());
    if (!posted.ok()) return posted;
    std::vector<float> all(recv_at[size_]);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(all.data(), recv_, all.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    std::vector<std::vector<float>> received(size_);
    for (int m = 0; m < size_; ++m) {
      if (m != rank_) received[m].assign(all.begin() + recv_at[m], all.begin() + recv_at[m + 1]);
    }
    return received;
  }

 private:
  static int64_t LongestPart(const GroupOwnership& owned) {
    int64_t longest = 0;
    for (const auto& ranges : owned) longest = std::max(longest, RangeElements(ranges));
    return std::max<int64_t>(longest, 1);
  }
  // Device buffers of at least `send` and `recv` floats.
  absl::Status Reserve(int64_t send, int64_t recv) {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (send > send_floats_) {
      cudaFree(send_);
      send_ = nullptr;
      CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&send_), send * sizeof(float)));
      send_floats_ = send;
    }
    if (recv > recv_floats_) {
      cudaFree(recv_);
      recv_ = nullptr;
      CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&recv_), recv * sizeof(float)));
      recv_floats_ = recv;
    }
    return absl::OkStatus();
  }

  const int rank_;
  const int size_;
  const int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  float* send_ = nullptr;
  float* recv_ = nullptr;
  int64_t send_floats_ = 0;
  int64_t recv_floats_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GroupCollective>> JoinNcclGroup(int rank, int size, int device,
                                                               const RendezvousFn& rendezvous) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL group member ", rank, " of ", size, " is out of range"));
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ncclUniqueId id{};
  std::string payload;
  if (rank == 0) {
    PSHARD_NCCL(ncclGetUniqueId(&id));
    payload.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  absl::StatusOr<std::vector<std::string>> posted = rendezvous(payload);
  if (!posted.ok()) return posted.status();
  if (posted->empty() || (*posted)[0].size() != sizeof(id)) {
    return absl::InternalError("NCCL group: member 0 posted no unique id to the rendezvous");
  }
  std::memcpy(&id, (*posted)[0].data(), sizeof(id));
  ncclComm_t comm = nullptr;
  PSHARD_NCCL(ncclCommInitRank(&comm, size, id, rank));
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    ncclCommDestroy(comm);
    return internal::CudaError("cudaStreamCreateWithFlags", e, __FILE__, __LINE__);
  }
  return std::unique_ptr<GroupCollective>(new NcclGroupMember(rank, size, device, comm, stream));
}

}  // namespace pshard
