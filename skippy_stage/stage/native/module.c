/* The module skippy_stage.stage._frames (native_frames.py is its Python side): the types the other
 * files define, and greedy() for the tests of the final stage's pick. frames.h maps the files. */
#include "frames.h"

#include <string.h>

/* greedy(logits: float32 buffer) -> int: the final stage's greedy pick, for its tests. */
static PyObject *module_greedy(PyObject *mod, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = b.len / (Py_ssize_t)sizeof(float);
    if (n < 1 || n > INT32_MAX || b.len % (Py_ssize_t)sizeof(float)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "greedy: a non-empty buffer of float32 logits");
        return NULL;
    }
    int32_t best = sk_greedy((const float *)b.buf, (int)n);
    PyBuffer_Release(&b);
    return PyLong_FromLong(best);
}

static PyMethodDef module_methods[] = {
    {"greedy", module_greedy, METH_O, "greedy(logits) -> int: the first index of the largest float32 logit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frames", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__frames(void) {
    PyTypeObject *types[] = {&sk_FramePathType, &sk_ReturnWaitType, &sk_FrameReaderType, &sk_BellType, &sk_GateType};
    PyObject *m = NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    if ((m = PyModule_Create(&module)) == NULL) return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const char *name = strrchr(types[i]->tp_name, '.') + 1; /* "skippy_stage.stage._frames.<name>" */
        if (PyModule_AddObjectRef(m, name, (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
