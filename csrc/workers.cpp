#include "workers.hpp"

#include <stdexcept>

namespace moeinf {

Workers::Workers(size_t threads) {
  if (threads == 0) throw std::invalid_argument("Workers: threads must be at least 1");
  for (size_t i = 1; i < threads; ++i) helpers_.emplace_back(&Workers::helper, this, i);
}

Workers::~Workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
}

void Workers::run(size_t parts, const std::function<void(size_t)>& task) {
  if (parts == 0 || parts > size()) throw std::invalid_argument("Workers::run: parts must be in 1..threads");
  std::lock_guard<std::mutex> turn(turn_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &task;
    parts_ = parts;
    pending_ = parts - 1;
    error_ = nullptr;
    ++generation_;
  }
  if (parts > 1) wake_.notify_all();
  std::exception_ptr mine;
  try {
    task(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
  task_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void Workers::helper(size_t index) {
  size_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index >= parts_) continue;
    const auto* task = task_;
    lock.unlock();
    std::exception_ptr failure;
    try {
      (*task)(index);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (failure && !error_) error_ = failure;
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace moeinf
