#include "memory.hpp"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "errors.hpp"

namespace moeinf {
namespace {

// From <linux/mempolicy.h>; spelled here so the engine needs no libnuma headers.
constexpr int kMpolBind = 2;

// Parses a sysfs list such as "0", "0-3" or "0-1,4".
std::vector<int> parse_id_list(const std::string& text) {
  std::vector<int> ids;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty() || item == "\n") continue;
    const size_t dash = item.find('-');
    const int first = std::stoi(item.substr(0, dash));
    const int last = dash == std::string::npos ? first : std::stoi(item.substr(dash + 1));
    for (int id = first; id <= last; ++id) ids.push_back(id);
  }
  return ids;
}

void bind_to_node(void* addr, size_t bytes, int node) {
  if (node < 0 || node >= 64) throw std::invalid_argument("NUMA node id out of range: " + std::to_string(node));
  const unsigned long mask = 1UL << node;
  if (::syscall(SYS_mbind, addr, bytes, kMpolBind, &mask, sizeof(mask) * 8, 0) != 0)
    throw std::runtime_error(errno_message("mbind of the slot pool to NUMA node " + std::to_string(node), errno));
}

}  // namespace

std::vector<int> numa_nodes() {
  std::ifstream online("/sys/devices/system/node/online");
  std::string text;
  if (!online || !std::getline(online, text)) return {0};
  std::vector<int> nodes = parse_id_list(text);
  if (nodes.empty()) return {0};
  return nodes;
}

Region::Region(size_t bytes, int node, bool lock) : size_(align_up(bytes, kAlignment)) {
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw std::runtime_error(errno_message("mmap of a " + std::to_string(size_) + "-byte slot pool", errno));
  data_ = static_cast<unsigned char*>(p);
  try {
    if (node >= 0) bind_to_node(data_, size_, node);
  } catch (...) {
    ::munmap(data_, size_);
    throw;
  }
  // Huge pages make pinning a slot for O_DIRECT cheaper (one page per 2 MiB). Only a hint: a kernel built
  // without transparent huge pages answers EINVAL and the pool works with small pages.
  if (::madvise(data_, size_, MADV_HUGEPAGE) != 0 && errno != EINVAL) {
    const int err = errno;
    ::munmap(data_, size_);
    throw std::runtime_error(errno_message("madvise(MADV_HUGEPAGE) on the slot pool", err));
  }
  // Touch every page now: the first O_DIRECT read into a slot must not pay for page faults.
  std::memset(data_, 0, size_);
  // ENOMEM/EPERM/EAGAIN: over RLIMIT_MEMLOCK (or no privilege); the pool works pageable and says so.
  if (lock) {
    if (::mlock(data_, size_) == 0) {
      locked_ = true;
    } else if (errno != ENOMEM && errno != EPERM && errno != EAGAIN) {
      const int err = errno;
      ::munmap(data_, size_);
      throw std::runtime_error(errno_message("mlock of the slot pool", err));
    }
  }
}

Region::~Region() {
  // munmap of a mapping we own with its own size cannot fail; a destructor could not report it anyway.
  if (data_) ::munmap(data_, size_);
}

SlotPool::SlotPool(size_t slot_bytes, size_t num_slots, const std::vector<int>& nodes, bool lock)
    : slot_bytes_(align_up(slot_bytes, kAlignment)) {
  if (slot_bytes == 0 || num_slots == 0) throw std::invalid_argument("slot_bytes and num_slots must be positive");
  const size_t n_nodes = nodes.size() > 1 ? std::min(nodes.size(), num_slots) : 1;
  free_.resize(n_nodes);
  for (size_t r = 0; r < n_nodes; ++r) {
    // Slots are spread evenly over the nodes; a single node needs no binding.
    const size_t count = num_slots / n_nodes + (r < num_slots % n_nodes ? 1 : 0);
    regions_.push_back(std::make_shared<Region>(count * slot_bytes_, n_nodes > 1 ? nodes[r] : -1, lock));
    free_[r].reserve(count);  // release() then never allocates
    for (size_t i = 0; i < count; ++i) {
      const int slot = static_cast<int>(slot_region_.size());
      slot_region_.push_back(r);
      slot_offset_.push_back(i * slot_bytes_);
      free_[r].push_back(slot);
    }
  }
  for (auto& stack : free_) std::reverse(stack.begin(), stack.end());
  free_count_ = num_slots;
}

bool SlotPool::locked() const {
  return std::all_of(regions_.begin(), regions_.end(), [](const auto& r) { return r->locked(); });
}

std::vector<std::pair<uintptr_t, size_t>> SlotPool::regions() const {
  std::vector<std::pair<uintptr_t, size_t>> out;
  for (const auto& r : regions_) out.emplace_back(reinterpret_cast<uintptr_t>(r->data()), r->size());
  return out;
}

int SlotPool::acquire(size_t node_hint) {
  for (size_t k = 0; k < free_.size(); ++k) {
    auto& stack = free_[(node_hint + k) % free_.size()];
    if (stack.empty()) continue;
    const int slot = stack.back();
    stack.pop_back();
    --free_count_;
    return slot;
  }
  return -1;
}

void SlotPool::release(int slot) {
  free_[slot_region_.at(static_cast<size_t>(slot))].push_back(slot);
  ++free_count_;
}

unsigned char* SlotPool::data(int slot) const {
  const auto s = static_cast<size_t>(slot);
  return regions_[slot_region_.at(s)]->data() + slot_offset_[s];
}

std::shared_ptr<Region> SlotPool::region_of(int slot) const {
  return regions_[slot_region_.at(static_cast<size_t>(slot))];
}

}  // namespace moeinf
