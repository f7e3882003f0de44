#include "python/buffers.h"

#include <cstring>

#include "common/errors.h"

namespace py = pybind11;

namespace clawcomm {
namespace {

// The element type a buffer's struct format describes.
DataType dataTypeOfFormat(const std::string& op, const std::string& format, ssize_t itemsize) {
  // One type code, after an optional byte-order prefix ('<f4' style).
  std::string code = format;
  if (!code.empty() && std::strchr("@=<>!", code[0])) code.erase(0, 1);
  const char f = code.size() == 1 ? code[0] : '\0';
  switch (f) {
    case 'f': return DataType::kFloat32;
    case 'd': return DataType::kFloat64;
    case 'e': return DataType::kFloat16;
    case 'b': return DataType::kInt8;
    case 'B': return DataType::kUInt8;
    case '?': return DataType::kBool;
    case 'i':
    case 'l':
    case 'q':
      if (itemsize == 4) return DataType::kInt32;
      if (itemsize == 8) return DataType::kInt64;
      break;
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm::", op, ": buffer format '", format,
                                        "' is not a supported element type (pass dtype= for "
                                        "bfloat16 held in uint16)"));
}

}  // namespace

DataType parseDataType(const std::string& op, const std::string& name) {
  for (int t = 0; t < int(DataType::kNumTypes); ++t) {
    if (name == dataTypeName(DataType(t))) return DataType(t);
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm::", op, ": unknown dtype '", name, "'"));
}

// `dtype` overrides the buffer's own format (bfloat16 travels as uint16).
Buffer takeBuffer(const std::string& op, const char* what, const py::buffer& obj, bool writable,
                  const py::object& dtype, bool anyFormat) {
  Buffer b;
  try {
    b.info = obj.request(writable);
  } catch (const py::error_already_set& e) {
    throw InvalidArgument(CLAWCOMM_CONCAT(
        "clawcomm::", op, ": ", what, writable ? " is not a writable buffer: " : ": ", e.what()));
  }
  ssize_t expected = b.info.itemsize;
  for (ssize_t d = b.info.ndim - 1; d >= 0; --d) {
    CLAWCOMM_ARG_CHECK(b.info.shape[d] <= 1 || b.info.strides[d] == expected, "clawcomm::", op,
                       ": ", what, " is not C-contiguous");
    expected *= b.info.shape[d];
  }
  b.data = b.info.ptr;
  b.count = size_t(b.info.size);
  if (anyFormat) return b;
  b.dtype = dtype.is_none() ? dataTypeOfFormat(op, b.info.format, b.info.itemsize)
                            : parseDataType(op, py::cast<std::string>(dtype));
  CLAWCOMM_ARG_CHECK(ssize_t(elementSize(b.dtype)) == b.info.itemsize, "clawcomm::", op, ": ", what,
                     " has ", b.info.itemsize, "-byte elements, dtype ", dataTypeName(b.dtype),
                     " needs ", elementSize(b.dtype));
  return b;
}

// A C-contiguous buffer taken as raw bytes (point-to-point messages).
Buffer takeBytes(const std::string& op, const char* what, const py::buffer& obj, bool writable) {
  Buffer b = takeBuffer(op, what, obj, writable, py::none(), /*anyFormat=*/true);
  b.count *= size_t(b.info.itemsize);
  b.dtype = DataType::kUInt8;
  return b;
}

ReduceOp parseReduceOp(const std::string& op, const std::string& name) {
  for (int r = 0; r < int(ReduceOp::kNumOps); ++r) {
    if (name == reduceOpName(ReduceOp(r))) return ReduceOp(r);
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm::", op, ": unknown reduce op '", name, "'"));
}

void checkSameType(const std::string& op, const Buffer& a, const Buffer& b) {
  CLAWCOMM_ARG_CHECK(a.dtype == b.dtype, "clawcomm::", op, ": input is ", dataTypeName(a.dtype),
                     " but output is ", dataTypeName(b.dtype));
}

// Waits for `request` without the GIL and raises its error, if any.
int finish(const RequestPtr& request) {
  {
    py::gil_scoped_release release;
    request->waitFor(std::chrono::milliseconds(-1));
  }
  if (auto e = request->exception()) std::rethrow_exception(e);
  return request->sourceRank();
}

}  // namespace clawcomm
