/* The owner-sum table of ownersum.c: per-shard totals in a dense layout (cell = id - lo) while the ids'
 * range stays under DENSE_LIMIT cells, else hashed (insertion-ordered slots, sorted once at the end).
 *
 * Totals start at the identity: -0.0 for floats (-0.0 + x == x for every x, sign of zero included), 0 for
 * integers. Growing the dense table or leaving it for the hashed one moves totals bit for bit. Pure C, no
 * Python: included by ownersum.c only.
 */
#ifndef GRADAGG_OWNERTABLE_H
#define GRADAGG_OWNERTABLE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DENSE_LIMIT ((int64_t)1 << 24) /* 128 MiB of float64 cells, small next to an input that needs them */


typedef struct {
    int ints, raise_nonfinite;
    int dense;            /* 1: cell = id - lo; 0: cell = the id's hash slot */
    int64_t lo, span;     /* dense: the ids lo .. lo + span - 1 */
    void *totals;         /* double or int64 per cell */
    uint8_t *seen;        /* 1 where an owner row was added */
    int64_t cap;          /* cells allocated */
    int64_t *keys, used;  /* hashed: slot -> id, slots used */
    int64_t *hash, hsize; /* hashed: open addressing, slot + 1 (0 = empty) */
} Table;

/* --- cells -------------------------------------------------------------------------------------------- */

static void fill_identity(Table *a, int64_t from, int64_t to) {
    if (a->ints) {
        memset((int64_t *)a->totals + from, 0, (size_t)(to - from) * 8);
    } else {
        double *t = a->totals;
        for (int64_t k = from; k < to; k++) t[k] = -0.0;
    }
    memset(a->seen + from, 0, (size_t)(to - from));
}

static int reserve(Table *a, int64_t cells) { /* room for `cells` cells, new ones at the identity */
    if (cells <= a->cap) return 0;
    int64_t cap = a->cap ? a->cap : 1024;
    while (cap < cells) cap *= 2;
    void *t = realloc(a->totals, (size_t)cap * 8);
    if (!t) return -1;
    a->totals = t;
    uint8_t *s = realloc(a->seen, (size_t)cap);
    if (!s) return -1;
    a->seen = s;
    fill_identity(a, a->cap, cap);
    a->cap = cap;
    return 0;
}

static uint64_t mix(int64_t id) { /* splitmix64's finaliser */
    uint64_t z = (uint64_t)id + 0x9e3779b97f4a7c15u;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static int rehash(Table *a, int64_t size) {
    int64_t *h = calloc((size_t)size, sizeof *h);
    if (!h) return -1;
    for (int64_t s = 0; s < a->used; s++) {
        uint64_t k = mix(a->keys[s]) & (uint64_t)(size - 1);
        while (h[k]) k = (k + 1) & (uint64_t)(size - 1);
        h[k] = s + 1;
    }
    free(a->hash);
    a->hash = h;
    a->hsize = size;
    return 0;
}

/* The slot of `id`, made (at the identity) if new; -1 when out of memory. */
static int64_t slot(Table *a, int64_t id) {
    uint64_t mask = (uint64_t)(a->hsize - 1), k = mix(id) & mask;
    for (;;) {
        int64_t s = a->hash[k];
        if (!s) break;
        if (a->keys[s - 1] == id) return s - 1;
        k = (k + 1) & mask;
    }
    if (a->used == a->cap) { /* totals, seen and keys grow together */
        if (reserve(a, a->used + 1)) return -1;
        int64_t *keys = realloc(a->keys, (size_t)a->cap * sizeof *keys);
        if (!keys) return -1;
        a->keys = keys;
    }
    int64_t s = a->used++;
    a->keys[s] = id;
    a->hash[k] = s + 1;
    if (2 * a->used > a->hsize && rehash(a, 2 * a->hsize)) return -1;
    return s;
}

/* Leave the dense layout: every seen cell becomes a slot, totals kept bit for bit. */
static int to_hashed(Table *a) {
    int64_t span = a->span, lo = a->lo, n = 0;
    void *old_totals = a->totals;
    uint8_t *old_seen = a->seen;
    for (int64_t k = 0; k < span; k++) n += old_seen[k];
    a->totals = NULL, a->seen = NULL, a->cap = 0, a->used = 0, a->dense = 0;
    int64_t size = 1024;
    while (size < 2 * (n + 1)) size *= 2;
    int rc = rehash(a, size);
    for (int64_t k = 0; !rc && k < span; k++) {
        if (!old_seen[k]) continue;
        int64_t s = slot(a, lo + k);
        if (s < 0) {
            rc = -1;
            break;
        }
        memcpy((uint8_t *)a->totals + 8 * s, (uint8_t *)old_totals + 8 * k, 8);
        a->seen[s] = 1;
    }
    free(old_totals);
    free(old_seen);
    return rc;
}

/* Make the dense table cover ids first .. last (growing it at least twofold), or go hashed. */
static int cover(Table *a, int64_t first, int64_t last) {
    int64_t need_lo = first, need_hi = last;
    if (a->span) {
        int64_t hi = a->lo + (a->span - 1);
        need_lo = a->lo < first ? a->lo : first;
        need_hi = hi > last ? hi : last;
    }
    if ((uint64_t)need_hi - (uint64_t)need_lo >= (uint64_t)DENSE_LIMIT) return to_hashed(a);
    int64_t need = need_hi - need_lo + 1, span = 2 * a->span > need ? 2 * a->span : need;
    span = span < 1024 ? 1024 : span > DENSE_LIMIT ? DENSE_LIMIT : span;
    /* Grow away from the side that overflowed, so ids arriving in order keep fitting; stay inside int64. */
    int64_t lo = need_lo;
    if (a->span && first < a->lo) lo = need_hi < INT64_MIN + (span - 1) ? INT64_MIN : need_hi - (span - 1);
    if (lo > INT64_MAX - (span - 1)) lo = INT64_MAX - (span - 1);
    void *t = malloc((size_t)span * 8);
    uint8_t *s = malloc((size_t)span);
    if (!t || !s) {
        free(t);
        free(s);
        return -1;
    }
    void *old_t = a->totals;
    uint8_t *old_s = a->seen;
    int64_t old_span = a->span, at = a->span ? a->lo - lo : 0;
    a->totals = t, a->seen = s, a->cap = span;
    fill_identity(a, 0, span);
    if (old_span) {
        memcpy((uint8_t *)t + 8 * at, old_t, (size_t)old_span * 8);
        memcpy(s + at, old_s, (size_t)old_span);
    }
    free(old_t);
    free(old_s);
    a->lo = lo, a->span = span;
    return 0;
}

/* The cell of a plain shard id, growing the table (or going hashed) when it falls outside; -1: no memory. */
static int64_t cell_of(Table *a, int64_t id) {
    if (a->dense) {
        uint64_t off = (uint64_t)id - (uint64_t)a->lo;
        if (off < (uint64_t)a->span) return (int64_t)off;
        if (cover(a, id, id)) return -1;
        if (a->dense) return (int64_t)((uint64_t)id - (uint64_t)a->lo);
    }
    return slot(a, id);
}

static void table_free(Table *a) {
    free(a->totals);
    free(a->seen);
    free(a->keys);
    free(a->hash);
}

/* The number of shards with an owner row. */
static int64_t table_count(const Table *a) {
    int64_t cells = a->dense ? a->span : a->used, n = 0;
    for (int64_t k = 0; k < cells; k++) n += a->seen[k];
    return n;
}

typedef struct {
    int64_t key, slot;
} Pair;

static int by_key(const void *x, const void *y) {
    int64_t a = ((const Pair *)x)->key, b = ((const Pair *)y)->key;
    return (a > b) - (a < b);
}

/* The shards with an owner row, ascending, and their totals (8 bytes each) into table_count() places. */
static int table_export(const Table *a, int64_t *keys, void *totals) {
    int64_t cells = a->dense ? a->span : a->used, n = table_count(a), j = 0;
    uint8_t *out = totals;
    Pair *pairs = a->dense ? NULL : malloc((size_t)(n ? n : 1) * sizeof *pairs);
    if (!a->dense && !pairs) return -1;
    for (int64_t k = 0; k < cells; k++) {
        if (!a->seen[k]) continue;
        if (a->dense) {
            keys[j] = (int64_t)((uint64_t)a->lo + (uint64_t)k);
            memcpy(out + 8 * j, (uint8_t *)a->totals + 8 * k, 8);
        } else {
            pairs[j].key = a->keys[k], pairs[j].slot = k;
        }
        j++;
    }
    if (pairs) {
        qsort(pairs, (size_t)n, sizeof *pairs, by_key);
        for (j = 0; j < n; j++) {
            keys[j] = pairs[j].key;
            memcpy(out + 8 * j, (uint8_t *)a->totals + 8 * pairs[j].slot, 8);
        }
        free(pairs);
    }
    return 0;
}

#endif
