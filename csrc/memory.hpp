#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace moeinf {

// O_DIRECT needs buffers, offsets and sizes aligned to the logical block size; 4 KiB covers every device.
constexpr size_t kAlignment = 4096;

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The NUMA node ids listed in /sys/devices/system/node/online; {0} when the file is absent.
std::vector<int> numa_nodes();

// One anonymous, page-aligned mapping (RAII), faulted in at construction so the hot path never page-faults.
// With node >= 0 on a multi-node machine its pages are bound to that node (mbind, no libnuma needed).
// With `lock`, its pages are page-locked (mlock): never swapped, and registrable with the GPU driver for
// asynchronous host->device copies. Where RLIMIT_MEMLOCK refuses, the region stays pageable and
// locked() is false (the caller warns); nothing else changes.
class Region {
 public:
  Region(size_t bytes, int node, bool lock = false);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  bool locked() const { return locked_; }

 private:
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
  bool locked_ = false;
};

// A fixed set of equal, aligned slots carved out of one Region per NUMA node, allocated once. Not
// thread-safe: the engine calls it under its lock. Slots are plain indices; acquire/release never allocate.
class SlotPool {
 public:
  SlotPool(size_t slot_bytes, size_t num_slots, const std::vector<int>& nodes, bool lock);

  size_t slot_bytes() const { return slot_bytes_; }
  size_t num_slots() const { return slot_region_.size(); }
  size_t free_count() const { return free_count_; }
  size_t num_nodes() const { return regions_.size(); }
  // True when every region is page-locked.
  bool locked() const;
  // (address, bytes) of each region: the caller may register them with a GPU driver (cudaHostRegister).
  std::vector<std::pair<uintptr_t, size_t>> regions() const;

  // A free slot, preferring `node_hint` (an index into the pool's nodes); -1 when none is free.
  int acquire(size_t node_hint);
  void release(int slot);
  unsigned char* data(int slot) const;
  // The Region holding `slot`: buffers handed to Python keep it alive past the engine.
  std::shared_ptr<Region> region_of(int slot) const;

 private:
  size_t slot_bytes_;
  std::vector<std::shared_ptr<Region>> regions_;
  std::vector<size_t> slot_region_;       // slot -> index in regions_
  std::vector<size_t> slot_offset_;       // slot -> byte offset in its region
  std::vector<std::vector<int>> free_;    // per region: free slots (a stack)
  size_t free_count_ = 0;
};

}  // namespace moeinf
