#include "backend/thread_priority.h"

#include <sched.h>

#include <cerrno>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace tmem {

absl::Status SetCurrentThreadPriority(ThreadPriority priority) {
  const int policy =
      priority == ThreadPriority::kIdle ? SCHED_IDLE : SCHED_OTHER;
  sched_param param{};
  param.sched_priority = 0;  // the only value SCHED_IDLE/SCHED_OTHER accept
  // pid 0: the calling thread (Linux schedules threads, not processes).
  if (sched_setscheduler(0, policy, &param) != 0) {
    const int err = errno;
    return {
        absl::ErrnoToStatusCode(err),
        absl::StrCat("sched_setscheduler(",
                     policy == SCHED_IDLE ? "SCHED_IDLE" : "SCHED_OTHER",
                     ") failed: ",
                     std::error_code(err, std::generic_category()).message())};
  }
  return absl::OkStatus();
}

ThreadPriority CurrentThreadPriority() {
  return sched_getscheduler(0) == SCHED_IDLE ? ThreadPriority::kIdle
                                             : ThreadPriority::kNormal;
}

}  // namespace tmem
