// Shared-memory transport between ranks on one host.
//
// Each rank creates one segment holding, for every peer it reaches over
// shared memory, a single-producer single-consumer byte ring that the peer
// writes and this rank reads. A connection therefore reads from its own
// segment and writes into the peer's. Rings are laid out in the order of
// the rank's shared-memory peers (ascending), which every rank of the host
// knows for every other (EndpointSetup::peersOf), so a writer finds its
// ring in the reader's segment without asking.
// The segment is unlinked as soon as every peer has mapped it
// (finishSetup), so a SIGKILL of every rank leaves nothing in /dev/shm.
//
// Single copy (CLAWCOMM_SINGLE_COPY): when a rank connects to a peer it
// tries to read the peer's segment header out of the peer's own address
// space with process_vm_readv, and writes the verdict into the control block
// of the ring the peer writes to it. The peer then sends frames of at least
// CLAWCOMM_SINGLE_COPY_BYTES as references (Connection::referenceMinBytes),
// which this rank reads with one process_vm_readv each, straight into the
// receive. Unless CLAWCOMM_SINGLE_COPY_BYTES names the size, the reader
// also times a read of the peer's ring against a plain copy of the same
// pages and publishes from which size it takes frames by reference
// (measureReads in connection.cc). Where Yama restricts ptrace to
// descendants (ptrace_scope 1, as on Ubuntu), each rank names its parent
// (the launcher) its ptracer, which lets its sibling ranks, and only
// processes under that launcher, read it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/settings.h"
#include "transport/transport.h"

namespace clawcomm {

class ShmMapping;

// Whether a peer this rank waits on has died with nothing left to read:
// `gone` (its process has exited), and then neither `closed` (it shut the
// stream down) nor `unread` (bytes it wrote wait in the ring). `gone` is
// looked at first (connection.cc says why); a seam for tests.
bool peerLeftNothing(const std::function<bool()>& gone, const std::function<bool()>& closed,
                     const std::function<bool()>& unread);

struct SingleCopyPolicy {
  bool probe = true;                          // try cross-memory attach with every peer (auto, cma)
  bool required = true;                       // a failed probe is an error (cma, all)
  bool everyOp = false;                       // reductions and broadcast by reference too (all)
  size_t minBytes = kDefaultSingleCopyBytes;  // Settings::singleCopyMinBytes
  bool measure = true;  // each reader times its reads at setup (the size is not set)
};

class ShmEndpoint : public Endpoint {
 public:
  // Creates "/clawcomm-<jobToken>-<rank>" with one inbound ring for each of
  // peersOf[rank]; peersOf[q] lists rank q's shared-memory peers.
  ShmEndpoint(const std::string& jobToken, int rank, int size, size_t ringBytes,
              std::vector<std::vector<int>> peersOf, SingleCopyPolicy singleCopy = {});
  ~ShmEndpoint() override;

  std::string address() const override { return name_; }
  std::unique_ptr<Connection> connect(int peer, const std::string& peerAddress,
                                      Clock::time_point deadline) override;
  // Unlinks every rank's segment name of this job, not only this rank's: a
  // peer killed during setup, or just after it, cannot unlink its own. Also
  // run when the endpoint is destroyed by a failed setup.
  void finishSetup() override;

 private:
  std::string jobToken_;
  std::string name_;
  int rank_;
  int size_;
  size_t ringBytes_;
  std::vector<std::vector<int>> peersOf_;
  SingleCopyPolicy singleCopy_;
  std::shared_ptr<ShmMapping> own_;
  bool unlinked_ = false;
};

}  // namespace clawcomm
