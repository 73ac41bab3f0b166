#include "workers.hpp"

#include <unistd.h>

#include <stdexcept>

namespace moeinf {

Workers::Workers(size_t threads) : state_(std::make_unique<State>()), owner_(static_cast<long>(getpid())) {
  if (threads == 0) throw std::invalid_argument("Workers: threads must be at least 1");
  for (size_t i = 1; i < threads; ++i) helpers_.emplace_back(&Workers::helper, this, i);
}

Workers::~Workers() {
  if (static_cast<long>(getpid()) != owner_) {  // a forked child: nothing to stop, nothing safe to destroy
    for (auto& t : helpers_) t.detach();
    (void)state_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_all();
  for (auto& t : helpers_) t.join();
}

void Workers::run(size_t parts, const std::function<void(size_t)>& task) {
  if (parts == 0 || parts > size()) throw std::invalid_argument("Workers::run: parts must be in 1..threads");
  State& s = *state_;
  std::lock_guard<std::mutex> turn(s.turn);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.task = &task;
    s.parts = parts;
    s.pending = parts - 1;
    s.error = nullptr;
    ++s.generation;
  }
  if (parts > 1) s.wake.notify_all();
  std::exception_ptr mine;
  try {
    task(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(s.mutex);
  s.done.wait(lock, [&s] { return s.pending == 0; });
  s.task = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (s.error) std::rethrow_exception(s.error);
}

void Workers::helper(size_t index) {
  State& s = *state_;
  size_t seen = 0;
  std::unique_lock<std::mutex> lock(s.mutex);
  for (;;) {
    s.wake.wait(lock, [&] { return s.stop || s.generation != seen; });
    if (s.stop) return;
    seen = s.generation;
    if (index >= s.parts) continue;
    const auto* task = s.task;
    lock.unlock();
    std::exception_ptr failure;
    try {
      (*task)(index);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (failure && !s.error) s.error = failure;
    if (--s.pending == 0) s.done.notify_one();
  }
}

}  // namespace moeinf
