#pragma once
#include <stdexcept>
#include <string>

namespace moeinf {

// A blob could not be read (missing file, I/O error, short read, checksum mismatch). The message names the
// file and the (layer, expert) key; Python sees moeinf.engine.EngineError.
class ReadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// wait() gave up; Python sees TimeoutError.
class WaitTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A key that was never registered with add(); Python sees KeyError.
class UnknownKey : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Any call on a closed engine; Python sees RuntimeError.
class EngineClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "<what>: <strerror(err)> (errno <err>)".
std::string errno_message(const std::string& what, int err);

}  // namespace moeinf
