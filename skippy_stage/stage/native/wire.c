/* The protobuf bytes of the frame path: a HopRequest parsed into a frame_t (or declined: 0), the
 * next frame and the head's ReturnedBatch encoded after their 5-byte frame header, a returned
 * token read. Nothing here touches Python state but the error an encoder sets. */
#include "frames.h"

#include <string.h>

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

/* A BatchEntry the fast path can run, or 0. ``final``: it samples here (and returns no logits). */
int sk_parse_entry(const uint8_t *s, size_t n, entry_t *e, int final) {
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
        /* Every field but payload_bytes is 32 bits wide, and the Python path reads a longer varint cut
         * to its low 32 bits: a layer_start of 2^64 - 1 is 4294967295 there (refused), where as an
         * int64 it is -1 (below layer_end). Declined, so both read the same numbers. */
        if (f != 9 && v > UINT32_MAX) return 0;
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

static int distinct_sessions(const frame_t *fr) {
    for (int i = 0; i < fr->n; i++)
        for (int j = 0; j < i; j++)
            if (fr->entries[i].sid_len == fr->entries[j].sid_len
                && !memcmp(fr->entries[i].sid, fr->entries[j].sid, fr->entries[i].sid_len))
                return 0;
    return 1;
}

int sk_parse_frame(FramePath *self, const uint8_t *data, size_t size, frame_t *fr) {
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
            if (fr->n >= MAX_ENTRIES || fr->n >= self->n_batch
                || !sk_parse_entry(s, n, &fr->entries[fr->n], self->final))
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

/* ReturnedBatch{return_key, response: IterationBatchResponse{outputs: one EntryOutput, final_stage_id}}
 * whose one output is a plain token in [0, n_vocab) and whose final_stage_id is ASCII (at most
 * MAX_ID bytes): 1, its parts pointing into ``data``; else 0. Without the GIL (ReturnWait's take). */
int sk_parse_returned_token(const uint8_t *data, size_t size, int n_vocab, const uint8_t **key, size_t *key_len,
                            const uint8_t **sid, size_t *sid_len, int64_t *token, const uint8_t **final_id,
                            size_t *final_len) {
    rd_t r = {data, data + size};
    const uint8_t *resp = NULL, *out = NULL;
    size_t resp_len = 0, out_len = 0;
    int seen_key = 0, seen_resp = 0, n_out = 0, seen_final = 0;
    *key = *sid = *final_id = NULL;
    *key_len = *sid_len = *final_len = 0;
    while (r.p < r.end) {
        uint32_t f, wt;
        const uint8_t *b;
        size_t n;
        if (!rd_key(&r, &f, &wt) || wt != 2 || !rd_bytes(&r, &b, &n)) return 0;
        if (f == 1 && !seen_key++) {
            *key = b;
            *key_len = n;
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
            *final_id = b;
            *final_len = n;
        } else {
            return 0;
        }
    }
    *token = -1;
    return n_out == 1 && parse_plain_output(out, out_len, sid, sid_len, token) && *token >= 0 && *token < n_vocab
           && *final_len <= MAX_ID && (*final_id == NULL || ascii(*final_id, *final_len));
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
size_t sk_encode_returned(FramePath *self, const frame_t *fr, uint8_t **out) { /* *out: PyMem_Free it; 0: error set */
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

/* An inner stage's next frame: HopRequest{request: IterationBatchRequest{request_id, the entries as
 * they came, frame: ActivationFrame{descriptor, rows}, return_key}, timeout_s, relay, sent_unix_ns}
 * after a 5-byte frame header; its total length (0: an error set). ``rows`` in entry order. */
size_t sk_encode_forward(FramePath *self, const frame_t *fr, const char *key, size_t key_len, double timeout_s,
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
    uint64_t sent = sk_now_unix_ns();
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

/* The fields of one step of the head's lone generation, appended to its entry's template (a
 * BatchEntry without them): positions [position], token_ids [token], draws_before ``draws``; at
 * most 29 bytes. Returns the end. */
uint8_t *sk_put_step_fields(uint8_t *p, int64_t position, int32_t token, uint64_t draws) {
    *p++ = 3 << 3;
    p = put_varint(p, (uint64_t)position);
    *p++ = 4 << 3;
    p = put_varint(p, (uint64_t)(uint32_t)token);
    *p++ = (uint8_t)(16 << 3 | 0x80); /* field 16, varint: a two-byte key */
    *p++ = 1;
    return put_varint(p, draws);
}
