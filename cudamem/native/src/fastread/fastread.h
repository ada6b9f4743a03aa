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
//
// The sources: this header (what every part shares: the includes, the stub allocator, the
// log's and the replay's state, the node references, the parts' functions) and counters.cpp
// (the counter reads), log.cpp (the log: reads that log, start, stop, drain, mark),
// gates.cpp (the C++ pre-hooks on autograd nodes), forward.cpp (the forward hooks' fast
// path), replay.cpp (the log's replay into each module's figures), module.cpp (the module).
// They make one translation unit, in cudamem/native/reader_build.py's ORDER (its `bundle`:
// the header first, each part after a #line naming it), so the parts share one anonymous
// namespace and nothing but PyInit leaves the library.

#ifndef CUDAMEM_FASTREAD_H
#define CUDAMEM_FASTREAD_H

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


// How a tensor holds its grad_fn (a shared or an intrusive pointer, depending on the release).
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// An autograd node held from C++: where a call's backward ends (its first grad-requiring
// input's grad_fn, taken at its forward's entry), with no Python grad_fn object made for it.
struct NodeRefObject {
  PyObject_HEAD
  NodePtr node;
};

PyTypeObject NodeRefType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The parts' functions that other parts call (the templates are defined before their
// callers: read_locked in log.cpp, add_gate and the rest in gates.cpp).
void clear_replay();
int64_t now_ns();
void log_event(int64_t tag, int64_t allocated, int64_t peak, int64_t ns, int64_t meta = -1,
               int64_t parent = -1);
void gate_read(int64_t code, int64_t owner, c10::DeviceIndex device, int64_t meta = -1,
               int64_t parent = -1) noexcept;
bool take_events(int64_t owner, std::vector<Event>& taken, int64_t& lost);
bool int_arg(PyObject* arg, long long* out);
PyObject* int_tuple(const std::vector<int64_t>& values);
long device_arg(PyObject* arg);
PyObject* make_noderef(NodePtr node);
bool ready_types(PyObject* module);

} // namespace

#endif // CUDAMEM_FASTREAD_H
