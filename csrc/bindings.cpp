#include <pybind11/pybind11.h>

#include "checksum.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_engine, m) {
  m.doc() = "moeinf expert I/O engine (private; use moeinf.engine)";
  m.def(
      "checksum",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        const size_t size = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        py::gil_scoped_release release;
        return moeinf::checksum(info.ptr, size);
      },
      py::arg("data"), "fletcher64w checksum of a buffer whose size is a multiple of 8 bytes");
}
