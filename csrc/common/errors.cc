#include "common/errors.h"

namespace clawcomm {
namespace detail {

void checkFailed(const char* file, int line, const std::string& msg) {
  // The path from csrc/ on, not the build machine's absolute one.
  std::string where = file;
  const size_t at = where.rfind("csrc/");
  if (at != std::string::npos) where = where.substr(at);
  throw std::logic_error(concat("clawcomm internal error at ", where, ":", line, ": ", msg));
}

}  // namespace detail
}  // namespace clawcomm
