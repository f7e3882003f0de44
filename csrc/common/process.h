// What /proc says of a process on this machine: the rings' peer check asks
// whether a peer has exited, the hang diagnosis whether one is stopped.
#pragma once

namespace clawcomm {

// The state letter of process `pid` in /proc/<pid>/stat (R, S, D, T, t, Z,
// X, ...), or 0 where it cannot be read; `missing` (if given) is set where
// the entry does not exist, as opposed to a read that failed for want of
// file descriptors or memory.
char processState(int pid, bool* missing = nullptr);

// True when `pid` has exited (gone, or a zombie not yet reaped).
bool processGone(int pid);

// True when `pid` is stopped (SIGSTOP, SIGTSTP, or held by a debugger).
bool processStopped(int pid);

}  // namespace clawcomm
