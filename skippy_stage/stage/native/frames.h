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
 *
 * One module (skippy_stage.stage._frames), one file per job, this header between them:
 *   wire.c    the protobuf bytes: a frame parsed, the next frame and a ReturnedBatch encoded
 *   sync.c    clocks and timed waits: Bell, Gate, ReturnWait
 *   reader.c  FrameReader: a link read without the GIL
 *   lanes.c   the runtime's session state under its locks: lanes checked and advanced, histories
 *   path.c    FramePath: a frame admitted, decoded and sent (run, serve); the greedy pick
 *   lone.c    FramePath.lone: the head's lone greedy generation
 *   module.c  the module: the types the other files define, and greedy() for the tests
 * What one file calls in another is named sk_* (the rest is static), so nothing clashes with
 * the interpreter's or another extension's symbols; the module is built with hidden visibility
 * besides (setup.py), exporting only PyInit__frames.
 */
#ifndef SKIPPY_FRAMES_H
#define SKIPPY_FRAMES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

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

/* The prefix of the name of each pointer capsule FramePath takes: "skippy_stage._frames.<argument>"
 * (native_frames.capsule makes them). */
#define SK_CAPSULE_PREFIX "skippy_stage._frames."

/* -- a frame, parsed (wire.c) -------------------------------------------------------------------- */

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

/* -- the objects ----------------------------------------------------------------------------------- */

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
    int compute_lock_fd;              /* the host's compute lock (flock'd around decode), or -1 */
    logits_ith_fn logits_ith;
    seq_rm_fn seq_rm;
    batch_t batch;
    int32_t *pos, *seq, *token;
    int8_t *out;
    float *embd;
    int n_embd, n_vocab, n_batch, layer_start;
    long cells_per_lane, kv_pool_tokens;
    PyObject *owner; /* the runtime: its public ``closed`` is true once closed */
    PyObject *compute_lock, *lanes_lock, *sessions, *resident, *histories, *samplers;
    PyObject *sampling_kinds; /* dict: SamplingParams bytes -> 0 invalid, 1 valid, 2 plain greedy */
    PyObject *classify;       /* callable(bytes) -> that kind, for a settings message not seen yet */
    PyObject *stage_id;       /* bytes */
} FramePath;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    int ready;
    int rung;
} Bell;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    int ready;
    int closed;
    long passing;
    long waiting; /* threads in close/wait_idle, waiting for none passing */
} Gate;

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

typedef struct {
    PyObject_HEAD
    int fd; /* its own duplicate of the link's descriptor (-1: none), closed with the reader */
    uint8_t *buf;
    size_t cap, start, end; /* buffered bytes: buf[start:end] */
    size_t max_message;
} FrameReader;

extern PyTypeObject sk_FramePathType, sk_BellType, sk_GateType, sk_ReturnWaitType, sk_FrameReaderType;

/* -- wire.c: the protobuf bytes ------------------------------------------------------------------ */

int sk_parse_entry(const uint8_t *s, size_t n, entry_t *e, int final);
int sk_parse_frame(FramePath *self, const uint8_t *data, size_t size, frame_t *fr);
/* A ReturnedBatch holding one plain token (token < n_vocab) of one session: 1 with its parts
 * (pointing into ``data``), else 0. */
int sk_parse_returned_token(const uint8_t *data, size_t size, int n_vocab, const uint8_t **key, size_t *key_len,
                            const uint8_t **sid, size_t *sid_len, int64_t *token, const uint8_t **final_id,
                            size_t *final_len);
size_t sk_encode_returned(FramePath *self, const frame_t *fr, uint8_t **out);
size_t sk_encode_forward(FramePath *self, const frame_t *fr, const char *key, size_t key_len, double timeout_s,
                         const float *rows, uint8_t **out);
uint8_t *sk_put_step_fields(uint8_t *p, int64_t position, int32_t token, uint64_t draws);

/* -- sync.c: clocks and timed waits -------------------------------------------------------------- */

double sk_now_monotonic(void);
uint64_t sk_now_unix_ns(void);
struct timespec sk_monotonic_after(double seconds);
int sk_timed_wait(pthread_cond_t *cond, pthread_mutex_t *mu, const struct timespec *until);
int sk_timeout_checked(double seconds, const char *who, double *timeout);
void sk_bell_ring(Bell *self);
void sk_gate_in(Gate *g);
void sk_gate_out(Gate *g);
void sk_wait_move(ReturnWait *self, int state);
void sk_wait_reset(ReturnWait *self);
int sk_wait_take(ReturnWait *self, const uint8_t *data, size_t size);

/* -- reader.c: a link read without the GIL ------------------------------------------------------- */

enum { R_MESSAGE, R_CLOSED, R_ERROR, R_ZERO, R_TOO_LARGE, R_NOMEM };

int sk_reader_fill(FrameReader *self, ReturnWait *wait, size_t *length, int *err);
PyObject *sk_reader_result(FrameReader *self, int outcome, size_t length, int err);
int sk_reader_whole_after(FrameReader *self, size_t skip);

/* -- lanes.c: the runtime's session state, under its locks ------------------------------------- */

/* What sk_extend_histories changed, to put back: each entry's history list (a reference), where its
 * change began, what stood there, whether the list was made for it. */
typedef struct {
    int n;
    PyObject *history[MAX_ENTRIES], *tail[MAX_ENTRIES];
    Py_ssize_t cut[MAX_ENTRIES];
    int created[MAX_ENTRIES];
} history_undo_t;

int sk_check_lanes(FramePath *self, frame_t *fr, PyObject *owner);
int sk_samplers_plain(FramePath *self, frame_t *fr);
int sk_advance_lanes(FramePath *self, frame_t *fr);
int sk_extend_histories(FramePath *self, frame_t *fr, history_undo_t *u);
void sk_undo_histories(FramePath *self, frame_t *fr, history_undo_t *u);
void sk_release_history_undo(history_undo_t *u);

/* -- path.c: FramePath --------------------------------------------------------------------------- */

int sk_path_ready(FramePath *self);
PyObject *sk_run_frame(FramePath *self, frame_t *fr, PyObject *sock, PyObject *send_lock, PyObject *sink);
int32_t sk_greedy(const float *logits, int n);

/* -- lone.c: the head's lone greedy generation --------------------------------------------------- */

enum { LONE_TOKEN, LONE_SETTLED, LONE_DECLINED, LONE_DECODE_FAILED, LONE_UNSENT, LONE_TIMEOUT };

PyObject *sk_path_lone(FramePath *self, PyObject *args, PyObject *kw);

#endif
