#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moeinf {

enum class IoMode { Direct, Buffered };

// One open blob file (RAII). Opened with O_DIRECT when asked; a file system that refuses O_DIRECT with
// EINVAL (tmpfs, some FUSE) is opened buffered instead, and mode() says so (the engine reports it in stats).
class BlobFile {
 public:
  BlobFile(const std::string& path, bool want_direct);
  ~BlobFile();
  BlobFile(const BlobFile&) = delete;
  BlobFile& operator=(const BlobFile&) = delete;

  const std::string& path() const { return path_; }
  IoMode mode() const { return mode_; }

  // Reads exactly `size` bytes at `offset` into `dst` (4 KiB-aligned for O_DIRECT), retrying on EINTR and
  // partial reads. Throws ReadError naming the file on an error or when the file ends early. Thread-safe.
  void read_exact(void* dst, size_t size, uint64_t offset) const;

 private:
  std::string path_;
  int fd_ = -1;
  IoMode mode_ = IoMode::Buffered;
};

struct RawReadResult {
  uint64_t bytes = 0;
  double seconds = 0.0;
  bool direct = false;
};

// The dd-equivalent baseline of the I/O benchmark: reads each (offset, size) range of `path` in turn, in
// `chunk_bytes` pieces into one aligned buffer (one request at a time), with O_DIRECT when `direct` (and
// the file system allows it). With `buffer_bytes` > chunk_bytes the pieces land one after the other in a
// buffer that large, wrapping around (a reader that keeps what it reads, like the engine's pool).
RawReadResult raw_read(const std::string& path, const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                       size_t chunk_bytes, bool direct, size_t buffer_bytes = 0);

}  // namespace moeinf
