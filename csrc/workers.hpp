#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moeinf {

// A few threads that split one product with the calling thread: `run(parts, task)` runs task(0) on the
// caller and task(i) on helper i, and returns when all have finished. Calls from several threads take turns.
// The destructor stops and joins the helpers. A forked child has none of them, only copies of their
// handles and of a condition variable they were waiting on (whose destruction would wait for them
// forever): there the destructor lets both go.
//
// Hand-off: a decoded token runs a few hundred products, most of them far shorter than a sleeping
// thread's wake-up on a small VM (~30 us: a 128x2048 int8 GEMV took 27 us on one thread and 55 us split
// two ways with condition-variable hand-offs). So a helper that finishes a part spins (with `pause`) for up
// to `spin` before it sleeps on the condition variable, and the caller spins on the parts still running:
// products that follow each other within a token find the helpers awake. 1 ms covers the gaps between a
// token's products (int4 and int8 stores at two threads: 0.84x and 0.80x the decode step of helpers that
// sleep at once, 0.94x and 0.82x that of a 200 us spin). Beyond it the
// helpers sleep, so the cores are free for the I/O threads between tokens.
class Workers {
 public:
  static constexpr std::chrono::microseconds kDefaultSpin{1000};

  explicit Workers(size_t threads, std::chrono::microseconds spin = kDefaultSpin);
  ~Workers();
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  size_t size() const { return helpers_.size() + 1; }
  // parts <= size(); rethrows the first exception a part threw.
  void run(size_t parts, const std::function<void(size_t)>& task);

 private:
  struct State {
    std::mutex turn;   // one product at a time
    std::mutex mutex;  // guards the sleeps on `wake` and `done` (the hand-off itself is in the atomics)
    std::condition_variable wake, done;
    const std::function<void(size_t)>* task = nullptr;
    size_t parts = 0;
    std::atomic<uint64_t> generation{0};  // bumped (after task and parts are set) to start a product
    std::atomic<size_t> pending{0};       // helpers yet to finish (or pass on) the current product
    std::atomic<int> sleepers{0};         // helpers asleep, or about to sleep, on `wake`
    std::atomic<bool> caller_asleep{false};
    std::atomic<bool> stop{false};
    std::exception_ptr error;  // under `mutex`
  };

  void helper(size_t index);

  std::unique_ptr<State> state_;
  std::vector<std::thread> helpers_;
  const std::chrono::microseconds spin_;
  const long owner_;  // the process that started the helpers
};

}  // namespace moeinf
