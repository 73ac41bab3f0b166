// The I/O side of the engine: the I/O threads (chunk scheduling, reads, checksums).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>

#include "codec.hpp"
#include "engine.hpp"
#include "errors.hpp"

namespace moeinf {
namespace {

double ms_since(Engine::Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Engine::Clock::now() - t).count();
}

// CPU seconds used by the calling thread: what verification costs, whatever the machine's load.
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

// Each I/O thread takes the next chunk of the best runnable read, reads it and checksums it, then goes
// back to the queue. Checksumming in the reading thread (instead of a verifier thread fed through a ring)
// keeps the chunk counted in `readers` until its sum is merged, so nothing can settle or free the slot
// on a partial sum, and io_threads threads give verification io_threads cores. Checksumming off the read
// path instead (by the key's waiter or an idle I/O thread, commit c0d70a6) read no faster and made demand
// p50 no better on a shared 2-core VM, so the simpler design stays.
void Engine::io_loop(size_t thread_index) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    Entry* e = nullptr;
    work_cv_.wait(lk, [&] { return stopping_ || (!paused_ && (e = next_runnable()) != nullptr); });
    if (stopping_) return;
    read_chunk(lk, *e, thread_index);
  }
}

// Reads (and verifies) the next chunk of `e`. The thread then goes back to the queue, so a higher-priority
// read submitted meanwhile is served next and `e` pauses, keeping its slot, its progress and its place.
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
  const bool verify = opt_.verify;
  std::string error;
  ChecksumParts sums;
  double verify_cpu = 0;
  lk.unlock();
  try {
    file(file_index).read_exact(dst, n, file_offset);
    if (verify) {
      const double cpu0 = thread_cpu_s();
      sums.add(dst, n, offset / 8);
      verify_cpu = thread_cpu_s() - cpu0;
    }
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
    if (verify) {
      counters_.bytes_verified += n;
      counters_.verify_cpu_s += verify_cpu;
    }
    e.sums.merge(sums);
  }
  if (e.readers > 0) return;  // another thread's chunk of `e` is still in flight; it finishes the job
  if (e.in_queue) {
    e.state = State::Queued;  // more chunks to read, now or after a higher-priority read
    if (queue_.top().key != e.key) ++counters_.preemptions;
    return;
  }
  if (e.blob.raw_size > 0 && !e.decoded && !e.discard && e.error.empty()) {
    decode(lk, e);
    if (e.readers > 0 || e.in_queue) return;
  }
  settle(e);
}

// Decodes the coded blob of `e`, whole in its slot, in place (csrc/codec.hpp), without the engine lock: its
// checksum is checked first (it covers the bytes as stored), and `e` counts as being read meanwhile, so a
// cancel only marks it dropped and nothing frees the slot under the decoder.
void Engine::decode(std::unique_lock<std::mutex>& lk, Entry& e) {
  check_sums(e);
  e.decoded = true;
  if (!e.error.empty()) return;
  ++e.readers;
  unsigned char* data = pool_.data(e.slot);
  const size_t size = static_cast<size_t>(e.blob.size);
  std::string error;
  lk.unlock();
  const double cpu0 = thread_cpu_s();
  try {
    const uint64_t words = codec_words(data, size);
    if (2 * words != e.blob.raw_size)
      throw std::invalid_argument("the coded blob decodes to " + std::to_string(2 * words) +
                                  " bytes, its entry says " + std::to_string(e.blob.raw_size));
    codec_decode(data, size, pool_.slot_bytes());
  } catch (const std::exception& x) {
    error = x.what();
  }
  const double cpu = thread_cpu_s() - cpu0;
  lk.lock();
  --e.readers;
  if (!error.empty() && e.error.empty()) e.error = name(e) + ": " + error + " in " + paths_[e.blob.file];
  counters_.bytes_decoded += e.blob.raw_size;
  counters_.decode_cpu_s += cpu;
}

// Sets the error of `e` if its bytes do not match its checksum (once per read; nothing without verify).
void Engine::check_sums(Entry& e) {
  if (e.sums_checked || !e.error.empty() || !opt_.verify) return;
  e.sums_checked = true;
  const uint64_t got = e.sums.finish();
  if (got != e.blob.checksum)
    e.error = name(e) + ": checksum mismatch reading " + paths_[e.blob.file] + " at offset " +
              std::to_string(e.blob.offset) + " (expected " + hex(e.blob.checksum) + ", got " + hex(got) +
              "): the store is corrupted; check it with `moeinf verify` and re-pack";
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
  check_sums(e);
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
