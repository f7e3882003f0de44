// Run-time dispatch of the element-wise kernels over three builds of the same
// loops (reduce/kernel_loops.h): portable, AVX2 + F16C, and AVX-512.
#include "reduce/reduce_kernels.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/errors.h"
#include "common/settings.h"
#include "reduce/half.h"
#include "reduce/kernel_loops.h"

#if defined(__x86_64__)
// g++ 12 warns about the deliberately undefined lanes inside its own AVX-512
// conversion intrinsics (avx512fintrin.h); nothing here reads them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define CLAWCOMM_X86 1
#define CLAWCOMM_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CLAWCOMM_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#endif

namespace clawcomm {
namespace {

using Reduce = void (*)(DataType, ReduceOp, void*, const void*, size_t);
using ToFloat = void (*)(DataType, const void*, float*, size_t, float);
using FromFloat = void (*)(DataType, const float*, void*, size_t, float);
using AddFrom16 = void (*)(DataType, float*, const void*, size_t, float);
using AddFrom16AndRound = void (*)(DataType, float*, const void*, void*, size_t, float, float);

struct KernelTable {
  Reduce reduce;
  ToFloat toFloat;
  FromFloat fromFloat;
  AddFrom16 addFrom16;
  AddFrom16AndRound addFrom16AndRound;
};

// One level's kernels and their table: thin wrappers, compiled with the
// level's target attribute (TARGET; empty for portable), through which the
// shared loops of kernel_loops.h inline and vectorise for that instruction
// set. `Cvt` gives the level's 16-bit conversions.
#define CLAWCOMM_KERNEL_SET(Name, Cvt, TARGET)                                                   \
  TARGET void reduce##Name(DataType t, ReduceOp op, void* dst, const void* src, size_t n) {      \
    kernels::reduce<Cvt>(t, op, dst, src, n);                                                    \
  }                                                                                              \
  TARGET void toFloat##Name(DataType t, const void* src, float* dst, size_t n, float scale) {    \
    kernels::toFloatScaled<Cvt>(t, src, dst, n, scale);                                          \
  }                                                                                              \
  TARGET void fromFloat##Name(DataType t, const float* src, void* dst, size_t n, float scale) {  \
    kernels::fromFloatScaled<Cvt>(t, src, dst, n, scale);                                        \
  }                                                                                              \
  TARGET void addFrom16##Name(DataType t, float* dst, const void* src, size_t n, float scale) {  \
    kernels::addFrom16<Cvt>(t, dst, src, n, scale);                                              \
  }                                                                                              \
  TARGET void addFrom16AndRound##Name(DataType t, float* dst, const void* src, void* out,        \
                                      size_t n, float dstScale, float outScale) {                \
    kernels::addFrom16AndRound<Cvt>(t, dst, src, out, n, dstScale, outScale);                    \
  }                                                                                              \
  const KernelTable Name##Kernels{reduce##Name, toFloat##Name, fromFloat##Name, addFrom16##Name, \
                                  addFrom16AndRound##Name};

CLAWCOMM_KERNEL_SET(portable, kernels::PortableCvt, )

#ifdef CLAWCOMM_X86

// float16 through the F16C instructions, 8 lanes at a time. (Called once per
// 512-element block, so these are plain calls: a target-specific function
// cannot be force-inlined into the generic loop templates.)
struct F16cCvt {
  static CLAWCOMM_TARGET_AVX2 void halfToFloat(const uint16_t* s, float* d, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; ++i) d[i] = clawcomm::halfToFloat(s[i]);
  }
  static CLAWCOMM_TARGET_AVX2 void floatToHalf(const float* s, uint16_t* d, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h =
          _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
    }
    for (; i < n; ++i) d[i] = clawcomm::floatToHalf(s[i]);
  }
};

// float16 through AVX-512F, 16 lanes at a time.
struct Avx512Cvt {
  static CLAWCOMM_TARGET_AVX512 void halfToFloat(const uint16_t* s, float* d, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
    }
    F16cCvt::halfToFloat(s + i, d + i, n - i);
  }
  static CLAWCOMM_TARGET_AVX512 void floatToHalf(const float* s, uint16_t* d, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i h =
          _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), h);
    }
    F16cCvt::floatToHalf(s + i, d + i, n - i);
  }
};

CLAWCOMM_KERNEL_SET(avx2, F16cCvt, CLAWCOMM_TARGET_AVX2)
CLAWCOMM_KERNEL_SET(avx512, Avx512Cvt, CLAWCOMM_TARGET_AVX512)

#endif  // CLAWCOMM_X86

const KernelTable& tableFor(SimdLevel level) {
#ifdef CLAWCOMM_X86
  CLAWCOMM_ARG_CHECK(level <= detectSimdLevel(), "clawcomm: this CPU does not support ",
                     simdLevelName(level), " kernels (best: ", simdLevelName(detectSimdLevel()),
                     ")");
  if (level == SimdLevel::kAvx512) return avx512Kernels;
  if (level == SimdLevel::kAvx2) return avx2Kernels;
#else
  CLAWCOMM_ARG_CHECK(level == SimdLevel::kPortable, "clawcomm: ", simdLevelName(level),
                     " kernels exist on x86-64 only");
#endif
  return portableKernels;
}

// The table in use, chosen on first use. A forked child forgets the parent's
// choice, so that a rank started by fork() honours its own CLAWCOMM_SIMD.
std::atomic<const KernelTable*> activeTable{nullptr};
[[maybe_unused]] const int forgetOnFork =
    pthread_atfork(nullptr, nullptr, [] { activeTable.store(nullptr); });

SimdLevel levelFromEnv() {
  const SimdLevel best = detectSimdLevel();
  switch (simdChoiceFromEnv()) {
    case SimdChoice::kPortable: return SimdLevel::kPortable;
    case SimdChoice::kAvx2: return std::min(best, SimdLevel::kAvx2);
    default: return best;
  }
}

const KernelTable& active() {
  const KernelTable* t = activeTable.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = &tableFor(levelFromEnv());
    activeTable.store(t, std::memory_order_release);
  }
  return *t;
}

}  // namespace

const char* simdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kPortable: return "portable";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
  }
  return "?";
}

SimdLevel detectSimdLevel() {
#ifdef CLAWCOMM_X86
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      return SimdLevel::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return SimdLevel::kAvx2;
    }
    return SimdLevel::kPortable;
  }();
  return level;
#else
  return SimdLevel::kPortable;
#endif
}

SimdLevel activeSimdLevel() {
  const KernelTable* t = &active();
  for (SimdLevel l : {SimdLevel::kAvx512, SimdLevel::kAvx2}) {
    if (l <= detectSimdLevel() && t == &tableFor(l)) return l;
  }
  return SimdLevel::kPortable;
}

void reduceInto(DataType type, ReduceOp op, void* dst, const void* src, size_t n) {
  if (n) active().reduce(type, op, dst, src, n);
}

void toFloat32(DataType type, const void* src, float* dst, size_t n, float scale) {
  if (n) active().toFloat(type, src, dst, n, scale);
}

void fromFloat32(DataType type, const float* src, void* dst, size_t n, float scale) {
  if (n) active().fromFloat(type, src, dst, n, scale);
}

void addFrom16(DataType type, float* dst, const void* src, size_t n, float dstScale) {
  if (n) active().addFrom16(type, dst, src, n, dstScale);
}

void addFrom16AndRound(DataType type, float* dst, const void* src, void* out, size_t n,
                       float dstScale, float outScale) {
  if (n) active().addFrom16AndRound(type, dst, src, out, n, dstScale, outScale);
}

void reduceIntoAt(SimdLevel level, DataType type, ReduceOp op, void* dst, const void* src,
                  size_t n) {
  const KernelTable& t = tableFor(level);
  if (n) t.reduce(type, op, dst, src, n);
}

void toFloat32At(SimdLevel level, DataType type, const void* src, float* dst, size_t n,
                 float scale) {
  const KernelTable& t = tableFor(level);
  if (n) t.toFloat(type, src, dst, n, scale);
}

void fromFloat32At(SimdLevel level, DataType type, const float* src, void* dst, size_t n,
                   float scale) {
  const KernelTable& t = tableFor(level);
  if (n) t.fromFloat(type, src, dst, n, scale);
}

void addFrom16At(SimdLevel level, DataType type, float* dst, const void* src, size_t n,
                 float dstScale) {
  const KernelTable& t = tableFor(level);
  if (n) t.addFrom16(type, dst, src, n, dstScale);
}

void addFrom16AndRoundAt(SimdLevel level, DataType type, float* dst, const void* src, void* out,
                         size_t n, float dstScale, float outScale) {
  const KernelTable& t = tableFor(level);
  if (n) t.addFrom16AndRound(type, dst, src, out, n, dstScale, outScale);
}

void divideInPlace(DataType type, void* dstv, size_t n, double divisor) {
  switch (type) {
    case DataType::kFloat32: {
      float* d = static_cast<float*>(dstv);
      const float s = float(divisor);
      for (size_t i = 0; i < n; ++i) d[i] /= s;
      return;
    }
    case DataType::kFloat64: {
      double* d = static_cast<double*>(dstv);
      for (size_t i = 0; i < n; ++i) d[i] /= divisor;
      return;
    }
    case DataType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dstv);
      for (size_t i = 0; i < n; ++i) d[i] = floatToHalf(halfToFloat(d[i]) / float(divisor));
      return;
    }
    case DataType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dstv);
      for (size_t i = 0; i < n; ++i) d[i] = floatToBf16(bf16ToFloat(d[i]) / float(divisor));
      return;
    }
    default: CLAWCOMM_CHECK(false, "AVG on ", dataTypeName(type));
  }
}

}  // namespace clawcomm
