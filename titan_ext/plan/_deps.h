/* The dependency rule as the compiled planners read it: titan_ext.plan.deps.DepTable.spec(),
 *     (S, trigger, link, feeds_off, feeds, needs_off, needs)
 * flat int sequences over the 3·S op classes (class q = 3·stage + kind, kind 0 F, 1 I or full B, 2 W;
 * microbatch m of class q is op id q·N + m):
 *   needs[needs_off[q] .. needs_off[q+1]): the classes q's ops need (the validator's readiness);
 *   trigger[q]: the one producer class an op of q waits for once implied producers are dropped
 *     (DEPS_ROOT: none, ready from the start; DEPS_ABSENT: the class has no ops, W with full backwards);
 *   link[q]: the stage boundary the trigger's result crosses to reach q (-1: from q's own stage);
 *   feeds[feeds_off[q] .. feeds_off[q+1]): the classes whose trigger is q (same stage first).
 * No C module hard-codes the rule: each walks this table, passed in from Python
 * (tests/plan/test_plan_deps_table.py feeds them another rule).
 *
 * Header only (static functions; needs Python.h first).  setup.py lists it in the extensions' `depends`
 * and pyproject.toml ships it.
 */
#ifndef TITAN_EXT_PLAN_DEPS_H
#define TITAN_EXT_PLAN_DEPS_H

#include <stdlib.h>
#include <string.h>

#define DEPS_ROOT (-1)
#define DEPS_ABSENT (-2)

typedef struct {
    int S, n;  /* stages, classes (3S) */
    int *trigger, *link, *feeds_off, *feeds, *needs_off, *needs;
    int *buf;
    Py_ssize_t cap;  /* ints in buf */
} DepTable;

static void deps_free(DepTable *t) {
    free(t->buf);
    t->buf = NULL;
}

static Py_ssize_t deps_read_ints(PyObject *seq, int *out, Py_ssize_t cap, Py_ssize_t want, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    Py_ssize_t n, k;
    if (!fast) return -1;
    n = PySequence_Fast_GET_SIZE(fast);
    if ((want >= 0 && n != want) || n > cap) {
        PyErr_Format(PyExc_ValueError, "dependency table: %s has %zd entries", what, n);
        Py_DECREF(fast);
        return -1;
    }
    for (k = 0; k < n; k++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, k));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        if (v < -2 || v > 0x3fffffff) {
            PyErr_Format(PyExc_ValueError, "dependency table: %s out of range", what);
            Py_DECREF(fast);
            return -1;
        }
        out[k] = (int)v;
    }
    Py_DECREF(fast);
    return n;
}

/* checks an offsets array (n + 1 entries, 0 .. len, non-decreasing) and its class entries */
static int deps_check_csr(const int *off, const int *val, int n, Py_ssize_t len, const char *what) {
    int q;
    Py_ssize_t j;
    if (off[0] != 0 || off[n] != len) goto bad;
    for (q = 0; q < n; q++)
        if (off[q + 1] < off[q]) goto bad;
    for (j = 0; j < len; j++)
        if (val[j] < 0 || val[j] >= n) goto bad;
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "dependency table: bad %s", what);
    return -1;
}

/* reads deps.DepTable.spec(); 0 ok, -1 with an exception set (and nothing to free) */
static int deps_read(PyObject *spec, DepTable *t) {
    PyObject *tr, *lk, *fo, *fe, *no, *ne;
    Py_ssize_t nf, nn, cap;
    int S, q;
    memset(t, 0, sizeof *t);
    if (!PyTuple_Check(spec)) {
        PyErr_SetString(PyExc_TypeError, "dependency table: expected deps.DepTable.spec()");
        return -1;
    }
    if (!PyArg_ParseTuple(spec, "iOOOOOO", &S, &tr, &lk, &fo, &fe, &no, &ne)) return -1;
    if (S < 1 || S > 0x1000000) { PyErr_SetString(PyExc_ValueError, "dependency table: bad stage count"); return -1; }
    t->S = S;
    t->n = 3 * S;
    nf = PySequence_Size(fe);
    nn = PySequence_Size(ne);
    if (nf < 0 || nn < 0) return -1;
    cap = 4 * (Py_ssize_t)t->n + 2 + nf + nn + 2;
    if (!(t->buf = (int *)calloc((size_t)cap, sizeof(int)))) { PyErr_NoMemory(); return -1; }
    t->cap = cap;
    t->trigger = t->buf;
    t->link = t->trigger + t->n;
    t->feeds_off = t->link + t->n;
    t->needs_off = t->feeds_off + t->n + 1;
    t->feeds = t->needs_off + t->n + 1;
    t->needs = t->feeds + nf + 1;
    if (deps_read_ints(tr, t->trigger, t->n, t->n, "trigger") < 0 || deps_read_ints(lk, t->link, t->n, t->n, "link") < 0
        || deps_read_ints(fo, t->feeds_off, t->n + 1, t->n + 1, "feeds_off") < 0
        || deps_read_ints(fe, t->feeds, nf, nf, "feeds") < 0
        || deps_read_ints(no, t->needs_off, t->n + 1, t->n + 1, "needs_off") < 0
        || deps_read_ints(ne, t->needs, nn, nn, "needs") < 0
        || deps_check_csr(t->feeds_off, t->feeds, t->n, nf, "feeds")
        || deps_check_csr(t->needs_off, t->needs, t->n, nn, "needs"))
        goto bad;
    for (q = 0; q < t->n; q++) {
        int p = t->trigger[q], l = t->link[q];
        if (p >= t->n || l < -1 || l >= S - 1 || (p >= 0 && l >= 0 && l != (p / 3 < q / 3 ? p / 3 : q / 3))
            || (p >= 0 && l < 0 && p / 3 != q / 3) || (p >= 0 && p / 3 != q / 3 && abs(p / 3 - q / 3) != 1)) {
            PyErr_SetString(PyExc_ValueError, "dependency table: bad trigger or link");
            goto bad;
        }
    }
    {
        Py_ssize_t edges = 0;
        for (q = 0; q < t->n; q++) edges += t->trigger[q] >= 0;
        if (edges != nf) {
            PyErr_SetString(PyExc_ValueError, "dependency table: feeds is not the inverse of trigger");
            goto bad;
        }
    }
    for (q = 0; q < t->n; q++) {  /* feeds must be the inverse of trigger */
        int j;
        for (j = t->feeds_off[q]; j < t->feeds_off[q + 1]; j++)
            if (t->trigger[t->feeds[j]] != q) {
                PyErr_SetString(PyExc_ValueError, "dependency table: feeds is not the inverse of trigger");
                goto bad;
            }
    }
    return 0;
bad:
    deps_free(t);
    return -1;
}

/* a copy of `src` (its own buffer); 0 ok, -1 no memory (exception set) */
static int deps_copy(const DepTable *src, DepTable *dst) {
    *dst = *src;
    if (!(dst->buf = (int *)malloc(sizeof(int) * (size_t)src->cap))) { PyErr_NoMemory(); return -1; }
    memcpy(dst->buf, src->buf, sizeof(int) * (size_t)src->cap);
#define DEPS_MOVE(f) dst->f = dst->buf + (src->f - src->buf)
    DEPS_MOVE(trigger); DEPS_MOVE(link); DEPS_MOVE(feeds_off); DEPS_MOVE(feeds); DEPS_MOVE(needs_off); DEPS_MOVE(needs);
#undef DEPS_MOVE
    return 0;
}

/* deps_read with a small cache keyed by the spec object itself (deps.DepTable.spec() returns the same
 * tuple for a problem every time; held here, so its identity cannot be reused, and only tuples of tuples
 * — immutable — are cached): a planner's repeated calls copy the parsed table instead of parsing it.
 * The caller owns *t (deps_free); the GIL must be held. */
#define DEPS_CACHE 8
static PyObject *deps_cache_key[DEPS_CACHE];
static DepTable deps_cache_val[DEPS_CACHE];
static int deps_cache_next;

static int deps_get(PyObject *spec, DepTable *t) {
    int i, slot;
    for (i = 0; i < DEPS_CACHE; i++)
        if (deps_cache_key[i] == spec) return deps_copy(&deps_cache_val[i], t);
    if (deps_read(spec, t)) return -1;
    if (!PyTuple_CheckExact(spec)) return 0;
    for (i = 1; i < PyTuple_GET_SIZE(spec); i++)
        if (!PyTuple_CheckExact(PyTuple_GET_ITEM(spec, i))) return 0;
    slot = deps_cache_next;
    deps_cache_next = (deps_cache_next + 1) % DEPS_CACHE;
    Py_CLEAR(deps_cache_key[slot]);
    deps_free(&deps_cache_val[slot]);
    if (deps_copy(t, &deps_cache_val[slot])) { PyErr_Clear(); return 0; }  /* not cached: still a result */
    Py_INCREF(spec);
    deps_cache_key[slot] = spec;
    return 0;
}

#endif
