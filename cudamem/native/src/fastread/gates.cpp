// The gates: C++ pre-hooks on autograd nodes that log the counters with no GIL when the
// node is about to run, and what Python asks of them (`gate`, `codes`; see fastread.h).

#include "fastread.h"

namespace {

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

} // namespace
