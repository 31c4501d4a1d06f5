/* The Parquet page formats, as pure functions over bytes: Thrift compact page headers, snappy, RLE/bit-packing.
 *
 * Included by pqdecode.c only. Every function takes the bytes it may read as (pointer, length) and checks
 * each length read from them before using it; none allocates.
 */
#ifndef GRADAGG_PQFORMAT_H
#define GRADAGG_PQFORMAT_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { E_PLAIN = 0, E_PLAIN_DICTIONARY = 2, E_RLE = 3, E_RLE_DICTIONARY = 8 };     /* Encoding */
enum { P_DATA = 0, P_INDEX = 1, P_DICTIONARY = 2, P_DATA_V2 = 3 };                /* PageType */

typedef struct {
    char msg[240];
    int64_t null_at; /* >= 0: the value (counted in the chunk) that is null */
} Status;

static int fail(Status *st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->msg, sizeof st->msg, fmt, ap);
    va_end(ap);
    return -1;
}

/* --- Thrift compact protocol: just what a PageHeader needs ------------------------------------------ */

typedef struct {
    const uint8_t *p, *end;
} Cursor;

static int varint(Cursor *c, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (c->p >= c->end) return -1;
        uint8_t b = *c->p++;
        if (shift == 63 && b > 1) return -1; /* more than 64 bits */
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static int zigzag(Cursor *c, int64_t *out) {
    uint64_t v;
    if (varint(c, &v)) return -1;
    *out = (int64_t)(v >> 1) ^ -(int64_t)(v & 1);
    return 0;
}

static int i32(Cursor *c, int32_t *out) {
    int64_t v;
    if (zigzag(c, &v) || v < INT32_MIN || v > INT32_MAX) return -1;
    *out = (int32_t)v;
    return 0;
}

static int skip(Cursor *c, int type, int depth);

static int skip_struct(Cursor *c, int depth) {
    if (depth > 16) return -1; /* nesting a real header never needs: refuse instead of recursing */
    for (;;) {
        if (c->p >= c->end) return -1;
        uint8_t b = *c->p++;
        if (b == 0) return 0;
        if (!(b >> 4)) { /* a long-form field id follows */
            int64_t id;
            if (zigzag(c, &id)) return -1;
        }
        if (skip(c, b & 0x0f, depth + 1)) return -1;
    }
}

static int skip(Cursor *c, int type, int depth) {
    uint64_t n;
    switch (type) {
    case 1: case 2: return 0;                     /* a bool in a field header holds its value */
    case 3: if (c->p >= c->end) return -1; c->p++; return 0;
    case 4: case 5: case 6: return varint(c, &n);
    case 7: if (c->end - c->p < 8) return -1; c->p += 8; return 0;
    case 8:
        if (varint(c, &n) || n > (uint64_t)(c->end - c->p)) return -1;
        c->p += n;
        return 0;
    case 9: case 10: {
        if (c->p >= c->end) return -1;
        uint8_t h = *c->p++;
        n = h >> 4;
        if (n == 15 && varint(c, &n)) return -1;
        if (n > (uint64_t)(c->end - c->p)) return -1; /* every element takes a byte at least */
        int elem = h & 0x0f;
        for (uint64_t k = 0; k < n; k++) {
            if (elem == 1 || elem == 2) { /* bools in a list are one byte each */
                if (c->p >= c->end) return -1;
                c->p++;
            } else if (skip(c, elem, depth + 1)) {
                return -1;
            }
        }
        return 0;
    }
    case 11: {
        if (varint(c, &n)) return -1;
        if (n == 0) return 0;
        if (n > (uint64_t)(c->end - c->p)) return -1;
        uint8_t kv = *c->p++;
        for (uint64_t k = 0; k < n; k++)
            if (skip(c, kv >> 4, depth + 1) || skip(c, kv & 0x0f, depth + 1)) return -1;
        return 0;
    }
    case 12: return skip_struct(c, depth);
    default: return -1;
    }
}

/* Iterate a struct's fields: returns 1 with (*id, *type) for a field, 0 at its end, -1 on bad input. */
static int field(Cursor *c, int *last, int *id, int *type) {
    if (c->p >= c->end) return -1;
    uint8_t b = *c->p++;
    if (b == 0) return 0;
    if (b >> 4) {
        *id = *last + (b >> 4);
    } else {
        int64_t v;
        if (zigzag(c, &v) || v < INT16_MIN || v > INT16_MAX) return -1;
        *id = (int)v;
    }
    *last = *id;
    *type = b & 0x0f;
    return 1;
}

typedef struct {
    int32_t type, uncompressed, compressed;
    int32_t num_values, encoding, level_encoding; /* data page v1 (and the dictionary page's first two) */
    int32_t num_nulls, def_bytes, rep_bytes;      /* data page v2 */
    int is_compressed, has_sub;
} PageHeader;

/* Read a struct of i32 fields (and bools) into slots[field id] (ids 1..8); skip anything else. */
static int i32_fields(Cursor *c, int32_t *slots, int *is_compressed, int depth) {
    int last = 0, id, type, r;
    while ((r = field(c, &last, &id, &type)) == 1) {
        if (type == 5 && id >= 1 && id <= 8) {
            if (i32(c, &slots[id])) return -1;
        } else if ((type == 1 || type == 2) && id == 7 && is_compressed) {
            *is_compressed = type == 1;
        } else if (skip(c, type, depth + 1)) {
            return -1;
        }
    }
    return r;
}

static int page_header(Cursor *c, PageHeader *h) {
    int32_t top[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
    int32_t sub[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
    int last = 0, id, type, r;
    memset(h, 0, sizeof *h);
    h->is_compressed = 1; /* DataPageHeaderV2.is_compressed defaults to true */
    while ((r = field(c, &last, &id, &type)) == 1) {
        if (type == 5 && id >= 1 && id <= 3) {
            if (i32(c, &top[id])) return -1;
        } else if (type == 12 && (id == 5 || id == 7 || id == 8)) {
            if (h->has_sub) return -1; /* one page, one kind of header */
            h->has_sub = id;
            if (i32_fields(c, sub, id == 8 ? &h->is_compressed : NULL, 1)) return -1;
        } else if (skip(c, type, 1)) {
            return -1;
        }
    }
    if (r < 0 || top[1] < 0 || top[2] < 0 || top[3] < 0) return -1;
    h->type = top[1];
    h->uncompressed = top[2];
    h->compressed = top[3];
    h->num_values = sub[1];
    if (h->has_sub == 8) {
        h->num_nulls = sub[2];
        h->encoding = sub[4];
        h->def_bytes = sub[5];
        h->rep_bytes = sub[6];
    } else {
        h->encoding = sub[2];
        h->level_encoding = sub[3];
    }
    return 0;
}

/* --- Snappy (raw blocks, as Parquet stores each page) ------------------------------------------------- */

static int snappy(const uint8_t *src, size_t n, uint8_t *dst, size_t dst_len) {
    Cursor c = {src, src + n};
    uint64_t want;
    if (varint(&c, &want) || want != dst_len) return -1;
    const uint8_t *ip = c.p, *iend = src + n;
    uint8_t *op = dst, *oend = dst + dst_len;
    while (ip < iend) {
        uint8_t tag = *ip++;
        size_t len, off;
        if ((tag & 3) == 0) { /* literal */
            len = tag >> 2;
            if (len >= 60) {
                size_t bytes = len - 59;
                if ((size_t)(iend - ip) < bytes) return -1;
                len = 0;
                for (size_t k = 0; k < bytes; k++) len |= (size_t)ip[k] << (8 * k);
                ip += bytes;
            }
            len += 1;
            if ((size_t)(iend - ip) < len || (size_t)(oend - op) < len) return -1;
            memcpy(op, ip, len);
            op += len;
            ip += len;
            continue;
        }
        if ((tag & 3) == 1) {
            if (ip >= iend) return -1;
            len = 4 + ((tag >> 2) & 7);
            off = ((size_t)(tag >> 5) << 8) | *ip++;
        } else if ((tag & 3) == 2) {
            if (iend - ip < 2) return -1;
            len = (size_t)(tag >> 2) + 1;
            off = (size_t)ip[0] | (size_t)ip[1] << 8;
            ip += 2;
        } else {
            if (iend - ip < 4) return -1;
            len = (size_t)(tag >> 2) + 1;
            off = (size_t)ip[0] | (size_t)ip[1] << 8 | (size_t)ip[2] << 16 | (size_t)ip[3] << 24;
            ip += 4;
        }
        if (off == 0 || off > (size_t)(op - dst) || len > (size_t)(oend - op)) return -1;
        while (len) { /* an overlapping copy repeats the last `off` bytes: copy at most `off` at a time */
            size_t k = off < len ? off : len;
            memcpy(op, op - off, k);
            op += k;
            len -= k;
        }
    }
    return op == oend ? 0 : -1;
}

/* --- RLE / bit-packed hybrid (dictionary indices, definition levels) ---------------------------------- */

/* One group of 8 values of N bits (N bytes), read with 8-byte loads: the caller leaves 8 bytes of slack. */
#define GROUP(N)                                                                                             \
    for (int k = 0; k < 8; k++) {                                                                            \
        uint64_t w;                                                                                          \
        memcpy(&w, in + (k * (N)) / 8, 8);                                                                   \
        out[k] = (uint32_t)((w >> ((k * (N)) % 8)) & (((uint64_t)1 << (N)) - 1));                            \
    }
#define GROUPS(N)                                                                                            \
    case N:                                                                                                  \
        for (int64_t g = 0; g < groups; g++, in += (N), out += 8) { GROUP(N) }                               \
        break;

/* `groups` whole groups of bit width 1..32, with constant shifts for each width (the compiler unrolls them). */
static void unpack_groups(const uint8_t *in, uint32_t *out, int64_t groups, int bw) {
    switch (bw) {
        GROUPS(1) GROUPS(2) GROUPS(3) GROUPS(4) GROUPS(5) GROUPS(6) GROUPS(7) GROUPS(8)
        GROUPS(9) GROUPS(10) GROUPS(11) GROUPS(12) GROUPS(13) GROUPS(14) GROUPS(15) GROUPS(16)
        GROUPS(17) GROUPS(18) GROUPS(19) GROUPS(20) GROUPS(21) GROUPS(22) GROUPS(23) GROUPS(24)
        GROUPS(25) GROUPS(26) GROUPS(27) GROUPS(28) GROUPS(29) GROUPS(30) GROUPS(31) GROUPS(32)
    default: break;
    }
}

/* n values of bw bits from `avail` bytes (the caller checked that n * bw bits are there). */
static void unpack(const uint8_t *src, size_t avail, int bw, int64_t n, uint32_t *out) {
    if (bw == 0) {
        memset(out, 0, (size_t)n * sizeof *out);
        return;
    }
    /* whole groups while a group's 8-byte loads stay inside the bytes: bw bytes a group, plus 8 of slack */
    int64_t fast = avail >= 8 + (size_t)bw ? (int64_t)((avail - 8) / (size_t)bw) : 0;
    fast = fast < n / 8 ? fast : n / 8;
    unpack_groups(src, out, fast, bw);
    uint64_t mask = bw == 32 ? 0xffffffffu : ((uint64_t)1 << bw) - 1;
    for (int64_t i = 8 * fast; i < n; i++) { /* the rest, byte by byte */
        uint64_t bit = (uint64_t)i * (uint64_t)bw, w = 0;
        size_t at = bit >> 3;
        for (size_t k = 0; k < 8 && at + k < avail; k++) w |= (uint64_t)src[at + k] << (8 * k);
        out[i] = (uint32_t)((w >> (bit & 7)) & mask);
    }
}

/* One run of the hybrid encoding at c: its count (capped at `left`), and either its repeated value
 * (*packed = NULL) or where its bit-packed bytes start (*packed, with *avail bytes there). */
typedef struct {
    uint64_t take;
    uint32_t value;
    const uint8_t *packed;
    size_t avail;
} Run;

static int next_run(Cursor *c, int bw, uint64_t left, Run *run, Status *st) {
    uint64_t h;
    if (varint(c, &h)) return fail(st, "an RLE run header is cut short");
    if (h & 1) { /* bit-packed: h >> 1 groups of 8 values */
        uint64_t groups = h >> 1;
        run->take = groups <= left / 8 ? groups * 8 : left; /* (no overflow: groups * 8 <= left) */
        run->packed = c->p;
        run->avail = (size_t)(c->end - c->p);
        uint64_t need = (run->take * (uint64_t)bw + 7) / 8;
        if (need > run->avail) return fail(st, "a bit-packed run needs %llu bytes, %zu are left",
                                           (unsigned long long)need, run->avail);
        /* a last run may stop short at the end of the data: only the values used must be there */
        uint64_t bytes = bw == 0 ? 0 : groups > run->avail ? run->avail : groups * (uint64_t)bw;
        c->p += bytes > run->avail ? run->avail : bytes;
        return 0;
    }
    size_t value_bytes = ((size_t)bw + 7) / 8;
    if ((size_t)(c->end - c->p) < value_bytes) return fail(st, "an RLE run's value is cut short");
    uint32_t v = 0;
    for (size_t k = 0; k < value_bytes; k++) v |= (uint32_t)c->p[k] << (8 * k);
    c->p += value_bytes;
    if (bw < 32 && (v >> bw)) return fail(st, "an RLE value %u is wider than %d bits", v, bw);
    run->take = (h >> 1) < left ? (h >> 1) : left;
    run->value = v;
    run->packed = NULL;
    return 0;
}

/* n values of bit width bw (0..32) into out. */
static int rle(const uint8_t *p, size_t len, int bw, int64_t n, uint32_t *out, Status *st) {
    Cursor c = {p, p + len};
    for (int64_t i = 0; i < n;) {
        Run run = {0, 0, NULL, 0};
        if (next_run(&c, bw, (uint64_t)(n - i), &run, st)) return -1;
        if (run.packed) {
            unpack(run.packed, run.avail, bw, (int64_t)run.take, out + i);
        } else {
            uint32_t v = run.value;
            for (uint64_t k = 0; k < run.take; k++) out[i + (int64_t)k] = v;
        }
        i += (int64_t)run.take;
    }
    return 0;
}

/* Whether n definition levels (bit width 1) are all 1, i.e. no null; else the index of the first 0 in *at. */
static int levels_all_present(const uint8_t *p, size_t len, int64_t n, int64_t *at, Status *st) {
    Cursor c = {p, p + len};
    uint32_t block[256];
    for (int64_t i = 0; i < n;) {
        Run run = {0, 0, NULL, 0};
        if (next_run(&c, 1, (uint64_t)(n - i), &run, st)) return -1;
        if (!run.packed && run.value != 1 && run.take) {
            *at = i;
            return 1;
        }
        for (uint64_t done = 0; run.packed && done < run.take; done += 256) {
            int64_t m = run.take - done < 256 ? (int64_t)(run.take - done) : 256;
            unpack(run.packed + done / 8, run.avail - done / 8, 1, m, block); /* (done is a multiple of 8) */
            for (int64_t k = 0; k < m; k++) {
                if (block[k] != 1) {
                    *at = i + (int64_t)done + k;
                    return 1;
                }
            }
        }
        i += (int64_t)run.take;
    }
    return 0;
}

#endif
