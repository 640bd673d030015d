# PSHARD_WITH_FUZZERS: the libFuzzer harnesses of fuzz/. They need clang
# (its libFuzzer and sanitizer runtimes: Debian's clang-14 and
# libclang-rt-14-dev), and the whole build is then instrumented for them:
# coverage for libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer
# (any undefined behaviour stops the program, so that the fuzzer reports it).
# Use a build folder of its own, e.g.
#   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
#     -DPSHARD_WITH_FUZZERS=ON -DPSHARD_WITH_UCX=OFF
option(PSHARD_WITH_FUZZERS "Build the libFuzzer harnesses, the whole build with ASan and UBSan (clang)" OFF)

if(PSHARD_WITH_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang" OR NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "PSHARD_WITH_FUZZERS=ON needs clang for C and C++ (libFuzzer), not "
                        "${CMAKE_CXX_COMPILER_ID}; configure a build folder of its own with "
                        "-DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 "
                        "(Debian packages clang-14 and libclang-rt-14-dev)")
  endif()
  if(PSHARD_WITH_CUDA)
    message(FATAL_ERROR "PSHARD_WITH_FUZZERS=ON builds the host code only; configure it without PSHARD_WITH_CUDA")
  endif()
  set(pshard_sanitizers -fsanitize=address,undefined -fno-sanitize-recover=undefined)
  add_compile_options(-fsanitize=fuzzer-no-link ${pshard_sanitizers} -fno-omit-frame-pointer)
  add_link_options(${pshard_sanitizers})
  include(CheckCXXSourceCompiles)
  set(CMAKE_REQUIRED_FLAGS "-fsanitize=fuzzer")
  check_cxx_source_compiles([[
    #include <cstddef>
    #include <cstdint>
    extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }
  ]] PSHARD_HAVE_LIBFUZZER)
  unset(CMAKE_REQUIRED_FLAGS)
  if(NOT PSHARD_HAVE_LIBFUZZER)
    message(FATAL_ERROR "PSHARD_WITH_FUZZERS=ON but ${CMAKE_CXX_COMPILER} cannot link -fsanitize=fuzzer; "
                        "install its compiler runtime (Debian: libclang-rt-14-dev for clang-14)")
  endif()
  message(STATUS "Fuzzers: on (libFuzzer, ASan, UBSan)")
endif()
