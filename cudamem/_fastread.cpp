// cudamem's C++ counter reader: three integers of one device's CUDA caching allocator, and
// the per-module profile's backward gates.
//
// torch._C._cuda_memoryStats builds 39 dicts of 122 ints per call (~11 us); spans need three
// numbers: allocated, reserved and peak-allocated bytes of the "all" pool (StatType::AGGREGATE,
// index 0 in every PyTorch release), exactly what memory_stats() reports as
// allocated_bytes.all.current, reserved_bytes.all.current and allocated_bytes.all.peak.
//
// Gates (cudamem/modules.py): one log of counter events per module profile. A C++ pre-hook
// on an autograd node (a gate) reads the counters when the node is about to run, with no GIL
// and no Python, and appends (code, allocated, peak, ns) to the log for each module-call edge
// registered at that node (a call's backward starting or ending there); the forward hooks log
// a call's entry and exit the same way (``mark``). A Python pre-hook costs the engine the GIL
// and a Python tuple of the gradients (about 20 us a node on an H200); a gate costs a counter
// read. Each event resets the peak, so an event's peak is the highest allocated since the
// event before it; what an event's reset discards is kept (``discarded``) and merged into the
// next read from Python, so that the spans, which reset the peak themselves, see every byte of
// it. While a log is on, the Python reads that reset the peak are logged too (tag -1): the
// log's intervals tile time, and its replay gives each call the figures a span would, added
// up per module slot here (a forward's entry event carries its slot and the forward it runs
// in), so that Python takes one record per module per step (``log_figures``), none per call.
//
// Plain CPython C API (no pybind11 of our own) so that a call costs ~0.2 us. Built by
// cudamem/_fastread.py with torch.utils.cpp_extension.load_inline, which defines
// TORCH_EXTENSION_NAME; the module must be named after it.

#include <Python.h>

#include <structmember.h>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

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
#include <array>
#include <cstdint>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_set>
#include <utility>
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
// Events a log keeps before it drops the rest (and counts them): 32 bytes each, 128 MiB
// (a test build sets fewer).
#ifndef CUDAMEM_MAX_EVENTS
#define CUDAMEM_MAX_EVENTS (size_t(1) << 22)
#endif
constexpr size_t kMaxEvents = CUDAMEM_MAX_EVENTS;

struct Event {
  int64_t tag;
  int64_t allocated;
  int64_t peak;
  int64_t ns;
  int64_t meta;   // a forward's entry: its module's slot times two plus 1 if it is a
                  // recomputation (-1: none given); else -1
  int64_t parent; // a forward's entry: the call of the forward it runs in (-1: none)
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

// The replay's state (``log_replay``), touched only from Python (the GIL held): the calls whose
// forward or backward is open, outermost first, and the forwards Python dropped unfinished.
struct Open {
  int64_t call;
  bool forward;
  int64_t peak;  // the highest allocated since it opened
  int64_t start; // allocated when it opened
  int64_t ns;
  int64_t slot;    // its module's slot (-1: not given)
  bool recompute;  // a forward run inside a backward (activation checkpointing)
  int64_t parent;  // the forward it runs in (-1: none)
  int64_t child;   // bytes kept by the forwards that ran in it (not recomputations)
};
std::vector<Open> open_calls;
std::unordered_set<int64_t> dropped_forwards;

// A module's figures in the step in progress, added up by the replay (the order of
// module_profile.STEP_FIELDS: forward calls, kept, self-kept, forward peak, forward ns,
// backward calls, backward delta, backward peak, backward ns, recomputations, recomputed).
enum Field : size_t {
  kCalls,
  kKept,
  kSelf,
  kForwardPeak,
  kForwardNs,
  kBackwardCalls,
  kBackwardDelta,
  kBackwardPeak,
  kBackwardNs,
  kRecalls,
  kRekept,
  kFields
};
using Figures = std::array<int64_t, kFields>;
std::vector<Figures> figures;  // by slot
std::vector<int64_t> touched;  // slots with figures this step, in the order first touched
std::vector<char> is_touched;  // by slot
// The slot of each call from its forward's entry (its backward adds to it), calls numbered
// from `slots_base`.
std::vector<int64_t> call_slots;
int64_t slots_base = 0;

void clear_replay() {
  open_calls.clear();
  dropped_forwards.clear();
  figures.clear();
  touched.clear();
  is_touched.clear();
  call_slots.clear();
  slots_base = 0;
}

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts); // time.perf_counter_ns's clock on Linux
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void log_event(int64_t tag, int64_t allocated, int64_t peak, int64_t ns, int64_t meta = -1,
               int64_t parent = -1) {
  if (events.size() >= kMaxEvents) {
    ++dropped;
    return;
  }
  events.push_back(Event{tag, allocated, peak, ns, meta, parent});
}

// One read for `owner`'s log, `mutex` held by the caller: the counters, the peak reset (what
// it discards kept for Python's next read), one event per code (`code(i)`, i < count). The
// first event has the peak since the event before it; the others, logged at the same instant,
// the current level. A gate of an earlier log (on a graph kept alive) does nothing, not even a
// reset. `meta` and `parent` go with the first code (a forward's entry).
template <class Code>
void read_locked(const Code& code, size_t count, int64_t owner, c10::DeviceIndex device,
                 int64_t meta = -1, int64_t parent = -1) noexcept {
  try {
    if (owner != session || count == 0) {
      return;
    }
    const auto stats = alloc::getDeviceStats(device);
    const int64_t current = stats.allocated_bytes[0].current;
    const int64_t peak = stats.allocated_bytes[0].peak;
    alloc::resetPeakStats(device);
    int64_t& kept = discarded[device];
    kept = std::max(kept, peak);
    armed = true;
    const int64_t ns = now_ns();
    log_event(code(0), current, peak, ns, meta, parent);
    for (size_t i = 1; i < count; ++i) {
      log_event(code(i), current, current, ns);
    }
  } catch (...) {
    // A read that fails loses these edges (the Python side ends an unmatched call at the
    // backward's end); it never breaks the user's backward.
  }
}

// The same with `mutex` taken here, for one code.
void gate_read(int64_t code, int64_t owner, c10::DeviceIndex device, int64_t meta = -1,
               int64_t parent = -1) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex);
    read_locked([code](size_t) { return code; }, 1, owner, device, meta, parent);
  } catch (...) {
    // as above: a lock that fails loses the edge
  }
}

// A node's gate for one log: the codes of the module-call edges at this node (a call's
// backward starting or ending there), in the order they were added, each with the step it
// was added in; a code is dropped once two steps old (its call's record is gone by then).
struct GateHook final : torch::autograd::FunctionPreHook {
  GateHook(int64_t owner, c10::DeviceIndex device) : owner(owner), device(device) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    try {
      std::lock_guard<std::mutex> lock(mutex); // Python adds codes holding it
      read_locked([this](size_t i) { return codes[i].first; }, codes.size(), owner, device);
    } catch (...) {
      // as in read_locked: the edges are lost, the backward goes on
    }
    return grads;
  }

  const int64_t owner;
  const c10::DeviceIndex device;
  std::vector<std::pair<int64_t, int64_t>> codes; // (code, step), guarded by `mutex`
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

// Add `code` to the node's gate for `owner` (put there now if it has none): whether the
// pointer holds a node. The gate lives on the node (nothing Python does), so a graph's release
// on the engine's thread needs no GIL for it.
template <class P>
bool add_gate(const P& pointer, int64_t code, int64_t owner, int64_t step,
              c10::DeviceIndex device) {
  const auto& node = strong(pointer);
  if (!node) {
    return false;
  }
  GateHook* found = nullptr;
  for (const auto& hook : node->pre_hooks()) {
    auto* gate = dynamic_cast<GateHook*>(hook.get());
    if (gate != nullptr && gate->owner == owner) {
      found = gate;
      break;
    }
  }
  if (found == nullptr) {
    auto made = std::make_unique<GateHook>(owner, device);
    found = made.get();
    node->add_pre_hook(std::move(made));
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto& codes = found->codes;
  codes.erase(std::remove_if(codes.begin(), codes.end(),
                             [step](const std::pair<int64_t, int64_t>& c) {
                               return c.second < step - 1;
                             }),
              codes.end());
  codes.emplace_back(code, step);
  return true;
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

// ---- The forward hooks' fast path (cudamem/modules.py) --------------------------------------
//
// A module call's forward pre- and post-hook, in C: what ModuleProfiler._pre and _post do for
// a call inside another one while the C++ log serves (the module's entry and exit marked, its
// backward's gates added), with no Python frame; everything else (a top-level call, where steps
// begin and end; the span path; an exception; an entry Python made) is handed to them. A thin
// Python hook calls in, after torch.compiler.is_compiling() (dynamo traces that, not this).
// The stack is the profiler's list of open forwards, each a list in the order of modules.py
// (node, span, in backward, child, source, task, call, parent).

enum EntryField : Py_ssize_t { kNode, kSpan, kInBackward, kChild, kSource, kTask, kCall, kParent,
                               kEntryFields };

// How a tensor holds its grad_fn (a shared or an intrusive pointer, depending on the release).
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// An autograd node held from C++: where a call's backward ends (its first grad-requiring
// input's grad_fn, taken at its forward's entry), with no Python grad_fn object made for it.
struct NodeRefObject {
  PyObject_HEAD
  NodePtr node;
};

void noderef_dealloc(PyObject* self) {
  reinterpret_cast<NodeRefObject*>(self)->node.~NodePtr();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject NodeRefType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* make_noderef(NodePtr node) {
  auto* ref = PyObject_New(NodeRefObject, &NodeRefType);
  if (ref == nullptr) {
    return nullptr;
  }
  new (&ref->node) NodePtr(std::move(node));
  return reinterpret_cast<PyObject*>(ref);
}

struct ForwardObject {
  PyObject_HEAD
  PyObject* stack;       // the profiler's open forwards (a list)
  PyObject* slow_pre;    // ModuleProfiler._pre(node, module, args, kwargs)
  PyObject* slow_post;   // ModuleProfiler._post(node, module, args, output)
  PyObject* grad_tensor; // modules._grad_tensor(value, depth)
  long long owner;       // the C++ log (0: none, every call goes to Python)
  long long device;
  long long step;        // the step gates added now belong to
  long long next;        // the next call's number
  char paused;
};

PyObject* slot_name = nullptr; // "slot", interned

// The first tensor in `value` that requires grad, looking two levels deep, as
// modules._grad_tensor finds it (a new reference: the tensor or None; nullptr on an error).
// Tensors, exact tuples, lists and dicts and plain scalars are read here; anything else (a
// tensor subclass, a ModelOutput, another Mapping) is asked of the Python function.
PyObject* grad_in(ForwardObject* self, PyObject* value, int depth) {
  if (THPVariable_CheckExact(value)) {
    if (THPVariable_Unpack(value).requires_grad()) {
      Py_INCREF(value);
      return value;
    }
    Py_RETURN_NONE;
  }
  if (value == Py_None || PyLong_CheckExact(value) || PyBool_Check(value) ||
      PyFloat_CheckExact(value) || PyUnicode_CheckExact(value)) {
    Py_RETURN_NONE;
  }
  const bool seq = PyTuple_CheckExact(value) || PyList_CheckExact(value);
  if (seq || PyDict_CheckExact(value)) {
    if (depth >= 2) {
      Py_RETURN_NONE;
    }
    if (seq) {
      PyObject* fast = PySequence_Fast(value, "");
      if (fast == nullptr) {
        return nullptr;
      }
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* found = grad_in(self, PySequence_Fast_GET_ITEM(fast, i), depth + 1);
        if (found != Py_None) {
          Py_DECREF(fast);
          return found;
        }
        Py_DECREF(found);
      }
      Py_DECREF(fast);
      Py_RETURN_NONE;
    }
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* item = nullptr;
    while (PyDict_Next(value, &pos, &key, &item)) {
      Py_INCREF(item); // a value's own code could change the dict
      PyObject* found = grad_in(self, item, depth + 1);
      Py_DECREF(item);
      if (found != Py_None) {
        return found;
      }
      Py_DECREF(found);
    }
    Py_RETURN_NONE;
  }
  PyObject* depth_obj = PyLong_FromLong(depth);
  if (depth_obj == nullptr) {
    return nullptr;
  }
  PyObject* call_args[2] = {value, depth_obj};
  PyObject* found = PyObject_Vectorcall(self->grad_tensor, call_args, 2, nullptr);
  Py_DECREF(depth_obj);
  return found;
}

// The grad_fn of `tensor` (a tensor, or None: none), or none.
NodePtr grad_fn_of(PyObject* tensor) {
  if (tensor == Py_None || !THPVariable_Check(tensor)) {
    return nullptr;
  }
  return THPVariable_Unpack(tensor).grad_fn();
}

PyObject* forward_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"stack",  "pre",    "post", "grad_tensor",
                                "owner",  "device", nullptr};
  PyObject* stack = nullptr;
  PyObject* pre = nullptr;
  PyObject* post = nullptr;
  PyObject* grad_tensor = nullptr;
  long long owner = 0;
  long long device = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOLL", const_cast<char**>(names),
                                   &PyList_Type, &stack, &pre, &post, &grad_tensor, &owner,
                                   &device)) {
    return nullptr;
  }
  if (device < 0 || device >= kDevices) {
    PyErr_Format(PyExc_ValueError, "device must be in 0..127, got %lld", device);
    return nullptr;
  }
  auto* self = reinterpret_cast<ForwardObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) {
    return nullptr;
  }
  Py_INCREF(stack);
  Py_INCREF(pre);
  Py_INCREF(post);
  Py_INCREF(grad_tensor);
  self->stack = stack;
  self->slow_pre = pre;
  self->slow_post = post;
  self->grad_tensor = grad_tensor;
  self->owner = owner;
  self->device = device;
  self->step = 0;
  self->next = 0;
  self->paused = 0;
  return reinterpret_cast<PyObject*>(self);
}

int forward_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ForwardObject*>(obj);
  Py_VISIT(self->stack);
  Py_VISIT(self->slow_pre);
  Py_VISIT(self->slow_post);
  Py_VISIT(self->grad_tensor);
  return 0;
}

int forward_clear(PyObject* obj) {
  auto* self = reinterpret_cast<ForwardObject*>(obj);
  self->owner = 0; // no log once its references are gone
  Py_CLEAR(self->stack);
  Py_CLEAR(self->slow_pre);
  Py_CLEAR(self->slow_post);
  Py_CLEAR(self->grad_tensor);
  return 0;
}

void forward_dealloc(PyObject* obj) {
  PyObject_GC_UnTrack(obj);
  forward_clear(obj);
  Py_TYPE(obj)->tp_free(obj);
}

bool forward_ready(ForwardObject* self) {
  return self->owner != 0 && self->stack != nullptr;
}

// pre(node, module, args, kwargs): a module call's forward begins.
PyObject* forward_pre(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ForwardObject*>(obj);
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "pre(node, module, args, kwargs) takes 4 arguments");
    return nullptr;
  }
  if (self->paused) {
    Py_RETURN_NONE;
  }
  if (!forward_ready(self) || PyList_GET_SIZE(self->stack) == 0) {
    if (self->slow_pre == nullptr) {
      Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(self->slow_pre, args, 4, nullptr);
  }
  PyObject* node = args[0];
  PyObject* call_args = args[2];
  PyObject* kwargs = args[3];
  try {
    const bool in_backward = torch::autograd::get_current_graph_task_id() != -1;
    PyObject* source = Py_None;
    Py_INCREF(source);
    if (!in_backward && c10::GradMode::is_enabled()) {
      PyObject* found = grad_in(self, call_args, 0);
      if (found == Py_None && kwargs != Py_None && PyDict_Check(kwargs) &&
          PyDict_GET_SIZE(kwargs) > 0) {
        Py_DECREF(found);
        found = grad_in(self, kwargs, 0);
      }
      if (found == nullptr) {
        Py_DECREF(source);
        return nullptr;
      }
      auto fn = grad_fn_of(found);
      Py_DECREF(found);
      if (fn) {
        Py_DECREF(source);
        source = make_noderef(std::move(fn));
        if (source == nullptr) {
          return nullptr;
        }
      }
    }
    PyObject* slot_obj = PyObject_GetAttr(node, slot_name);
    if (slot_obj == nullptr) {
      Py_DECREF(source);
      return nullptr;
    }
    const long long slot = PyLong_AsLongLong(slot_obj);
    Py_DECREF(slot_obj);
    // The search can run Python (a Mapping's values()): the profile may have stopped or its
    // open forwards been dropped meanwhile.
    if (!forward_ready(self)) {
      Py_DECREF(source);
      Py_RETURN_NONE;
    }
    if (PyList_GET_SIZE(self->stack) == 0) {
      Py_DECREF(source);
      return PyObject_Vectorcall(self->slow_pre, args, 4, nullptr);
    }
    PyObject* parent = PyList_GET_ITEM(self->stack, PyList_GET_SIZE(self->stack) - 1);
    long long parent_call = -1;
    if (PyList_Check(parent) && PyList_GET_SIZE(parent) == kEntryFields) {
      parent_call = PyLong_AsLongLong(PyList_GET_ITEM(parent, kCall));
    }
    if ((slot == -1 || parent_call == -1) && PyErr_Occurred() != nullptr) {
      Py_DECREF(source);
      return nullptr;
    }
    const long long call = self->next;
    PyObject* entry = PyList_New(kEntryFields);
    PyObject* zero = PyLong_FromLong(0);
    PyObject* no_task = PyLong_FromLong(-1);
    PyObject* call_obj = PyLong_FromLongLong(call);
    if (entry == nullptr || zero == nullptr || no_task == nullptr || call_obj == nullptr) {
      Py_XDECREF(entry);
      Py_XDECREF(zero);
      Py_XDECREF(no_task);
      Py_XDECREF(call_obj);
      Py_DECREF(source);
      return nullptr;
    }
    Py_INCREF(node);
    Py_INCREF(Py_None);
    PyObject* flag = in_backward ? Py_True : Py_False;
    Py_INCREF(flag);
    Py_INCREF(parent);
    PyList_SET_ITEM(entry, kNode, node);
    PyList_SET_ITEM(entry, kSpan, Py_None);
    PyList_SET_ITEM(entry, kInBackward, flag);
    PyList_SET_ITEM(entry, kChild, zero);
    PyList_SET_ITEM(entry, kSource, source);
    PyList_SET_ITEM(entry, kTask, no_task);
    PyList_SET_ITEM(entry, kCall, call_obj);
    PyList_SET_ITEM(entry, kParent, parent);
    const int appended = PyList_Append(self->stack, entry);
    Py_DECREF(entry);
    if (appended != 0) {
      return nullptr;
    }
    self->next = call + 1;
    const int64_t code = call * 4; // its forward's entry, its slot, the forward it runs in
    gate_read(code, self->owner, static_cast<c10::DeviceIndex>(self->device),
              slot * 2 + (in_backward ? 1 : 0), parent_call);
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// post(node, module, args, output): a module call's forward returned.
PyObject* forward_post(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ForwardObject*>(obj);
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "post(node, module, args, output) takes 4 arguments");
    return nullptr;
  }
  PyObject* node = args[0];
  PyObject* output = args[3];
  const Py_ssize_t open = forward_ready(self) ? PyList_GET_SIZE(self->stack) : 0;
  PyObject* entry = open >= 2 ? PyList_GET_ITEM(self->stack, open - 1) : nullptr;
  // Python's: a top-level call, an exception (no output), another module's forward on top,
  // a span's call or one whose source Python took.
  if (entry == nullptr || output == Py_None || !PyList_Check(entry) ||
      PyList_GET_SIZE(entry) != kEntryFields || PyList_GET_ITEM(entry, kNode) != node ||
      (PyList_GET_ITEM(entry, kSource) != Py_None &&
       Py_TYPE(PyList_GET_ITEM(entry, kSource)) != &NodeRefType)) {
    if (self->slow_post == nullptr) {
      Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(self->slow_post, args, 4, nullptr);
  }
  const long long call = PyLong_AsLongLong(PyList_GET_ITEM(entry, kCall));
  if (call == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  if (call < 0) {
    return PyObject_Vectorcall(self->slow_post, args, 4, nullptr);
  }
  Py_INCREF(entry);
  if (PyList_SetSlice(self->stack, open - 1, open, nullptr) != 0) {
    Py_DECREF(entry);
    return nullptr;
  }
  try {
    const auto device = static_cast<c10::DeviceIndex>(self->device);
    const int64_t exit_code = call * 4 + 1;
    gate_read(exit_code, self->owner, device);
    if (PyList_GET_ITEM(entry, kInBackward) != Py_True) {
      PyObject* out = grad_in(self, output, 0);
      if (out == nullptr) {
        Py_DECREF(entry);
        return nullptr;
      }
      auto start = grad_fn_of(out);
      Py_DECREF(out);
      if (start) {
        PyObject* source = PyList_GET_ITEM(entry, kSource);
        NodePtr end;
        if (source != Py_None) {
          end = reinterpret_cast<NodeRefObject*>(source)->node;
        }
        Py_INCREF(Py_None); // the record outlives the forward: no node in it
        PyList_SetItem(entry, kSource, Py_None);
        add_gate(start, call * 4 + 2, self->owner, self->step, device); // its backward's start
        if (end) {
          add_gate(end, call * 4 + 3, self->owner, self->step, device); // its end
        }
      }
    }
  } catch (const std::exception& exc) {
    Py_DECREF(entry);
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
  Py_DECREF(entry);
  Py_RETURN_NONE;
}

PyMethodDef forward_methods[] = {
    {"pre",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward_pre)),
     METH_FASTCALL,
     "pre(node, module, args, kwargs): a module call's forward begins"},
    {"post",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward_post)),
     METH_FASTCALL,
     "post(node, module, args, output): a module call's forward returned"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef forward_members[] = {
    {"owner", T_LONGLONG, offsetof(ForwardObject, owner), 0,
     "the C++ log the calls go to (0: none, Python's hooks take every call)"},
    {"device", T_LONGLONG, offsetof(ForwardObject, device), READONLY, "the log's device"},
    {"step", T_LONGLONG, offsetof(ForwardObject, step), 0,
     "the step the gates added now belong to"},
    {"next", T_LONGLONG, offsetof(ForwardObject, next), 0, "the next call's number"},
    {"paused", T_BOOL, offsetof(ForwardObject, paused), 0,
     "whether calls are left out (ModuleProfiler.pause)"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject ForwardType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool ready_types(PyObject* module) {
  NodeRefType.tp_name = CUDAMEM_STR(TORCH_EXTENSION_NAME) ".NodeRef";
  NodeRefType.tp_basicsize = sizeof(NodeRefObject);
  NodeRefType.tp_dealloc = noderef_dealloc;
  NodeRefType.tp_flags = Py_TPFLAGS_DEFAULT;
  NodeRefType.tp_doc = "An autograd node held from C++ (where a module call's backward ends)";
  ForwardType.tp_name = CUDAMEM_STR(TORCH_EXTENSION_NAME) ".Forward";
  ForwardType.tp_basicsize = sizeof(ForwardObject);
  ForwardType.tp_dealloc = forward_dealloc;
  ForwardType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  ForwardType.tp_doc =
      "Forward(stack, pre, post, grad_tensor, owner, device): a module profile's forward "
      "hooks in C";
  ForwardType.tp_traverse = forward_traverse;
  ForwardType.tp_clear = forward_clear;
  ForwardType.tp_methods = forward_methods;
  ForwardType.tp_members = forward_members;
  ForwardType.tp_new = forward_new;
  if (PyType_Ready(&NodeRefType) < 0 || PyType_Ready(&ForwardType) < 0) {
    return false;
  }
  slot_name = PyUnicode_InternFromString("slot");
  if (slot_name == nullptr) {
    return false;
  }
  Py_INCREF(&ForwardType);
  if (PyModule_AddObject(module, "Forward", reinterpret_cast<PyObject*>(&ForwardType)) < 0) {
    Py_DECREF(&ForwardType);
    return false;
  }
  Py_INCREF(&NodeRefType);
  if (PyModule_AddObject(module, "NodeRef", reinterpret_cast<PyObject*>(&NodeRefType)) < 0) {
    Py_DECREF(&NodeRefType);
    return false;
  }
  return true;
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

// gate(grad_fn, code, owner, step, device) -> bool: `code` logged by the node's C++ gate for
// `owner` (put there now if it has none) whenever the node is about to run; False when
// `grad_fn` is no autograd node this build can reach. `grad_fn` may be a NodeRef.
PyObject* gate(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "gate(grad_fn, code, owner, step, device) takes 5 arguments");
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
  bool added = false;
  try {
    const auto index = static_cast<c10::DeviceIndex>(device);
    if (Py_TYPE(fn) == &NodeRefType) {
      added = add_gate(reinterpret_cast<NodeRefObject*>(fn)->node, ints[0], ints[1], ints[2],
                       index);
    } else if (torch::autograd::THPCppFunction_Check(fn)) {
      added = add_gate(reinterpret_cast<torch::autograd::THPCppFunction*>(fn)->cdata, ints[0],
                       ints[1], ints[2], index);
    } else if (THPFunction_Check(fn)) {
      added = add_gate(reinterpret_cast<THPFunction*>(fn)->cdata, ints[0], ints[1], ints[2],
                       index);
    }
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
  return PyBool_FromLong(added ? 1 : 0);
}

// A tuple of Python ints (nullptr with the error set when one cannot be made).
PyObject* int_tuple(const std::vector<int64_t>& values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(static_cast<long long>(values[i]));
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

// The codes of the node's gate for `owner`, in order ({} without one).
template <class P>
std::vector<int64_t> gate_codes(const P& pointer, int64_t owner) {
  std::vector<int64_t> out;
  const auto& node = strong(pointer);
  if (!node) {
    return out;
  }
  for (const auto& hook : node->pre_hooks()) {
    const auto* gate = dynamic_cast<const GateHook*>(hook.get());
    if (gate != nullptr && gate->owner == owner) {
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& c : gate->codes) {
        out.push_back(c.first);
      }
    }
  }
  return out;
}

// codes(grad_fn, owner) -> tuple: the codes the node's gate for `owner` logs, in order (what
// the tests see of the gates: one per node and log).
PyObject* codes(PyObject* /*module*/, PyObject* args) {
  PyObject* fn = nullptr;
  long long owner = 0;
  if (!PyArg_ParseTuple(args, "OL", &fn, &owner)) {
    return nullptr;
  }
  std::vector<int64_t> found;
  if (torch::autograd::THPCppFunction_Check(fn)) {
    found = gate_codes(reinterpret_cast<torch::autograd::THPCppFunction*>(fn)->cdata, owner);
  } else if (THPFunction_Check(fn)) {
    found = gate_codes(reinterpret_cast<THPFunction*>(fn)->cdata, owner);
  }
  return int_tuple(found);
}

// log_start() -> owner: a new log (the previous one's events are dropped).
PyObject* log_start(PyObject* /*module*/, PyObject* /*unused*/) {
  std::lock_guard<std::mutex> lock(mutex);
  session = ++sessions;
  events.clear();
  clear_replay();
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
    clear_replay();
    events.shrink_to_fit();
    dropped = 0;
    armed = false;
  }
  Py_RETURN_NONE;
}

// The events of log `owner` so far and how many it dropped, both emptied (the log disarmed);
// false for another log's owner.
bool take_events(int64_t owner, std::vector<Event>& taken, int64_t& lost) {
  std::lock_guard<std::mutex> lock(mutex);
  if (owner != session) {
    return false;
  }
  taken.swap(events);
  lost = dropped;
  dropped = 0;
  armed = false;
  return true;
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
  take_events(owner, taken, lost);
  std::vector<int64_t> values;
  values.reserve(taken.size() * 4);
  for (const Event& e : taken) {
    values.insert(values.end(), {e.tag, e.allocated, e.peak, e.ns});
  }
  PyObject* flat = int_tuple(values);
  if (flat == nullptr) {
    return nullptr;
  }
  return Py_BuildValue("(NL)", flat, static_cast<long long>(lost));
}

// `arg` as a long long into `out`; false with the Python error set when it is none.
bool int_arg(PyObject* arg, long long* out) {
  *out = PyLong_AsLongLong(arg);
  return !(*out == -1 && PyErr_Occurred() != nullptr);
}

// A log event's code: a module call's number times four plus its edge.
constexpr int64_t kForwardEnter = 0;
constexpr int64_t kForwardExit = 1;
constexpr int64_t kBackwardStart = 2;

// The figures of module slot `slot` in this step (made, and marked touched, on first use).
Figures& slot_figures(int64_t slot) {
  const auto index = static_cast<size_t>(slot);
  if (index >= figures.size()) {
    figures.resize(index + 1, Figures{});
    is_touched.resize(index + 1, 0);
  }
  if (is_touched[index] == 0) {
    is_touched[index] = 1;
    touched.push_back(slot);
  }
  return figures[index];
}

// The slot of `call` from its forward's entry (-1: unknown, or two steps old).
int64_t slot_of(int64_t call) {
  const int64_t i = call - slots_base;
  if (i < 0 || i >= static_cast<int64_t>(call_slots.size())) {
    return -1;
  }
  return call_slots[static_cast<size_t>(i)];
}

// Remember `call`'s slot (its backward adds to it); calls below `first` are forgotten.
void remember_slot(int64_t call, int64_t slot, int64_t first) {
  if (call_slots.empty()) {
    slots_base = call;
  } else if (first > slots_base) {
    const auto gone = static_cast<size_t>(
        std::min<int64_t>(first - slots_base, static_cast<int64_t>(call_slots.size())));
    call_slots.erase(call_slots.begin(), call_slots.begin() + static_cast<std::ptrdiff_t>(gone));
    slots_base += static_cast<int64_t>(gone);
    if (call_slots.empty()) {
      slots_base = call;
    }
  }
  const int64_t i = call - slots_base;
  if (i < 0) {
    return; // numbered below the calls kept: out of order, not counted
  }
  if (i >= static_cast<int64_t>(call_slots.size())) {
    call_slots.resize(static_cast<size_t>(i) + 1, -1);
  }
  call_slots[static_cast<size_t>(i)] = slot;
}

// End the call open at `open_calls[k]` at an event of `allocated` bytes and add its figures
// (allocated minus at its start, peak minus at its start, ns) to its module's, as
// modules.py adds a span's: a forward's kept bytes also count as its parent's children's.
// Its peak covers the calls opened inside it; it hands its own to the call below.
void close_open(size_t k, int64_t allocated, int64_t ns) {
  const Open entry = open_calls[k];
  int64_t peak = entry.peak;
  for (size_t j = k + 1; j < open_calls.size(); ++j) {
    peak = std::max(peak, open_calls[j].peak);
  }
  if (k > 0) {
    open_calls[k - 1].peak = std::max(open_calls[k - 1].peak, entry.peak);
  }
  open_calls.erase(open_calls.begin() + static_cast<std::ptrdiff_t>(k));
  const int64_t delta = allocated - entry.start;
  const int64_t top = peak - entry.start;
  const int64_t spent = ns - entry.ns;
  if (entry.forward && !entry.recompute && entry.parent >= 0) {
    for (size_t j = open_calls.size(); j > 0; --j) {
      Open& below = open_calls[j - 1];
      if (below.forward && below.call == entry.parent) {
        below.child += delta;
        break;
      }
    }
  }
  if (entry.slot < 0) {
    return;
  }
  Figures& f = slot_figures(entry.slot);
  if (!entry.forward) {
    f[kBackwardCalls] += 1;
    f[kBackwardDelta] += delta;
    f[kBackwardPeak] = std::max(f[kBackwardPeak], top);
    f[kBackwardNs] += spent;
  } else if (entry.recompute) {
    f[kRecalls] += 1;
    f[kRekept] += delta;
  } else {
    f[kCalls] += 1;
    f[kKept] += delta;
    f[kSelf] += delta - entry.child;
    f[kForwardPeak] = std::max(f[kForwardPeak], top);
    f[kForwardNs] += spent;
  }
}

// log_replay(owner, first, active, close, forwards) -> (ended, dropped): the log's events
// since the last replay, as spans would have measured each module call, added to the
// figures of its module's slot (``log_figures`` takes them); how many calls ended, and how
// many events the log dropped.
//
// An event's peak is the highest allocated since the event before it: it goes to the
// innermost open call, and a closing call hands its peak to the call below, so each call's
// peak covers everything after it opened, as a span's does. Calls numbered below `first`
// are gone (two steps old). A backward opens only while `active` and not open already.
// Forwards whose exit is not logged yet stay open for the next replay (and the log stays
// armed, so that Python's resets are logged meanwhile) while `forwards` says that some are
// still running; else they are dropped (an exit the full log lost). `close`: the backward
// pass ended (its last event is the end), backward calls still open end there; else they
// are dropped unrecorded, as spans a failed backward left open are.
PyObject* log_replay(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "log_replay(owner, first, active, close, forwards) takes 5 arguments");
    return nullptr;
  }
  long long owner = 0;
  long long first = 0;
  if (!int_arg(args[0], &owner) || !int_arg(args[1], &first)) {
    return nullptr;
  }
  const int active = PyObject_IsTrue(args[2]);
  const int close = PyObject_IsTrue(args[3]);
  const int forwards = PyObject_IsTrue(args[4]);
  if (active < 0 || close < 0 || forwards < 0) {
    return nullptr;
  }
  std::vector<Event> taken;
  int64_t lost = 0;
  if (!take_events(owner, taken, lost)) {
    return Py_BuildValue("(LL)", 0LL, 0LL);
  }
  int64_t ended = 0;
  try {
    for (const Event& e : taken) {
      if (!open_calls.empty()) {
        open_calls.back().peak = std::max(open_calls.back().peak, e.peak);
      }
      if (e.tag < 0) {
        continue;
      }
      const int64_t call = e.tag >> 2;
      const int64_t kind = e.tag & 3;
      if (call < first) {
        continue;
      }
      const bool forward = kind == kForwardEnter || kind == kForwardExit;
      size_t k = open_calls.size();
      while (k > 0 && (open_calls[k - 1].call != call || open_calls[k - 1].forward != forward)) {
        --k;
      }
      if (kind == kForwardEnter) {
        if (dropped_forwards.count(call) == 0) {
          const int64_t slot = e.meta < 0 ? -1 : e.meta >> 1;
          remember_slot(call, slot, first);
          open_calls.push_back(Open{call, true, e.allocated, e.allocated, e.ns, slot,
                                    e.meta >= 0 && (e.meta & 1) != 0, e.parent, 0});
        }
      } else if (kind == kBackwardStart) {
        if (active != 0 && k == 0) {
          open_calls.push_back(
              Open{call, false, e.allocated, e.allocated, e.ns, slot_of(call), false, -1, 0});
        }
      } else if (k > 0) {
        close_open(k - 1, e.allocated, e.ns);
        ++ended;
      }
    }
    if (close != 0 && !taken.empty()) {
      for (size_t k = open_calls.size(); k > 0; --k) {
        if (!open_calls[k - 1].forward) {
          close_open(k - 1, taken.back().allocated, taken.back().ns);
          ++ended;
        }
      }
    }
    // Backward calls left open are dropped; so are the forwards Python dropped (all of
    // them when none is running).
    std::vector<Open> kept;
    for (const Open& o : open_calls) {
      if (o.forward && forwards != 0 && dropped_forwards.count(o.call) == 0) {
        kept.push_back(o);
      }
    }
    open_calls.swap(kept);
    dropped_forwards.clear();
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
  if (!open_calls.empty()) {
    std::lock_guard<std::mutex> lock(mutex);
    armed = true;
  }
  return Py_BuildValue("(LL)", static_cast<long long>(ended), static_cast<long long>(lost));
}

// log_figures(owner) -> figures: what the replays added up since the last call, as one flat
// tuple of (slot, then the 11 figures of module_profile.STEP_FIELDS) per module slot that
// ran, in the order they first ended a call; emptied. () for another log.
PyObject* log_figures(PyObject* /*module*/, PyObject* arg) {
  long long owner = 0;
  if (!int_arg(arg, &owner)) {
    return nullptr;
  }
  std::vector<int64_t> out;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (owner != session) {
      return PyTuple_New(0);
    }
  }
  out.reserve(touched.size() * (kFields + 1));
  for (const int64_t slot : touched) {
    auto& f = figures[static_cast<size_t>(slot)];
    out.push_back(slot);
    out.insert(out.end(), f.begin(), f.end());
    f = Figures{};
    is_touched[static_cast<size_t>(slot)] = 0;
  }
  touched.clear();
  return int_tuple(out);
}

// log_drop(owner, call): the forward of `call` ended without its exit (an exception skipped
// the hook, or the profile stopped inside it): the replay forgets it.
PyObject* log_drop(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "log_drop(owner, call) takes 2 arguments");
    return nullptr;
  }
  long long owner = 0;
  long long call = 0;
  if (!int_arg(args[0], &owner) || !int_arg(args[1], &call)) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (owner == session) {
    dropped_forwards.insert(call);
  }
  Py_RETURN_NONE;
}

// mark(owner, device, tag[, meta, parent]): an event now, as a gate would log it (a module
// call's forward entry or exit, the end of a backward, or the gate of a node the C++ hook
// cannot reach, from a Python hook). A forward's entry gives its module's slot times two
// plus 1 for a recomputation (`meta`) and the call of the forward it runs in (`parent`, -1:
// none): the replay adds its figures to that slot.
PyObject* mark(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 && nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "mark(owner, device, tag[, meta, parent]) takes 3 or 5 arguments");
    return nullptr;
  }
  long long tag = 0;
  long long owner = 0;
  long long meta = -1;
  long long parent = -1;
  if (!int_arg(args[2], &tag) || !int_arg(args[0], &owner)) {
    return nullptr;
  }
  if (nargs == 5 && (!int_arg(args[3], &meta) || !int_arg(args[4], &parent))) {
    return nullptr;
  }
  const long device = device_arg(args[1]);
  if (device == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  const int64_t code = tag;
  gate_read(code, owner, static_cast<c10::DeviceIndex>(device), meta, parent);
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
     "gate(grad_fn, code, owner, step, device) -> whether a C++ gate logs code there"},
    {"codes", codes, METH_VARARGS, "codes(grad_fn, owner) -> the codes of the node's gate"},
    {"log_start", log_start, METH_NOARGS, "log_start() -> owner: a new gate log"},
    {"log_stop", log_stop, METH_O, "log_stop(owner): the gate log ends"},
    {"log_drain", log_drain, METH_O, "log_drain(owner) -> (flat events, dropped)"},
    {"log_replay",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(log_replay)),
     METH_FASTCALL,
     "log_replay(owner, first, active, close, forwards) -> (calls ended, dropped)"},
    {"log_figures",
     log_figures,
     METH_O,
     "log_figures(owner) -> flat (slot, 11 figures) per module slot that ran; emptied"},
    {"log_drop",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(log_drop)),
     METH_FASTCALL,
     "log_drop(owner, call): the call's forward ended without its exit"},
    {"mark",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(mark)),
     METH_FASTCALL,
     "mark(owner, device, tag[, meta, parent]): a gate event now"},
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
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && !ready_types(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
