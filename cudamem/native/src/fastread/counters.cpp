// The counter reads: allocated, reserved and peak bytes of a device's "all" pool, with or
// without a peak reset (and the stub allocator's setter for CPU tests; see fastread.h).

#include "fastread.h"

namespace {

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
    std::lock_guard<std::mutex> lock(mutex);
    const auto stats = alloc::getDeviceStats(index);
    allocated = stats.allocated_bytes[0].current;
    reserved = stats.reserved_bytes[0].current;
    const int64_t raw_peak = stats.allocated_bytes[0].peak;
    // What gates' resets discarded since the last reset from here is part of this peak.
    peak = std::max(raw_peak, discarded[index]);
    if (reset_peak) {
      alloc::resetPeakStats(index);
      discarded[index] = 0;
      if (armed) {
        log_event(-1, allocated, raw_peak, now_ns());
      }
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

#ifdef CUDAMEM_STUB_ALLOCATOR
// stub_set(allocated, peak): the stub's counters (CPU tests of the gates).
PyObject* stub_set(PyObject* /*module*/, PyObject* args) {
  long long allocated = 0;
  long long peak = 0;
  if (!PyArg_ParseTuple(args, "LL", &allocated, &peak)) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mutex);
  alloc::stats.allocated_bytes[0].current = allocated;
  alloc::stats.allocated_bytes[0].peak = std::max(
      static_cast<int64_t>(peak), alloc::stats.allocated_bytes[0].peak);
  Py_RETURN_NONE;
}
#endif

} // namespace
