/* The objects of given types: in a snapshot, in gc's lists; and the modules' dicts. */
#include "heapscan.h"

/* The addresses of the types in the tuple `types`, as a set (-1 with an exception set). */
int type_set(PyObject *types, PtrSet *set) {
    if (set_init(set, (size_t)PyTuple_GET_SIZE(types)) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        PyObject *tp = PyTuple_GET_ITEM(types, i);
        if (!PyType_Check(tp)) {
            free(set->slots);
            PyErr_SetString(PyExc_TypeError, "types must hold types only");
            return -1;
        }
        if (set_add(set, (uintptr_t)tp) < 0) {
            free(set->slots);
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* instances(objs, types[, start, end]) -> the objects of objs[start:end] whose exact type is
 * one of the tuple `types`, in order. Reads only each object's type pointer. */
PyObject *instances(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs, *types;
    Py_ssize_t start = 0, end = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "O!O!|nn", &PyList_Type, &objs, &PyTuple_Type, &types, &start,
                          &end))
        return NULL;
    if (start < 0 || end < start) {
        PyErr_SetString(PyExc_ValueError, "instances: need 0 <= start <= end");
        return NULL;
    }
    PtrSet set;
    if (type_set(types, &set) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) {
        free(set.slots);
        return NULL;
    }
    Py_INCREF(objs);
    for (Py_ssize_t i = start; i < end && i < PyList_GET_SIZE(objs); i++) {
        PyObject *o = PyList_GET_ITEM(objs, i);
        if (set_has(&set, (uintptr_t)Py_TYPE(o)) && PyList_Append(out, o) < 0) {
            Py_CLEAR(out);
            break;
        }
    }
    Py_DECREF(objs);
    free(set.slots);
    return out;
}

/* Calls cb(object, arg) for every gc-tracked object, in gc.get_objects()'s order (youngest
 * generation first, each generation in list order), until cb returns 0. gc does not run
 * meanwhile; cb must neither create nor free gc-tracked objects. */
static void visit_gc(int (*cb)(PyObject *, void *), void *arg) {
#if PY_VERSION_HEX >= 0x030C0000
    PyUnstable_GC_VisitObjects(cb, arg);
#else
    struct _gc_runtime_state *gc = &PyInterpreterState_Get()->gc;
    int enabled = gc->enabled;
    gc->enabled = 0;
    for (int i = 0; i < NUM_GENERATIONS; i++) {
        PyGC_Head *head = &gc->generations[i].head;
        for (PyGC_Head *g = (PyGC_Head *)head->_gc_next; g != head;
             g = (PyGC_Head *)g->_gc_next) {
            if (!cb((PyObject *)(g + 1), arg)) goto done;
        }
    }
done:
    gc->enabled = enabled;
#endif
}

typedef struct {
    const PtrSet *types;
    PyObject *out;
    int failed;
} TypeVisit;

static int collect_instance(PyObject *op, void *arg) {
    TypeVisit *v = (TypeVisit *)arg;
    if (set_has(v->types, (uintptr_t)Py_TYPE(op)) && PyList_Append(v->out, op) < 0) {
        v->failed = 1;
        return 0;
    }
    return 1;
}

/* gc_instances(types) -> the gc-tracked objects whose exact type is in the tuple `types`, in
 * gc.get_objects()'s order: instances(gc.get_objects(), types) without listing the heap
 * (reads each object's type pointer in place; appending to the result list allocates no
 * gc-tracked object). */
PyObject *gc_instances(PyObject *self, PyObject *types) {
    (void)self;
    if (!PyTuple_Check(types)) {
        PyErr_SetString(PyExc_TypeError, "gc_instances: types must be a tuple of types");
        return NULL;
    }
    PtrSet set;
    if (type_set(types, &set) < 0) return NULL;
    TypeVisit v = {&set, PyList_New(0), 0};
    if (v.out != NULL) {
        visit_gc(collect_instance, &v);
        if (v.failed) Py_CLEAR(v.out);
    }
    free(set.slots);
    return v.out;
}

/* module_dicts(modules) -> {id(module.__dict__): name} for the modules of the dict
 * `modules` (sys.modules) whose name is a str, the first name of each (in the dict's
 * order). Reads fields only: no Python code runs. */
PyObject *module_dicts(PyObject *self, PyObject *modules) {
    (void)self;
    if (!PyDict_CheckExact(modules)) {
        PyErr_SetString(PyExc_TypeError, "module_dicts: modules must be a dict");
        return NULL;
    }
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    Py_ssize_t pos = 0;
    PyObject *name, *mod;
    while (PyDict_Next(modules, &pos, &name, &mod)) {
        if (!PyUnicode_CheckExact(name) || !PyModule_Check(mod)) continue;
        PyObject *d = PyModule_GetDict(mod);
        if (d == NULL) {
            PyErr_Clear();
            continue;
        }
        PyObject *key = PyLong_FromVoidPtr(d);
        if (!key || PyDict_SetDefault(out, key, name) == NULL) {
            Py_XDECREF(key);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
    }
    return out;
}
