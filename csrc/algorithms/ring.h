// The segmented ring pipeline shared by ring all-reduce, reduce-scatter and
// all-gather.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/channel.h"

namespace clawcomm {

struct RingStep {
  int sendChunk;  // chunk sent to rank + 1
  int recvChunk;  // chunk received from rank - 1
  bool reduce;    // combine into recvChunk (true) or overwrite it (false)
};

// Runs `steps` around the ring over `buf`, whose chunk c holds counts[c]
// elements starting at the sum of the counts before it.
//
// Each chunk is cut into the same number of segments (at most
// settings().segmentBytes each) and the segments flow as a wavefront: in
// wave w, segment j runs step w - j. So segment 0 can already be in step 2
// while segment 5 is still in step 0, and a step never waits for the whole
// chunk of the step before it.
void ringPipeline(Channel& ch, void* buf, const std::vector<size_t>& counts,
                  const std::vector<RingStep>& steps);

// How the segmented algorithms cut a buffer of chunks, back to back (chunk
// c holds counts[c] elements), into segments: every chunk into the same
// number of segments of at most `segmentBytes`, so that segment j of every
// chunk moves in the same wave on every rank.
class ChunkSegments {
 public:
  ChunkSegments(std::vector<size_t> counts, size_t elementBytes, size_t segmentBytes);
  size_t count() const { return segments_; }  // segments per chunk
  // Segment j of chunk c: elements [j*per, min((j+1)*per, counts[c])) of
  // the chunk, as a byte offset from the buffer's start and a byte length.
  void of(int c, size_t j, size_t* at, size_t* bytes) const;

 private:
  std::vector<size_t> counts_;
  std::vector<size_t> offsets_;  // elements before each chunk
  size_t es_;
  size_t segments_;
};

// The same pipeline one wave at a time, for an algorithm that runs rings on
// two subgroups at once (hierarchical all-reduce): postWave() posts the next
// wave's sends and receives on the channel, and the caller waits for them
// (Channel::wait or test) before it posts the next.
class RingPipeline {
 public:
  RingPipeline(Channel& ch, void* buf, std::vector<size_t> counts, std::vector<RingStep> steps);
  // False, posting nothing, once every wave has been posted.
  bool postWave();

 private:
  Channel& ch_;
  uint8_t* base_;
  ChunkSegments segments_;
  std::vector<RingStep> steps_;
  size_t wave_ = 0;
  size_t waves_ = 0;
};

// The steps of a ring reduce-scatter (`reduce`) or all-gather, for `rank`
// of `n`: afterwards rank r holds chunk r reduced, or every chunk.
std::vector<RingStep> reduceScatterSteps(int rank, int n);
std::vector<RingStep> allGatherSteps(int rank, int n);

// n chunk sizes that differ by at most one element (the first count % n
// one larger).
std::vector<size_t> evenCounts(size_t count, int n);
// Where each chunk of `counts` elements of `elementBytes` starts, back to
// back, and (last) where they end.
std::vector<size_t> byteOffsets(const std::vector<size_t>& counts, size_t elementBytes);

// Chunk index `i` modulo the ring size, for negative i too.
inline int ringIndex(int i, int n) {
  return ((i % n) + n) % n;
}

}  // namespace clawcomm
