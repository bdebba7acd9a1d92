/* A plain frame link read in C (framing's format: u32 big-endian length N, u8 kind, N-1 bytes),
 * the GIL released while it waits for the peer.
 *
 * The head's return listener reads a plain return link through this: a ReturnedBatch that is the
 * lone generation's awaited token is handed over (``sk_wait_take``) without the GIL and without
 * returning to Python; every other message is returned to the listener as FrameSocket.receive
 * returns it. Without the GIL a token's arrival no longer waits for whatever Python holds it (the
 * client stream's handler, on the same core) before the loop can take it. A stage below the head
 * reads its upstream's frames through it too (FramePath.serve, path.c). */
#include "frames.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* The reader reads its own duplicate of ``fd``, closed only with the reader: the number it reads
 * cannot be closed and handed to another socket while it reads without the GIL (the link's
 * ``close`` shuts the connection down first, which ends the read; FrameSocket.close). Initialised
 * once: a second ``__init__`` is refused, as the first may be reading meanwhile. */
static int FrameReader_init(FrameReader *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "max_message_bytes", "buffered", NULL};
    Py_buffer buffered = {0};
    Py_ssize_t max_message;
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "in|y*", names, &fd, &max_message, &buffered)) return -1;
    if (fd < 0 || max_message <= 0) {
        PyBuffer_Release(&buffered);
        PyErr_SetString(PyExc_ValueError, "FrameReader: a descriptor and a positive max_message_bytes");
        return -1;
    }
    size_t cap = 1 << 16;
    if ((size_t)buffered.len > cap) cap = (size_t)buffered.len;
    uint8_t *buf = PyMem_RawMalloc(cap);
    if (buf == NULL) {
        PyBuffer_Release(&buffered);
        PyErr_NoMemory();
        return -1;
    }
    if (self->buf != NULL) { /* another thread may be reading it without the GIL: never swapped */
        PyMem_RawFree(buf);
        PyBuffer_Release(&buffered);
        PyErr_SetString(PyExc_RuntimeError, "FrameReader: already reading a link (make a new reader)");
        return -1;
    }
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) {
        PyMem_RawFree(buf);
        PyBuffer_Release(&buffered);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (buffered.len) memcpy(buf, buffered.buf, (size_t)buffered.len);
    self->buf = buf;
    self->fd = own;
    self->max_message = (size_t)max_message;
    self->cap = cap;
    self->start = 0;
    self->end = (size_t)buffered.len;
    PyBuffer_Release(&buffered);
    return 0;
}

static void FrameReader_dealloc(FrameReader *self) {
    if (self->buf != NULL) close(self->fd);
    PyMem_RawFree(self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Until a whole message is buffered (R_MESSAGE, its length field in ``*length``) or the link cannot
 * be read on (the other outcomes; ``*err`` the errno of a failed read). ``wait`` (a ReturnWait, or
 * NULL) takes its tokens on the way. Called without the GIL. */
int sk_reader_fill(FrameReader *self, ReturnWait *wait, size_t *length, int *err) {
    for (;;) {
        size_t have = self->end - self->start;
        if (have >= 5) {
            const uint8_t *h = self->buf + self->start;
            *length = (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | (size_t)h[3];
            if (*length == 0) return R_ZERO;
            if (*length - 1 > self->max_message) return R_TOO_LARGE;
            if (have >= 4 + *length) {
                if (wait != NULL && h[4] == KIND_RETURNED && sk_wait_take(wait, h + 5, *length - 1)) {
                    self->start += 4 + *length;
                    continue;
                }
                return R_MESSAGE; /* the listener's */
            }
            if (4 + *length > self->cap) { /* a message larger than the buffer: grow it */
                uint8_t *grown = PyMem_RawMalloc(4 + *length);
                if (grown == NULL) return R_NOMEM;
                memcpy(grown, self->buf + self->start, have);
                PyMem_RawFree(self->buf);
                self->buf = grown;
                self->cap = 4 + *length;
                self->start = 0;
                self->end = have;
            }
        }
        if (self->start == self->end) {
            self->start = self->end = 0;
        } else if (self->start > 0 && self->cap - self->end < 4096) {
            memmove(self->buf, self->buf + self->start, self->end - self->start);
            self->end -= self->start;
            self->start = 0;
        }
        ssize_t k = recv(self->fd, self->buf + self->end, self->cap - self->end, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            *err = errno;
            return R_ERROR;
        }
        if (k == 0) return R_CLOSED;
        self->end += (size_t)k;
    }
}

/* What ``next`` returns for ``reader_fill``'s outcome; a whole message is taken off the buffer. */
PyObject *sk_reader_result(FrameReader *self, int outcome, size_t length, int err) {
    switch (outcome) {
    case R_CLOSED:
        Py_RETURN_NONE;
    case R_ERROR:
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    case R_NOMEM:
        return PyErr_NoMemory();
    case R_ZERO:
        return Py_BuildValue("(is)", -1, "frame message length is 0 (it must include the kind byte)");
    case R_TOO_LARGE: {
        PyObject *why = PyUnicode_FromFormat("frame message of %zu bytes exceeds max_message_bytes=%zu", length - 1,
                                             self->max_message);
        return why == NULL ? NULL : Py_BuildValue("(iN)", -1, why);
    }
    default: {
        const uint8_t *h = self->buf + self->start;
        PyObject *body = PyBytes_FromStringAndSize((const char *)h + 5, (Py_ssize_t)(length - 1));
        if (body == NULL) return NULL;
        int kind = h[4];
        self->start += 4 + length;
        return Py_BuildValue("(iN)", kind, body);
    }
    }
}

/* Whether a whole message (or a length ``next`` refuses) is buffered beyond the first ``skip`` bytes. */
int sk_reader_whole_after(FrameReader *self, size_t skip) {
    size_t have = self->end - self->start - skip;
    if (have < 5) return 0;
    const uint8_t *h = self->buf + self->start + skip;
    size_t length = (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | (size_t)h[3];
    return length == 0 || length - 1 > self->max_message || have >= 4 + length;
}

/* next(wait) -> (kind, body); (-1, reason) for a length the link cannot be read past (zero, or over
 * max_message_bytes: the listener refuses it as FrameSocket does); None when the peer closed it.
 * Raises OSError when the read fails. ``wait`` (a ReturnWait, or None) takes its tokens here. */
static PyObject *FrameReader_next(FrameReader *self, PyObject *arg) {
    ReturnWait *wait = NULL;
    if (self->buf == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrameReader: not initialised");
        return NULL;
    }
    if (arg != Py_None) {
        if (!PyObject_TypeCheck(arg, &sk_ReturnWaitType)) {
            PyErr_SetString(PyExc_TypeError, "FrameReader.next: a ReturnWait or None");
            return NULL;
        }
        wait = (ReturnWait *)arg;
    }
    int outcome, err = 0;
    size_t length = 0;
    Py_BEGIN_ALLOW_THREADS
    outcome = sk_reader_fill(self, wait, &length, &err);
    Py_END_ALLOW_THREADS
    return sk_reader_result(self, outcome, length, err);
}

/* readable() -> whether a whole message is buffered already (or a length ``next`` refuses), so
 * ``next`` would not wait for the peer: what FrameSocket.readable answers for the Python reader. */
static PyObject *FrameReader_readable(FrameReader *self, PyObject *Py_UNUSED(ignored)) {
    if (self->buf == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrameReader: not initialised");
        return NULL;
    }
    return PyBool_FromLong(sk_reader_whole_after(self, 0));
}

static PyMethodDef FrameReader_methods[] = {
    {"next", (PyCFunction)FrameReader_next, METH_O,
     "next(wait) -> (kind, body), (-1, why) for a length it cannot read past, or None once closed"},
    {"readable", (PyCFunction)FrameReader_readable, METH_NOARGS,
     "readable() -> whether a whole message is buffered (next would not wait for the peer)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject sk_FrameReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.FrameReader",
    .tp_basicsize = sizeof(FrameReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FrameReader_init,
    .tp_dealloc = (destructor)FrameReader_dealloc,
    .tp_methods = FrameReader_methods,
    .tp_doc = "The head's plain return link, read in C; the lone generation's tokens taken on the way.",
};
