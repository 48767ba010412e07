/* The direct path's host steps in C: the same steps as the Python ones they replace, without the
 * interpreter between the driver calls (transport/nvlink/native.py builds and loads this module).
 *
 * stage(dst_addr, src_slots, dst_slots, src_limit, dst_limit)
 *     copy two int64 arrays back to back to host memory at dst_addr and say whether every slot,
 *     read as unsigned, is at most its side's limit (a negative slot is past any limit); None
 *     when an array is not a C-contiguous int64 buffer (the caller takes its numpy path).
 * same_slots(addr, src_slots, dst_slots)
 *     whether host memory at addr holds the two int64 arrays back to back, as stage() copied
 *     them (None: an array is not a C-contiguous int64 buffer): a write's slots found already
 *     in the ring.
 * same_bytes(key, arrays)
 *     whether the int64 arrays of the tuple, back to back, hold exactly the bytes of key (None:
 *     some array is not a C-contiguous int64 buffer): a pair set compared with the last one
 *     without making its key.
 * load_driver()
 *     resolve the driver entry points in libcuda (OSError without one); the calls below need it.
 * upload_after(copy_stream, dev_addr, host_addr, nbytes, caller_stream, order_event)
 *     queue the host-to-device copy on copy_stream, then (caller_stream not None) make
 *     copy_stream wait for the work queued so far on caller_stream, through order_event.
 * launch(function, block, shared, stream, grid, pointers, ints, trailing[, wide])
 *     cuLaunchKernel over the parameters: the pointers (8 bytes each), the ints (int32 each,
 *     int64 where bit i of `wide` is set), then `trailing` null pointers (Triton's scratch
 *     arguments).
 * pipeline(local, peer, streams, events, buffers, next, gather, scatter, ints, bounds, offsets, upload)
 *     the staged engine's pipeline (transport/nvlink/staged.py, StagedLane.run) enqueued in one
 *     call: per chunk, on the local GPU a gather launch, on the copy stream a copy-engine copy
 *     into the peer's staging buffer, on the peer GPU a scatter launch, and the events that
 *     order them; returns the staging buffer index after the last chunk's.
 * param_sizes(function)
 *     the kernel's parameter sizes in bytes (cuFuncGetParamInfo; None on a driver without it).
 * current_device()
 *     the device of the calling thread's current context (-1: none), as cudaGetDevice sees it
 *     once the runtime made a device current.
 * event_create() / event_destroy(event)
 *     a raw event without timing, as an int.
 * lander_new(word_addr) and lander_watch / lander_land / lander_withdraw / lander_release /
 * lander_landed / lander_passed / lander_wait / lander_close
 *     a queue of notifications whose numbers one thread of the process (no Python, no GIL,
 *     shared by every lander) stores into a mailbox's landed word once each one's copy event
 *     completed, in order (transport/nvlink/lander.py says what each call promises).
 * lander_spin(ns)
 *     how long that thread looks at a copy in flight without pause before it naps (default
 *     2 ms; 0: it naps from the first look); returns the value it replaces.
 *
 * Driver errors raise the class given to set_error_class(cls) (RuntimeError before), naming
 * the call and the CUresult. Every function runs with
 * the GIL held: each is a few microseconds and touches no Python object after the driver call
 * (lander_wait lets the GIL go while it waits; so does lander_close, while it waits for the
 * landers' thread to let go of the lander, and joins that thread when it closes the last one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;

#define EVENT_DISABLE_TIMING 0x2
#define MAX_PARAMS 64
#define MAX_DEVICES 64

static CUresult (*cu_memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*cu_memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*cu_event_create)(CUevent *, unsigned int);
static CUresult (*cu_event_destroy)(CUevent);
static CUresult (*cu_event_record)(CUevent, CUstream);
static CUresult (*cu_stream_wait_event)(CUstream, CUevent, unsigned int);
static CUresult (*cu_launch_kernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                    unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
static CUresult (*cu_func_get_param_info)(CUfunction, size_t, size_t *, size_t *);
static CUresult (*cu_get_error_name)(CUresult, const char **);
static CUresult (*cu_ctx_get_current)(void **);
static CUresult (*cu_ctx_get_device)(int *);
static CUresult (*cu_event_query)(CUevent);
static CUresult (*cu_ctx_set_current)(void *);
static CUresult (*cu_device_get)(int *, int);
static CUresult (*cu_primary_ctx_retain)(void **, int);
static CUresult (*cu_primary_ctx_release)(int);
static int driver_loaded = 0;
static PyObject *error_class = NULL;  /* what a driver error raises (set_error_class; RuntimeError) */

static PyObject *driver_error(const char *call, CUresult code) {
    const char *name = NULL;
    if (cu_get_error_name == NULL || cu_get_error_name(code, &name) != 0 || name == NULL)
        name = "unknown";
    PyErr_Format(error_class != NULL ? error_class : PyExc_RuntimeError, "%s failed: CUresult %d (%s)", call, code,
                 name);
    return NULL;
}

static int need_driver(void) {
    if (driver_loaded)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "the CUDA driver is not loaded: call load_driver() first");
    return 0;
}

/* An int argument as a pointer-sized handle (0 allowed: the legacy default stream). */
static int as_handle(PyObject *obj, void **out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = (void *)(uintptr_t)v;
    return 1;
}

static int as_u64(PyObject *obj, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(obj);
    return !(*out == (unsigned long long)-1 && PyErr_Occurred());
}

static int as_i64(PyObject *obj, long long *out) {
    *out = PyLong_AsLongLong(obj);
    return !(*out == -1 && PyErr_Occurred());
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", name, want, nargs);
    return 0;
}

/* -- stage -------------------------------------------------------------------------------- */

static int int64_buffer(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    if (f != NULL && (*f == '<' || *f == '=' || *f == '@'))
        f++;
    if (view->itemsize == 8 && f != NULL && (f[0] == 'l' || f[0] == 'q') && f[1] == '\0')
        return 1;
    PyBuffer_Release(view);
    return 0;
}

static uint64_t copy_max(uint64_t *dst, const uint64_t *src, Py_ssize_t n) {
    uint64_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = src[i];
        dst[i] = v;
        top = v > top ? v : top;
    }
    return top;
}

/* Both slot arrays as C-contiguous int64 buffers (1), or neither (0: the caller answers None). */
static int slot_buffers(PyObject *src_obj, PyObject *dst_obj, Py_buffer *src, Py_buffer *dst) {
    if (!int64_buffer(src_obj, src))
        return 0;
    if (!int64_buffer(dst_obj, dst)) {
        PyBuffer_Release(src);
        return 0;
    }
    return 1;
}

static PyObject *stage(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long addr;
    long long src_limit, dst_limit;
    if (!check_nargs("stage", nargs, 5) || !as_u64(args[0], &addr) || !as_i64(args[3], &src_limit)
            || !as_i64(args[4], &dst_limit))
        return NULL;
    Py_buffer src, dst;
    if (!slot_buffers(args[1], args[2], &src, &dst))
        Py_RETURN_NONE;
    Py_ssize_t n = src.len / 8;
    if (dst.len / 8 != n) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_Format(PyExc_ValueError, "source and destination slots differ in length: %zd and %zd", n, dst.len / 8);
        return NULL;
    }
    uint64_t *ring = (uint64_t *)(uintptr_t)addr;
    uint64_t src_top = copy_max(ring, (const uint64_t *)src.buf, n);
    uint64_t dst_top = copy_max(ring + n, (const uint64_t *)dst.buf, n);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    int fits = n == 0 || (src_limit >= 0 && dst_limit >= 0 && src_top <= (uint64_t)src_limit
                          && dst_top <= (uint64_t)dst_limit);
    return PyBool_FromLong(fits);
}

/* same_slots(addr, src, dst): whether the ring at addr holds src then dst (as stage() left
 * them); None when either array cannot be read as C-contiguous int64. */
static PyObject *same_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long addr;
    if (!check_nargs("same_slots", nargs, 3) || !as_u64(args[0], &addr))
        return NULL;
    Py_buffer src, dst;
    if (!slot_buffers(args[1], args[2], &src, &dst))
        Py_RETURN_NONE;
    const char *ring = (const char *)(uintptr_t)addr;
    int same = src.len == dst.len && memcmp(ring, src.buf, (size_t)src.len) == 0
               && memcmp(ring + src.len, dst.buf, (size_t)dst.len) == 0;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyBool_FromLong(same);
}

static PyObject *same_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!check_nargs("same_bytes", nargs, 2))
        return NULL;
    if (!PyBytes_Check(args[0]) || !PyTuple_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "same_bytes() takes bytes and a tuple of arrays");
    const char *key = PyBytes_AS_STRING(args[0]);
    Py_ssize_t left = PyBytes_GET_SIZE(args[0]);
    int same = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); i++) {
        Py_buffer view;
        if (!int64_buffer(PyTuple_GET_ITEM(args[1], i), &view))
            Py_RETURN_NONE;
        same = same && view.len <= left && memcmp(key, view.buf, (size_t)view.len) == 0;
        key += same ? view.len : 0;
        left -= same ? view.len : 0;
        PyBuffer_Release(&view);
    }
    return PyBool_FromLong(same && left == 0);
}

/* -- driver ------------------------------------------------------------------------------- */

static PyObject *load_driver(PyObject *self, PyObject *unused) {
    if (driver_loaded)
        Py_RETURN_NONE;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL)
        return PyErr_Format(PyExc_OSError, "cannot load libcuda.so.1: %s", dlerror());
    struct { void **slot; const char *name; int required; } entries[] = {
        {(void **)&cu_memcpy_htod_async, "cuMemcpyHtoDAsync_v2", 1},
        {(void **)&cu_memcpy_async, "cuMemcpyAsync", 1},
        {(void **)&cu_event_create, "cuEventCreate", 1},
        {(void **)&cu_event_destroy, "cuEventDestroy_v2", 1},
        {(void **)&cu_event_record, "cuEventRecord", 1},
        {(void **)&cu_stream_wait_event, "cuStreamWaitEvent", 1},
        {(void **)&cu_launch_kernel, "cuLaunchKernel", 1},
        {(void **)&cu_get_error_name, "cuGetErrorName", 1},
        {(void **)&cu_ctx_get_current, "cuCtxGetCurrent", 1},
        {(void **)&cu_ctx_get_device, "cuCtxGetDevice", 1},
        {(void **)&cu_event_query, "cuEventQuery", 1},
        {(void **)&cu_ctx_set_current, "cuCtxSetCurrent", 1},
        {(void **)&cu_device_get, "cuDeviceGet", 1},
        {(void **)&cu_primary_ctx_retain, "cuDevicePrimaryCtxRetain", 1},
        {(void **)&cu_primary_ctx_release, "cuDevicePrimaryCtxRelease_v2", 1},
        {(void **)&cu_func_get_param_info, "cuFuncGetParamInfo", 0},  /* CUDA 12.4 and later */
    };
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        *entries[i].slot = dlsym(lib, entries[i].name);
        if (*entries[i].slot == NULL && entries[i].required)
            return PyErr_Format(PyExc_OSError, "libcuda.so.1 has no %s", entries[i].name);
    }
    driver_loaded = 1;
    Py_RETURN_NONE;
}

static PyObject *upload_after(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *copy, *dev, *host, *caller = NULL, *order = NULL;
    unsigned long long nbytes;
    if (!check_nargs("upload_after", nargs, 6) || !need_driver() || !as_handle(args[0], &copy)
            || !as_handle(args[1], &dev) || !as_handle(args[2], &host) || !as_u64(args[3], &nbytes))
        return NULL;
    int wait = args[4] != Py_None;
    if (wait && (!as_handle(args[4], &caller) || !as_handle(args[5], &order)))
        return NULL;
    CUresult rc;
    if (nbytes && (rc = cu_memcpy_htod_async((CUdeviceptr)(uintptr_t)dev, host, (size_t)nbytes, copy)) != 0)
        return driver_error("cuMemcpyHtoDAsync", rc);
    if (wait && (rc = cu_event_record(order, caller)) != 0)
        return driver_error("cuEventRecord", rc);
    if (wait && (rc = cu_stream_wait_event(copy, order, 0)) != 0)
        return driver_error("cuStreamWaitEvent", rc);
    Py_RETURN_NONE;
}

/* cuLaunchKernel over np pointers, ni integers (int64 where bit i of wide is set, else int32),
 * then trailing null pointers; 0 with an exception set on failure. */
static int launch_params(void *function, unsigned long long grid, unsigned long long block,
                         unsigned long long shared, void *stream, const CUdeviceptr *pointers, Py_ssize_t np,
                         const long long *ints, Py_ssize_t ni, unsigned long long wide, unsigned long long trailing) {
    if (np < 0 || ni < 0 || trailing > MAX_PARAMS || np + ni + (Py_ssize_t)trailing > MAX_PARAMS) {
        PyErr_Format(PyExc_ValueError, "launch() takes at most %d parameters", MAX_PARAMS);
        return 0;
    }
    if (grid == 0 || grid > 0x7fffffffULL || block == 0 || block > 1024) {
        PyErr_Format(PyExc_ValueError, "launch() grid %llu or block %llu out of range", grid, block);
        return 0;
    }
    CUdeviceptr ptrs[MAX_PARAMS];
    int64_t longs[MAX_PARAMS];
    int32_t values[MAX_PARAMS];
    void *params[MAX_PARAMS];
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < np; i++) {
        ptrs[i] = pointers[i];
        params[k++] = &ptrs[i];
    }
    for (Py_ssize_t i = 0; i < ni; i++) {
        long long v = ints[i];
        if (i < 64 && (wide >> i) & 1) {
            longs[i] = v;
            params[k++] = &longs[i];
            continue;
        }
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "launch() integer %lld is not an int32", v);
            return 0;
        }
        values[i] = (int32_t)v;
        params[k++] = &values[i];
    }
    for (unsigned long long i = 0; i < trailing; i++) {
        ptrs[np + i] = 0;
        params[k++] = &ptrs[np + i];
    }
    CUresult rc = cu_launch_kernel(function, (unsigned)grid, 1, 1, (unsigned)block, 1, 1, (unsigned)shared, stream,
                                   params, NULL);
    if (rc != 0) {
        driver_error("cuLaunchKernel", rc);
        return 0;
    }
    return 1;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *function, *stream;
    unsigned long long block, shared, grid, trailing, wide = 0;
    if (nargs != 9 && !check_nargs("launch", nargs, 8))
        return NULL;
    if (!need_driver() || !as_handle(args[0], &function) || !as_u64(args[1], &block) || !as_u64(args[2], &shared)
            || !as_handle(args[3], &stream) || !as_u64(args[4], &grid) || !as_u64(args[7], &trailing)
            || (nargs == 9 && !as_u64(args[8], &wide)))
        return NULL;
    PyObject *pointers = args[5], *ints = args[6];
    if (!PyTuple_Check(pointers) || !PyTuple_Check(ints))
        return PyErr_Format(PyExc_TypeError, "launch() takes its pointers and ints as tuples");
    Py_ssize_t np = PyTuple_GET_SIZE(pointers), ni = PyTuple_GET_SIZE(ints);
    if (np + ni > MAX_PARAMS)
        return PyErr_Format(PyExc_ValueError, "launch() takes at most %d parameters", MAX_PARAMS);
    CUdeviceptr ptrs[MAX_PARAMS];
    long long values[MAX_PARAMS];
    for (Py_ssize_t i = 0; i < np; i++) {
        void *p;
        if (!as_handle(PyTuple_GET_ITEM(pointers, i), &p))
            return NULL;
        ptrs[i] = (CUdeviceptr)(uintptr_t)p;
    }
    for (Py_ssize_t i = 0; i < ni; i++)
        if (!as_i64(PyTuple_GET_ITEM(ints, i), &values[i]))
            return NULL;
    if (!launch_params(function, grid, block, shared, stream, ptrs, np, values, ni, wide, trailing))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *param_sizes(PyObject *self, PyObject *arg) {
    void *function;
    if (!need_driver() || !as_handle(arg, &function))
        return NULL;
    if (cu_func_get_param_info == NULL)
        Py_RETURN_NONE;
    PyObject *sizes = PyList_New(0);
    if (sizes == NULL)
        return NULL;
    for (size_t i = 0; i <= MAX_PARAMS; i++) {
        size_t offset, size;
        if (cu_func_get_param_info(function, i, &offset, &size) != 0)
            break;  /* past the last parameter */
        PyObject *v = PyLong_FromSize_t(size);
        if (v == NULL || PyList_Append(sizes, v) != 0) {
            Py_XDECREF(v);
            Py_DECREF(sizes);
            return NULL;
        }
        Py_DECREF(v);
    }
    return sizes;
}

static PyObject *current_device(PyObject *self, PyObject *unused) {
    void *ctx = NULL;
    int device;
    CUresult rc;
    if (!need_driver())
        return NULL;
    if ((rc = cu_ctx_get_current(&ctx)) != 0)
        return driver_error("cuCtxGetCurrent", rc);
    if (ctx == NULL)
        return PyLong_FromLong(-1);
    if ((rc = cu_ctx_get_device(&device)) != 0)
        return driver_error("cuCtxGetDevice", rc);
    return PyLong_FromLong(device);
}

static PyObject *set_error_class(PyObject *self, PyObject *cls) {
    if (!PyExceptionClass_Check(cls))
        return PyErr_Format(PyExc_TypeError, "set_error_class() takes an exception class");
    Py_INCREF(cls);
    Py_XSETREF(error_class, cls);
    Py_RETURN_NONE;
}

static PyObject *event_create(PyObject *self, PyObject *unused) {
    CUevent event;
    CUresult rc;
    if (!need_driver())
        return NULL;
    if ((rc = cu_event_create(&event, EVENT_DISABLE_TIMING)) != 0)
        return driver_error("cuEventCreate", rc);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)event);
}

static PyObject *event_destroy(PyObject *self, PyObject *arg) {
    void *event;
    CUresult rc;
    if (!need_driver() || !as_handle(arg, &event))
        return NULL;
    if ((rc = cu_event_destroy(event)) != 0)
        return driver_error("cuEventDestroy", rc);
    Py_RETURN_NONE;
}

/* -- contexts ----------------------------------------------------------------------------- */

/* Make device's primary context current on the calling thread (retained at its first use, in
 * ctxs; whoever owns ctxs releases them), unless *current says it is already. 0, or the failing
 * call's CUresult with *call naming it. */
static CUresult use_device(void **ctxs, int device, int *current, const char **call) {
    CUresult rc;
    int dev;
    if (device == *current)
        return 0;
    if (device < 0 || device >= MAX_DEVICES) {
        *call = "cuDeviceGet (device out of range)";
        return 101;  /* CUDA_ERROR_INVALID_DEVICE */
    }
    if ((rc = cu_device_get(&dev, device)) != 0) {
        *call = "cuDeviceGet";
        return rc;
    }
    if (ctxs[device] == NULL && (rc = cu_primary_ctx_retain(&ctxs[device], dev)) != 0) {
        ctxs[device] = NULL;
        *call = "cuDevicePrimaryCtxRetain";
        return rc;
    }
    if ((rc = cu_ctx_set_current(ctxs[device])) != 0) {
        *call = "cuCtxSetCurrent";
        return rc;
    }
    *current = device;
    return 0;
}

/* -- pipeline ----------------------------------------------------------------------------- */

#define MAX_BUFFERS 16  /* staged.py: MAX_BUFFERS */

typedef struct {
    void *function;
    unsigned long long block, shared, trailing, wide;
    CUdeviceptr pointers[2];  /* the pair table and the ring of slots on the launch's GPU */
} launch_spec;

/* (function, block, shared, trailing, wide, pair table, ring of slots) */
static int as_spec(PyObject *obj, launch_spec *spec) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 7) {
        PyErr_SetString(PyExc_TypeError, "pipeline() takes each launch as (function, block, shared, trailing, wide, "
                        "table, slots)");
        return 0;
    }
    void *a, *b;
    if (!as_handle(PyTuple_GET_ITEM(obj, 0), &spec->function) || !as_u64(PyTuple_GET_ITEM(obj, 1), &spec->block)
            || !as_u64(PyTuple_GET_ITEM(obj, 2), &spec->shared) || !as_u64(PyTuple_GET_ITEM(obj, 3), &spec->trailing)
            || !as_u64(PyTuple_GET_ITEM(obj, 4), &spec->wide) || !as_handle(PyTuple_GET_ITEM(obj, 5), &a)
            || !as_handle(PyTuple_GET_ITEM(obj, 6), &b))
        return 0;
    spec->pointers[0] = (CUdeviceptr)(uintptr_t)a;
    spec->pointers[1] = (CUdeviceptr)(uintptr_t)b;
    return 1;
}

/* The handles of a tuple of n ints into out (n at most cap). */
static int as_handles(PyObject *obj, void **out, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != n) {
        PyErr_Format(PyExc_TypeError, "pipeline() takes %s as a tuple of %zd ints", what, n);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!as_handle(PyTuple_GET_ITEM(obj, i), &out[i]))
            return 0;
    return 1;
}

static void *pipeline_ctxs[MAX_DEVICES];  /* primary contexts, retained at their first use for the process */

#define STEP(call, name) do { CUresult rc_ = (call); if (rc_ != 0) { driver_error(name, rc_); goto fail; } } while (0)

static PyObject *pipeline(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long local, peer, next, slot_base, num_pairs, num_slots, block_r, programs;
    if (!check_nargs("pipeline", nargs, 12) || !need_driver() || !as_i64(args[0], &local) || !as_i64(args[1], &peer)
            || !as_i64(args[5], &next))
        return NULL;
    void *streams[3], *events[3 * MAX_BUFFERS], *buffers[2 * MAX_BUFFERS];
    Py_ssize_t n = PyTuple_Check(args[4]) ? PyTuple_GET_SIZE(args[4]) / 2 : 0;
    if (n < 1 || n > MAX_BUFFERS)
        return PyErr_Format(PyExc_ValueError, "pipeline() takes 1 to %d staging buffer pairs", MAX_BUFFERS);
    launch_spec gather, scatter;
    if (!as_handles(args[2], streams, 3, "its streams") || !as_handles(args[3], events, 3 * n, "its events")
            || !as_handles(args[4], buffers, 2 * n, "its buffers") || !as_spec(args[6], &gather)
            || !as_spec(args[7], &scatter))
        return NULL;
    PyObject *ints = args[8];
    if (!PyTuple_Check(ints) || PyTuple_GET_SIZE(ints) != 5)
        return PyErr_Format(PyExc_TypeError, "pipeline() takes (slot_base, num_pairs, num_slots, block_r, programs)");
    if (!as_i64(PyTuple_GET_ITEM(ints, 0), &slot_base) || !as_i64(PyTuple_GET_ITEM(ints, 1), &num_pairs)
            || !as_i64(PyTuple_GET_ITEM(ints, 2), &num_slots) || !as_i64(PyTuple_GET_ITEM(ints, 3), &block_r)
            || !as_i64(PyTuple_GET_ITEM(ints, 4), &programs))
        return NULL;
    if (block_r < 1 || programs < 0 || next < 0)
        return PyErr_Format(PyExc_ValueError, "pipeline() block_r %lld, programs %lld or next %lld out of range",
                            block_r, programs, next);
    void *upload[3] = {NULL, NULL, NULL};
    if (args[11] != Py_None && !as_handles(args[11], upload, 3, "its upload (device address, host address, bytes)"))
        return NULL;
    Py_buffer bounds, offsets;
    if (!int64_buffer(args[9], &bounds))
        return PyErr_Format(PyExc_TypeError, "pipeline() takes its bounds as a C-contiguous int64 buffer");
    if (!int64_buffer(args[10], &offsets)) {
        PyBuffer_Release(&bounds);
        return PyErr_Format(PyExc_TypeError, "pipeline() takes its offsets as a C-contiguous int64 buffer");
    }
    const long long *bound = bounds.buf, *offset = offsets.buf;
    Py_ssize_t chunks = bounds.len / 8 - 1;
    void *prev = NULL;
    int current = -1;  /* the device whose context this call made current (-1: none yet) */
    const char *call = NULL;  /* the driver call that failed */
    void *g = streams[0], *c = streams[1], *sc = streams[2];
    CUresult rc;
    if (offsets.len != bounds.len || chunks < 0) {
        PyErr_Format(PyExc_ValueError, "pipeline() bounds and offsets differ: %zd and %zd", bounds.len / 8,
                     offsets.len / 8);
        goto fail_args;
    }
    for (Py_ssize_t k = 0; k < chunks; k++)
        if (bound[k + 1] <= bound[k] || offset[k + 1] < offset[k] || bound[k] < 0 || offset[k] < 0) {
            PyErr_Format(PyExc_ValueError, "pipeline() chunk %zd: rows [%lld, %lld) from offset %lld", k, bound[k],
                         bound[k + 1], offset[k]);
            goto fail_args;
        }
    if ((rc = cu_ctx_get_current(&prev)) != 0) {
        driver_error("cuCtxGetCurrent", rc);
        goto fail_args;
    }
    if (local < 0 || local >= MAX_DEVICES || peer < 0 || peer >= MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "pipeline() devices %lld and %lld out of range", local, peer);
        goto fail_args;
    }
#define USE(device) do { if ((rc = use_device(pipeline_ctxs, (int)(device), &current, &call)) != 0) { \
        driver_error(call, rc); goto fail; } } while (0)
    if (upload[0] != NULL) {
        USE(peer);
        STEP(cu_memcpy_async((CUdeviceptr)(uintptr_t)upload[0], (CUdeviceptr)(uintptr_t)upload[1],
                             (size_t)(uintptr_t)upload[2], sc), "cuMemcpyAsync (slots)");
    }
    for (Py_ssize_t k = 0; k < chunks; k++) {
        long long a = bound[k], b = bound[k + 1], origin = offset[k];
        size_t nbytes = (size_t)(offset[k + 1] - offset[k]);
        Py_ssize_t slot = (Py_ssize_t)(next++ % n);
        void *gathered = events[slot], *copied = events[n + slot], *scattered = events[2 * n + slot];
        CUdeviceptr mine = (CUdeviceptr)(uintptr_t)buffers[slot], theirs = (CUdeviceptr)(uintptr_t)buffers[n + slot];
        long long tiles = (b - a + block_r - 1) / block_r;
        long long grid = programs && programs < tiles ? programs : tiles;
        long long gather_ints[8] = {slot_base, num_pairs, num_slots, a, b, tiles, (long long)mine, origin};
        long long scatter_ints[8] = {slot_base, num_pairs, num_slots, a, b, tiles, (long long)theirs, origin};
        USE(local);
        STEP(cu_stream_wait_event(g, copied, 0), "cuStreamWaitEvent");  /* the copy that last read mine is done */
        if (!launch_params(gather.function, grid, gather.block, gather.shared, g, gather.pointers, 2, gather_ints, 8,
                           gather.wide, gather.trailing))
            goto fail;
        STEP(cu_event_record(gathered, g), "cuEventRecord");
        STEP(cu_stream_wait_event(c, gathered, 0), "cuStreamWaitEvent");
        STEP(cu_stream_wait_event(c, scattered, 0), "cuStreamWaitEvent");  /* the scatter that last read theirs */
        STEP(cu_memcpy_async(theirs, mine, nbytes, c), "cuMemcpyAsync");
        STEP(cu_event_record(copied, c), "cuEventRecord");
        USE(peer);
        STEP(cu_stream_wait_event(sc, copied, 0), "cuStreamWaitEvent");
        if (!launch_params(scatter.function, grid, scatter.block, scatter.shared, sc, scatter.pointers, 2,
                           scatter_ints, 8, scatter.wide, scatter.trailing))
            goto fail;
        STEP(cu_event_record(scattered, sc), "cuEventRecord");
    }
#undef USE
    cu_ctx_set_current(prev);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&offsets);
    return PyLong_FromLongLong(next);
fail:
    cu_ctx_set_current(prev);
fail_args:
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&offsets);
    return NULL;
}

/* -- lander ------------------------------------------------------------------------------- */

/* A lander is the queue of the notifications one mailbox outbox announced; ONE thread of the
 * process (no Python, no GIL) serves every lander: it looks at each queue's front in turn and,
 * once the front's copy event completed, stores its number into that outbox's landed word, so
 * that the receiver hands the notification out (transport/nvlink/mailbox.py). A process that
 * writes to many peers keeps one core busy while copies run, not one per peer. The thread
 * starts with the first lander and ends when the last one closes.
 *
 * A notification being withdrawn (its write failed or was aborted) is HELD: its queue stops at
 * it, storing nothing past it, until Python has sent the receiver its Dropped and releases it
 * (SKIP); then it goes on. A number <= landed was stored and can no longer be withdrawn. The
 * events stay Python's: it keeps each one alive until `passed` reaches its number. */

enum { WATCHING = 0, HELD = 1, SKIP = 2 };
#define CUDA_ERROR_NOT_READY 600
#define SPIN_NS 2000000LL        /* look without pause while some front has waited less than 2 ms (lander_spin) */
#define NAP_NS 20000LL           /* then every 20 us */
#define LONG_WAIT_NS 100000000LL /* and once every front has waited 100 ms, every 1 ms */
#define LONG_NAP_NS 1000000LL
#define IDLE_SPIN_NS 200000LL    /* with nothing watched, look for 200 us before sleeping */


typedef struct {
    uint64_t number;
    CUevent event;
    int device;  /* the event's: its context is made current before the thread queries it */
    int state;
    int faulted; /* the event's query failed: the thread waits for Python to withdraw it */
} landing;

typedef struct lander {
    volatile uint64_t *word;
    landing *ring;  /* a growing circular queue: head, count, cap */
    size_t head, count, cap;
    uint64_t watched, landed, passed;
    uint64_t busy;         /* the number whose event the thread queries outside the mutex (0: none) */
    uint64_t front;        /* the front the thread last looked at, and since when (its wait) */
    long long front_since;
    int closed;
    struct lander *prev, *next;  /* in `landers` while open */
} lander;

/* The landers and their thread; all of it under `mu`, which the thread lets go only while it
 * queries events (or looks for work, or naps). */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv;  /* on CLOCK_MONOTONIC: a nap ends early when there is news */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static lander *landers;    /* the open ones */
static long long spin_ns = SPIN_NS;  /* the window of looking without pause (lander_spin) */
static uint64_t era;       /* the running thread's; a thread whose era is past ends */
static uint64_t news;      /* raised by every watch: new work for a thread looking without the mutex */
static int running;        /* a thread of this era runs */
static pthread_t runner;

static const char *LANDER = "kvtransfer.lander";

static long long now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000000000LL + now.tv_nsec;
}

static void init_cv(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&cv, &attr);
    pthread_condattr_destroy(&attr);
}

/* A forked child has no thread and holds copies of `mu` and `cv` taken mid-use: it starts
 * afresh, every lander it inherited closed. */
static void fork_prepare(void) { pthread_mutex_lock(&mu); }
static void fork_parent(void) { pthread_mutex_unlock(&mu); }
static void fork_child(void) {
    for (lander *l = landers; l != NULL; l = l->next) {
        l->closed = 1;
        l->busy = 0;
    }
    landers = NULL;
    running = 0;
    pthread_mutex_init(&mu, NULL);
    init_cv();
}

static void init_once(void) {
    init_cv();
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* Wait on `cv` for at most `ns` (the mutex held). */
static void nap(long long ns) {
    long long until = now_ns() + ns;
    struct timespec t = {until / 1000000000LL, until % 1000000000LL};
    pthread_cond_timedwait(&cv, &mu, &t);
}

static void pop_front(lander *l) {
    l->passed = l->ring[l->head].number;
    l->head = (l->head + 1) % l->cap;
    l->count--;
    pthread_cond_broadcast(&cv);  /* for lander_wait (no system call while nobody waits) */
}

/* The front's copy has ended: its number into the word (one release store), then it goes. */
static void store_front(lander *l) {
    uint64_t number = l->ring[l->head].number;
    __atomic_store_n(l->word, number, __ATOMIC_RELEASE);
    l->landed = number;
    pop_front(l);
}

typedef struct {
    lander *l;
    uint64_t number;
    CUevent event;
    int device;
    CUresult rc;
} look;

/* One pass: each queue's front that can be queried, into *looks (grown as needed), marked busy;
 * SKIP fronts dropped. Returns how many; *shortest: the least any of them has waited, *pending:
 * whether any queue holds anything. */
static size_t fronts(look **looks, size_t *cap, long long now, long long *shortest, int *pending) {
    size_t n = 0;
    *shortest = LLONG_MAX;
    *pending = 0;
    for (lander *l = landers; l != NULL; l = l->next) {
        while (l->count > 0 && l->ring[l->head].state == SKIP)
            pop_front(l);
        if (l->count == 0)
            continue;
        *pending = 1;
        landing *f = &l->ring[l->head];
        if (f->state != WATCHING || f->faulted)
            continue;  /* until Python withdraws it */
        if (n == *cap) {
            size_t grown = *cap ? 2 * *cap : 16;
            look *more = realloc(*looks, grown * sizeof *more);
            if (more == NULL)
                break;  /* the rest on a later pass */
            *looks = more;
            *cap = grown;
        }
        if (l->front != f->number) {
            l->front = f->number;
            l->front_since = now;
        }
        if (now - l->front_since < *shortest)
            *shortest = now - l->front_since;
        (*looks)[n++] = (look){l, f->number, f->event, f->device, 0};
        l->busy = f->number;
    }
    return n;
}

static void *lander_main(void *arg) {
    uint64_t mine = (uint64_t)(uintptr_t)arg;
    void *ctxs[MAX_DEVICES] = {0};
    int current = -1;
    const char *call = NULL;  /* unused: a front whose context cannot be made current counts as faulted */
    look *looks = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&mu);
    while (era == mine) {
        long long shortest;
        int pending;
        size_t n = fronts(&looks, &cap, now_ns(), &shortest, &pending);
        if (n == 0) {
            if (!pending) {  /* a write often follows soon: look a while before sleeping, so that
                              * its watch finds the thread awake (no wake-up, no system call) */
                uint64_t seen = news;
                pthread_mutex_unlock(&mu);
                long long start = now_ns();
                while (__atomic_load_n(&news, __ATOMIC_ACQUIRE) == seen && __atomic_load_n(&era, __ATOMIC_ACQUIRE) == mine
                       && now_ns() - start < IDLE_SPIN_NS)
                    ;
                pthread_mutex_lock(&mu);
                if (news == seen && era == mine)
                    pthread_cond_wait(&cv, &mu);  /* until a watch or the end */
            } else {
                nap(LONG_NAP_NS);  /* held or faulted fronts only: Python withdraws or releases them */
            }
            continue;
        }
        pthread_mutex_unlock(&mu);
        for (size_t i = 0; i < n; i++)
            looks[i].rc = use_device(ctxs, looks[i].device, &current, &call) == 0 ? cu_event_query(looks[i].event) : -1;
        pthread_mutex_lock(&mu);
        int stored = 0, closed = 0;
        for (size_t i = 0; i < n; i++) {
            lander *l = looks[i].l;
            l->busy = 0;
            closed |= l->closed;
            landing *f = &l->ring[l->head];
            if (l->closed || l->count == 0 || f->number != looks[i].number || f->state != WATCHING)
                continue;  /* closed, stored by lander_land() from the caller's thread, or withdrawn */
            if (looks[i].rc == 0) {
                store_front(l);
                stored = 1;
            } else if (looks[i].rc != CUDA_ERROR_NOT_READY) {
                f->faulted = 1;
            }
        }
        if (closed)
            pthread_cond_broadcast(&cv);  /* lander_stop waits for the thread to let go of it */
        if (!stored && shortest >= spin_ns)
            nap(shortest > LONG_WAIT_NS ? LONG_NAP_NS : NAP_NS);
    }
    pthread_mutex_unlock(&mu);
    free(looks);
    cu_ctx_set_current(NULL);
    for (int d = 0; d < MAX_DEVICES; d++) {
        int dev;
        if (ctxs[d] != NULL && cu_device_get(&dev, d) == 0)
            cu_primary_ctx_release(dev);
    }
    return NULL;
}

/* Close l (nothing is stored for it afterwards); the last one to close ends the thread. The
 * caller has let go of the GIL. */
static void lander_stop(lander *l) {
    pthread_mutex_lock(&mu);
    if (l->closed) {
        pthread_mutex_unlock(&mu);
        return;
    }
    l->closed = 1;
    if (l->prev != NULL)
        l->prev->next = l->next;
    else
        landers = l->next;
    if (l->next != NULL)
        l->next->prev = l->prev;
    l->prev = l->next = NULL;
    int join = landers == NULL && running;  /* the thread ends once it let go of l */
    pthread_t thread = runner;
    if (join) {
        running = 0;
        __atomic_add_fetch(&era, 1, __ATOMIC_RELEASE);
    }
    pthread_cond_broadcast(&cv);  /* a lander_wait on l returns now; an ending thread wakes */
    while (l->busy != 0)
        pthread_cond_wait(&cv, &mu);  /* the thread is querying its event */
    pthread_mutex_unlock(&mu);
    if (join)
        pthread_join(thread, NULL);
}

static void lander_free(PyObject *capsule) {
    lander *l = PyCapsule_GetPointer(capsule, LANDER);
    if (l == NULL)
        return;
    Py_BEGIN_ALLOW_THREADS
    lander_stop(l);
    Py_END_ALLOW_THREADS
    free(l->ring);
    free(l);
}

static lander *as_lander(PyObject *obj) {
    return PyCapsule_GetPointer(obj, LANDER);
}

static PyObject *lander_new(PyObject *self, PyObject *arg) {
    void *word;
    if (!need_driver() || !as_handle(arg, &word))
        return NULL;
    if (word == NULL || ((uintptr_t)word & 7) != 0)
        return PyErr_Format(PyExc_ValueError, "lander_new() needs an 8-byte aligned word, got %p", word);
    pthread_once(&once, init_once);
    lander *l = calloc(1, sizeof *l);
    landing *ring = calloc(64, sizeof *ring);
    PyObject *capsule = l != NULL && ring != NULL ? PyCapsule_New(l, LANDER, NULL) : NULL;
    if (capsule == NULL) {
        free(l);
        free(ring);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    l->word = word;
    l->ring = ring;
    l->cap = 64;
    pthread_mutex_lock(&mu);
    int err = 0;
    if (!running) {
        uint64_t next = era + 1;
        err = pthread_create(&runner, NULL, lander_main, (void *)(uintptr_t)next);
        if (err == 0) {
            pthread_setname_np(runner, "kvt-lander");  /* as top -H and /proc name it */
            __atomic_store_n(&era, next, __ATOMIC_RELEASE);
            running = 1;
        }
    }
    if (err == 0) {
        l->next = landers;
        if (landers != NULL)
            landers->prev = l;
        landers = l;
    }
    pthread_mutex_unlock(&mu);
    if (err != 0) {
        Py_DECREF(capsule);
        free(ring);
        free(l);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyCapsule_SetDestructor(capsule, lander_free);
    return capsule;
}

static PyObject *lander_watch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lander *l;
    unsigned long long number;
    void *event;
    long long device;
    if (!check_nargs("lander_watch", nargs, 4) || (l = as_lander(args[0])) == NULL || !as_u64(args[1], &number)
            || !as_handle(args[2], &event) || !as_i64(args[3], &device))
        return NULL;
    if (device < 0 || device >= MAX_DEVICES)
        return PyErr_Format(PyExc_ValueError, "lander_watch(): device %lld out of range", device);
    pthread_mutex_lock(&mu);
    if (l->closed) {  /* the connection ended: nothing more is released */
        pthread_mutex_unlock(&mu);
        Py_RETURN_NONE;
    }
    if (number <= l->watched || event == NULL) {
        unsigned long long last = l->watched;
        pthread_mutex_unlock(&mu);
        return PyErr_Format(PyExc_ValueError, "lander_watch(): notification %llu after %llu, event %p", number,
                            last, event);
    }
    if (l->count == l->cap) {  /* grow, keeping the order: the front part first */
        landing *ring = malloc(2 * l->cap * sizeof *ring);
        if (ring == NULL) {
            pthread_mutex_unlock(&mu);
            return PyErr_NoMemory();
        }
        for (size_t i = 0; i < l->count; i++)
            ring[i] = l->ring[(l->head + i) % l->cap];
        free(l->ring);
        l->ring = ring;
        l->head = 0;
        l->cap *= 2;
    }
    landing *slot = &l->ring[(l->head + l->count) % l->cap];
    slot->number = number;
    slot->event = event;
    slot->device = (int)device;
    slot->state = WATCHING;
    slot->faulted = 0;
    l->count++;
    l->watched = number;
    __atomic_add_fetch(&news, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    Py_RETURN_NONE;
}

/* The watched landing of `number` (NULL: none, passed already or never watched). */
static landing *find(lander *l, uint64_t number) {
    for (size_t i = 0; i < l->count; i++) {
        landing *e = &l->ring[(l->head + i) % l->cap];
        if (e->number == number)
            return e;
    }
    return NULL;
}

/* The (lander, notification number) arguments of `name`; 0 with the exception set. */
static int lander_and_number(const char *name, PyObject *const *args, Py_ssize_t nargs, lander **l,
                             unsigned long long *number) {
    return check_nargs(name, nargs, 2) && (*l = as_lander(args[0])) != NULL && as_u64(args[1], number);
}

static PyObject *lander_withdraw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lander *l;
    unsigned long long number;
    if (!lander_and_number("lander_withdraw", args, nargs, &l, &number))
        return NULL;
    pthread_mutex_lock(&mu);
    int landed = number <= l->landed;
    landing *e = find(l, number);
    if (e != NULL && e->state == WATCHING)
        e->state = HELD;
    int unknown = !landed && e == NULL && !l->closed && number > l->passed;
    pthread_mutex_unlock(&mu);
    if (unknown)
        return PyErr_Format(PyExc_ValueError, "lander_withdraw(): notification %llu was never watched", number);
    return PyBool_FromLong(!landed);
}

/* Store, from the calling thread, the front landings whose events have completed (the write
 * call's own look: a copy that ended before the call returned is released without waiting for
 * the thread). A query that is refused (another device's event) is left to the thread. */
static PyObject *lander_land(PyObject *self, PyObject *capsule) {
    lander *l = as_lander(capsule);
    if (l == NULL)
        return NULL;
    pthread_mutex_lock(&mu);
    while (!l->closed && l->count > 0) {
        landing *front = &l->ring[l->head];
        if (front->state == SKIP) {
            pop_front(l);
            continue;
        }
        /* a landing the thread could not query (faulted) is stored if this thread can */
        if (front->state != WATCHING || cu_event_query(front->event) != 0)
            break;
        store_front(l);
    }
    pthread_mutex_unlock(&mu);
    Py_RETURN_NONE;
}

static PyObject *lander_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lander *l;
    unsigned long long number;
    if (!lander_and_number("lander_release", args, nargs, &l, &number))
        return NULL;
    pthread_mutex_lock(&mu);
    landing *e = find(l, number);
    if (e != NULL && e->state == HELD) {
        e->state = SKIP;
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
    Py_RETURN_NONE;
}

static PyObject *lander_counter(PyObject *capsule, int which) {
    lander *l = as_lander(capsule);
    if (l == NULL)
        return NULL;
    pthread_mutex_lock(&mu);
    uint64_t v = which == 0 ? l->landed : l->passed;
    if (which == 1 && l->busy != 0 && l->busy <= v)
        v = l->busy - 1;  /* popped by lander_land() while the thread still queries its event */
    pthread_mutex_unlock(&mu);
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *lander_landed(PyObject *self, PyObject *capsule) { return lander_counter(capsule, 0); }

static PyObject *lander_passed(PyObject *self, PyObject *capsule) { return lander_counter(capsule, 1); }

/* lander_wait(lander, number, timeout_s): wait, the GIL let go, until the thread is past
 * `number` (stored, or withdrawn and skipped): True; False after timeout_s; None once the
 * lander is closed (nothing will pass any more). */
static PyObject *lander_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lander *l;
    unsigned long long number;
    if (!check_nargs("lander_wait", nargs, 3) || (l = as_lander(args[0])) == NULL || !as_u64(args[1], &number))
        return NULL;
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    int past, closed;
    Py_BEGIN_ALLOW_THREADS
    long long until = now_ns() + (long long)(timeout > 0 ? timeout * 1e9 : 0);
    struct timespec t = {until / 1000000000LL, until % 1000000000LL};
    pthread_mutex_lock(&mu);
    while (!(past = l->passed >= number) && !(closed = l->closed) && now_ns() < until)
        pthread_cond_timedwait(&cv, &mu, &t);
    closed = l->closed;
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    if (past)
        Py_RETURN_TRUE;
    if (closed)
        Py_RETURN_NONE;
    Py_RETURN_FALSE;
}

static PyObject *lander_spin(PyObject *self, PyObject *arg) {
    long long ns;
    if (!as_i64(arg, &ns))
        return NULL;
    if (ns < 0)
        return PyErr_Format(PyExc_ValueError, "lander_spin() takes nanoseconds >= 0, got %lld", ns);
    pthread_once(&once, init_once);
    pthread_mutex_lock(&mu);
    long long was = spin_ns;
    spin_ns = ns;
    pthread_cond_broadcast(&cv);  /* a napping thread looks again under the new window */
    pthread_mutex_unlock(&mu);
    return PyLong_FromLongLong(was);
}

static PyObject *lander_close(PyObject *self, PyObject *capsule) {
    lander *l = as_lander(capsule);
    if (l == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    lander_stop(l);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stage", (PyCFunction)(void (*)(void))stage, METH_FASTCALL, "Copy two slot arrays in; True if in bounds."},
    {"same_slots", (PyCFunction)(void (*)(void))same_slots, METH_FASTCALL,
     "Whether the ring at an address holds two slot arrays back to back."},
    {"same_bytes", (PyCFunction)(void (*)(void))same_bytes, METH_FASTCALL,
     "Whether int64 arrays, back to back, are these bytes."},
    {"load_driver", load_driver, METH_NOARGS, "Resolve the driver entry points in libcuda."},
    {"upload_after", (PyCFunction)(void (*)(void))upload_after, METH_FASTCALL, "Upload, then order after a stream."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "cuLaunchKernel over pointers, int32s or int64s, nulls."},
    {"pipeline", (PyCFunction)(void (*)(void))pipeline, METH_FASTCALL, "Enqueue a staged pipeline's chunks."},
    {"param_sizes", param_sizes, METH_O, "A kernel's parameter sizes in bytes."},
    {"current_device", current_device, METH_NOARGS, "The current context's device (-1: no context)."},
    {"set_error_class", set_error_class, METH_O, "The exception class driver errors raise."},
    {"event_create", event_create, METH_NOARGS, "A raw event without timing."},
    {"event_destroy", event_destroy, METH_O, "Destroy a raw event."},
    {"lander_new", lander_new, METH_O, "A lander storing into the word at an address."},
    {"lander_watch", (PyCFunction)(void (*)(void))lander_watch, METH_FASTCALL, "Store a number once its event completed."},
    {"lander_withdraw", (PyCFunction)(void (*)(void))lander_withdraw, METH_FASTCALL,
     "Hold a number back (False: it landed already)."},
    {"lander_release", (PyCFunction)(void (*)(void))lander_release, METH_FASTCALL, "Let the thread pass a held number."},
    {"lander_land", lander_land, METH_O, "Store, from this thread, what has completed at the front."},
    {"lander_landed", lander_landed, METH_O, "The highest number stored."},
    {"lander_wait", (PyCFunction)(void (*)(void))lander_wait, METH_FASTCALL,
     "Wait until the thread is past a number (True), a timeout (False) or the close (None)."},
    {"lander_passed", lander_passed, METH_O, "The highest number the thread is done with."},
    {"lander_close", lander_close, METH_O, "Close a lander (nothing is stored for it after it)."},
    {"lander_spin", lander_spin, METH_O, "Set how long the thread looks without pause (ns); the old value."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvt_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvt_native(void) { return PyModule_Create(&module); }
