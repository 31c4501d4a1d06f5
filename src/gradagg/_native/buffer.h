/* A typed, read-only buffer that owns malloc'd memory: how decoded columns reach Python without a copy.
 *
 * memoryview(buffer) has the format ("i", "q", "f", "d", "I") and the length of the values, so the
 * Python side never reinterprets bytes; NumPy's frombuffer and torch.frombuffer read it without a copy.
 */
#ifndef GRADAGG_BUFFER_H
#define GRADAGG_BUFFER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

/* Freed blocks are kept for the next buffers (a reader's batches are all of one size or two): reusing them
 * spares the kernel's page faults on fresh memory, which cost as much as decoding on a small VM. Only ever
 * touched with the GIL held. At most POOL blocks wait, so the pool never holds more than a few batches. */
#define POOL 24
static struct {
    void *data;
    size_t capacity;
} pool[POOL];
static int pooled;

static void *pool_take(size_t size, size_t *capacity) {
    int best = -1;
    for (int k = 0; k < pooled; k++)
        if (pool[k].capacity >= size && pool[k].capacity <= 2 * size + 4096 &&
            (best < 0 || pool[k].capacity < pool[best].capacity))
            best = k;
    if (best >= 0) {
        void *data = pool[best].data;
        *capacity = pool[best].capacity;
        pool[best] = pool[--pooled];
        return data;
    }
    *capacity = size ? size : 1;
    return malloc(*capacity);
}

static void pool_give(void *data, size_t capacity) {
    if (!data) return;
    if (pooled == POOL) { /* full: the oldest goes back to the system */
        free(pool[0].data);
        pool[0] = pool[--pooled];
    }
    pool[pooled].data = data;
    pool[pooled].capacity = capacity;
    pooled++;
}

typedef struct {
    PyObject_HEAD
    void *data;
    size_t capacity;
    Py_ssize_t n, itemsize, shape[1], strides[1];
    char format[2];
} Buffer;

static void buffer_dealloc(Buffer *self) {
    pool_give(self->data, self->capacity);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int buffer_get(Buffer *self, Py_buffer *view, int flags) {
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "decoded columns are read-only");
        view->obj = NULL;
        return -1;
    }
    view->obj = (PyObject *)self;
    Py_INCREF(self);
    view->buf = self->data;
    view->len = self->n * self->itemsize;
    view->readonly = 1;
    view->itemsize = self->itemsize;
    view->format = (flags & PyBUF_FORMAT) ? self->format : NULL;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? self->shape : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? self->strides : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PyBufferProcs buffer_procs = {(getbufferproc)buffer_get, NULL};

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradagg._native.Buffer",
    .tp_basicsize = sizeof(Buffer),
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_as_buffer = &buffer_procs,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A decoded column's values: read it through memoryview().",
};

static int buffer_ready(void) { return PyType_Ready(&BufferType); }

/* A buffer of n values of `itemsize` bytes in struct format `format`, over `data` (a block of `capacity`
 * bytes from pool_take or malloc, now owned by the buffer; given back to the pool on failure). */
static PyObject *buffer_new(void *data, size_t capacity, Py_ssize_t n, const char *format, Py_ssize_t itemsize) {
    Buffer *b = PyObject_New(Buffer, &BufferType);
    if (!b) {
        pool_give(data, capacity);
        return NULL;
    }
    b->data = data;
    b->capacity = capacity;
    b->n = n;
    b->itemsize = itemsize;
    b->shape[0] = n;
    b->strides[0] = itemsize;
    b->format[0] = format[0];
    b->format[1] = 0;
    return (PyObject *)b;
}

#endif
