/* A stage's frame path without the interpreter, for the frames it can prove plain: a decode
 * frame's bytes in; at the final stage its sampled tokens out on the head's return link, at an
 * inner stage the next frame out on the downstream link. The head runs its own plain decode steps
 * through it too: the step encoded as the frame it sends, minus the rows (token ids in), the rows
 * it computes added on the way out, under the return key its wait is registered with.
 *
 * Why: on co-located stages every Python bytecode a frame runs after a llama_decode runs on caches
 * that decode just evicted (3-10x its hot cost, measured); a stage's frame path took ~300 us a
 * token there in Python (parse, checks, batch, sample or capture, encode, send). Here it is one call.
 *
 * It handles only what it can prove plain, and *declines* (returns None, touching nothing) the
 * rest, which the Python path then runs as before, errors and all: one frame alone on its link,
 * f32 hidden rows, one position per entry of a session already bound here, no rewind, prefix or
 * fork; at the final stage greedy sampling with nothing that reads history (the head sends plain
 * greedy settings by default), no logits, no relay, a plain TCP return link; at an inner stage
 * valid sampling settings (it only carries them), an f32 wire, a plain TCP downstream link.
 * Anything odd in the bytes (a field it does not know, a value out of range, a string that is
 * not ASCII) is a decline too: the Python path's checks then name the field, so refusals are
 * written once.
 *
 * State is not copied: the lane table, the session histories and the samplers stay the Python
 * objects the runtime owns, read and written here through the C API under the same locks in the
 * same order (the runtime's compute lock, then the lane table's), so there is one owner and one
 * truth. The GIL is released around llama_decode and the send, as ctypes would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../model/native/capture.h" /* the capture's state, ABI 1 */

typedef struct {
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
} batch_t; /* llama.h's llama_batch, by value */

typedef int32_t (*decode_fn)(void *ctx, batch_t batch);
typedef float *(*logits_ith_fn)(void *ctx, int32_t i);
typedef _Bool (*seq_rm_fn)(void *mem, int32_t seq, int32_t p0, int32_t p1);

#define MAX_ENTRIES 64
#define MAX_ID 256       /* config.MAX_SESSION_ID_LEN */
#define MAX_KEY 64       /* steps.MAX_RETURN_KEY_LEN */
#define KIND_HOP_REQUEST 3 /* framing.Kind.HOP_REQUEST */
#define KIND_RETURNED 5    /* framing.Kind.RETURNED_BATCH */

/* -- protobuf reading ------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *p, *end;
} rd_t;

static int rd_varint(rd_t *r, uint64_t *v) {
    uint64_t x = 0;
    for (int shift = 0; shift < 64 && r->p < r->end; shift += 7) {
        uint8_t b = *r->p++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return 1;
        }
    }
    return 0;
}

static int rd_key(rd_t *r, uint32_t *field, uint32_t *wt) {
    uint64_t k;
    if (!rd_varint(r, &k) || (k >> 3) == 0 || (k >> 3) > 0x1fffffff) return 0;
    *field = (uint32_t)(k >> 3);
    *wt = (uint32_t)(k & 7);
    return 1;
}

static int rd_bytes(rd_t *r, const uint8_t **s, size_t *n) {
    uint64_t len;
    if (!rd_varint(r, &len) || len > (uint64_t)(r->end - r->p)) return 0;
    *s = r->p;
    *n = (size_t)len;
    r->p += len;
    return 1;
}

static int rd_skip_fixed(rd_t *r, size_t n) {
    if ((size_t)(r->end - r->p) < n) return 0;
    r->p += n;
    return 1;
}

static int ascii(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] & 0x80) return 0;
    return 1;
}

/* One repeated int32 field holding exactly zero or one value so far: packed or not. */
static int rd_one_int(rd_t *r, uint32_t wt, int64_t *value, int *count) {
    uint64_t v;
    if (wt == 0) {
        if (!rd_varint(r, &v)) return 0;
        *value = (int64_t)v;
        *count += 1;
        return 1;
    }
    if (wt != 2) return 0;
    const uint8_t *s;
    size_t n;
    if (!rd_bytes(r, &s, &n)) return 0;
    rd_t in = {s, s + n};
    while (in.p < in.end) {
        if (!rd_varint(&in, &v)) return 0;
        *value = (int64_t)v;
        *count += 1;
    }
    return 1;
}

typedef struct {
    const uint8_t *raw; /* the whole BatchEntry, forwarded as it came (inner stage) */
    size_t raw_len;
    const uint8_t *sid;
    size_t sid_len;
    int64_t pos, token;
    int n_pos, n_tok;
    const uint8_t *sampling;
    size_t sampling_len;
    uint64_t draws;
    int32_t lane, row;
    int32_t sampled;
    int sample_last;
    PyObject *sid_obj, *lane_obj;
} entry_t;

/* A BatchEntry the fast path can run, or 0. ``final``: it samples here (and returns no logits). */
static int parse_entry(const uint8_t *s, size_t n, entry_t *e, int final) {
    rd_t r = {s, s + n};
    int seen_sid = 0, seen_sampling = 0, sample_last = 0;
    memset(e, 0, sizeof *e);
    e->raw = s;
    e->raw_len = n;
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        const uint8_t *b;
        size_t len;
        if (!rd_key(&r, &f, &wt)) return 0;
        switch (f) {
        case 1: /* session_id */
            if (wt != 2 || seen_sid++ || !rd_bytes(&r, &e->sid, &e->sid_len)) return 0;
            break;
        case 2: /* phase: prefill or decode, the same computation */
            if (wt != 0 || !rd_varint(&r, &v) || v > 2) return 0;
            break;
        case 3: /* positions */
            if (!rd_one_int(&r, wt, &e->pos, &e->n_pos)) return 0;
            break;
        case 4: /* token_ids */
            if (!rd_one_int(&r, wt, &e->token, &e->n_tok)) return 0;
            break;
        case 5: /* sample_last */
            if (wt != 0 || !rd_varint(&r, &v) || v > 1) return 0;
            sample_last = (int)v;
            break;
        case 6: case 9: case 10: case 11: /* want_logits (every stage checks the reply fits), rewind, verify,
                                             * all_rows: only false */
            if (wt != 0 || !rd_varint(&r, &v) || v != 0) return 0;
            break;
        case 7: /* sampling */
            if (wt != 2 || seen_sampling++ || !rd_bytes(&r, &e->sampling, &e->sampling_len)) return 0;
            break;
        case 8: case 13: /* prefix_id, fork_of: only empty */
            if (wt != 2 || !rd_bytes(&r, &b, &len) || len != 0) return 0;
            break;
        case 16: /* draws_before */
            if (wt != 0 || !rd_varint(&r, &e->draws)) return 0;
            break;
        default: /* top_logprobs, prompt_logprobs, next_token, unknown fields */
            return 0;
        }
    }
    if (!seen_sid || e->sid_len == 0 || e->sid_len > MAX_ID || !ascii(e->sid, e->sid_len)) return 0;
    if ((final && !sample_last) || e->n_pos != 1 || e->n_tok > 1) return 0;
    if (e->pos < 0 || e->pos >= INT32_MAX) return 0;
    if (final && e->draws > (uint64_t)e->pos) return 0; /* checked where it samples */
    e->sample_last = sample_last;
    return 1;
}

typedef struct {
    uint64_t hop_id, sent_ns;
    double timeout_s;
    int relay;
    const uint8_t *request_id;
    size_t request_id_len;
    const uint8_t *key;
    size_t key_len;
    const uint8_t *payload;
    size_t payload_len;
    int n;
    entry_t entries[MAX_ENTRIES];
} frame_t;

typedef struct {
    int64_t version, dtype, layout, layer_start, layer_end, width, token_count, sequence_count, payload_bytes;
} desc_t;

static int parse_descriptor(const uint8_t *s, size_t n, desc_t *d) {
    rd_t r = {s, s + n};
    memset(d, 0, sizeof *d);
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        if (!rd_key(&r, &f, &wt) || wt != 0 || !rd_varint(&r, &v)) return 0;
        if (f > 11) return 0;
        int64_t x = (int64_t)v;
        switch (f) {
        case 1: d->version = x; break;
        case 2: d->dtype = x; break;
        case 3: d->layout = x; break;
        case 5: d->layer_start = x; break;
        case 6: d->layer_end = x; break;
        case 7: d->token_count = x; break;
        case 8: d->sequence_count = x; break;
        case 9: d->payload_bytes = x; break;
        case 11: d->width = x; break;
        default: break; /* producer_stage_index, flags: not checked on either path */
        }
    }
    return 1;
}

typedef struct {
    PyObject_HEAD
    int final;                        /* samples and returns to the head; else forwards */
    int head;                         /* the first stage: token ids in (the head's own steps), no rows */
    struct skippy_capture *capture;   /* inner stage: the boundary rows land in capture->dst */
    int equal_split;                  /* llama.cpp splits a multi-sequence batch by sequence */
    int stage_index, layer_end;
    double hop_timeout_s;             /* the cap on a forwarded frame's timeout_s */
    PyObject *routes;                 /* inner stage: Stage.routes (claim: a key replies come back under) */
    void *ctx, *mem;
    decode_fn decode;
    logits_ith_fn logits_ith;
    seq_rm_fn seq_rm;
    batch_t batch;
    int32_t *pos, *seq, *token;
    int8_t *out;
    float *embd;
    int n_embd, n_vocab, n_batch, layer_start;
    long cells_per_lane, kv_pool_tokens;
    PyObject *owner; /* the runtime: its _ctx is None once closed */
    PyObject *compute_lock, *lanes_lock, *sessions, *resident, *histories, *samplers;
    PyObject *sampling_kinds; /* dict: SamplingParams bytes -> 0 invalid, 1 valid, 2 plain greedy */
    PyObject *classify;       /* callable(bytes) -> that kind, for a settings message not seen yet */
    PyObject *stage_id;       /* bytes */
} FramePath;

static int path_ready(FramePath *self);

static int distinct_sessions(const frame_t *fr) {
    for (int i = 0; i < fr->n; i++)
        for (int j = 0; j < i; j++)
            if (fr->entries[i].sid_len == fr->entries[j].sid_len
                && !memcmp(fr->entries[i].sid, fr->entries[j].sid, fr->entries[i].sid_len))
                return 0;
    return 1;
}

static int parse_frame(FramePath *self, const uint8_t *data, size_t size, frame_t *fr) {
    rd_t r = {data, data + size};
    const uint8_t *req = NULL, *frame = NULL;
    size_t req_len = 0, frame_len = 0;
    int seen_req = 0;
    memset(fr, 0, offsetof(frame_t, entries));
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        if (!rd_key(&r, &f, &wt)) return 0;
        if (f == 1 && wt == 0) {
            if (!rd_varint(&r, &fr->hop_id)) return 0;
        } else if (f == 2 && wt == 2) {
            if (seen_req++ || !rd_bytes(&r, &req, &req_len)) return 0;
        } else if (f == 3 && wt == 1) {
            if (!rd_skip_fixed(&r, 8)) return 0;
            memcpy(&fr->timeout_s, r.p - 8, 8);
        } else if (f == 4 && wt == 0) {
            /* relay: the final stage's Python path relays; an inner stage passes it on */
            if (!rd_varint(&r, &v) || v > 1 || (self->final && v)) return 0;
            fr->relay = (int)v;
        } else if (f == 5 && wt == 0) {
            if (!rd_varint(&r, &fr->sent_ns)) return 0;
        } else {
            return 0;
        }
    }
    if (!seen_req) return 0;
    rd_t q = {req, req + req_len};
    int seen_frame = 0, seen_key = 0;
    while (q.p < q.end) {
        uint32_t f, wt;
        const uint8_t *s;
        size_t n;
        if (!rd_key(&q, &f, &wt) || wt != 2 || !rd_bytes(&q, &s, &n)) return 0;
        if (f == 1) {
            if (!ascii(s, n)) return 0;
            fr->request_id = s;
            fr->request_id_len = n;
        } else if (f == 2) {
            if (fr->n >= MAX_ENTRIES || fr->n >= self->n_batch || !parse_entry(s, n, &fr->entries[fr->n], self->final))
                return 0;
            fr->n++;
        } else if (f == 3) {
            if (seen_frame++) return 0;
            frame = s;
            frame_len = n;
        } else if (f == 4) {
            /* the final stage returns under it; an inner stage may route an empty one anew */
            if (seen_key++ || (self->final && n == 0) || n > MAX_KEY || !ascii(s, n)) return 0;
            fr->key = s;
            fr->key_len = n;
        } else {
            return 0;
        }
    }
    if (fr->n == 0) return 0;
    if (self->head) { /* the head's own step: token ids, no rows; the return key its wait is under */
        if (seen_frame || !seen_key || fr->key_len == 0) return 0;
        for (int i = 0; i < fr->n; i++)
            if (fr->entries[i].n_tok != 1) return 0;
        return distinct_sessions(fr);
    }
    if (!seen_frame || (self->final && !seen_key)) return 0;
    rd_t a = {frame, frame + frame_len};
    desc_t d;
    int seen_desc = 0, seen_payload = 0;
    while (a.p < a.end) {
        uint32_t f, wt;
        const uint8_t *s;
        size_t n;
        if (!rd_key(&a, &f, &wt) || wt != 2 || !rd_bytes(&a, &s, &n)) return 0;
        if (f == 1) {
            if (seen_desc++ || !parse_descriptor(s, n, &d)) return 0;
        } else if (f == 2) {
            if (seen_payload++) return 0;
            fr->payload = s;
            fr->payload_len = n;
        } else {
            return 0;
        }
    }
    size_t rows = (size_t)fr->n, want = rows * (size_t)self->n_embd * 4;
    if (!seen_desc || d.version != 1 || d.dtype != 1 /* f32 */ || d.layout != 1 || d.layer_end != self->layer_start
        || d.layer_start >= d.layer_end || d.width != self->n_embd || d.token_count != (int64_t)rows
        || d.sequence_count != (int64_t)rows || d.payload_bytes != (int64_t)want || fr->payload_len != want)
        return 0;
    return distinct_sessions(fr);
}

/* -- helpers on Python objects ----------------------------------------------------------------- */

static long attr_long(PyObject *o, const char *name) {
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL) return -1;
    long x = PyLong_AsLong(v);
    Py_DECREF(v);
    return x;
}

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

static double now_monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t now_unix_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* -- protobuf writing -------------------------------------------------------------------------- */

/* A message of ``body`` bytes after its kind byte, as the frame header's u32 length (body + 1):
 * 1, or 0 with ValueError where it does not fit (never truncated). */
static int frame_length_fits(size_t body) {
    if (body < UINT32_MAX) return 1;
    PyErr_Format(PyExc_ValueError, "frame message of %zu bytes exceeds the frame format's 4 GiB", body);
    return 0;
}

static size_t varint_len(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

static uint8_t *put_bytes(uint8_t *p, uint32_t field, const void *s, size_t n) {
    p = put_varint(p, (uint64_t)field << 3 | 2);
    p = put_varint(p, n);
    memcpy(p, s, n);
    return p + n;
}

/* ReturnedBatch{return_key, response: IterationBatchResponse{outputs: EntryOutput{session_id,
 * has_token, token}..., final_stage_id}} after a 5-byte frame header; its total length. */
static size_t encode_returned(FramePath *self, const frame_t *fr, uint8_t **out) { /* *out: PyMem_Free it; 0: error set */
    const char *stage = PyBytes_AS_STRING(self->stage_id);
    size_t stage_len = (size_t)PyBytes_GET_SIZE(self->stage_id);
    size_t outputs[MAX_ENTRIES];
    size_t response = 1 + varint_len(stage_len) + stage_len;
    for (int i = 0; i < fr->n; i++) {
        const entry_t *e = &fr->entries[i];
        outputs[i] = 1 + varint_len(e->sid_len) + e->sid_len + 2 + 1 + varint_len((uint64_t)(uint32_t)e->sampled);
        response += 1 + varint_len(outputs[i]) + outputs[i];
    }
    size_t body = 1 + varint_len(fr->key_len) + fr->key_len + 1 + varint_len(response) + response;
    if (!frame_length_fits(body)) return 0;
    uint8_t *start = PyMem_Malloc(5 + body), *p = start;
    if (start == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    uint32_t length = (uint32_t)(body + 1);
    *p++ = (uint8_t)(length >> 24);
    *p++ = (uint8_t)(length >> 16);
    *p++ = (uint8_t)(length >> 8);
    *p++ = (uint8_t)length;
    *p++ = KIND_RETURNED;
    p = put_bytes(p, 1, fr->key, fr->key_len);
    *p++ = 2 << 3 | 2;
    p = put_varint(p, response);
    for (int i = 0; i < fr->n; i++) {
        const entry_t *e = &fr->entries[i];
        *p++ = 1 << 3 | 2;
        p = put_varint(p, outputs[i]);
        p = put_bytes(p, 1, e->sid, e->sid_len);
        *p++ = 2 << 3;
        *p++ = 1;
        *p++ = 3 << 3;
        p = put_varint(p, (uint64_t)(uint32_t)e->sampled);
    }
    p = put_bytes(p, 2, stage, stage_len);
    *out = start;
    return (size_t)(p - start);
}

/* -- the lanes, under the runtime's locks ------------------------------------------------------ */

/* 1: every entry's session is bound here at its next position with room and owned by ``owner`` (the
 * link the frame came on, peers.Peer; None for the head's own), the pool needs no eviction; 0:
 * decline (a session another link opened moves to this one in Python: LaneTable.admit); -1: a
 * Python error. */
static int check_lanes(FramePath *self, frame_t *fr, PyObject *owner) {
    Py_ssize_t i = 0;
    PyObject *k, *v;
    long used = 0, resident = 0;
    while (PyDict_Next(self->sessions, &i, &k, &v)) {
        long t = attr_long(v, "n_tokens");
        if (t < 0) return PyErr_Occurred() ? -1 : 0;
        used += t;
    }
    i = 0;
    while (PyDict_Next(self->resident, &i, &k, &v)) {
        long t = attr_long(v, "n_tokens");
        if (t < 0) return PyErr_Occurred() ? -1 : 0;
        resident += t;
    }
    if (used + fr->n + resident > self->kv_pool_tokens) return 0; /* full, or an eviction: Python's */
    for (int j = 0; j < fr->n; j++) {
        entry_t *e = &fr->entries[j];
        PyObject *bound = PyDict_GetItemWithError(self->sessions, e->sid_obj);
        if (bound == NULL) return PyErr_Occurred() ? -1 : 0;
        long n_tokens = attr_long(bound, "n_tokens"), lane = attr_long(bound, "lane");
        if ((n_tokens < 0 || lane < 0) && PyErr_Occurred()) return -1;
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

static int samplers_plain(FramePath *self, frame_t *fr) {
    for (int j = 0; j < fr->n; j++) {
        PyObject *state = PyDict_GetItemWithError(self->samplers, fr->entries[j].sid_obj);
        if (state == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        PyObject *chain = PyObject_GetAttrString(state, "chain");
        if (chain == NULL) return -1;
        PyObject *argmax = PyObject_GetAttrString(chain, "_argmax");
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
static int advance_lanes(FramePath *self, frame_t *fr) {
    static const char *fields[3] = {"n_tokens", "batches", "last_used"};
    PyObject *was[MAX_ENTRIES][3] = {{NULL}}, *now[MAX_ENTRIES][3] = {{NULL}};
    int rc = -1, written = 0;
    now[0][2] = PyFloat_FromDouble(now_monotonic());
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

/* What extend_histories changed, to put back: each entry's history list (a reference), where its
 * change began, what stood there, whether the list was made for it. */
typedef struct {
    int n;
    PyObject *history[MAX_ENTRIES], *tail[MAX_ENTRIES];
    Py_ssize_t cut[MAX_ENTRIES];
    int created[MAX_ENTRIES];
} history_undo_t;

/* The histories as they were before extend_histories (an error in flight kept); the references let go. */
static void undo_histories(FramePath *self, frame_t *fr, history_undo_t *u) {
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

static void release_history_undo(history_undo_t *u) {
    for (int j = 0; j < u->n; j++) {
        Py_CLEAR(u->history[j]);
        Py_CLEAR(u->tail[j]);
    }
    u->n = 0;
}

/* history[pos:] = [token_id] (the fed token, if it came along) + [sampled], as the runtime does;
 * all of it, or (an error raised) none: what it changed is put back. ``u`` keeps what undoes it. */
static int extend_histories(FramePath *self, frame_t *fr, history_undo_t *u) {
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
    undo_histories(self, fr, u);
    return -1;
}

/* llama.cpp's greedy sampler, exactly: the first index whose logit no later one exceeds (NaN
 * never exceeds, so a NaN row picks as llama_sampler_sample would). Two passes with no index
 * carried from one element to the next: the largest logit, kept in eight running maxima that the
 * compiler turns into vector max instructions (x > m ? x : m is what MAXPS does, a NaN x never
 * taken), then the first index holding it. The one-pass loop's compare-and-move chain took
 * ~200 us for SmolLM2's 49152 logits, at the final stage, on a token's critical path. */
static int32_t greedy(const float *logits, int n) {
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

/* An inner stage's next frame: HopRequest{request: IterationBatchRequest{request_id, the entries as
 * they came, frame: ActivationFrame{descriptor, rows}, return_key}, timeout_s, relay, sent_unix_ns}
 * after a 5-byte frame header; its total length (0: an error set). ``rows`` in entry order. */
static size_t encode_forward(FramePath *self, const frame_t *fr, const char *key, size_t key_len, double timeout_s,
                             const float *rows, uint8_t **out) {
    size_t payload = (size_t)fr->n * (size_t)self->n_embd * 4;
    uint64_t d[11] = {1, 1, 1, (uint64_t)self->stage_index, (uint64_t)self->layer_start, (uint64_t)self->layer_end,
                      (uint64_t)fr->n, (uint64_t)fr->n, payload, 0, (uint64_t)self->n_embd};
    size_t desc = 0;
    for (int f = 0; f < 11; f++)
        if (d[f]) desc += 1 + varint_len(d[f]);
    size_t frame = 1 + varint_len(desc) + desc + 1 + varint_len(payload) + payload;
    size_t request = 1 + varint_len(frame) + frame;
    if (fr->request_id_len) request += 1 + varint_len(fr->request_id_len) + fr->request_id_len;
    if (key_len) request += 1 + varint_len(key_len) + key_len;
    for (int j = 0; j < fr->n; j++) request += 1 + varint_len(fr->entries[j].raw_len) + fr->entries[j].raw_len;
    uint64_t sent = now_unix_ns();
    size_t body = 1 + varint_len(request) + request + 9 + (fr->relay ? 2 : 0) + 1 + varint_len(sent);
    if (!frame_length_fits(body)) return 0;
    uint8_t *start = PyMem_Malloc(5 + body), *p = start;
    if (start == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    uint32_t length = (uint32_t)(body + 1);
    *p++ = (uint8_t)(length >> 24);
    *p++ = (uint8_t)(length >> 16);
    *p++ = (uint8_t)(length >> 8);
    *p++ = (uint8_t)length;
    *p++ = KIND_HOP_REQUEST;
    *p++ = 2 << 3 | 2;
    p = put_varint(p, request);
    if (fr->request_id_len) p = put_bytes(p, 1, fr->request_id, fr->request_id_len);
    for (int j = 0; j < fr->n; j++) p = put_bytes(p, 2, fr->entries[j].raw, fr->entries[j].raw_len);
    *p++ = 3 << 3 | 2;
    p = put_varint(p, frame);
    *p++ = 1 << 3 | 2;
    p = put_varint(p, desc);
    for (int f = 0; f < 11; f++)
        if (d[f]) {
            p = put_varint(p, (uint64_t)(f + 1) << 3);
            p = put_varint(p, d[f]);
        }
    p = put_bytes(p, 2, rows, payload);
    if (key_len) p = put_bytes(p, 4, key, key_len);
    *p++ = 3 << 3 | 1;
    memcpy(p, &timeout_s, 8);
    p += 8;
    if (fr->relay) {
        *p++ = 4 << 3;
        *p++ = 1;
    }
    *p++ = 5 << 3;
    p = put_varint(p, sent);
    *out = start;
    return (size_t)(p - start);
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
static PyObject *run_frame(FramePath *self, frame_t *fr, PyObject *sock, PyObject *send_lock, PyObject *sink);

static PyObject *FramePath_run(FramePath *self, PyObject *args) {
    Py_buffer body;
    PyObject *sock, *send_lock, *sink;
    if (!path_ready(self) || !PyArg_ParseTuple(args, "y*OOO", &body, &sock, &send_lock, &sink)) return NULL;
    frame_t *fr = PyMem_Malloc(sizeof(frame_t));
    if (fr == NULL) {
        PyBuffer_Release(&body);
        return PyErr_NoMemory();
    }
    fr->n = 0;
    PyObject *result;
    if (parse_frame(self, body.buf, (size_t)body.len, fr)) {
        result = run_frame(self, fr, sock, send_lock, sink);
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
static PyObject *run_frame(FramePath *self, frame_t *fr, PyObject *sock, PyObject *send_lock, PyObject *sink) {
    float *forward_rows = NULL;
    PyObject *result = NULL, *key_obj = NULL;
    uint8_t *msg = NULL;
    int locked = 0, lanes_locked = 0;
    uint64_t arrived = now_unix_ns();
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
        if (e->sample_last) { /* checked wherever it rides; only the final stage samples */
            int kind = sampling_kind(self, e);
            if (kind < 0) goto fail;
            if (kind < (self->final ? 2 : 1)) goto decline;
        }
        e->sid_obj = PyUnicode_FromStringAndSize((const char *)e->sid, (Py_ssize_t)e->sid_len);
        if (e->sid_obj == NULL) goto fail;
    }
    uint64_t marks[4] = {now_unix_ns(), 0, 0, 0}; /* parsed, d0, d1, sent: tracing's marks */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (call_method(self->compute_lock, "acquire") < 0) goto fail;
    locked = 1;
    PyObject *live = PyObject_GetAttrString(self->owner, "_ctx");
    if (live == NULL) goto fail;
    int open = live != Py_None;
    Py_DECREF(live);
    if (!open) goto decline; /* closed meanwhile: the Python path says so */
    int ok = self->final ? samplers_plain(self, fr) : 1;
    if (ok < 0) goto fail;
    if (!ok) goto decline;
    if (call_method(self->lanes_lock, "acquire") < 0) goto fail;
    lanes_locked = 1;
    ok = check_lanes(self, fr, sink);
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
    marks[1] = now_unix_ns();
    rc = self->decode(self->ctx, batch);
    if (rc == 0 && self->final) {
        for (int j = 0; j < fr->n; j++) {
            float *logits = self->logits_ith(self->ctx, fr->entries[j].row);
            if (logits == NULL) {
                rc = -1000;
                break;
            }
            fr->entries[j].sampled = greedy(logits, self->n_vocab);
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
    marks[2] = now_unix_ns();
    if (rc != 0)
        for (int j = 0; j < fr->n; j++)
            self->seq_rm(self->mem, fr->entries[j].lane, (int32_t)fr->entries[j].pos, -1);
    Py_END_ALLOW_THREADS
    if (rc == 0) {
        /* The bookkeeping after the decode, all of it or none: where any of it fails, the histories
         * and lanes are as they were and the KV the decode wrote is cut back, as after a failed
         * decode; the error goes up. */
        history_undo_t undo = {0};
        int kept = !self->final || extend_histories(self, fr, &undo) == 0;
        if (kept && call_method(self->lanes_lock, "acquire") < 0) {
            kept = 0;
            undo_histories(self, fr, &undo);
        } else if (kept && advance_lanes(self, fr) < 0) {
            kept = 0;
            undo_histories(self, fr, &undo);
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (call_method(self->lanes_lock, "release") < 0) PyErr_Clear();
            PyErr_Restore(type, value, tb);
        } else if (kept && call_method(self->lanes_lock, "release") < 0) {
            release_history_undo(&undo);
            goto fail; /* all of it done; the lock's error goes up */
        }
        release_history_undo(&undo);
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
        len = encode_returned(self, fr, &msg);
    } else if (self->head) { /* its own step: the key the head waits under, the timeout it chose */
        len = encode_forward(self, fr, (const char *)fr->key, fr->key_len, forward_timeout(self, fr->timeout_s),
                             forward_rows, &msg);
    } else {
        /* Replies from below for this step come back under the key routed here (Stage.routes). */
        key_obj = PyObject_CallMethod(self->routes, "claim", "s#OK", (const char *)fr->key, (Py_ssize_t)fr->key_len,
                                      sink, (unsigned long long)fr->hop_id);
        if (key_obj == NULL) goto fail;
        Py_ssize_t key_len;
        const char *key = PyUnicode_AsUTF8AndSize(key_obj, &key_len);
        if (key == NULL) goto fail;
        len = encode_forward(self, fr, key, (size_t)key_len, forward_timeout(self, fr->timeout_s), forward_rows, &msg);
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
    marks[3] = now_unix_ns();
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
static struct timespec monotonic_after(double seconds) {
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
static int timeout_checked(double seconds, const char *who, double *timeout) {
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
    return timeout_checked(seconds, who, timeout);
}

/* One timed wait on a CLOCK_MONOTONIC condition: 1 to wait on (woken, or spuriously), 0 to stop
 * (the deadline passed, or any other error: EINVAL would otherwise return at once forever, a spin
 * holding ``mu``). */
static int timed_wait(pthread_cond_t *cond, pthread_mutex_t *mu, const struct timespec *until) {
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

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    int ready;
    int rung;
} Bell;

static int Bell_init(Bell *self, PyObject *args, PyObject *kw) {
    return sync_init(args, kw, &self->mu, &self->cond, &self->ready);
}

static void Bell_dealloc(Bell *self) { sync_dealloc((PyObject *)self, &self->mu, &self->cond, self->ready); }

/* Callable with or without the GIL. Signalled after unlocking: a waiter woken on this thread's
 * core would otherwise run only to block on the mutex still held here, and be woken again. */
static void bell_ring(Bell *self) {
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
    bell_ring(self);
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
    struct timespec until = monotonic_after(timeout >= 0 ? timeout : 0);
    pthread_mutex_lock(&self->mu);
    while (!self->rung)
        if (!(timeout < 0 ? untimed_wait(&self->cond, &self->mu) : timed_wait(&self->cond, &self->mu, &until)))
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

static PyTypeObject BellType = {
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

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    int ready;
    int closed;
    long passing;
    long waiting; /* threads in close/wait_idle, waiting for none passing */
} Gate;

static int Gate_init(Gate *self, PyObject *args, PyObject *kw) {
    return sync_init(args, kw, &self->mu, &self->cond, &self->ready);
}

static void Gate_dealloc(Gate *self) { sync_dealloc((PyObject *)self, &self->mu, &self->cond, self->ready); }

/* A frame passes in: at once while the gate is open, else once it opens (the GIL released).
 * Called with the GIL held. */
static void gate_in(Gate *g) {
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
static void gate_out(Gate *g) {
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
    gate_in(self);
    Py_RETURN_NONE;
}

static PyObject *Gate_exit(Gate *self, PyObject *Py_UNUSED(args)) {
    if (!gate_ready(self)) return NULL;
    gate_out(self);
    Py_RETURN_FALSE; /* never swallows the exception of the block it guarded */
}

/* Wait (mutex held) until none is passing or ``until``; returns whether none is. */
static int gate_wait_none(Gate *g, double timeout, const struct timespec *until) {
    g->waiting++;
    while (g->passing > 0)
        if (!(timeout < 0 ? untimed_wait(&g->cond, &g->mu) : timed_wait(&g->cond, &g->mu, until))) break;
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
    struct timespec until = monotonic_after(timeout >= 0 ? timeout : 0);
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
    struct timespec until = monotonic_after(timeout >= 0 ? timeout : 0);
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

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gate_init,
    .tp_dealloc = (destructor)Gate_dealloc,
    .tp_methods = Gate_methods,
    .tp_doc = "The gate in front of a stage's downstream edge (gate.EdgeGate's state), passed from C.",
};

/* -- the head's lone greedy generation -------------------------------------------------------------
 *
 * One session alone at the head, decoding greedily, one plain token a step: what the scheduler's
 * Python would do between its steps is fixed (the token that came back is the next step's input),
 * so ``lone`` runs the steps back to back in C on the scheduler's thread — the head's layers, the
 * frame sent, the return awaited — and hands each token to the scheduler's bookkeeping only after
 * the next frame has left (``on_token``: the client's stream, off the token's path). The return
 * listener hands the token over in C (``ReturnWait.take``); an error for the step in flight, a
 * return that is not one plain token, or a broken link settles the wait from Python
 * (``ReturnWait.settle``), and the loop gives the scheduler that outcome as the step's. It stops
 * at a token the scheduler must see (an end of generation, the length or context reached) or when
 * ``on_token`` says so (another session came, the task was cancelled), after the step in flight. */

enum { W_IDLE, W_WAITING, W_TOKEN, W_SETTLED };

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    int ready;
    int state;           /* W_*: written with the GIL held and under mu; the waiter reads it under mu */
    char key[MAX_KEY];   /* the awaited step's return key */
    size_t key_len;
    char sid[MAX_ID];    /* its session */
    size_t sid_len;
    int n_vocab;
    int32_t token;
    char final_id[MAX_ID]; /* the stage the last token came from */
    size_t final_len;
    PyObject *settled;   /* what ``settle`` gave */
} ReturnWait;

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

static void wait_move(ReturnWait *self, int state) {
    pthread_mutex_lock(&self->mu);
    self->state = state;
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->mu);
}

/* Back to idle between runs or steps, dropping a value settled for a step that ended otherwise
 * (it failed or was declined while ``settle`` came). */
static void wait_reset(ReturnWait *self) {
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

/* One EntryOutput holding a token and nothing else (no logits, samples or logprobs): 1, else 0. */
static int parse_plain_output(const uint8_t *s, size_t n, const uint8_t **sid, size_t *sid_len, int64_t *token) {
    rd_t r = {s, s + n};
    int seen_sid = 0, seen_token = 0;
    uint64_t has = 0;
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        if (!rd_key(&r, &f, &wt)) return 0;
        if (f == 1 && wt == 2) {
            if (seen_sid++ || !rd_bytes(&r, sid, sid_len)) return 0;
        } else if (f == 2 && wt == 0) {
            if (!rd_varint(&r, &has)) return 0;
        } else if (f == 3 && wt == 0) {
            if (seen_token++ || !rd_varint(&r, &v)) return 0;
            *token = (int64_t)(int32_t)(uint32_t)v;
        } else {
            return 0;
        }
    }
    return seen_sid && has == 1 && seen_token;
}

/* The core of ``take``, without the GIL (the return listener's C reader calls it): 1 when
 * ``body`` (a ReturnedBatch's bytes) is the awaited step's one plain token, now handed to the
 * waiting loop; 0 when not (nothing touched). Parsing touches nothing shared; the awaited key and
 * session are read under ``mu`` once the state says a step is awaited (the loop writes them
 * before it says so). */
static int wait_take(ReturnWait *self, const uint8_t *data, size_t size) {
    rd_t r = {data, data + size};
    const uint8_t *key = NULL, *resp = NULL, *out = NULL, *final_id = NULL, *sid = NULL;
    size_t key_len = 0, resp_len = 0, out_len = 0, final_len = 0, sid_len = 0;
    int seen_key = 0, seen_resp = 0, n_out = 0, seen_final = 0;
    while (r.p < r.end) {
        uint32_t f, wt;
        const uint8_t *b;
        size_t n;
        if (!rd_key(&r, &f, &wt) || wt != 2 || !rd_bytes(&r, &b, &n)) return 0;
        if (f == 1 && !seen_key++) {
            key = b;
            key_len = n;
        } else if (f == 2 && !seen_resp++) {
            resp = b;
            resp_len = n;
        } else {
            return 0;
        }
    }
    if (!seen_key || !seen_resp) return 0;
    rd_t q = {resp, resp + resp_len};
    while (q.p < q.end) {
        uint32_t f, wt;
        const uint8_t *b;
        size_t n;
        if (!rd_key(&q, &f, &wt) || wt != 2 || !rd_bytes(&q, &b, &n)) return 0;
        if (f == 1) {
            n_out++;
            out = b;
            out_len = n;
        } else if (f == 2 && !seen_final++) {
            final_id = b;
            final_len = n;
        } else {
            return 0;
        }
    }
    int64_t token = -1;
    if (n_out != 1 || !parse_plain_output(out, out_len, &sid, &sid_len, &token) || token < 0
        || token >= self->n_vocab || final_len > MAX_ID || (final_id != NULL && !ascii(final_id, final_len)))
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
    int taken = wait_take(self, body.buf, (size_t)body.len);
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

static PyTypeObject ReturnWaitType = {
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

/* -- the head's return link, read in C ---------------------------------------------------------
 *
 * The head's return listener reads a plain return link through this (framing's format: u32
 * big-endian length N, u8 kind, N-1 bytes): a ReturnedBatch that is the lone generation's awaited
 * token is handed over (``wait_take``) without the GIL and without returning to Python; every
 * other message is returned to the listener as FrameSocket.receive returns it. Without the GIL a
 * token's arrival no longer waits for whatever Python holds it (the client stream's handler, on
 * the same core) before the loop can take it. */

typedef struct {
    PyObject_HEAD
    int fd; /* its own duplicate of the link's descriptor (-1: none), closed with the reader */
    uint8_t *buf;
    size_t cap, start, end; /* buffered bytes: buf[start:end] */
    size_t max_message;
} FrameReader;

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

enum { R_MESSAGE, R_CLOSED, R_ERROR, R_ZERO, R_TOO_LARGE, R_NOMEM };

/* Until a whole message is buffered (R_MESSAGE, its length field in ``*length``) or the link cannot
 * be read on (the other outcomes; ``*err`` the errno of a failed read). ``wait`` (a ReturnWait, or
 * NULL) takes its tokens on the way. Called without the GIL. */
static int reader_fill(FrameReader *self, ReturnWait *wait, size_t *length, int *err) {
    for (;;) {
        size_t have = self->end - self->start;
        if (have >= 5) {
            const uint8_t *h = self->buf + self->start;
            *length = (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | (size_t)h[3];
            if (*length == 0) return R_ZERO;
            if (*length - 1 > self->max_message) return R_TOO_LARGE;
            if (have >= 4 + *length) {
                if (wait != NULL && h[4] == KIND_RETURNED && wait_take(wait, h + 5, *length - 1)) {
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
static PyObject *reader_result(FrameReader *self, int outcome, size_t length, int err) {
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
static int reader_whole_after(FrameReader *self, size_t skip) {
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
        if (!PyObject_TypeCheck(arg, &ReturnWaitType)) {
            PyErr_SetString(PyExc_TypeError, "FrameReader.next: a ReturnWait or None");
            return NULL;
        }
        wait = (ReturnWait *)arg;
    }
    int outcome, err = 0;
    size_t length = 0;
    Py_BEGIN_ALLOW_THREADS
    outcome = reader_fill(self, wait, &length, &err);
    Py_END_ALLOW_THREADS
    return reader_result(self, outcome, length, err);
}

/* readable() -> whether a whole message is buffered already (or a length ``next`` refuses), so
 * ``next`` would not wait for the peer: what FrameSocket.readable answers for the Python reader. */
static PyObject *FrameReader_readable(FrameReader *self, PyObject *Py_UNUSED(ignored)) {
    if (self->buf == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrameReader: not initialised");
        return NULL;
    }
    return PyBool_FromLong(reader_whole_after(self, 0));
}

static PyMethodDef FrameReader_methods[] = {
    {"next", (PyCFunction)FrameReader_next, METH_O,
     "next(wait) -> (kind, body), (-1, why) for a length it cannot read past, or None once closed"},
    {"readable", (PyCFunction)FrameReader_readable, METH_NOARGS,
     "readable() -> whether a whole message is buffered (next would not wait for the peer)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FrameReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skippy_stage.stage._frames.FrameReader",
    .tp_basicsize = sizeof(FrameReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FrameReader_init,
    .tp_dealloc = (destructor)FrameReader_dealloc,
    .tp_methods = FrameReader_methods,
    .tp_doc = "The head's plain return link, read in C; the lone generation's tokens taken on the way.",
};

enum { LONE_TOKEN, LONE_SETTLED, LONE_DECLINED, LONE_DECODE_FAILED, LONE_UNSENT, LONE_TIMEOUT };

/* 1: ``stage.downstream`` is still ``downstream`` and its hop's link ``link``; 0: not; -1: error. */
static int same_edge(PyObject *stage, PyObject *downstream, PyObject *link) {
    PyObject *d = PyObject_GetAttrString(stage, "downstream");
    if (d == NULL) return -1;
    int same = d == downstream;
    Py_DECREF(d);
    if (!same) return 0;
    PyObject *hop = PyObject_GetAttrString(downstream, "hop");
    if (hop == NULL) return -1;
    PyObject *l = PyObject_GetAttrString(hop, "_link");
    Py_DECREF(hop);
    if (l == NULL) return -1;
    same = l == link;
    Py_DECREF(l);
    return same;
}

/* lone(wait, template, request_id, key_prefix, position, token, draws, limit, eog, timeout_s, sock,
 *      send_lock, gate_pass, stage, downstream, link, on_token, bell)
 *   -> (how, value, steps, computes, hops, final_stage_id)
 * Steps of one session from ``position`` on: the entry ``template`` (a BatchEntry without
 * positions, token_ids and draws_before) fed ``token``, then each token that comes back, while
 * fewer than ``limit`` tokens came back, none of them in ``eog`` (int32s), and ``on_token`` (called
 * once a step's frame has left as ``on_token(fed, True)``: ``fed`` None for the first step, else
 * the token it fed) says go on: it returns an int, bit 0 go on, bit 1 ring ``bell`` (a Bell, or
 * None) — done here once the GIL is released, before the wait for the step's return.
 * how LONE_TOKEN: ``value`` the last token, which the caller takes; LONE_SETTLED: the last step's
 * outcome as ``settle`` gave it; LONE_DECLINED: ``value`` the token whose step the C path declined
 * (nothing of it done: the caller runs it); LONE_DECODE_FAILED, LONE_UNSENT: the decode or the send
 * of a step failed, ``value`` (llama_decode's code, the token that step fed or None for the first
 * step: a token that came back, which the caller still takes); LONE_TIMEOUT: no return within
 * ``timeout_s`` (+50 ms).
 * ``steps``: frames sent; ``computes`` and ``hops``: seconds each step's compute and return took. */
static PyObject *FramePath_lone(FramePath *self, PyObject *args) {
    ReturnWait *wait;
    PyObject *template, *request, *prefix, *eog, *sock, *send_lock, *gate_pass, *stage, *downstream, *link, *on_token;
    PyObject *bell_obj;
    long long position;
    int token;
    unsigned long long draws;
    long limit;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!SSSLiKlSdOOOOOOOO", &ReturnWaitType, &wait, &template, &request, &prefix, &position,
                          &token, &draws, &limit, &eog, &timeout, &sock, &send_lock, &gate_pass, &stage, &downstream,
                          &link, &on_token, &bell_obj))
        return NULL;
    if (!path_ready(self) || timeout_checked(timeout, "FramePath.lone", &timeout) < 0) return NULL;
    if (!PyObject_TypeCheck(gate_pass, &GateType) || !((Gate *)gate_pass)->ready) {
        PyErr_SetString(PyExc_TypeError, "FramePath.lone: gate_pass must be the stage's initialised Gate");
        return NULL;
    }
    Gate *gate = (Gate *)gate_pass;
    Bell *bell = NULL;
    if (bell_obj != Py_None) {
        if (!PyObject_TypeCheck(bell_obj, &BellType) || !((Bell *)bell_obj)->ready) {
            PyErr_SetString(PyExc_TypeError, "FramePath.lone: bell must be an initialised Bell or None");
            return NULL;
        }
        bell = (Bell *)bell_obj;
    }
    if (!self->head || PyBytes_GET_SIZE(template) > 4096 || PyBytes_GET_SIZE(request) > 200
        || PyBytes_GET_SIZE(prefix) > 40 || PyBytes_GET_SIZE(eog) % 4 || limit < 1 || position < 0) {
        PyErr_SetString(PyExc_ValueError, "FramePath.lone: the head's path only, a template of at most 4096 bytes, "
                                          "request_id <= 200 and key_prefix <= 40 bytes, eog int32s, limit >= 1");
        return NULL;
    }
    if (wait->state != W_IDLE) {
        PyErr_SetString(PyExc_RuntimeError, "FramePath.lone: its ReturnWait is in use");
        return NULL;
    }
    size_t tlen = (size_t)PyBytes_GET_SIZE(template);
    uint8_t *entry = PyMem_Malloc(tlen + 40);
    frame_t *fr = PyMem_Malloc(sizeof(frame_t));
    PyObject *computes = PyList_New(0), *hops = PyList_New(0), *result = NULL, *value = NULL;
    if (entry == NULL || fr == NULL || computes == NULL || hops == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    const int32_t *eogs = (const int32_t *)PyBytes_AS_STRING(eog);
    Py_ssize_t n_eog = PyBytes_GET_SIZE(eog) / 4;
    memcpy(entry, PyBytes_AS_STRING(template), tlen);
    char req[232];
    int how = -1;
    long steps = 0;
    for (;;) {
        gate_in(gate);
        int same = same_edge(stage, downstream, link);
        if (same <= 0) {
            gate_out(gate);
            if (same < 0) goto out;
            how = LONE_DECLINED;
            value = PyLong_FromLong(token);
            break;
        }
        /* this step's entry, request id and return key */
        uint8_t *end = entry + tlen;
        *end++ = 3 << 3;
        end = put_varint(end, (uint64_t)position);
        *end++ = 4 << 3;
        end = put_varint(end, (uint64_t)(uint32_t)token);
        *end++ = (uint8_t)(16 << 3 | 0x80); /* field 16, varint: a two-byte key */
        *end++ = 1;
        end = put_varint(end, draws);
        memset(fr, 0, offsetof(frame_t, entries));
        if (!parse_entry(entry, (size_t)(end - entry), &fr->entries[0], 0) || fr->entries[0].n_tok != 1) {
            gate_out(gate);
            how = LONE_DECLINED;
            value = PyLong_FromLong(token);
            break;
        }
        const entry_t *e = &fr->entries[0];
        int req_len = steps == 0 ? snprintf(req, sizeof req, "%s", PyBytes_AS_STRING(request))
                                 : snprintf(req, sizeof req, "%s+%ld", PyBytes_AS_STRING(request), steps);
        wait->key_len = (size_t)snprintf(wait->key, sizeof wait->key, "%s.%ld", PyBytes_AS_STRING(prefix), steps);
        memcpy(wait->sid, e->sid, e->sid_len);
        wait->sid_len = e->sid_len;
        fr->n = 1;
        fr->timeout_s = timeout;
        fr->request_id = (const uint8_t *)req;
        fr->request_id_len = (size_t)req_len;
        fr->key = (const uint8_t *)wait->key;
        fr->key_len = wait->key_len;
        wait_move(wait, W_WAITING); /* before the send: its return may come before run_frame ends */
        PyObject *done = run_frame(self, fr, sock, send_lock, Py_None);
        double sent_at = now_monotonic();
        gate_out(gate);
        if (done == NULL) {
            Py_XDECREF(done);
            wait_reset(wait);
            goto out;
        }
        if (done == Py_None) {
            Py_DECREF(done);
            wait_reset(wait);
            how = LONE_DECLINED;
            value = PyLong_FromLong(token);
            break;
        }
        int status = (int)PyLong_AsLong(PyTuple_GET_ITEM(done, 0));
        int rc = (int)PyLong_AsLong(PyTuple_GET_ITEM(done, 1));
        if (PyList_Append(computes, PyTuple_GET_ITEM(done, 2)) < 0) {
            Py_DECREF(done);
            wait_reset(wait);
            goto out;
        }
        Py_DECREF(done);
        if (status != 0) {
            wait_reset(wait);
            how = status == 2 ? LONE_DECODE_FAILED : LONE_UNSENT;
            /* the token this step fed came back from the last one: the caller takes it */
            value = steps ? Py_BuildValue("(ii)", rc, token) : Py_BuildValue("(iO)", rc, Py_None);
            break;
        }
        steps++;
        /* the token this frame fed goes to its handler now that the frame has left */
        PyObject *fed = steps == 1 ? Py_None : PyLong_FromLong(token);
        if (fed == NULL) {
            wait_reset(wait);
            goto out;
        }
        if (steps == 1) Py_INCREF(fed);
        PyObject *go = PyObject_CallFunctionObjArgs(on_token, fed, Py_True, NULL);
        Py_DECREF(fed);
        long flags = go == NULL ? -1 : PyLong_AsLong(go);
        Py_XDECREF(go);
        if (flags == -1 && (go == NULL || PyErr_Occurred())) {
            wait_reset(wait);
            goto out;
        }
        int proceed = (flags & 1) != 0, ring = bell != NULL && (flags & 2) != 0;
        int state;
        Py_BEGIN_ALLOW_THREADS
        if (ring) bell_ring(bell); /* the handler wakes into a free GIL */
        struct timespec until = monotonic_after(timeout + 0.05);
        pthread_mutex_lock(&wait->mu);
        while (wait->state == W_WAITING)
            if (!timed_wait(&wait->cond, &wait->mu, &until)) break;
        state = wait->state;
        pthread_mutex_unlock(&wait->mu);
        Py_END_ALLOW_THREADS
        PyObject *hop = PyFloat_FromDouble(now_monotonic() - sent_at);
        if (hop == NULL || PyList_Append(hops, hop) < 0) {
            Py_XDECREF(hop);
            wait_reset(wait);
            goto out;
        }
        Py_DECREF(hop);
        if (state == W_TOKEN) {
            int32_t next = wait->token;
            wait_reset(wait);
            int end_of_generation = 0;
            for (Py_ssize_t i = 0; i < n_eog; i++)
                if (eogs[i] == next) end_of_generation = 1;
            if (steps >= limit || end_of_generation || !proceed) {
                how = LONE_TOKEN;
                value = PyLong_FromLong(next);
                break;
            }
            token = next;
            position++;
            draws++;
            continue;
        }
        if (state == W_SETTLED) {
            how = LONE_SETTLED;
            value = wait->settled;
            wait->settled = NULL;
            wait_reset(wait);
            break;
        }
        wait_reset(wait); /* the time ran out */
        how = LONE_TIMEOUT;
        value = Py_None;
        Py_INCREF(value);
        break;
    }
    if (value == NULL) goto out;
    result = Py_BuildValue("(iNlOOs#)", how, value, steps, computes, hops, wait->final_id, (Py_ssize_t)wait->final_len);
out:
    PyMem_Free(entry);
    PyMem_Free(fr);
    Py_XDECREF(computes);
    Py_XDECREF(hops);
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
    if (!path_ready(self)
        || !PyArg_ParseTuple(args, "O!OOO|O", &FrameReaderType, &reader, &begin, &end, &sink, &done_list))
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
        outcome = reader_fill(reader, NULL, &length, &err);
        Py_END_ALLOW_THREADS
        if (outcome != R_MESSAGE) {
            result = reader_result(reader, outcome, length, err);
            break;
        }
        const uint8_t *h = reader->buf + reader->start;
        fr->n = 0;
        if (h[4] != KIND_HOP_REQUEST || reader_whole_after(reader, 4 + length)
            || !parse_frame(self, h + 5, length - 1, fr)) {
            result = reader_result(reader, outcome, length, err);
            break;
        }
        PyObject *held = PyObject_CallNoArgs(begin);
        if (held == NULL) break;
        if (held == Py_None) {
            Py_DECREF(held);
            result = reader_result(reader, outcome, length, err);
            break;
        }
        if (!PyTuple_Check(held) || PyTuple_GET_SIZE(held) < 2) {
            PyErr_SetString(PyExc_TypeError, "FramePath.serve: begin() must give None or (sock, send_lock, ...)");
            serve_end(end, held, Py_None, Py_None, sink);
            Py_DECREF(held);
            break;
        }
        PyObject *done = run_frame(self, fr, PyTuple_GET_ITEM(held, 0), PyTuple_GET_ITEM(held, 1), sink);
        if (done == Py_None) { /* declined inside: the Python path runs it */
            int ended = serve_end(end, held, Py_None, Py_None, sink);
            Py_DECREF(held);
            Py_DECREF(done);
            if (ended == 0) result = reader_result(reader, outcome, length, err);
            break;
        }
        PyObject *body = NULL;
        int plain = done != NULL && PyLong_AsLong(PyTuple_GET_ITEM(done, 0)) == 0;
        if (done != NULL && !plain)
            body = PyBytes_FromStringAndSize((const char *)h + 5, (Py_ssize_t)(length - 1));
        reader->start += 4 + length; /* run (or failed in the run): the frame is this path's */
        PyObject *gate = PyTuple_GET_SIZE(held) >= 5 ? PyTuple_GET_ITEM(held, 4) : NULL;
        if (plain && done_list != Py_None && PyList_GET_SIZE(done_list) < SERVE_DONE_MAX && gate != NULL
            && PyObject_TypeCheck(gate, &GateType) && ((Gate *)gate)->ready) { /* else ``end`` leaves it */
            gate_out((Gate *)gate);
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

/* The standard ownership pattern: every argument parsed into locals (borrowed) and checked first;
 * only then are new references taken and the old ones (a second ``__init__``) released, so a
 * failed init leaves the object as it was and dealloc releases only what the object holds. */
static int FramePath_init(FramePath *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ctx", "mem", "decode", "logits_ith", "seq_rm", "batch", "pos", "seq", "out", "embd",
                            "capture", "token", "n_embd", "n_vocab", "n_batch", "layer_start", "layer_end",
                            "stage_index", "equal_split", "cells_per_lane", "kv_pool_tokens", "hop_timeout_s", "owner",
                            "compute_lock", "lanes_lock", "sessions", "resident", "histories", "samplers", "routes",
                            "classify", "stage_id", NULL};
    unsigned long long ctx, mem, decode, logits_ith, seq_rm, batch, pos, seq, out, embd, capture, token;
    int n_embd, n_vocab, n_batch, layer_start, layer_end, stage_index, equal_split;
    long cells_per_lane, kv_pool_tokens;
    double hop_timeout_s;
    PyObject *owner, *compute_lock, *lanes_lock, *sessions, *resident, *histories, *samplers, *routes, *classify,
        *stage_id;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKKKKKKKKKiiiiiiplldOOOO!O!O!O!OOS", names, &ctx, &mem, &decode,
                                     &logits_ith, &seq_rm, &batch, &pos, &seq, &out, &embd, &capture, &token, &n_embd,
                                     &n_vocab, &n_batch, &layer_start, &layer_end, &stage_index, &equal_split,
                                     &cells_per_lane, &kv_pool_tokens, &hop_timeout_s, &owner, &compute_lock,
                                     &lanes_lock, &PyDict_Type, &sessions, &PyDict_Type, &resident, &PyDict_Type,
                                     &histories, &PyDict_Type, &samplers, &routes, &classify, &stage_id))
        return -1;
    if (!ctx || !mem || !decode || !seq_rm || !batch || !pos || !seq || !out || !(embd || token) || (embd && token)
        || n_embd <= 0 || n_vocab <= 0 || n_batch <= 0) {
        PyErr_SetString(PyExc_ValueError, "FramePath needs every pointer and positive sizes");
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
    int final = capture == 0, head = token != 0;
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
    self->ctx = (void *)(uintptr_t)ctx;
    self->mem = (void *)(uintptr_t)mem;
    self->decode = (decode_fn)(uintptr_t)decode;
    self->logits_ith = (logits_ith_fn)(uintptr_t)logits_ith;
    self->seq_rm = (seq_rm_fn)(uintptr_t)seq_rm;
    memcpy(&self->batch, (void *)(uintptr_t)batch, sizeof(batch_t));
    self->pos = (int32_t *)(uintptr_t)pos;
    self->seq = (int32_t *)(uintptr_t)seq;
    self->out = (int8_t *)(uintptr_t)out;
    self->embd = (float *)(uintptr_t)embd;
    self->token = (int32_t *)(uintptr_t)token;
    self->capture = (struct skippy_capture *)(uintptr_t)capture;
#define TAKE(name) Py_XSETREF(self->name, Py_NewRef(name));
    FRAMEPATH_OBJECTS(TAKE)
#undef TAKE
    Py_DECREF(sampling_kinds); /* Py_NewRef above took the object's own reference */
    return 0;
}

/* Whether ``__init__`` has run (a bare ``FramePath.__new__`` holds nothing to run with). */
static int path_ready(FramePath *self) {
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
    {"lone", (PyCFunction)FramePath_lone, METH_VARARGS,
     "lone(wait, template, request_id, key_prefix, position, token, draws, limit, eog, timeout_s, sock, send_lock, "
     "gate_pass, stage, downstream, link, on_token, bell) -> (how, value, steps, computes, hops, final_stage_id)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FramePathType = {
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

/* greedy(logits: float32 buffer) -> int: the final stage's greedy pick, for its tests. */
static PyObject *module_greedy(PyObject *mod, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = b.len / (Py_ssize_t)sizeof(float);
    if (n < 1 || n > INT32_MAX || b.len % (Py_ssize_t)sizeof(float)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "greedy: a non-empty buffer of float32 logits");
        return NULL;
    }
    int32_t best = greedy((const float *)b.buf, (int)n);
    PyBuffer_Release(&b);
    return PyLong_FromLong(best);
}

static PyMethodDef module_methods[] = {
    {"greedy", module_greedy, METH_O, "greedy(logits) -> int: the first index of the largest float32 logit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frames", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__frames(void) {
    PyTypeObject *types[] = {&FramePathType, &ReturnWaitType, &FrameReaderType, &BellType, &GateType};
    PyObject *m = NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    if ((m = PyModule_Create(&module)) == NULL) return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const char *name = strrchr(types[i]->tp_name, '.') + 1; /* "skippy_stage.stage._frames.<name>" */
        if (PyModule_AddObjectRef(m, name, (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
