/* Compiled PipeMorph planning core: titan_ext.plan._pipemorph_c.
 *
 * generate: the schedule generator (Alg.3/4 of PipeMorph §4.3, event-driven), a port of
 * titan_ext.plan.pipemorph._generate_py (the Python reference) with the same integer
 * arithmetic and the same event order, so it returns bit-identical results: the same per-stage
 * operation orders, the same makespan (ns) and the same cap_bound flag, including the early stop once
 * the makespan is certain to exceed a bound (tests/plan/test_plan_pipemorph_c.py).
 *
 *   generate(deps, N, f, b, w, latency, transfer, x, limit, full_backward, bound, release_w=False)
 *       deps: the dependency rule, titan_ext.plan.deps.table(S, full_backward).spec() (_deps.h); N: microbatches; f, b, w: per-stage times (int ns; b already includes w when full_backward); latency, transfer:
 *       per link (S - 1, int ns; transfer 0 = no occupancy); x, limit: warm-up counts and in-flight
 *       limits per stage; bound: int ns or None; release_w: an activation is in flight until its W (else
 *       its I; a full B either way: plan/profile.py RELEASES).
 *       -> (order, makespan_ns, cap_bound); order is None when the bound stopped it, else a list per
 *       stage of (stage, kind, microbatch) tuples, kind one of "F", "I", "W", "B".  ValueError when the
 *       counts and limits deadlock (no stage can run any more), as the Python reference.
 *
 * Dependencies: an op's end makes ready the ops its class feeds in the table (its own stage's at
 * once, an adjacent stage's when the message arrives); no rule is written here.
 * Timing: _link.h's link_send (titan_ext.plan.timing.LinkQueues.send): a message on link l is ready
 * when its op ends; with transfer 0 it arrives latency later; otherwise it waits for its direction of
 * the link to be free (FIFO), occupies it for transfer, and arrives latency after that.  Events
 * (time, stage) pop in lexicographic order, as Python's heapq does on tuples.
 *
 * generate_virtual(deps, N, stage_to_rank, f, b, w, latency, transfer, x, limit, release_w=False): the same over a stage graph
 *       with several stages per rank, a port of titan_ext.plan.virtual._virtual_loop_py (rank → ops
 *       as a list per rank, makespan ns); messages between ranks on channels (src rank, dst rank),
 *       a boundary inside one rank is free.  RuntimeError when no rank can make progress.
 *
 * check(deps, plan, num_stages, num_microbatches, inflight_limit, release_w=False): checks 1-3 of titan_ext.plan.validate
 *       (completeness, progress under the dependency rule deps = deps.table(S).spec(): an op runs once
 *       every class it needs is done for its microbatch, in-flight memory) on a plan of
 *       (stage, kind, microbatch) tuples per rank; returns the per-stage peak in-flight activations (a
 *       list, as simulate.peak_inflight) when the plan is valid, None when it is not (the Python
 *       validator then runs to name the reason).  Same verdicts as the Python validator on valid and
 *       broken plans (tests/plan/test_plan_pipemorph_c.py).
 *
 * Plain C and the CPython API (also valid C++).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "_deps.h"
#include "_link.h"

typedef long long i64;

typedef struct { i64 t; int i; } Ev;

typedef struct { Ev *a; Py_ssize_t n, cap; } Heap;

static int ev_less(Ev x, Ev y) { return x.t < y.t || (x.t == y.t && x.i < y.i); }

static int heap_push(Heap *h, i64 t, int i) {
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 64;
        Ev *a = (Ev *)realloc(h->a, (size_t)cap * sizeof(Ev));
        if (!a) return -1;
        h->a = a; h->cap = cap;
    }
    Py_ssize_t k = h->n++;
    Ev e = {t, i};
    while (k > 0) {
        Py_ssize_t p = (k - 1) / 2;
        if (!ev_less(e, h->a[p])) break;
        h->a[k] = h->a[p]; k = p;
    }
    h->a[k] = e;
    return 0;
}

static Ev heap_pop(Heap *h) {
    Ev top = h->a[0], last = h->a[--h->n];
    Py_ssize_t k = 0, n = h->n;
    for (;;) {
        Py_ssize_t c = 2 * k + 1;
        if (c >= n) break;
        if (c + 1 < n && ev_less(h->a[c + 1], h->a[c])) c++;
        if (!ev_less(h->a[c], last)) break;
        h->a[k] = h->a[c]; k = c;
    }
    if (n) h->a[k] = last;
    return top;
}

/* a FIFO of (ready, mb) per stage and kind: each receives exactly N entries */
typedef struct { i64 *ready; int *mb; int head, tail; } Q;

static int read_i64s(PyObject *seq, Py_ssize_t n, i64 *out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd values", what, n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        out[k] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, k));
        if (out[k] == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *KIND[4];  /* "F", "I", "W", "B" */
/* the Python reference's message, word for word */
static const char *DEADLOCK = "the warm-up counts and in-flight limits deadlock: no stage can run any more";
enum { KF, KI, KW, KB };

typedef struct {
    Py_ssize_t S, N;
    i64 *tf, *tb, *tw, *lat, *tx, *x, *lim, *ffree, *bfree, *free_at, *work, *qready;
    int *warm, *fcount, *bcount, *qmb, *kinds, *mbs, *nops;
    Q *q;  /* 3S queues, one per class: F of stage i at q[3i], I (or B) at q[3i + 1], W at q[3i + 2] */
    Heap heap;
    int release_w;  /* bcount counts W (else I): plan/profile.py RELEASES */
    const DepTable *deps;
    struct Feed *feed;  /* deps' feeds, resolved: feed[deps->feeds_off[cq] ..] */
} Gen;

/* one class a class feeds, resolved for the generator: its queue, and for a message the link's
 * direction (its free time), transfer and latency, and the stage woken */
typedef struct Feed { Q *q; i64 *free_at, tx, lat; int dst; } Feed;

static void q_push(Q *q, i64 ready, int mb) { q->ready[q->tail] = ready; q->mb[q->tail] = mb; q->tail++; }
static int q_ready(const Q *q, i64 t) { return q->head < q->tail && q->ready[q->head] <= t; }

/* the end (at `done`) of class cq's op of microbatch m on stage i: every class it feeds (deps) gets
 * microbatch m, at once on stage i, else when the message over the link arrives; 0 ok, -1 no memory */
static int g_feed(Gen *g, int cq, int m, i64 done) {
    const Feed *f = g->feed + g->deps->feeds_off[cq], *end = g->feed + g->deps->feeds_off[cq + 1];
    for (; f < end; f++) {
        if (!f->free_at) { q_push(f->q, done, m); continue; }
        i64 arrive = link_send_ns(f->free_at, f->tx, f->lat, done);
        q_push(f->q, arrive, m);
        if (heap_push(&g->heap, arrive, f->dst)) return -1;
    }
    return 0;
}

/* g->feed from the table (after the times are read); 0 ok, -1 no memory */
static int g_resolve(Gen *g) {
    const DepTable *d = g->deps;
    Py_ssize_t nf = d->feeds_off[d->n];
    if (!(g->feed = (Feed *)calloc((size_t)nf + 1, sizeof(Feed)))) return -1;
    for (int p = 0; p < d->n; p++)
        for (int j = d->feeds_off[p]; j < d->feeds_off[p + 1]; j++) {
            int c = d->feeds[j], l = d->link[c];
            Feed *f = &g->feed[j];
            f->q = &g->q[c];
            f->dst = c / 3;
            if (l >= 0) {
                f->free_at = c / 3 > p / 3 ? &g->ffree[l] : &g->bfree[l];
                f->tx = g->tx[l];
                f->lat = g->lat[l];
            }
        }
    return 0;
}

/* the event loop of pipemorph._generate_py; returns 1 when done, 0 when stopped by the bound, -1 on error */
static int run(Gen *g, int full, int have_bound, i64 bound, i64 *makespan, int *cap_bound) {
    Py_ssize_t S = g->S, N = g->N;
    for (int c = 0; c < 3 * S; c++)
        if (g->deps->trigger[c] == DEPS_ROOT)
            for (int m = 0; m < N; m++) q_push(&g->q[c], 0, m);
    i64 remaining = (full ? 2 : 3) * (i64)N * S;
    for (int i = 0; i < S; i++) {
        g->warm[i] = (int)g->x[i];
        g->work[i] = (i64)N * (g->tf[i] + g->tb[i] + (full ? 0 : g->tw[i]));
        if (heap_push(&g->heap, 0, i)) return -1;
    }
    while (remaining) {
        if (!g->heap.n) return -2;  /* nothing can run any more: the counts and limits deadlock */
        Ev e = heap_pop(&g->heap);
        i64 t = e.t;
        int i = e.i, kind = -1, m;
        if (g->free_at[i] > t) continue;
        Q *fq = &g->q[3 * i], *bq = fq + 1, *wq = fq + 2;
        if (g->warm[i] > 0) {
            if (q_ready(fq, t)) { kind = KF; g->warm[i]--; }
        } else if (q_ready(bq, t)) {
            kind = KI;
        } else if (q_ready(fq, t)) {
            if (g->fcount[i] - g->bcount[i] < g->lim[i]) kind = KF;
            else *cap_bound = 1;
        }
        if (kind < 0 && q_ready(wq, t)) kind = KW;
        if (kind < 0) continue;
        i64 done;
        int cq;  /* the op's class */
        if (kind == KF) {
            m = fq->mb[fq->head++];
            done = t + g->tf[i];
            g->fcount[i]++;
            cq = 3 * i;
        } else if (kind == KI) {
            m = bq->mb[bq->head++];
            done = t + g->tb[i];
            if (full) kind = KB;
            if (full || !g->release_w) g->bcount[i]++;  /* bcount: activations released (profile.RELEASES) */
            cq = 3 * i + 1;
        } else {
            m = wq->mb[wq->head++];
            done = t + g->tw[i];
            if (g->release_w) g->bcount[i]++;
            cq = 3 * i + 2;
        }
        if (g_feed(g, cq, m, done)) return -1;
        g->work[i] -= done - t;
        if (have_bound && done + g->work[i] > bound) { *makespan = done; return 0; }
        Py_ssize_t k = (Py_ssize_t)i * 3 * N + g->nops[i]++;
        g->kinds[k] = kind;
        g->mbs[k] = m;
        if (done > *makespan) *makespan = done;
        g->free_at[i] = done;
        remaining--;
        if (heap_push(&g->heap, done, i)) return -1;
    }
    return 1;
}

static PyObject *build_order(Gen *g) {
    PyObject *order = PyList_New(g->S);
    if (!order) return NULL;
    for (Py_ssize_t i = 0; i < g->S; i++) {
        PyObject *ops = PyList_New(g->nops[i]), *stage = PyLong_FromSsize_t(i);
        if (!ops || !stage) { Py_XDECREF(ops); Py_XDECREF(stage); Py_DECREF(order); return NULL; }
        PyList_SET_ITEM(order, i, ops);
        for (int k = 0; k < g->nops[i]; k++) {
            Py_ssize_t j = i * 3 * g->N + k;
            PyObject *op = Py_BuildValue("(OOi)", stage, KIND[g->kinds[j]], g->mbs[j]);
            if (!op) { Py_DECREF(stage); Py_DECREF(order); return NULL; }
            PyList_SET_ITEM(ops, k, op);
        }
        Py_DECREF(stage);
    }
    return order;
}

static void gen_free(Gen *g) {
    free(g->feed);
    free(g->tf); free(g->qready); free(g->warm); free(g->qmb); free(g->kinds); free(g->mbs); free(g->q);
    free(g->heap.a);
}

static int gen_alloc(Gen *g) {
    Py_ssize_t S = g->S, N = g->N;
    g->tf = (i64 *)calloc((size_t)(12 * S), sizeof(i64));
    g->qready = (i64 *)calloc((size_t)(3 * S * N), sizeof(i64));
    g->warm = (int *)calloc((size_t)(4 * S), sizeof(int));
    g->qmb = (int *)calloc((size_t)(3 * S * N), sizeof(int));
    g->kinds = (int *)calloc((size_t)(3 * S * N), sizeof(int));
    g->mbs = (int *)calloc((size_t)(3 * S * N), sizeof(int));
    g->q = (Q *)calloc((size_t)(3 * S), sizeof(Q));
    if (!g->tf || !g->qready || !g->warm || !g->qmb || !g->kinds || !g->mbs || !g->q) return -1;
    g->tb = g->tf + S; g->tw = g->tb + S; g->lat = g->tw + S; g->tx = g->lat + S; g->x = g->tx + S;
    g->lim = g->x + S; g->ffree = g->lim + S; g->bfree = g->ffree + S; g->free_at = g->bfree + S;
    g->work = g->free_at + S;
    g->fcount = g->warm + S; g->bcount = g->fcount + S; g->nops = g->bcount + S;
    for (Py_ssize_t k = 0; k < 3 * S; k++) { g->q[k].ready = g->qready + k * N; g->q[k].mb = g->qmb + k * N; }
    return 0;
}

/* reads the table for S stages (and, when full_backward >= 0, checks it was made for that backward) */
static int read_deps(PyObject *spec, DepTable *d, Py_ssize_t S, int full_backward) {
    if (deps_get(spec, d)) return -1;
    if (d->S != S || (full_backward >= 0 && (d->trigger[2] == DEPS_ABSENT) != (full_backward != 0))) {
        PyErr_SetString(PyExc_ValueError, "dependency table: made for another problem");
        deps_free(d);
        return -1;
    }
    return 0;
}

static PyObject *generate(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t N;
    PyObject *depso, *fo, *bo, *wo, *lato, *txo, *xo, *limo, *boundo;
    int full, release_w = 0;
    if (!PyArg_ParseTuple(args, "OnOOOOOOOpO|p", &depso, &N, &fo, &bo, &wo, &lato, &txo, &xo, &limo, &full, &boundo,
                          &release_w))
        return NULL;
    Gen g;
    DepTable deps;
    memset(&g, 0, sizeof g);
    g.S = PySequence_Size(fo);
    g.N = N;
    g.release_w = release_w;
    if (g.S < 1 || N < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "need at least one stage and one microbatch");
        return NULL;
    }
    if (read_deps(depso, &deps, g.S, full)) return NULL;
    g.deps = &deps;
    PyObject *result = NULL;
    Py_ssize_t S = g.S;
    int have_bound = boundo != Py_None, cap_bound = 0, status;
    i64 bound = 0, makespan = 0;
    if (gen_alloc(&g)) { PyErr_NoMemory(); goto done; }
    if (read_i64s(fo, S, g.tf, "f") || read_i64s(bo, S, g.tb, "b") || read_i64s(wo, S, g.tw, "w")
        || read_i64s(lato, S - 1, g.lat, "latency") || read_i64s(txo, S - 1, g.tx, "transfer")
        || read_i64s(xo, S, g.x, "x") || read_i64s(limo, S, g.lim, "limit")) goto done;
    if (have_bound && (bound = PyLong_AsLongLong(boundo)) == -1 && PyErr_Occurred()) goto done;
    if (g_resolve(&g)) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    status = run(&g, full, have_bound, bound, &makespan, &cap_bound);
    Py_END_ALLOW_THREADS
    if (status == -2) { PyErr_SetString(PyExc_ValueError, DEADLOCK); goto done; }
    if (status < 0) { PyErr_NoMemory(); goto done; }
    if (status == 0) {
        result = Py_BuildValue("(OLO)", Py_None, makespan, cap_bound ? Py_True : Py_False);
    } else {
        PyObject *order = build_order(&g);
        if (order) {
            result = Py_BuildValue("(OLO)", order, makespan, cap_bound ? Py_True : Py_False);
            Py_DECREF(order);
        }
    }
done:
    gen_free(&g);
    deps_free(&deps);
    return result;
}

/* ------------------------------------------------------ generate_virtual: virtual._virtual_loop_py */
typedef struct {
    Py_ssize_t S, N, R;
    int *s2r, *own, *own_off, *fcount, *bcount, *nops, *kinds, *stg, *mbs;
    i64 *tf, *tb, *tw, *lat, *tx, *x, *lim, *chfree, *free_at, *qready;
    int *qmb;
    Q *q;  /* one per class: F of stage s at q[3s], I at q[3s + 1], W at q[3s + 2] */
    Heap heap;
    int release_w;  /* bcount counts W (else I): plan/profile.py RELEASES */
    const DepTable *deps;
} VGen;

/* the end (at `done`) of class cq's op of microbatch mb on stage s: every class it feeds (deps) gets mb,
 * at once on the same rank, else when the message on channel (src rank, dst rank) arrives */
static int v_feed(VGen *g, int s, int cq, int mb, i64 done) {
    const DepTable *d = g->deps;
    for (int j = d->feeds_off[cq]; j < d->feeds_off[cq + 1]; j++) {
        int c = d->feeds[j], l = d->link[c], src = g->s2r[s], dst = g->s2r[c / 3];
        if (src == dst) { q_push(&g->q[c], done, mb); continue; }
        i64 arrive = link_send_ns(&g->chfree[(Py_ssize_t)src * g->R + dst], g->tx[l], g->lat[l], done);
        q_push(&g->q[c], arrive, mb);
        if (heap_push(&g->heap, arrive, dst)) return -1;
    }
    return 0;
}

/* key (class, value, -s) < key of the best so far */
static int v_better(int cls, i64 val, int s, int bcls, i64 bval, int bs) {
    if (cls != bcls) return cls < bcls;
    if (val != bval) return val < bval;
    return -s < -bs;
}

static int v_run(VGen *g, i64 *makespan) {
    Py_ssize_t S = g->S, N = g->N, R = g->R;
    for (int c = 0; c < 3 * S; c++)
        if (g->deps->trigger[c] == DEPS_ROOT)
            for (int m = 0; m < N; m++) q_push(&g->q[c], 0, m);
    i64 remaining = 3 * (i64)N * S;
    for (int r = 0; r < R; r++)
        if (heap_push(&g->heap, 0, r)) return -1;
    while (remaining) {
        if (!g->heap.n) return -2;
        Ev e = heap_pop(&g->heap);
        i64 t = e.t;
        int r = e.i, bs = -1, bcls = 0;
        i64 bval = 0;
        if (g->free_at[r] > t) continue;
        for (int j = g->own_off[r]; j < g->own_off[r + 1]; j++) {
            int s = g->own[j], cls;
            i64 val;
            Q *fq = &g->q[3 * s], *bq = fq + 1, *wq = fq + 2;
            if (bq->head < bq->tail && bq->ready[bq->head] <= t && g->fcount[s] >= g->x[s]) {
                cls = 0; val = bq->mb[bq->head];
            } else if (fq->head < fq->tail && fq->ready[fq->head] <= t && g->fcount[s] - g->bcount[s] < g->lim[s]) {
                cls = 1; val = fq->mb[fq->head];
            } else if (wq->head < wq->tail) {
                cls = 2; val = wq->ready[wq->head];
            } else {
                continue;
            }
            if (bs < 0 || v_better(cls, val, s, bcls, bval, bs)) { bs = s; bcls = cls; bval = val; }
        }
        if (bs < 0) continue;
        int s = bs, kind = bcls == 0 ? KI : bcls == 1 ? KF : KW, cq = 3 * s + (kind == KF ? 0 : kind == KI ? 1 : 2);
        Q *from = &g->q[cq];
        int mb = from->mb[from->head++];
        i64 done = t + (kind == KF ? g->tf[s] : kind == KI ? g->tb[s] : g->tw[s]);
        if (kind == KF) {
            g->fcount[s]++;
        } else if (kind == KI) {
            if (!g->release_w) g->bcount[s]++;  /* activations released (profile.RELEASES) */
        } else if (g->release_w) {
            g->bcount[s]++;
        }
        if (v_feed(g, s, cq, mb, done)) return -1;
        Py_ssize_t k = 3 * N * (Py_ssize_t)g->own_off[r] + g->nops[r]++;  /* rank r: at most 3N per stage */
        g->kinds[k] = kind; g->stg[k] = s; g->mbs[k] = mb;
        if (done > *makespan) *makespan = done;
        g->free_at[r] = done;
        remaining--;
        if (heap_push(&g->heap, done, r)) return -1;
    }
    return 1;
}

static void vgen_free(VGen *g) {
    free(g->s2r); free(g->tf); free(g->qready); free(g->qmb); free(g->kinds); free(g->q); free(g->heap.a);
}

static int vgen_alloc(VGen *g) {
    Py_ssize_t S = g->S, N = g->N, R = g->R, ops = 3 * S * N;
    g->s2r = (int *)calloc((size_t)(6 * S + 2 * R + 2), sizeof(int));
    g->tf = (i64 *)calloc((size_t)(8 * S + R * R + R), sizeof(i64));
    g->qready = (i64 *)calloc((size_t)ops, sizeof(i64));
    g->qmb = (int *)calloc((size_t)ops, sizeof(int));
    g->kinds = (int *)calloc((size_t)(3 * ops), sizeof(int));
    g->q = (Q *)calloc((size_t)(3 * S), sizeof(Q));
    if (!g->s2r || !g->tf || !g->qready || !g->qmb || !g->kinds || !g->q) return -1;
    g->own = g->s2r + S; g->own_off = g->own + S; g->fcount = g->own_off + R + 1; g->bcount = g->fcount + S;
    g->nops = g->bcount + S;
    g->stg = g->kinds + ops; g->mbs = g->stg + ops;
    g->tb = g->tf + S; g->tw = g->tb + S; g->lat = g->tw + S; g->tx = g->lat + S; g->x = g->tx + S;
    g->lim = g->x + S; g->chfree = g->lim + S; g->free_at = g->chfree + R * R;
    for (Py_ssize_t k = 0; k < 3 * S; k++) { g->q[k].ready = g->qready + k * N; g->q[k].mb = g->qmb + k * N; }
    return 0;
}

static PyObject *generate_virtual(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t N;
    PyObject *depso, *s2ro, *fo, *bo, *wo, *lato, *txo, *xo, *limo, *result = NULL, *order = NULL;
    int release_w = 0;
    if (!PyArg_ParseTuple(args, "OnOOOOOOOO|p", &depso, &N, &s2ro, &fo, &bo, &wo, &lato, &txo, &xo, &limo, &release_w))
        return NULL;
    VGen g;
    DepTable deps;
    memset(&g, 0, sizeof g);
    memset(&deps, 0, sizeof deps);
    g.release_w = release_w;
    g.S = PySequence_Size(s2ro);
    g.N = N;
    i64 *tmp = NULL, makespan = 0;
    int status;
    if (g.S < 1 || N < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "need at least one stage and one microbatch");
        return NULL;
    }
    if (!(tmp = (i64 *)malloc(sizeof(i64) * (size_t)g.S))) return PyErr_NoMemory();
    if (read_deps(depso, &deps, g.S, 0)) goto done;
    g.deps = &deps;
    if (read_i64s(s2ro, g.S, tmp, "stage_to_rank")) goto done;
    for (Py_ssize_t s = 0; s < g.S; s++) {
        if (tmp[s] < 0 || tmp[s] >= g.S) { PyErr_SetString(PyExc_ValueError, "stage_to_rank out of range"); goto done; }
        if (tmp[s] + 1 > g.R) g.R = tmp[s] + 1;
    }
    if (vgen_alloc(&g)) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t s = 0; s < g.S; s++) g.s2r[s] = (int)tmp[s];
    for (Py_ssize_t r = 0, j = 0; r < g.R; r++) {  /* each rank's stages in stage order */
        g.own_off[r] = (int)j;
        for (Py_ssize_t s = 0; s < g.S; s++) if (g.s2r[s] == r) g.own[j++] = (int)s;
        g.own_off[r + 1] = (int)j;
    }
    if (read_i64s(fo, g.S, g.tf, "f") || read_i64s(bo, g.S, g.tb, "b") || read_i64s(wo, g.S, g.tw, "w")
        || read_i64s(lato, g.S - 1, g.lat, "latency") || read_i64s(txo, g.S - 1, g.tx, "transfer")
        || read_i64s(xo, g.S, g.x, "x") || read_i64s(limo, g.S, g.lim, "limit")) goto done;
    Py_BEGIN_ALLOW_THREADS
    status = v_run(&g, &makespan);
    Py_END_ALLOW_THREADS
    if (status == -2) { PyErr_SetString(PyExc_RuntimeError, "generator stalled: no rank can make progress"); goto done; }
    if (status < 0) { PyErr_NoMemory(); goto done; }
    if (!(order = PyList_New(g.R))) goto done;
    for (Py_ssize_t r = 0; r < g.R; r++) {
        PyObject *ops = PyList_New(g.nops[r]);
        if (!ops) goto done;
        PyList_SET_ITEM(order, r, ops);
        for (int k = 0; k < g.nops[r]; k++) {
            Py_ssize_t j = 3 * g.N * (Py_ssize_t)g.own_off[r] + k;
            PyObject *op = Py_BuildValue("(iOi)", g.stg[j], KIND[g.kinds[j]], g.mbs[j]);
            if (!op) goto done;
            PyList_SET_ITEM(ops, k, op);
        }
    }
    result = Py_BuildValue("(OL)", order, makespan);
done:
    Py_XDECREF(order);
    free(tmp);
    vgen_free(&g);
    deps_free(&deps);
    return result;
}

/* ------------------------------------------------------------------ check: validate.py checks 1-3 */
typedef struct { int s, k, m; } COp;  /* k: KF, KI, KW, KB */

static int kind_of(PyObject *o) {
    if (!PyUnicode_Check(o) || PyUnicode_GET_LENGTH(o) != 1) return -1;
    switch (PyUnicode_READ_CHAR(o, 0)) {
        case 'F': return KF; case 'I': return KI; case 'W': return KW; case 'B': return KB;
        default: return -1;
    }
}

/* read rank r's ops; 0 ok, 1 malformed (Python names it), -1 error */
static int read_ops(PyObject *list, COp *out, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *op = PyList_GET_ITEM(list, j);  /* plain tuples of (int, str, int) only: torch's
                                                     _Action and others go through validate.as_ops */
        if (!PyTuple_CheckExact(op) || PyTuple_GET_SIZE(op) != 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(op, 0))
            || !PyLong_CheckExact(PyTuple_GET_ITEM(op, 2)) || !PyUnicode_CheckExact(PyTuple_GET_ITEM(op, 1))) return 1;
        long s = PyLong_AsLong(PyTuple_GET_ITEM(op, 0)), m = PyLong_AsLong(PyTuple_GET_ITEM(op, 2));
        if ((s == -1 || m == -1) && PyErr_Occurred()) { PyErr_Clear(); return 1; }
        int k = kind_of(PyTuple_GET_ITEM(op, 1));
        if (k < 0 || s < 0 || m < 0 || s > 0x3fffffff || m > 0x3fffffff) return 1;
        out[j].s = (int)s; out[j].k = k; out[j].m = (int)m;
    }
    return 0;
}

/* done key: a full B completes what an I would (deps.done_key) */
static int done_kind(int k) { return k == KB ? KI : k; }

/* every class op's class needs (deps) done for its microbatch? done[class * N + mb]; base[j] = needs[j] * N */
static int ready(const DepTable *d, const size_t *base, const unsigned char *done, COp o) {
    int q = 3 * o.s + done_kind(o.k);
    for (int j = d->needs_off[q], e = d->needs_off[q + 1]; j < e; j++)
        if (!done[base[j] + (size_t)o.m]) return 0;
    return 1;
}
#define DONE(s, k, m) done[((size_t)(s) * 3 + (k)) * (size_t)N + (m)]

/* the checks on parsed ops; 1 valid, 0 invalid, -1 out of memory */
static int check_ops(const DepTable *d, COp **ops, Py_ssize_t *len, Py_ssize_t R, int S, int N, const long *limit,
                     long *peak, unsigned char *seen, unsigned char *done, int *owner, Py_ssize_t *pos, long *held,
                     int release_w) {
    for (int s = 0; s < S; s++) owner[s] = -1;
    for (Py_ssize_t r = 0; r < R; r++)
        for (Py_ssize_t j = 0; j < len[r]; j++) {
            COp o = ops[r][j];
            if (o.s >= S || o.m >= N) return 0;
            if (owner[o.s] >= 0 && owner[o.s] != r) return 0;
            owner[o.s] = (int)r;
            unsigned char *c = &seen[((size_t)o.s * 4 + o.k) * (size_t)N + o.m];
            if (*c) return 0;
            *c = 1;
        }
    for (int s = 0; s < S; s++)
        for (int m = 0; m < N; m++) {
#define SEEN(k) seen[((size_t)s * 4 + (k)) * (size_t)N + m]
            int full = SEEN(KB), i = SEEN(KI), w = SEEN(KW);
            if (!SEEN(KF) || (full && (i || w)) || (!full && !(i && w))) return 0;
#undef SEEN
        }
    Py_ssize_t remaining = 0;
    for (Py_ssize_t r = 0; r < R; r++) remaining += len[r];
    size_t *base = (size_t *)malloc(sizeof(size_t) * ((size_t)d->needs_off[d->n] + 1));
    if (!base) return -1;
    for (int j = 0; j < d->needs_off[d->n]; j++) base[j] = (size_t)d->needs[j] * (size_t)N;
    while (remaining) {  /* progress: every rank runs its list in order under the dependency rule */
        int progressed = 0;
        for (Py_ssize_t r = 0; r < R; r++) {
            Py_ssize_t p = pos[r];
            while (p < len[r] && ready(d, base, done, ops[r][p])) {
                COp o = ops[r][p++];
                DONE(o.s, done_kind(o.k), o.m) = 1;
            }
            if (p != pos[r]) { remaining -= p - pos[r]; pos[r] = p; progressed = 1; }
        }
        if (!progressed) { free(base); return 0; }
    }
    free(base);
#undef DONE
    for (Py_ssize_t r = 0; r < R; r++)  /* memory: F done - I/B done, in program order */
        for (Py_ssize_t j = 0; j < len[r]; j++) {
            COp o = ops[r][j];
            if (o.k == KF && ++held[o.s] > peak[o.s]) peak[o.s] = held[o.s];
            else if (o.k == KB || o.k == (release_w ? KW : KI)) held[o.s]--;  /* profile.RELEASES */
        }
    for (int s = 0; s < S; s++)
        if (limit && peak[s] > limit[s]) return 0;
    return 1;
}

static PyObject *check(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *depso, *plan, *limo;
    int S, N;
    int release_w = 0;
    DepTable deps;
    if (!PyArg_ParseTuple(args, "OO!iiO|p", &depso, &PyDict_Type, &plan, &S, &N, &limo, &release_w)) return NULL;
    if (PyDict_Size(plan) == 0) Py_RETURN_NONE;
    if (S < 1 || N < 1) Py_RETURN_NONE;
    if (read_deps(depso, &deps, S, -1)) return NULL;
    Py_ssize_t R = PyDict_Size(plan), total = 0, k = 0, r = 0;
    PyObject *key, *val, *result = NULL;
    COp **ops = (COp **)calloc((size_t)R + 1, sizeof(COp *));
    Py_ssize_t *len = (Py_ssize_t *)calloc((size_t)R + 1, sizeof(Py_ssize_t));
    Py_ssize_t *pos = (Py_ssize_t *)calloc((size_t)R + 1, sizeof(Py_ssize_t));
    long *limit = NULL, *peak = (long *)calloc((size_t)S, sizeof(long)), *held = (long *)calloc((size_t)S, sizeof(long));
    unsigned char *seen = (unsigned char *)calloc((size_t)S * 4 * N, 1), *done = (unsigned char *)calloc((size_t)S * 3 * N, 1);
    int *owner = (int *)calloc((size_t)S, sizeof(int)), bad = 0, valid = 0;
    COp *all = NULL;
    if (!ops || !len || !pos || !peak || !held || !seen || !done || !owner) { PyErr_NoMemory(); goto out; }
    while (PyDict_Next(plan, &k, &key, &val)) {
        if (!PyList_Check(val)) { bad = 1; break; }
        total += PyList_GET_SIZE(val);
    }
    if (!bad && !(all = (COp *)malloc(sizeof(COp) * (size_t)(total + 1)))) { PyErr_NoMemory(); goto out; }
    k = 0; total = 0;
    while (!bad && PyDict_Next(plan, &k, &key, &val)) {
        len[r] = PyList_GET_SIZE(val);
        ops[r] = all + total;
        total += len[r];
        int st = read_ops(val, ops[r], len[r]);
        if (st < 0) goto out;
        bad = st;
        r++;
    }
    if (!bad && limo != Py_None) {
        if (!(limit = (long *)malloc(sizeof(long) * (size_t)S))) { PyErr_NoMemory(); goto out; }
        for (int s = 0; s < S; s++) {
            PyObject *item = PyLong_Check(limo) ? (Py_INCREF(limo), limo) : PySequence_GetItem(limo, s);
            if (!item) { PyErr_Clear(); bad = 1; break; }
            limit[s] = PyLong_AsLong(item);
            Py_DECREF(item);
            if (limit[s] == -1 && PyErr_Occurred()) { PyErr_Clear(); bad = 1; break; }
        }
    }
    if (!bad) valid = check_ops(&deps, ops, len, R, S, N, limit, peak, seen, done, owner, pos, held, release_w);
    if (valid < 0) { PyErr_NoMemory(); goto out; }
    if (!valid) { result = Py_None; Py_INCREF(result); goto out; }
    if (!(result = PyList_New(S))) goto out;
    for (int s = 0; s < S; s++) PyList_SET_ITEM(result, s, PyLong_FromLong(peak[s]));
out:
    free(ops); free(len); free(pos); free(limit); free(peak); free(held); free(seen); free(done); free(owner); free(all);
    deps_free(&deps);
    return result;
}

static PyMethodDef methods[] = {
    {"generate", generate, METH_VARARGS, "PipeMorph Alg.3/4, event-driven (see the module source)."},
    {"generate_virtual", generate_virtual, METH_VARARGS, "virtual._virtual_loop_py compiled (see the module source)."},
    {"check", check, METH_VARARGS, "validate.py's checks 1-3: per-stage peaks when valid, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pipemorph_c", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pipemorph_c(void) {
    const char *names[4] = {"F", "I", "W", "B"};
    for (int k = 0; k < 4; k++) {
        if (!KIND[k] && !(KIND[k] = PyUnicode_InternFromString(names[k]))) return NULL;
    }
    return PyModule_Create(&module);
}
