/* gradagg._native._ownersum: the owner-sum table of gradagg.backends.native, in C.
 *
 * totals[shard] += gradient for every row whose worker equals its owner, one row at a time in row order,
 * into totals that start at -0.0 (the identity of IEEE addition, sign of zero included): float totals
 * are bit-identical to gradagg.reference.owner_sum. Integer totals are exact: a running total that would
 * leave int64 stops the update and is reported (the Python side raises). With raise_nonfinite, the first
 * counted NaN/Inf stops the update and is reported, before it is added.
 *
 * Shard ids index a dense table (id - lo) while their range stays under DENSE_LIMIT cells, else a hash
 * table (insertion-ordered slots, sorted once at the end). A dictionary-encoded shard column is mapped
 * dictionary entry -> cell once per batch, so rows only look their cell up. Nothing is trusted: formats,
 * lengths and every dictionary index are checked before the row loop. The row loop runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ownertable.h"

#define BLOCK 1024 /* rows whose ids are loaded together: they stay in L1 */

enum { OK = 0, NONFINITE = 1, OVERFLOW = 2, NOMEM = 3 };

/* --- columns ----------------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer values, indices; /* indices.obj NULL: plain values */
    int64_t n;                 /* rows */
    int64_t *dict;             /* dictionary values widened to int64 (dictionary-encoded ids) */
    int64_t *cells;            /* shard column: each dictionary entry's cell */
} Column;

static void column_release(Column *c) {
    if (c->values.obj) PyBuffer_Release(&c->values);
    if (c->indices.obj) PyBuffer_Release(&c->indices);
    free(c->dict);
    free(c->cells);
}

static int is_format(const Py_buffer *b, const char *formats) {
    return b->format && b->format[0] && !b->format[1] && strchr(formats, b->format[0]) && b->ndim == 1;
}

/* A column from (values, indices or None); ids: values "i"/"q"; gradients: "i", "q", "f", "d". */
static int column_get(PyObject *spec, const char *formats, const char *name, Column *c) {
    PyObject *values, *indices;
    memset(c, 0, sizeof *c);
    if (!PyArg_ParseTuple(spec, "OO", &values, &indices)) return -1;
    if (PyObject_GetBuffer(values, &c->values, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (!is_format(&c->values, formats)) {
        PyErr_Format(PyExc_TypeError, "%s: values of format %s, expected one of %s", name,
                     c->values.format ? c->values.format : "B", formats);
        return -1;
    }
    c->n = c->values.len / c->values.itemsize;
    if (indices == Py_None) return 0;
    if (PyObject_GetBuffer(indices, &c->indices, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (!is_format(&c->indices, "I")) {
        PyErr_Format(PyExc_TypeError, "%s: indices must be uint32 (format I)", name);
        return -1;
    }
    int64_t d = c->n, wide = c->values.itemsize == 8;
    c->n = c->indices.len / 4;
    c->dict = malloc((size_t)(d ? d : 1) * 8);
    if (!c->dict) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t k = 0; k < d; k++)
        c->dict[k] = wide ? ((const int64_t *)c->values.buf)[k] : ((const int32_t *)c->values.buf)[k];
    const uint32_t *ix = c->indices.buf;
    uint32_t bad = 0, limit = d > UINT32_MAX ? UINT32_MAX : (uint32_t)d;
    for (int64_t r = 0; r < c->n; r++) bad |= ix[r] >= limit; /* (a loop the compiler vectorises) */
    for (int64_t r = 0; bad && r < c->n; r++) {
        if (ix[r] >= limit) {
            PyErr_Format(PyExc_ValueError, "%s: row %lld: index %u into a dictionary of %lld values", name,
                         (long long)r, ix[r], (long long)d);
            return -1;
        }
    }
    return 0;
}

/* Owner ids seen as worker dictionary indices (UINT32_MAX: a value no worker has), when both columns are
 * dictionary-encoded with small dictionaries: then a row is an owner row iff its two indices are equal. */
static uint32_t *owner_in_worker_terms(const Column *w, const Column *o) {
    int64_t dw = w->values.len / w->values.itemsize, dn = o->values.len / o->values.itemsize;
    if (!w->dict || !o->dict || dw * dn > 65536) return NULL;
    uint32_t *perm = malloc((size_t)(dn ? dn : 1) * sizeof *perm);
    if (!perm) return NULL;
    for (int64_t k = 0; k < dn; k++) {
        perm[k] = UINT32_MAX;
        for (int64_t j = 0; j < dw; j++) {
            if (w->dict[j] == o->dict[k]) {
                perm[k] = (uint32_t)j;
                break;
            }
        }
    }
    return perm;
}

static void load_ids(const Column *c, int64_t start, int m, int64_t *out) {
    if (c->dict) {
        const uint32_t *ix = (const uint32_t *)c->indices.buf + start;
        for (int j = 0; j < m; j++) out[j] = c->dict[ix[j]];
    } else if (c->values.itemsize == 8) {
        memcpy(out, (const int64_t *)c->values.buf + start, (size_t)m * 8);
    } else {
        const int32_t *v = (const int32_t *)c->values.buf + start;
        for (int j = 0; j < m; j++) out[j] = v[j];
    }
}

/* Each dictionary entry of a shard column gets its cell before any row is added. */
static int map_dictionary(Table *a, Column *c) {
    int64_t d = c->values.len / c->values.itemsize;
    c->cells = malloc((size_t)(d ? d : 1) * 8);
    if (!c->cells) return -1;
    if (d && a->dense) {
        int64_t lo = c->dict[0], hi = c->dict[0];
        for (int64_t k = 1; k < d; k++) {
            lo = c->dict[k] < lo ? c->dict[k] : lo;
            hi = c->dict[k] > hi ? c->dict[k] : hi;
        }
        if ((lo < a->lo || a->span == 0 || (uint64_t)hi - (uint64_t)a->lo >= (uint64_t)a->span) && cover(a, lo, hi))
            return -1;
    }
    for (int64_t k = 0; k < d; k++) {
        c->cells[k] = a->dense ? (int64_t)((uint64_t)c->dict[k] - (uint64_t)a->lo) : slot(a, c->dict[k]);
        if (c->cells[k] < 0) return -1;
    }
    return 0;
}

/* --- the row loop ------------------------------------------------------------------------------------ */

typedef struct {
    int status;
    int64_t row, before; /* where it stopped; the integer total before the add that would overflow */
} Stop;

/* The cells of a block's owner rows (plain shard ids): growing the table moves cells, so a block whose
 * table grew meanwhile is looked up again (it converges: ids already seen stay inside the grown table). */
static int block_cells(Table *a, const int64_t *ids, const int *sel, int count, int64_t *cells) {
    for (;;) {
        int64_t lo = a->lo, span = a->span;
        int dense = a->dense, q = 0;
        for (; q < count; q++) {
            int64_t c = cell_of(a, ids[sel[q]]);
            if (c < 0) return -1;
            if (a->dense != dense || a->lo != lo || a->span != span) break;
            cells[q] = c;
        }
        if (q == count) return 0;
    }
}

/* totals[cell] += g[row] for the block's owner rows, in row order; one loop per gradient type. */
#define FLOAT_ADDS(T)                                                                                        \
    {                                                                                                        \
        const T *gv = (const T *)g->values.buf + start;                                                      \
        for (int q = 0; q < count; q++) {                                                                    \
            double x = (double)gv[sel[q]];                                                                   \
            if (check && !isfinite(x)) {                                                                     \
                stop->status = NONFINITE, stop->row = start + sel[q];                                        \
                return -1;                                                                                   \
            }                                                                                                \
            t[cells[q]] += x;                                                                                \
            seen[cells[q]] = 1;                                                                              \
        }                                                                                                    \
    }
#define INT_ADDS(T)                                                                                          \
    {                                                                                                        \
        const T *gv = (const T *)g->values.buf + start;                                                      \
        for (int q = 0; q < count; q++) {                                                                    \
            int64_t before = ti[cells[q]];                                                                   \
            if (__builtin_add_overflow(before, (int64_t)gv[sel[q]], &ti[cells[q]])) {                         \
                stop->status = OVERFLOW, stop->row = start + sel[q], stop->before = before;                  \
                return -1;                                                                                   \
            }                                                                                                \
            seen[cells[q]] = 1;                                                                              \
        }                                                                                                    \
    }

static int add_block(Table *a, const Column *g, int64_t start, const int *sel, const int64_t *cells, int count,
                     Stop *stop) {
    double *t = a->totals;
    int64_t *ti = a->totals;
    uint8_t *seen = a->seen;
    int check = a->raise_nonfinite;
    switch (g->values.format[0]) {
    case 'd': FLOAT_ADDS(double) break;
    case 'f': FLOAT_ADDS(float) break;
    case 'q': INT_ADDS(int64_t) break;
    case 'i': INT_ADDS(int32_t) break;
    default: break;
    }
    return 0;
}

/* The block's owner rows into sel (without a branch per row); their count. */
static int owner_rows(const Column *w, const Column *o, const uint32_t *perm, int64_t start, int m, int *sel) {
    int count = 0;
    if (perm) {
        const uint32_t *wi = (const uint32_t *)w->indices.buf + start, *oi = (const uint32_t *)o->indices.buf + start;
        for (int j = 0; j < m; j++) {
            sel[count] = j;
            count += wi[j] == perm[oi[j]];
        }
        return count;
    }
    int64_t ws[BLOCK], os[BLOCK];
    load_ids(w, start, m, ws);
    load_ids(o, start, m, os);
    for (int j = 0; j < m; j++) {
        sel[count] = j;
        count += ws[j] == os[j];
    }
    return count;
}

static void run(Table *a, Column *s, Column *w, Column *o, Column *g, Stop *stop) {
    int64_t ids[BLOCK], cells[BLOCK];
    int sel[BLOCK];
    uint32_t *perm = owner_in_worker_terms(w, o);
    for (int64_t start = 0; start < s->n; start += BLOCK) {
        int m = s->n - start < BLOCK ? (int)(s->n - start) : BLOCK;
        int count = owner_rows(w, o, perm, start, m, sel);
        if (s->cells) {
            const uint32_t *ix = (const uint32_t *)s->indices.buf + start;
            for (int q = 0; q < count; q++) cells[q] = s->cells[ix[sel[q]]];
        } else {
            load_ids(s, start, m, ids);
            if (block_cells(a, ids, sel, count, cells)) {
                stop->status = NOMEM, stop->row = start;
                break;
            }
        }
        if (add_block(a, g, start, sel, cells, count, stop)) break;
    }
    free(perm);
}

/* --- Python ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Table t;
    int ready, busy;
} Acc;

static int acc_init(Acc *a, PyObject *args, PyObject *kw) {
    static char *names[] = {"ints", "raise_nonfinite", NULL};
    if (a->ready) {
        PyErr_SetString(PyExc_TypeError, "a Table is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "pp", names, &a->t.ints, &a->t.raise_nonfinite)) return -1;
    a->t.dense = a->ready = 1;
    return 0;
}

static void acc_dealloc(Acc *a) {
    table_free(&a->t);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

PyDoc_STRVAR(update_doc,
"update(shards, workers, owners, gradients) -> (status, row, before)\n"
"\n"
"Each argument is (values, indices or None): typed buffers, indices uint32 into the values.\n"
"status 0: every owner row added; 1: the gradient of `row` is NaN/Inf (raise_nonfinite);\n"
"2: adding `row` would take its shard's integer total (`before`) beyond int64.");

static PyObject *acc_update(Acc *a, PyObject *args) {
    PyObject *spec[4];
    Table *t = &a->t;
    if (!PyArg_ParseTuple(args, "OOOO", &spec[0], &spec[1], &spec[2], &spec[3])) return NULL;
    if (a->busy || !a->ready) {
        PyErr_SetString(PyExc_RuntimeError, "an owner-sum table is initialised first, updated by one thread at a time");
        return NULL;
    }
    Column c[4];
    memset(c, 0, sizeof c);
    const char *names[4] = {"shard_ids", "worker_ids", "owner_ids", "gradients"};
    PyObject *result = NULL;
    int k = 0;
    for (; k < 4; k++)
        if (column_get(spec[k], k == 3 ? (t->ints ? "iq" : "fd") : "iq", names[k], &c[k])) break;
    if (k == 4 && c[3].dict) {
        PyErr_SetString(PyExc_TypeError, "gradients: materialise dictionary-encoded gradients first");
        k = 0;
    }
    if (k == 4 && (c[1].n != c[0].n || c[2].n != c[0].n || c[3].n != c[0].n)) {
        PyErr_Format(PyExc_ValueError, "columns differ in length: %lld, %lld, %lld, %lld rows", (long long)c[0].n,
                     (long long)c[1].n, (long long)c[2].n, (long long)c[3].n);
        k = 0;
    }
    if (k == 4) {
        Stop stop = {OK, -1, 0};
        a->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        if (c[0].dict && map_dictionary(t, &c[0])) stop.status = NOMEM;
        else run(t, &c[0], &c[1], &c[2], &c[3], &stop);
        Py_END_ALLOW_THREADS
        a->busy = 0;
        if (stop.status == NOMEM) PyErr_NoMemory();
        else result = Py_BuildValue("(iLL)", stop.status, (long long)stop.row, (long long)stop.before);
    }
    for (int j = 0; j < 4; j++) column_release(&c[j]);
    return result;
}

PyDoc_STRVAR(result_doc,
"result() -> (shards, totals): bytes of int64 shard ids (ascending) and of their float64 or int64 totals,\n"
"the shards with an owner row only.");

static PyObject *acc_result(Acc *a, PyObject *unused) {
    (void)unused;
    if (!a->ready) {
        PyErr_SetString(PyExc_RuntimeError, "an owner-sum table is initialised first");
        return NULL;
    }
    int64_t n = table_count(&a->t);
    PyObject *keys = PyBytes_FromStringAndSize(NULL, n * 8), *totals = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!keys || !totals || table_export(&a->t, (int64_t *)PyBytes_AS_STRING(keys), PyBytes_AS_STRING(totals))) {
        Py_XDECREF(keys);
        Py_XDECREF(totals);
        return PyErr_NoMemory();
    }
    return Py_BuildValue("(NN)", keys, totals);
}

static PyMethodDef acc_methods[] = {
    {"update", (PyCFunction)acc_update, METH_VARARGS, update_doc},
    {"result", (PyCFunction)acc_result, METH_NOARGS, result_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AccType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradagg._native._ownersum.Table",
    .tp_basicsize = sizeof(Acc),
    .tp_dealloc = (destructor)acc_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Table(ints, raise_nonfinite): owner-sum totals per shard, fed batches of columns in row order.",
    .tp_methods = acc_methods,
    .tp_init = (initproc)acc_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gradagg._native._ownersum",
    "The owner-sum table of gradagg.backends.native.", -1, NULL,
};

PyMODINIT_FUNC PyInit__ownersum(void) {
    if (PyType_Ready(&AccType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&AccType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&AccType) < 0) {
        Py_DECREF(&AccType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
