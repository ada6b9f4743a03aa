// The module: its functions and its PyInit (see fastread.h).

#include "fastread.h"

namespace {

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
    {"log_replay",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(log_replay)),
     METH_FASTCALL,
     "log_replay(owner, first, active, close, forwards) -> events dropped"},
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
    {"log_drain", log_drain, METH_O, "log_drain(owner) -> (flat events, dropped)"},
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
