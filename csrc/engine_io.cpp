// The I/O side of the engine: the I/O threads (chunk scheduling, reads) and the verifier thread.
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

// Reads come first; an I/O thread with nothing it can read (empty queue, or no free slot) checksums pending
// chunks instead: slots wait on verification, so this frees them sooner, and when CPUs are contended two
// threads get more CPU time for checksums than the verifier alone.
void Engine::io_loop(size_t thread_index) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    Entry* e = nullptr;
    work_cv_.wait(lk, [&] {
      return stopping_ || verify_count_ > 0 || (!paused_ && (e = next_runnable()) != nullptr);
    });
    if (stopping_) return;
    if (e != nullptr) {
      read_chunk(lk, *e, thread_index);
    } else if (!paused_ && (e = next_runnable()) != nullptr) {
      read_chunk(lk, *e, thread_index);
    } else if (verify_count_ > 0) {
      verify_one(lk);
    }
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
  work_cv_.notify_all();  // an idle I/O thread may checksum it
}

void Engine::verify_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    verify_cv_.wait(lk, [&] { return stopping_ || verify_count_ > 0; });
    if (stopping_) return;
    verify_one(lk);
  }
}

// Checksums the oldest pending chunk (the verifier thread, or an I/O thread with nothing to read).
void Engine::verify_one(std::unique_lock<std::mutex>& lk) {
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

// Completes `e` once no chunk of it is queued, being read or being checksummed: frees a dropped read,
// fails a read that hit an error or a checksum mismatch, or makes the key resident.
void Engine::settle(Entry& e) {
  if (e.pending_verify > 0 || e.readers > 0 || e.in_queue) return;
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
