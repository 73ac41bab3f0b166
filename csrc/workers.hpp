#pragma once
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moeinf {

// A few threads that split one product with the calling thread: `run(parts, task)` runs task(0) on the
// caller and task(i) on helper i, and returns when all have finished. The helpers sleep on a condition
// variable between products (no spinning: on a small machine the other cores read experts meanwhile).
// Calls from several threads take turns. The destructor stops and joins the helpers.
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
  void helper(size_t index);

  std::mutex turn_;  // one product at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> helpers_;
  const std::function<void(size_t)>* task_ = nullptr;
  size_t parts_ = 0, generation_ = 0, pending_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
};

}  // namespace moeinf
