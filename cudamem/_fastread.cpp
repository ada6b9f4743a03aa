// cudamem's C++ counter reader: three integers of one device's CUDA caching allocator.
//
// torch._C._cuda_memoryStats builds 39 dicts of 122 ints per call (~11 us); spans need three
// numbers: allocated, reserved and peak-allocated bytes of the "all" pool (StatType::AGGREGATE,
// index 0 in every PyTorch release), exactly what memory_stats() reports as
// allocated_bytes.all.current, reserved_bytes.all.current and allocated_bytes.all.peak.
//
// Plain CPython C API (no pybind11) so that it compiles in seconds and a call costs ~0.2 us.
// Built by cudamem/_fastread.py with torch.utils.cpp_extension.load_inline, which defines
// TORCH_EXTENSION_NAME; the module must be named after it.

#include <Python.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <exception>

#define CUDAMEM_STR2(x) #x
#define CUDAMEM_STR(x) CUDAMEM_STR2(x)
#define CUDAMEM_CAT2(a, b) a##b
#define CUDAMEM_CAT(a, b) CUDAMEM_CAT2(a, b)

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

PyObject* read_counters(PyObject* arg, bool reset_peak) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  if (device < 0 || device > 127) {
    PyErr_Format(PyExc_ValueError, "device must be in 0..127, got %ld", device);
    return nullptr;
  }
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t peak = 0;
  try {
    const auto index = static_cast<c10::DeviceIndex>(device);
    const auto stats = alloc::getDeviceStats(index);
    allocated = stats.allocated_bytes[0].current;
    reserved = stats.reserved_bytes[0].current;
    peak = stats.allocated_bytes[0].peak;
    if (reset_peak) {
      alloc::resetPeakStats(index);
    }
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "the CUDA caching allocator raised");
    return nullptr;
  }
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) {
    return nullptr;
  }
  const int64_t values[3] = {allocated, reserved, peak};
  for (Py_ssize_t i = 0; i < 3; ++i) {
    PyObject* item = PyLong_FromLongLong(static_cast<long long>(values[i]));
    if (item == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, i, item);
  }
  return result;
}

PyObject* counters(PyObject* /*module*/, PyObject* device) {
  return read_counters(device, false);
}

PyObject* counters_reset_peak(PyObject* /*module*/, PyObject* device) {
  return read_counters(device, true);
}

PyMethodDef methods[] = {
    {"counters",
     counters,
     METH_O,
     "counters(device) -> (allocated, reserved, peak_allocated) bytes of the 'all' pool"},
    {"counters_reset_peak",
     counters_reset_peak,
     METH_O,
     "counters_reset_peak(device) -> the counters, read before resetting the peak"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    CUDAMEM_STR(TORCH_EXTENSION_NAME),
    "cudamem's C++ reader of the CUDA caching allocator's counters",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

} // namespace

PyMODINIT_FUNC CUDAMEM_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&module_def);
}
