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
 * lander_landed / lander_passed / lander_wait / lander_bell / lander_close
 *     a queue of notifications whose numbers one thread of the process (no Python, no GIL,
 *     shared by every lander) stores into a mailbox's landed word once each one's copy event
 *     completed, in order (lander.c; transport/nvlink/landed.py, Lander, says what each
 *     call promises).
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
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

#include "lander.c"  /* the landers' thread (lander_*): one translation unit with this file */

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
    {"lander_bell", (PyCFunction)(void (*)(void))lander_bell, METH_FASTCALL,
     "Ring an eventfd (the receiver's doorbell) after each store."},
    {"lander_close", lander_close, METH_O, "Close a lander (nothing is stored for it after it)."},
    {"lander_spin", lander_spin, METH_O, "Set how long the thread looks without pause (ns); the old value."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvt_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvt_native(void) { return PyModule_Create(&module); }
