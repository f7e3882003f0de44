// What moving and reducing bytes costs, for CLAWCOMM_ALGO=auto and
// `clawcomm simulate` (clawcomm/cost_model/formulas.py holds the same formulas).
#pragma once

#include <string>

namespace clawcomm {

// The alpha-beta-gamma model with separate links (docs/algorithms.md):
// alpha is the cost of one message, beta the time per byte, gamma the time
// per byte reduced. Shared memory is a per-pair copy; the network is each
// host's link, shared by every stream that leaves (or enters) the host.
struct CostModel {
  double shmAlpha = 8e-6;         // s per message over shared memory
  double shmBeta = 1.0 / 5e9;     // s per byte over shared memory
  double netAlpha = 50e-6;        // s per message across hosts
  double netBeta = 1.0 / 1.25e9;  // s per byte through a host's link (10 Gbit/s)
  double gamma = 1.0 / 4e9;       // s per byte reduced

  // Reads a model file (`clawcomm bench --calibrate` writes one): a JSON
  // object with the five numbers above under shm_alpha, shm_beta, net_alpha,
  // net_beta and gamma (other keys are ignored). Throws InvalidArgument
  // naming the file and what is wrong with it.
  static CostModel load(const std::string& path);
};

}  // namespace clawcomm
