#include "common/process.h"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace clawcomm {

char processState(int pid, bool* missing) {
  if (missing) *missing = false;
  if (pid <= 0) return 0;
  errno = 0;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) {
    if (missing) *missing = errno == ENOENT || errno == ESRCH;
    return 0;
  }
  std::string line;
  std::getline(stat, line);
  const size_t close = line.rfind(')');  // the name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= line.size()) return 0;
  return line[close + 2];
}

bool processGone(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  // Only a missing entry means gone: out of file descriptors (EMFILE) or
  // memory, this rank cannot tell, and looks again at the next check.
  bool missing = false;
  const char state = processState(pid, &missing);
  return missing || state == 'Z' || state == 'X';
}

bool processStopped(int pid) {
  const char state = processState(pid);
  return state == 'T' || state == 't';
}

}  // namespace clawcomm
