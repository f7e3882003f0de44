#include "transport/shm/ring_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "common/errors.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace clawcomm {
namespace {

size_t pageSize() {
  return size_t(sysconf(_SC_PAGESIZE));
}

std::pair<void*, size_t> wholePages(const uint8_t* data, size_t bytes) {
  const uintptr_t page = pageSize();
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  return {reinterpret_cast<void*>(begin), end > begin ? size_t(end - begin) : 0};
}

}  // namespace

size_t residentBytes(const uint8_t* data, size_t bytes) {
  const auto [start, length] = wholePages(data, bytes);
  if (length == 0) return 0;
  std::vector<unsigned char> pages(length / pageSize());
  if (mincore(start, length, pages.data()) != 0) return 0;
  size_t resident = 0;
  for (unsigned char p : pages) resident += (p & 1) ? pageSize() : 0;
  return resident;
}

void releasePages(uint8_t* data, size_t bytes) {
  const auto [start, length] = wholePages(data, bytes);
  if (length > 0) madvise(start, length, MADV_REMOVE);
}

void reservePages(uint8_t* data, size_t bytes, int peer) {
  const auto [start, length] = wholePages(data, bytes);
  if (length == 0 || madvise(start, length, MADV_POPULATE_WRITE) == 0) return;
  if (errno == EINVAL) return;  // a kernel without it
  throw Error(CLAWCOMM_CONCAT("clawcomm shm: cannot take back the ", length,
                              " bytes of the ring from rank ", peer, ": ", std::strerror(errno),
                              " (is /dev/shm full?)"));
}

}  // namespace clawcomm
