// The only file that knows Python: wraps moeinf::Engine, maps its exceptions, releases the GIL while blocking.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <string>
#include <vector>

#include "checksum.hpp"
#include "codec.hpp"
#include "engine.hpp"
#include "errors.hpp"
#include "file.hpp"

namespace py = pybind11;
using moeinf::Engine;

namespace {

py::dict stats_dict(const moeinf::EngineStats& s, const moeinf::EngineOptions& o) {
  py::dict d;
  d["bytes_read"] = s.bytes_read;
  d["fetches_demand"] = s.fetches_demand;
  d["fetches_prefetch"] = s.fetches_prefetch;
  d["hits"] = s.hits;
  d["waits_blocked"] = s.waits_blocked;
  d["failures"] = s.failures;
  d["cancels"] = s.cancels;
  d["preemptions"] = s.preemptions;
  d["bytes_verified"] = s.bytes_verified;
  d["verify_cpu_s"] = s.verify_cpu_s;
  d["bytes_decoded"] = s.bytes_decoded;
  d["decode_cpu_s"] = s.decode_cpu_s;
  d["demand_p50_ms"] = s.demand_p50_ms;
  d["demand_p99_ms"] = s.demand_p99_ms;
  d["prefetch_p50_ms"] = s.prefetch_p50_ms;
  d["prefetch_p99_ms"] = s.prefetch_p99_ms;
  d["queue_wait_p50_ms"] = s.queue_wait_p50_ms;
  d["queue_wait_p99_ms"] = s.queue_wait_p99_ms;
  d["direct_io"] = s.direct_io;
  d["pool_locked"] = s.pool_locked;
  d["slots_total"] = s.slots_total;
  d["slots_used"] = s.slots_total - s.slots_free;
  d["slots_free"] = s.slots_free;
  d["queued"] = s.queued;
  d["numa_nodes"] = s.numa_nodes;
  d["slot_bytes"] = o.slot_bytes;
  d["chunk_bytes"] = o.chunk_bytes;
  d["io_threads"] = o.io_threads;
  d["verify"] = o.verify;
  d["lock_memory"] = o.lock_memory;
  return d;
}

// Engine plus the options it was built with (for stats) in one Python-visible object.
struct PyEngine {
  moeinf::EngineOptions options;
  Engine engine;
  PyEngine(std::vector<std::string> files, const moeinf::EngineOptions& o) : options(o), engine(std::move(files), o) {}
};

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "moeinf expert I/O engine (private; use moeinf.engine)";

  py::register_exception<moeinf::ReadError>(m, "EngineError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const moeinf::WaitTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const moeinf::UnknownKey& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const moeinf::EngineClosed& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.attr("MAX_PRIORITY") = moeinf::kMaxPriority;
  m.attr("ALIGNMENT") = moeinf::kAlignment;

  m.def(
      "checksum",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        const size_t size = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        py::gil_scoped_release release;
        return moeinf::checksum(info.ptr, size);
      },
      py::arg("data"), "fletcher64w checksum of a buffer whose size is a multiple of 8 bytes");

  m.def(
      "codec_encode_into",
      [](py::buffer b, py::buffer o) {
        py::buffer_info info = b.request();
        py::buffer_info out = o.request(true);
        const size_t size = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        const size_t room = static_cast<size_t>(out.size) * static_cast<size_t>(out.itemsize);
        if (size % (2 * moeinf::kCodecBlockWords) != 0)
          throw py::value_error("codec_encode_into: " + std::to_string(size) + " bytes, not a multiple of 128");
        if (room < moeinf::codec_bound(size / 2))
          throw py::value_error("codec_encode_into: the output buffer holds " + std::to_string(room) +
                                " bytes, the code may need " + std::to_string(moeinf::codec_bound(size / 2)));
        py::gil_scoped_release release;
        return moeinf::codec_encode(static_cast<const uint16_t*>(info.ptr), size / 2, static_cast<uint8_t*>(out.ptr));
      },
      py::arg("words"), py::arg("out"),
      "Codes a buffer of bf16 words into the writable buffer `out` (at least codec_bound bytes); returns the "
      "bytes written.");
  m.def("codec_bound", &moeinf::codec_bound, py::arg("words"), "The most bytes the code of `words` words takes.");
  m.def(
      "codec_decode",
      [](py::buffer b, size_t size) {
        py::buffer_info info = b.request(true);
        const size_t capacity = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        try {
          py::gil_scoped_release release;
          moeinf::codec_decode(static_cast<uint8_t*>(info.ptr), size, capacity);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("buffer"), py::arg("size"),
      "Decodes in place the coded blob in the first `size` bytes of a writable buffer that holds its words.");
  m.def(
      "codec_words",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        try {
          return moeinf::codec_words(static_cast<const uint8_t*>(info.ptr),
                                     static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("coded"), "The number of bf16 words a coded blob decodes to.");
  m.def("codec_avx2", &moeinf::codec_avx2, "Whether decoding takes the AVX2 path.");
  m.def("codec_set_avx2", &moeinf::codec_set_avx2, py::arg("enabled"),
        "For tests: False forces the portable decoder, True lets the CPU decide.");

  m.def(
      "raw_read",
      [](const std::string& path, const std::vector<std::pair<uint64_t, uint64_t>>& ranges, size_t chunk_bytes,
         bool direct, size_t buffer_bytes) {
        moeinf::RawReadResult r;
        {
          py::gil_scoped_release release;
          r = moeinf::raw_read(path, ranges, chunk_bytes, direct, buffer_bytes);
        }
        py::dict d;
        d["bytes"] = r.bytes;
        d["seconds"] = r.seconds;
        d["direct_io"] = r.direct;
        return d;
      },
      py::arg("path"), py::arg("ranges"), py::arg("chunk_bytes"), py::arg("direct") = true,
      py::arg("buffer_bytes") = 0,
      "Reads each (offset, size) range in turn in chunk_bytes pieces, one request at a time (the "
      "dd-equivalent I/O baseline), into one chunk buffer or, with buffer_bytes, around a buffer that large.");

  py::class_<moeinf::SlotBuffer>(m, "SlotBuffer", py::buffer_protocol(),
                                 "A resident blob's bytes in the slot pool (zero-copy; valid until release).")
      .def_buffer([](moeinf::SlotBuffer& b) {
        // Writable so torch.frombuffer does not warn; nothing writes to it.
        return py::buffer_info(b.data, 1, py::format_descriptor<unsigned char>::format(), 1,
                               {static_cast<py::ssize_t>(b.size)}, {1}, false);
      })
      .def("__len__", [](const moeinf::SlotBuffer& b) { return b.size; });

  py::class_<PyEngine>(m, "Engine")
      .def(py::init([](std::vector<std::string> files, size_t slot_bytes, size_t num_slots, size_t io_threads,
                       size_t chunk_bytes, bool direct_io, bool verify, bool lock_memory, bool paused) {
             moeinf::EngineOptions o;
             o.slot_bytes = slot_bytes;
             o.num_slots = num_slots;
             o.io_threads = io_threads;
             o.chunk_bytes = chunk_bytes;
             o.direct_io = direct_io;
             o.verify = verify;
             o.lock_memory = lock_memory;
             o.start_paused = paused;
             py::gil_scoped_release release;
             return std::make_unique<PyEngine>(std::move(files), o);
           }),
           py::arg("files"), py::arg("slot_bytes"), py::arg("num_slots"), py::arg("io_threads"),
           py::arg("chunk_bytes"), py::arg("direct_io"), py::arg("verify"), py::arg("lock_memory"), py::arg("paused"))
      .def(
          "add",
          [](PyEngine& s, int layer, int expert, size_t file, uint64_t offset, uint64_t size, uint64_t checksum,
             uint64_t raw_size) {
            s.engine.add(layer, expert, moeinf::BlobRef{file, offset, size, checksum, raw_size});
          },
          py::arg("layer"), py::arg("expert"), py::arg("file"), py::arg("offset"), py::arg("size"),
          py::arg("checksum"), py::arg("raw_size") = 0)
      // The calls below wait for the engine lock (held by an I/O thread between chunks, or by wait()):
      // they touch no Python object, so other Python threads run meanwhile (call_guard releases the GIL
      // after the arguments are converted and takes it back before the result is).
      .def("submit", [](PyEngine& s, int layer, int expert, double priority) { s.engine.submit(layer, expert, priority); },
           py::arg("layer"), py::arg("expert"), py::arg("priority"), py::call_guard<py::gil_scoped_release>())
      .def("cancel", [](PyEngine& s, int layer, int expert) { return s.engine.cancel(layer, expert); },
           py::arg("layer"), py::arg("expert"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](PyEngine& s, int layer, int expert, double timeout) {
            // Let Ctrl-C interrupt a long wait: the engine calls this every ~100 ms without its lock.
            auto check_signals = [] {
              py::gil_scoped_acquire acquire;
              if (PyErr_CheckSignals() != 0) throw py::error_already_set();
            };
            py::gil_scoped_release release;
            return s.engine.wait(layer, expert, timeout, check_signals);
          },
          py::arg("layer"), py::arg("expert"), py::arg("timeout"))
      .def("release", [](PyEngine& s, int layer, int expert) { s.engine.release(layer, expert); },
           py::arg("layer"), py::arg("expert"), py::call_guard<py::gil_scoped_release>())
      .def("is_resident", [](PyEngine& s, int layer, int expert) { return s.engine.is_resident(layer, expert); },
           py::arg("layer"), py::arg("expert"), py::call_guard<py::gil_scoped_release>())
      .def("state", [](PyEngine& s, int layer, int expert) { return std::string(moeinf::state_name(s.engine.state(layer, expert))); },
           py::arg("layer"), py::arg("expert"), py::call_guard<py::gil_scoped_release>())
      .def("resident", [](PyEngine& s) { return s.engine.resident(); })
      .def("queued", [](PyEngine& s) { return s.engine.queued(); })
      .def("completed", [](PyEngine& s) { return s.engine.completed(); })
      .def("free_slots", [](PyEngine& s) { return s.engine.free_slots(); })
      .def("regions", [](PyEngine& s) { return s.engine.regions(); })
      .def("pause", [](PyEngine& s) { s.engine.pause(); })
      .def("resume", [](PyEngine& s) { s.engine.resume(); })
      .def("stats", [](PyEngine& s) { return stats_dict(s.engine.stats(), s.options); })
      .def("reset_stats", [](PyEngine& s) { s.engine.reset_stats(); })
      .def("close", [](PyEngine& s) {
        py::gil_scoped_release release;
        s.engine.close();
      });
}
