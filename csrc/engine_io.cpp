// The I/O side of the engine: the I/O threads (chunk scheduling, reads, checksums).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>

#include "engine.hpp"
#include "errors.hpp"

namespace moeinf {
namespace {

double ms_since(Engine::Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Engine::Clock::now() - t).count();
}

// CPU seconds used by the calling thread (verification cost, independent of how loaded the machine is).
double thread_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

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

// Each I/O thread takes the next chunk of the best runnable read and reads it, then goes back to the queue;
// only when no read can be issued does it checksum a pending chunk (oldest first), so a checksum never
// delays the next read and a thread blocked in wait() spends its time on its own key's chunks.
void Engine::io_loop(size_t thread_index) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    Entry* e = nullptr;
    work_cv_.wait(lk, [&] {
      return stopping_ || (!paused_ && (e = next_runnable()) != nullptr) || !pending_.empty();
    });
    if (stopping_) return;
    if (e != nullptr) {
      read_chunk(lk, *e, thread_index);
      continue;
    }
    PendingChunk c;
    if (take_pending(c, nullptr)) verify_chunk(lk, c, false);
  }
}

// Reads the next chunk of `e`. The thread then goes back to the queue, so a higher-priority read submitted
// meanwhile is served next and `e` pauses, keeping its slot, its progress and its place. With verify the
// chunk stays counted in `readers` until verify_chunk has merged its sums, so nothing can settle the read
// or free its slot on a partial sum.
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
  ++e.reading;
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
  --e.reading;
  // The last chunk being read of a read that is still queued, below another: the read pauses.
  if (e.reading == 0 && e.in_queue && queue_.top().key != e.key) ++counters_.preemptions;
  if (!error.empty()) {
    if (e.error.empty()) e.error = name(e) + ": " + error;
    dequeue(e);
  } else {
    e.bytes_done += n;
    counters_.bytes_read += n;
    if (opt_.verify) {
      pending_.push_back(PendingChunk{e.key, offset, n});
      work_cv_.notify_one();                   // an idle I/O thread checksums it
      if (e.waiters > 0) ready_cv_.notify_all();  // or a waiter of this key does
      return;
    }
  }
  --e.readers;
  chunk_done(e);
}

bool Engine::take_pending(PendingChunk& out, const Entry* only) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (only != nullptr && it->key != only->key) continue;
    out = *it;
    pending_.erase(it);
    return true;
  }
  return false;
}

// Checksums a chunk taken from `pending_` (the lock is released meanwhile; the entry still counts the
// chunk in `readers`, so its slot stays put), merges the sums and finishes the chunk.
void Engine::verify_chunk(std::unique_lock<std::mutex>& lk, const PendingChunk& c, bool by_waiter) {
  Entry& e = entries_.at(c.key);
  const unsigned char* data = pool_.data(e.slot) + c.offset;
  ChecksumParts sums;
  std::string error;
  lk.unlock();
  const double cpu0 = thread_cpu_s();
  try {
    sums.add(data, c.size, c.offset / 8);
  } catch (const std::exception& x) {
    error = x.what();
  }
  const double cpu = thread_cpu_s() - cpu0;
  lk.lock();
  counters_.bytes_verified += c.size;
  counters_.verify_cpu_s += cpu;
  if (by_waiter) ++counters_.verified_by_waiter;
  if (!error.empty() && e.error.empty()) e.error = name(e) + ": " + error;
  e.sums.merge(sums);
  --e.readers;
  chunk_done(e);
}

// After one chunk of `e` is read (and checksummed): the last chunk in flight pauses the read (more chunks
// to read, now or after a higher-priority read) or settles it.
void Engine::chunk_done(Entry& e) {
  if (e.readers > 0) return;  // another chunk of `e` is still in flight; it finishes the job
  if (e.in_queue) {
    e.state = State::Queued;
    return;
  }
  settle(e);
}

// Completes `e` once no chunk of it is queued or being read (and checksummed): frees a dropped read, fails
// a read that hit an error or a checksum mismatch, or makes the key resident.
void Engine::settle(Entry& e) {
  if (e.readers > 0 || e.in_queue) return;
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
