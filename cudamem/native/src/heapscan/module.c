/* The heap pass's module: its functions and its PyInit (see heapscan.h). */
#include "heapscan.h"

static PyMethodDef methods[] = {
#ifdef CUDAMEM_HAVE_WALK
    {"walk", walk, METH_VARARGS,
     "The snapshot, the objects of given types and a full edge cache in one walk."},
#endif
    {"scan", scan, METH_VARARGS, "One pass over a heap snapshot (see the file's comment)."},
    {"instances", instances, METH_VARARGS, "The objects whose exact type is in a tuple."},
    {"gc_instances", gc_instances, METH_O, "The gc-tracked objects whose exact type is in a tuple."},
    {"module_dicts", module_dicts, METH_O, "{id(module.__dict__): name} of sys.modules."},
    {"edges", edges_new, METH_VARARGS, "A new edge cache for repeated scans of one snapshot."},
    {"edges_info", edges_info, METH_VARARGS, "(batches, edges, full) of an edge cache."},
#ifdef CUDAMEM_SIDE_THREAD
    {"side_thread", side_thread, METH_O, "Walks' array keeps on a second thread: 0, 1, 2."},
#endif
#ifdef CUDAMEM_HAVE_WALK
    {"walk_stats", walk_stats, METH_NOARGS, "(objects, edges, side, chased): the last walk."},
#endif
    {NULL, NULL, 0, NULL},
};

#ifndef CUDAMEM_MODULE_NAME
#define CUDAMEM_MODULE_NAME _cudamem_heapscan
#endif
#define STR2(x) #x
#define STR(x) STR2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, STR(CUDAMEM_MODULE_NAME), "cudamem's compiled heap pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC CAT(PyInit_, CUDAMEM_MODULE_NAME)(void) { return PyModule_Create(&module); }
