#include "common/memory_policy.h"

#include <malloc.h>

#include <cstdio>

namespace pshard {

void ReuseFreedMemory() {
  // 32 MiB is the largest mmap threshold glibc accepts on 64-bit.
  if (mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 || mallopt(M_TRIM_THRESHOLD, 256 << 20) != 1) {
    std::fprintf(stderr, "pshard: warning: malloc refused the buffer-reuse settings; the data path will be slower\n");
  }
}

}  // namespace pshard
