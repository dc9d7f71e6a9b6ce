/* Compiled search engine of the CrossPipe planner (titan_ext.plan.crosspipe).
 *
 * The same algorithms as the pure-Python reference in the crosspipe package — simulate's timing model
 * (CrossPipe §3.5) on flat arrays (crosspipe.retime.Retimer), the critical-path descent
 * (crosspipe.search.critical_moves / local_search with ``max_evals``) and the annealing of
 * crosspipe.search.anneal — in integer nanoseconds (int64; the annealing's threshold as
 * crosspipe.search.threshold computes it) with the same random numbers (splitmix64), so for a given
 * number of evaluations both return the same plan (tests/plan/test_crosspipe_engine.py).  Only faster:
 * the planner's time budget buys ~100x more plan evaluations here.
 *
 * The description arrives as data: Retimer.spec()'s per-operation durations, out-edges and producers,
 * built from a titan_ext.plan.placed.PlacedProfile and titan_ext.plan.deps.table (no rule is written
 * here); messages use _link.h's FIFO send (int64 ns, the one instantiation).
 *
 * Plain C and the CPython API; no torch, no numpy.  Built by setup.py as titan_ext.plan._search_c;
 * the planner falls back to the Python reference when it is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_link.h"

typedef long long ns_t;
#define NS_INF LLONG_MAX /* no bound / not finished (crosspipe.search._NO_BOUND and above) */
#define NO_BOUND (1LL << 62)

typedef struct {
    int d, ch, rd, unused; /* consumer, channel (-1: same rank), consumer's rank */
    ns_t tx, lat;          /* size·β, α */
} Edge;

typedef struct {
    int n, N, R, nch;
    ns_t *dur;
    int *ocnt;   /* out edges per op (0..2) */
    Edge *edge;  /* [2n]: op i's edges at 2i, 2i+1 */
    ns_t *zero;  /* n zeros: the "no tail" tail */
    int *rank, *kind, *prod;
    int *chan_of;     /* channel an op's message occupies (-1: none, or size·β = 0) */
    int *chan_sender; /* per channel: the rank that sends on it */
    double delta[3];
} Model;

typedef struct {
    int R;
    int *len;
    int **ord; /* ord[r][0..len[r]) */
    int *buf;
} Orders;

typedef struct {
    ns_t *start, *avail, *free_, *chfree;
    ns_t *msgres; /* per sending op: the end of its message's window on its channel (detail runs) */
    int *pos, *stack;
    char *queued;
} Work;

static void model_free(Model *m) {
    free(m->dur); free(m->ocnt); free(m->edge); free(m->zero);
    free(m->rank); free(m->kind); free(m->prod); free(m->chan_of); free(m->chan_sender);
}

static int get_int_list(PyObject *seq, int *dst, int n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) { Py_DECREF(fast); PyErr_SetString(PyExc_ValueError, "bad length"); return -1; }
    for (int i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        dst[i] = (int)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* spec = (N, R, nch, dur, out, rank, kind, prod, delta) as built by crosspipe.retime.Retimer.spec() */
static int model_parse(PyObject *spec, Model *m) {
    memset(m, 0, sizeof(*m));
    PyObject *dur, *out, *rank, *kind, *prod, *delta;
    if (!PyArg_ParseTuple(spec, "iiiOOOOOO", &m->N, &m->R, &m->nch, &dur, &out, &rank, &kind, &prod, &delta)) return -1;
    int n = (int)PySequence_Size(dur);
    if (n < 0) return -1;
    m->n = n;
    m->dur = (ns_t *)malloc(sizeof(ns_t) * (n + 1)); m->ocnt = (int *)calloc(n + 1, sizeof(int));
    m->edge = (Edge *)malloc(sizeof(Edge) * (2 * n + 1)); m->zero = (ns_t *)calloc(n + 1, sizeof(ns_t));
    m->rank = (int *)malloc(sizeof(int) * (n)); m->kind = (int *)malloc(sizeof(int) * (n)); m->prod = (int *)malloc(sizeof(int) * (n));
    if (!m->dur || !m->ocnt || !m->edge || !m->zero || !m->rank || !m->kind || !m->prod) {
        PyErr_NoMemory(); return -1;
    }
    for (int i = 0; i < n; i++) {
        PyObject *x = PySequence_GetItem(dur, i);
        if (!x) return -1;
        m->dur[i] = PyLong_AsLongLong(x); Py_DECREF(x);
        if (PyErr_Occurred()) return -1;
        PyObject *edges = PySequence_GetItem(out, i);
        if (!edges) return -1;
        int k = (int)PySequence_Size(edges);
        if (k < 0 || k > 2) { Py_DECREF(edges); PyErr_SetString(PyExc_ValueError, "at most 2 out edges"); return -1; }
        m->ocnt[i] = k;
        for (int j = 0; j < k; j++) {
            PyObject *e = PySequence_GetItem(edges, j);
            int d, ch; long long tx, lat;
            if (!e || !PyArg_ParseTuple(e, "iiLL", &d, &ch, &tx, &lat)) { Py_XDECREF(e); Py_DECREF(edges); return -1; }
            Py_DECREF(e);
            Edge *E = &m->edge[2 * i + j];
            E->d = d; E->ch = ch; E->tx = tx; E->lat = lat; E->rd = 0; E->unused = 0;
        }
        Py_DECREF(edges);
    }
    if (get_int_list(rank, m->rank, n) || get_int_list(kind, m->kind, n) || get_int_list(prod, m->prod, n)) return -1;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < m->ocnt[i]; j++) {
            Edge *E = &m->edge[2 * i + j];
            if (E->d < 0 || E->d >= n) { PyErr_SetString(PyExc_ValueError, "edge to a bad op id"); return -1; }
            E->rd = m->rank[E->d];
        }
    if (!PyArg_ParseTuple(delta, "ddd", &m->delta[0], &m->delta[1], &m->delta[2])) return -1;
    m->chan_of = (int *)malloc(sizeof(int) * (n > 0 ? n : 1));
    m->chan_sender = (int *)malloc(sizeof(int) * (m->nch + 1));
    if (!m->chan_of || !m->chan_sender) { PyErr_NoMemory(); return -1; }
    for (int c = 0; c <= m->nch; c++) m->chan_sender[c] = -1; /* -1: no message occupies the channel */
    for (int i = 0; i < n; i++) {
        m->chan_of[i] = -1;
        for (int j = 0; j < m->ocnt[i]; j++) {
            const Edge *E = &m->edge[2 * i + j];
            if (E->ch < 0) continue;
            if (E->ch >= m->nch) { PyErr_SetString(PyExc_ValueError, "edge on a bad channel"); return -1; }
            if (E->tx != 0) { m->chan_of[i] = E->ch; m->chan_sender[E->ch] = m->rank[i]; }
        }
    }
    return 0;
}

static void orders_free(Orders *o) { free(o->len); free(o->ord); free(o->buf); }

static int orders_parse(PyObject *seq, Orders *o, int R, int n) {
    memset(o, 0, sizeof(*o));
    if (PySequence_Size(seq) != R) { PyErr_SetString(PyExc_ValueError, "orders: one list per rank"); return -1; }
    o->R = R;
    o->len = (int *)calloc(R, sizeof(int)); o->ord = (int **)calloc(R, sizeof(int *)); o->buf = (int *)malloc(sizeof(int) * ((n > 0 ? n : 1)));
    if (!o->len || !o->ord || !o->buf) { PyErr_NoMemory(); return -1; }
    int off = 0;
    for (int r = 0; r < R; r++) {
        PyObject *lst = PySequence_GetItem(seq, r);
        if (!lst) return -1;
        int L = (int)PySequence_Size(lst);
        if (L < 0 || off + L > n) { Py_DECREF(lst); PyErr_SetString(PyExc_ValueError, "orders: too many operations"); return -1; }
        o->ord[r] = o->buf + off; o->len[r] = L;
        int rc = get_int_list(lst, o->ord[r], L);
        Py_DECREF(lst);
        if (rc) return -1;
        for (int j = 0; j < L; j++)
            if (o->ord[r][j] < 0 || o->ord[r][j] >= n) { PyErr_SetString(PyExc_ValueError, "orders: bad op id"); return -1; }
        off += L;
    }
    if (off != n) { PyErr_SetString(PyExc_ValueError, "orders: every operation exactly once"); return -1; }
    return 0;
}

static PyObject *orders_to_py(const Orders *o) {
    PyObject *res = PyList_New(o->R);
    if (!res) return NULL;
    for (int r = 0; r < o->R; r++) {
        PyObject *lst = PyList_New(o->len[r]);
        if (!lst) { Py_DECREF(res); return NULL; }
        for (int j = 0; j < o->len[r]; j++) PyList_SET_ITEM(lst, j, PyLong_FromLong(o->ord[r][j]));
        PyList_SET_ITEM(res, r, lst);
    }
    return res;
}

static int work_alloc(Work *w, const Model *m) {
    w->start = (ns_t *)malloc(sizeof(ns_t) * ((m->n + 1))); w->avail = (ns_t *)malloc(sizeof(ns_t) * (m->n + 1));
    w->free_ = (ns_t *)malloc(sizeof(ns_t) * (m->R)); w->chfree = (ns_t *)malloc(sizeof(ns_t) * ((m->nch + 1)));
    w->pos = (int *)malloc(sizeof(int) * (m->R)); w->stack = (int *)malloc(sizeof(int) * (m->R)); w->queued = (char *)malloc(m->R);
    w->msgres = (ns_t *)malloc(sizeof(ns_t) * (m->n + 1));
    if (!w->start || !w->avail || !w->free_ || !w->chfree || !w->pos || !w->stack || !w->queued || !w->msgres) {
        PyErr_NoMemory(); return -1;
    }
    return 0;
}

static void work_free(Work *w) {
    free(w->start); free(w->avail); free(w->free_); free(w->chfree); free(w->pos); free(w->stack); free(w->queued);
    free(w->msgres);
}

/* crosspipe.retime.Retimer._loop: advance every rank from w->pos / w->free_ / w->chfree / w->avail
 * (``done`` operations already timed).  Returns the makespan, the end of the last operation (NS_INF:
 * deadlock, or an operation's end — plus its rank's remaining work when ``tail`` is given — exceeded
 * ``bound``); *sf = Σ rank finish times.  ``detail``: also start (per op) and msgres (per sending op)
 * in ``w``. */
static ns_t loop(const Model *m, const Orders *o, Work *w, ns_t bound, const ns_t *tail, int detail, ns_t *sf,
                 int done) {
    const int n = m->n, R = m->R;
    ns_t *avail = w->avail, *fr_ = w->free_, *chfree = w->chfree, *start = w->start, *msgres = w->msgres;
    int *pos = w->pos, *stack = w->stack;
    char *queued = w->queued;
    const ns_t *tl = tail ? tail : m->zero, *dur = m->dur;
    const int *ocnt = m->ocnt;
    const Edge *edge = m->edge;
    int top = 0;
    for (int r = 0; r < R; r++) { queued[r] = 1; stack[top++] = r; }
    while (top) {
        int r = stack[--top];
        queued[r] = 0;
        const int *ops = o->ord[r];
        int p = pos[r], L = o->len[r];
        ns_t fr = fr_[r];
        while (p < L) {
            int op = ops[p];
            ns_t a = avail[op];
            if (a < 0) break;
            ns_t t = a > fr ? a : fr;
            if (detail) start[op] = t;
            fr = t + dur[op];
            if (fr + tl[op] > bound) { *sf = NS_INF; return NS_INF; }
            const Edge *E = edge + 2 * op, *Eend = E + ocnt[op];
            for (; E < Eend; E++) {
                int d = E->d, ch = E->ch;
                if (ch < 0) avail[d] = fr;
                else {
                    avail[d] = link_send_ns(&chfree[ch], E->tx, E->lat, fr);  /* _link.h */
                    if (detail && E->tx != 0) msgres[op] = chfree[ch];
                }
                int x = E->rd;
                if (x != r && !queued[x]) { queued[x] = 1; stack[top++] = x; }
            }
            p++;
        }
        done += p - pos[r];
        pos[r] = p;
        fr_[r] = fr;
    }
    if (done != n) { *sf = NS_INF; return NS_INF; }
    ns_t mx = fr_[0], s = 0;
    for (int r = 0; r < R; r++) { if (fr_[r] > mx) mx = fr_[r]; s += fr_[r]; }
    *sf = s;
    return mx;
}

/* crosspipe.retime.Retimer.run: time the orders from scratch (see loop). */
static ns_t run(const Model *m, const Orders *o, Work *w, ns_t bound, const ns_t *tail, int detail, ns_t *sf) {
    for (int i = 0; i < m->n; i++) w->avail[i] = -1;
    for (int i = 0; i < m->N; i++) w->avail[i] = 0;
    for (int c = 0; c < m->nch; c++) w->chfree[c] = 0;
    for (int r = 0; r < m->R; r++) { w->pos[r] = 0; w->free_[r] = 0; }
    return loop(m, o, w, bound, tail, detail, sf, 0);
}

/* Operations of rank x's order that started before T in the base timing ``b`` (its starts are
 * non-decreasing in program order); on the moved rank only positions < lo count (they are unchanged). */
static int started_before(const Model *m, const Orders *o, const Work *b, int x, ns_t T, int lim) {
    const int *ord = o->ord[x];
    int lo = 0, hi = lim;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (b->start[ord[mid]] < T) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* crosspipe.retime.Retimer.rerun: time ``o``, which differs from the orders timed in detail in ``b`` only
 * on rank r at positions lo..hi.  Every operation that started before the earliest of the moved ones
 * keeps its times (it cannot depend on them), so the run restarts from there; same result as run(). */
static ns_t rerun(const Model *m, const Orders *o, const Work *b, Work *w, int r, int lo, int hi, ns_t bound,
                  const ns_t *tail, int detail, ns_t *sf) {
    const int n = m->n, R = m->R;
    ns_t T = NS_INF;
    for (int j = lo; j <= hi; j++) { ns_t t = b->start[o->ord[r][j]]; if (t < T) T = t; }
    int done = 0;
    for (int x = 0; x < R; x++) {
        w->pos[x] = started_before(m, o, b, x, T, x == r ? lo : o->len[x]);
        done += w->pos[x];
    }
    if (!done) return run(m, o, w, bound, tail, detail, sf);
    for (int x = 0; x < R; x++) {
        int k = w->pos[x];
        w->free_[x] = k ? b->start[o->ord[x][k - 1]] + m->dur[o->ord[x][k - 1]] : 0;
    }
    for (int c = 0; c < m->nch; c++) {
        int x = m->chan_sender[c];
        ns_t v = 0;
        for (int k = x < 0 ? -1 : w->pos[x] - 1; k >= 0; k--)
            if (m->chan_of[o->ord[x][k]] == c) { v = b->msgres[o->ord[x][k]]; break; }
        w->chfree[c] = v;
    }
    memcpy(w->avail, b->avail, sizeof(ns_t) * n);
    for (int x = 0; x < R; x++)
        for (int k = w->pos[x]; k < o->len[x]; k++) {
            int op = o->ord[x][k];
            for (int j = 0; j < m->ocnt[op]; j++) w->avail[m->edge[2 * op + j].d] = -1;
        }
    if (detail) {
        memcpy(w->start, b->start, sizeof(ns_t) * (n + 1));
        memcpy(w->msgres, b->msgres, sizeof(ns_t) * n);
    }
    return loop(m, o, w, bound, tail, detail, sf, done);
}

static void rank_tails(const Model *m, const Orders *o, ns_t *tail) {
    for (int r = 0; r < o->R; r++) {
        ns_t acc = 0;
        for (int j = o->len[r] - 1; j >= 0; j--) { int x = o->ord[r][j]; tail[x] = acc; acc += m->dur[x]; }
    }
}

static void update_tails(const Model *m, ns_t *tail, const int *o, int L, int lo, int hi) {
    ns_t acc = hi + 1 < L ? tail[o[hi + 1]] + m->dur[o[hi + 1]] : 0;
    for (int j = hi; j >= lo; j--) { int x = o[j]; tail[x] = acc; acc += m->dur[x]; }
}

static int memory_ok(const Model *m, const int *o, int lo, int hi, double limit) {
    double cur = 0.0;
    for (int j = 0; j <= hi; j++) {
        cur += m->delta[m->kind[o[j]]];
        if (j >= lo && cur > limit + 1e-9) return 0;
    }
    return 1;
}

static void move(int *o, int p, int q) {
    int x = o[p];
    if (p < q) memmove(o + p, o + p + 1, sizeof(int) * (q - p));
    else if (q < p) memmove(o + q + 1, o + q, sizeof(int) * (p - q));
    o[q] = x;
}

/* ------------------------------------------------------------------ critical-path moves */
typedef struct { int r, p, q; } Move;
typedef struct {
    Move *mv; int nmv, cap;
    int64_t *keys; int hcap; /* open addressing, -1 = empty */
    int *used; int nused;    /* filled slots */
} MoveSet;

static int moveset_add(MoveSet *s, int r, int p, int q, int n) {
    int64_t key = ((int64_t)r * (n + 1) + p) * (n + 1) + q;
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ULL;
    int i = (int)(h >> 40) & (s->hcap - 1);
    while (s->keys[i] != -1) {
        if (s->keys[i] == key) return 0;
        i = (i + 1) & (s->hcap - 1);
    }
    if (s->nmv + 1 > s->hcap / 2) return 0; /* never happens: hcap sized for the path */
    s->keys[i] = key;
    s->used[s->nused++] = i;
    if (s->nmv == s->cap) {
        int nc = s->cap ? 2 * s->cap : 256;
        Move *nm = (Move *)realloc(s->mv, sizeof(Move) * nc);
        if (!nm) return -1;
        s->mv = nm; s->cap = nc;
    }
    s->mv[s->nmv].r = r; s->mv[s->nmv].p = p; s->mv[s->nmv].q = q; s->nmv++;
    return 0;
}

/* crosspipe.search.critical_moves, same moves in the same order. */
static int critical_moves(const Model *m, const Orders *o, const ns_t *start, const ns_t *avail, int depth,
                          int long_moves, int gap_fill, int *posof, MoveSet *s) {
    const int N = m->N, n = m->n;
    for (int i = 0; i < s->nused; i++) s->keys[s->used[i]] = -1; /* clear only what the last call filled */
    s->nmv = s->nused = 0;
    for (int r = 0; r < o->R; r++) for (int j = 0; j < o->len[r]; j++) posof[o->ord[r][j]] = j;
    int cur = -1;
    ns_t best = 0;
    for (int r = 0; r < o->R; r++) {
        if (!o->len[r]) continue;
        int x = o->ord[r][o->len[r] - 1];
        ns_t e = start[x] + m->dur[x];
        if (cur < 0 || e > best) { best = e; cur = x; }
    }
    while (1) {
        int r = m->rank[cur];
        const int *ord = o->ord[r];
        int L = o->len[r];
        int p = posof[cur];
        int rank_bound = 0, prev = -1;
        if (p > 0) {
            prev = ord[p - 1];
            rank_bound = start[cur] <= start[prev] + m->dur[prev] && avail[cur] < start[cur];
        }
        if (rank_bound) {
            int cls = cur / N;
            for (int q = p - 1; q >= 0 && p - q <= depth; q--) {
                int a = ord[q];
                if (a / N == cls || avail[cur] >= start[a] + m->dur[a]) break;
                if (moveset_add(s, r, p, q, n)) return -1;
            }
            int pcls = prev / N;
            int qend = L < p - 1 + depth ? L : p - 1 + depth;
            for (int q = p; q < qend; q++) {
                if (ord[q] / N == pcls) break;
                if (q != p && moveset_add(s, r, p - 1, q, n)) return -1;
            }
            if (long_moves == 2 || (long_moves == 1 && m->kind[prev] == 2)) {
                int q = p;
                while (q < L && ord[q] / N != pcls) q++;
                if (q - 1 >= p - 1 + depth && moveset_add(s, r, p - 1, q - 1, n)) return -1;
            }
            cur = prev;
            continue;
        }
        if (gap_fill && p > 0 && start[cur] > start[prev] + m->dur[prev]) {
            int cls = cur / N, nfound = 0, found[8];
            int jend = L < p + 1 + 4 * depth ? L : p + 1 + 4 * depth;
            for (int j = p + 1; j < jend; j++) {
                int y = ord[j], ycls = y / N, seen_cls = ycls == cls;
                for (int k = 0; k < nfound && !seen_cls; k++) seen_cls = found[k] == ycls;
                if (seen_cls) continue;
                if (nfound < 8) found[nfound++] = ycls;
                if (avail[y] < start[cur] && moveset_add(s, r, j, p, n)) return -1;
            }
        }
        if (m->prod[cur] >= n) break;
        cur = m->prod[cur];
    }
    return 0;
}

/* ------------------------------------------------------------------ random numbers */
static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* ------------------------------------------------------------------ Python entry points */
typedef struct {
    Model m; Orders o; Work w; double *limit; ns_t *tail;
    int owned; /* m's arrays are ours (parsed from a tuple) rather than a model capsule's */
} Ctx;

static const char *CAPSULE = "titan_ext.plan._search_c.Model";

static void ctx_free(Ctx *c) {
    if (c->owned) model_free(&c->m);
    orders_free(&c->o); work_free(&c->w); free(c->limit); free(c->tail);
}

static void capsule_free(PyObject *cap) {
    Model *m = (Model *)PyCapsule_GetPointer(cap, CAPSULE);
    if (m) { model_free(m); free(m); }
}

/* model(spec) -> capsule: the parsed model, reusable by every call of one plan (parsing a spec costs
 * ~50 us at 768 operations, more than a timing). */
static PyObject *py_model(PyObject *self, PyObject *args) {
    PyObject *spec;
    if (!PyArg_ParseTuple(args, "O", &spec)) return NULL;
    Model *m = (Model *)calloc(1, sizeof(Model));
    if (!m) return PyErr_NoMemory();
    if (model_parse(spec, m)) { model_free(m); free(m); return NULL; }
    PyObject *cap = PyCapsule_New(m, CAPSULE, capsule_free);
    if (!cap) { model_free(m); free(m); }
    return cap;
}

/* spec: a model capsule or the tuple of crosspipe.retime.Retimer.spec() */
static int ctx_init(Ctx *c, PyObject *spec, PyObject *orders, PyObject *limit) {
    memset(c, 0, sizeof(*c));
    if (PyCapsule_CheckExact(spec)) {
        Model *m = (Model *)PyCapsule_GetPointer(spec, CAPSULE);
        if (!m) return -1;
        c->m = *m;
    } else {
        c->owned = 1;
        if (model_parse(spec, &c->m)) return -1;
    }
    if (orders_parse(orders, &c->o, c->m.R, c->m.n)) return -1;
    if (work_alloc(&c->w, &c->m)) return -1;
    c->limit = (double *)malloc(sizeof(double) * (c->m.R)); c->tail = (ns_t *)malloc(sizeof(ns_t) * (c->m.n + 1));
    if (!c->limit || !c->tail) { PyErr_NoMemory(); return -1; }
    if (limit == Py_None) {
        for (int r = 0; r < c->m.R; r++) c->limit[r] = INFINITY;
    } else {
        if (PySequence_Size(limit) != c->m.R) { PyErr_SetString(PyExc_ValueError, "limit: one per rank"); return -1; }
        for (int r = 0; r < c->m.R; r++) {
            PyObject *x = PySequence_GetItem(limit, r);
            if (!x) return -1;
            c->limit[r] = PyFloat_AsDouble(x); Py_DECREF(x);
            if (PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

/* an ns value for Python: an int, or float('inf') for NS_INF (not finished / over the bound) */
static PyObject *ns_to_py(ns_t v) {
    return v == NS_INF ? PyFloat_FromDouble(INFINITY) : PyLong_FromLongLong(v);
}

/* a bound from Python: an int (ns) or a float (inf, or a real: its floor, since times are whole ns);
 * at or above NO_BOUND none */
static int bound_from_py(PyObject *o, ns_t *out) {
    if (PyLong_Check(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        *out = overflow > 0 || v >= NO_BOUND ? NS_INF : (overflow < 0 ? -1 : v);
        return 0;
    }
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *out = !(d < (double)NO_BOUND) ? NS_INF : (ns_t)floor(d);
    return 0;
}

static PyObject *py_run(PyObject *self, PyObject *args) {
    PyObject *spec, *orders, *bound_o;
    ns_t bound;
    if (!PyArg_ParseTuple(args, "OOO", &spec, &orders, &bound_o)) return NULL;
    if (bound_from_py(bound_o, &bound)) return NULL;
    Ctx c;
    if (ctx_init(&c, spec, orders, Py_None)) { ctx_free(&c); return NULL; }
    ns_t sf, mk = run(&c.m, &c.o, &c.w, bound, NULL, 0, &sf);
    ctx_free(&c);
    return Py_BuildValue("NN", ns_to_py(mk), ns_to_py(sf));
}

/* descent(spec, orders, limit, max_evals, depth, long_moves, gap_fill) -> (orders, makespan, evals)
 * = crosspipe.search.local_search(model, orders, limit, inf, depth, max_evals=..., long_moves=..., gap_fill=...). */
static PyObject *py_descent(PyObject *self, PyObject *args) {
    PyObject *spec, *orders, *limit; long long max_evals; int depth, long_moves, gap_fill, incremental = 1;
    if (!PyArg_ParseTuple(args, "OOOLiii|p", &spec, &orders, &limit, &max_evals, &depth, &long_moves, &gap_fill,
                          &incremental)) return NULL;
    Ctx c;
    MoveSet ms = {NULL, 0, 0, NULL, 0, NULL, 0};
    int *posof = NULL, failed = 0;
    ns_t sf = 0, mk = NS_INF;
    Work wb; /* the current plan, timed in detail: the base of every candidate's rerun */
    long long evals = 1;
    PyObject *res = NULL, *ol;
    const Model *m = &c.m;
    memset(&wb, 0, sizeof(wb));
    if (ctx_init(&c, spec, orders, limit)) goto done;
    posof = (int *)malloc(sizeof(int) * (m->n));
    ms.hcap = 1;
    while (ms.hcap < 8 * (m->n + 8) * (depth + 2)) ms.hcap <<= 1;
    ms.keys = (int64_t *)malloc(sizeof(int64_t) * (ms.hcap));
    ms.used = (int *)malloc(sizeof(int) * (ms.hcap / 2 + 1));
    if (!posof || !ms.keys || !ms.used) { PyErr_NoMemory(); goto done; }
    for (int i = 0; i < ms.hcap; i++) ms.keys[i] = -1;
    if (work_alloc(&wb, m)) goto done;
    Py_BEGIN_ALLOW_THREADS
    mk = run(m, &c.o, &wb, NS_INF, NULL, 1, &sf);
    rank_tails(m, &c.o, c.tail);
    while (evals < max_evals && mk < NS_INF) {
        int improved = 0;
        if (critical_moves(m, &c.o, wb.start, wb.avail, depth, long_moves, gap_fill, posof, &ms)) { failed = 1; break; }
        for (int i = 0; i < ms.nmv; i++) {
            if (evals >= max_evals) break;
            int r = ms.mv[i].r, p = ms.mv[i].p, q = ms.mv[i].q;
            int *o = c.o.ord[r], L = c.o.len[r];
            int lo = p < q ? p : q, hi = p < q ? q : p;
            move(o, p, q);
            if (!memory_ok(m, o, lo, hi, c.limit[r])) { move(o, q, p); continue; }
            update_tails(m, c.tail, o, L, lo, hi);
            ns_t s2, m2 = incremental ? rerun(m, &c.o, &wb, &c.w, r, lo, hi, mk, c.tail, 0, &s2)
                                      : run(m, &c.o, &c.w, mk, c.tail, 0, &s2);
            evals++;
            if (m2 < mk || (m2 <= mk && s2 < sf)) {
                mk = incremental ? rerun(m, &c.o, &wb, &c.w, r, lo, hi, NS_INF, NULL, 1, &sf)
                                 : run(m, &c.o, &c.w, NS_INF, NULL, 1, &sf);
                Work tmp = wb; wb = c.w; c.w = tmp;
                improved = 1;
                break;
            }
            move(o, q, p);
            update_tails(m, c.tail, o, L, lo, hi);
        }
        if (!improved) break;
    }
    Py_END_ALLOW_THREADS
    if (failed) { PyErr_NoMemory(); goto done; }
    ol = orders_to_py(&c.o);
    if (ol) res = Py_BuildValue("NNL", ol, ns_to_py(mk), evals);
done:
    work_free(&wb);
    free(posof); free(ms.mv); free(ms.keys); free(ms.used);
    ctx_free(&c);
    return res;
}

/* The state of one annealing run (crosspipe.search.anneal). */
typedef struct {
    const Model *m;
    const double *limit;
    Orders o;
    Work w;
    ns_t *tail;
    int *best;
    long long max_evals, evals;
    uint64_t seed;
    double t0;
    ns_t bmk;
    int max_shift;
} Chain;

static int chain_init(Chain *c, const Model *m, const double *limit, const Orders *src) {
    memset(c, 0, sizeof(*c));
    c->m = m; c->limit = limit;
    int R = src->R, n = m->n;
    c->o.R = R;
    c->o.len = (int *)malloc(sizeof(int) * R); c->o.ord = (int **)malloc(sizeof(int *) * R);
    c->o.buf = (int *)malloc(sizeof(int) * (n > 0 ? n : 1));
    c->tail = (ns_t *)malloc(sizeof(ns_t) * (n + 1)); c->best = (int *)malloc(sizeof(int) * (n > 0 ? n : 1));
    if (!c->o.len || !c->o.ord || !c->o.buf || !c->tail || !c->best || work_alloc(&c->w, m)) return -1;
    memcpy(c->o.buf, src->buf, sizeof(int) * n);
    for (int r = 0; r < R; r++) { c->o.len[r] = src->len[r]; c->o.ord[r] = c->o.buf + (src->ord[r] - src->buf); }
    return 0;
}

static void chain_free(Chain *c) { orders_free(&c->o); work_free(&c->w); free(c->tail); free(c->best); }

static void chain_run(Chain *c) {
    const Model *m = c->m;
    const int N = m->N, R = m->R;
    ns_t sf, cur = run(m, &c->o, &c->w, NS_INF, NULL, 0, &sf);
    long long evals = 0, attempts = 0, max_evals = c->max_evals, max_attempts = 64 * max_evals + 1024;
    uint64_t st = c->seed;
    c->bmk = cur;
    memcpy(c->best, c->o.buf, sizeof(int) * m->n);
    rank_tails(m, &c->o, c->tail);
    while (evals < max_evals && attempts < max_attempts && cur < NS_INF) {
        attempts++;
        int r = (int)(splitmix64(&st) % (uint64_t)R);
        int L = c->o.len[r];
        int p = (int)(splitmix64(&st) % (uint64_t)(L > 0 ? L : 1));
        int d = 1 + (int)(splitmix64(&st) % (uint64_t)c->max_shift);
        if (splitmix64(&st) & 1) d = -d;
        int q = p + d;
        if (L < 2 || q < 0 || q >= L) continue;
        int *o = c->o.ord[r];
        int lo = p < q ? p : q, hi = p < q ? q : p, cls = o[p] / N, clash = 0;
        for (int j = lo; j <= hi; j++) if (j != p && o[j] / N == cls) { clash = 1; break; }
        if (clash) continue;
        move(o, p, q);
        if (!memory_ok(m, o, lo, hi, c->limit[r])) { move(o, q, p); continue; }
        update_tails(m, c->tail, o, L, lo, hi);
        double u = (double)(splitmix64(&st) >> 11) * (1.0 / 9007199254740992.0);
        double temp = c->t0 * (1.0 - (double)evals / (double)max_evals);
        ns_t thr = NS_INF; /* crosspipe.search.threshold: cur + floor(temp * -ln u), whole ns */
        if (u > 0.0) {
            double x = temp * -log(u);
            if (x < (double)NO_BOUND) thr = cur + (ns_t)floor(x);
        }
        evals++;
        /* timed from scratch: restarting from the moved operation (as the descent does) measured no
         * faster here (docs/crosspipe.md) */
        ns_t s2, m2 = run(m, &c->o, &c->w, thr, c->tail, 0, &s2);
        if (m2 < NS_INF) {
            cur = m2;
            if (m2 < c->bmk) { c->bmk = m2; memcpy(c->best, c->o.buf, sizeof(int) * m->n); }
        } else {
            move(o, q, p);
            update_tails(m, c->tail, o, L, lo, hi);
        }
    }
    c->evals = evals;
}

/* anneal(spec, orders, limit, max_evals, seed, t0, max_shift) -> (orders, makespan, evals):
 * crosspipe.search.anneal — the best plan seen and the evaluations made. */
static PyObject *py_anneal(PyObject *self, PyObject *args) {
    PyObject *spec, *orders, *limit, *ol, *res = NULL;
    long long max_evals;
    unsigned long long seed;
    double t0;
    int max_shift;
    Ctx c;
    Chain ch;
    memset(&ch, 0, sizeof(ch));
    if (!PyArg_ParseTuple(args, "OOOLKdi", &spec, &orders, &limit, &max_evals, &seed, &t0, &max_shift)) return NULL;
    if (ctx_init(&c, spec, orders, limit)) goto done;
    if (max_shift < 1) { PyErr_SetString(PyExc_ValueError, "max_shift >= 1"); goto done; }
    if (chain_init(&ch, &c.m, c.limit, &c.o)) { PyErr_NoMemory(); goto done; }
    ch.seed = seed; ch.max_evals = max_evals; ch.t0 = t0; ch.max_shift = max_shift;
    Py_BEGIN_ALLOW_THREADS
    chain_run(&ch);
    Py_END_ALLOW_THREADS
    memcpy(c.o.buf, ch.best, sizeof(int) * c.m.n);
    ol = orders_to_py(&c.o);
    if (ol) res = Py_BuildValue("NNL", ol, ns_to_py(ch.bmk), ch.evals);
done:
    chain_free(&ch);
    ctx_free(&c);
    return res;
}

static PyMethodDef methods[] = {
    {"model", py_model, METH_VARARGS, "model(spec) -> capsule usable as ``spec`` by the other functions"},
    {"run", py_run, METH_VARARGS, "run(spec, orders, bound) -> (makespan, finish_sum)"},
    {"descent", py_descent, METH_VARARGS, "descent(spec, orders, limit, max_evals, depth, long_moves, gap_fill, "
     "incremental=True) -> (orders, makespan, evals)"},
    {"anneal", py_anneal, METH_VARARGS, "anneal(spec, orders, limit, max_evals, seed, t0, max_shift) -> (orders, makespan, evals)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_search_c", "Compiled CrossPipe plan search (see titan_ext.plan.crosspipe).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__search_c(void) { return PyModule_Create(&moddef); }
