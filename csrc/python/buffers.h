// Buffer-protocol arguments of the Python bindings (engine_bindings.cc,
// device_bindings.cc): C-contiguous buffers, dtype and reduce-op names, and
// waiting for a request without the GIL. Every error names the op.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "comm/communicator.h"
#include "comm/request.h"
#include "common/dtype.h"

// Hidden, as pybind11's own types (buffer_info) are: these are _C's alone.
#pragma GCC visibility push(hidden)

namespace clawcomm {

// A C-contiguous buffer and its element type.
struct Buffer {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  pybind11::buffer_info info;  // keeps the exporter's view alive
};

DataType parseDataType(const std::string& op, const std::string& name);
ReduceOp parseReduceOp(const std::string& op, const std::string& name);
// `dtype` (None, or a dtype name) overrides the buffer's own format
// (bfloat16 travels as uint16); `anyFormat` skips the element type.
Buffer takeBuffer(const std::string& op, const char* what, const pybind11::buffer& obj,
                  bool writable, const pybind11::object& dtype, bool anyFormat = false);
// A C-contiguous buffer taken as raw bytes (point-to-point messages).
Buffer takeBytes(const std::string& op, const char* what, const pybind11::buffer& obj,
                 bool writable);
void checkSameType(const std::string& op, const Buffer& a, const Buffer& b);
// Waits for `request` without the GIL and raises its error, if any; returns
// its source rank.
int finish(const RequestPtr& request);

// Issues one operation and waits for it, all in one release of the GIL
// (a collective runs inline, Communicator::Blocking, so this is the whole
// call).
template <typename Issue>
int run(Issue issue) {
  namespace py = pybind11;
  RequestPtr request;
  {
    py::gil_scoped_release release;
    Communicator::Blocking blocking;
    request = issue();
    request->waitFor(std::chrono::milliseconds(-1));
  }
  if (auto e = request->exception()) std::rethrow_exception(e);
  return request->sourceRank();
}
}  // namespace clawcomm

#pragma GCC visibility pop
