#include "common/settings.h"

#include <cstdlib>
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

}  // namespace

Settings Settings::fromEnv() {
  Settings s;
  if (const char* v = env("CLAWCOMM_TRANSPORT")) {
    std::string t = v;
    if (t == "auto")
      s.transport = TransportChoice::kAuto;
    else if (t == "shm")
      s.transport = TransportChoice::kShm;
    else if (t == "tcp")
      s.transport = TransportChoice::kTcp;
    else
      throw InvalidArgument(
          CLAWCOMM_CONCAT("clawcomm: CLAWCOMM_TRANSPORT=", t, " is not one of auto, shm, tcp"));
  }
  if (const char* v = env("CLAWCOMM_ALGO")) {
    std::string a = v;
    if (a == "auto")
      s.algo = AlgoChoice::kAuto;
    else if (a == "ring")
      s.algo = AlgoChoice::kRing;
    else if (a == "tree")
      s.algo = AlgoChoice::kTree;
    else
      throw InvalidArgument(
          CLAWCOMM_CONCAT("clawcomm: CLAWCOMM_ALGO=", a, " is not one of auto, ring, tree"));
  }
  // Ring sizes are rounded to 64 bytes so that frames stay aligned.
  s.shmRingBytes = envBytes("CLAWCOMM_SHM_RING_BYTES", s.shmRingBytes, 4096) & ~size_t(63);
  s.segmentBytes = envBytes("CLAWCOMM_SEGMENT_BYTES", s.segmentBytes, 64);
  s.treeMaxBytes = envBytes("CLAWCOMM_TREE_MAX_BYTES", s.treeMaxBytes, 0);
  s.spinMicros = int(envBytes("CLAWCOMM_SPIN_US", size_t(s.spinMicros), 0));
  if (const char* v = env("CLAWCOMM_SOCKET_ADDR")) s.socketAddr = v;
  if (const char* v = env("CLAWCOMM_HOST_ID")) s.hostId = v;
  if (const char* v = env("CLAWCOMM_DEBUG")) s.debug = std::string(v) != "0";
  return s;
}

}  // namespace clawcomm
