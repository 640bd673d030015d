#include "common/copy.h"

#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace pshard {

void CopyBytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= 256 && n <= (size_t{4} << 20)) {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    for (; n >= 64; d += 64, s += 64, n -= 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    std::memcpy(d, s, n);  // under 64 bytes: glibc's vector moves
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace pshard
