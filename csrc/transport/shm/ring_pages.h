// A shared-memory ring's pages: how many are in memory, giving them back
// and taking them again (Communicator::memoryStats, suspend, resume). Each
// works on the whole pages of [data, data + bytes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace clawcomm {

size_t residentBytes(const uint8_t* data, size_t bytes);
// MADV_REMOVE: frees the segment's pages themselves (a hole in the tmpfs
// file), not only this mapping of them. Only while nobody writes there.
void releasePages(uint8_t* data, size_t bytes);
// MADV_POPULATE_WRITE (Linux 5.14; without it the pages come back when
// written): takes them again as the segment's creation reserved them,
// keeping what is in them. Throws Error naming `peer`'s ring if /dev/shm
// has no room.
void reservePages(uint8_t* data, size_t bytes, int peer);

}  // namespace clawcomm
