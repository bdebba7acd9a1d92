/* FramePath: a plain frame admitted through the runtime's own lane table and locks (lanes.c),
 * decoded, and its output sent on, in one call (``run``), or frame after frame off a stage's link
 * (``serve``); and the final stage's greedy pick. Its lone generation is lone.c's.
 *
 * What it reads of the Python objects it was given, it reads by public name only: the runtime's
 * ``closed``, the locks' acquire and release, ``routes.claim`` (and in lanes.c a lane record's
 * fields and a sampler chain's ``argmax``); native_frames.py and those classes document it. */
#include "frames.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>

/* One llama_decode, under the host's compute lock where co-located stages share one
 * (``compute_lock_path``): only one of them computes at a time, on all its threads. A lock that
 * cannot be taken (it never fails on a file this process opened) leaves the decode unlocked: the
 * lock is for speed, never for correctness. Called without the GIL. */
static int32_t locked_decode(FramePath *self, batch_t batch) {
    int locked = 0;
    if (self->compute_lock_fd >= 0) {
        int r;
        while ((r = flock(self->compute_lock_fd, LOCK_EX)) < 0 && errno == EINTR) {}
        locked = r == 0;
    }
    int32_t rc = self->decode(self->ctx, batch);
    if (locked) flock(self->compute_lock_fd, LOCK_UN);
    return rc;
}

/* -- helpers on Python objects ----------------------------------------------------------------- */

static int call_method(PyObject *o, const char *name) {
    PyObject *r = PyObject_CallMethod(o, name, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* 0 invalid, 1 valid, 2 plain greedy; -1: a Python error. */
static int sampling_kind(FramePath *self, const entry_t *e) {
    PyObject *key = PyBytes_FromStringAndSize((const char *)e->sampling, (Py_ssize_t)e->sampling_len);
    if (key == NULL) return -1;
    PyObject *known = PyDict_GetItemWithError(self->sampling_kinds, key);
    int kind;
    if (known != NULL) {
        kind = (int)PyLong_AsLong(known);
    } else if (PyErr_Occurred()) {
        kind = -1;
    } else {
        PyObject *r = PyObject_CallOneArg(self->classify, key);
        kind = r == NULL ? -1 : (int)PyLong_AsLong(r);
        if (kind == -1 && !PyErr_Occurred()) kind = 0;
        if (r != NULL && kind >= 0 && e->sampling_len <= 512 && PyDict_Size(self->sampling_kinds) < 512)
            if (PyDict_SetItem(self->sampling_kinds, key, r) < 0) kind = -1;
        Py_XDECREF(r);
    }
    Py_DECREF(key);
    return kind;
}


/* llama.cpp's greedy sampler, exactly: the first index whose logit no later one exceeds (NaN
 * never exceeds, so a NaN row picks as llama_sampler_sample would). Two passes with no index
 * carried from one element to the next: the largest logit, kept in eight running maxima that the
 * compiler turns into vector max instructions (x > m ? x : m is what MAXPS does, a NaN x never
 * taken), then the first index holding it. The one-pass loop's compare-and-move chain took
 * ~200 us for SmolLM2's 49152 logits, at the final stage, on a token's critical path. */
int32_t sk_greedy(const float *logits, int n) {
    size_t count = (size_t)n, i = 0; /* unsigned: Python builds with -fwrapv, which keeps int loops scalar */
    float m[8];
    for (size_t j = 0; j < 8; j++) m[j] = logits[0];
    for (; i + 8 <= count; i += 8)
        for (size_t j = 0; j < 8; j++) m[j] = logits[i + j] > m[j] ? logits[i + j] : m[j];
    for (; i < count; i++) m[0] = logits[i] > m[0] ? logits[i] : m[0];
    float top = m[0];
    for (size_t j = 1; j < 8; j++) top = m[j] > top ? m[j] : top;
    for (i = 0; i + 64 <= count; i += 64) { /* a block holding it found without a branch per logit */
        int hit = 0;
        for (size_t j = 0; j < 64; j++) hit |= logits[i + j] == top;
        if (hit) break;
    }
    for (; i < count; i++)
        if (logits[i] == top) return (int32_t)i;
    return 0; /* logits[0] is NaN: nothing exceeds it */
}

static void release_entries(frame_t *fr) {
    for (int j = 0; j < fr->n; j++) {
        Py_CLEAR(fr->entries[j].sid_obj);
        Py_CLEAR(fr->entries[j].lane_obj);
    }
}

/* downstream.timeout_for: what is left of the caller's deadline (at least 1 ms), capped. */
static double forward_timeout(const FramePath *self, double remaining) {
    if (remaining == 0.0 || remaining != remaining) return self->hop_timeout_s;
    double t = remaining < self->hop_timeout_s ? remaining : self->hop_timeout_s;
    return t > 0.001 ? t : 0.001;
}

/* run(body, sock, send_lock, sink) -> None (declined: nothing touched) or
 * (status, detail, compute_s, latency_s, entries, payload_bytes, message, marks, key)
 *   status 0: decoded and sent; 1: decoded, the send failed (``message`` holds what was to go:
 *   the final stage's ReturnedBatch, for the caller to relay; an inner stage's HopRequest); 2: the
 *   decode failed with ``detail`` (llama_decode's code; -1000 no logits; -1001 the capture
 *   disagrees): the KV was cut back, nothing advanced. latency_s < 0: the frame carried no send
 *   time. marks: wall-clock ns when the frame was parsed, llama_decode started, the outputs were
 *   ready, the send returned (0: not reached). key: the return key an inner stage routed (None at
 *   the final stage and the head). */
static PyObject *FramePath_run(FramePath *self, PyObject *args) {
    Py_buffer body;
    PyObject *sock, *send_lock, *sink;
    if (!sk_path_ready(self) || !PyArg_ParseTuple(args, "y*OOO", &body, &sock, &send_lock, &sink)) return NULL;
    frame_t *fr = PyMem_Malloc(sizeof(frame_t));
    if (fr == NULL) {
        PyBuffer_Release(&body);
        return PyErr_NoMemory();
    }
    fr->n = 0;
    PyObject *result;
    if (sk_parse_frame(self, body.buf, (size_t)body.len, fr)) {
        result = sk_run_frame(self, fr, sock, send_lock, sink);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
    PyMem_Free(fr);
    PyBuffer_Release(&body);
    return result;
}

/* ``run``'s work on a parsed frame (whose bytes stay alive meanwhile): the same result. The
 * entries' Python objects are released; ``fr`` itself stays the caller's. */
PyObject *sk_run_frame(FramePath *self, frame_t *fr, PyObject *sock, PyObject *send_lock, PyObject *sink) {
    float *forward_rows = NULL;
    PyObject *result = NULL, *key_obj = NULL;
    uint8_t *msg = NULL;
    int locked = 0, lanes_locked = 0;
    uint64_t arrived = sk_now_unix_ns();
    double latency = fr->sent_ns ? (arrived > fr->sent_ns ? (double)(arrived - fr->sent_ns) * 1e-9 : 0.0) : -1.0;
    const float *rows = (const float *)fr->payload;
    for (size_t k = 0, m = self->head ? 0 : (size_t)fr->n * (size_t)self->n_embd; k < m; k++) {
        float x;
        memcpy(&x, rows + k, sizeof x);
        if (!isfinite(x)) goto decline;
    }
    for (int j = 0; j < fr->n; j++) {
        entry_t *e = &fr->entries[j];
        if (e->n_tok && (e->token < 0 || e->token >= self->n_vocab)) goto decline;
        /* Checked wherever it rides (an entry that does not sample still carries it on, so it must at
         * least parse: the Python path parses the whole frame); only the final stage samples. */
        if (e->sample_last || e->sampling != NULL) {
            int kind = sampling_kind(self, e);
            if (kind < 0) goto fail;
            if (kind < (self->final && e->sample_last ? 2 : 1)) goto decline;
        }
        e->sid_obj = PyUnicode_FromStringAndSize((const char *)e->sid, (Py_ssize_t)e->sid_len);
        if (e->sid_obj == NULL) goto fail;
    }
    uint64_t marks[4] = {sk_now_unix_ns(), 0, 0, 0}; /* parsed, d0, d1, sent: tracing's marks */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (call_method(self->compute_lock, "acquire") < 0) goto fail;
    locked = 1;
    PyObject *closed = PyObject_GetAttrString(self->owner, "closed"); /* StageRuntime.closed */
    if (closed == NULL) goto fail;
    int shut = PyObject_IsTrue(closed);
    Py_DECREF(closed);
    if (shut < 0) goto fail;
    if (shut) goto decline; /* closed meanwhile: the Python path says so */
    int ok = self->final ? sk_samplers_plain(self, fr) : 1;
    if (ok < 0) goto fail;
    if (!ok) goto decline;
    if (call_method(self->lanes_lock, "acquire") < 0) goto fail;
    lanes_locked = 1;
    ok = sk_check_lanes(self, fr, sink);
    lanes_locked = 0;
    if (call_method(self->lanes_lock, "release") < 0 || ok < 0) goto fail;
    if (!ok) goto decline;

    /* The batch in lane order, as the runtime orders it. */
    int order[MAX_ENTRIES];
    for (int j = 0; j < fr->n; j++) {
        int k = j;
        while (k > 0 && fr->entries[order[k - 1]].lane > fr->entries[j].lane) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = j;
    }
    /* Several sequences split by sequence come back from the capture in llama.cpp's order: Python's. */
    if (!self->final && self->equal_split && fr->n > 1) goto decline;
    for (int r = 0; r < fr->n; r++) {
        entry_t *e = &fr->entries[order[r]];
        e->row = r;
        self->pos[r] = (int32_t)e->pos;
        self->seq[r] = e->lane;
        self->out[r] = 1;
        if (self->head)
            self->token[r] = (int32_t)e->token;
        else
            memcpy(self->embd + (size_t)r * self->n_embd, rows + (size_t)order[r] * self->n_embd,
                   sizeof(float) * (size_t)self->n_embd);
    }
    if (!self->final) {
        forward_rows = PyMem_Malloc(sizeof(float) * (size_t)fr->n * (size_t)self->n_embd);
        if (forward_rows == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        self->capture->n_counts = 0;
        self->capture->rows = 0;
        self->capture->error = 0;
    }
    batch_t batch = self->batch;
    batch.n_tokens = fr->n;
    int32_t rc;
    Py_BEGIN_ALLOW_THREADS
    marks[1] = sk_now_unix_ns();
    rc = locked_decode(self, batch);
    if (rc == 0 && self->final) {
        for (int j = 0; j < fr->n; j++) {
            float *logits = self->logits_ith(self->ctx, fr->entries[j].row);
            if (logits == NULL) {
                rc = -1000;
                break;
            }
            fr->entries[j].sampled = sk_greedy(logits, self->n_vocab);
        }
    } else if (rc == 0) {
        const struct skippy_capture *c = self->capture;
        if (c->error != 0 || c->n_counts != 1 || c->counts[0] != fr->n || c->rows != fr->n) {
            rc = -1001;
        } else {
            for (int j = 0; j < fr->n; j++)
                memcpy(forward_rows + (size_t)j * self->n_embd, c->dst + (size_t)fr->entries[j].row * self->n_embd,
                       sizeof(float) * (size_t)self->n_embd);
        }
    }
    marks[2] = sk_now_unix_ns();
    if (rc != 0)
        for (int j = 0; j < fr->n; j++)
            self->seq_rm(self->mem, fr->entries[j].lane, (int32_t)fr->entries[j].pos, -1);
    Py_END_ALLOW_THREADS
    if (rc == 0) {
        /* The bookkeeping after the decode, all of it or none: where any of it fails, the histories
         * and lanes are as they were and the KV the decode wrote is cut back, as after a failed
         * decode; the error goes up. */
        history_undo_t undo = {0};
        int kept = !self->final || sk_extend_histories(self, fr, &undo) == 0;
        if (kept && call_method(self->lanes_lock, "acquire") < 0) {
            kept = 0;
            sk_undo_histories(self, fr, &undo);
        } else if (kept && sk_advance_lanes(self, fr) < 0) {
            kept = 0;
            sk_undo_histories(self, fr, &undo);
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (call_method(self->lanes_lock, "release") < 0) PyErr_Clear();
            PyErr_Restore(type, value, tb);
        } else if (kept && call_method(self->lanes_lock, "release") < 0) {
            sk_release_history_undo(&undo);
            goto fail; /* all of it done; the lock's error goes up */
        }
        sk_release_history_undo(&undo);
        if (!kept) {
            for (int j = 0; j < fr->n; j++)
                self->seq_rm(self->mem, fr->entries[j].lane, (int32_t)fr->entries[j].pos, -1);
            goto fail;
        }
    }
    locked = 0;
    if (call_method(self->compute_lock, "release") < 0) goto fail;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double compute = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    if (rc != 0) {
        result = Py_BuildValue("(iiddnnO(KKKK)O)", 2, (int)rc, compute, latency, (Py_ssize_t)fr->n,
                               (Py_ssize_t)fr->payload_len, Py_None, marks[0], marks[1], marks[2], marks[3], Py_None);
        goto done;
    }

    size_t len;
    if (self->final) {
        len = sk_encode_returned(self, fr, &msg);
    } else if (self->head) { /* its own step: the key the head waits under, the timeout it chose */
        len = sk_encode_forward(self, fr, (const char *)fr->key, fr->key_len, forward_timeout(self, fr->timeout_s),
                             forward_rows, &msg);
    } else {
        /* Replies from below for this step come back under the key routed here (Stage.routes). */
        key_obj = PyObject_CallMethod(self->routes, "claim", "s#OK", (const char *)fr->key, (Py_ssize_t)fr->key_len,
                                      sink, (unsigned long long)fr->hop_id);
        if (key_obj == NULL) goto fail;
        Py_ssize_t key_len;
        const char *key = PyUnicode_AsUTF8AndSize(key_obj, &key_len);
        if (key == NULL) goto fail;
        len = sk_encode_forward(self, fr, key, (size_t)key_len, forward_timeout(self, fr->timeout_s), forward_rows,
                                &msg);
    }
    if (len == 0) goto fail; /* the encoder set the error */
    int status = 0;
    if (call_method(send_lock, "acquire") < 0) goto fail;
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0) {
        PyErr_Clear();
        status = 1;
    } else {
        size_t sent = 0;
        Py_BEGIN_ALLOW_THREADS
        while (sent < len) {
            ssize_t k = send(fd, msg + sent, len - sent, MSG_NOSIGNAL);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            sent += (size_t)k;
        }
        Py_END_ALLOW_THREADS
        status = sent == len ? 0 : 1;
    }
    marks[3] = sk_now_unix_ns();
    if (call_method(send_lock, "release") < 0) goto fail;
    PyObject *message = Py_None;
    if (status == 0)
        Py_INCREF(message);
    else if ((message = PyBytes_FromStringAndSize((const char *)msg + 5, (Py_ssize_t)len - 5)) == NULL)
        goto fail;
    result = Py_BuildValue("(iiddnnN(KKKK)O)", status, 0, compute, latency, (Py_ssize_t)fr->n,
                           (Py_ssize_t)fr->payload_len, message, marks[0], marks[1], marks[2],
                           marks[3], key_obj == NULL ? Py_None : key_obj);
    goto done;

decline:
    result = Py_None;
    Py_INCREF(result);
fail:
    if (lanes_locked) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (call_method(self->lanes_lock, "release") < 0) PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    if (locked) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (call_method(self->compute_lock, "release") < 0) PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
done:
    Py_XDECREF(key_obj);
    PyMem_Free(msg);
    PyMem_Free(forward_rows);
    release_entries(fr);
    return result;
}

/* End a plain frame's way through (``end(held, done, body, sink)``) with any Python error kept. */
static int serve_end(PyObject *end, PyObject *held, PyObject *done, PyObject *body, PyObject *sink) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallFunctionObjArgs(end, held, done, body, sink, NULL);
    Py_XDECREF(r);
    if (r == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    PyErr_Restore(type, value, tb);
    return 0;
}

/* serve(reader, begin, end, sink) -> what ``reader.next(None)`` returns, for the first message this
 * path hands back: a stage's frame link, read and run here while its frames are plain. Each frame
 * alone on the link (no other whole message behind it) that parses as plain asks ``begin()`` for
 * its way through: None (nothing held: the stage is not taking frames, or its output has no plain
 * link) hands it back; else ``held``, whose first two items are the socket and send lock its
 * output leaves on. The frame then runs as ``run`` runs it, and ``end(held, done, body, sink)``
 * follows whatever happened: ``done`` as ``run`` returns it (None: declined inside, nothing done,
 * and the frame is handed back; also None, with the error raised after, when the run raised),
 * ``body`` the frame's bytes where the outcome is not plain success (else None). A message of any
 * other kind, one with more behind it (the listener coalesces those), and a frame that does not
 * parse as plain are handed back untouched. Between frames the GIL is released; the listener's
 * Python runs only for what is handed back and for ``begin`` and ``end``.
 * ``done`` (a list, or None): where a frame sent on as plain success goes instead of ``end``, when
 * ``held``'s fifth item is the stage's Gate (left here) and the list holds fewer than
 * SERVE_DONE_MAX: ``end``'s metrics, taken in bulk later (a metrics scrape), rather than ~80 us of
 * Python a token on the caches the frame's decode emptied, on a core the next stage needs. */
#define SERVE_DONE_MAX 1024
static PyObject *FramePath_serve(FramePath *self, PyObject *args) {
    FrameReader *reader;
    PyObject *begin, *end, *sink, *done_list = Py_None;
    if (!sk_path_ready(self)
        || !PyArg_ParseTuple(args, "O!OOO|O", &sk_FrameReaderType, &reader, &begin, &end, &sink, &done_list))
        return NULL;
    if (reader->buf == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FramePath.serve: the FrameReader is not initialised");
        return NULL;
    }
    if (done_list != Py_None && !PyList_Check(done_list)) {
        PyErr_SetString(PyExc_TypeError, "FramePath.serve: done must be a list or None");
        return NULL;
    }
    if (self->head) {
        PyErr_SetString(PyExc_ValueError, "FramePath.serve: a stage below the head's path only");
        return NULL;
    }
    frame_t *fr = PyMem_Malloc(sizeof(frame_t));
    if (fr == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    for (;;) {
        int outcome, err = 0;
        size_t length = 0;
        Py_BEGIN_ALLOW_THREADS
        outcome = sk_reader_fill(reader, NULL, &length, &err);
        Py_END_ALLOW_THREADS
        if (outcome != R_MESSAGE) {
            result = sk_reader_result(reader, outcome, length, err);
            break;
        }
        const uint8_t *h = reader->buf + reader->start;
        fr->n = 0;
        if (h[4] != KIND_HOP_REQUEST || sk_reader_whole_after(reader, 4 + length)
            || !sk_parse_frame(self, h + 5, length - 1, fr)) {
            result = sk_reader_result(reader, outcome, length, err);
            break;
        }
        PyObject *held = PyObject_CallNoArgs(begin);
        if (held == NULL) break;
        if (held == Py_None) {
            Py_DECREF(held);
            result = sk_reader_result(reader, outcome, length, err);
            break;
        }
        if (!PyTuple_Check(held) || PyTuple_GET_SIZE(held) < 2) {
            PyErr_SetString(PyExc_TypeError, "FramePath.serve: begin() must give None or (sock, send_lock, ...)");
            serve_end(end, held, Py_None, Py_None, sink);
            Py_DECREF(held);
            break;
        }
        PyObject *done = sk_run_frame(self, fr, PyTuple_GET_ITEM(held, 0), PyTuple_GET_ITEM(held, 1), sink);
        if (done == Py_None) { /* declined inside: the Python path runs it */
            int ended = serve_end(end, held, Py_None, Py_None, sink);
            Py_DECREF(held);
            Py_DECREF(done);
            if (ended == 0) result = sk_reader_result(reader, outcome, length, err);
            break;
        }
        PyObject *body = NULL;
        int plain = done != NULL && PyLong_AsLong(PyTuple_GET_ITEM(done, 0)) == 0;
        if (done != NULL && !plain)
            body = PyBytes_FromStringAndSize((const char *)h + 5, (Py_ssize_t)(length - 1));
        reader->start += 4 + length; /* run (or failed in the run): the frame is this path's */
        PyObject *gate = PyTuple_GET_SIZE(held) >= 5 ? PyTuple_GET_ITEM(held, 4) : NULL;
        if (plain && done_list != Py_None && PyList_GET_SIZE(done_list) < SERVE_DONE_MAX && gate != NULL
            && PyObject_TypeCheck(gate, &sk_GateType) && ((Gate *)gate)->ready) { /* else ``end`` leaves it */
            sk_gate_out((Gate *)gate);
            int kept = PyList_Append(done_list, done);
            Py_DECREF(held);
            Py_DECREF(done);
            if (kept < 0) break;
            continue;
        }
        int ended = serve_end(end, held, done == NULL ? Py_None : done, body == NULL ? Py_None : body, sink);
        Py_DECREF(held);
        Py_XDECREF(body);
        if (done == NULL) break;
        Py_DECREF(done);
        if (ended < 0) break;
    }
    PyMem_Free(fr);
    return result;
}

/* The Python objects a FramePath holds, in one place for init, traverse, clear and dealloc. */
#define FRAMEPATH_OBJECTS(X)                                                                                  \
    X(owner) X(compute_lock) X(lanes_lock) X(sessions) X(resident) X(histories) X(samplers) X(routes) X(classify) \
    X(stage_id) X(sampling_kinds)

/* The C pointer in ``obj``, a capsule named SK_CAPSULE_PREFIX ``arg`` (native_frames.capsule makes
 * them), in ``*out``: 0; or -1 with TypeError for anything else, a capsule of another name included
 * (a pointer meant for another argument), so a wrong object is refused rather than dereferenced.
 * None is NULL where ``optional``. */
static int capsule_pointer(PyObject *obj, const char *arg, int optional, void **out) {
    char name[64];
    snprintf(name, sizeof name, SK_CAPSULE_PREFIX "%s", arg);
    *out = NULL;
    if (optional && obj == Py_None) return 0;
    if (!PyCapsule_IsValid(obj, name)) {
        const char *other = PyCapsule_CheckExact(obj) ? PyCapsule_GetName(obj) : NULL; /* NULL: unnamed */
        if (other != NULL)
            PyErr_Format(PyExc_TypeError, "FramePath: %s must be a capsule named \"%s\"%s, not one named \"%.200s\"",
                         arg, name, optional ? " or None" : "", other);
        else
            PyErr_Format(PyExc_TypeError, "FramePath: %s must be a capsule named \"%s\"%s, not %.200s", arg, name,
                         optional ? " or None" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = PyCapsule_GetPointer(obj, name);
    return *out == NULL ? -1 : 0;
}

/* The C pointers FramePath takes: each argument's name, and whether None may stand for it (only a
 * final stage needs logits_ith, and it has no capture; the head takes token ids, every other stage
 * rows). */
#define FRAMEPATH_POINTERS(X) \
    X(ctx, 0) X(mem, 0) X(decode, 0) X(logits_ith, 1) X(seq_rm, 0) X(batch, 0) X(pos, 0) X(seq, 0) X(out, 0) \
    X(embd, 1) X(capture, 1) X(token, 1)

/* The standard ownership pattern: every argument parsed into locals (borrowed) and checked first;
 * only then are new references taken and the old ones (a second ``__init__``) released, so a
 * failed init leaves the object as it was and dealloc releases only what the object holds. */
static int FramePath_init(FramePath *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ctx", "mem", "decode", "logits_ith", "seq_rm", "batch", "pos", "seq", "out", "embd",
                            "capture", "token", "n_embd", "n_vocab", "n_batch", "layer_start", "layer_end",
                            "stage_index", "equal_split", "cells_per_lane", "kv_pool_tokens", "hop_timeout_s", "owner",
                            "compute_lock", "lanes_lock", "sessions", "resident", "histories", "samplers", "routes",
                            "classify", "stage_id", "compute_lock_fd", NULL};
#define DECLARE(name, optional) PyObject *name##_arg; void *name;
    FRAMEPATH_POINTERS(DECLARE)
#undef DECLARE
    int n_embd, n_vocab, n_batch, layer_start, layer_end, stage_index, equal_split;
    long cells_per_lane, kv_pool_tokens;
    double hop_timeout_s;
    PyObject *owner, *compute_lock, *lanes_lock, *sessions, *resident, *histories, *samplers, *routes, *classify,
        *stage_id;
    int compute_lock_fd = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOOOiiiiiiplldOOOO!O!O!O!OOS|i", names, &ctx_arg, &mem_arg,
                                     &decode_arg, &logits_ith_arg, &seq_rm_arg, &batch_arg, &pos_arg, &seq_arg,
                                     &out_arg, &embd_arg, &capture_arg, &token_arg, &n_embd, &n_vocab, &n_batch,
                                     &layer_start, &layer_end, &stage_index, &equal_split, &cells_per_lane,
                                     &kv_pool_tokens, &hop_timeout_s, &owner, &compute_lock, &lanes_lock, &PyDict_Type,
                                     &sessions, &PyDict_Type, &resident, &PyDict_Type, &histories, &PyDict_Type,
                                     &samplers, &routes, &classify, &stage_id, &compute_lock_fd))
        return -1;
#define CONVERT(name, optional) \
    if (capsule_pointer(name##_arg, #name, optional, &name) < 0) return -1;
    FRAMEPATH_POINTERS(CONVERT)
#undef CONVERT
    if (!(embd || token) || (embd && token) || n_embd <= 0 || n_vocab <= 0 || n_batch <= 0) {
        PyErr_SetString(PyExc_ValueError, "FramePath needs rows (embd) or token ids (token), and positive sizes");
        return -1;
    }
    /* A frame's rows must fit the frame format's 32-bit length with room to spare (encoders check
     * again before narrowing): MAX_ENTRIES rows of n_embd float32s under 1 GiB. */
    if ((uint64_t)n_embd * 4u * MAX_ENTRIES >= (1u << 30)) {
        PyErr_Format(PyExc_ValueError, "FramePath: n_embd=%d is too wide for a frame", n_embd);
        return -1;
    }
    if (!isfinite(hop_timeout_s) || hop_timeout_s <= 0) {
        PyErr_SetString(PyExc_ValueError, "FramePath: hop_timeout_s must be finite and positive");
        return -1;
    }
    /* A final stage samples (logits_ith) and has no capture; an inner one captures and routes; the
     * head (token ids in) captures and sends its own steps, whose keys it chose. */
    int final = capture == NULL, head = token != NULL;
    if ((final && !logits_ith) || (head && final) || (!final && !head && routes == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "FramePath: a final stage needs logits_ith, an inner one routes, the head captures");
        return -1;
    }
    PyObject *sampling_kinds = PyDict_New();
    if (sampling_kinds == NULL) return -1;
    /* Checked: from here nothing fails. */
    self->final = final;
    self->head = head;
    self->n_embd = n_embd;
    self->n_vocab = n_vocab;
    self->n_batch = n_batch;
    self->layer_start = layer_start;
    self->layer_end = layer_end;
    self->stage_index = stage_index;
    self->equal_split = equal_split;
    self->cells_per_lane = cells_per_lane;
    self->kv_pool_tokens = kv_pool_tokens;
    self->hop_timeout_s = hop_timeout_s;
    self->ctx = ctx;
    self->mem = mem;
    self->decode = (decode_fn)(uintptr_t)decode; /* a function's address, as ctypes gave it */
    self->compute_lock_fd = compute_lock_fd < 0 ? -1 : compute_lock_fd;
    self->logits_ith = (logits_ith_fn)(uintptr_t)logits_ith;
    self->seq_rm = (seq_rm_fn)(uintptr_t)seq_rm;
    memcpy(&self->batch, batch, sizeof(batch_t));
    self->pos = pos;
    self->seq = seq;
    self->out = out;
    self->embd = embd;
    self->token = token;
    self->capture = capture;
#define TAKE(name) Py_XSETREF(self->name, Py_NewRef(name));
    FRAMEPATH_OBJECTS(TAKE)
#undef TAKE
    Py_DECREF(sampling_kinds); /* Py_NewRef above took the object's own reference */
    return 0;
}

/* Whether ``__init__`` has run (a bare ``FramePath.__new__`` holds nothing to run with). */
int sk_path_ready(FramePath *self) {
    if (self->owner == NULL) PyErr_SetString(PyExc_RuntimeError, "FramePath: not initialised");
    return self->owner != NULL;
}

static int FramePath_traverse(FramePath *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
    FRAMEPATH_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int FramePath_clear(FramePath *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    FRAMEPATH_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void FramePath_dealloc(FramePath *self) {
    PyObject_GC_UnTrack(self);
    FramePath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef FramePath_methods[] = {
    {"run", (PyCFunction)FramePath_run, METH_VARARGS,
     "run(body, sock, send_lock, sink): the frame decoded and its output sent, or None (declined)"},
    {"serve", (PyCFunction)FramePath_serve, METH_VARARGS,
     "serve(reader, begin, end, sink, done=None): a frame link's plain frames run until a message is handed "
     "back (as reader.next(None) gives it); plain successes kept in done instead of ended, where it can"},
    {"lone", (PyCFunction)(void (*)(void))sk_path_lone, METH_VARARGS | METH_KEYWORDS,
     "lone(*, wait, template, request_id, key_prefix, position, token, draws, limit, eog, timeout_s, sock, send_lock, "
     "gate_pass, stage, downstream, link, on_token, bell=None) -> (how, value, steps, computes, hops, final_stage_id)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject sk_FramePathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.FramePath",
    .tp_basicsize = sizeof(FramePath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)FramePath_traverse,
    .tp_clear = (inquiry)FramePath_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FramePath_init,
    .tp_dealloc = (destructor)FramePath_dealloc,
    .tp_methods = FramePath_methods,
    .tp_doc = "A stage's plain frames, parsed, decoded and sent on in C.",
};

