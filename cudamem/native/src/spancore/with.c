/* MemorySpan's ``__enter__``/``__exit__`` through one span core state (see core.h). */
#include "core.h"

/* MemorySpan's ``__enter__`` or ``__exit__`` through one state: a method descriptor of its
 * own kind that holds its state, so that a call finds the state through its own object.
 * Called unbound with the span first (``MemorySpan.__enter__(span)``; CPython calls so
 * where it can, Py_TPFLAGS_METHOD_DESCRIPTOR) or bound to a span (a SpanBound, what a
 * ``with`` block looks up). */
typedef struct {
    PyObject_HEAD
    Core *core;
    PyObject *name, *qualname; /* "__enter__", "MemorySpan.__enter__" */
    vectorcallfunc vectorcall; /* called unbound */
    vectorcallfunc bound;      /* its SpanBound's call */
} SpanMethod;

/* A SpanMethod bound to a span, as a bound method, called straight into the core. */
typedef struct {
    PyObject_HEAD
    SpanMethod *method;
    PyObject *self;
    vectorcallfunc vectorcall;
} SpanBound;

/* Whether ``o`` is a MemorySpan of the state (its fields lie at the offsets read here). */
static int own_span(Core *st, PyObject *o) {
    return st->span_type != NULL && PyObject_TypeCheck(o, st->span_type);
}

/* The Python method (``fn``: the helpers FN_PY_SPAN_ENTER or FN_PY_SPAN_EXIT) with the
 * same call. */
static PyObject *py_method(Core *st, int fn, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    PyObject *f = st->fn[fn];
    if (f == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this span core state was cleared");
        return NULL;
    }
    return PyObject_Vectorcall(f, args, nargsf, kwnames);
}

/* ``self.__enter__()`` for a MemorySpan of ``st``: the span on the stack, opened by
 * ``cm_open``; a span entered before or detached goes to the Python method. */
static PyObject *enter_own(Core *st, PyObject *self) {
    PyObject *raw = MSLOT(st, self, M_RAW), *detached = MSLOT(st, self, M_DETACHED);
    PyObject *name = MSLOT(st, self, M_NAME);
    if (raw != Py_None || detached == NULL || !PyLong_CheckExact(detached) ||
        PyLong_AsLong(detached) != 0 || name == NULL || MSLOT(st, self, M_DEVICE) == NULL ||
        MSLOT(st, self, M_SYNC) == NULL || MSLOT(st, self, M_PEAK) == NULL ||
        MSLOT(st, self, M_LEAKS) == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return py_method(st, FN_PY_SPAN_ENTER, &self, 1, NULL);
    }
    if (name == Py_None || (PyUnicode_Check(name) && PyUnicode_GET_LENGTH(name) == 0))
        name = cm_names[S_SPAN_DEFAULT]; /* ``self._name or "span"`` */
    PyObject *call[5] = {name, MSLOT(st, self, M_DEVICE), MSLOT(st, self, M_SYNC),
                         MSLOT(st, self, M_PEAK), MSLOT(st, self, M_LEAKS)};
    PyObject *span = cm_open((PyObject *)st, call, 5, NULL);
    if (span == NULL)
        return NULL;
    PyObject *old = MSLOT(st, self, M_RAW);
    MSLOT(st, self, M_RAW) = span;
    Py_XDECREF(old);
    return Py_NewRef(self);
}

/* ``self.__exit__(exc_type, exc, tb)`` for a MemorySpan of ``st``:
 * ``cm_close(self._raw, exc, self)``. */
static PyObject *exit_own(Core *st, PyObject *self, PyObject *exc) {
    PyObject *raw = MSLOT(st, self, M_RAW);
    if (raw == NULL || raw == Py_None)
        Py_RETURN_NONE;
    Py_INCREF(raw);
    PyObject *call[3] = {raw, exc, self};
    PyObject *r = cm_close((PyObject *)st, call, 3, NULL);
    Py_DECREF(raw);
    return r;
}

/* MemorySpan.__enter__(self), unbound; any other call goes to the Python method. */
static PyObject *span_enter(PyObject *method, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
    Core *st = ((SpanMethod *)method)->core;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !own_span(st, args[0]))
        return py_method(st, FN_PY_SPAN_ENTER, args, nargsf, kwnames);
    return enter_own(st, args[0]);
}

/* MemorySpan.__exit__(self, exc_type, exc, tb), unbound; any other call goes to the Python
 * method. */
static PyObject *span_exit(PyObject *method, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    Core *st = ((SpanMethod *)method)->core;
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL || !own_span(st, args[0]))
        return py_method(st, FN_PY_SPAN_EXIT, args, nargsf, kwnames);
    return exit_own(st, args[0], args[2]);
}

/* A bound call other than the ``with`` block's: as a bound method calls (the span first). */
static PyObject *bound_other(SpanBound *b, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    PyObject *m = PyMethod_New((PyObject *)b->method, b->self);
    if (m == NULL)
        return NULL;
    PyObject *r = PyObject_Vectorcall(m, args, nargsf, kwnames);
    Py_DECREF(m);
    return r;
}

static PyObject *bound_enter(PyObject *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    SpanBound *b = (SpanBound *)self;
    Core *st = b->method->core;
    if (PyVectorcall_NARGS(nargsf) != 0 || kwnames != NULL || !own_span(st, b->self))
        return bound_other(b, args, nargsf, kwnames);
    return enter_own(st, b->self);
}

static PyObject *bound_exit(PyObject *self, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
    SpanBound *b = (SpanBound *)self;
    Core *st = b->method->core;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL || !own_span(st, b->self))
        return bound_other(b, args, nargsf, kwnames);
    return exit_own(st, b->self, args[1]);
}

static int bound_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((SpanBound *)self)->method);
    Py_VISIT(((SpanBound *)self)->self);
    return 0;
}

static void bound_dealloc(PyObject *self) {
    SpanBound *b = (SpanBound *)self;
    PyObject_GC_UnTrack(self);
    Py_XDECREF(b->method);
    Py_XDECREF(b->self);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *bound_repr(PyObject *self) {
    SpanBound *b = (SpanBound *)self;
    return PyUnicode_FromFormat("<bound %U of %R>", b->method->qualname, b->self);
}

static PyMemberDef bound_members[] = {
    {"__self__", T_OBJECT, offsetof(SpanBound, self), READONLY, NULL},
    {"__func__", T_OBJECT, offsetof(SpanBound, method), READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

PyTypeObject cm_bound_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = CM_STR(CUDAMEM_MODULE_NAME) ".SpanBound",
    .tp_basicsize = sizeof(SpanBound),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SpanBound, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = bound_repr,
    .tp_traverse = bound_traverse,
    .tp_dealloc = bound_dealloc,
    .tp_members = bound_members,
};

/* Bound to a span: a SpanBound (one that is not the state's goes to the Python method, as
 * a bound method); on the class: itself. */
static PyObject *method_get(PyObject *self, PyObject *obj, PyObject *type) {
    SpanMethod *m = (SpanMethod *)self;
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    if (!own_span(m->core, obj))
        return PyMethod_New(self, obj);
    SpanBound *b = PyObject_GC_New(SpanBound, &cm_bound_type);
    if (b == NULL)
        return NULL;
    b->method = (SpanMethod *)Py_NewRef(self);
    b->self = Py_NewRef(obj);
    b->vectorcall = m->bound;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

static PyObject *method_repr(PyObject *self) {
    return PyUnicode_FromFormat("<%U of the compiled span core>", ((SpanMethod *)self)->qualname);
}

static PyObject *method_doc(PyObject *self, void *closure) {
    return PyUnicode_FromFormat("MemorySpan.%U through the compiled span core.",
                                ((SpanMethod *)self)->name);
}

static int method_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((SpanMethod *)self)->core);
    return 0;
}

static void method_dealloc(PyObject *self) {
    SpanMethod *m = (SpanMethod *)self;
    PyObject_GC_UnTrack(self);
    Py_XDECREF(m->core);
    Py_XDECREF(m->name);
    Py_XDECREF(m->qualname);
    Py_TYPE(self)->tp_free(self);
}

static PyMemberDef method_members[] = {
    {"__name__", T_OBJECT, offsetof(SpanMethod, name), READONLY, NULL},
    {"__qualname__", T_OBJECT, offsetof(SpanMethod, qualname), READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyGetSetDef method_getset[] = {{"__doc__", method_doc, NULL, NULL, NULL},
                                      {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject cm_method_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = CM_STR(CUDAMEM_MODULE_NAME) ".SpanMethod",
    .tp_basicsize = sizeof(SpanMethod),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(SpanMethod, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_repr = method_repr,
    .tp_traverse = method_traverse,
    .tp_dealloc = method_dealloc,
    .tp_members = method_members,
    .tp_getset = method_getset,
};

/* A SpanMethod of ``st`` named ``name`` (a new reference, or NULL with an error). */
PyObject *cm_new_method(Core *st, PyObject *type_qualname, const char *name, int enter) {
    vectorcallfunc call = enter ? span_enter : span_exit;
    vectorcallfunc bound = enter ? bound_enter : bound_exit;
    SpanMethod *m = (SpanMethod *)cm_method_type.tp_alloc(&cm_method_type, 0);
    if (m == NULL)
        return NULL;
    m->core = (Core *)Py_NewRef((PyObject *)st);
    m->vectorcall = call;
    m->bound = bound;
    m->name = PyUnicode_InternFromString(name);
    m->qualname = PyUnicode_FromFormat("%U.%s", type_qualname, name);
    if (m->name == NULL || m->qualname == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}
