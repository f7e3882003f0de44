// The one clock every deadline in clawcomm is measured on.
#pragma once

#include <chrono>

namespace clawcomm {

using Clock = std::chrono::steady_clock;

}  // namespace clawcomm
