#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "errors.hpp"

namespace moeinf {
namespace {

constexpr size_t kVerifyQueue = 1024;
constexpr size_t kCompletedLog = 4096;
constexpr auto kTick = std::chrono::milliseconds(100);

uint64_t make_key(int layer, int expert) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) | static_cast<uint32_t>(expert);
}

std::pair<int, int> split_key(uint64_t key) {
  return {static_cast<int>(key >> 32), static_cast<int>(key & 0xffffffffu)};
}

double ms_since(Engine::Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Engine::Clock::now() - t).count();
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

const char* state_name(State s) {
  switch (s) {
    case State::Idle: return "idle";
    case State::Queued: return "queued";
    case State::Reading: return "reading";
    case State::Verifying: return "verifying";
    case State::Ready: return "ready";
    case State::Failed: return "failed";
  }
  return "unknown";
}

Engine::Engine(std::vector<std::string> files, const EngineOptions& options)
    : opt_(options),
      paths_(std::move(files)),
      pool_(options.slot_bytes, options.num_slots, numa_nodes()),
      verify_ring_(kVerifyQueue),
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
    if (opt_.verify) verifier_ = std::thread(&Engine::verify_loop, this);
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
  verify_cv_.notify_all();
  for (auto& t : io_threads_)
    if (t.joinable()) t.join();
  if (verifier_.joinable()) verifier_.join();
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
  if (blob.size > pool_.slot_bytes())
    throw std::invalid_argument("a blob of " + std::to_string(blob.size) + " bytes does not fit a slot of " +
                                std::to_string(pool_.slot_bytes()) + " bytes: raise slot_bytes");
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
      e.discard = false;
      e.priority = priority;
      e.t_submit = Clock::now();
      e.state = State::Queued;
      enqueue(e);
      return;
    case State::Queued:
    case State::Reading:
    case State::Verifying:
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
  if (!e.in_queue && e.next_offset < e.blob.size && e.error.empty()) enqueue(e);
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

// Drops a queued read (also a paused one, whose slot returns to the pool). A read with a chunk in flight,
// a resident key and a key someone wait()s for are not cancelled.
bool Engine::cancel_locked(Entry& e) {
  if (e.state != State::Queued || e.waiters > 0) return false;
  dequeue(e);
  if (e.slot >= 0) free_slot(e);
  e.state = State::Idle;
  e.next_offset = e.bytes_done = 0;
  ++counters_.cancels;
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
    case State::Verifying:
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
    return SlotBuffer{pool_.region_of(e.slot), pool_.data(e.slot), static_cast<size_t>(e.blob.size)};
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
      return SlotBuffer{pool_.region_of(e.slot), pool_.data(e.slot), static_cast<size_t>(e.blob.size)};
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

const BlobFile& Engine::file(size_t index) {
  std::lock_guard<std::mutex> lk(files_mu_);
  if (!files_[index]) {
    files_[index] = std::make_unique<BlobFile>(paths_[index], opt_.direct_io);
    any_buffered_ = any_buffered_ || files_[index]->mode() == IoMode::Buffered;
  }
  return *files_[index];
}

// The best queued read whose next chunk can be read now: the top of the queue if it holds a slot or one
// is free, otherwise a queued read that already holds a slot (back-pressure: the rest waits for release()).
Engine::Entry* Engine::next_runnable() {
  if (queue_.empty()) return nullptr;
  Entry& top = entries_.at(queue_.top().key);
  if (top.slot >= 0 || pool_.free_count() > 0) return &top;
  if (queued_with_slot_ == 0) return nullptr;
  for (const auto& item : queue_) {
    Entry& e = entries_.at(item.key);
    if (e.slot >= 0) return &e;
  }
  return nullptr;
}

void Engine::io_loop(size_t thread_index) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    Entry* e = nullptr;
    work_cv_.wait(lk, [&] { return stopping_ || (!paused_ && (e = next_runnable()) != nullptr); });
    if (stopping_) return;
    read_chunk(lk, *e, thread_index);
  }
}

// Reads the next chunk of `e`. The thread then goes back to the queue, so a higher-priority read submitted
// meanwhile is served next and `e` pauses, keeping its slot, its progress and its place in the queue.
void Engine::read_chunk(std::unique_lock<std::mutex>& lk, Entry& e, size_t thread_index) {
  if (e.slot < 0) {
    e.slot = pool_.acquire(thread_index % pool_.num_nodes());
    ++queued_with_slot_;
    queue_wait_ms_.add(ms_since(e.t_submit));
  }
  const uint64_t offset = e.next_offset;
  const size_t n = static_cast<size_t>(std::min<uint64_t>(opt_.chunk_bytes, e.blob.size - offset));
  e.next_offset += n;
  if (e.next_offset == e.blob.size) dequeue(e);
  ++e.readers;
  e.state = State::Reading;
  unsigned char* dst = pool_.data(e.slot) + offset;
  const size_t file_index = e.blob.file;
  const uint64_t file_offset = e.blob.offset + offset;
  std::string error;
  lk.unlock();
  try {
    file(file_index).read_exact(dst, n, file_offset);
  } catch (const std::exception& x) {
    error = x.what();
  }
  lk.lock();
  --e.readers;
  if (!error.empty()) {
    if (e.error.empty()) e.error = name(e) + ": " + error;
    dequeue(e);
  } else {
    e.bytes_done += n;
    counters_.bytes_read += n;
    if (opt_.verify) push_verify(lk, e, offset, n);
  }
  if (e.readers > 0) return;  // another thread's chunk of `e` is still in flight; it finishes the job
  if (e.in_queue) {
    e.state = State::Queued;  // more chunks to read, now or after a higher-priority read
    if (queue_.top().key != e.key) ++counters_.preemptions;
    return;
  }
  e.state = State::Verifying;
  settle(e);
}

void Engine::push_verify(std::unique_lock<std::mutex>& lk, Entry& e, uint64_t offset, size_t size) {
  verify_cv_.wait(lk, [&] { return stopping_ || verify_count_ < verify_ring_.size(); });
  if (stopping_) return;
  verify_ring_[(verify_head_ + verify_count_) % verify_ring_.size()] = VerifyTask{&e, offset, size};
  ++verify_count_;
  ++e.pending_verify;
  verify_cv_.notify_all();
}

void Engine::verify_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    verify_cv_.wait(lk, [&] { return stopping_ || verify_count_ > 0; });
    if (stopping_) return;
    const VerifyTask task = verify_ring_[verify_head_];
    verify_head_ = (verify_head_ + 1) % verify_ring_.size();
    --verify_count_;
    verify_cv_.notify_all();
    Entry& e = *task.entry;
    // The slot stays with `e` while pending_verify > 0 (settle() frees nothing before), so no lock needed.
    const unsigned char* src = pool_.data(e.slot) + task.offset;
    lk.unlock();
    ChecksumParts parts;
    parts.add(src, task.size, task.offset / 8);
    lk.lock();
    e.sums.merge(parts);
    --e.pending_verify;
    if (e.state == State::Verifying) settle(e);
  }
}

// Called when no I/O thread owns `e` any more; completes it once its last chunk is checksummed.
void Engine::settle(Entry& e) {
  if (e.pending_verify > 0) return;
  if (e.discard) {
    free_slot(e);
    e.discard = false;
    e.error.clear();
    e.next_offset = e.bytes_done = 0;
    e.state = State::Idle;
    return;
  }
  if (e.error.empty() && opt_.verify) {
    const uint64_t got = e.sums.finish();
    if (got != e.blob.checksum)
      e.error = name(e) + ": checksum mismatch reading " + paths_[e.blob.file] + " at offset " +
                std::to_string(e.blob.offset) + " (expected " + hex(e.blob.checksum) + ", got " + hex(got) +
                "): the store is corrupted; check it with `moeinf verify` and re-pack";
  }
  if (!e.error.empty()) {
    free_slot(e);
    e.next_offset = e.bytes_done = 0;
    e.state = State::Failed;
    ++counters_.failures;
    ready_cv_.notify_all();
    return;
  }
  e.state = State::Ready;
  const double latency = ms_since(e.t_submit);
  if (e.priority == kMaxPriority) {
    ++counters_.fetches_demand;
    demand_ms_.add(latency);
  } else {
    ++counters_.fetches_prefetch;
    prefetch_ms_.add(latency);
  }
  completed_[completed_next_] = e.key;
  completed_next_ = (completed_next_ + 1) % completed_.size();
  completed_count_ = std::min(completed_count_ + 1, completed_.size());
  ready_cv_.notify_all();
}

}  // namespace moeinf
