/*
 * The hidden-state capture of a non-final stage, as llama.cpp's eval callback.
 *
 * llama.cpp asks the callback about every node of the graph (hundreds per decode); answered
 * in Python that is one ctypes crossing and ~1.4 us of interpreter per node. Here the
 * question costs a strcmp. Only the boundary node (l_out-{n-1}) is answered "yes"; its
 * rows are copied into the caller's buffer and the callback answers "stop", so the graph
 * ends there. The ggml functions are handed in as pointers (the ones Python resolved from
 * libllama's own ggml), so this file links against nothing but libc.
 *
 * Not a Python module: skippy_stage/model/capture.py loads it with ctypes.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*skippy_get_name_fn)(const void *tensor);
typedef size_t (*skippy_nbytes_fn)(const void *tensor);
typedef void (*skippy_tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

/* The stable leading fields of struct ggml_tensor. */
struct skippy_tensor_head {
    int32_t type;
    void *buffer;
    int64_t ne[4];
};

enum {
    SKIPPY_CAPTURE_OK = 0,
    SKIPPY_CAPTURE_BAD_SHAPE = 1,   /* not f32 rows of the expected width */
    SKIPPY_CAPTURE_OVERFLOW = 2,    /* more rows than the buffer holds */
    SKIPPY_CAPTURE_TOO_MANY = 3,    /* more micro-batches than counts holds */
};

struct skippy_capture {
    skippy_get_name_fn get_name;
    skippy_nbytes_fn nbytes;
    skippy_tensor_get_fn tensor_get;
    const char *target;
    float *dst;
    int64_t width;
    int64_t capacity_rows;
    int32_t *counts;
    int32_t capacity_counts;
    /* written by the callback, reset by the caller before each decode */
    int32_t n_counts;
    int64_t rows;
    int32_t error;
    int32_t bad_type;
    int64_t bad_width;
};

/* Checked by capture.py before use; bumped whenever struct skippy_capture changes. */
int skippy_capture_abi_version(void) { return 1; }

/* The signature of ggml_backend_sched_eval_callback. */
bool skippy_capture_eval(void *tensor, bool ask, void *user_data) {
    struct skippy_capture *c = (struct skippy_capture *) user_data;
    if (ask) {
        const char *name = c->get_name(tensor);
        return name != NULL && strcmp(name, c->target) == 0;
    }
    const struct skippy_tensor_head *head = (const struct skippy_tensor_head *) tensor;
    if (head->type != 0 || head->ne[0] != c->width || head->ne[2] != 1 || head->ne[3] != 1) {
        c->error = SKIPPY_CAPTURE_BAD_SHAPE;
        c->bad_type = head->type;
        c->bad_width = head->ne[0];
        return false;
    }
    const int64_t rows = head->ne[1];
    if (c->rows + rows > c->capacity_rows) {
        c->error = SKIPPY_CAPTURE_OVERFLOW;
        return false;
    }
    if (c->n_counts >= c->capacity_counts) {
        c->error = SKIPPY_CAPTURE_TOO_MANY;
        return false;
    }
    c->tensor_get(tensor, c->dst + c->rows * c->width, 0, c->nbytes(tensor));
    c->rows += rows;
    c->counts[c->n_counts++] = (int32_t) rows;
    return false; /* stop the graph: nothing after the boundary is needed here */
}
