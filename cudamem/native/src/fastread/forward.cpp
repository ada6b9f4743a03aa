// The forward hooks' fast path: a module call's forward pre- and post-hook in C, and the
// node references (see fastread.h).

#include "fastread.h"

namespace {

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

void noderef_dealloc(PyObject* self) {
  reinterpret_cast<NodeRefObject*>(self)->node.~NodePtr();
  Py_TYPE(self)->tp_free(self);
}

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

} // namespace
