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

#include "capture.h"

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
