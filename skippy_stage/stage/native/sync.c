/* Clocks and the waits of the frame path, each on a CLOCK_MONOTONIC condition variable, with the
 * GIL released while waiting: Bell (a handler's wake-up), Gate (the edge's gate) and ReturnWait
 * (where the head's lone generation waits for its step's return). */
#include "frames.h"

#include <math.h>
#include <string.h>

double sk_now_monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t sk_now_unix_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A condition variable that times out on CLOCK_MONOTONIC (wall-clock steps cannot cut a wait
 * short or stretch it), and its mutex. */
static void monotonic_cond_init(pthread_cond_t *cond, pthread_mutex_t *mu) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(mu, NULL);
}

/* CLOCK_MONOTONIC's time ``seconds`` (>= 0) from now, for pthread_cond_timedwait. */
struct timespec sk_monotonic_after(double seconds) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    double whole = floor(seconds);
    until.tv_sec += (time_t)whole;
    until.tv_nsec += (long)((seconds - whole) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    return until;
}

/* Bell's and Gate's mutex and condition variable: made by ``__init__`` (no arguments; once, however
 * often it is called), destroyed with the object. */
static int sync_init(PyObject *args, PyObject *kw, pthread_mutex_t *mu, pthread_cond_t *cond, int *ready) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "", names)) return -1;
    if (!*ready) {
        monotonic_cond_init(cond, mu);
        *ready = 1;
    }
    return 0;
}

static void sync_dealloc(PyObject *self, pthread_mutex_t *mu, pthread_cond_t *cond, int ready) {
    if (ready) {
        pthread_cond_destroy(cond);
        pthread_mutex_destroy(mu);
    }
    Py_TYPE(self)->tp_free(self);
}

/* A wait's seconds, finite and >= 0 (a NaN deadline makes pthread_cond_timedwait fail with EINVAL,
 * which no caller may mistake for "not yet"): else ValueError naming ``who``. Capped at 1e6 s. */
int sk_timeout_checked(double seconds, const char *who, double *timeout) {
    if (!isfinite(seconds) || seconds < 0) {
        PyObject *got = PyFloat_FromDouble(seconds);
        if (got != NULL) {
            PyErr_Format(PyExc_ValueError, "%s: timeout_s must be finite and >= 0, got %R", who, got);
            Py_DECREF(got);
        }
        return -1;
    }
    *timeout = seconds > 1e6 ? 1e6 : seconds;
    return 0;
}

/* A wait's seconds from a Python float or None (None: no limit, -1 here); see timeout_checked. */
static int timeout_arg(PyObject *arg, const char *who, double *timeout) {
    *timeout = -1;
    if (arg == Py_None) return 0;
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1 && PyErr_Occurred()) return -1;
    return sk_timeout_checked(seconds, who, timeout);
}

/* One timed wait on a CLOCK_MONOTONIC condition: 1 to wait on (woken, or spuriously), 0 to stop
 * (the deadline passed, or any other error: EINVAL would otherwise return at once forever, a spin
 * holding ``mu``). */
int sk_timed_wait(pthread_cond_t *cond, pthread_mutex_t *mu, const struct timespec *until) {
    return pthread_cond_timedwait(cond, mu, until) == 0;
}

/* An untimed wait: 1 to wait on, 0 on an error (never expected; a spin otherwise). */
static int untimed_wait(pthread_cond_t *cond, pthread_mutex_t *mu) { return pthread_cond_wait(cond, mu) == 0; }

/* -- a handler's wake-up, rung without the GIL ----------------------------------------------------
 *
 * A Generate handler waits on its task's Bell for the scheduler's events. Rung from Python (``ring``)
 * it is a condition variable; the head's lone generation rings it from C after the loop has released
 * the GIL (``lone``'s ``bell``), so the handler does not wake into a GIL the scheduler's thread
 * still holds (woken, blocked on the GIL, woken again: four switches of a core the next stage's
 * decode is about to need). ``wait`` returns once rung since the last wait (the rings between two
 * waits count as one: the waiter takes whatever was put before them), or False at its timeout. */

static int Bell_init(Bell *self, PyObject *args, PyObject *kw) {
    return sync_init(args, kw, &self->mu, &self->cond, &self->ready);
}

static void Bell_dealloc(Bell *self) { sync_dealloc((PyObject *)self, &self->mu, &self->cond, self->ready); }

/* Callable with or without the GIL. Signalled after unlocking: a waiter woken on this thread's
 * core would otherwise run only to block on the mutex still held here, and be woken again. */
void sk_bell_ring(Bell *self) {
    pthread_mutex_lock(&self->mu);
    self->rung = 1;
    pthread_mutex_unlock(&self->mu);
    pthread_cond_signal(&self->cond);
}

static PyObject *Bell_ring(Bell *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Bell: not initialised");
        return NULL;
    }
    sk_bell_ring(self);
    Py_RETURN_NONE;
}

/* wait(timeout_s: float | None) -> bool */
static PyObject *Bell_wait(Bell *self, PyObject *arg) {
    double timeout;
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Bell: not initialised");
        return NULL;
    }
    if (timeout_arg(arg, "Bell.wait", &timeout) < 0) return NULL;
    int got;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until = sk_monotonic_after(timeout >= 0 ? timeout : 0);
    pthread_mutex_lock(&self->mu);
    while (!self->rung)
        if (!(timeout < 0 ? untimed_wait(&self->cond, &self->mu) : sk_timed_wait(&self->cond, &self->mu, &until)))
            break;
    got = self->rung;
    self->rung = 0;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(got);
}

static PyMethodDef Bell_methods[] = {
    {"ring", (PyCFunction)Bell_ring, METH_NOARGS, "ring() -> None: wake the waiter (or the next wait)"},
    {"wait", (PyCFunction)Bell_wait, METH_O,
     "wait(timeout_s or None) -> bool: True once rung since the last wait, False at the timeout"},
    {NULL}};

PyTypeObject sk_BellType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.Bell",
    .tp_basicsize = sizeof(Bell),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Bell_init,
    .tp_dealloc = (destructor)Bell_dealloc,
    .tp_methods = Bell_methods,
    .tp_doc = "A handler's wake-up that C can ring without the GIL.",
};

/* -- the gate in front of a stage's downstream edge, passed without the interpreter ---------------
 *
 * ``gate.EdgeGate``'s state (its contract is written there): frames pass from before their compute
 * to after their send, a hand-off closes it and waits for those passing. Here so that the C paths
 * pass it with a mutex rather than two Python method calls on a Condition: those cost ~50 us a
 * token at the head, on the caches the decode before them emptied (measured, `perf`), where the
 * same calls cost under 1 us hot. Waits release the GIL; the mutex is never held across one. */

static int Gate_init(Gate *self, PyObject *args, PyObject *kw) {
    return sync_init(args, kw, &self->mu, &self->cond, &self->ready);
}

static void Gate_dealloc(Gate *self) { sync_dealloc((PyObject *)self, &self->mu, &self->cond, self->ready); }

/* A frame passes in: at once while the gate is open, else once it opens (the GIL released).
 * Called with the GIL held. */
void sk_gate_in(Gate *g) {
    pthread_mutex_lock(&g->mu);
    if (!g->closed) {
        g->passing++;
        pthread_mutex_unlock(&g->mu);
        return;
    }
    pthread_mutex_unlock(&g->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g->mu);
    while (g->closed)
        if (!untimed_wait(&g->cond, &g->mu)) break;
    g->passing++;
    pthread_mutex_unlock(&g->mu);
    Py_END_ALLOW_THREADS
}

/* A frame passes out; callable with or without the GIL. Wakes a closer (or an idle wait) once
 * none is passing; nobody else waits for this. */
void sk_gate_out(Gate *g) {
    pthread_mutex_lock(&g->mu);
    int wake = --g->passing <= 0 && g->waiting > 0;
    if (g->passing < 0) g->passing = 0; /* an exit without its enter: not below none */
    pthread_mutex_unlock(&g->mu);
    if (wake) pthread_cond_broadcast(&g->cond);
}

static int gate_ready(Gate *g) {
    if (!g->ready) PyErr_SetString(PyExc_RuntimeError, "Gate: not initialised");
    return g->ready;
}

static PyObject *Gate_enter(Gate *self, PyObject *Py_UNUSED(ignored)) {
    if (!gate_ready(self)) return NULL;
    sk_gate_in(self);
    Py_RETURN_NONE;
}

static PyObject *Gate_exit(Gate *self, PyObject *Py_UNUSED(args)) {
    if (!gate_ready(self)) return NULL;
    sk_gate_out(self);
    Py_RETURN_FALSE; /* never swallows the exception of the block it guarded */
}

/* Wait (mutex held) until none is passing or ``until``; returns whether none is. */
static int gate_wait_none(Gate *g, double timeout, const struct timespec *until) {
    g->waiting++;
    while (g->passing > 0)
        if (!(timeout < 0 ? untimed_wait(&g->cond, &g->mu) : sk_timed_wait(&g->cond, &g->mu, until))) break;
    g->waiting--;
    return g->passing == 0;
}

/* close(timeout_s) -> bool: hold new frames (after any other hand-off's close has opened again) and
 * wait up to ``timeout_s`` for those passing to leave; whether they all did. ``open`` undoes it. */
static PyObject *Gate_close(Gate *self, PyObject *arg) {
    double timeout;
    if (!gate_ready(self) || timeout_arg(arg, "Gate.close", &timeout) < 0) return NULL;
    int drained;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until = sk_monotonic_after(timeout >= 0 ? timeout : 0);
    pthread_mutex_lock(&self->mu);
    while (self->closed) /* one hand-off at a time */
        if (!untimed_wait(&self->cond, &self->mu)) break;
    self->closed = 1;
    drained = gate_wait_none(self, timeout, &until);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(drained);
}

static PyObject *Gate_open(Gate *self, PyObject *Py_UNUSED(ignored)) {
    if (!gate_ready(self)) return NULL;
    pthread_mutex_lock(&self->mu);
    self->closed = 0;
    pthread_mutex_unlock(&self->mu);
    pthread_cond_broadcast(&self->cond);
    Py_RETURN_NONE;
}

/* wait_idle(timeout_s) -> bool: whether none is passing, waiting up to ``timeout_s`` for it. */
static PyObject *Gate_wait_idle(Gate *self, PyObject *arg) {
    double timeout;
    if (!gate_ready(self) || timeout_arg(arg, "Gate.wait_idle", &timeout) < 0) return NULL;
    int idle;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until = sk_monotonic_after(timeout >= 0 ? timeout : 0);
    pthread_mutex_lock(&self->mu);
    idle = gate_wait_none(self, timeout, &until);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(idle);
}

static PyMethodDef Gate_methods[] = {
    {"__enter__", (PyCFunction)Gate_enter, METH_NOARGS, "a frame passes in (waits while the gate is closed)"},
    {"__exit__", (PyCFunction)Gate_exit, METH_VARARGS, "the frame passes out"},
    {"close", (PyCFunction)Gate_close, METH_O,
     "close(timeout_s) -> bool: hold new frames, wait for those passing; whether they all left"},
    {"open", (PyCFunction)Gate_open, METH_NOARGS, "open() -> None: let frames pass again"},
    {"wait_idle", (PyCFunction)Gate_wait_idle, METH_O,
     "wait_idle(timeout_s) -> bool: whether none is passing, waiting up to timeout_s"},
    {NULL}};

PyTypeObject sk_GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gate_init,
    .tp_dealloc = (destructor)Gate_dealloc,
    .tp_methods = Gate_methods,
    .tp_doc = "The gate in front of a stage's downstream edge (gate.EdgeGate's state), passed from C.",
};

/* -- where the head's lone generation waits for its step's return (lone.c) ------------------------
 *
 * The loop registers the step it awaits (``state`` W_WAITING, under its key and session); the
 * return listener's C reader hands a plain token over without the GIL (``take``), Python settles
 * anything else (``settle``: an error for the step, a return that is not one plain token, a broken
 * link). */

static int ReturnWait_init(ReturnWait *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"n_vocab", NULL};
    int n_vocab;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i", names, &n_vocab)) return -1;
    if (n_vocab <= 0) {
        PyErr_SetString(PyExc_ValueError, "ReturnWait: n_vocab must be positive");
        return -1;
    }
    self->n_vocab = n_vocab;
    if (!self->ready) {
        monotonic_cond_init(&self->cond, &self->mu);
        self->ready = 1;
    }
    return 0;
}

/* ``settled`` may be any object (an exception whose traceback reaches this wait): GC support. */
static int ReturnWait_traverse(ReturnWait *self, visitproc visit, void *arg) {
    Py_VISIT(self->settled);
    return 0;
}

static int ReturnWait_clear(ReturnWait *self) {
    Py_CLEAR(self->settled);
    return 0;
}

static void ReturnWait_dealloc(ReturnWait *self) {
    PyObject_GC_UnTrack(self);
    if (self->ready) {
        pthread_cond_destroy(&self->cond);
        pthread_mutex_destroy(&self->mu);
    }
    ReturnWait_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

void sk_wait_move(ReturnWait *self, int state) {
    pthread_mutex_lock(&self->mu);
    self->state = state;
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->mu);
}

/* Back to idle between runs or steps, dropping a value settled for a step that ended otherwise
 * (it failed or was declined while ``settle`` came). */
void sk_wait_reset(ReturnWait *self) {
    pthread_mutex_lock(&self->mu);
    self->state = W_IDLE;
    PyObject *stale = self->settled;
    self->settled = NULL;
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->mu);
    Py_XDECREF(stale);
}

static int key_matches(ReturnWait *self, const uint8_t *key, size_t key_len) {
    return key_len == self->key_len && !memcmp(key, self->key, key_len);
}

/* The core of ``take``, without the GIL (the return listener's C reader calls it): 1 when
 * ``body`` (a ReturnedBatch's bytes) is the awaited step's one plain token, now handed to the
 * waiting loop; 0 when not (nothing touched). Parsing touches nothing shared; the awaited key and
 * session are read under ``mu`` once the state says a step is awaited (the loop writes them
 * before it says so). */
int sk_wait_take(ReturnWait *self, const uint8_t *data, size_t size) {
    const uint8_t *key, *sid, *final_id;
    size_t key_len, sid_len, final_len;
    int64_t token;
    if (!sk_parse_returned_token(data, size, self->n_vocab, &key, &key_len, &sid, &sid_len, &token, &final_id,
                                 &final_len))
        return 0;
    int taken = 0;
    pthread_mutex_lock(&self->mu);
    if (self->state == W_WAITING && key_matches(self, key, key_len) && sid_len == self->sid_len
        && !memcmp(sid, self->sid, sid_len)) {
        if (final_len) memcpy(self->final_id, final_id, final_len);
        self->final_len = final_len;
        self->token = (int32_t)token;
        self->state = W_TOKEN;
        taken = 1;
    }
    pthread_mutex_unlock(&self->mu);
    /* after the unlock: a waiter woken under the lock would only block on it again */
    if (taken) pthread_cond_broadcast(&self->cond);
    return taken;
}

/* take(body) -> True: ``body`` (a ReturnedBatch's bytes) is the awaited step's one plain token,
 * now handed to the waiting loop; False: not that (nothing touched; the Python path reads it). */
static PyObject *ReturnWait_take(ReturnWait *self, PyObject *arg) {
    Py_buffer body;
    if (PyObject_GetBuffer(arg, &body, PyBUF_SIMPLE) < 0) return NULL;
    int taken = sk_wait_take(self, body.buf, (size_t)body.len);
    PyBuffer_Release(&body);
    return PyBool_FromLong(taken);
}

/* settle(key, value) -> True: the step awaited under ``key`` (None: whatever step is awaited —
 * a broken link loses them all) ends with ``value`` (its Outputs, or the exception to raise);
 * False: no step is awaited under it here. */
static PyObject *ReturnWait_settle(ReturnWait *self, PyObject *args) {
    PyObject *key, *value;
    if (!PyArg_ParseTuple(args, "OO", &key, &value)) return NULL;
    if (self->state != W_WAITING) Py_RETURN_FALSE;
    if (key != Py_None) {
        Py_ssize_t n;
        const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &n) : NULL;
        if (k == NULL) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        if (!key_matches(self, (const uint8_t *)k, (size_t)n)) Py_RETURN_FALSE;
    }
    int settled = 0;
    pthread_mutex_lock(&self->mu);
    if (self->state == W_WAITING) { /* a token may have come meanwhile (the reader takes it without the GIL) */
        Py_INCREF(value);
        Py_XSETREF(self->settled, value);
        self->state = W_SETTLED;
        settled = 1;
    }
    pthread_mutex_unlock(&self->mu);
    if (settled) pthread_cond_broadcast(&self->cond);
    return PyBool_FromLong(settled);
}

static PyMethodDef ReturnWait_methods[] = {
    {"take", (PyCFunction)ReturnWait_take, METH_O,
     "take(body) -> bool: the awaited step's plain token handed to the waiting loop"},
    {"settle", (PyCFunction)ReturnWait_settle, METH_VARARGS,
     "settle(key or None, value) -> bool: the awaited step ends with value (Outputs or an exception)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject sk_ReturnWaitType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.ReturnWait",
    .tp_basicsize = sizeof(ReturnWait),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)ReturnWait_traverse,
    .tp_clear = (inquiry)ReturnWait_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ReturnWait_init,
    .tp_dealloc = (destructor)ReturnWait_dealloc,
    .tp_methods = ReturnWait_methods,
    .tp_doc = "Where the head's lone generation waits for its step's return.",
};
