/* The landers' thread: the landed word stored from C, without the GIL. Compiled as part of
 * native.c (included there, one translation unit): it uses native.c's driver entry points and
 * argument helpers, and its functions are in native.c's method table. */

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
 * events stay Python's: it keeps each one alive until `passed` reaches its number.
 *
 * A lander may hold the receiver's doorbell (lander_bell): an eventfd that each store rings
 * (adds 1 to), so that a receiver asleep in select/poll wakes as the word moves instead of at
 * its next look. The lander keeps its own duplicate of the fd and closes it once closed: no
 * store, and so no ring, follows lander_stop. */

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
    int bell;  /* the receiver's doorbell (an eventfd, this lander's own duplicate), or -1 */
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
        if (l->bell >= 0) {
            close(l->bell);
            l->bell = -1;
        }
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

/* The front's copy has ended: its number into the word (one release store), the receiver's
 * doorbell rung after it (a receiver woken by the ring reads the word past the store), then it
 * goes. The bell is non-blocking: a full counter (never, at 2^64 - 2) would refuse the ring,
 * and the receiver finds the word at its next look. */
static void store_front(lander *l) {
    uint64_t number = l->ring[l->head].number;
    __atomic_store_n(l->word, number, __ATOMIC_RELEASE);
    l->landed = number;
    if (l->bell >= 0) {
        uint64_t one = 1;
        ssize_t rang = write(l->bell, &one, sizeof one);
        (void)rang;
    }
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
    if (l->bell >= 0) {  /* no store follows: nothing rings it again */
        close(l->bell);
        l->bell = -1;
    }
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
    l->bell = -1;
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

/* Ring the eventfd `fd` after each store from now on (a duplicate is kept: the caller closes
 * its own); a lander rings one bell, a second call replaces the first. Closed: nothing. */
static PyObject *lander_bell(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lander *l;
    long long fd;
    if (!check_nargs("lander_bell", nargs, 2) || (l = as_lander(args[0])) == NULL || !as_i64(args[1], &fd))
        return NULL;
    if (fd < 0 || fd > INT_MAX)
        return PyErr_Format(PyExc_ValueError, "lander_bell(): no file descriptor %lld", fd);
    int mine = fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&mu);
    int old = mine;  /* closed: the new one is not kept */
    if (!l->closed) {
        old = l->bell;
        l->bell = mine;
    }
    pthread_mutex_unlock(&mu);
    if (old >= 0)
        close(old);
    Py_RETURN_NONE;
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
