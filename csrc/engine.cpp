// The engine's public side: registration, submit/cancel/wait/release, introspection, statistics.
#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "errors.hpp"

namespace moeinf {
namespace {

constexpr size_t kCompletedLog = 4096;
constexpr auto kTick = std::chrono::milliseconds(100);

uint64_t make_key(int layer, int expert) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) | static_cast<uint32_t>(expert);
}

std::pair<int, int> split_key(uint64_t key) {
  return {static_cast<int>(key >> 32), static_cast<int>(key & 0xffffffffu)};
}

}  // namespace

const char* state_name(State s) {
  switch (s) {
    case State::Idle: return "idle";
    case State::Queued: return "queued";
    case State::Reading: return "reading";
    case State::Ready: return "ready";
    case State::Failed: return "failed";
  }
  return "unknown";
}

Engine::Engine(std::vector<std::string> files, const EngineOptions& options)
    : opt_(options),
      paths_(std::move(files)),
      pool_(options.slot_bytes, options.num_slots, numa_nodes(), options.lock_memory),
      completed_(kCompletedLog) {
  if (paths_.empty()) throw std::invalid_argument("Engine needs at least one file");
  if (opt_.io_threads == 0) throw std::invalid_argument("io_threads must be >= 1");
  if (opt_.chunk_bytes == 0 || opt_.chunk_bytes % kAlignment != 0)
    throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096 (e.g. 2 MiB), got " +
                                std::to_string(opt_.chunk_bytes));
  paused_ = opt_.start_paused;
  files_.resize(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i) {
    // Open what exists now so stats show the I/O mode from the start; a file that cannot be opened is
    // retried at its first read, where the error reaches that key's waiters.
    try {
      files_[i] = std::make_unique<BlobFile>(paths_[i], opt_.direct_io);
      any_buffered_ = any_buffered_ || files_[i]->mode() == IoMode::Buffered;
    } catch (const ReadError&) {
    }
  }
  try {
    for (size_t t = 0; t < opt_.io_threads; ++t) io_threads_.emplace_back(&Engine::io_loop, this, t);
  } catch (...) {
    close();
    throw;
  }
}

Engine::~Engine() { close(); }

void Engine::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  work_cv_.notify_all();
  ready_cv_.notify_all();
  for (auto& t : io_threads_)
    if (t.joinable()) t.join();
}

void Engine::check_open() const {
  if (stopping_) throw EngineClosed("the engine is closed");
}

Engine::Entry& Engine::entry(int layer, int expert) {
  auto it = entries_.find(make_key(layer, expert));
  if (it == entries_.end())
    throw UnknownKey("(layer " + std::to_string(layer) + ", expert " + std::to_string(expert) +
                     ") was never registered with add()");
  return it->second;
}

std::string Engine::name(const Entry& e) const {
  return "expert (layer " + std::to_string(e.layer) + ", expert " + std::to_string(e.expert) + ")";
}

void Engine::add(int layer, int expert, const BlobRef& blob) {
  if (layer < 0 || expert < 0) throw std::invalid_argument("layer and expert must be >= 0");
  if (blob.file >= paths_.size())
    throw std::invalid_argument("file index " + std::to_string(blob.file) + " out of range: the engine has " +
                                std::to_string(paths_.size()) + " files");
  if (blob.size == 0 || blob.size % kAlignment != 0 || blob.offset % kAlignment != 0)
    throw std::invalid_argument("blob offset and size must be positive multiples of 4096 (the store alignment), "
                                "got offset " + std::to_string(blob.offset) + ", size " + std::to_string(blob.size));
  if (std::max(blob.size, blob.memory_size()) > pool_.slot_bytes())
    throw std::invalid_argument("a blob of " + std::to_string(std::max(blob.size, blob.memory_size())) +
                                " bytes does not fit a slot of " + std::to_string(pool_.slot_bytes()) +
                                " bytes: raise slot_bytes");
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  const uint64_t key = make_key(layer, expert);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    if (it->second.state != State::Idle && it->second.state != State::Failed)
      throw std::invalid_argument(name(it->second) + " is already registered and in use; release() it first");
    it->second.blob = blob;
    return;
  }
  Entry& e = entries_[key];
  e.layer = layer;
  e.expert = expert;
  e.key = key;
  e.blob = blob;
}

void Engine::submit(int layer, int expert, double priority) {
  if (std::isnan(priority)) throw std::invalid_argument("priority must be a number, got NaN");
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  submit_locked(entry(layer, expert), priority);
}

void Engine::submit_locked(Entry& e, double priority) {
  const bool promoted = priority == kMaxPriority && e.priority != kMaxPriority;
  switch (e.state) {
    case State::Idle:
    case State::Failed:  // a later submit of a failed key retries it
      e.error.clear();
      e.next_offset = e.bytes_done = 0;
      e.sums = ChecksumParts{};
      e.sums_checked = e.decoded = false;
      e.discard = false;
      e.priority = priority;
      e.t_submit = Clock::now();
      e.state = State::Queued;
      enqueue(e);
      return;
    case State::Queued:
    case State::Reading:
      // Already queued or in flight: never read twice, only move it to its new priority.
      if (promoted) e.t_submit = Clock::now();
      e.priority = priority;
      if (e.in_queue) {
        dequeue(e);
        enqueue(e);
      }
      keep(e);
      return;
    case State::Ready:
      return;
  }
}

// A key released while in flight is wanted again: undo the release.
void Engine::keep(Entry& e) {
  if (!e.discard) return;
  e.discard = false;
  if (!e.in_queue && e.next_offset < e.blob.size && e.error.empty()) {
    enqueue(e);
    if (e.readers == 0) e.state = State::Queued;  // it was cancelled between chunks
  }
}

void Engine::enqueue(Entry& e) {
  e.queued_as = queue_.push(e.key, e.priority);
  e.in_queue = true;
  if (e.slot >= 0) ++queued_with_slot_;
  work_cv_.notify_all();
}

void Engine::dequeue(Entry& e) {
  if (!e.in_queue) return;
  queue_.erase(e.queued_as);
  e.in_queue = false;
  if (e.slot >= 0) --queued_with_slot_;
}

bool Engine::cancel(int layer, int expert) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return cancel_locked(entry(layer, expert));
}

// Drops a queued read (also a paused one, whose slot returns to the pool), or forgets a failed one (it
// holds no slot). A read with a chunk in flight, a resident key and a key someone wait()s for are not
// cancelled.
bool Engine::cancel_locked(Entry& e) {
  if (e.waiters > 0) return false;
  if (e.state == State::Failed) {
    e.error.clear();
    e.state = State::Idle;
    return true;
  }
  if (e.state != State::Queued) return false;
  dequeue(e);
  ++counters_.cancels;
  if (e.slot >= 0) free_slot(e);
  e.state = State::Idle;
  e.next_offset = e.bytes_done = 0;
  return true;
}

void Engine::free_slot(Entry& e) {
  pool_.release(e.slot);
  e.slot = -1;
  work_cv_.notify_all();
}

void Engine::release(int layer, int expert) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  Entry& e = entry(layer, expert);
  switch (e.state) {
    case State::Ready:
      free_slot(e);
      e.state = State::Idle;
      return;
    case State::Queued:
      cancel_locked(e);
      return;
    case State::Reading:
      // Chunks in flight finish into the slot; the last one frees it (settle).
      if (e.waiters == 0) {
        e.discard = true;
        dequeue(e);
      }
      return;
    case State::Failed:
      e.error.clear();
      e.state = State::Idle;
      return;
    case State::Idle:
      return;
  }
}

SlotBuffer Engine::wait(int layer, int expert, double timeout_s, const std::function<void()>& tick) {
  std::unique_lock<std::mutex> lk(mu_);
  check_open();
  Entry& e = entry(layer, expert);
  if (e.state == State::Ready) {
    ++counters_.hits;
    return SlotBuffer{pool_.region_of(e.slot), pool_.data(e.slot), static_cast<size_t>(e.blob.memory_size())};
  }
  if (e.state == State::Failed) throw ReadError(e.error);
  ++counters_.waits_blocked;
  // The waiter count protects the key from cancel/release while we sleep; it must change under the lock.
  struct WaiterGuard {
    Entry& e;
    explicit WaiterGuard(Entry& entry) : e(entry) { ++e.waiters; }
    ~WaiterGuard() { --e.waiters; }
  } guard(e);
  const bool forever = timeout_s < 0;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(forever ? 0.0 : timeout_s));
  auto next_tick = Clock::now() + kTick;
  for (;;) {
    check_open();
    if (e.state == State::Ready)
      return SlotBuffer{pool_.region_of(e.slot), pool_.data(e.slot), static_cast<size_t>(e.blob.memory_size())};
    if (e.state == State::Failed) throw ReadError(e.error);
    // Never submitted, or released by another thread between becoming ready and this wake-up.
    if (e.state == State::Idle) submit_locked(e, kMaxPriority);
    keep(e);
    const auto now = Clock::now();
    if (!forever && now >= deadline) {
      const size_t free = pool_.free_count();
      std::string msg = name(e) + " not ready after " + std::to_string(timeout_s) + " s (" + state_name(e.state) +
                        "; " + std::to_string(free) + " of " + std::to_string(pool_.num_slots()) + " slots free)";
      if (free == 0) msg += ": the slot pool is exhausted; release() resident experts or raise num_slots";
      throw WaitTimeout(msg);
    }
    ready_cv_.wait_until(lk, forever ? next_tick : std::min(deadline, next_tick));
    if (tick && Clock::now() >= next_tick) {
      lk.unlock();
      try {
        tick();
      } catch (...) {
        lk.lock();  // the guard's destructor needs the lock
        throw;
      }
      lk.lock();
      next_tick = Clock::now() + kTick;
    }
  }
}

bool Engine::is_resident(int layer, int expert) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return entry(layer, expert).state == State::Ready;
}

std::vector<std::pair<int, int>> Engine::resident() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  std::vector<std::pair<int, int>> keys;
  for (const auto& [key, e] : entries_)
    if (e.state == State::Ready) keys.emplace_back(e.layer, e.expert);
  std::sort(keys.begin(), keys.end());
  return keys;
}

std::vector<std::pair<int, int>> Engine::queued() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  std::vector<std::pair<int, int>> keys;
  for (const auto& item : queue_) keys.push_back(split_key(item.key));
  return keys;
}

std::vector<std::pair<int, int>> Engine::completed() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  std::vector<std::pair<int, int>> keys;
  const size_t first = (completed_next_ + completed_.size() - completed_count_) % completed_.size();
  for (size_t i = 0; i < completed_count_; ++i) keys.push_back(split_key(completed_[(first + i) % completed_.size()]));
  return keys;
}

State Engine::state(int layer, int expert) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return entry(layer, expert).state;
}

size_t Engine::free_slots() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return pool_.free_count();
}

std::vector<std::pair<uintptr_t, size_t>> Engine::regions() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return pool_.regions();
}

void Engine::pause() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  paused_ = true;
}

void Engine::resume() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    paused_ = false;
  }
  work_cv_.notify_all();
}

EngineStats Engine::stats() {
  bool buffered;
  {
    std::lock_guard<std::mutex> files_lk(files_mu_);
    buffered = any_buffered_;
  }
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = counters_;
  s.demand_p50_ms = demand_ms_.percentile(0.5);
  s.demand_p99_ms = demand_ms_.percentile(0.99);
  s.prefetch_p50_ms = prefetch_ms_.percentile(0.5);
  s.prefetch_p99_ms = prefetch_ms_.percentile(0.99);
  s.queue_wait_p50_ms = queue_wait_ms_.percentile(0.5);
  s.queue_wait_p99_ms = queue_wait_ms_.percentile(0.99);
  s.direct_io = opt_.direct_io && !buffered;
  s.pool_locked = pool_.locked();
  s.slots_total = pool_.num_slots();
  s.slots_free = pool_.free_count();
  s.queued = queue_.size();
  s.numa_nodes = pool_.num_nodes();
  return s;
}

void Engine::reset_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  counters_ = EngineStats{};
  demand_ms_.clear();
  prefetch_ms_.clear();
  queue_wait_ms_.clear();
  completed_next_ = completed_count_ = 0;
}

}  // namespace moeinf
