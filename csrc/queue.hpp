#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

namespace moeinf {

// One queued read: higher priority first, then first come first served.
struct QueueItem {
  double priority = 0.0;
  uint64_t seq = 0;
  uint64_t key = 0;
};

struct QueueOrder {
  bool operator()(const QueueItem& a, const QueueItem& b) const {
    if (a.priority != b.priority) return a.priority > b.priority;
    return a.seq < b.seq;
  }
};

// The priority queue of reads. Re-prioritising is erase + push (the caller keeps the QueueItem it got), so
// a key changes place in O(log n) and a re-prioritised key goes behind others of its new priority.
class ReadQueue {
 public:
  using const_iterator = std::set<QueueItem, QueueOrder>::const_iterator;

  QueueItem push(uint64_t key, double priority) {
    QueueItem item{priority, next_seq_++, key};
    items_.insert(item);
    return item;
  }
  void erase(const QueueItem& item) { items_.erase(item); }
  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }
  const QueueItem& top() const { return *items_.begin(); }
  const_iterator begin() const { return items_.begin(); }
  const_iterator end() const { return items_.end(); }

 private:
  std::set<QueueItem, QueueOrder> items_;
  uint64_t next_seq_ = 0;
};

// The last `capacity` samples of a latency (ms), kept in a ring allocated once; percentiles on demand.
class LatencyLog {
 public:
  explicit LatencyLog(size_t capacity) : samples_(capacity) {}

  void add(double ms) {
    samples_[next_] = ms;
    next_ = (next_ + 1) % samples_.size();
    count_ = std::min(count_ + 1, samples_.size());
  }
  void clear() { next_ = count_ = 0; }
  size_t count() const { return count_; }

  // The q-quantile (0..1, nearest rank) of the kept samples; NaN when there are none.
  double percentile(double q) const {
    if (count_ == 0) return std::nan("");
    std::vector<double> sorted(samples_.begin(), samples_.begin() + static_cast<long>(count_));
    const size_t rank = std::min(count_ - 1, static_cast<size_t>(std::ceil(q * count_)) - (q > 0 ? 1 : 0));
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<long>(rank), sorted.end());
    return sorted[rank];
  }

 private:
  std::vector<double> samples_;
  size_t next_ = 0;
  size_t count_ = 0;
};

}  // namespace moeinf
