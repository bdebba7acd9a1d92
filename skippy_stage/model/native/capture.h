/*
 * The state of the hidden-state capture callback (capture.c), shared with the stages' native
 * frame path (skippy_stage/stage/native/path.c), which resets it and reads the rows it
 * captured. capture.py mirrors it in ctypes: bump skippy_capture_abi_version with any change.
 */
#ifndef SKIPPY_CAPTURE_H
#define SKIPPY_CAPTURE_H

#include <stddef.h>
#include <stdint.h>

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

#endif
