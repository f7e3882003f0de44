#include "common/errors.h"

namespace clawcomm {
namespace detail {

void checkFailed(const char* file, int line, const std::string& msg) {
  throw std::logic_error(concat("clawcomm internal error at ", file, ":", line, ": ", msg));
}

}  // namespace detail
}  // namespace clawcomm
