#include "common/settings.h"

#include <cerrno>
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

// A whole number in [minimum, maximum]: digits only (strtoull alone would
// take "-1" as 2^64 - 1, and " 5" or "5k" in part), no overflow.
size_t envNumber(const char* name, size_t fallback, size_t minimum, size_t maximum) {
  const char* v = env(name);
  if (!v) return fallback;
  bool digits = *v != '\0';
  for (const char* c = v; *c; ++c) digits &= *c >= '0' && *c <= '9';
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = digits ? std::strtoull(v, &end, 10) : 0;
  CLAWCOMM_ARG_CHECK(digits && errno != ERANGE && n >= minimum && n <= maximum, "clawcomm: ", name,
                     "=", v, " is not a whole number in [", minimum, ", ", maximum, "]");
  return size_t(n);
}

constexpr size_t kGiB = size_t(1) << 30;

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
  simdChoiceFromEnv();  // CLAWCOMM_SIMD is read once per process; refuse a bad one at setup
  if (const char* v = env("CLAWCOMM_TRANSPORT")) s.transport = v;
  if (const char* v = env("CLAWCOMM_ALGO")) s.algo = v;
  s.deterministic = envChoice("CLAWCOMM_DETERMINISTIC", {"0", "1"}) == 1;
  if (const char* v = env("CLAWCOMM_COST_MODEL")) {
    s.costModelPath = v;
    s.costModel = CostModel::load(v);
  }
  // Ring sizes are rounded to 64 bytes so that frames stay aligned.
  s.shmRingBytes =
      envNumber("CLAWCOMM_SHM_RING_BYTES", s.shmRingBytes, 4096, 16 * kGiB) & ~size_t(63);
  s.shmPeers = Settings::ShmPeers(envChoice("CLAWCOMM_SHM_PEERS", {"auto", "all", "sparse"}));
  s.singleCopy =
      Settings::SingleCopy(envChoice("CLAWCOMM_SINGLE_COPY", {"auto", "cma", "all", "off"}));
  s.singleCopyMinBytesSet = env("CLAWCOMM_SINGLE_COPY_BYTES") != nullptr;
  s.singleCopyMinBytes =
      envNumber("CLAWCOMM_SINGLE_COPY_BYTES", s.singleCopyMinBytes, 1, 1024 * kGiB);
  s.segmentBytes = envNumber("CLAWCOMM_SEGMENT_BYTES", s.segmentBytes, 64, 16 * kGiB);
  s.treeMaxBytes = envNumber("CLAWCOMM_TREE_MAX_BYTES", s.treeMaxBytes, 0, 1024 * kGiB);
  if (env("CLAWCOMM_SPIN_US")) s.spinMicros = int(envNumber("CLAWCOMM_SPIN_US", 0, 0, 1000000));
  if (env("CLAWCOMM_YIELD_US")) s.yieldMicros = int(envNumber("CLAWCOMM_YIELD_US", 0, 0, 1000000));
  s.inlineMaxBytes = envNumber("CLAWCOMM_INLINE_BYTES", s.inlineMaxBytes, 0, 16 * kGiB);
  if (env("CLAWCOMM_PROGRESS_NICE")) {
    s.progressNice = int(envNumber("CLAWCOMM_PROGRESS_NICE", 0, 0, 19));  // a nice value
  }
  if (const char* v = env("CLAWCOMM_SOCKET_ADDR")) s.socketAddr = v;
  if (const char* v = env("CLAWCOMM_SOCKET_IFNAME")) s.socketIfname = v;
  s.socketsPerPeer = int(envNumber("CLAWCOMM_SOCKETS_PER_PEER", size_t(s.socketsPerPeer), 1, 64));
  if (const char* v = env("CLAWCOMM_HOST_ID")) s.hostId = v;
  if (const char* v = env("CLAWCOMM_DEBUG")) s.debug = std::string(v) != "0";
  s.cudaIpc = envChoice("CLAWCOMM_CUDA_IPC", {"auto", "0"}) == 0;
  s.recorderEntries = envNumber("CLAWCOMM_RECORDER_ENTRIES", s.recorderEntries, 0, size_t(1) << 20);
  if (const char* v = env("CLAWCOMM_FLIGHT_DIR")) {
    s.flightDir = v;
  } else {
    const char* tmp = env("TMPDIR");
    s.flightDir = std::string(tmp ? tmp : "/tmp") + "/clawcomm-flight";
  }
  s.flightKeepDays =
      int(envNumber("CLAWCOMM_FLIGHT_KEEP_DAYS", size_t(s.flightKeepDays), 0, 36500));
  s.flightKeep = envNumber("CLAWCOMM_FLIGHT_KEEP", s.flightKeep, 1, 1000000);
  s.cudaIpcBytes = envNumber("CLAWCOMM_CUDA_IPC_BYTES", s.cudaIpcBytes, 4096, 64 * kGiB);
  s.cudaGraphBytes = envNumber("CLAWCOMM_CUDA_GRAPH_BYTES", s.cudaGraphBytes, 4096, 64 * kGiB);
  s.cudaP2pBytes = envNumber("CLAWCOMM_CUDA_P2P_BYTES", s.cudaP2pBytes, 0, 64 * kGiB);
  const char* oneShot = env("CLAWCOMM_CUDA_ONESHOT_BYTES");
  if (oneShot && std::string(oneShot) != "auto") {
    s.cudaOneShotMaxBytes = envNumber("CLAWCOMM_CUDA_ONESHOT_BYTES", 0, 0, 64 * kGiB);
  }
  return s;
}

std::string Settings::mustMatch() const {
  const std::string oneShot =
      cudaOneShotMaxBytes == kAutoBytes ? "auto" : std::to_string(cudaOneShotMaxBytes);
  return CLAWCOMM_CONCAT(
      "CLAWCOMM_TRANSPORT=", transport, "|CLAWCOMM_DETERMINISTIC=", deterministic ? 1 : 0,
      "|CLAWCOMM_SHM_RING_BYTES=", shmRingBytes, "|CLAWCOMM_SOCKETS_PER_PEER=", socketsPerPeer,
      "|CLAWCOMM_CUDA_IPC=", cudaIpc ? "auto" : "0", "|CLAWCOMM_CUDA_IPC_BYTES=", cudaIpcBytes,
      "|CLAWCOMM_CUDA_GRAPH_BYTES=", cudaGraphBytes, "|CLAWCOMM_CUDA_P2P_BYTES=", cudaP2pBytes,
      "|CLAWCOMM_CUDA_ONESHOT_BYTES=", oneShot);
}

}  // namespace clawcomm
