#include "common/settings.h"

#include <cstdlib>
#include <initializer_list>
#include <string>

#include "common/errors.h"

namespace clawcomm {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

size_t envBytes(const char* name, size_t fallback, size_t minimum) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  unsigned long long n = std::strtoull(v, &end, 10);
  CLAWCOMM_ARG_CHECK(end && *end == '\0' && n >= minimum, "clawcomm: ", name, "=", v,
                     " is not a byte count >= ", minimum);
  return size_t(n);
}

// The index of the variable's value in `choices` (0, the first, when unset).
int envChoice(const char* name, std::initializer_list<const char*> choices) {
  const char* v = env(name);
  if (!v) return 0;
  std::string allowed;
  int i = 0;
  for (const char* c : choices) {
    if (std::string(v) == c) return i;
    allowed += (i++ ? ", " : "") + std::string(c);
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: ", name, "=", v, " is not one of ", allowed));
}

}  // namespace

SimdChoice simdChoiceFromEnv() {
  return SimdChoice(envChoice("CLAWCOMM_SIMD", {"auto", "avx512", "avx2", "portable"}));
}

Settings Settings::fromEnv() {
  Settings s;
  if (const char* v = env("CLAWCOMM_TRANSPORT")) s.transport = v;
  if (const char* v = env("CLAWCOMM_ALGO")) s.algo = v;
  // Ring sizes are rounded to 64 bytes so that frames stay aligned.
  s.shmRingBytes = envBytes("CLAWCOMM_SHM_RING_BYTES", s.shmRingBytes, 4096) & ~size_t(63);
  s.segmentBytes = envBytes("CLAWCOMM_SEGMENT_BYTES", s.segmentBytes, 64);
  s.treeMaxBytes = envBytes("CLAWCOMM_TREE_MAX_BYTES", s.treeMaxBytes, 0);
  if (env("CLAWCOMM_SPIN_US")) s.spinMicros = int(envBytes("CLAWCOMM_SPIN_US", 0, 0));
  if (env("CLAWCOMM_YIELD_US")) s.yieldMicros = int(envBytes("CLAWCOMM_YIELD_US", 0, 0));
  s.inlineMaxBytes = envBytes("CLAWCOMM_INLINE_BYTES", s.inlineMaxBytes, 0);
  if (env("CLAWCOMM_PROGRESS_NICE")) {
    const size_t nice = envBytes("CLAWCOMM_PROGRESS_NICE", 0, 0);
    CLAWCOMM_ARG_CHECK(nice <= 19, "clawcomm: CLAWCOMM_PROGRESS_NICE=", nice,
                       " is not a nice value in 0..19");
    s.progressNice = int(nice);
  }
  if (const char* v = env("CLAWCOMM_SOCKET_ADDR")) s.socketAddr = v;
  if (const char* v = env("CLAWCOMM_HOST_ID")) s.hostId = v;
  if (const char* v = env("CLAWCOMM_DEBUG")) s.debug = std::string(v) != "0";
  s.cudaIpc = envChoice("CLAWCOMM_CUDA_IPC", {"auto", "0"}) == 0;
  s.recorderEntries = envBytes("CLAWCOMM_RECORDER_ENTRIES", s.recorderEntries, 0);
  if (const char* v = env("CLAWCOMM_FLIGHT_DIR")) {
    s.flightDir = v;
  } else {
    const char* tmp = env("TMPDIR");
    s.flightDir = std::string(tmp ? tmp : "/tmp") + "/clawcomm-flight";
  }
  s.cudaIpcBytes = envBytes("CLAWCOMM_CUDA_IPC_BYTES", s.cudaIpcBytes, 4096);
  s.cudaOneShotMaxBytes = envBytes("CLAWCOMM_CUDA_ONESHOT_BYTES", s.cudaOneShotMaxBytes, 0);
  return s;
}

}  // namespace clawcomm
