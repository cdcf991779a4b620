// Worker::Stop with a deadline: a worker busy inside a round (held there by
// the test's round hook, standing in for a long store operation) makes Stop
// return false once the deadline passes instead of joining forever, and a
// later Stop joins it once it is free. Nothing here asserts how fast
// anything runs: the busy worker is held until the test lets it go.
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "gtest/gtest.h"
#include "host-agent/worker.h"

namespace tmem {
namespace {

// Holds the worker thread inside its first round until Release.
class Gate {
 public:
  void Hold() {
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
  }
  void AwaitEntered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool released_ = false;
};

TEST(WorkerStopTest, ABusyWorkerMissesTheDeadlineAndIsJoinedWhenFree) {
  Gate gate;
  WorkerOptions options;
  options.round_hook = [&] { gate.Hold(); };
  Worker worker(options);
  ASSERT_TRUE(worker.Start().ok());
  gate.AwaitEntered();
  // The worker cannot leave its round until released: Stop must give up.
  EXPECT_FALSE(worker.Stop(std::chrono::milliseconds(20)));
  EXPECT_FALSE(worker.Stop(std::chrono::milliseconds(0)));
  gate.Release();
  EXPECT_TRUE(worker.Stop());
  EXPECT_TRUE(worker.Stop(std::chrono::milliseconds(0))) << "already joined";
}

TEST(WorkerStopTest, AnIdleWorkerStopsWithinADeadline) {
  Worker worker(WorkerOptions{});
  ASSERT_TRUE(worker.Start().ok());
  // Generous: an idle worker wakes on the stop eventfd at once; the bound
  // only keeps a broken Stop from hanging the test.
  EXPECT_TRUE(worker.Stop(std::chrono::minutes(2)));
}

TEST(WorkerStopTest, StopBeforeStartIsImmediate) {
  Worker worker(WorkerOptions{});
  EXPECT_TRUE(worker.Stop(std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace tmem
