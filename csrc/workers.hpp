#pragma once
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moeinf {

// A few threads that split one product with the calling thread: `run(parts, task)` runs task(0) on the
// caller and task(i) on helper i, and returns when all have finished. The helpers sleep on a condition
// variable between products (no spinning: on a small machine the other cores read experts meanwhile).
// Calls from several threads take turns. The destructor stops and joins the helpers. A forked child has
// none of them, only copies of their handles and of a condition variable they were waiting on (whose
// destruction would wait for them forever): there the destructor lets both go.
class Workers {
 public:
  explicit Workers(size_t threads);
  ~Workers();
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  size_t size() const { return helpers_.size() + 1; }
  // parts <= size(); rethrows the first exception a part threw.
  void run(size_t parts, const std::function<void(size_t)>& task);

 private:
  struct State {
    std::mutex turn;  // one product at a time
    std::mutex mutex;
    std::condition_variable wake, done;
    const std::function<void(size_t)>* task = nullptr;
    size_t parts = 0, generation = 0, pending = 0;
    std::exception_ptr error;
    bool stop = false;
  };

  void helper(size_t index);

  std::unique_ptr<State> state_;
  std::vector<std::thread> helpers_;
  const long owner_;  // the process that started the helpers
};

}  // namespace moeinf
