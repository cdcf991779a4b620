// ThreadPriority: moves the calling thread between SCHED_IDLE and the
// ordinary time-sharing class (SCHED_OTHER at the thread's nice value).
//
// Why: the compactor compresses with cycles nobody else wants, so it runs at
// SCHED_IDLE; but a thread at SCHED_IDLE that is preempted while it holds a
// store lock makes every normal thread waiting for that lock wait for an idle
// CPU (priority inversion, which futexes do not fix for CFS threads). So the
// compactor takes store locks only while it runs at normal priority
// (compactor.h). Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE
// that allows the thread's nice value; without either the call fails with
// EPERM and the caller counts and logs it.
//
// Affects only the calling thread (sched_setscheduler on tid 0 is
// per-thread on Linux). Thread-safe.
#ifndef TMEMD_BACKEND_THREAD_PRIORITY_H_
#define TMEMD_BACKEND_THREAD_PRIORITY_H_

#include "absl/status/status.h"

namespace tmem {

enum class ThreadPriority : int {
  kNormal = 0,  // SCHED_OTHER at the thread's nice value
  kIdle = 1,    // SCHED_IDLE: runs only when no other thread wants the CPU
};

// Sets the calling thread's scheduling class. An error names the class and
// errno; the thread's class is then unchanged.
absl::Status SetCurrentThreadPriority(ThreadPriority priority);

// The calling thread's class as the kernel reports it (sched_getscheduler):
// kIdle for SCHED_IDLE, kNormal for anything else.
ThreadPriority CurrentThreadPriority();

}  // namespace tmem

#endif  // TMEMD_BACKEND_THREAD_PRIORITY_H_
