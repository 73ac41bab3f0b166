#include "file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "errors.hpp"
#include "memory.hpp"

namespace moeinf {

std::string errno_message(const std::string& what, int err) {
  return what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

namespace {

int open_read(const std::string& path, int extra_flags) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | extra_flags);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

}  // namespace

BlobFile::BlobFile(const std::string& path, bool want_direct) : path_(path) {
  if (want_direct) {
    fd_ = open_read(path, O_DIRECT);
    if (fd_ >= 0) {
      mode_ = IoMode::Direct;
      return;
    }
    if (errno != EINVAL) throw ReadError(errno_message("cannot open " + path, errno));
  }
  fd_ = open_read(path, 0);
  if (fd_ < 0) throw ReadError(errno_message("cannot open " + path, errno));
  mode_ = IoMode::Buffered;
}

BlobFile::~BlobFile() {
  // A read-only descriptor has nothing to flush; a destructor could not report a failure anyway.
  if (fd_ >= 0) ::close(fd_);
}

void BlobFile::read_exact(void* dst, size_t size, uint64_t offset) const {
  auto* out = static_cast<unsigned char*>(dst);
  size_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd_, out + done, size - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw ReadError(errno_message("pread of " + path_ + " at offset " +
                                        std::to_string(offset + done) + " failed", errno));
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
    // O_DIRECT cannot continue from an unaligned position; a partial read there means the file ended.
    if (mode_ == IoMode::Direct && done < size && done % kAlignment != 0) break;
  }
  if (done == size) return;
  struct stat st {};
  const std::string file_size =
      ::fstat(fd_, &st) == 0 ? std::to_string(st.st_size) + " bytes" : std::string("of unknown size");
  throw ReadError("short read of " + path_ + ": got " + std::to_string(done) + " of " +
                  std::to_string(size) + " bytes at offset " + std::to_string(offset) + " (the file is " +
                  file_size + "; it is truncated or the index is stale)");
}

RawReadResult raw_read(const std::string& path, const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                       size_t chunk_bytes, bool direct, size_t buffer_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % kAlignment != 0)
    throw std::invalid_argument("raw_read: chunk_bytes must be a positive multiple of 4096");
  BlobFile file(path, direct);
  Region buffer(std::max(chunk_bytes, buffer_bytes), -1);
  const auto start = std::chrono::steady_clock::now();
  uint64_t total = 0;
  size_t at = 0;  // where the next piece lands in the buffer
  for (const auto& [offset, size] : ranges) {
    for (uint64_t done = 0; done < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, size - done));
      if (at + chunk_bytes > buffer.size()) at = 0;
      file.read_exact(buffer.data() + at, n, offset + done);
      at += chunk_bytes;
      done += n;
    }
    total += size;
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return RawReadResult{total, elapsed.count(), file.mode() == IoMode::Direct};
}

}  // namespace moeinf
