/* The runtime's session state, read and written in place under its locks: whether a frame's
 * sessions are bound here ready for it (the lane table), whether their samplers are plain greedy,
 * and after the decode each lane advanced and each history extended, all or nothing. The objects
 * stay the runtime's (one owner, one truth); what is read of them is read by public name
 * (lanes.SessionLane's fields, SamplerChain.argmax). path.c calls these under the locks. */
#include "frames.h"

#include <limits.h>
#include <string.h>

/* ``o.<name>`` (a public attribute) as a C long in ``*out``: 0, or -1 with the error raised (missing,
 * not an int, out of range); a value of -1 is a value, never taken for an error. */
static int attr_long(PyObject *o, const char *name, long *out) {
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL) return -1;
    long x = PyLong_AsLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

/* 1: every entry's session is bound here at its next position with room and owned by ``owner`` (the
 * link the frame came on, peers.Peer; None for the head's own), the pool needs no eviction; 0:
 * decline (a session another link opened moves to this one in Python: LaneTable.admit); -1: a
 * Python error. */
int sk_check_lanes(FramePath *self, frame_t *fr, PyObject *owner) {
    Py_ssize_t i = 0;
    PyObject *k, *v;
    long used = 0, resident = 0;
    while (PyDict_Next(self->sessions, &i, &k, &v)) {
        long t;
        if (attr_long(v, "n_tokens", &t) < 0) return -1;
        if (t < 0) return 0;
        used += t;
    }
    i = 0;
    while (PyDict_Next(self->resident, &i, &k, &v)) {
        long t;
        if (attr_long(v, "n_tokens", &t) < 0) return -1;
        if (t < 0) return 0;
        resident += t;
    }
    if (used + fr->n + resident > self->kv_pool_tokens) return 0; /* full, or an eviction: Python's */
    for (int j = 0; j < fr->n; j++) {
        entry_t *e = &fr->entries[j];
        PyObject *bound = PyDict_GetItemWithError(self->sessions, e->sid_obj);
        if (bound == NULL) return PyErr_Occurred() ? -1 : 0;
        long n_tokens, lane;
        if (attr_long(bound, "n_tokens", &n_tokens) < 0 || attr_long(bound, "lane", &lane) < 0) return -1;
        if (n_tokens != e->pos || n_tokens + 1 > self->cells_per_lane || lane < 0 || lane > INT32_MAX) return 0;
        PyObject *held_by = PyObject_GetAttrString(bound, "owner");
        if (held_by == NULL) return -1;
        Py_DECREF(held_by); /* only its identity is compared: the session keeps it alive */
        if (held_by != owner) return 0;
        e->lane = (int32_t)lane;
        Py_INCREF(bound);
        e->lane_obj = bound;
    }
    return 1;
}

/* 1: each entry's session sampler here, if it has one, is plain greedy (its chain's public
 * ``argmax``: SamplerChain), so the pick made here is the one it would make; 0: decline; -1: a
 * Python error. */
int sk_samplers_plain(FramePath *self, frame_t *fr) {
    for (int j = 0; j < fr->n; j++) {
        PyObject *state = PyDict_GetItemWithError(self->samplers, fr->entries[j].sid_obj);
        if (state == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        PyObject *chain = PyObject_GetAttrString(state, "chain");
        if (chain == NULL) return -1;
        PyObject *argmax = PyObject_GetAttrString(chain, "argmax");
        Py_DECREF(chain);
        if (argmax == NULL) return -1;
        int plain = argmax == Py_True;
        Py_DECREF(argmax);
        if (!plain) return 0;
    }
    return 1;
}

/* Each entry's lane: n_tokens and batches one more, last_used now; all of it or (an error raised)
 * none. The old values are read first, each checked (an attribute that is missing or not an int is
 * an error, never taken as -1); a failed write puts back the ones made. Under the lane table's lock. */
int sk_advance_lanes(FramePath *self, frame_t *fr) {
    static const char *fields[3] = {"n_tokens", "batches", "last_used"};
    PyObject *was[MAX_ENTRIES][3] = {{NULL}}, *now[MAX_ENTRIES][3] = {{NULL}};
    int rc = -1, written = 0;
    now[0][2] = PyFloat_FromDouble(sk_now_monotonic());
    if (now[0][2] == NULL) return -1;
    for (int j = 0; j < fr->n; j++) {
        PyObject *lane = fr->entries[j].lane_obj;
        for (int f = 0; f < 3; f++)
            if ((was[j][f] = PyObject_GetAttrString(lane, fields[f])) == NULL) goto out;
        for (int f = 0; f < 2; f++) {
            long v = PyLong_AsLong(was[j][f]);
            if (v == -1 && PyErr_Occurred()) goto out;
            if (v < 0 || v == LONG_MAX) {
                PyErr_Format(PyExc_ValueError, "FramePath: a lane's %s is %ld", fields[f], v);
                goto out;
            }
            if ((now[j][f] = PyLong_FromLong(v + 1)) == NULL) goto out;
        }
        if (j > 0) now[j][2] = Py_NewRef(now[0][2]);
    }
    for (; written < fr->n; written++)
        for (int f = 0; f < 3; f++)
            if (PyObject_SetAttrString(fr->entries[written].lane_obj, fields[f], now[written][f]) < 0) {
                written++; /* this one may be partly written: put back too */
                goto out;
            }
    rc = 0;
out:
    if (rc < 0 && written > 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        for (int j = 0; j < written; j++)
            for (int f = 0; f < 3; f++)
                if (PyObject_SetAttrString(fr->entries[j].lane_obj, fields[f], was[j][f]) < 0) PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    for (int j = 0; j < fr->n; j++)
        for (int f = 0; f < 3; f++) {
            Py_XDECREF(was[j][f]);
            Py_XDECREF(now[j][f]);
        }
    return rc;
}

/* The histories as they were before sk_extend_histories (an error in flight kept); the references let go. */
void sk_undo_histories(FramePath *self, frame_t *fr, history_undo_t *u) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int j = u->n - 1; j >= 0; j--) {
        if (u->tail[j] != NULL && PyList_SetSlice(u->history[j], u->cut[j], PY_SSIZE_T_MAX, u->tail[j]) < 0)
            PyErr_Clear();
        if (u->created[j] && PyDict_GetItemWithError(self->histories, fr->entries[j].sid_obj) == u->history[j]
            && PyDict_DelItem(self->histories, fr->entries[j].sid_obj) < 0)
            PyErr_Clear();
        PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
}

void sk_release_history_undo(history_undo_t *u) {
    for (int j = 0; j < u->n; j++) {
        Py_CLEAR(u->history[j]);
        Py_CLEAR(u->tail[j]);
    }
    u->n = 0;
}

/* history[pos:] = [token_id] (the fed token, if it came along) + [sampled], as the runtime does;
 * all of it, or (an error raised) none: what it changed is put back. ``u`` keeps what undoes it. */
int sk_extend_histories(FramePath *self, frame_t *fr, history_undo_t *u) {
    for (int j = 0; j < fr->n; j++) {
        entry_t *e = &fr->entries[j];
        int created = 0;
        PyObject *history = PyDict_GetItemWithError(self->histories, e->sid_obj);
        if (history == NULL) {
            if (PyErr_Occurred()) goto fail;
            history = PyList_New(0);
            if (history == NULL) goto fail;
            if (PyDict_SetItem(self->histories, e->sid_obj, history) < 0) {
                Py_DECREF(history);
                goto fail;
            }
            Py_DECREF(history); /* the dict holds it; u takes its own below */
            created = 1;
        }
        u->history[j] = Py_NewRef(history);
        u->created[j] = created;
        u->n = j + 1;
        if (!PyList_Check(history)) {
            PyErr_Format(PyExc_TypeError, "FramePath: session %R's history is not a list", e->sid_obj);
            goto fail;
        }
        Py_ssize_t len = PyList_GET_SIZE(history);
        u->cut[j] = e->n_tok && e->pos < len ? (Py_ssize_t)e->pos : len;
        if ((u->tail[j] = PyList_GetSlice(history, u->cut[j], len)) == NULL) goto fail;
        if (u->cut[j] < len && PyList_SetSlice(history, u->cut[j], len, NULL) < 0) goto fail;
        PyObject *t = e->n_tok ? PyLong_FromLongLong(e->token) : NULL, *s = PyLong_FromLong(e->sampled);
        int bad = (e->n_tok && t == NULL) || s == NULL || (t != NULL && PyList_Append(history, t) < 0)
                  || PyList_Append(history, s) < 0;
        Py_XDECREF(t);
        Py_XDECREF(s);
        if (bad) goto fail;
    }
    return 0;
fail:
    sk_undo_histories(self, fr, u);
    return -1;
}
