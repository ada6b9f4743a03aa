/* The span core's state (``Core``), ``init`` (the table) and the module (see core.h). */
#include "core.h"

static int core_traverse(PyObject *self, visitproc visit, void *arg) {
    Core *st = (Core *)self;
    Py_VISIT(st->raw_type);
    Py_VISIT(st->span_type);
    Py_VISIT(st->state);
    Py_VISIT(st->backend_ns);
    Py_VISIT(st->backend_key);
    for (int i = 0; i < N_FN; i++)
        Py_VISIT(st->fn[i]);
    Py_VISIT(st->open_peak);
    Py_VISIT(st->process_peak);
    Py_VISIT(st->inbox);
    Py_VISIT(st->inbox_append);
    Py_VISIT(st->top);
    Py_VISIT(st->tls);
    Py_VISIT(st->finished);
    Py_VISIT(st->finished_append);
    Py_VISIT(st->enter);
    Py_VISIT(st->exit);
    return 0;
}

/* The types first: a call that comes while the rest is cleared finds them NULL and goes no
 * further (open and close hand the call on, and a cleared state refuses it). */
static int core_clear(PyObject *self) {
    Core *st = (Core *)self;
    Py_CLEAR(st->raw_type);
    Py_CLEAR(st->span_type);
    Py_CLEAR(st->enter);
    Py_CLEAR(st->exit);
    Py_CLEAR(st->open_peak);
    Py_CLEAR(st->process_peak);
    Py_CLEAR(st->inbox);
    Py_CLEAR(st->inbox_append);
    Py_CLEAR(st->top);
    Py_CLEAR(st->tls);
    Py_CLEAR(st->finished);
    Py_CLEAR(st->finished_append);
    for (int i = 0; i < N_FN; i++)
        Py_CLEAR(st->fn[i]);
    Py_CLEAR(st->backend_ns);
    Py_CLEAR(st->backend_key);
    Py_CLEAR(st->state);
    return 0;
}

static void core_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef core_methods[] = {
    {"open", (PyCFunction)(void (*)(void))cm_open, METH_FASTCALL | METH_KEYWORDS,
     "open(name, device, sync, peak, leaks, nest=True, push=True, *, hooks=True)"},
    {"close", (PyCFunction)(void (*)(void))cm_close, METH_FASTCALL | METH_KEYWORDS,
     "close(span, exc, keeper=None, *, hooks=True)"},
    {"columns", cm_columns, METH_O,
     "columns(spans): a batch of closed spans' sums and maxima for the history"},
    {"make", (PyCFunction)(void (*)(void))cm_make, METH_FASTCALL,
     "make(name, sync, peak, leaks): track()'s MemorySpan"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef core_members[] = {
    {"enter", T_OBJECT, offsetof(Core, enter), READONLY, "MemorySpan.__enter__ through it"},
    {"exit", T_OBJECT, offsetof(Core, exit), READONLY, "MemorySpan.__exit__ through it"},
    {NULL, 0, 0, 0, NULL}};

PyTypeObject cm_core_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = CM_STR(CUDAMEM_MODULE_NAME) ".Core",
    .tp_doc = "One span machinery's state in the compiled span core (made by init).",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = core_traverse,
    .tp_clear = core_clear,
    .tp_dealloc = core_dealloc,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

/* The offsets of the member descriptors ``descrs`` (a tuple of ``n``, named ``names`` in
 * that order: writable object slots of ``type``) into ``out``; -1 with an error. */
static int slot_offsets(PyTypeObject *type, PyObject *descrs, const char *const *names, int n,
                        Py_ssize_t *out) {
    if (!PyTuple_Check(descrs) || PyTuple_GET_SIZE(descrs) != n) {
        PyErr_Format(PyExc_TypeError, "%s's slots: a tuple of %d descriptors", type->tp_name, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        PyObject *descr = PyTuple_GET_ITEM(descrs, i);
        if (!Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
            ((PyDescrObject *)descr)->d_type != type ||
            PyUnicode_CompareWithASCIIString(((PyDescrObject *)descr)->d_name, names[i]) != 0) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, names[i]);
            return -1;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0 ||
            (size_t)m->offset + sizeof(PyObject *) > (size_t)type->tp_basicsize) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name,
                         names[i]);
            return -1;
        }
        out[i] = m->offset;
    }
    return 0;
}

/* ---------------------------------------------------------------------------- init */

/* init(table) -> Core: check the table (core.h's T_ order) and keep it, in a state of
 * that span machinery's own. */
static PyObject *core_init(PyObject *self, PyObject *table) {
    if (!PyTuple_CheckExact(table) || PyTuple_GET_SIZE(table) != N_TABLE) {
        PyErr_Format(PyExc_TypeError, "init(table): a tuple of %d entries", N_TABLE);
        return NULL;
    }
#define AT(i) PyTuple_GET_ITEM(table, i)
    PyObject *rtype = AT(T_RAW_TYPE), *mtype = AT(T_SPAN_TYPE), *state = AT(T_STATE);
    if (!PyType_Check(rtype) || !PyType_Check(mtype)) {
        PyErr_SetString(PyExc_TypeError, "init: the span types are not types");
        return NULL;
    }
    Py_ssize_t offsets[N_FIELDS], moffsets[M_FIELDS], soffsets[N_STATE];
    if (slot_offsets((PyTypeObject *)rtype, AT(T_RAW_SLOTS), cm_field_names, N_FIELDS,
                     offsets) < 0 ||
        slot_offsets((PyTypeObject *)mtype, AT(T_SPAN_SLOTS), cm_mfield_names, M_FIELDS,
                     moffsets) < 0 ||
        slot_offsets(Py_TYPE(state), AT(T_STATE_SLOTS), cm_state_names, N_STATE, soffsets) < 0)
        return NULL;
    if (!PyDict_CheckExact(AT(T_BACKEND_NS)) || !PyUnicode_CheckExact(AT(T_BACKEND_KEY)) ||
        !PyDict_CheckExact(AT(T_OPEN_PEAK)) || !PyDict_CheckExact(AT(T_PROCESS_PEAK)) ||
        !PyContextVar_CheckExact(AT(T_TOP)) || !PyBool_Check(AT(T_MONOTONIC))) {
        PyErr_SetString(PyExc_TypeError, "init: the backend holder, the peak registries, the "
                                         "stack or the clock flag are not what the core reads");
        return NULL;
    }
    for (int i = 0; i < N_FN; i++) {
        if (!PyCallable_Check(AT(T_FN + i))) {
            PyErr_Format(PyExc_TypeError, "init: table entry %d is not callable", T_FN + i);
            return NULL;
        }
    }
    Core *st = (Core *)cm_core_type.tp_alloc(&cm_core_type, 0);
    if (st == NULL)
        return NULL;
    memcpy(st->off, offsets, sizeof offsets);
    memcpy(st->moff, moffsets, sizeof moffsets);
    memcpy(st->soff, soffsets, sizeof soffsets);
    st->state = Py_NewRef(state);
    st->backend_ns = Py_NewRef(AT(T_BACKEND_NS));
    st->backend_key = Py_NewRef(AT(T_BACKEND_KEY));
    for (int i = 0; i < N_FN; i++)
        st->fn[i] = Py_NewRef(AT(T_FN + i));
    st->open_peak = Py_NewRef(AT(T_OPEN_PEAK));
    st->process_peak = Py_NewRef(AT(T_PROCESS_PEAK));
    st->inbox = Py_NewRef(AT(T_PEAK_INBOX));
    st->finished = Py_NewRef(AT(T_FINISHED));
    st->top = Py_NewRef(AT(T_TOP));
    st->tls = Py_NewRef(AT(T_TLS));
    st->monotonic = AT(T_MONOTONIC) == Py_True;
    if ((st->inbox_append = PyObject_GetAttr(st->inbox, cm_names[S_APPEND])) == NULL ||
        (st->finished_append = PyObject_GetAttr(st->finished, cm_names[S_APPEND])) == NULL)
        goto error;
    PyObject *qualname = PyObject_GetAttrString(mtype, "__qualname__");
    if (qualname == NULL)
        goto error;
    st->enter = cm_new_method(st, qualname, "__enter__", 1);
    if (st->enter != NULL)
        st->exit = cm_new_method(st, qualname, "__exit__", 0);
    Py_DECREF(qualname);
    if (st->exit == NULL)
        goto error;
    /* Last: a state with its types set is one that serves. */
    st->raw_type = (PyTypeObject *)Py_NewRef(rtype);
    st->span_type = (PyTypeObject *)Py_NewRef(mtype);
    return (PyObject *)st;
#undef AT
error:
    Py_DECREF(st);
    return NULL;
}

static PyMethodDef methods[] = {
    {"init", core_init, METH_O,
     "init(table) -> Core: a span machinery's state, from the table of core.h's T_ order, "
     "whose open, close, make and columns serve that machinery, and whose enter and exit "
     "are its MemorySpan's __enter__ and __exit__"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, CM_STR(CUDAMEM_MODULE_NAME),
                                    "cudamem's span core (see cudamem's spans)", -1, methods};

static const char *const NAMES[N_NAMES] = {
    "settled_devices", "fast_reset", "fast_counters", "counters_reset_peak", "counters",
    "append",          "hooks",      "_extras",       "name",                "span"};

PyMODINIT_FUNC CM_CAT(PyInit_, CUDAMEM_MODULE_NAME)(void) {
    for (int i = 0; i < N_NAMES; i++) {
        if (cm_names[i] == NULL && (cm_names[i] = PyUnicode_InternFromString(NAMES[i])) == NULL)
            return NULL;
    }
    if (PyType_Ready(&cm_core_type) < 0 || PyType_Ready(&cm_method_type) < 0 ||
        PyType_Ready(&cm_bound_type) < 0)
        return NULL;
    return PyModule_Create(&module);
}
