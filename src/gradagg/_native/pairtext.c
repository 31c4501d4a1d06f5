/* gradagg._native._pairtext: an owner-sum result's two columns as JSON or CSV text, in C.
 *
 * pairs_text(shards, totals, csv) writes exactly what gradagg.formats.text writes from the same values as
 * Python objects, byte for byte, in one growing buffer instead of one Python object per number:
 *
 *   JSON (csv false): json.dumps(list(zip(shards.tolist(), totals.tolist()))), e.g. [[1, 2.5], [3, -0.0]];
 *                     NaN, Infinity, -Infinity as json writes them by default (allow_nan=True); [] when empty.
 *   CSV  (csv true):  one line "shard,total\n" per pair, each number as repr() writes it (nan, inf, -inf);
 *                     the header line is the Python side's.
 *
 * A float is float.__repr__'s own text: PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0), the shortest
 * string that reads back to the same double. That call allocates with PyMem_Malloc and runs CPython's dtoa,
 * whose caches are shared: both need the GIL, so the whole call keeps it (nothing here runs Python code, so
 * the buffers cannot change underneath). An int64 is written digit by digit, the digits int.__repr__ gives.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* --- the growing buffer ------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
} Text;

/* Room for `more` bytes after the end (doubling, so n appends cost O(n)); -1 with MemoryError set. */
static int reserve(Text *t, size_t more) {
    if (t->cap - t->len >= more) return 0;
    size_t cap = t->cap ? t->cap : 4096;
    while (cap - t->len < more) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *data = realloc(t->data, cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    t->data = data;
    t->cap = cap;
    return 0;
}

/* Callers reserve first: these only copy. */
static void put(Text *t, const char *s, size_t n) {
    memcpy(t->data + t->len, s, n);
    t->len += n;
}

static void put_int(Text *t, int64_t v) {
    char digits[20];
    int n = 0;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v; /* (INT64_MIN's magnitude fits uint64) */
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) t->data[t->len++] = '-';
    while (n) t->data[t->len++] = digits[--n];
}

#define INT_CHARS 20 /* "-9223372036854775808" */

/* A float64 as json writes it (json: non-finite as NaN/Infinity) or as repr() does (csv: nan/inf). */
static int put_float(Text *t, double x, int csv) {
    if (!csv && !isfinite(x)) {
        const char *word = isnan(x) ? "NaN" : x > 0 ? "Infinity" : "-Infinity";
        if (reserve(t, 16)) return -1;
        put(t, word, strlen(word));
        return 0;
    }
    char *s = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!s) return -1;
    size_t n = strlen(s);
    int failed = reserve(t, n + 8); /* (+8: the bytes that close the pair) */
    if (!failed) put(t, s, n);
    PyMem_Free(s);
    return failed;
}

/* --- Python ------------------------------------------------------------------------------------------- */

static int get_column(PyObject *obj, const char *formats, const char *name, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (view->ndim != 1 || !f[0] || f[1] || !strchr(formats, f[0]) || view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "%s: a buffer of format %s, expected one dimension of format %s", name, f,
                     formats);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int write_pairs(Text *t, const Py_buffer *s, const Py_buffer *v, Py_ssize_t n, int csv) {
    const int64_t *shards = s->buf;
    int ints = v->format[0] == 'q';
    if (!csv && reserve(t, 2)) return -1;
    if (!csv) put(t, "[", 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (reserve(t, 4 + INT_CHARS + 2 + INT_CHARS + 8)) return -1;
        if (!csv) put(t, i ? ", [" : "[", i ? 3 : 1);
        put_int(t, shards[i]);
        put(t, csv ? "," : ", ", csv ? 1 : 2);
        if (ints) put_int(t, ((const int64_t *)v->buf)[i]);
        else if (put_float(t, ((const double *)v->buf)[i], csv)) return -1;
        put(t, csv ? "\n" : "]", 1); /* (room: reserved with the total) */
    }
    if (!csv) put(t, "]", 1); /* (room: the pair's reserve, or the opening one when n == 0) */
    return 0;
}

PyDoc_STRVAR(pairs_text_doc,
"pairs_text(shards, totals, csv) -> str\n"
"\n"
"shards: int64 buffer (format q); totals: float64 or int64 buffer (d or q) of the same length.\n"
"csv false: json.dumps(list(zip(shards.tolist(), totals.tolist()))), byte for byte;\n"
"csv true: the CSV lines 'shard,total\\n' (repr of each number), without a header.");

static PyObject *pairs_text(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *shards_obj, *totals_obj;
    int csv;
    if (!PyArg_ParseTuple(args, "OOp", &shards_obj, &totals_obj, &csv)) return NULL;
    Py_buffer s, v;
    if (get_column(shards_obj, "q", "shards", &s)) return NULL;
    if (get_column(totals_obj, "dq", "totals", &v)) {
        PyBuffer_Release(&s);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = s.len / 8;
    Text t = {NULL, 0, 0};
    if (v.len / 8 != n)
        PyErr_Format(PyExc_ValueError, "shards has %zd values but totals %zd", n, v.len / 8);
    else if (!write_pairs(&t, &s, &v, n, csv) && (result = PyUnicode_New((Py_ssize_t)t.len, 127)))
        if (t.len) memcpy(PyUnicode_1BYTE_DATA(result), t.data, t.len); /* ASCII: digits, - + . e, words */
    free(t.data);
    PyBuffer_Release(&s);
    PyBuffer_Release(&v);
    return result;
}

static PyMethodDef methods[] = {
    {"pairs_text", pairs_text, METH_VARARGS, pairs_text_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gradagg._native._pairtext",
    "An owner-sum result's columns as the JSON or CSV text of gradagg.formats.text.", -1, methods,
};

PyMODINIT_FUNC PyInit__pairtext(void) { return PyModule_Create(&module); }
