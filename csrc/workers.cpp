#include "workers.hpp"

#include <unistd.h>

#include <chrono>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOEINF_PAUSE() _mm_pause()
#else
#define MOEINF_PAUSE() std::this_thread::yield()
#endif

namespace moeinf {

namespace {

// Spins until `ready()` or until `budget` has passed; whether it became ready.
template <typename Ready>
bool spin_until(Ready ready, std::chrono::microseconds budget) {
  if (ready()) return true;
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (unsigned i = 1;; ++i) {
    MOEINF_PAUSE();
    if (ready()) return true;
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= deadline) return false;
  }
}

}  // namespace

Workers::Workers(size_t threads, std::chrono::microseconds spin)
    : state_(std::make_unique<State>()), spin_(spin), owner_(static_cast<long>(getpid())) {
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
  s.task = &task;
  s.parts = parts;
  s.error = nullptr;  // no helper touches it between products
  // Every helper answers every product, those past `parts` with nothing to do too: no helper can then
  // still be reading `parts` and `task` of one product when the next one writes them.
  s.pending.store(helpers_.size());
  s.generation.fetch_add(1);  // seq_cst: ordered before the read of `sleepers` (a helper does the converse)
  if (!helpers_.empty() && s.sleepers.load() > 0) {
    std::lock_guard<std::mutex> lock(s.mutex);  // a sleeper between its check and its wait sees the bump
    s.wake.notify_all();
  }
  std::exception_ptr mine;
  try {
    task(0);
  } catch (...) {
    mine = std::current_exception();
  }
  auto finished = [&s] { return s.pending.load() == 0; };  // seq_cst against `caller_asleep`
  if (!spin_until(finished, spin_)) {
    std::unique_lock<std::mutex> lock(s.mutex);
    s.caller_asleep.store(true);
    s.done.wait(lock, finished);
    s.caller_asleep.store(false);
  }
  s.task = nullptr;
  if (mine) std::rethrow_exception(mine);
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.error) std::rethrow_exception(s.error);
}

void Workers::helper(size_t index) {
  State& s = *state_;
  uint64_t seen = 0;
  for (;;) {
    auto started = [&] { return s.stop.load(std::memory_order_relaxed) || s.generation.load() != seen; };
    if (!spin_until(started, spin_)) {
      std::unique_lock<std::mutex> lock(s.mutex);
      s.sleepers.fetch_add(1);  // seq_cst, before the predicate's read of `generation`
      s.wake.wait(lock, started);
      s.sleepers.fetch_sub(1);
    }
    if (s.stop.load()) return;
    seen = s.generation.load();
    std::exception_ptr failure;
    if (index < s.parts) {
      try {
        (*s.task)(index);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (!s.error) s.error = failure;
    }
    if (s.pending.fetch_sub(1) == 1 && s.caller_asleep.load()) {
      std::lock_guard<std::mutex> lock(s.mutex);  // the caller is between its check and its wait, or waiting
      s.done.notify_one();
    }
  }
}

}  // namespace moeinf
