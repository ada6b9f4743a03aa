// The log's replay: each module call's figures from the events, as spans would measure
// them, added up per module slot (`log_replay`, `log_figures`, `log_drop`; see fastread.h).

#include "fastread.h"

namespace {

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

// log_replay(owner, first, active, close, forwards) -> dropped: the log's events since the
// last replay, as spans would have measured each module call, added to the figures of its
// module's slot (``log_figures`` takes them); how many events the log dropped.
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
    return PyLong_FromLong(0);
  }
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
      }
    }
    if (close != 0 && !taken.empty()) {
      for (size_t k = open_calls.size(); k > 0; --k) {
        if (!open_calls[k - 1].forward) {
          close_open(k - 1, taken.back().allocated, taken.back().ns);
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
  return PyLong_FromLongLong(static_cast<long long>(lost));
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

} // namespace
