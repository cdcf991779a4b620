// FaultPoint: a test-only crash at a named step, so a test can kill tmemd
// exactly between two steps that must survive a crash together (storing a
// guest's connection in the fd store, answering its handshake, resetting
// its region when it leaves).
//
// Compiled into every build and inert unless the environment variable
// TMEMD_TEST_ABORT_AT names the step when tmemd starts: then the first
// time execution reaches FaultPoint("<that step>") the process writes one
// line "event=fault_point step=<step>" to stderr and raises SIGKILL
// (nothing is flushed or cleaned up, as in a real crash). The variable is
// read once, on the first call, and never changes afterwards.
//
// Steps (each named after what has just happened):
//   attach_accepted   a guest connection is accepted; nothing stored or sent
//   attach_stored     it is in the fd store as VM/attaching; nothing sent
//   attach_answered   its whole handshake is sent; VM/client not stored yet
//   attach_recorded   stored as VM/client; VM/attaching not removed yet
//   attach_done       VM/attaching removed; the worker has not polled it
//   detach_begin      the guest left (hang-up, garbage, or found dead when
//                     another connected); nothing undone yet
//   detach_unstored   VM/client removed from the fd store
//   detach_reset      its pools dropped and region reset; fd not closed yet
//
// Thread safety: any thread.
#ifndef TMEMD_HOST_AGENT_FAULT_POINT_H_
#define TMEMD_HOST_AGENT_FAULT_POINT_H_

#include <string_view>

namespace tmem {

inline constexpr char kFaultPointEnv[] = "TMEMD_TEST_ABORT_AT";

// Kills the process with SIGKILL if TMEMD_TEST_ABORT_AT == step.
void FaultPoint(std::string_view step);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_FAULT_POINT_H_
