// The counter log of a module profile: the reads that log (a gate's, a mark's), a log's
// start, stop and drain, and `mark` (see fastread.h).

#include "fastread.h"

namespace {

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

void log_event(int64_t tag, int64_t allocated, int64_t peak, int64_t ns, int64_t meta,
               int64_t parent) {
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
void gate_read(int64_t code, int64_t owner, c10::DeviceIndex device, int64_t meta,
               int64_t parent) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex);
    read_locked([code](size_t) { return code; }, 1, owner, device, meta, parent);
  } catch (...) {
    // as above: a lock that fails loses the edge
  }
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

#ifdef CUDAMEM_STUB_ALLOCATOR
// log_drain(owner) -> (events, dropped): the log's events so far, as one flat tuple of
// (tag, allocated, peak, ns) quadruples, and how many it dropped; both emptied. Only in the
// stub build: the CPU tests read the raw events through it (cudamem reads them through
// log_replay).
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
#endif

// `arg` as a long long into `out`; false with the Python error set when it is none.
bool int_arg(PyObject* arg, long long* out) {
  *out = PyLong_AsLongLong(arg);
  return !(*out == -1 && PyErr_Occurred() != nullptr);
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

} // namespace
