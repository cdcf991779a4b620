// Mutex and SharedMutex: std locks with clang thread-safety annotations.
//
// Why not absl::Mutex: Debian's libabsl is built without ThreadSanitizer, so
// TSan cannot see absl::Mutex's lock/unlock and would report every guarded
// field as a race. The std locks are pthread locks, which TSan intercepts;
// the annotations keep clang's -Wthread-safety checks (ABSL_GUARDED_BY etc.).
// CondVar waits on a Mutex (a std::condition_variable underneath), so the
// fields a waiter checks stay annotated too.
#ifndef TMEMD_BACKEND_MUTEX_H_
#define TMEMD_BACKEND_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "absl/base/thread_annotations.h"

namespace tmem {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) {
    return mu_.try_lock();
  }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class ABSL_LOCKABLE SharedMutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Scoped exclusive lock of a Mutex or SharedMutex.
template <typename M>
class ABSL_SCOPED_LOCKABLE BasicMutexLock {
 public:
  explicit BasicMutexLock(M* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~BasicMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  BasicMutexLock(const BasicMutexLock&) = delete;
  BasicMutexLock& operator=(const BasicMutexLock&) = delete;

 private:
  M* const mu_;
};
using MutexLock = BasicMutexLock<Mutex>;
using WriterMutexLock = BasicMutexLock<SharedMutex>;

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(SharedMutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu)
      : mu_(mu) {
    mu_->ReaderLock();
  }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// A condition variable for Mutex. Write waits as loops over the guarded
// condition, `while (!ready_) cv_.Wait(&mu_);`: clang's analysis does not
// know that a predicate lambda runs with the lock held, a loop it checks.
class CondVar {
 public:
  // Releases `mu` while asleep; holds it again on return (maybe spuriously).
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's scope unlocks it
  }
  // As Wait; false once `deadline` has passed.
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex* mu,
                 const std::chrono::time_point<Clock, Duration>& deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woken =
        cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_MUTEX_H_
