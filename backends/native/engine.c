/*
 * kvferry's native transfer engine: executes posts on NIXL's C API and watches them on its own
 * thread, so no poll of a transfer or a notification needs the Python interpreter.
 *
 * What it decides: nothing about rooms. "Post this; tell me when it finished or failed" and
 * "these notifications arrived". The Python side (backends/nixl/native.py) loads this library with
 * ctypes (blocking calls through a handle that drops the GIL, short ones through one that keeps it)
 * and reads events in batches after one wake-up fd.
 *
 * NIXL's C API (libnixl_capi.so, inside the nixl wheel) ships no header and no version contract:
 * the few functions used here are declared from its wrapper.h at the pinned version (1.5.1) and
 * every one is looked up at load; any missing refuses the load, naming how many and which.
 *
 * Threads. Callers (Python threads) register memory, prepare lists and load peers directly; the
 * data path is the engine's own thread: a caller's post queues a command (one call, its arguments
 * copied), and the thread makes and posts the request, polls it and the agent's notifications. So
 * a request handle only ever lives on that thread, and no poster and poller contend for the UCX
 * worker. The agent is created with NIXL_THREAD_SYNC_RW: set-up calls from callers may still run
 * beside the thread's data path.
 *
 * Fences. A copy of the staged flows (a gather or scatter) is not a NIXL transfer, but its end is
 * watched here too, so the host learns it from the same batches and the same wake-up: "tell me
 * when this finished or failed". Two kinds: a CUDA event (a CUevent recorded after the copy's
 * kernels; cuEventQuery from libcuda, resolved the first time a CUDA fence is watched, never at
 * create) and a host fence (kvf_fence_new: a flag the host copy's thread signals). Each watch is
 * reported exactly once: done, failed (its reason in the status) or, at kvf_stop, failed -3. The
 * engine keeps a reference on a host fence until it reported it; a CUDA event must stay alive
 * until its fence event is drained (the Python side keeps it; the engine cannot own a CUevent).
 *
 * Event batch format (little endian, packed), read by kvf_drain:
 *   kind u8 (1 completion, 2 notification, 3 fence), then
 *   completion: cookie u64, status i32 (0 done, < 0 NIXL's error), post_ns u64, done_ns u64
 *   notification: agent_len u32, payload_len u32, agent bytes, payload bytes
 *   fence: cookie u64, status i32 (0 done; < 0 failed: see FENCE_*), watch_ns u64, done_ns u64
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

/* ---- NIXL C API, as declared by its wrapper.h (nixl 1.5.1) ---------------------------------- */
typedef int capi_status; /* nixl_capi_status_t: 0 success, 1 in progress, 2 in progress with error */
typedef void *capi_handle;

typedef struct {
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync; /* nixl_capi_thread_sync_t: 0 none, 1 strict, 2 rw */
    unsigned int num_workers;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
} capi_agent_config;

#define CAPI_FUNCS(X)                                                                              \
    X(create_configured_agent, capi_status, (const char *, const capi_agent_config *, capi_handle *)) \
    X(destroy_agent, capi_status, (capi_handle))                                                   \
    X(get_local_md, capi_status, (capi_handle, void **, size_t *))                                 \
    X(load_remote_md, capi_status, (capi_handle, const void *, size_t, char **))                   \
    X(invalidate_remote_md, capi_status, (capi_handle, const char *))                              \
    X(get_plugin_params, capi_status, (capi_handle, const char *, capi_handle *, capi_handle *))   \
    X(destroy_mem_list, capi_status, (capi_handle))                                                \
    X(destroy_params, capi_status, (capi_handle))                                                  \
    X(params_add, capi_status, (capi_handle, const char *, const char *))                          \
    X(create_backend, capi_status, (capi_handle, const char *, capi_handle, capi_handle *))        \
    X(destroy_backend, capi_status, (capi_handle))                                                 \
    X(create_opt_args, capi_status, (capi_handle *))                                               \
    X(destroy_opt_args, capi_status, (capi_handle))                                                \
    X(opt_args_set_notif_msg, capi_status, (capi_handle, const void *, size_t))                    \
    X(opt_args_set_has_notif, capi_status, (capi_handle, bool))                                    \
    X(create_reg_dlist, capi_status, (int, capi_handle *))                                         \
    X(destroy_reg_dlist, capi_status, (capi_handle))                                               \
    X(reg_dlist_add_desc, capi_status, (capi_handle, uintptr_t, size_t, uint64_t, const void *, size_t)) \
    X(register_mem, capi_status, (capi_handle, capi_handle, capi_handle))                          \
    X(deregister_mem, capi_status, (capi_handle, capi_handle, capi_handle))                        \
    X(create_xfer_dlist, capi_status, (int, capi_handle *))                                        \
    X(destroy_xfer_dlist, capi_status, (capi_handle))                                              \
    X(xfer_dlist_add_desc, capi_status, (capi_handle, uintptr_t, size_t, uint64_t))                \
    X(prep_xfer_dlist, capi_status, (capi_handle, const char *, capi_handle, capi_handle *, capi_handle)) \
    X(release_xfer_dlist_handle, capi_status, (capi_handle, capi_handle))                          \
    X(make_xfer_req, capi_status,                                                                  \
      (capi_handle, int, capi_handle, const int *, size_t, capi_handle, const int *, size_t,       \
       capi_handle *, capi_handle))                                                                \
    X(create_xfer_req, capi_status,                                                                \
      (capi_handle, int, capi_handle, capi_handle, const char *, capi_handle *, capi_handle))      \
    X(post_xfer_req, capi_status, (capi_handle, capi_handle, capi_handle))                         \
    X(get_xfer_status, capi_status, (capi_handle, capi_handle))                                    \
    X(release_xfer_req, capi_status, (capi_handle, capi_handle))                                   \
    X(destroy_xfer_req, capi_status, (capi_handle))                                                \
    X(create_notif_map, capi_status, (capi_handle *))                                              \
    X(destroy_notif_map, capi_status, (capi_handle))                                               \
    X(get_notifs, capi_status, (capi_handle, capi_handle, capi_handle))                            \
    X(notif_map_size, capi_status, (capi_handle, size_t *))                                        \
    X(notif_map_get_agent_at, capi_status, (capi_handle, size_t, const char **))                   \
    X(notif_map_get_notifs_size, capi_status, (capi_handle, const char *, size_t *))               \
    X(notif_map_get_notif, capi_status, (capi_handle, const char *, size_t, const void **, size_t *)) \
    X(notif_map_clear, capi_status, (capi_handle))                                                 \
    X(gen_notif, capi_status, (capi_handle, const char *, const void *, size_t, capi_handle))

static struct {
#define X(name, ret, args) ret(*name) args;
    CAPI_FUNCS(X)
#undef X
} api;
static void *api_lib;
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;

/* Load libnixl_capi.so at `path` and look up every function above. 0 on success; else -1 and a
 * one-line reason in err (the missing names, or dlopen's message). Idempotent. */
int kvf_load(const char *path, char *err, size_t errlen) {
    pthread_mutex_lock(&load_mu);
    if (api_lib != NULL) {
        pthread_mutex_unlock(&load_mu);
        return 0;
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(err, errlen, "cannot load %s: %s", path, dlerror());
        pthread_mutex_unlock(&load_mu);
        return -1;
    }
    const char *names[64];
    int missing = 0, total = 0;
#define X(name, ret, args)                                                                         \
    total++;                                                                                       \
    api.name = (ret(*) args)dlsym(lib, "nixl_capi_" #name);                                        \
    if (api.name == NULL && missing < 64)                                                          \
        names[missing++] = "nixl_capi_" #name;
    CAPI_FUNCS(X)
#undef X
    /* One line: how many are missing, and the first few by name. */
    size_t used = (size_t)snprintf(err, errlen, "missing %d of the %d functions it uses:", missing, total);
    for (int i = 0; i < missing && i < 6 && used < errlen; i++)
        used += (size_t)snprintf(err + used, errlen - used, "%s %s", i ? "," : "", names[i]);
    if (missing > 6 && used < errlen)
        snprintf(err + used, errlen - used, ", ...");
    if (missing) {
        dlclose(lib);
        memset(&api, 0, sizeof api);
        pthread_mutex_unlock(&load_mu);
        return -1;
    }
    api_lib = lib;
    pthread_mutex_unlock(&load_mu);
    return 0;
}

/* ---- CUDA driver API, resolved lazily (only once a CUDA fence is watched) -------------------- */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
static struct {
    int (*event_query)(void *);
    int (*ctx_get)(void **);
    int (*ctx_set)(void *);
    bool tried;
} cu;
static pthread_mutex_t cu_mu = PTHREAD_MUTEX_INITIALIZER;

/* libcuda as the process already has it (torch loaded it), else loaded here. 0, or -1: none. */
static int cuda_load(void) {
    pthread_mutex_lock(&cu_mu);
    if (!cu.tried) {
        cu.tried = true;
        void *lib = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
        if (lib == NULL)
            lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib != NULL) {
            cu.event_query = (int (*)(void *))dlsym(lib, "cuEventQuery");
            cu.ctx_get = (int (*)(void **))dlsym(lib, "cuCtxGetCurrent");
            cu.ctx_set = (int (*)(void *))dlsym(lib, "cuCtxSetCurrent");
            if (cu.event_query == NULL || cu.ctx_get == NULL || cu.ctx_set == NULL)
                cu.event_query = NULL; /* the library stays loaded: others may use it */
        }
    }
    int ok = cu.event_query != NULL ? 0 : -1;
    pthread_mutex_unlock(&cu_mu);
    return ok;
}

/* ---- engine ---------------------------------------------------------------------------------- */
enum { EV_DONE = 1, EV_NOTIF = 2, EV_FENCE = 3 };
enum { PLANT_NONE = 0, PLANT_EARLY_DONE = 1, PLANT_NOTIF_PREV = 2, PLANT_READY_LIFO = 3, PLANT_FENCE_EARLY = 4 };
/* A fence's failure statuses (a CUDA error e is reported as FENCE_CUDA_BASE - e). */
enum { FENCE_STOPPED = -3, FENCE_NO_CUDA = -6, FENCE_HOST_FAILED = -7, FENCE_CUDA_BASE = -10000 };

/* A host fence: state 0 pending, 1 done, < 0 failed; freed when its last reference goes (the
 * host's, taken at kvf_fence_new, and the engine's while it watches it). */
typedef struct kvf_hostfence {
    atomic_int state;
    atomic_int refs;
} kvf_hostfence;

static void fence_put(kvf_hostfence *f) {
    if (f != NULL && atomic_fetch_sub(&f->refs, 1) == 1)
        free(f);
}

/* A watched fence: a CUDA event (and the context it was recorded in) or a host fence. Lives on
 * the engine's thread only. */
typedef struct kvf_fence {
    uint64_t cookie, watch_ns;
    void *cu_event, *cu_ctx;
    kvf_hostfence *host;
    int status; /* a watch refused before it ran (no libcuda): reported as is */
    bool reported; /* planted early report: already emitted */
    struct kvf_fence *next;
} kvf_fence;

typedef struct kvf_req {
    uint64_t cookie;
    capi_handle req;
    uint64_t post_ns;
    bool done_at_post; /* NIXL finished it inside the post call */
    bool reported;     /* a completion event was already emitted (planted early completion) */
    struct kvf_req *next;
} kvf_req;

enum {
    CMD_PREPPED = 1,
    CMD_DESCS,
    CMD_RELEASE_PREP,
    CMD_REMOVE_REMOTE,
    CMD_GEN_NOTIF,
    CMD_READY,      /* make a request now, post it later (its `how`: CMD_PREPPED or CMD_DESCS) */
    CMD_POST_READY, /* post a made request */
    CMD_DROP_READY, /* give a made request back unposted */
    CMD_WATCH,      /* watch a fence (`fence`), report it under `cookie` */
};

/* A request made ahead of its post (CMD_READY), kept by id until posted or dropped. Lives on the
 * engine's thread only (and on the caller's once the thread stopped). */
typedef struct kvf_ready {
    uint64_t id;
    capi_handle req;  /* NULL: NIXL refused to make it; `status` says why */
    capi_handle args; /* its notification, passed again at the post */
    int status;
    struct kvf_ready *next;
} kvf_ready;

/* A caller's command for the engine's thread; its arguments are copies (the caller's arrays may
 * be gone by the time it runs). */
typedef struct kvf_cmd {
    int kind;
    int how; /* CMD_READY: which kind of request to make */
    int op;
    uint64_t cookie; /* the transfer's cookie; CMD_READY and CMD_DROP_READY: the ready id */
    uint64_t ready;  /* CMD_POST_READY: the ready id */
    uint64_t t0;
    capi_handle local, remote; /* prepared lists (CMD_PREPPED), the list to release */
    int *lidx, *ridx;
    size_t nl, nr; /* indices, or one-shot rows, of each side */
    int lmem, rmem;
    uint64_t *lrows, *rrows; /* one-shot: addr[n], len[n], dev[n] */
    char *agent;
    void *notif;
    size_t notif_len;
    bool sync, done; /* a sync command's caller waits for `done` and reads `result` */
    int result;
    kvf_fence *fence; /* CMD_WATCH: handed to the engine's thread */
    struct kvf_cmd *next;
} kvf_cmd;

typedef struct {
    capi_handle agent;
    capi_handle backend;
    pthread_t thread;
    bool thread_started;
    atomic_bool stop;
    pthread_mutex_t mu; /* guards: the command queue, events, accepting */
    pthread_cond_t cond;      /* the engine's thread waits on it: a command was queued */
    pthread_cond_t done_cond; /* callers of sync commands wait on it */
    kvf_cmd *cmd_head, *cmd_tail;
    atomic_bool queued; /* cmd_head != NULL, readable without the lock (the spinning thread peeks) */
    bool accepting; /* the engine's thread runs commands; else their callers do */
    uint8_t *events;
    size_t ev_len, ev_cap;
    _Atomic size_t pending; /* == ev_len, readable without the lock (Python peeks at it) */
    atomic_int hot;         /* the host expects notifications soon: poll without sleeping */
    int wake_fd;
    capi_handle notif_map; /* progress thread only */
    kvf_req *watched;      /* progress thread only */
    kvf_ready *ready;      /* progress thread only: requests made ahead, not yet posted */
    kvf_fence *fences;     /* progress thread only: copies watched, in watch order */
    void *cu_ctx;          /* progress thread only: the CUDA context it made current last */
    uint64_t poll_ns; /* pace while a transfer is in flight or hot; 0: poll back to back, yielding */
    uint64_t idle_min_ns, idle_max_ns;
    int plant;
    uint8_t *prev_notif; /* planted misrouting: the previous payload */
    size_t prev_len;
    atomic_ullong polls, posts, completions, notifs, fence_polls, fence_events;
} kvf_engine;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int reserve(kvf_engine *e, size_t more) {
    if (e->ev_len + more <= e->ev_cap)
        return 0;
    size_t cap = e->ev_cap ? e->ev_cap : 4096;
    while (cap < e->ev_len + more)
        cap *= 2;
    uint8_t *p = realloc(e->events, cap);
    if (p == NULL)
        return -1;
    e->events = p;
    e->ev_cap = cap;
    return 0;
}

static void put(kvf_engine *e, const void *src, size_t n) {
    memcpy(e->events + e->ev_len, src, n);
    e->ev_len += n;
    atomic_store(&e->pending, e->ev_len);
}

/* Caller holds mu. */
static void emit_done(kvf_engine *e, uint64_t cookie, int32_t status, uint64_t post_ns) {
    if (reserve(e, 1 + 8 + 4 + 8 + 8) != 0)
        return; /* out of memory: the transfer stays unreported; Python's deadlines cover it */
    uint8_t kind = EV_DONE;
    uint64_t done = now_ns();
    put(e, &kind, 1);
    put(e, &cookie, 8);
    put(e, &status, 4);
    put(e, &post_ns, 8);
    put(e, &done, 8);
    atomic_fetch_add(&e->completions, 1);
}

/* Caller holds mu. */
static void emit_notif(kvf_engine *e, const char *agent, const void *data, size_t len) {
    uint32_t alen = (uint32_t)strlen(agent), plen = (uint32_t)len;
    if (reserve(e, 1 + 8 + alen + plen) != 0)
        return;
    uint8_t kind = EV_NOTIF;
    put(e, &kind, 1);
    put(e, &alen, 4);
    put(e, &plen, 4);
    put(e, agent, alen);
    put(e, data, plen);
    atomic_fetch_add(&e->notifs, 1);
}

/* Caller holds mu. Same layout as a completion. */
static void emit_fence(kvf_engine *e, uint64_t cookie, int32_t status, uint64_t watch_ns) {
    if (reserve(e, 1 + 8 + 4 + 8 + 8) != 0)
        return; /* out of memory: unreported; the room's deadline covers it */
    uint8_t kind = EV_FENCE;
    uint64_t done = now_ns();
    put(e, &kind, 1);
    put(e, &cookie, 8);
    put(e, &status, 4);
    put(e, &watch_ns, 8);
    put(e, &done, 8);
    atomic_fetch_add(&e->fence_events, 1);
}

static uint64_t emitted_count(kvf_engine *e) {
    return atomic_load(&e->completions) + atomic_load(&e->notifs) + atomic_load(&e->fence_events);
}

static void wake(kvf_engine *e) {
    uint64_t one = 1;
    ssize_t n = write(e->wake_fd, &one, sizeof one);
    (void)n; /* EAGAIN only when the counter is saturated: Python is already due to wake */
}

static void free_req(kvf_engine *e, kvf_req *r) {
    if (r->req != NULL && api.release_xfer_req(e->agent, r->req) == 0)
        api.destroy_xfer_req(r->req);
    free(r);
}

/* One pass of the progress thread: poll every watched request, then the notifications.
 * Returns how many events it produced. */
static int run_cmds(kvf_engine *e);

/* Engine thread: 1 pending, 0 done, < 0 failed. */
static int fence_state(kvf_engine *e, kvf_fence *f) {
    if (f->status != 0)
        return f->status;
    if (f->host != NULL) {
        int s = atomic_load(&f->host->state);
        return s == 0 ? 1 : (s > 0 ? 0 : s);
    }
    if (f->cu_ctx != NULL && f->cu_ctx != e->cu_ctx) { /* query in the event's own context */
        cu.ctx_set(f->cu_ctx);
        e->cu_ctx = f->cu_ctx;
    }
    int r = cu.event_query(f->cu_event);
    return r == CUDA_SUCCESS ? 0 : (r == CUDA_ERROR_NOT_READY ? 1 : FENCE_CUDA_BASE - r);
}

static void free_fence(kvf_fence *f) {
    fence_put(f->host); /* the engine's reference */
    free(f);
}

/* Engine thread: report every watched fence that finished or failed. Returns how many. */
static int poll_fences(kvf_engine *e) {
    int produced = 0;
    kvf_fence **link = &e->fences;
    while (*link != NULL) {
        kvf_fence *f = *link;
        int st = fence_state(e, f);
        atomic_fetch_add(&e->fence_polls, 1);
        if (st == 1) {
            link = &f->next;
            continue;
        }
        *link = f->next;
        if (!f->reported) {
            pthread_mutex_lock(&e->mu);
            emit_fence(e, f->cookie, st, f->watch_ns);
            pthread_mutex_unlock(&e->mu);
            produced++;
        }
        free_fence(f);
    }
    return produced;
}

static int progress_once(kvf_engine *e) {
    uint64_t emitted = emitted_count(e);
    int ran = run_cmds(e); /* refused posts come back as events, counted below */
    int produced = poll_fences(e);
    kvf_req **link = &e->watched;
    while (*link != NULL) {
        kvf_req *r = *link;
        capi_status st = r->done_at_post ? 0 : api.get_xfer_status(e->agent, r->req);
        atomic_fetch_add(&e->polls, 1);
        if (st == 1 || st == 2) { /* in progress (2: some entry failed; wait for the end) */
            link = &r->next;
            continue;
        }
        *link = r->next;
        if (!r->reported) {
            pthread_mutex_lock(&e->mu);
            emit_done(e, r->cookie, st == 0 ? 0 : (st > 0 ? -2 : st), r->post_ns);
            pthread_mutex_unlock(&e->mu);
            produced++;
        }
        free_req(e, r);
    }
    if (api.get_notifs(e->agent, e->notif_map, NULL) == 0) {
        size_t n = 0;
        api.notif_map_size(e->notif_map, &n);
        if (n > 0) {
            pthread_mutex_lock(&e->mu);
            for (size_t i = 0; i < n; i++) {
                const char *agent = NULL;
                size_t count = 0;
                if (api.notif_map_get_agent_at(e->notif_map, i, &agent) != 0 ||
                    api.notif_map_get_notifs_size(e->notif_map, agent, &count) != 0)
                    continue;
                for (size_t j = 0; j < count; j++) {
                    const void *data = NULL;
                    size_t len = 0;
                    if (api.notif_map_get_notif(e->notif_map, agent, j, &data, &len) != 0)
                        continue;
                    if (e->plant == PLANT_NOTIF_PREV) {
                        /* Planted bug: each notification delivered with the one before it. */
                        uint8_t *copy = malloc(len ? len : 1);
                        if (copy != NULL)
                            memcpy(copy, data, len);
                        if (e->prev_notif != NULL)
                            emit_notif(e, agent, e->prev_notif, e->prev_len);
                        else
                            emit_notif(e, agent, data, len);
                        free(e->prev_notif);
                        e->prev_notif = copy;
                        e->prev_len = len;
                    } else {
                        emit_notif(e, agent, data, len);
                    }
                    produced++;
                }
            }
            pthread_mutex_unlock(&e->mu);
            /* get_notifs appends to the map: clear it so nothing is delivered twice */
            api.notif_map_clear(e->notif_map);
        }
    }
    if (emitted_count(e) != emitted)
        wake(e);
    return produced + ran; /* anything done: go round again before sleeping */
}

static void *progress_main(void *arg) {
    kvf_engine *e = arg;
    uint64_t idle = e->idle_min_ns;
    while (!atomic_load(&e->stop)) {
        int produced = progress_once(e);
        bool busy = e->watched != NULL || e->fences != NULL || atomic_load(&e->hot);
        if (produced || busy) {
            idle = e->idle_min_ns; /* something in flight: keep the short pace */
        } else {
            idle = idle * 2 > e->idle_max_ns ? e->idle_max_ns : idle * 2;
        }
        if (produced)
            continue;
        if (busy && e->poll_ns == 0) {
            /* This thread never holds the interpreter: polling back to back costs a core while
             * something is in flight, not the host's Python threads. Yield to anyone runnable. */
            sched_yield();
            continue;
        }
        /* Sleep until the pace elapses or a caller hands over a post. */
        uint64_t wake_at = now_ns() + (busy ? e->poll_ns : idle);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t dl = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        dl = wake_at > dl ? wake_at : dl;
        ts.tv_sec = (time_t)(dl / 1000000000ull);
        ts.tv_nsec = (long)(dl % 1000000000ull);
        pthread_mutex_lock(&e->mu);
        if (e->cmd_head == NULL && !atomic_load(&e->stop))
            pthread_cond_timedwait(&e->cond, &e->mu, &ts);
        pthread_mutex_unlock(&e->mu);
    }
    return NULL;
}

static void set_err(char *err, size_t errlen, const char *what, capi_status st) {
    if (err != NULL && errlen > 0)
        snprintf(err, errlen, "%s failed (NIXL C API status %d)", what, st);
}

void kvf_destroy(kvf_engine *e);

/* An agent with the UCX backend, no NIXL progress or listener thread (this engine's thread polls),
 * sync mode as given (2: RW, the runtime's choice: several threads post). */
kvf_engine *kvf_create(const char *name, int sync_mode, unsigned ucx_workers, unsigned ucx_threads,
                       uint64_t poll_ns, uint64_t idle_max_ns, int plant, char *err, size_t errlen) {
    if (api_lib == NULL) {
        snprintf(err, errlen, "kvf_load() first");
        return NULL;
    }
    kvf_engine *e = calloc(1, sizeof *e);
    if (e == NULL)
        return NULL;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&e->done_cond, NULL);
    e->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    e->poll_ns = poll_ns;
    e->idle_min_ns = poll_ns ? poll_ns : 10000;
    e->idle_max_ns = idle_max_ns > e->idle_min_ns ? idle_max_ns : e->idle_min_ns;
    e->plant = plant;
    capi_agent_config cfg = {0};
    cfg.enable_prog_thread = false;
    cfg.enable_listen_thread = false;
    cfg.thread_sync = sync_mode;
    cfg.num_workers = ucx_workers;
    capi_status st = api.create_configured_agent(name, &cfg, &e->agent);
    if (st != 0 || e->wake_fd < 0) {
        set_err(err, errlen, "create_configured_agent", st);
        kvf_destroy(e);
        return NULL;
    }
    capi_handle mems = NULL, params = NULL;
    st = api.get_plugin_params(e->agent, "UCX", &mems, &params);
    if (st != 0) {
        set_err(err, errlen, "get_plugin_params(UCX)", st);
        kvf_destroy(e);
        return NULL;
    }
    char num[32];
    if (ucx_workers > 1) {
        snprintf(num, sizeof num, "%u", ucx_workers);
        api.params_add(params, "num_workers", num);
    }
    if (ucx_threads > 0) {
        snprintf(num, sizeof num, "%u", ucx_threads);
        api.params_add(params, "num_threads", num);
    }
    st = api.create_backend(e->agent, "UCX", params, &e->backend);
    api.destroy_mem_list(mems);
    api.destroy_params(params);
    if (st != 0) {
        set_err(err, errlen, "create_backend(UCX)", st);
        kvf_destroy(e);
        return NULL;
    }
    st = api.create_notif_map(&e->notif_map);
    if (st != 0) {
        set_err(err, errlen, "create_notif_map", st);
        kvf_destroy(e);
        return NULL;
    }
    if (pthread_create(&e->thread, NULL, progress_main, e) != 0) {
        snprintf(err, errlen, "cannot start the progress thread");
        kvf_destroy(e);
        return NULL;
    }
    e->thread_started = true;
    pthread_mutex_lock(&e->mu);
    e->accepting = true;
    pthread_mutex_unlock(&e->mu);
    return e;
}

/* Stop the progress thread, give back every request still watched (NIXL aborts what is in
 * flight), then the agent. Prepared lists, remote agents and memory are released by the caller
 * first (NIXL's teardown order); kvf_stop before those keeps the thread off the agent. */
static void run_cmd(kvf_engine *e, kvf_cmd *c, bool can_post);
static void free_ready(kvf_engine *e, kvf_ready *r);

void kvf_stop(kvf_engine *e) {
    if (e == NULL || !e->thread_started)
        return;
    atomic_store(&e->stop, true);
    pthread_mutex_lock(&e->mu);
    e->accepting = false; /* from here on, callers run their own commands */
    kvf_cmd *left = e->cmd_head;
    e->cmd_head = e->cmd_tail = NULL;
    atomic_store(&e->queued, false);
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    e->thread_started = false;
    while (left != NULL) { /* queued when the thread stopped: posts fail unposted, the rest run */
        kvf_cmd *next = left->next;
        run_cmd(e, left, false);
        left = next;
    }
    for (kvf_req *r = e->watched; r != NULL;) {
        kvf_req *next = r->next;
        pthread_mutex_lock(&e->mu);
        if (!r->reported)
            emit_done(e, r->cookie, -3, r->post_ns); /* never finished: failed at teardown */
        pthread_mutex_unlock(&e->mu);
        free_req(e, r);
        r = next;
    }
    e->watched = NULL;
    for (kvf_fence *f = e->fences; f != NULL;) { /* still pending: failed, the engine stopped */
        kvf_fence *next = f->next;
        pthread_mutex_lock(&e->mu);
        if (!f->reported)
            emit_fence(e, f->cookie, FENCE_STOPPED, f->watch_ns);
        pthread_mutex_unlock(&e->mu);
        free_fence(f);
        f = next;
    }
    e->fences = NULL;
    while (e->ready != NULL) { /* made ahead, never posted: given back before the agent goes */
        kvf_ready *r = e->ready;
        e->ready = r->next;
        free_ready(e, r);
    }
    wake(e);
}

void kvf_destroy(kvf_engine *e) {
    if (e == NULL)
        return;
    kvf_stop(e);
    if (e->notif_map != NULL)
        api.destroy_notif_map(e->notif_map);
    if (e->backend != NULL)
        api.destroy_backend(e->backend);
    if (e->agent != NULL)
        api.destroy_agent(e->agent);
    if (e->wake_fd >= 0)
        close(e->wake_fd);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cond);
    pthread_cond_destroy(&e->done_cond);
    free(e->events);
    free(e->prev_notif);
    free(e);
}

int kvf_wake_fd(kvf_engine *e) { return e->wake_fd; }

/* Address of the count of queued event bytes: the host reads it with a plain load and calls
 * kvf_drain only when it is not zero (no foreign call, no interpreter hand-off, on an empty poll). */
const _Atomic size_t *kvf_pending_addr(kvf_engine *e) { return &e->pending; }

/* The host expects notifications soon (a room it receives is in flight): poll at the in-flight
 * pace even with no transfer of its own to watch. */
void kvf_set_hot(kvf_engine *e, int hot) {
    if (atomic_exchange(&e->hot, hot != 0) == 0 && hot) {
        pthread_mutex_lock(&e->mu);
        pthread_cond_signal(&e->cond);
        pthread_mutex_unlock(&e->mu);
    }
}

/* Queued event bytes, without the lock (e->pending mirrors ev_len, stored under it). */
static size_t pending_events(kvf_engine *e) { return atomic_load(&e->pending); }

/* Wait (without the GIL: ctypes released it) until events are pending, `fd` is readable, or
 * timeout_us passed. `fd` (-1: none) is a non-blocking eventfd the caller sleeps on at the same
 * time (a runtime rank's one progress thread: its control plane's inbox wake-up); when it ends
 * the wait it is read here (reset), so the caller makes no call of its own for that and must look
 * at what it announces (the inbox) after every wait. Returns a mask: 1 engine events, 2 `fd`
 * readable; 0 on timeout. */
int kvf_wait_fd(kvf_engine *e, int fd, int64_t timeout_us) {
    if (pending_events(e))
        return 1;
    struct pollfd p[2] = {{.fd = e->wake_fd, .events = POLLIN}, {.fd = fd, .events = POLLIN}};
    /* ppoll: a timeout in microseconds (poll's milliseconds would stretch a 200 us idle cap of
     * the data thread, where copies are not watched here, to 1 ms). A negative fd is ignored. */
    uint64_t end = now_ns() + (uint64_t)(timeout_us > 0 ? timeout_us : 0) * 1000u;
    for (;;) {
        uint64_t now = now_ns();
        uint64_t left = end > now ? end - now : 0;
        struct timespec ts = {.tv_sec = (time_t)(left / 1000000000u), .tv_nsec = (long)(left % 1000000000u)};
        if (ppoll(p, 2, &ts, NULL) <= 0)
            return 0;
        int mask = 0;
        if (fd >= 0 && p[1].revents != 0) {
            uint64_t told;
            ssize_t r = read(fd, &told, sizeof told);
            (void)r;
            mask = 2;
        }
        if (pending_events(e))
            mask |= 1;
        if (mask)
            return mask;
        /* Readable with nothing queued: the events it announced were drained before the
         * engine's write reached the fd. Reset it, or every later wait would return at once
         * and its caller would spin until the next event. */
        uint64_t sink;
        ssize_t n = read(e->wake_fd, &sink, sizeof sink);
        (void)n;
        if (pending_events(e))
            return 1;
        if (left == 0)
            return 0;
    }
}

/* kvf_wait_fd on the engine's wake-up alone. Returns 1 when woken by events, 0 on timeout. */
int kvf_wait(kvf_engine *e, int64_t timeout_us) { return kvf_wait_fd(e, -1, timeout_us) != 0; }

/* Move up to cap bytes of whole events into buf. Returns the bytes written; *more is set when
 * events are left (buf too small). */
size_t kvf_drain(kvf_engine *e, uint8_t *buf, size_t cap, int *more) {
    uint64_t sink;
    ssize_t n = read(e->wake_fd, &sink, sizeof sink); /* reset the wake-up: we are reading now */
    (void)n;
    pthread_mutex_lock(&e->mu);
    size_t take = 0;
    while (take < e->ev_len) { /* whole events only */
        size_t sz;
        if (e->events[take] == EV_DONE || e->events[take] == EV_FENCE) {
            sz = 1 + 8 + 4 + 8 + 8;
        } else {
            uint32_t alen, plen;
            memcpy(&alen, e->events + take + 1, 4);
            memcpy(&plen, e->events + take + 5, 4);
            sz = 1 + 8 + (size_t)alen + plen;
        }
        if (take + sz > cap)
            break;
        take += sz;
    }
    memcpy(buf, e->events, take);
    memmove(e->events, e->events + take, e->ev_len - take);
    e->ev_len -= take;
    atomic_store(&e->pending, e->ev_len);
    *more = e->ev_len > 0;
    pthread_mutex_unlock(&e->mu);
    return take;
}

/* ---- memory and peers (caller threads) -------------------------------------------------------- */
capi_handle kvf_register(kvf_engine *e, int mem_type, size_t n, const uint64_t *addr,
                         const uint64_t *len, const uint64_t *dev, char *err, size_t errlen) {
    capi_handle dl = NULL;
    capi_status st = api.create_reg_dlist(mem_type, &dl);
    for (size_t i = 0; st == 0 && i < n; i++)
        st = api.reg_dlist_add_desc(dl, (uintptr_t)addr[i], (size_t)len[i], dev[i], NULL, 0);
    if (st == 0)
        st = api.register_mem(e->agent, dl, NULL);
    if (st != 0) {
        set_err(err, errlen, "register_mem", st);
        if (dl != NULL)
            api.destroy_reg_dlist(dl);
        return NULL;
    }
    return dl;
}

int kvf_deregister(kvf_engine *e, capi_handle dl) {
    capi_status st = api.deregister_mem(e->agent, dl, NULL);
    api.destroy_reg_dlist(dl);
    return st;
}

/* Local metadata; free the returned buffer with kvf_free. */
int kvf_local_md(kvf_engine *e, void **data, size_t *len) { return api.get_local_md(e->agent, data, len); }

void kvf_free(void *p) { free(p); }

/* Load a peer's metadata; *name (free with kvf_free) is its agent name. */
int kvf_load_remote(kvf_engine *e, const void *data, size_t len, char **name) {
    return api.load_remote_md(e->agent, data, len, name);
}

static capi_handle xfer_dlist(int mem_type, size_t n, const uint64_t *addr, const uint64_t *len,
                              const uint64_t *dev, capi_status *st) {
    capi_handle dl = NULL;
    *st = api.create_xfer_dlist(mem_type, &dl);
    for (size_t i = 0; *st == 0 && i < n; i++)
        *st = api.xfer_dlist_add_desc(dl, (uintptr_t)addr[i], (size_t)len[i], dev[i]);
    if (*st != 0 && dl != NULL) {
        api.destroy_xfer_dlist(dl);
        dl = NULL;
    }
    return dl;
}

/* A prepared descriptor list: agent "" for the local side, else the peer's agent name. */
capi_handle kvf_prep(kvf_engine *e, const char *agent, int mem_type, size_t n, const uint64_t *addr,
                     const uint64_t *len, const uint64_t *dev, char *err, size_t errlen) {
    capi_status st;
    capi_handle dl = xfer_dlist(mem_type, n, addr, len, dev, &st);
    capi_handle h = NULL;
    if (st == 0)
        st = api.prep_xfer_dlist(e->agent, agent, dl, &h, NULL);
    if (dl != NULL)
        api.destroy_xfer_dlist(dl);
    if (st != 0) {
        set_err(err, errlen, "prep_xfer_dlist", st);
        return NULL;
    }
    return h;
}

/* ---- commands: posting is one call; the engine's thread executes ---------------------------------
 * A caller's post only copies its arguments into a command and queues it: the engine's thread makes
 * the request, posts it and watches it, so one thread drives NIXL's data path (no contention for
 * the UCX worker between a poster and a poller) and commands run in the order they were given. A
 * post that NIXL refuses comes back as a failed completion. Releasing a prepared list, forgetting a
 * peer and sending a bare notification are queued the same way (so they cannot overtake a post
 * given before them) and the caller waits for their result. */
static capi_handle notif_args(const void *notif, size_t notif_len, capi_status *st) {
    capi_handle args = NULL;
    *st = 0;
    if (notif_len == 0)
        return NULL;
    *st = api.create_opt_args(&args);
    if (*st == 0)
        *st = api.opt_args_set_notif_msg(args, notif, notif_len);
    if (*st == 0)
        *st = api.opt_args_set_has_notif(args, true);
    return args;
}

static void free_cmd(kvf_cmd *c) {
    free(c->lidx);
    free(c->ridx);
    free(c->lrows);
    free(c->rrows);
    free(c->agent);
    free(c->notif);
    if (c->fence != NULL)
        free_fence(c->fence);
    free(c);
}

/* Engine thread: post a made request and watch it (or report the refusal). */
static void post_and_watch(kvf_engine *e, capi_handle req, capi_handle args, kvf_cmd *c) {
    capi_status st = api.post_xfer_req(e->agent, req, args);
    kvf_req *r = st < 0 ? NULL : calloc(1, sizeof *r);
    if (r == NULL) {
        if (st >= 0) /* no memory to watch it: see it through here rather than leak a live request */
            while (api.get_xfer_status(e->agent, req) == 1)
                ;
        if (api.release_xfer_req(e->agent, req) == 0)
            api.destroy_xfer_req(req);
        pthread_mutex_lock(&e->mu);
        emit_done(e, c->cookie, st < 0 ? st : -4, c->t0);
        pthread_mutex_unlock(&e->mu);
        return;
    }
    r->cookie = c->cookie;
    r->req = req;
    r->post_ns = c->t0;
    r->done_at_post = st == 0;
    atomic_fetch_add(&e->posts, 1);
    if (e->plant == PLANT_EARLY_DONE && !r->done_at_post) {
        /* Planted bug: the completion is reported now, before the transfer finished. */
        pthread_mutex_lock(&e->mu);
        emit_done(e, c->cookie, 0, c->t0);
        pthread_mutex_unlock(&e->mu);
        r->reported = true;
    }
    kvf_req **tail = &e->watched;
    while (*tail != NULL)
        tail = &(*tail)->next;
    *tail = r;
}

/* Engine thread: make c's request (kind `how`) and its notification arguments. */
static capi_status make_req(kvf_engine *e, kvf_cmd *c, int how, capi_handle *req, capi_handle *args) {
    capi_status st;
    capi_handle ld = NULL, rd = NULL;
    *req = NULL;
    *args = notif_args(c->notif, c->notif_len, &st);
    if (st == 0 && how == CMD_PREPPED) {
        st = api.make_xfer_req(e->agent, c->op, c->local, c->lidx, c->nl, c->remote, c->ridx, c->nr, req, *args);
    } else if (st == 0) {
        ld = xfer_dlist(c->lmem, c->nl, c->lrows, c->lrows + c->nl, c->lrows + 2 * c->nl, &st);
        rd = st == 0 ? xfer_dlist(c->rmem, c->nr, c->rrows, c->rrows + c->nr, c->rrows + 2 * c->nr, &st) : NULL;
        if (st == 0)
            st = api.create_xfer_req(e->agent, c->op, ld, rd, c->agent, req, *args);
    }
    if (ld != NULL)
        api.destroy_xfer_dlist(ld);
    if (rd != NULL)
        api.destroy_xfer_dlist(rd);
    return st;
}

static void run_post(kvf_engine *e, kvf_cmd *c) {
    capi_handle req, args;
    capi_status st = make_req(e, c, c->kind, &req, &args);
    if (st == 0) {
        post_and_watch(e, req, args, c);
    } else {
        pthread_mutex_lock(&e->mu);
        emit_done(e, c->cookie, st > 0 ? -2 : st, c->t0);
        pthread_mutex_unlock(&e->mu);
    }
    if (args != NULL)
        api.destroy_opt_args(args);
}

static void free_ready(kvf_engine *e, kvf_ready *r) {
    if (r->req != NULL && api.release_xfer_req(e->agent, r->req) == 0)
        api.destroy_xfer_req(r->req);
    if (r->args != NULL)
        api.destroy_opt_args(r->args);
    free(r);
}

/* Unlink the ready request `id` (NULL: none). */
static kvf_ready *take_ready(kvf_engine *e, uint64_t id) {
    for (kvf_ready **link = &e->ready; *link != NULL; link = &(*link)->next) {
        kvf_ready *r = *link;
        if (r->id == id) {
            *link = r->next;
            return r;
        }
    }
    return NULL;
}

/* Engine thread: make the request now; NIXL's refusal is kept and reported at the post. */
static void run_ready(kvf_engine *e, kvf_cmd *c) {
    kvf_ready *r = calloc(1, sizeof *r);
    if (r == NULL)
        return; /* not kept: its post reports it unknown (-5) */
    r->id = c->cookie;
    capi_status st = make_req(e, c, c->how, &r->req, &r->args);
    if (st != 0) {
        if (r->req != NULL && api.release_xfer_req(e->agent, r->req) == 0)
            api.destroy_xfer_req(r->req);
        r->req = NULL;
        r->status = st > 0 ? -2 : st;
    }
    r->next = e->ready;
    e->ready = r;
}

/* Engine thread: post a request made ahead (unknown id: -5; refused when made: its status). */
static void run_post_ready(kvf_engine *e, kvf_cmd *c) {
    uint64_t id = c->ready;
    if (e->plant == PLANT_READY_LIFO && e->ready != NULL)
        id = e->ready->id; /* planted bug: the request made last is posted, whichever was named */
    kvf_ready *r = take_ready(e, id);
    if (r == NULL || r->req == NULL) {
        pthread_mutex_lock(&e->mu);
        emit_done(e, c->cookie, r == NULL ? -5 : r->status, c->t0);
        pthread_mutex_unlock(&e->mu);
    } else {
        capi_handle req = r->req;
        r->req = NULL; /* watched from here on: post_and_watch owns it */
        post_and_watch(e, req, r->args, c);
    }
    if (r != NULL)
        free_ready(e, r);
}

/* Any thread (the engine's, or a caller's once the engine stopped). */
static void run_cmd(kvf_engine *e, kvf_cmd *c, bool can_post) {
    int result = 0;
    switch (c->kind) {
    case CMD_PREPPED:
    case CMD_DESCS:
        if (can_post) {
            run_post(e, c);
        } else { /* the engine stopped before posting it: failed, never posted */
            pthread_mutex_lock(&e->mu);
            emit_done(e, c->cookie, -3, c->t0);
            pthread_mutex_unlock(&e->mu);
        }
        break;
    case CMD_READY:
        if (can_post)
            run_ready(e, c);
        break;
    case CMD_POST_READY:
        if (can_post) {
            run_post_ready(e, c);
        } else {
            pthread_mutex_lock(&e->mu);
            emit_done(e, c->cookie, -3, c->t0);
            pthread_mutex_unlock(&e->mu);
        }
        break;
    case CMD_DROP_READY: {
        kvf_ready *r = take_ready(e, c->cookie);
        if (r != NULL)
            free_ready(e, r);
        break;
    }
    case CMD_WATCH: {
        kvf_fence *f = c->fence;
        c->fence = NULL;
        if (!can_post) { /* the engine stopped before watching it */
            pthread_mutex_lock(&e->mu);
            emit_fence(e, f->cookie, FENCE_STOPPED, f->watch_ns);
            pthread_mutex_unlock(&e->mu);
            free_fence(f);
            break;
        }
        if (e->plant == PLANT_FENCE_EARLY && f->status == 0) {
            /* Planted bug: the copy is reported done when it is watched, before it finished. */
            pthread_mutex_lock(&e->mu);
            emit_fence(e, f->cookie, 0, f->watch_ns);
            pthread_mutex_unlock(&e->mu);
            f->reported = true;
        }
        kvf_fence **tail = &e->fences;
        while (*tail != NULL)
            tail = &(*tail)->next;
        *tail = f;
        break;
    }
    case CMD_RELEASE_PREP:
        result = api.release_xfer_dlist_handle(e->agent, c->local);
        break;
    case CMD_REMOVE_REMOTE:
        result = api.invalidate_remote_md(e->agent, c->agent);
        break;
    case CMD_GEN_NOTIF:
        result = api.gen_notif(e->agent, c->agent, c->notif, c->notif_len, NULL);
        break;
    }
    if (!c->sync) {
        free_cmd(c);
        return;
    }
    pthread_mutex_lock(&e->mu);
    c->result = result;
    c->done = true;
    pthread_cond_broadcast(&e->done_cond);
    pthread_mutex_unlock(&e->mu);
}

/* Engine thread: run every queued command, in order. Returns how many ran. */
static int run_cmds(kvf_engine *e) {
    /* Peek first: the thread comes here on every pass while it polls back to back, and taking the
     * lock each time would make a caller's post wait whenever this thread is preempted holding it
     * (on a busy host, a whole time slice with the caller's GIL held). */
    if (!atomic_load(&e->queued))
        return 0;
    pthread_mutex_lock(&e->mu);
    kvf_cmd *c = e->cmd_head;
    e->cmd_head = e->cmd_tail = NULL;
    atomic_store(&e->queued, false);
    pthread_mutex_unlock(&e->mu);
    int n = 0;
    while (c != NULL) {
        kvf_cmd *next = c->next;
        run_cmd(e, c, true);
        c = next;
        n++;
    }
    return n;
}

/* Queue c; a sync command waits for its result (the caller dropped the GIL: ctypes). Once the
 * engine stopped, the caller runs it itself (teardown releases lists after kvf_stop). */
static int enqueue(kvf_engine *e, kvf_cmd *c) {
    c->t0 = now_ns();
    pthread_mutex_lock(&e->mu);
    if (!e->accepting) {
        pthread_mutex_unlock(&e->mu);
        bool sync = c->sync;
        c->sync = true; /* keep it until its result is read */
        run_cmd(e, c, false);
        int result = c->result;
        free_cmd(c);
        return sync ? result : 0;
    }
    if (e->cmd_tail != NULL)
        e->cmd_tail->next = c;
    else
        e->cmd_head = c;
    e->cmd_tail = c;
    atomic_store(&e->queued, true);
    pthread_cond_signal(&e->cond);
    if (!c->sync) {
        pthread_mutex_unlock(&e->mu);
        return 0;
    }
    while (!c->done)
        pthread_cond_wait(&e->done_cond, &e->mu);
    pthread_mutex_unlock(&e->mu);
    int result = c->result;
    free_cmd(c);
    return result;
}

static void *dup_bytes(const void *src, size_t n) {
    void *p = malloc(n ? n : 1);
    if (p != NULL && n)
        memcpy(p, src, n);
    return p;
}

static uint64_t *rows_of(size_t n, const uint64_t *addr, const uint64_t *len, const uint64_t *dev) {
    uint64_t *rows = malloc(3 * (n ? n : 1) * sizeof *rows);
    if (rows != NULL && n) {
        memcpy(rows, addr, n * sizeof *rows);
        memcpy(rows + n, len, n * sizeof *rows);
        memcpy(rows + 2 * n, dev, n * sizeof *rows);
    }
    return rows;
}

/* A command carrying a copy of its notification (empty: none); NULL when out of memory. */
static kvf_cmd *new_cmd(int kind, int op, uint64_t cookie, const void *notif, size_t notif_len) {
    kvf_cmd *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->kind = kind;
    c->op = op;
    c->cookie = cookie;
    c->notif_len = notif_len;
    c->notif = dup_bytes(notif, notif_len);
    if (c->notif == NULL) {
        free(c);
        return NULL;
    }
    return c;
}

/* Queue c if every copy it needed was made; else -4 (no memory, nothing queued). */
static int queue_or_drop(kvf_engine *e, kvf_cmd *c, bool copied) {
    if (!copied) {
        free_cmd(c);
        return -4;
    }
    return enqueue(e, c);
}

static kvf_cmd *prepped_cmd(int kind, int op, capi_handle local, const int *lidx, size_t nl, capi_handle remote,
                            const int *ridx, size_t nr, const void *notif, size_t notif_len, uint64_t cookie,
                            bool *copied) {
    kvf_cmd *c = new_cmd(kind, op, cookie, notif, notif_len);
    if (c == NULL)
        return NULL;
    c->how = CMD_PREPPED;
    c->local = local;
    c->remote = remote;
    c->nl = nl;
    c->nr = nr;
    c->lidx = dup_bytes(lidx, nl * sizeof(int));
    c->ridx = dup_bytes(ridx, nr * sizeof(int));
    *copied = c->lidx != NULL && c->ridx != NULL;
    return c;
}

static kvf_cmd *descs_cmd(int kind, int op, const char *agent, int lmem, size_t n, const uint64_t *laddr,
                          const uint64_t *llen, const uint64_t *ldev, int rmem, size_t m, const uint64_t *raddr,
                          const uint64_t *rlen, const uint64_t *rdev, const void *notif, size_t notif_len,
                          uint64_t cookie, bool *copied) {
    kvf_cmd *c = new_cmd(kind, op, cookie, notif, notif_len);
    if (c == NULL)
        return NULL;
    c->how = CMD_DESCS;
    c->lmem = lmem;
    c->rmem = rmem;
    c->nl = n;
    c->nr = m;
    c->lrows = rows_of(n, laddr, llen, ldev);
    c->rrows = rows_of(m, raddr, rlen, rdev);
    c->agent = strdup(agent);
    *copied = c->lrows != NULL && c->rrows != NULL && c->agent != NULL;
    return c;
}

/* Post a transfer between prepared lists (index runs). Returns 0: queued (its end comes as an
 * event with `cookie`), or -4: no memory (nothing queued). */
int kvf_post_prepped(kvf_engine *e, int op, capi_handle local, const int *lidx, size_t nl, capi_handle remote,
                     const int *ridx, size_t nr, const void *notif, size_t notif_len, uint64_t cookie) {
    bool copied = false;
    kvf_cmd *c = prepped_cmd(CMD_PREPPED, op, local, lidx, nl, remote, ridx, nr, notif, notif_len, cookie, &copied);
    return c == NULL ? -4 : queue_or_drop(e, c, copied);
}

/* Post a transfer of descriptors given here (one-shot): same contract as kvf_post_prepped. */
int kvf_post_descs(kvf_engine *e, int op, const char *agent, int lmem, size_t n, const uint64_t *laddr,
                   const uint64_t *llen, const uint64_t *ldev, int rmem, size_t m, const uint64_t *raddr,
                   const uint64_t *rlen, const uint64_t *rdev, const void *notif, size_t notif_len,
                   uint64_t cookie) {
    bool copied = false;
    kvf_cmd *c = descs_cmd(CMD_DESCS, op, agent, lmem, n, laddr, llen, ldev, rmem, m, raddr, rlen, rdev, notif,
                           notif_len, cookie, &copied);
    return c == NULL ? -4 : queue_or_drop(e, c, copied);
}

/* Make ahead: the same arguments as kvf_post_prepped / kvf_post_descs, with `id` for the cookie.
 * The engine's thread makes the request now (NIXL's make/create) and keeps it under `id`;
 * kvf_post_ready posts it, kvf_drop_ready gives it back. 0 queued, -4 no memory. */
int kvf_ready_prepped(kvf_engine *e, int op, capi_handle local, const int *lidx, size_t nl, capi_handle remote,
                      const int *ridx, size_t nr, const void *notif, size_t notif_len, uint64_t id) {
    bool copied = false;
    kvf_cmd *c = prepped_cmd(CMD_READY, op, local, lidx, nl, remote, ridx, nr, notif, notif_len, id, &copied);
    return c == NULL ? -4 : queue_or_drop(e, c, copied);
}

int kvf_ready_descs(kvf_engine *e, int op, const char *agent, int lmem, size_t n, const uint64_t *laddr,
                    const uint64_t *llen, const uint64_t *ldev, int rmem, size_t m, const uint64_t *raddr,
                    const uint64_t *rlen, const uint64_t *rdev, const void *notif, size_t notif_len, uint64_t id) {
    bool copied = false;
    kvf_cmd *c = descs_cmd(CMD_READY, op, agent, lmem, n, laddr, llen, ldev, rmem, m, raddr, rlen, rdev, notif,
                           notif_len, id, &copied);
    return c == NULL ? -4 : queue_or_drop(e, c, copied);
}

/* Post the request made ahead under `id`: one small command, no argument copied. Its end comes
 * as an event with `cookie` (an id never made or already posted: status -5). 0 queued, -4. */
int kvf_post_ready(kvf_engine *e, uint64_t id, uint64_t cookie) {
    kvf_cmd *c = new_cmd(CMD_POST_READY, 0, cookie, NULL, 0);
    if (c == NULL)
        return -4;
    c->ready = id;
    return enqueue(e, c);
}

/* Give back the request made ahead under `id`, unposted (queued: it cannot overtake its make). */
int kvf_drop_ready(kvf_engine *e, uint64_t id) {
    kvf_cmd *c = new_cmd(CMD_DROP_READY, 0, id, NULL, 0);
    return c == NULL ? -4 : enqueue(e, c);
}

static int sync_cmd(kvf_engine *e, int kind, capi_handle h, const char *agent, const void *data, size_t len) {
    kvf_cmd *c = new_cmd(kind, 0, 0, data, len);
    if (c == NULL)
        return -4;
    c->sync = true;
    c->local = h;
    c->agent = agent != NULL ? strdup(agent) : NULL;
    return queue_or_drop(e, c, agent == NULL || c->agent != NULL);
}

int kvf_release_prep(kvf_engine *e, capi_handle h) { return sync_cmd(e, CMD_RELEASE_PREP, h, NULL, NULL, 0); }

int kvf_remove_remote(kvf_engine *e, const char *name) {
    return sync_cmd(e, CMD_REMOVE_REMOTE, NULL, name, NULL, 0);
}

int kvf_gen_notif(kvf_engine *e, const char *agent, const void *data, size_t len) {
    return sync_cmd(e, CMD_GEN_NOTIF, NULL, agent, data, len);
}

/* Counters: polls of NIXL request status, posts, completion events, notification events. */
void kvf_counters(kvf_engine *e, uint64_t out[4]) {
    out[0] = atomic_load(&e->polls);
    out[1] = atomic_load(&e->posts);
    out[2] = atomic_load(&e->completions);
    out[3] = atomic_load(&e->notifs);
}

/* ---- fences: copies watched on the engine's thread ------------------------------------------- */
/* A host fence, pending, with one reference: the caller's (give it back with kvf_fence_put once
 * signalled). NULL when out of memory. */
kvf_hostfence *kvf_fence_new(void) {
    kvf_hostfence *f = calloc(1, sizeof *f);
    if (f != NULL)
        atomic_store(&f->refs, 1);
    return f;
}

/* The host copy finished (status 0) or failed (< 0; anything else: FENCE_HOST_FAILED). Once. */
void kvf_fence_signal(kvf_hostfence *f, int status) {
    atomic_store(&f->state, status == 0 ? 1 : (status < 0 ? status : FENCE_HOST_FAILED));
}

void kvf_fence_put(kvf_hostfence *f) { fence_put(f); }

static int watch(kvf_engine *e, kvf_fence *f, uint64_t cookie) {
    kvf_cmd *c = new_cmd(CMD_WATCH, 0, cookie, NULL, 0);
    if (c == NULL) {
        free_fence(f);
        return -4;
    }
    f->cookie = cookie;
    f->watch_ns = now_ns();
    c->fence = f;
    return enqueue(e, c);
}

/* Watch host fence f: its end comes as a fence event with `cookie`. The engine takes its own
 * reference (the caller keeps and puts its own). 0 queued, -4 no memory (nothing watched). */
int kvf_watch_host(kvf_engine *e, kvf_hostfence *f, uint64_t cookie) {
    kvf_fence *w = calloc(1, sizeof *w);
    if (w == NULL)
        return -4;
    atomic_fetch_add(&f->refs, 1);
    w->host = f;
    return watch(e, w, cookie);
}

/* Watch CUDA event `event` (a CUevent, recorded in the caller's current context): done once
 * cuEventQuery says so. The event must stay alive until its fence event is drained. Without
 * libcuda the watch is reported failed (FENCE_NO_CUDA). 0 queued, -4 no memory. */
int kvf_watch_cuda(kvf_engine *e, uint64_t event, uint64_t cookie) {
    kvf_fence *w = calloc(1, sizeof *w);
    if (w == NULL)
        return -4;
    w->cu_event = (void *)(uintptr_t)event;
    if (cuda_load() != 0 || cu.ctx_get(&w->cu_ctx) != CUDA_SUCCESS)
        w->status = FENCE_NO_CUDA;
    return watch(e, w, cookie);
}

/* Counters of the fences: cuEventQuery or host-flag reads, fence events emitted. */
void kvf_fence_counters(kvf_engine *e, uint64_t out[2]) {
    out[0] = atomic_load(&e->fence_polls);
    out[1] = atomic_load(&e->fence_events);
}
