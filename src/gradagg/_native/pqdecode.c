/* gradagg._native._pqdecode: stream the values of one Parquet column chunk (flat INT32/INT64/FLOAT/DOUBLE).
 *
 * Decoding only (no contract here): a Decoder walks the pages of one column chunk (dictionary page, data
 * pages v1 and v2), UNCOMPRESSED or SNAPPY, PLAIN or RLE_DICTIONARY/PLAIN_DICTIONARY values, RLE definition
 * levels of an OPTIONAL column that must hold no null, and hands out the values a batch at a time. Anything
 * else is refused with a message; the Python side (gradagg.formats.parquet_native) sends only chunks its
 * footer check accepted.
 *
 * Batches: read(m) returns the next m values as a typed buffer, or, while every page is dictionary-encoded
 * and the dictionary is small, the dictionary (one buffer for the whole chunk) and m uint32 indices into it.
 * Whole pages decode straight into the batch; a page that straddles two batches is decoded aside once.
 * Batch buffers come from a pool of freed ones (buffer.h), so a stream of batches touches little fresh memory.
 *
 * Hostile input: every length read from the file is checked against the bytes there (pqformat.h); values
 * out number the caller's count (bounded by the caller from the row group's row count), never a page's;
 * dictionary indices are checked against the dictionary. read() runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"
#include "pqformat.h"

enum { T_INT32 = 1, T_INT64 = 2, T_FLOAT = 4, T_DOUBLE = 5 }; /* parquet.thrift Type */
enum { C_UNCOMPRESSED = 0, C_SNAPPY = 1 };                    /* CompressionCodec */

typedef struct {
    PyObject_HEAD
    Py_buffer data;                  /* the column chunk's bytes */
    const uint8_t *at, *end;         /* the next page header */
    int codec, max_def, busy;
    size_t size;                     /* bytes per value */
    const char *format;
    int64_t n, done, paged;          /* values in the chunk, returned, in the data pages parsed so far */
    int64_t max_dict;                /* indices are returned while the dictionary has at most this many values */
    uint8_t *dict;                   /* the dictionary's values (owned by dict_obj once that exists) */
    size_t dict_cap;
    int64_t dict_n;
    PyObject *dict_obj;              /* the dictionary as a Buffer, shared by every batch of indices */
    int plain_seen;                  /* a PLAIN data page came: later batches are values */
    uint8_t *page;                   /* a data page decoded aside: page_n values (or indices), page_used taken */
    size_t page_cap;
    int page_idx;
    int64_t page_n, page_used;
    uint8_t *scratch;                /* a decompressed page */
    size_t scratch_cap;
    uint32_t *tmp;                   /* a page's indices before they become values */
    size_t tmp_cap;
} Decoder;

typedef struct { /* one batch being filled: values or indices */
    uint8_t *vals;
    uint32_t *idx;
    size_t cap;
    int64_t got, m;
} Out;

static void *grow(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return *buf;
    void *p = realloc(*buf, need ? need : 1);
    if (!p) return NULL;
    *buf = p;
    *cap = need;
    return p;
}

/* A page's payload decompressed: in place when uncompressed, else into `to` or the scratch buffer. */
static const uint8_t *inflate(Decoder *d, const uint8_t *src, size_t n, size_t out_len, uint8_t *to, Status *st) {
    if (d->codec == C_UNCOMPRESSED) {
        if (n != out_len) {
            fail(st, "an uncompressed page holds %zu bytes but says %zu", n, out_len);
            return NULL;
        }
        return src;
    }
    if (out_len > 32 * n + 1024) { /* snappy expands at most ~21x: refuse before allocating for a lie */
        fail(st, "a page of %zu snappy bytes claims %zu bytes decompressed", n, out_len);
        return NULL;
    }
    if (!to && !(to = grow((void **)&d->scratch, &d->scratch_cap, out_len))) {
        fail(st, "out of memory for a page of %zu bytes", out_len);
        return NULL;
    }
    if (snappy(src, n, to, out_len)) {
        fail(st, "a page's snappy data is corrupt (%zu bytes, %zu expected out)", n, out_len);
        return NULL;
    }
    return to;
}

static void gather(const Decoder *d, const uint32_t *idx, int64_t n, uint8_t *out) {
    if (d->size == 8)
        for (int64_t i = 0; i < n; i++) memcpy(out + 8 * i, d->dict + 8 * (size_t)idx[i], 8);
    else
        for (int64_t i = 0; i < n; i++) memcpy(out + 4 * i, d->dict + 4 * (size_t)idx[i], 4);
}

/* n values of one page, PLAIN or dictionary-encoded, into dest (indices if dest_idx, else values). */
static int page_values(Decoder *d, int encoding, const uint8_t *p, size_t len, int64_t n, uint8_t *dest,
                       int dest_idx, Status *st) {
    if (encoding == E_PLAIN) {
        if (dest_idx) return fail(st, "a plain page where indices were expected");
        if (len < (size_t)n * d->size) return fail(st, "a plain page holds %zu bytes for %lld values", len, (long long)n);
        if (dest != p) memcpy(dest, p, (size_t)n * d->size);
        return 0;
    }
    if (encoding != E_RLE_DICTIONARY && encoding != E_PLAIN_DICTIONARY)
        return fail(st, "a data page has encoding %d, which this reader does not decode", encoding);
    if (!d->dict) return fail(st, "a dictionary-encoded page comes before any dictionary page");
    if (len < 1 || p[0] > 32) return fail(st, "a dictionary page's bit width is missing or above 32");
    uint32_t *idx = dest_idx ? (uint32_t *)dest : grow((void **)&d->tmp, &d->tmp_cap, (size_t)n * 4);
    if (!idx) return fail(st, "out of memory for %lld indices", (long long)n);
    if (rle(p + 1, len - 1, p[0], n, idx, st)) return -1;
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) top = idx[i] > top ? idx[i] : top;
    if (n && (int64_t)top >= d->dict_n)
        return fail(st, "dictionary index %u, the dictionary has %lld values", top, (long long)d->dict_n);
    if (!dest_idx) gather(d, idx, n, dest);
    return 0;
}

static int check_levels(Decoder *d, const uint8_t *p, size_t len, int64_t n, Status *st) {
    int64_t at;
    int r = levels_all_present(p, len, n, &at, st);
    if (r > 0) {
        st->null_at = d->paged + at;
        return fail(st, "value %lld is null", (long long)st->null_at);
    }
    return r;
}

static int data_page_v1(Decoder *d, const PageHeader *h, const uint8_t *p, uint8_t *dest, int dest_idx,
                        Status *st) {
    int64_t n = h->num_values;
    size_t len = (size_t)h->uncompressed;
    /* a plain page of a REQUIRED column is nothing but its values: it decompresses into place */
    int direct = d->max_def == 0 && h->encoding == E_PLAIN && !dest_idx && len == (size_t)n * d->size;
    const uint8_t *data = inflate(d, p, (size_t)h->compressed, len, direct ? dest : NULL, st);
    if (!data) return -1;
    if (d->max_def > 0) {
        if (h->level_encoding != E_RLE) return fail(st, "definition levels have encoding %d", h->level_encoding);
        if (len < 4) return fail(st, "a page's definition levels are missing");
        uint32_t lv = (uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 | (uint32_t)data[3] << 24;
        if (lv > len - 4) return fail(st, "definition levels of %u bytes in a page of %zu", lv, len);
        if (check_levels(d, data + 4, lv, n, st)) return -1;
        data += 4 + lv;
        len -= 4 + lv;
    }
    return page_values(d, h->encoding, data, len, n, dest, dest_idx, st);
}

static int data_page_v2(Decoder *d, const PageHeader *h, const uint8_t *p, uint8_t *dest, int dest_idx,
                        Status *st) {
    int64_t n = h->num_values;
    if (h->def_bytes < 0 || h->rep_bytes != 0 || h->def_bytes > h->compressed || h->def_bytes > h->uncompressed)
        return fail(st, "a v2 page's level lengths do not fit it (or it has repetition levels)");
    if (h->def_bytes && d->max_def == 0) return fail(st, "a v2 page has definition levels in a REQUIRED column");
    if (d->max_def > 0 && check_levels(d, p, (size_t)h->def_bytes, n, st)) return -1;
    if (h->num_nulls > 0) return fail(st, "a v2 page counts %d nulls", h->num_nulls);
    size_t in = (size_t)(h->compressed - h->def_bytes), out = (size_t)(h->uncompressed - h->def_bytes);
    const uint8_t *src = p + h->def_bytes, *data = src;
    if (h->is_compressed && d->codec != C_UNCOMPRESSED) {
        int direct = h->encoding == E_PLAIN && !dest_idx && out == (size_t)n * d->size;
        data = inflate(d, src, in, out, direct ? dest : NULL, st);
        if (!data) return -1;
    } else if (in != out) {
        return fail(st, "an uncompressed v2 page holds %zu bytes but says %zu", in, out);
    }
    return page_values(d, h->encoding, data, out, n, dest, dest_idx, st);
}

static int dictionary_page(Decoder *d, const PageHeader *h, const uint8_t *p, Status *st) {
    if (d->dict) return fail(st, "a second dictionary page");
    if (h->has_sub != 7 || h->num_values < 0) return fail(st, "a dictionary page without its header");
    if (h->encoding != E_PLAIN && h->encoding != E_PLAIN_DICTIONARY)
        return fail(st, "a dictionary page has encoding %d", h->encoding);
    const uint8_t *data = inflate(d, p, (size_t)h->compressed, (size_t)h->uncompressed, NULL, st);
    if (!data) return -1;
    size_t bytes = (size_t)h->num_values * d->size;
    if ((size_t)h->uncompressed < bytes)
        return fail(st, "a dictionary page holds %d bytes for %d values", h->uncompressed, h->num_values);
    d->dict_cap = bytes ? bytes : 1;
    if (!(d->dict = malloc(d->dict_cap))) return fail(st, "out of memory for a dictionary");
    memcpy(d->dict, data, bytes);
    d->dict_n = h->num_values;
    return 0;
}

/* The next data page's header and payload (dictionary and index pages on the way are taken care of). */
static int next_data_page(Decoder *d, PageHeader *h, const uint8_t **payload, Status *st) {
    for (;;) {
        if (d->at >= d->end)
            return fail(st, "the column chunk ends after %lld of its %lld values", (long long)d->paged,
                        (long long)d->n);
        Cursor c = {d->at, d->end};
        if (page_header(&c, h))
            return fail(st, "a page header is corrupt (at byte %zu)", (size_t)(d->at - (const uint8_t *)d->data.buf));
        if (h->compressed < 0 || h->uncompressed < 0 || (size_t)h->compressed > (size_t)(c.end - c.p))
            return fail(st, "a page of %d bytes, %zu are left in the chunk", h->compressed, (size_t)(c.end - c.p));
        *payload = c.p;
        d->at = c.p + h->compressed;
        if (h->type == P_INDEX) continue;
        if (h->type == P_DICTIONARY) {
            if (dictionary_page(d, h, *payload, st)) return -1;
            continue;
        }
        if (h->type != P_DATA && h->type != P_DATA_V2) return fail(st, "a page of unknown type %d", h->type);
        if (h->has_sub != (h->type == P_DATA ? 5 : 8) || h->num_values < 0)
            return fail(st, "a data page without its header");
        if (h->num_values > d->n - d->paged)
            return fail(st, "data pages hold more than the chunk's %lld values", (long long)d->n);
        return 0;
    }
}

static int decode_page(Decoder *d, const PageHeader *h, const uint8_t *p, uint8_t *dest, int dest_idx, Status *st) {
    int rc = (h->type == P_DATA ? data_page_v1 : data_page_v2)(d, h, p, dest, dest_idx, st);
    d->paged += h->num_values;
    return rc;
}

/* The batch so far becomes values: a plain page came, or the dictionary is too big to pass along. */
static int to_values(Decoder *d, Out *o, Status *st) {
    size_t cap = (size_t)o->m * d->size + 1;
    uint8_t *vals = malloc(cap);
    if (!vals) return fail(st, "out of memory for %lld values", (long long)o->m);
    gather(d, o->idx, o->got, vals);
    free(o->idx);
    o->idx = NULL;
    o->vals = vals;
    o->cap = cap;
    return 0;
}

/* Take what the batch needs from the page decoded aside. */
static int from_page(Decoder *d, Out *o, Status *st) {
    int64_t k = d->page_n - d->page_used < o->m - o->got ? d->page_n - d->page_used : o->m - o->got;
    if (o->idx && !d->page_idx && to_values(d, o, st)) return -1;
    if (d->page_idx && o->idx)
        memcpy(o->idx + o->got, (uint32_t *)d->page + d->page_used, (size_t)k * 4);
    else if (d->page_idx)
        gather(d, (uint32_t *)d->page + d->page_used, k, o->vals + o->got * d->size);
    else
        memcpy(o->vals + o->got * d->size, d->page + d->page_used * d->size, (size_t)k * d->size);
    d->page_used += k;
    o->got += k;
    return 0;
}

static int fill(Decoder *d, Out *o, Status *st) {
    while (o->got < o->m) {
        if (d->page_used < d->page_n) {
            if (from_page(d, o, st)) return -1;
            continue;
        }
        PageHeader h;
        const uint8_t *p = NULL;
        if (next_data_page(d, &h, &p, st)) return -1;
        int dict_page = h.encoding == E_RLE_DICTIONARY || h.encoding == E_PLAIN_DICTIONARY;
        d->plain_seen |= !dict_page;
        if (o->idx && (!dict_page || d->dict_n > d->max_dict) && to_values(d, o, st)) return -1;
        int64_t n = h.num_values;
        if (n <= o->m - o->got) { /* the whole page, straight into the batch */
            uint8_t *dest = o->idx ? (uint8_t *)(o->idx + o->got) : o->vals + o->got * d->size;
            if (decode_page(d, &h, p, dest, o->idx != NULL, st)) return -1;
            o->got += n;
            continue;
        }
        d->page_idx = o->idx != NULL; /* (an index page only while the batch is indices) */
        if (!grow((void **)&d->page, &d->page_cap, (size_t)n * (d->page_idx ? 4 : d->size) + 1))
            return fail(st, "out of memory for a page of %lld values", (long long)n);
        if (decode_page(d, &h, p, d->page, d->page_idx, st)) return -1;
        d->page_n = n;
        d->page_used = 0;
    }
    return 0;
}

/* --- Python ------------------------------------------------------------------------------------------- */

static PyObject *Malformed, *NullValue;

static int decoder_init(Decoder *d, PyObject *args, PyObject *kw) {
    static char *names[] = {"data", "physical_type", "codec", "num_values", "max_definition_level",
                            "max_dictionary", NULL};
    int ptype;
    long long n, max_dict;
    if (d->data.obj) {
        PyErr_SetString(PyExc_TypeError, "a Decoder is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*iiLiL", names, &d->data, &ptype, &d->codec, &n, &d->max_def,
                                     &max_dict))
        return -1;
    static const char *formats[] = {NULL, "i", "q", NULL, "f", "d"};
    d->format = ptype >= 0 && ptype <= T_DOUBLE ? formats[ptype] : NULL;
    if (!d->format || (d->codec != C_UNCOMPRESSED && d->codec != C_SNAPPY) || n < 0 || n > ((int64_t)1 << 40) ||
        d->max_def < 0 || d->max_def > 1) {
        PyErr_SetString(PyExc_ValueError, "Decoder: a type, codec, count or level this decoder does not take");
        return -1;
    }
    d->size = (ptype == T_INT64 || ptype == T_DOUBLE) ? 8 : 4;
    d->n = n;
    d->max_dict = max_dict;
    d->at = d->data.buf;
    d->end = d->at + d->data.len;
    return 0;
}

static void decoder_dealloc(Decoder *d) {
    if (d->data.obj) PyBuffer_Release(&d->data);
    if (d->dict_obj) Py_DECREF(d->dict_obj);
    else free(d->dict);
    free(d->page);
    free(d->scratch);
    free(d->tmp);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyObject *batch(Decoder *d, Out *o) { /* (values, indices or None) of a filled batch */
    if (!o->idx) return Py_BuildValue("(NO)", buffer_new(o->vals, o->cap, o->m, d->format, (Py_ssize_t)d->size),
                                      Py_None);
    if (!d->dict_obj) {
        d->dict_obj = buffer_new(d->dict, d->dict_cap, d->dict_n, d->format, (Py_ssize_t)d->size);
        if (!d->dict_obj) {
            d->dict = NULL;
            free(o->idx);
            return NULL;
        }
    }
    return Py_BuildValue("(ON)", d->dict_obj, buffer_new(o->idx, o->cap, o->m, "I", 4));
}

PyDoc_STRVAR(read_doc,
"read(m) -> (values, indices)\n"
"\n"
"The chunk's next m values: a typed buffer and None; or, while every page is dictionary-encoded and the\n"
"dictionary has at most max_dictionary values, the dictionary and m uint32 indices into it.\n"
"Raises Malformed (a ValueError) for what it cannot decode, NullValue(k) for a null value k of the chunk.");

static PyObject *decoder_read(Decoder *d, PyObject *arg) {
    long long m = PyLong_AsLongLong(arg);
    if (m == -1 && PyErr_Occurred()) return NULL;
    if (!d->data.obj || m < 0 || m > d->n - d->done || d->busy) {
        PyErr_Format(PyExc_ValueError, "read(%lld): %lld of %lld values are left (or the decoder is busy)", m,
                     (long long)(d->n - d->done), (long long)d->n);
        return NULL;
    }
    Out o = {NULL, NULL, 0, 0, m};
    int idx = d->max_dict > 0 && !d->plain_seen && (!d->dict || d->dict_n <= d->max_dict) && m > 0;
    o.idx = idx ? pool_take((size_t)m * 4, &o.cap) : NULL;
    o.vals = idx ? NULL : pool_take((size_t)m * d->size, &o.cap);
    if (!o.idx && !o.vals) return PyErr_NoMemory();
    Status st = {{0}, -1};
    int rc;
    d->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = fill(d, &o, &st);
    Py_END_ALLOW_THREADS
    d->busy = 0;
    if (rc) {
        pool_give(o.idx ? (void *)o.idx : (void *)o.vals, o.cap);
        if (st.null_at >= 0)
            PyErr_SetObject(NullValue, PyLong_FromLongLong(st.null_at));
        else
            PyErr_SetString(Malformed, st.msg);
        d->done = d->n; /* a broken chunk reads no further */
        return NULL;
    }
    d->done += m;
    return batch(d, &o);
}

static PyMethodDef decoder_methods[] = {
    {"read", (PyCFunction)decoder_read, METH_O, read_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradagg._native._pqdecode.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_dealloc = (destructor)decoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Decoder(data, physical_type, codec, num_values, max_definition_level, max_dictionary):\n"
              "the values of one column chunk, a batch at a time (read).",
    .tp_methods = decoder_methods,
    .tp_init = (initproc)decoder_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gradagg._native._pqdecode",
    "Decode flat numeric Parquet column chunks (see gradagg.formats.parquet_native).", -1, NULL,
};

PyMODINIT_FUNC PyInit__pqdecode(void) {
    if (buffer_ready() < 0 || PyType_Ready(&DecoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Malformed = PyErr_NewException("gradagg._native._pqdecode.Malformed", PyExc_ValueError, NULL);
    NullValue = PyErr_NewException("gradagg._native._pqdecode.NullValue", PyExc_ValueError, NULL);
    Py_XINCREF(Malformed);
    Py_XINCREF(NullValue);
    Py_INCREF(&DecoderType);
    if (!Malformed || !NullValue || PyModule_AddObject(m, "Malformed", Malformed) < 0 ||
        PyModule_AddObject(m, "NullValue", NullValue) < 0 ||
        PyModule_AddObject(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
