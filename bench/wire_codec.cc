// The trainer's per-byte work on a fetched slice, in GB/s of encoded bytes
// (Google Benchmark): CRC-32C alone, and decode + checksum in one pass per
// encoding, on a range that fits in cache (32 KiB) and on one slice of a
// 64 MiB unit from 4 servers (16 MiB of fp32 values), which comes from
// memory. Against memcpy and CopyBytes of the same bytes, the floor of any
// pass.
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/checksum.h"
#include "common/copy.h"
#include "common/wire_encoding.h"

namespace {

void SetBytes(benchmark::State& state, size_t bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

// A copy of the range by `kCopy` (glibc's memcpy or CopyBytes).
template <void* (*kCopy)(void*, const void*, size_t)>
void BM_Copy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<std::byte> in(bytes, std::byte{1}), out(bytes);
  for (auto _ : state) {
    kCopy(out.data(), in.data(), bytes);
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, bytes);
}

void* Memcpy(void* dst, const void* src, size_t n) { return std::memcpy(dst, src, n); }
void* CopyBytes(void* dst, const void* src, size_t n) {
  pshard::CopyBytes(dst, src, n);
  return dst;
}

void BM_Crc32c(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<std::byte> in(bytes, std::byte{1});
  for (auto _ : state) benchmark::DoNotOptimize(pshard::Crc32c(in.data(), bytes));
  SetBytes(state, bytes);
}

template <pshard::WireEncoding kEncoding>
void BM_DecodeAndChecksum(benchmark::State& state) {
  const size_t elements = static_cast<size_t>(state.range(0)) / sizeof(float);
  const size_t bytes = pshard::WireFormat(kEncoding).EncodedBytes(elements);
  std::vector<std::byte> in(bytes, std::byte{1});
  std::vector<float> out(elements);
  for (auto _ : state) benchmark::DoNotOptimize(pshard::DecodeAndChecksum(kEncoding, in.data(), out, 0));
  SetBytes(state, bytes);
}

// The sender's encoding of a slice (block-quantized: a scale and codes per
// block), in GB/s of fp32 values read.
template <pshard::WireEncoding kEncoding>
void BM_Encode(benchmark::State& state) {
  const size_t elements = static_cast<size_t>(state.range(0)) / sizeof(float);
  const pshard::WireFormat format(kEncoding);
  std::vector<float> in(elements);
  for (size_t i = 0; i < elements; ++i) in[i] = static_cast<float>(i % 251) * 1e-3f - 0.1f;
  std::vector<std::byte> out(format.EncodedBytes(elements));
  for (auto _ : state) {
    pshard::EncodeElements(format, in, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, elements * sizeof(float));
}

// Sizes in fp32 bytes: 32 KiB (cache) and 16 MiB (one slice, memory).
BENCHMARK(BM_Copy<Memcpy>)->Name("BM_Memcpy")->Arg(32 << 10)->Arg(16 << 20);
BENCHMARK(BM_Copy<CopyBytes>)->Name("BM_CopyBytes")->Arg(32 << 10)->Arg(16 << 20);
BENCHMARK(BM_Crc32c)->Arg(32 << 10)->Arg(16 << 20);
BENCHMARK(BM_DecodeAndChecksum<pshard::WireEncoding::kFp32>)->Arg(32 << 10)->Arg(16 << 20);
BENCHMARK(BM_DecodeAndChecksum<pshard::WireEncoding::kBf16>)->Arg(32 << 10)->Arg(16 << 20);
BENCHMARK(BM_Encode<pshard::WireEncoding::kInt8>)->Arg(32 << 10)->Arg(16 << 20);
BENCHMARK(BM_Encode<pshard::WireEncoding::kInt4>)->Arg(32 << 10)->Arg(16 << 20);

}  // namespace

BENCHMARK_MAIN();
