#pragma once
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "checksum.hpp"
#include "file.hpp"
#include "memory.hpp"
#include "queue.hpp"

namespace moeinf {

// Demand fetches: above every prefetch priority, so they jump the whole queue.
constexpr double kMaxPriority = std::numeric_limits<double>::infinity();

struct EngineOptions {
  size_t slot_bytes = 0;
  size_t num_slots = 0;
  size_t io_threads = 1;
  size_t chunk_bytes = 2 << 20;
  bool direct_io = true;
  bool verify = true;
  bool lock_memory = true;    // page-lock the slot pool (mlock); falls back to pageable, see pool_locked
  bool start_paused = false;  // I/O threads take nothing from the queue until resume() (tests, staging)
};

// Where one registered blob lives.
struct BlobRef {
  size_t file = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t checksum = 0;
  // > 0: the blob is coded (csrc/codec.hpp); the read decodes it in its slot into raw_size bytes, which are
  // what a waiter gets. The checksum is over the `size` bytes as stored.
  uint64_t raw_size = 0;

  // The bytes the blob takes in its slot (what a waiter gets).
  uint64_t memory_size() const { return raw_size ? raw_size : size; }
};

// A resident blob: `size` bytes at `data`, valid until the key is released. `owner` keeps the pool memory
// mapped even after the engine is gone, so a stale buffer reads old bytes instead of crashing.
struct SlotBuffer {
  std::shared_ptr<Region> owner;
  unsigned char* data = nullptr;
  size_t size = 0;
};

enum class State { Idle, Queued, Reading, Ready, Failed };
const char* state_name(State s);

struct EngineStats {
  uint64_t bytes_read = 0;
  uint64_t fetches_demand = 0;    // reads completed at MAX priority
  uint64_t fetches_prefetch = 0;  // reads completed below MAX priority
  uint64_t hits = 0;              // wait() found the key resident
  uint64_t waits_blocked = 0;     // wait() had to block for a read
  uint64_t failures = 0;
  uint64_t cancels = 0;
  uint64_t preemptions = 0;  // a read paused between chunks for a higher-priority one
  uint64_t bytes_verified = 0;
  double verify_cpu_s = 0;  // CPU time (thread clocks) the checksums of those bytes took
  uint64_t bytes_decoded = 0;  // bytes coded blobs decoded to
  double decode_cpu_s = 0;     // CPU time (thread clocks) their decoding took
  double demand_p50_ms = 0, demand_p99_ms = 0, prefetch_p50_ms = 0, prefetch_p99_ms = 0;
  double queue_wait_p50_ms = 0, queue_wait_p99_ms = 0;
  bool direct_io = false;  // every opened file uses O_DIRECT
  bool pool_locked = false;  // the slot pool is page-locked
  size_t slots_total = 0, slots_free = 0, queued = 0, numa_nodes = 0;
};

// The host-DRAM tier: a pool of aligned slots, a priority queue of reads and I/O threads. The unit of I/O is
// a chunk: each I/O thread repeatedly takes the next chunk of the best runnable read, reads and checksums
// it, so a demand fetch waits behind at most one chunk per thread, a read left with unread chunks keeps
// its slot and place in the queue (paused), and io_threads reads are in flight (the drive's queue depth;
// several threads read one blob in parallel). One object owns all of it; the destructor stops and joins.
// Keys are (layer, expert) pairs of ints; the engine knows nothing else about them.
class Engine {
 public:
  using Clock = std::chrono::steady_clock;

  Engine(std::vector<std::string> files, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void add(int layer, int expert, const BlobRef& blob);
  void submit(int layer, int expert, double priority);
  bool cancel(int layer, int expert);
  // Blocks until resident; submits at kMaxPriority if the key is neither queued nor in flight. timeout_s < 0
  // waits forever. `tick`, if set, runs about every 100 ms without the engine lock (the binding checks
  // for Ctrl-C there) and may throw to abort the wait.
  SlotBuffer wait(int layer, int expert, double timeout_s, const std::function<void()>& tick);
  void release(int layer, int expert);
  bool is_resident(int layer, int expert);
  std::vector<std::pair<int, int>> resident();
  std::vector<std::pair<int, int>> queued();     // queue order, highest priority first
  std::vector<std::pair<int, int>> completed();  // keys in the order their reads completed (last 4096)
  State state(int layer, int expert);
  size_t free_slots();
  // (address, bytes) of each pool region, for registering the pool with a GPU driver.
  std::vector<std::pair<uintptr_t, size_t>> regions();
  void pause();
  void resume();
  EngineStats stats();
  void reset_stats();
  void close();

 private:
  struct Entry {
    int layer = 0, expert = 0;
    uint64_t key = 0;
    BlobRef blob;
    State state = State::Idle;
    double priority = 0.0;
    QueueItem queued_as;
    bool in_queue = false;  // has chunks not yet issued and is wanted
    int slot = -1;
    uint64_t next_offset = 0;  // chunks issued so far
    uint64_t bytes_done = 0;   // chunks read so far
    int readers = 0;           // chunks being read (and checksummed) right now
    ChecksumParts sums;
    bool sums_checked = false;  // the read's checksum was compared (coded blobs: before decoding)
    bool decoded = false;       // the coded blob was decoded (or failed to)
    std::string error;
    bool discard = false;  // released while chunks are in flight: drop it when they are done
    int waiters = 0;
    Clock::time_point t_submit;  // submit, or promotion to kMaxPriority (demand latency starts there)
  };
  Entry& entry(int layer, int expert);
  std::string name(const Entry& e) const;
  void check_open() const;
  void submit_locked(Entry& e, double priority);
  void decode(std::unique_lock<std::mutex>& lk, Entry& e);
  void check_sums(Entry& e);
  bool cancel_locked(Entry& e);
  void keep(Entry& e);
  void enqueue(Entry& e);
  void dequeue(Entry& e);
  void free_slot(Entry& e);
  Entry* next_runnable();
  void io_loop(size_t thread_index);
  void read_chunk(std::unique_lock<std::mutex>& lk, Entry& e, size_t thread_index);
  void settle(Entry& e);
  const BlobFile& file(size_t index);

  EngineOptions opt_;
  std::vector<std::string> paths_;
  std::mutex files_mu_;
  std::vector<std::unique_ptr<BlobFile>> files_;  // opened lazily; a missing file fails its keys only
  bool any_buffered_ = false;                     // guarded by files_mu_

  std::mutex mu_;  // guards everything below
  std::condition_variable work_cv_, ready_cv_;
  SlotPool pool_;
  std::unordered_map<uint64_t, Entry> entries_;  // never erased: Entry pointers stay valid
  ReadQueue queue_;
  size_t queued_with_slot_ = 0;  // queued reads that already hold a slot (paused or being read)
  bool paused_ = false;
  bool stopping_ = false;

  EngineStats counters_;
  LatencyLog demand_ms_{4096}, prefetch_ms_{4096}, queue_wait_ms_{4096};
  std::vector<uint64_t> completed_;
  size_t completed_next_ = 0, completed_count_ = 0;

  std::vector<std::thread> io_threads_;
};

}  // namespace moeinf
