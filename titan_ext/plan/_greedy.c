/* Compiled CrossPipe greedy list scheduler (Alg.1 of CrossPipe §4.2): titan_ext.plan._greedy_c.
 *
 * A port of crosspipe.greedy.greedy_schedule, times in integer nanoseconds (int64, the unit of every
 * evaluator of plan/), so it returns bit-identical results: the same per-rank whole-action orders, the
 * same makespan and the same number of lookahead waits (tests/plan/test_crosspipe_greedy_c.py).  The
 * Python wrapper is titan_ext.plan.crosspipe._compiled; its input is a titan_ext.plan.placed.PlacedProfile.
 *
 *   spec = make_spec(R, N, stage_to_rank, f, b, w, deps, ch, tx, lat, deltas)
 *       an opaque capsule with the placed profile on flat arrays (built once per profile by the wrapper):
 *       f, b, w: per-stage times in ns; deps: the dependency rule, titan_ext.plan.deps.table(S).spec()
 *       (_deps.h): an op's end makes ready the classes its class feeds; ch[c] (per class c, 3S): channel
 *       (src rank * R + dst rank) of the message that brings c's trigger, -1 for none or a same-rank
 *       dependency; tx: size·β (ns); lat: α (ns); deltas: (M_F, M_D, M_W), the profile's memory rule.
 *       Messages: _link.h's FIFO send (equal to §4.2.3's range-based reservation on every run: one
 *       sender per channel, see crosspipe.greedy).  The spec holds no memory limit: it is an argument
 *       of run, so one spec serves every memory limit of a profile.
 *   run(spec, n_sub, backward_first, pending, k_units, critical_path, lookahead, need_f, lim)
 *       -> (ids, makespan_ns, waits), or (None, code, 0) when the Python would raise: code 1 = no rank
 *       can proceed (memory deadlock), 2 = no operation selectable (the Python's unpacking of None).
 *       A W of w ns runs as n_sub sub-blocks of w / n_sub ns, the first w % n_sub of them 1 ns longer
 *       (crosspipe.greedy.w_subblock_ns).  need_f (per-stage F memory need) is None to have it computed
 *       here (mf + k_units·mf·#later) or a sequence precomputed in Python; lim: per-rank limits (already
 *       + 1e-9, as the Python does) or None (unlimited).  Memory stays in (integer-valued) doubles.
 *
 * Plain C and the CPython API (also valid C++: setup.py may compile it as C++20).  The scheduling
 * itself runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "_deps.h"
#include "_link.h"

typedef struct {
    int R, N, S, nch;
    int *s2r;                  /* S */
    long long *f, *b, *w;      /* S, ns */
    DepTable deps;             /* the dependency rule (_deps.h) */
    int *ch;                   /* 3S: per class, the channel of its trigger's message (-1: same rank) */
    long long *tx, *lat;       /* 3S: that message's size·β and α (ns) */
    int *rq_off, *rq;          /* R+1, 3S: per rank its queues, later stage first, kinds F I W */
    int *rq_k, *rq_s;          /* 3S: kind and stage of rq[j] */
    int *later_off, *later;    /* S+1, list: later stages of the same rank */
    int any_later;
    double mf, mi, mw;
    PyObject *idobj;           /* tuple of the ints 0..3NS-1 (output without allocations) */
} Spec;

typedef struct {
    long long t;
    int r;
    long long v;
} Ev;

static void spec_free(Spec *sp) {
    if (!sp) return;
    free(sp->s2r); free(sp->f); free(sp->b); free(sp->w); free(sp->ch); free(sp->tx); free(sp->lat);
    free(sp->rq_off); free(sp->rq); free(sp->rq_k); free(sp->rq_s);
    free(sp->later_off); free(sp->later);
    deps_free(&sp->deps);
    Py_XDECREF(sp->idobj);
    free(sp);
}

static void capsule_destructor(PyObject *cap) {
    Spec *sp = (Spec *)PyCapsule_GetPointer(cap, "titan_ext.plan._greedy_c.spec");
    spec_free(sp);
}

static int get_doubles(PyObject *seq, double *dst, int n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of numbers");
    Py_ssize_t i;
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "bad sequence length");
        return -1;
    }
    for (i = 0; i < n; i++) {
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1.0 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        dst[i] = v;
    }
    Py_DECREF(fast);
    return 0;
}

static int get_lls(PyObject *seq, long long *dst, int n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    Py_ssize_t i;
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "bad sequence length");
        return -1;
    }
    for (i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        dst[i] = v;
    }
    Py_DECREF(fast);
    return 0;
}

static int get_ints(PyObject *seq, int *dst, int n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    Py_ssize_t i;
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "bad sequence length");
        return -1;
    }
    for (i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        dst[i] = (int)v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *make_spec(PyObject *self, PyObject *args) {
    int R, N, S, s, r, k, i, pos, nch;
    PyObject *s2r, *f, *b, *w, *depso, *ch, *tx, *lat, *deltas;
    double d3[3];
    Spec *sp;
    PyObject *cap;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiOOOOOOOOO", &R, &N, &s2r, &f, &b, &w, &depso, &ch, &tx, &lat, &deltas))
        return NULL;
    if (R < 1 || N < 1) { PyErr_SetString(PyExc_ValueError, "R and N must be positive"); return NULL; }
    S = (int)PySequence_Size(s2r);
    if (S < 1) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "no stages"); return NULL; }
    if ((double)N * 3.0 * (double)S > 1e9) { PyErr_SetString(PyExc_OverflowError, "problem too large"); return NULL; }
    nch = R * R;
    sp = (Spec *)calloc(1, sizeof(Spec));
    if (!sp) return PyErr_NoMemory();
    sp->R = R; sp->N = N; sp->S = S; sp->nch = nch;
    sp->s2r = (int *)malloc(sizeof(int) * S);
    sp->f = (long long *)malloc(sizeof(long long) * S);
    sp->b = (long long *)malloc(sizeof(long long) * S);
    sp->w = (long long *)malloc(sizeof(long long) * S);
    sp->ch = (int *)malloc(sizeof(int) * 3 * S);
    sp->tx = (long long *)malloc(sizeof(long long) * 3 * S);
    sp->lat = (long long *)malloc(sizeof(long long) * 3 * S);
    sp->rq_off = (int *)calloc(R + 1, sizeof(int));
    sp->rq = (int *)malloc(sizeof(int) * 3 * S);
    sp->rq_k = (int *)malloc(sizeof(int) * 3 * S);
    sp->rq_s = (int *)malloc(sizeof(int) * 3 * S);
    sp->later_off = (int *)calloc(S + 1, sizeof(int));
    sp->later = (int *)malloc(sizeof(int) * (S * S + 1));
    if (!sp->s2r || !sp->f || !sp->b || !sp->w || !sp->ch || !sp->tx || !sp->lat
        || !sp->rq_off || !sp->rq || !sp->rq_k || !sp->rq_s || !sp->later_off || !sp->later) {
        spec_free(sp);
        return PyErr_NoMemory();
    }
    if (deps_get(depso, &sp->deps) < 0) { spec_free(sp); return NULL; }
    if (sp->deps.S != S) {
        spec_free(sp);
        PyErr_SetString(PyExc_ValueError, "dependency table: made for another problem");
        return NULL;
    }
    if (get_ints(s2r, sp->s2r, S) < 0 || get_lls(f, sp->f, S) < 0 || get_lls(b, sp->b, S) < 0
        || get_lls(w, sp->w, S) < 0 || get_ints(ch, sp->ch, 3 * S) < 0 || get_lls(tx, sp->tx, 3 * S) < 0
        || get_lls(lat, sp->lat, 3 * S) < 0 || get_doubles(deltas, d3, 3) < 0) {
        spec_free(sp);
        return NULL;
    }
    sp->mf = d3[0]; sp->mi = d3[1]; sp->mw = d3[2];
    for (s = 0; s < S; s++) {
        if (sp->s2r[s] < 0 || sp->s2r[s] >= R) {
            spec_free(sp);
            PyErr_SetString(PyExc_ValueError, "bad rank or channel index");
            return NULL;
        }
    }
    for (i = 0; i < 3 * S; i++) {
        if (sp->ch[i] < -1 || sp->ch[i] >= nch) {
            spec_free(sp);
            PyErr_SetString(PyExc_ValueError, "bad rank or channel index");
            return NULL;
        }
    }
    /* per rank: its queues, stages in decreasing order, kinds 0 1 2 */
    pos = 0;
    for (r = 0; r < R; r++) {
        sp->rq_off[r] = pos;
        for (s = S - 1; s >= 0; s--)
            if (sp->s2r[s] == r)
                for (k = 0; k < 3; k++) { sp->rq_k[pos] = k; sp->rq_s[pos] = s; sp->rq[pos++] = 3 * s + k; }
    }
    sp->rq_off[R] = pos;
    /* later stages on the same rank, increasing */
    pos = 0;
    sp->any_later = 0;
    for (s = 0; s < S; s++) {
        sp->later_off[s] = pos;
        for (i = s + 1; i < S; i++)
            if (sp->s2r[i] == sp->s2r[s]) { sp->later[pos++] = i; sp->any_later = 1; }
    }
    sp->later_off[S] = pos;
    sp->idobj = PyTuple_New((Py_ssize_t)3 * N * S);
    if (!sp->idobj) { spec_free(sp); return NULL; }
    for (i = 0; i < 3 * N * S; i++) {
        PyObject *v = PyLong_FromLong(i);
        if (!v) { spec_free(sp); return NULL; }
        PyTuple_SET_ITEM(sp->idobj, i, v);
    }
    cap = PyCapsule_New(sp, "titan_ext.plan._greedy_c.spec", capsule_destructor);
    if (!cap) { spec_free(sp); return NULL; }
    return cap;
}

/* ------------------------------------------------------------------------------------------------ */

static inline int ev_less(const Ev *a, const Ev *b) {
    if (a->t < b->t) return 1;
    if (a->t > b->t) return 0;
    if (a->r != b->r) return a->r < b->r;
    return a->v < b->v;
}

typedef struct {
    Ev *h;
    Py_ssize_t n, cap;
} Heap;

static int heap_push(Heap *hp, long long t, int r, long long v) {
    Py_ssize_t i;
    Ev e;
    if (hp->n == hp->cap) {
        Py_ssize_t nc = hp->cap ? 2 * hp->cap : 64;
        Ev *nh = (Ev *)realloc(hp->h, sizeof(Ev) * nc);
        if (!nh) return -1;
        hp->h = nh;
        hp->cap = nc;
    }
    e.t = t; e.r = r; e.v = v;
    i = hp->n++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) >> 1;
        if (!ev_less(&e, &hp->h[p])) break;
        hp->h[i] = hp->h[p];
        i = p;
    }
    hp->h[i] = e;
    return 0;
}

static Ev heap_pop(Heap *hp) {
    Ev top = hp->h[0], last;
    Py_ssize_t i = 0, n;
    last = hp->h[--hp->n];
    n = hp->n;
    if (n > 0) {
        for (;;) {
            Py_ssize_t c = 2 * i + 1;
            if (c >= n) break;
            if (c + 1 < n && ev_less(&hp->h[c + 1], &hp->h[c])) c++;
            if (!ev_less(&hp->h[c], &last)) break;
            hp->h[i] = hp->h[c];
            i = c;
        }
        hp->h[i] = last;
    }
    return top;
}

typedef struct {
    long long end, start;
    int seq, id;
} Done;

/* (end, start) lexicographic; ties keep the completion order (stable sort) = Python's sorted over the
 * insertion order of its ``end`` dict */
static inline int done_less(const Done *a, const Done *b) {
    return a->end < b->end || (a->end == b->end && a->start < b->start);
}

/* stable bottom-up merge sort (insertion-sorted blocks of 16, merges skipped where already in order:
 * the completion order is nearly sorted); result in a, tmp: n scratch elements */
static void done_sort(Done *a, Done *tmp, int n) {
    int i, j, width, lo;
    Done *src = a, *dst = tmp, *sw;
    for (lo = 0; lo < n; lo += 16) {
        int hi = lo + 16 < n ? lo + 16 : n;
        for (i = lo + 1; i < hi; i++) {
            Done x = a[i];
            j = i;
            while (j > lo && done_less(&x, &a[j - 1])) { a[j] = a[j - 1]; j--; }
            a[j] = x;
        }
    }
    for (width = 16; width < n; width *= 2) {
        for (lo = 0; lo < n; lo += 2 * width) {
            int mid = lo + width < n ? lo + width : n;
            int hi = lo + 2 * width < n ? lo + 2 * width : n;
            int p = lo, q = mid, o = lo;
            if (mid >= hi || !done_less(&src[mid], &src[mid - 1])) {
                memcpy(dst + lo, src + lo, sizeof(Done) * (size_t)(hi - lo));
                continue;
            }
            while (p < mid && q < hi) {
                if (done_less(&src[q], &src[p])) dst[o++] = src[q++];
                else dst[o++] = src[p++];
            }
            while (p < mid) dst[o++] = src[p++];
            while (q < hi) dst[o++] = src[q++];
        }
        sw = src; src = dst; dst = sw;
    }
    if (src != a) memcpy(a, src, sizeof(Done) * (size_t)n);
}

typedef struct {
    /* inputs */
    const Spec *sp;
    int n_sub, backward_first, pending_rule, tie_cp, lookahead;
    double *needf, *lim;
    /* state */
    int *fsd;           /* f_stage_done, S */
    int *qm;            /* 3S*N */
    long long *qa;      /* 3S*N: available at (ns) */
    int *qlen, *heads;  /* 3S */
    int *wl;            /* S*N */
    long long *free_;
    double *mem;
    int *f_done, *seen_bw, *last_full, *total_f;
    long long *version;
    long long *chfree;  /* nch: per channel, the end of its last message's window (_link.h) */
    long long *start_;  /* n */
    Done *done;         /* n */
    Done *tmp;          /* n: sort scratch */
    Heap heap;
    /* outputs */
    int ndone;
    long long makespan;
    long long waits;
} Run;

static inline int f_blocked(const Run *w, int r, int s) {
    const Spec *sp = w->sp;
    if (w->pending_rule && sp->later_off[s + 1] > sp->later_off[s]) {
        long long sum = 0;
        int j;
        double need;
        for (j = sp->later_off[s]; j < sp->later_off[s + 1]; j++) sum += (long long)w->fsd[s] + 1 - w->fsd[sp->later[j]];
        need = sp->mf * (double)(1 + sum);
        return w->mem[r] + need > w->lim[r];
    }
    return w->mem[r] + w->needf[s] > w->lim[r];
}

static int push_rank(Run *w, int r) {
    const Spec *sp = w->sp;
    int N = sp->N, j, found = 0;
    long long best = 0, fr;
    w->version[r] += 1;
    for (j = sp->rq_off[r]; j < sp->rq_off[r + 1]; j++) {
        int q = sp->rq[j];
        int h = w->heads[q];
        if (h < w->qlen[q]) {
            long long a = w->qa[q * N + h];
            if ((!found || a < best) && !(sp->rq_k[j] == 0 && f_blocked(w, r, sp->rq_s[j]))) { best = a; found = 1; }
        }
    }
    if (found) {
        fr = w->free_[r];
        return heap_push(&w->heap, best > fr ? best : fr, r, w->version[r]);
    }
    return 0;
}

static void arrive(Run *w, int q, int m, long long avail) {
    int N = w->sp->N;
    int *qm = w->qm + (Py_ssize_t)q * N;
    long long *qa = w->qa + (Py_ssize_t)q * N;
    int len = w->qlen[q], i;
    if (len == 0 || qm[len - 1] < m) {
        qm[len] = m;
        qa[len] = avail;
    } else {
        i = len;
        while (i > w->heads[q] && qm[i - 1] > m) i--;
        memmove(qm + i + 1, qm + i, sizeof(int) * (len - i));
        memmove(qa + i + 1, qa + i, sizeof(long long) * (len - i));
        qm[i] = m;
        qa[i] = avail;
    }
    w->qlen[q] = len + 1;
}

/* when the trigger of class c, ready at `ready`, reaches c's rank (``_Alg1.message``) */
static inline long long message(Run *w, int c, long long ready) {
    const Spec *sp = w->sp;
    if (sp->ch[c] < 0) return ready;
    return link_send_ns(&w->chfree[sp->ch[c]], sp->tx[c], sp->lat[c], ready);
}

/* the end of class q's op of microbatch m on rank r at t1: the classes q feeds (deps) get m; every
 * other rank fed is rescheduled after r (``_Alg1.finish``); 0 ok, -1 out of memory */
static int finish(Run *w, int r, int q, int m, long long t1) {
    const Spec *sp = w->sp;
    const DepTable *d = &sp->deps;
    int j;
    for (j = d->feeds_off[q]; j < d->feeds_off[q + 1]; j++) {
        int c = d->feeds[j];
        arrive(w, c, m, message(w, c, t1));
    }
    if (push_rank(w, r) < 0) return -1;
    for (j = d->feeds_off[q]; j < d->feeds_off[q + 1]; j++) {
        int r2 = sp->s2r[d->feeds[j] / 3], k;
        for (k = d->feeds_off[q]; k < j; k++)
            if (sp->s2r[d->feeds[k] / 3] == r2) break;
        if (r2 != r && k == j && push_rank(w, r2) < 0) return -1;
    }
    return 0;
}

/* returns 0 ok, 1 deadlock, 2 nothing selectable, -1 out of memory */
static int greedy_core(Run *w) {
    const Spec *sp = w->sp;
    int R = sp->R, N = sp->N, S = sp->S;
    long long remaining = 3LL * N * S;
    int n_sub = w->n_sub;
    int r, j, m, q, s, k;
    int bm[3], bq[3];
    const int *order;
    static const int ORD_TEAR[3] = {1, 2, 0}, ORD_F[3] = {0, 1, 2}, ORD_B[3] = {1, 0, 2};
    long long t, dur, t1, soonest, endmax;
    int have_soonest;
    Ev e;

    for (r = 0; r < R; r++)
        if (push_rank(w, r) < 0) return -1;

    while (remaining) {
        if (w->heap.n == 0) return 1;
        e = heap_pop(&w->heap);
        t = e.t;
        r = e.r;
        if (e.v != w->version[r]) continue;
        bm[0] = bm[1] = bm[2] = -1;
        bq[0] = bq[1] = bq[2] = -1;
        for (j = sp->rq_off[r]; j < sp->rq_off[r + 1]; j++) {
            int h;
            q = sp->rq[j];
            h = w->heads[q];
            if (h < w->qlen[q]) {
                long long a;
                m = w->qm[q * N + h];
                a = w->qa[q * N + h];
                if (a > t) continue;
                k = sp->rq_k[j];
                if (k == 0 && f_blocked(w, r, sp->rq_s[j])) continue;
                if (bq[k] < 0 || (m < bm[k] && !(k == 1 && w->tie_cp))) {
                    bm[k] = m;
                    bq[k] = q;
                }
            }
        }
        if (!w->seen_bw[r] && bq[1] >= 0) w->seen_bw[r] = 1;
        if (w->f_done[r] == w->total_f[r]) order = ORD_TEAR;
        else if (!w->seen_bw[r]) order = ORD_F;
        else if (w->backward_first || w->last_full[r] == 0) order = ORD_B;
        else order = ORD_F;
        k = order[2];
        for (j = 0; j < 3; j++)
            if (bq[order[j]] >= 0) { k = order[j]; break; }
        if (bq[k] < 0) return 2;
        m = bm[k];
        q = bq[k];
        s = q / 3;
        if (k == 2) {  /* the next sub-block: w / n_sub, the first w % n_sub of them 1 ns longer */
            long long wq = sp->w[s] / n_sub, wrem = sp->w[s] % n_sub;
            dur = (n_sub - w->wl[s * N + m]) < wrem ? wq + 1 : wq;
        } else {
            dur = k == 0 ? sp->f[s] : sp->b[s];
        }
        t1 = t + dur;
        if (w->lookahead && k != 1) {
            soonest = 0;
            have_soonest = 0;
            for (j = sp->rq_off[r]; j < sp->rq_off[r + 1]; j++) {
                int q2 = sp->rq[j];
                if (sp->rq_k[j] == 1 && w->heads[q2] < w->qlen[q2]) {
                    long long a = w->qa[q2 * N + w->heads[q2]];
                    if (!have_soonest || a < soonest) { soonest = a; have_soonest = 1; }
                }
            }
            if (have_soonest && t < soonest && soonest < t1) {
                w->version[r] += 1;
                if (heap_push(&w->heap, soonest, r, w->version[r]) < 0) return -1;
                w->waits += 1;
                continue;
            }
        }
        w->free_[r] = t1;
        if (k == 2) {
            int idx = s * N + m;
            int nleft = w->wl[idx];
            if (nleft == n_sub) w->start_[q * N + m] = t;
            nleft -= 1;
            if (nleft) {
                w->wl[idx] = nleft;
                w->qa[q * N + w->heads[q]] = t1;
            } else {
                Done *d;
                w->wl[idx] = n_sub;
                w->heads[q] += 1;
                d = &w->done[w->ndone];
                d->end = t1;
                d->start = w->start_[q * N + m];
                d->seq = w->ndone;
                d->id = q * N + m;
                w->ndone++;
                w->mem[r] += sp->mw;
                remaining -= 1;
                if (finish(w, r, q, m, t1) < 0) return -1;
                continue;
            }
            if (push_rank(w, r) < 0) return -1;
            continue;
        }
        {
            Done *d = &w->done[w->ndone];
            w->start_[q * N + m] = t;
            d->end = t1;
            d->start = t;
            d->seq = w->ndone;
            d->id = q * N + m;
            w->ndone++;
        }
        w->heads[q] += 1;
        remaining -= 1;
        w->last_full[r] = k;
        if (k == 0) {
            w->mem[r] += sp->mf;
            w->f_done[r] += 1;
            w->fsd[s] += 1;
        } else {
            w->mem[r] += sp->mi;
        }
        if (finish(w, r, q, m, t1) < 0) return -1;
    }
    done_sort(w->done, w->tmp, w->ndone);
    endmax = w->done[0].end;
    for (j = 1; j < w->ndone; j++)
        if (w->done[j].end > endmax) endmax = w->done[j].end;
    w->makespan = endmax;  /* the first F of stage 0 starts at 0 */
    return 0;
}

static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *cap, *needf_o, *lim_o;
    int n_sub, backward_first, pending, tie_cp, lookahead;
    double kf;
    const Spec *sp;
    Run w;
    int R, N, S, n, Q, s, r, i, rc, j;
    size_t nbytes;
    char *buf = NULL, *p;
    PyObject *ids = NULL, *res = NULL;
    int *cnt = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiiidiiOO", &cap, &n_sub, &backward_first, &pending, &kf, &tie_cp, &lookahead,
                          &needf_o, &lim_o))
        return NULL;
    sp = (const Spec *)PyCapsule_GetPointer(cap, "titan_ext.plan._greedy_c.spec");
    if (!sp) return NULL;
    if (n_sub < 1) { PyErr_SetString(PyExc_ValueError, "n_sub must be >= 1"); return NULL; }
    R = sp->R; N = sp->N; S = sp->S; n = 3 * N * S; Q = 3 * S;
    memset(&w, 0, sizeof(w));
    w.sp = sp;
    w.n_sub = n_sub;
    w.backward_first = backward_first;
    w.pending_rule = pending && sp->any_later;
    w.tie_cp = tie_cp;
    w.lookahead = lookahead;

#define ALIGN8(x) (((x) + 7) & ~(size_t)7)
    nbytes = ALIGN8(sizeof(double) * S)                /* needf */
             + ALIGN8(sizeof(double) * R)              /* lim */
             + ALIGN8(sizeof(int) * S)                 /* fsd */
             + ALIGN8(sizeof(int) * n)                 /* qm */
             + ALIGN8(sizeof(long long) * n)           /* qa */
             + ALIGN8(sizeof(int) * Q) * 2             /* qlen, heads */
             + ALIGN8(sizeof(int) * S * N)             /* wl */
             + ALIGN8(sizeof(long long) * R)           /* free_ */
             + ALIGN8(sizeof(double) * R)              /* mem */
             + ALIGN8(sizeof(int) * R) * 4             /* f_done, seen_bw, last_full, total_f */
             + ALIGN8(sizeof(long long) * R)           /* version */
             + ALIGN8(sizeof(long long) * sp->nch)     /* chfree */
             + ALIGN8(sizeof(long long) * n)           /* start_ */
             + ALIGN8(sizeof(Done) * n) * 2            /* done, tmp */
             + ALIGN8(sizeof(int) * R);                /* cnt */
    buf = (char *)calloc(1, nbytes);
    if (!buf) return PyErr_NoMemory();
    p = buf;
#define TAKE(ptr, type, count) do { ptr = (type *)p; p += ALIGN8(sizeof(type) * (size_t)(count)); } while (0)
    TAKE(w.needf, double, S);
    TAKE(w.lim, double, R);
    TAKE(w.fsd, int, S);
    TAKE(w.qm, int, n);
    TAKE(w.qa, long long, n);
    TAKE(w.qlen, int, Q);
    TAKE(w.heads, int, Q);
    TAKE(w.wl, int, S * N);
    TAKE(w.free_, long long, R);
    TAKE(w.mem, double, R);
    TAKE(w.f_done, int, R);
    TAKE(w.seen_bw, int, R);
    TAKE(w.last_full, int, R);
    TAKE(w.total_f, int, R);
    TAKE(w.version, long long, R);
    TAKE(w.chfree, long long, sp->nch);
    TAKE(w.start_, long long, n);
    TAKE(w.done, Done, n);
    TAKE(w.tmp, Done, n);
    TAKE(cnt, int, R);
#undef TAKE
#undef ALIGN8

    if (lim_o == Py_None) {
        for (r = 0; r < R; r++) w.lim[r] = INFINITY;
    } else if (get_doubles(lim_o, w.lim, R) < 0) {
        free(buf);
        return NULL;
    }
    if (needf_o == Py_None) {
        for (s = 0; s < S; s++) {
            int c = sp->later_off[s + 1] - sp->later_off[s];
            w.needf[s] = sp->mf + kf * sp->mf * (double)c;
        }
    } else if (get_doubles(needf_o, w.needf, S) < 0) {
        free(buf);
        return NULL;
    }

    Py_BEGIN_ALLOW_THREADS
    for (s = 0; s < S; s++) w.total_f[sp->s2r[s]] += N;
    for (i = 0; i < S * N; i++) w.wl[i] = n_sub;
    for (j = 0; j < Q; j++) {  /* the classes that need nothing: every microbatch ready at 0 */
        if (sp->deps.trigger[j] != DEPS_ROOT) continue;
        for (i = 0; i < N; i++) { w.qm[j * N + i] = i; w.qa[j * N + i] = 0; }
        w.qlen[j] = N;
    }
    for (r = 0; r < R; r++) w.last_full[r] = -1;
    rc = greedy_core(&w);
    Py_END_ALLOW_THREADS

    free(w.heap.h);
    if (rc < 0) { free(buf); return PyErr_NoMemory(); }
    if (rc > 0) {
        free(buf);
        return Py_BuildValue("(OiL)", Py_None, rc, w.waits);
    }
    /* per-rank lists in (end, start, completion) order */
    for (s = 0; s < S; s++) cnt[sp->s2r[s]] += 3 * N;
    ids = PyList_New(R);
    if (!ids) { free(buf); return NULL; }
    for (r = 0; r < R; r++) {
        PyObject *l = PyList_New(cnt[r]);
        if (!l) { Py_DECREF(ids); free(buf); return NULL; }
        PyList_SET_ITEM(ids, r, l);
        cnt[r] = 0;
    }
    for (j = 0; j < w.ndone; j++) {
        int id = w.done[j].id;
        int rr = sp->s2r[id / (3 * N)];
        PyObject *v = PyTuple_GET_ITEM(sp->idobj, id);
        Py_INCREF(v);
        PyList_SET_ITEM(PyList_GET_ITEM(ids, rr), cnt[rr], v);
        cnt[rr]++;
    }
    res = Py_BuildValue("(NLL)", ids, w.makespan, w.waits);
    free(buf);
    return res;
}

static PyMethodDef methods[] = {
    {"make_spec", make_spec, METH_VARARGS, "make_spec(R, N, stage_to_rank, f, b, w, deps, ch, tx, lat, deltas) -> spec"},
    {"run", run, METH_VARARGS,
     "run(spec, n_sub, backward_first, pending, k_units, critical_path, lookahead, need_f, lim) -> (ids, makespan_ns, waits)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_greedy_c",
                                       "Compiled CrossPipe greedy list scheduler (crosspipe.greedy_schedule).", -1,
                                       methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__greedy_c(void) { return PyModule_Create(&moduledef); }
