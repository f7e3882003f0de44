// Gather and scatter, linear: every non-root exchanges one message with the
// root, all posted at once. The root moves (n-1) N bytes in one step, which
// is optimal when the root's link is the bottleneck.
#include <cstdint>
#include <cstring>

#include "algorithms/algorithms.h"

namespace clawcomm {

void linearGather(Channel& ch, const void* in, void* out, size_t bytes, int root) {
  if (ch.rank() != root) {
    ch.send(root, in, bytes);
    ch.wait();
    return;
  }
  uint8_t* o = static_cast<uint8_t*>(out);
  for (int p = 0; p < ch.size(); ++p) {
    if (p == root) {
      if (bytes && o + p * bytes != in) std::memmove(o + p * bytes, in, bytes);
    } else {
      ch.recv(p, o + p * bytes, bytes);
    }
  }
  ch.wait();
}

void linearScatter(Channel& ch, const void* in, void* out, size_t bytes, int root) {
  if (ch.rank() != root) {
    ch.recv(root, out, bytes);
    ch.wait();
    ch.send(root, nullptr, 0);
    ch.wait();
    return;
  }
  const uint8_t* i = static_cast<const uint8_t*>(in);
  for (int p = 0; p < ch.size(); ++p) {
    if (p == root) {
      if (bytes && i + p * bytes != out) std::memmove(out, i + p * bytes, bytes);
    } else {
      ch.send(p, i + p * bytes, bytes);
      ch.recv(p, nullptr, 0);
    }
  }
  ch.wait();
}

}  // namespace clawcomm
