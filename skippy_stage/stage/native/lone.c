/* The head's lone greedy generation (FramePath.lone).
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

#include "frames.h"

#include <string.h>

/* 1: ``stage.downstream`` is still ``downstream`` and its hop's plain link (TcpHop.plain_link)
 * ``link``; 0: not; -1: error. Public attributes only: a hand-off switches the edge meanwhile. */
static int same_edge(PyObject *stage, PyObject *downstream, PyObject *link) {
    PyObject *d = PyObject_GetAttrString(stage, "downstream");
    if (d == NULL) return -1;
    int same = d == downstream;
    Py_DECREF(d);
    if (!same) return 0;
    PyObject *hop = PyObject_GetAttrString(downstream, "hop");
    if (hop == NULL) return -1;
    PyObject *l = PyObject_GetAttrString(hop, "plain_link");
    Py_DECREF(hop);
    if (l == NULL) return -1;
    same = l == link;
    Py_DECREF(l);
    return same;
}

/* lone(*, wait, template, request_id, key_prefix, position, token, draws, limit, eog, timeout_s, sock,
 *      send_lock, gate_pass, stage, downstream, link, on_token, bell=None)
 *   -> (how, value, steps, computes, hops, final_stage_id)
 * Keyword arguments only (an unknown one is a TypeError): ``wait`` the head's ReturnWait;
 * ``request_id`` and ``key_prefix`` (bytes) name each step's request and return key; ``sock`` and
 * ``send_lock`` the downstream link's socket and its send lock, ``gate_pass`` the stage's Gate;
 * ``stage``, ``downstream`` and ``link`` the edge each step checks is still the stage's (same_edge).
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
PyObject *sk_path_lone(FramePath *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"wait",      "template", "request_id", "key_prefix", "position", "token",
                            "draws",     "limit",    "eog",        "timeout_s",  "sock",     "send_lock",
                            "gate_pass", "stage",    "downstream", "link",       "on_token", "bell",
                            NULL};
    ReturnWait *wait;
    PyObject *template, *request, *prefix, *eog, *sock, *send_lock, *gate_pass, *stage, *downstream, *link, *on_token;
    PyObject *bell_obj = Py_None;
    long long position;
    int token;
    unsigned long long draws;
    long limit;
    double timeout;
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_Format(PyExc_TypeError, "lone() takes keyword arguments only (%zd positional given)",
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!SSSLiKlSdOOOOOOO|O:lone", names, &sk_ReturnWaitType, &wait, &template,
                                     &request, &prefix, &position, &token, &draws, &limit, &eog, &timeout, &sock,
                                     &send_lock, &gate_pass, &stage, &downstream, &link, &on_token, &bell_obj))
        return NULL;
    if (!sk_path_ready(self) || sk_timeout_checked(timeout, "FramePath.lone", &timeout) < 0) return NULL;
    if (!PyObject_TypeCheck(gate_pass, &sk_GateType) || !((Gate *)gate_pass)->ready) {
        PyErr_SetString(PyExc_TypeError, "FramePath.lone: gate_pass must be the stage's initialised Gate");
        return NULL;
    }
    Gate *gate = (Gate *)gate_pass;
    Bell *bell = NULL;
    if (bell_obj != Py_None) {
        if (!PyObject_TypeCheck(bell_obj, &sk_BellType) || !((Bell *)bell_obj)->ready) {
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
        sk_gate_in(gate);
        int same = same_edge(stage, downstream, link);
        if (same <= 0) {
            sk_gate_out(gate);
            if (same < 0) goto out;
            how = LONE_DECLINED;
            value = PyLong_FromLong(token);
            break;
        }
        /* this step's entry, request id and return key */
        uint8_t *end = sk_put_step_fields(entry + tlen, position, token, draws); /* the 40 bytes past it hold them */
        memset(fr, 0, offsetof(frame_t, entries));
        if (!sk_parse_entry(entry, (size_t)(end - entry), &fr->entries[0], 0) || fr->entries[0].n_tok != 1) {
            sk_gate_out(gate);
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
        sk_wait_move(wait, W_WAITING); /* before the send: its return may come before sk_run_frame ends */
        PyObject *done = sk_run_frame(self, fr, sock, send_lock, Py_None);
        double sent_at = sk_now_monotonic();
        sk_gate_out(gate);
        if (done == NULL) {
            Py_XDECREF(done);
            sk_wait_reset(wait);
            goto out;
        }
        if (done == Py_None) {
            Py_DECREF(done);
            sk_wait_reset(wait);
            how = LONE_DECLINED;
            value = PyLong_FromLong(token);
            break;
        }
        int status = (int)PyLong_AsLong(PyTuple_GET_ITEM(done, 0));
        int rc = (int)PyLong_AsLong(PyTuple_GET_ITEM(done, 1));
        if (PyList_Append(computes, PyTuple_GET_ITEM(done, 2)) < 0) {
            Py_DECREF(done);
            sk_wait_reset(wait);
            goto out;
        }
        Py_DECREF(done);
        if (status != 0) {
            sk_wait_reset(wait);
            how = status == 2 ? LONE_DECODE_FAILED : LONE_UNSENT;
            /* the token this step fed came back from the last one: the caller takes it */
            value = steps ? Py_BuildValue("(ii)", rc, token) : Py_BuildValue("(iO)", rc, Py_None);
            break;
        }
        steps++;
        /* the token this frame fed goes to its handler now that the frame has left */
        PyObject *fed = steps == 1 ? Py_None : PyLong_FromLong(token);
        if (fed == NULL) {
            sk_wait_reset(wait);
            goto out;
        }
        if (steps == 1) Py_INCREF(fed);
        PyObject *go = PyObject_CallFunctionObjArgs(on_token, fed, Py_True, NULL);
        Py_DECREF(fed);
        long flags = go == NULL ? -1 : PyLong_AsLong(go);
        Py_XDECREF(go);
        if (flags == -1 && (go == NULL || PyErr_Occurred())) {
            sk_wait_reset(wait);
            goto out;
        }
        int proceed = (flags & 1) != 0, ring = bell != NULL && (flags & 2) != 0;
        int state;
        Py_BEGIN_ALLOW_THREADS
        if (ring) sk_bell_ring(bell); /* the handler wakes into a free GIL */
        struct timespec until = sk_monotonic_after(timeout + 0.05);
        pthread_mutex_lock(&wait->mu);
        while (wait->state == W_WAITING)
            if (!sk_timed_wait(&wait->cond, &wait->mu, &until)) break;
        state = wait->state;
        pthread_mutex_unlock(&wait->mu);
        Py_END_ALLOW_THREADS
        PyObject *hop = PyFloat_FromDouble(sk_now_monotonic() - sent_at);
        if (hop == NULL || PyList_Append(hops, hop) < 0) {
            Py_XDECREF(hop);
            sk_wait_reset(wait);
            goto out;
        }
        Py_DECREF(hop);
        if (state == W_TOKEN) {
            int32_t next = wait->token;
            sk_wait_reset(wait);
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
            sk_wait_reset(wait);
            break;
        }
        sk_wait_reset(wait); /* the time ran out */
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
