// cudamem's C++ counter reader: three integers of one device's CUDA caching allocator, and
// the per-module profile's backward gates.
//
// torch._C._cuda_memoryStats builds 39 dicts of 122 ints per call (~11 us); spans need three
// numbers: allocated, reserved and peak-allocated bytes of the "all" pool (StatType::AGGREGATE,
// index 0 in every PyTorch release), exactly what memory_stats() reports as
// allocated_bytes.all.current, reserved_bytes.all.current and allocated_bytes.all.peak.
//
// Gates (cudamem/modules.py): a C++ pre-hook on an autograd node reads the counters when the
// node is about to run, with no GIL and no Python, and appends (tag, allocated, peak, ns) to
// one log. A Python pre-hook costs the engine the GIL and a Python tuple of the gradients
// (about 20 us a node on an H200); this one costs a counter read. Each event resets the peak,
// so an event's peak is the highest allocated since the event before it; what a gate's reset
// discards is kept (``discarded``) and merged into the next read from Python, so that the
// spans, which reset the peak themselves, see every byte of it. While a log is on, the
// Python reads that reset the peak are logged too (tag -1): the log's intervals tile time.
//
// Plain CPython C API (no pybind11 of our own) so that a call costs ~0.2 us. Built by
// cudamem/_fastread.py with torch.utils.cpp_extension.load_inline, which defines
// TORCH_EXTENSION_NAME; the module must be named after it.

#include <Python.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>

#ifdef CUDAMEM_STUB_ALLOCATOR
// A build without CUDA headers (a syntax check on a CPU machine): counters set by hand.
namespace cudamem_stub {
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
};
struct DeviceStats {
  Stat allocated_bytes[3];
  Stat reserved_bytes[3];
};
inline DeviceStats stats;
inline DeviceStats getDeviceStats(c10::DeviceIndex /*device*/) {
  return stats;
}
inline void resetPeakStats(c10::DeviceIndex /*device*/) {
  stats.allocated_bytes[0].peak = stats.allocated_bytes[0].current;
}
} // namespace cudamem_stub
#else
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#define CUDAMEM_STR2(x) #x
#define CUDAMEM_STR(x) CUDAMEM_STR2(x)
#define CUDAMEM_CAT2(a, b) a##b
#define CUDAMEM_CAT(a, b) CUDAMEM_CAT2(a, b)

namespace {

#ifdef CUDAMEM_STUB_ALLOCATOR
namespace alloc = cudamem_stub;
#else
namespace alloc = c10::cuda::CUDACachingAllocator;
#endif

constexpr long kDevices = 128;
// Events a log keeps before it drops the rest (and counts them): 32 bytes each, 128 MiB.
constexpr size_t kMaxEvents = size_t(1) << 22;

struct Event {
  int64_t tag;
  int64_t allocated;
  int64_t peak;
  int64_t ns;
};

// Everything below is guarded by `mutex`: gates run on the autograd engine's device threads
// without the GIL, reads on Python threads with it.
std::mutex mutex;
std::vector<Event> events;
int64_t session = 0;  // the log that is on (0: none)
int64_t sessions = 0; // logs started so far
int64_t dropped = 0;  // events past kMaxEvents, this log
bool armed = false;   // a gate logged since the last drain: reads from Python are logged too
int64_t discarded[kDevices] = {};

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts); // time.perf_counter_ns's clock on Linux
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void log_event(int64_t tag, int64_t allocated, int64_t peak) {
  if (events.size() >= kMaxEvents) {
    ++dropped;
    return;
  }
  events.push_back(Event{tag, allocated, peak, now_ns()});
}

// One gate's read: with `mutex` held, for the log `owner` only (a gate of an earlier log, on
// a graph kept alive, does nothing, not even a reset).
void gate_read(int64_t tag, int64_t owner, c10::DeviceIndex device) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex);
    if (owner != session) {
      return;
    }
    const auto stats = alloc::getDeviceStats(device);
    const int64_t peak = stats.allocated_bytes[0].peak;
    alloc::resetPeakStats(device);
    int64_t& kept = discarded[device];
    kept = std::max(kept, peak);
    armed = true;
    log_event(tag, stats.allocated_bytes[0].current, peak);
  } catch (...) {
    // A read that fails loses this edge (the Python side ends an unmatched call at the
    // backward's end); it never breaks the user's backward.
  }
}

struct GateHook final : torch::autograd::FunctionPreHook {
  GateHook(int64_t tag, int64_t owner, int64_t step, c10::DeviceIndex device)
      : tag(tag), owner(owner), step(step), device(device) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    gate_read(tag, owner, device);
    return grads;
  }

  const int64_t tag;
  const int64_t owner;
  const int64_t step;
  const c10::DeviceIndex device;
};

// The node behind a grad_fn's pointer: torch keeps it as a shared, weak or intrusive pointer
// depending on the release.
template <class T>
auto strong(const std::weak_ptr<T>& p) {
  return p.lock();
}
template <class T>
auto strong(const c10::weak_intrusive_ptr<T>& p) {
  return p.lock();
}
template <class P>
const P& strong(const P& p) {
  return p;
}

// The node's gate of (owner, step), put there now with `tag` if it has none: its tag, or -1
// when the pointer holds no node. The gate lives on the node (nothing Python does), so a
// graph's release on the engine's thread needs no GIL for it.
template <class P>
int64_t add_gate(const P& pointer, int64_t tag, int64_t owner, int64_t step,
                 c10::DeviceIndex device) {
  const auto& node = strong(pointer);
  if (!node) {
    return -1;
  }
  for (const auto& hook : node->pre_hooks()) {
    const auto* gate = dynamic_cast<const GateHook*>(hook.get());
    if (gate != nullptr && gate->owner == owner && gate->step == step) {
      return gate->tag;
    }
  }
  node->add_pre_hook(std::make_unique<GateHook>(tag, owner, step, device));
  return tag;
}

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
        log_event(-1, allocated, raw_peak);
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

long device_arg(PyObject* arg) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred() != nullptr) {
    return -1;
  }
  if (device < 0 || device >= kDevices) {
    PyErr_Format(PyExc_ValueError, "device must be in 0..127, got %ld", device);
    return -1;
  }
  return device;
}

// gate(grad_fn, tag, owner, step, device) -> int: the node's gate for (owner, step), a C++
// pre-hook logging `tag` put there now if it has none: its tag; -1 when `grad_fn` is no
// autograd node this build can reach.
PyObject* gate(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "gate(grad_fn, tag, owner, step, device) takes 5 arguments");
    return nullptr;
  }
  long long ints[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    ints[i] = PyLong_AsLongLong(args[i + 1]);
    if (ints[i] == -1 && PyErr_Occurred() != nullptr) {
      return nullptr;
    }
  }
  const long device = device_arg(args[4]);
  if (device == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  PyObject* fn = args[0];
  int64_t found = -1;
  try {
    const auto index = static_cast<c10::DeviceIndex>(device);
    if (torch::autograd::THPCppFunction_Check(fn)) {
      found = add_gate(reinterpret_cast<torch::autograd::THPCppFunction*>(fn)->cdata, ints[0],
                       ints[1], ints[2], index);
    } else if (THPFunction_Check(fn)) {
      found = add_gate(reinterpret_cast<THPFunction*>(fn)->cdata, ints[0], ints[1], ints[2],
                       index);
    }
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
  return PyLong_FromLongLong(static_cast<long long>(found));
}

// log_start() -> owner: a new log (the previous one's events are dropped).
PyObject* log_start(PyObject* /*module*/, PyObject* /*unused*/) {
  std::lock_guard<std::mutex> lock(mutex);
  session = ++sessions;
  events.clear();
  dropped = 0;
  armed = false;
  return PyLong_FromLongLong(session);
}

// log_stop(owner): the log ends (its gates do nothing from here); a no-op for another log.
PyObject* log_stop(PyObject* /*module*/, PyObject* arg) {
  const long long owner = PyLong_AsLongLong(arg);
  if (owner == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (owner == session) {
    session = 0;
    events.clear();
    events.shrink_to_fit();
    dropped = 0;
    armed = false;
  }
  Py_RETURN_NONE;
}

// log_drain(owner) -> (events, dropped): the log's events so far, as one flat tuple of
// (tag, allocated, peak, ns) quadruples, and how many it dropped; both emptied.
PyObject* log_drain(PyObject* /*module*/, PyObject* arg) {
  const long long owner = PyLong_AsLongLong(arg);
  if (owner == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  std::vector<Event> taken;
  int64_t lost = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (owner == session) {
      taken.swap(events);
      lost = dropped;
      dropped = 0;
      armed = false;
    }
  }
  PyObject* flat = PyTuple_New(static_cast<Py_ssize_t>(taken.size() * 4));
  if (flat == nullptr) {
    return nullptr;
  }
  Py_ssize_t i = 0;
  for (const Event& e : taken) {
    const int64_t values[4] = {e.tag, e.allocated, e.peak, e.ns};
    for (int64_t v : values) {
      PyObject* item = PyLong_FromLongLong(static_cast<long long>(v));
      if (item == nullptr) {
        Py_DECREF(flat);
        return nullptr;
      }
      PyTuple_SET_ITEM(flat, i++, item);
    }
  }
  return Py_BuildValue("(NL)", flat, static_cast<long long>(lost));
}

// mark(owner, device, tag): an event now, as a gate would log it (the end of a backward, or
// the gate of a node the C++ hook cannot reach, from a Python hook).
PyObject* mark(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "mark(owner, device, tag) takes 3 arguments");
    return nullptr;
  }
  const long long tag = PyLong_AsLongLong(args[2]);
  if (tag == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  const long long owner = PyLong_AsLongLong(args[0]);
  if (owner == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  const long device = device_arg(args[1]);
  if (device == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  gate_read(tag, owner, static_cast<c10::DeviceIndex>(device));
  Py_RETURN_NONE;
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

PyMethodDef methods[] = {
    {"counters",
     counters,
     METH_O,
     "counters(device) -> (allocated, reserved, peak_allocated) bytes of the 'all' pool"},
    {"counters_reset_peak",
     counters_reset_peak,
     METH_O,
     "counters_reset_peak(device) -> the counters, read before resetting the peak"},
    {"gate",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(gate)),
     METH_FASTCALL,
     "gate(grad_fn, tag, owner, step, device) -> the node's gate's tag (-1: no node)"},
    {"log_start", log_start, METH_NOARGS, "log_start() -> owner: a new gate log"},
    {"log_stop", log_stop, METH_O, "log_stop(owner): the gate log ends"},
    {"log_drain", log_drain, METH_O, "log_drain(owner) -> (flat events, dropped)"},
    {"mark",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mark)),
     METH_FASTCALL,
     "mark(owner, device, tag): a gate event now"},
#ifdef CUDAMEM_STUB_ALLOCATOR
    {"stub_set", stub_set, METH_VARARGS, "stub_set(allocated, peak)"},
#endif
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
