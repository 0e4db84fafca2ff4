"""eBPF probes on the CUDA runtime and driver APIs, seen from outside the process (bcc).

Uprobes and uretprobes on libcudart/libcuda aggregate in kernel maps, per (pid, API):
calls, errors by return code, bytes, and a log2 latency histogram. User space reads the
maps once per tick; there is no per-call event unless asked for (``events=True``, for
short investigations, with a drop counter that is always reported). Besides the
counters the kernel keeps:

- outstanding allocations (address -> bytes, user stack, time) between an allocation
  and its free, so memory never freed is reported by call stack with bytes and age;
- per kernel function, a histogram of grid sizes and the exact launch shapes, with
  launches of grid (1,1,1) counted apart with a sampled stack;
- off-CPU and run-queue time per thread of the probed processes (sched_switch), OOM
  kills (oom:mark_victim), and the opening of a CUDA library by a probed process
  (syscalls:openat), so a library loaded late is probed at once. A command started by
  the probe is stopped at that moment until the uprobes are in place, so none of its
  calls is missed.

Cost (see bench/bench_ebpf.py): each hooked call takes a trap on entry and one on
return, microseconds on virtual machines. Allocation, copy and synchronisation calls are
rare enough for that; kernel launches are not (millions per second under load), so
launch probing is a switch (``launches``) and the output says which APIs are attached.

Allocations and launches are those seen since the probe attached; a free of memory
allocated before that is counted but has no size.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.probes import cuda_libs, ebpf_readiness
from gpudiag.probes.cuda_libs import DRIVER, RUNTIME, CudaLibrary
from gpudiag.probes.kube_cgroup import read_identity

log = logging.getLogger(__name__)

BPF_PROGRAM = r"""
#include <uapi/linux/ptrace.h>

/* LAT_SLOTS, GRID_SLOTS, FLAG_STOP_ON_LOAD and the DROP_* reasons come from Python. */
#define NAME_BYTES 128
#define PATH_BYTES 256
#define SIGSTOP_NR 19

enum shape { SHAPE_PLAIN, SHAPE_ALLOC, SHAPE_FREE, SHAPE_COPY, SHAPE_LAUNCH, SHAPE_GET_FUNCTION };

struct proc_info { u32 flags; u32 pad; };
struct call_key { u64 pid_tgid; u32 api; u32 pad; };
struct call { u64 ts; u64 sp; u64 ptr; u64 bytes; u64 func; u32 grid[3]; u32 block[3];
              u32 shmem; u32 kind; };
struct stats_key { u32 tgid; u32 api; };
struct api_stats { u64 calls; u64 errors; u64 bytes; u64 failed_bytes; u64 latency_sum_ns; u64 untimed;
                   u64 latency[LAT_SLOTS]; };
struct error_key { u32 tgid; u32 api; s32 code; u32 pad; };
struct copy_key { u32 tgid; u32 api; u32 kind; u32 pad; };
struct copy_stats { u64 calls; u64 bytes; };
struct alloc_key { u32 tgid; u32 pad; u64 addr; };
struct allocation { u64 bytes; u64 ts; s64 stack_id; u32 api; u32 pad; };
struct shape_key { u32 tgid; u32 shmem; u64 func; u32 grid[3]; u32 block[3]; };
struct grid_key { u32 tgid; u32 slot; u64 func; };
struct func_key { u32 tgid; u32 api; u64 func; };
struct degenerate { u64 count; s64 stack_id; };
struct func_name { char name[NAME_BYTES]; };
struct thread_key { u32 tgid; u32 tid; };
struct offcpu { u64 offcpu_ns; u64 runqueue_ns; u64 switches; };
struct offstart { u64 ts; u32 tgid; u32 runnable; };
struct library_open { u64 ts; s64 fd; };
struct oom_kill { u64 ts; u64 anon_rss_pages; u32 uid; u32 pad; char comm[16]; };
struct event { u64 ts; u64 latency_ns; u64 bytes; u64 addr; u32 tgid; u32 tid; u32 api;
               s32 ret; u32 grid[3]; u32 block[3]; u32 kind; s32 stack_id; };

BPF_HASH(probed, u32, struct proc_info, 65536);
BPF_HASH(inflight, struct call_key, struct call, 65536);
BPF_HASH(stats, struct stats_key, struct api_stats, 4096);
BPF_ARRAY(zero_stats, struct api_stats, 1);
BPF_HASH(errors, struct error_key, u64, 4096);
BPF_HASH(copies, struct copy_key, struct copy_stats, 4096);
BPF_HASH(outstanding, struct alloc_key, struct allocation, 262144);
BPF_HASH(outstanding_bytes, u32, s64, 4096);
BPF_HASH(launch_shapes, struct shape_key, u64, 16384);
BPF_HASH(launch_grids, struct grid_key, u64, 16384);
BPF_HASH(degenerate_launches, struct func_key, struct degenerate, 4096);
BPF_HASH(function_names, struct func_key, struct func_name, 16384);
BPF_STACK_TRACE(stacks, 16384);
BPF_ARRAY(drops, u64, DROP_SLOTS);
BPF_ARRAY(enabled, u64, 1);   /* 0 once user space is detaching: everything becomes a no-op */
#if EVENTS
BPF_RINGBUF_OUTPUT(events, EVENT_PAGES);
#endif

static __always_inline void count_drop(u32 reason) {
    u64 *v = drops.lookup(&reason);
    if (v) __sync_fetch_and_add(v, 1);
}

static __always_inline int is_enabled(void) {
    int z = 0;
    u64 *on = enabled.lookup(&z);
    return on && *on;
}

static __always_inline int probed_process(u32 tgid) {
    if (!is_enabled() || tgid == SELF_PID) return 0;   /* never the probe itself */
    if (probed.lookup(&tgid)) return 1;
#if PROBE_ALL_PIDS
    struct proc_info fresh = {};
    probed.update(&tgid, &fresh);
    return 1;
#else
    return 0;
#endif
}

/* ---- entry: remember the arguments until the call returns ---- */

static __always_inline int begin(struct pt_regs *ctx, u32 api, struct call *c) {
    struct call_key k = {.pid_tgid = bpf_get_current_pid_tgid(), .api = api};
    u64 sp = PT_REGS_SP(ctx);
    struct call *outer = inflight.lookup(&k);
    if (outer && sp < outer->sp) return 0;   /* a variant of this API called from inside it */
    c->ts = bpf_ktime_get_ns();
    c->sp = sp;
    if (inflight.update(&k, c) != 0) count_drop(DROP_INFLIGHT);
    return 0;
}

#define WANTED() if (!probed_process(bpf_get_current_pid_tgid() >> 32)) return 0

static __always_inline int enter_plain(struct pt_regs *ctx, u32 api) {
    WANTED();
    struct call c = {};
    return begin(ctx, api, &c);
}

static __always_inline int enter_alloc(struct pt_regs *ctx, u32 api) {   /* (void **out, size_t) */
    WANTED();
    struct call c = {};
    c.ptr = PT_REGS_PARM1(ctx);
    c.bytes = PT_REGS_PARM2(ctx);
    return begin(ctx, api, &c);
}

static __always_inline int enter_free(struct pt_regs *ctx, u32 api) {    /* (void *ptr, ...) */
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!probed_process(tgid)) return 0;
    struct call c = {};
    c.ptr = PT_REGS_PARM1(ctx);
    struct alloc_key k = {.tgid = tgid, .addr = c.ptr};
    struct allocation *a = c.ptr ? outstanding.lookup(&k) : 0;
    if (a) c.bytes = a->bytes;
    return begin(ctx, api, &c);
}

static __always_inline int enter_copy(struct pt_regs *ctx, u32 api, u32 fixed_kind) {
    WANTED();                               /* (dst, src, size_t count[, kind]) */
    struct call c = {};
    c.bytes = PT_REGS_PARM3(ctx);
    c.kind = fixed_kind ? fixed_kind : (u32)PT_REGS_PARM4(ctx);
    return begin(ctx, api, &c);
}

/* cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shmem, stream):
   each 12-byte dim3 travels in two registers (x|y<<32, z); shmem is the first stack slot. */
static __always_inline int enter_launch_runtime(struct pt_regs *ctx, u32 api) {
    WANTED();
    struct call c = {};
    u64 grid_xy = PT_REGS_PARM2(ctx), block_xy = PT_REGS_PARM4(ctx), shmem = 0;
    c.func = PT_REGS_PARM1(ctx);
    c.grid[0] = grid_xy; c.grid[1] = grid_xy >> 32; c.grid[2] = PT_REGS_PARM3(ctx);
    c.block[0] = block_xy; c.block[1] = block_xy >> 32; c.block[2] = PT_REGS_PARM5(ctx);
    bpf_probe_read_user(&shmem, sizeof(shmem), (void *)(PT_REGS_SP(ctx) + 8));
    c.shmem = shmem;
    return begin(ctx, api, &c);
}

/* cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra): bz and shmem are
   the first two stack slots. */
static __always_inline int enter_launch_driver(struct pt_regs *ctx, u32 api) {
    WANTED();
    struct call c = {};
    u64 slots[2] = {};
    c.func = PT_REGS_PARM1(ctx);
    c.grid[0] = PT_REGS_PARM2(ctx); c.grid[1] = PT_REGS_PARM3(ctx); c.grid[2] = PT_REGS_PARM4(ctx);
    c.block[0] = PT_REGS_PARM5(ctx); c.block[1] = PT_REGS_PARM6(ctx);
    bpf_probe_read_user(slots, sizeof(slots), (void *)(PT_REGS_SP(ctx) + 8));
    c.block[2] = slots[0];
    c.shmem = slots[1];
    return begin(ctx, api, &c);
}

/* cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, ...): the config starts with
   gridDimX..Z, blockDimX..Z, sharedMemBytes. */
static __always_inline int enter_launch_ex(struct pt_regs *ctx, u32 api) {
    WANTED();
    struct call c = {};
    u32 dims[7] = {};
    bpf_probe_read_user(dims, sizeof(dims), (void *)PT_REGS_PARM1(ctx));
    c.func = PT_REGS_PARM2(ctx);
    c.grid[0] = dims[0]; c.grid[1] = dims[1]; c.grid[2] = dims[2];
    c.block[0] = dims[3]; c.block[1] = dims[4]; c.block[2] = dims[5];
    c.shmem = dims[6];
    return begin(ctx, api, &c);
}

/* cuModuleGetFunction(CUfunction *out, CUmodule, const char *name): names launch handles. */
static __always_inline int enter_get_function(struct pt_regs *ctx, u32 api) {
    WANTED();
    struct call c = {};
    c.ptr = PT_REGS_PARM1(ctx);
    c.func = PT_REGS_PARM3(ctx);
    return begin(ctx, api, &c);
}

/* ---- return: aggregate ---- */

/* One call ending; ``timed``: its entry was seen, so its latency and arguments are known. */
static __always_inline void account(u32 tgid, u32 api, s32 ret, u64 latency, u64 bytes, int timed) {
    struct stats_key k = {.tgid = tgid, .api = api};
    struct api_stats *s = stats.lookup(&k);
    if (!s) {
        int z = 0;
        struct api_stats *zero = zero_stats.lookup(&z);
        if (!zero) return;
        stats.insert(&k, zero);
        s = stats.lookup(&k);
        if (!s) { count_drop(DROP_STATS); return; }
    }
    __sync_fetch_and_add(&s->calls, 1);
    if (timed) {
        u32 slot = bpf_log2l(latency);
        if (slot >= LAT_SLOTS) slot = LAT_SLOTS - 1;
        __sync_fetch_and_add(&s->bytes, bytes);
        __sync_fetch_and_add(&s->latency_sum_ns, latency);
        __sync_fetch_and_add(&s->latency[slot], 1);
    } else {
        __sync_fetch_and_add(&s->untimed, 1);
    }
    if (ret == 0) return;
    __sync_fetch_and_add(&s->errors, 1);
    __sync_fetch_and_add(&s->failed_bytes, bytes);
    struct error_key ek = {.tgid = tgid, .api = api, .code = ret};
    u64 one = 1, *n = errors.lookup(&ek);
    if (!n && errors.insert(&ek, &one) == 0) return;
    n = n ? n : errors.lookup(&ek);
    if (n) __sync_fetch_and_add(n, 1); else count_drop(DROP_STATS);
}

static __always_inline void count_copy(u32 tgid, u32 api, u32 kind, u64 bytes) {
    struct copy_key k = {.tgid = tgid, .api = api, .kind = kind};
    struct copy_stats fresh = {.calls = 1, .bytes = bytes}, *s = copies.lookup(&k);
    if (!s && copies.insert(&k, &fresh) == 0) return;
    s = s ? s : copies.lookup(&k);
    if (!s) { count_drop(DROP_STATS); return; }
    __sync_fetch_and_add(&s->calls, 1);
    __sync_fetch_and_add(&s->bytes, bytes);
}

static __always_inline void add_outstanding(u32 tgid, s64 bytes) {
    s64 *total = outstanding_bytes.lookup(&tgid);
    if (!total && outstanding_bytes.insert(&tgid, &bytes) == 0) return;
    total = total ? total : outstanding_bytes.lookup(&tgid);
    if (total) __sync_fetch_and_add(total, bytes);
}

static __always_inline u64 record_allocation(struct pt_regs *ctx, u32 tgid, u32 api,
                                             struct call *c, u64 now) {
    u64 addr = 0;
    if (bpf_probe_read_user(&addr, sizeof(addr), (void *)c->ptr) != 0 || addr == 0) return 0;
    struct alloc_key k = {.tgid = tgid, .addr = addr};
    if (outstanding.lookup(&k)) return addr;   /* the driver call inside a runtime one */
    struct allocation a = {.bytes = c->bytes, .ts = now, .api = api};
    a.stack_id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (a.stack_id < 0) count_drop(DROP_STACKS);
    if (outstanding.insert(&k, &a) != 0) { count_drop(DROP_OUTSTANDING); return addr; }
    add_outstanding(tgid, c->bytes);
    return addr;
}

static __always_inline void release_allocation(u32 tgid, struct call *c) {
    struct alloc_key k = {.tgid = tgid, .addr = c->ptr};
    struct allocation *a = c->ptr ? outstanding.lookup(&k) : 0;
    if (!a) return;
    s64 bytes = a->bytes;
    outstanding.delete(&k);
    add_outstanding(tgid, -bytes);
}

static __always_inline void record_launch(struct pt_regs *ctx, u32 tgid, u32 api, struct call *c) {
    struct shape_key sk = {.tgid = tgid, .shmem = c->shmem, .func = c->func};
    sk.grid[0] = c->grid[0]; sk.grid[1] = c->grid[1]; sk.grid[2] = c->grid[2];
    sk.block[0] = c->block[0]; sk.block[1] = c->block[1]; sk.block[2] = c->block[2];
    u64 one = 1, *n = launch_shapes.lookup(&sk);
    if (n || launch_shapes.insert(&sk, &one) != 0) {
        n = n ? n : launch_shapes.lookup(&sk);
        if (n) __sync_fetch_and_add(n, 1); else count_drop(DROP_LAUNCHES);
    }
    u64 blocks = (u64)c->grid[0] * c->grid[1] * c->grid[2];
    struct grid_key gk = {.tgid = tgid, .slot = bpf_log2l(blocks), .func = c->func};
    if (gk.slot >= GRID_SLOTS) gk.slot = GRID_SLOTS - 1;
    n = launch_grids.lookup(&gk);
    if (n || launch_grids.insert(&gk, &one) != 0) {
        n = n ? n : launch_grids.lookup(&gk);
        if (n) __sync_fetch_and_add(n, 1); else count_drop(DROP_LAUNCHES);
    }
    if (blocks != 1) return;
    struct func_key fk = {.tgid = tgid, .api = api, .func = c->func};
    struct degenerate fresh = {.count = 0, .stack_id = -1}, *d = degenerate_launches.lookup(&fk);
    if (!d) { degenerate_launches.insert(&fk, &fresh); d = degenerate_launches.lookup(&fk); }
    if (!d) { count_drop(DROP_LAUNCHES); return; }
    u64 seen = __sync_fetch_and_add(&d->count, 1) + 1;
    if ((seen & (seen - 1)) == 0)   /* sample the stack at the 1st, 2nd, 4th, 8th ... launch */
        d->stack_id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
}

static __always_inline void record_function_name(u32 tgid, struct call *c) {
    struct func_key fk = {.tgid = tgid};
    if (bpf_probe_read_user(&fk.func, sizeof(fk.func), (void *)c->ptr) != 0 || !fk.func) return;
    struct func_name n = {};
    bpf_probe_read_user_str(n.name, sizeof(n.name), (void *)c->func);
    function_names.update(&fk, &n);
}

static __always_inline int finish(struct pt_regs *ctx, u32 api, int shape) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    struct call_key k = {.pid_tgid = id, .api = api};
    struct call *open = inflight.lookup(&k);
    if (!open) {
        /* A return whose entry was not seen: a call already running when the probe attached or
           the process was added, or one whose entry program the kernel did not run (seen on 6.18
           at full call rate: the return program ran for every cuLaunchKernel of a process, the
           entry program for none). The call happened: counted, untimed. */
        if (probed_process(tgid)) account(tgid, api, PT_REGS_RC(ctx), 0, 0, 0);
        return 0;
    }
    if (PT_REGS_SP(ctx) <= open->sp) return 0;   /* the inner variant returning */
    struct call c = *open;
    inflight.delete(&k);
    u64 now = bpf_ktime_get_ns(), addr = c.ptr;
    s32 ret = PT_REGS_RC(ctx);
    account(tgid, api, ret, now - c.ts, c.bytes, 1);
    if (shape == SHAPE_ALLOC) addr = ret == 0 ? record_allocation(ctx, tgid, api, &c, now) : 0;
    if (shape == SHAPE_FREE && ret == 0) release_allocation(tgid, &c);
    if (shape == SHAPE_COPY) count_copy(tgid, api, c.kind, c.bytes);
    if (shape == SHAPE_LAUNCH) { record_launch(ctx, tgid, api, &c); addr = c.func; }
    if (shape == SHAPE_GET_FUNCTION) { if (ret == 0) record_function_name(tgid, &c); addr = 0; }
#if EVENTS
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) { count_drop(DROP_EVENTS); return 0; }
    e->ts = now; e->latency_ns = now - c.ts; e->bytes = c.bytes; e->addr = addr;
    e->tgid = tgid; e->tid = id; e->api = api; e->ret = ret; e->kind = c.kind;
    e->grid[0] = c.grid[0]; e->grid[1] = c.grid[1]; e->grid[2] = c.grid[2];
    e->block[0] = c.block[0]; e->block[1] = c.block[1]; e->block[2] = c.block[2];
    e->stack_id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    events.ringbuf_submit(e, 0);
#endif
    return 0;
}

/* ---- host tracepoints ---- */
#if HOST_TRACEPOINTS
BPF_HASH(offcpu_start, u32, struct offstart, 65536);
BPF_HASH(offcpu, struct thread_key, struct offcpu, 65536);
BPF_HASH(opening, u64, u64, 4096);
BPF_HASH(library_opens, u64, struct library_open, 1024);
BPF_HASH(oom_kills, u32, struct oom_kill, 1024);

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns(), id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = id, next = args->next_pid;
    if (tid && probed.lookup(&tgid)) {   /* the current task is the one leaving the CPU */
        struct offstart s = {.ts = now, .tgid = tgid, .runnable = (args->prev_state & 0xff) == 0};
        offcpu_start.update(&tid, &s);
    }
    struct offstart *s = offcpu_start.lookup(&next);
    if (!s) return 0;
    struct thread_key k = {.tgid = s->tgid, .tid = next};
    struct offcpu fresh = {}, *v = offcpu.lookup(&k);
    if (!v) { offcpu.insert(&k, &fresh); v = offcpu.lookup(&k); }
    if (v) {
        u64 d = now - s->ts;
        __sync_fetch_and_add(&v->offcpu_ns, d);
        __sync_fetch_and_add(&v->switches, 1);
        if (s->runnable) __sync_fetch_and_add(&v->runqueue_ns, d);
    }
    offcpu_start.delete(&next);
    return 0;
}

#if FOLLOW_FORKS
TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32, child = args->child_pid;
    struct proc_info *p = probed.lookup(&tgid);
    if (p) { struct proc_info inherited = *p; probed.update(&child, &inherited); }
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id, tgid = id >> 32;
    if (tid != tgid) probed.delete(&tid);   /* a thread's entry, added when it was cloned */
    offcpu_start.delete(&tid);
    return 0;
}

/* libcuda.so*, libcudart.so* and wheel copies (libcudart-<hash>.so*); user space has the
   last word, a false match only costs a stop and a resume. Scans back from the end so the
   verifier sees one path per position. */
static __always_inline int is_cuda_library(const char *path, int len) {
    u32 base = 0;
    for (int i = 2; i < 48; i++) {
        int at = len - i;
        if (at < 0) break;
        if (path[at & (PATH_BYTES - 1)] == '/') { base = at + 1; break; }
    }
    char name[16] = {};
    bpf_probe_read_kernel(name, sizeof(name), path + (base & (PATH_BYTES - 1)));
    if (name[0] != 'l' || name[1] != 'i' || name[2] != 'b' || name[3] != 'c' || name[4] != 'u'
        || name[5] != 'd' || name[6] != 'a') return 0;
    char next = name[7];
    if (next == 'r' && name[8] == 't') next = name[9];
    return next == '.' || next == '-';
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_enabled() || (id >> 32) == SELF_PID) return 0;
#if !PROBE_ALL_PIDS
    u32 tgid = id >> 32;
    if (!probed.lookup(&tgid)) return 0;
#endif
    char path[PATH_BYTES + 16] = {};
    int len = bpf_probe_read_user_str(path, PATH_BYTES, args->filename);
    if (len <= 0 || !is_cuda_library(path, len)) return 0;
    u64 one = 1;
    opening.update(&id, &one);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat) {
    u64 id = bpf_get_current_pid_tgid();
    if (!opening.lookup(&id)) return 0;
    opening.delete(&id);
    if (args->ret < 0) return 0;
    struct library_open o = {.ts = bpf_ktime_get_ns(), .fd = args->ret};
    library_opens.update(&id, &o);
    u32 tgid = id >> 32;
    struct proc_info *p = probed.lookup(&tgid);
    if (p && (p->flags & FLAG_STOP_ON_LOAD))
        bpf_send_signal(SIGSTOP_NR);   /* user space attaches, then sends SIGCONT */
    return 0;
}

TRACEPOINT_PROBE(oom, mark_victim) {
    u32 pid = args->pid;
    struct oom_kill o = {.ts = bpf_ktime_get_ns()};
#if OOM_DETAILS
    o.anon_rss_pages = args->anon_rss;
    o.uid = args->uid;
    TP_DATA_LOC_READ_STR(o.comm, comm, sizeof(o.comm));
#endif
    oom_kills.update(&pid, &o);
    return 0;
}
#endif

/* ---- one entry and one return handler per API (generated) ---- */
"""

PLAIN, ALLOC, FREE, COPY, LAUNCH, GET_FUNCTION = ("plain", "alloc", "free", "copy", "launch",
                                                  "get_function")
_SHAPE_C = {PLAIN: "SHAPE_PLAIN", ALLOC: "SHAPE_ALLOC", FREE: "SHAPE_FREE", COPY: "SHAPE_COPY",
            LAUNCH: "SHAPE_LAUNCH", GET_FUNCTION: "SHAPE_GET_FUNCTION"}

# cudaMemcpyKind; the driver's copy functions each have one direction.
MEMCPY_KINDS = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}

STOP_ON_LOAD = 1  # a probed process flag: hold it when it opens a CUDA library (FLAG_STOP_ON_LOAD)

# Scanning every process's /proc/PID/maps for CUDA libraries (when no pids are given)
# costs tens of milliseconds on a busy node; libraries opened in between are caught at
# once by the openat tracepoint, so the scan only has to find what was loaded before.
SYSTEM_SCAN_INTERVAL_S = 10.0

DROP_REASONS = ("events", "inflight", "stats", "outstanding", "launches", "stacks")

# Log2 latency buckets: slot k holds latencies in [2^(k-1), 2^k) ns (slot 0: 0 ns),
# the last slot everything from 2^38 ns (~4.6 min) up.
LATENCY_SLOTS = 40
GRID_SLOTS = 40

# A tick in which at least this many calls of one API failed, and at least this share of
# its calls, is an error burst: a few failures are ordinary (a probe of a feature, an
# optional allocation); most calls failing together is the signature of an out-of-memory
# storm or a lost device.
ERROR_BURST_MIN_ERRORS = 10
ERROR_BURST_MIN_RATIO = 0.5

STACK_FRAMES_SHOWN = 16
EVENT_RING_PAGES = 256  # 1 MiB with 4 KiB pages: ~13k events in flight
EVENTS_KEPT = 100_000  # events held in memory for the report; more are counted as dropped


@dataclass(frozen=True)
class CudaApi:
    """One hooked API: its name, argument shape, library and exported symbols.

    The ``_ptsz``/``_ptds`` symbols are the per-thread-default-stream builds of the same
    call and are counted under the plain name.
    """

    name: str
    shape: str
    library: str
    symbols: tuple[str, ...]
    handler: str  # the C entry function for this shape
    copy_kind: int = 0

    @property
    def is_launch(self) -> bool:
        """A kernel launch (the expensive probes)."""
        return self.shape == LAUNCH


def _api(name, shape, library, handler, variants=(), copy_kind=0) -> CudaApi:
    return CudaApi(name, shape, library, (name, *variants), handler, copy_kind)


CUDA_APIS: tuple[CudaApi, ...] = (
    _api("cudaMalloc", ALLOC, RUNTIME, "enter_alloc"),
    _api("cudaFree", FREE, RUNTIME, "enter_free"),
    _api("cudaMallocAsync", ALLOC, RUNTIME, "enter_alloc", ("cudaMallocAsync_ptsz",)),
    _api("cudaFreeAsync", FREE, RUNTIME, "enter_free", ("cudaFreeAsync_ptsz",)),
    _api("cudaMallocManaged", ALLOC, RUNTIME, "enter_alloc"),
    _api("cudaMemcpy", COPY, RUNTIME, "enter_copy", ("cudaMemcpy_ptds",)),
    _api("cudaMemcpyAsync", COPY, RUNTIME, "enter_copy", ("cudaMemcpyAsync_ptsz",)),
    _api("cudaLaunchKernel", LAUNCH, RUNTIME, "enter_launch_runtime", ("cudaLaunchKernel_ptsz",)),
    _api("cudaStreamSynchronize", PLAIN, RUNTIME, "enter_plain", ("cudaStreamSynchronize_ptsz",)),
    _api("cudaDeviceSynchronize", PLAIN, RUNTIME, "enter_plain"),
    _api("cudaGraphLaunch", PLAIN, RUNTIME, "enter_plain", ("cudaGraphLaunch_ptsz",)),
    _api("cuMemAlloc_v2", ALLOC, DRIVER, "enter_alloc"),
    _api("cuMemFree_v2", FREE, DRIVER, "enter_free"),
    _api("cuMemAllocAsync", ALLOC, DRIVER, "enter_alloc", ("cuMemAllocAsync_ptsz",)),
    _api("cuMemFreeAsync", FREE, DRIVER, "enter_free", ("cuMemFreeAsync_ptsz",)),
    _api("cuMemcpyHtoDAsync_v2", COPY, DRIVER, "enter_copy", ("cuMemcpyHtoDAsync_v2_ptsz",), 1),
    _api("cuMemcpyDtoHAsync_v2", COPY, DRIVER, "enter_copy", ("cuMemcpyDtoHAsync_v2_ptsz",), 2),
    _api("cuMemcpyDtoDAsync_v2", COPY, DRIVER, "enter_copy", ("cuMemcpyDtoDAsync_v2_ptsz",), 3),
    _api("cuLaunchKernel", LAUNCH, DRIVER, "enter_launch_driver", ("cuLaunchKernel_ptsz",)),
    _api("cuLaunchKernelEx", LAUNCH, DRIVER, "enter_launch_ex", ("cuLaunchKernelEx_ptsz",)),
    _api("cuStreamSynchronize", PLAIN, DRIVER, "enter_plain", ("cuStreamSynchronize_ptsz",)),
    _api("cuCtxSynchronize", PLAIN, DRIVER, "enter_plain"),
    _api("cuModuleGetFunction", GET_FUNCTION, DRIVER, "enter_get_function"),
)
API_BY_NAME = {a.name: a for a in CUDA_APIS}


def render_program(apis: tuple[CudaApi, ...] = CUDA_APIS, *, all_pids: bool = False,
                   follow_forks: bool = True, host_tracepoints: bool = True,
                   events: bool = False, oom_details: bool = True,
                   event_ring_pages: int = EVENT_RING_PAGES) -> str:
    """The BPF C text: the program above, its switches, and one handler pair per API.

    API ids are positions in ``CUDA_APIS`` (stable whatever subset is attached).
    """
    switches = {"PROBE_ALL_PIDS": all_pids, "FOLLOW_FORKS": follow_forks,
                "HOST_TRACEPOINTS": host_tracepoints, "EVENTS": events, "OOM_DETAILS": oom_details}
    constants = {**{k: int(v) for k, v in switches.items()}, "EVENT_PAGES": event_ring_pages,
                 "SELF_PID": os.getpid(), "LAT_SLOTS": LATENCY_SLOTS, "GRID_SLOTS": GRID_SLOTS,
                 "FLAG_STOP_ON_LOAD": STOP_ON_LOAD, "DROP_SLOTS": len(DROP_REASONS),
                 **{f"DROP_{reason.upper()}": i for i, reason in enumerate(DROP_REASONS)}}
    head = "".join(f"#define {k} {v}\n" for k, v in constants.items())
    handlers = []
    for api in apis:
        i = CUDA_APIS.index(api)
        extra = f", {api.copy_kind}" if api.handler == "enter_copy" else ""
        handlers.append(f"int enter_{i}(struct pt_regs *ctx) {{ return {api.handler}(ctx, {i}{extra}); }}\n"
                        f"int leave_{i}(struct pt_regs *ctx) {{ return finish(ctx, {i}, {_SHAPE_C[api.shape]}); }}\n")
    return head + BPF_PROGRAM + "".join(handlers)


def percentile_from_log2(buckets: list[int], q: float) -> float | None:
    """The q-quantile (0..1) of a log2 histogram, interpolated inside its bucket.

    Slot k spans [2^(k-1), 2^k) (slot 0 is exactly 0), so the estimate is within a
    factor of two of the true value. None when the histogram is empty.
    """
    total = sum(buckets)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for k, n in enumerate(buckets):
        if n == 0:
            continue
        if seen + n >= rank:
            if k == 0:
                return 0.0
            low, high = 2.0 ** (k - 1), 2.0 ** k
            return low + (high - low) * max(0.0, rank - seen) / n
        seen += n
    return 2.0 ** (len(buckets) - 1)


def latency_summary(buckets: list[int]) -> dict:
    """p50/p95/p99 (ns) and the non-empty buckets as [{"le_ns", "count"}] (count in [le/2, le))."""
    out = {f"p{int(q * 100)}": percentile_from_log2(buckets, q) for q in (0.5, 0.95, 0.99)}
    out["buckets"] = [{"le_ns": (2 ** k if k else 0), "count": n} for k, n in enumerate(buckets) if n]
    return out


def prometheus_histogram(buckets: list[int], sum_ns: int) -> dict:
    """A latency histogram as a Prometheus histogram in seconds: cumulative buckets by ``le``."""
    cumulative, running = [], 0
    for k, n in enumerate(buckets[:-1]):
        running += n
        cumulative.append((2.0 ** k / 1e9 if k else 0.0, running))
    running += buckets[-1] if buckets else 0
    cumulative.append((float("inf"), running))
    return {"buckets": cumulative, "sum": sum_ns / 1e9, "count": running}


@dataclass
class AttachedLibrary:
    """A library with uprobes on it, and which APIs they cover."""

    library: CudaLibrary
    apis: list[str]
    uprobes: int
    events: list[bytes] = field(default_factory=list, repr=False)  # bcc's names, to detach
    attached_at: float = 0.0


@dataclass
class ProbedProcess:
    """What the probe knows of one process."""

    pid: int
    comm: str = ""
    libraries: set[str] = field(default_factory=set)
    alive: bool = True
    stop_on_load: bool = False
    symbols: Any = None  # bcc SymbolCache
    symbols_signature: frozenset = frozenset()
    maps_signature: frozenset = frozenset()
    oom_killed: bool = False
    cgroup: Any = None  # gpudiag.probes.kube_cgroup.CgroupIdentity, read while the process lives


def _read_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _is_process(pid: int) -> bool:
    """True for a thread-group leader (a process), False for another thread or no task."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Tgid:"):
                    return int(line.split()[1]) == pid
    except (OSError, ValueError):
        pass
    return False


def _mount_tracefs() -> str | None:
    """Mount tracefs where it belongs; None when done, else why not."""
    try:
        res = subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if res.returncode == 0 else (res.stderr.strip() or f"mount exited {res.returncode}")


def _tracepoint_fields(root, category: str, event: str) -> set[str] | None:
    try:
        text = (root / "events" / category / event / "format").read_text()
    except OSError:
        return None
    return set(re.findall(r"field:[^;]*?(\w+)(?:\[\d*\])?;", text))


class CudaApiProbe:
    """The CUDA API probes of one session: attach, read the maps, detach.

    ``pids`` are the processes to probe (their children too); None probes every
    process that maps a CUDA library. ``libraries`` are extra files to attach to (the
    system's CUDA libraries are always attached when ``system_libraries``).
    ``launches`` attaches the kernel-launch probes; ``events`` streams one event per
    call (see ``events()``).
    """

    def __init__(self, pids: list[int] | None = None, *, libraries: list[CudaLibrary] = (),
                 launches: bool = True, events: bool = False, host_tracepoints: bool = True,
                 system_libraries: bool = True, rescan_interval_s: float = 1.0,
                 event_ring_pages: int = EVENT_RING_PAGES, node: str | None = None):
        if event_ring_pages < 1 or event_ring_pages & (event_ring_pages - 1):
            raise ValueError("event_ring_pages must be a power of two")
        self.event_ring_pages = event_ring_pages
        self.all_pids = pids is None
        self.launches = launches
        self.events_enabled = events
        self.want_host_tracepoints = host_tracepoints
        self.rescan_interval_s = rescan_interval_s
        self._last_system_scan = 0.0
        self.node = node or os.uname().nodename
        self.apis = tuple(a for a in CUDA_APIS if launches or not a.is_launch)
        self.notes: list[str] = []
        self.host_tracepoints: list[str] = []
        self.attached: dict[tuple, AttachedLibrary] = {}
        self.processes: dict[int, ProbedProcess] = {}
        self.attach_errors: list[str] = []
        self._initial_pids = list(pids or [])
        self._extra_libraries = list(libraries)
        self._system_libraries = system_libraries
        self._bpf = None
        self._bcc = None
        self._stack_cache: dict[tuple[int, int], list[str]] = {}
        self._function_names: dict[tuple[int, int], str] = {}
        self._threads: set[int] = set()
        self._events: deque = deque(maxlen=EVENTS_KEPT)
        self._events_overflow = 0
        self._last_rescan = 0.0
        self._prev_stats: dict[tuple[int, str], tuple[int, int]] = {}
        self._bursts: set[tuple[int, str]] = set()
        self.started_at = 0.0
        self.detach_pid: int | None = None

    # ---- lifecycle ----

    def start(self) -> CudaApiProbe:
        """Compile, attach the tracepoints and the libraries known now. GpudiagError when impossible."""
        checks = ebpf_readiness.ebpf_checks()
        blockers = ebpf_readiness.blocking(checks)
        if blockers:
            raise GpudiagError("cannot attach the CUDA eBPF probes: " + ebpf_readiness.explain(blockers[0]))
        self._bcc = ebpf_readiness.import_bcc()
        source = ebpf_readiness.kernel_source_tree()
        saved_env = os.environ.get("BCC_KERNEL_SOURCE")
        if source and source[0] != str(ebpf_readiness.KHEADERS_ARCHIVE):
            os.environ["BCC_KERNEL_SOURCE"] = source[0]  # libbcc reads it while compiling
        tracepoints, oom_details = self._plan_tracepoints()
        text = render_program(self.apis, all_pids=self.all_pids, follow_forks=not self.all_pids,
                              host_tracepoints=tracepoints, events=self.events_enabled,
                              oom_details=oom_details, event_ring_pages=self.event_ring_pages)
        try:
            self._bpf = self._bcc.BPF(text=text.encode(), cflags=["-w"])
        except Exception as exc:  # bcc raises bare Exception for every failure
            headers = ebpf_readiness.explain(ebpf_readiness.check_kernel_headers())
            raise GpudiagError(f"the BPF program did not compile or load ({exc}); {headers}") from None
        finally:
            if saved_env is None:
                os.environ.pop("BCC_KERNEL_SOURCE", None)
            else:
                os.environ["BCC_KERNEL_SOURCE"] = saved_env
        if tracepoints:
            self.host_tracepoints = ["sched:sched_switch", "sched:sched_process_exit",
                                     "syscalls:sys_enter_openat", "syscalls:sys_exit_openat",
                                     "oom:mark_victim"] + ([] if self.all_pids else ["sched:sched_process_fork"])
        self._bpf[b"enabled"][ctypes.c_int(0)] = ctypes.c_uint64(1)
        if self.events_enabled:
            self._bpf[b"events"].open_ring_buffer(self._on_event)
        self.started_at = time.time()
        for pid in self._initial_pids:
            self.add_process(pid)
        libs = list(self._extra_libraries)
        if self._system_libraries:
            libs += cuda_libs.system_libraries()
        for lib in cuda_libs.distinct(libs):
            self.attach_library(lib)
        self._rescan(force=True)
        return self

    def _plan_tracepoints(self) -> tuple[bool, bool]:
        if not self.want_host_tracepoints:
            return False, False
        root = ebpf_readiness.tracefs_root()
        if root is None and os.geteuid() == 0:
            why = _mount_tracefs()
            root = ebpf_readiness.tracefs_root()
            self.notes.append("mounted tracefs at /sys/kernel/tracing" if root else f"tracefs: {why}")
        if root is None:
            self.notes.append("host tracepoints off: tracefs is not mounted")
            return False, False
        needed = {("sched", "sched_switch"), ("sched", "sched_process_exit"), ("sched", "sched_process_fork"),
                  ("syscalls", "sys_enter_openat"), ("syscalls", "sys_exit_openat"), ("oom", "mark_victim")}
        missing = [f"{c}:{e}" for c, e in sorted(needed) if _tracepoint_fields(root, c, e) is None]
        if missing:
            self.notes.append("host tracepoints off: the kernel lacks " + ", ".join(missing))
            return False, False
        oom_fields = _tracepoint_fields(root, "oom", "mark_victim") or set()
        return True, {"anon_rss", "uid", "comm"} <= oom_fields

    def close(self, wait: bool = False) -> None:
        """Detach everything and resume any process still held at a library load.

        Closing a uprobe waits for an RCU grace period in the kernel (about 0.1 s each,
        one after another), so detaching a few dozen takes seconds; unless ``wait``, a
        short-lived child process does that part and this one returns at once. The
        probes count nothing from the moment close() is called.
        """
        if self._bpf is None:
            return
        try:
            self._handle_library_opens()
        finally:
            self._bpf[b"enabled"][ctypes.c_int(0)] = ctypes.c_uint64(0)
            for proc in self.processes.values():
                if proc.stop_on_load and proc.alive:
                    self._resume(proc.pid)
            bpf = self._bpf
            self._bpf = None
            try:
                if wait or not self._detach_in_background(bpf):
                    bpf.cleanup()
            except OSError as exc:
                # A program descriptor already closed: seen once in a long test session
                # of the probe tests; the probes are detached either way. bcc would
                # retry the same close at exit, so its exit hook goes too.
                if exc.errno != errno.EBADF:
                    raise
                log.warning("closing the BPF object: a descriptor was already closed (%s)", exc)
                atexit.unregister(bpf.cleanup)

    def _detach_in_background(self, bpf) -> bool:
        perf_fds = list(bpf.uprobe_fds.values()) + list(bpf.tracepoint_fds.values())
        if not perf_fds:
            return False
        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            return False
        if pid == 0:  # the child: hold the last references, then drop them
            try:
                keep = set(perf_fds) | {read_end}
                for fd in map(int, os.listdir("/proc/self/fd")):
                    if fd not in keep and fd > 2:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.read(read_end, 1)  # the parent has let go of its copies
                for fd in perf_fds:
                    os.close(fd)
            finally:
                os._exit(0)
        os.close(read_end)
        for fd in perf_fds:
            os.close(fd)  # not the last reference: immediate
        for ev in list(bpf.uprobe_fds):
            bpf._del_uprobe_fd(ev)  # keeps bcc's count of open probes right
        bpf.tracepoint_fds.clear()
        os.write(write_end, b"x")
        os.close(write_end)
        threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True).start()
        self.detach_pid = pid
        bpf.cleanup()  # maps, programs and ring buffer: quick
        return True

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- processes and libraries ----

    def add_process(self, pid: int, *, stop_on_load: bool = False) -> ProbedProcess:
        """Probe a process (and the children it starts from now on).

        With ``stop_on_load`` the kernel stops it when it opens a CUDA library until the
        uprobes are attached (for a process the probe started itself: job control of an
        interactive shell would notice the stop).
        """
        proc = self.processes.get(pid)
        if proc is None:
            proc = self.processes[pid] = ProbedProcess(pid, comm=_read_comm(pid), alive=_is_alive(pid))
        table, key = self._bpf[b"probed"], ctypes.c_uint32(pid)
        known = table.get(key)  # a child followed at fork inherits its parent's flags
        proc.stop_on_load = proc.stop_on_load or stop_on_load or bool(known and known.flags & STOP_ON_LOAD)
        table[key] = table.Leaf(STOP_ON_LOAD if proc.stop_on_load else 0, 0)
        self._refresh_process(proc)
        return proc

    def attach_library(self, lib: CudaLibrary) -> AttachedLibrary | None:
        """Attach every hooked API the library exports, once per file; None when already attached."""
        if lib.identity in self.attached:
            return None
        wanted = {s: api for api in self.apis for s in api.symbols}
        pattern = ("^(" + "|".join(re.escape(s) for s in wanted) + ")$").encode()
        try:
            found = self._bcc.BPF.get_user_functions_and_addresses(lib.path.encode(), pattern)
        except Exception as exc:  # bcc raises bare Exception
            self.attach_errors.append(f"{lib.name}: cannot read its symbols ({exc})")
            return None
        entry = AttachedLibrary(lib, [], 0, attached_at=time.time())
        done_addresses = set()
        for sym, addr in sorted(found, key=lambda f: f[1]):
            api = wanted[sym.decode()]
            if addr in done_addresses:
                continue  # an alias of a symbol already hooked
            done_addresses.add(addr)
            i = CUDA_APIS.index(api)
            before = set(self._bpf.uprobe_fds)
            try:
                # Return probe first: a call caught by the entry probe alone would leave a stale
                # entry behind; a return without its entry is counted, without a latency.
                self._bpf.attach_uretprobe(name=lib.path.encode(), addr=addr, fn_name=f"leave_{i}".encode())
                self._bpf.attach_uprobe(name=lib.path.encode(), addr=addr, fn_name=f"enter_{i}".encode())
            except Exception as exc:  # bcc raises bare Exception
                self.attach_errors.append(f"{lib.name}: {sym.decode()}: {exc}")
            new = [e for e in self._bpf.uprobe_fds if e not in before]
            entry.events.extend(new)
            entry.uprobes += len(new)
            if api.name not in entry.apis:
                entry.apis.append(api.name)
        self.attached[lib.identity] = entry
        return entry

    def detach_library(self, identity: tuple) -> None:
        """Remove the uprobes of one library."""
        entry = self.attached.pop(identity, None)
        if entry is None or self._bpf is None:
            return
        for ev in entry.events:
            try:
                self._bpf.detach_uprobe_event(ev)
            except Exception as exc:  # bcc raises bare Exception
                self.attach_errors.append(f"{entry.library.name}: detach: {exc}")

    def _refresh_process(self, proc: ProbedProcess) -> None:
        if not proc.alive:
            return
        try:
            maps = cuda_libs.mapped_files(proc.pid)
        except OSError:
            proc.alive = _is_alive(proc.pid)
            return
        signature = frozenset(m.path for m in maps)
        if signature != proc.maps_signature:
            proc.maps_signature = signature
            proc.cgroup = None  # new mappings (an exec): its container is read again below
            for lib in cuda_libs.libraries_in_process(proc.pid, maps=maps):
                proc.libraries.add(lib.name)
                self.attach_library(lib)
        proc.comm = _read_comm(proc.pid) or proc.comm  # changes at exec
        if proc.cgroup is None:
            proc.cgroup = read_identity(proc.pid)  # container and pod: gone with the process, so read while alive
        if proc.symbols is None or proc.symbols_signature != signature:
            # bcc's symbol cache reads the mappings once; it stays usable after the process exits.
            self._free_symbols(proc)
            proc.symbols = self._bcc.SymbolCache(proc.pid)
            proc.symbols_signature = signature
            self._stack_cache = {k: v for k, v in self._stack_cache.items() if k[0] != proc.pid}

    def _free_symbols(self, proc: ProbedProcess) -> None:
        if proc.symbols is not None:
            self._bcc.lib.bcc_free_symcache(proc.symbols.cache, proc.pid)
            proc.symbols = None

    def _rescan(self, force: bool = False) -> None:
        """Follow new processes and re-read the mappings of the known ones.

        The system-wide scan of /proc (every process, when no pids were given) runs on
        its own slower clock, ``force`` or not: it reads every process's mappings.
        """
        now = time.monotonic()
        if self.all_pids and (now - self._last_system_scan >= SYSTEM_SCAN_INTERVAL_S
                              or not self._last_system_scan):
            self._last_system_scan = now
            for pid in cuda_libs.processes_with_cuda():
                if pid not in self.processes:
                    self.add_process(pid)
        if not force and now - self._last_rescan < self.rescan_interval_s:
            return
        self._last_rescan = now
        for key in list(self._bpf[b"probed"].keys()):
            pid = key.value
            if pid in self.processes or pid in self._threads:
                continue
            if _is_process(pid):
                self.processes[pid] = ProbedProcess(pid, comm=_read_comm(pid))
            else:
                self._threads.add(pid)  # a thread of a probed process, followed at clone
        for proc in list(self.processes.values()):
            if proc.alive and not _is_alive(proc.pid):
                proc.alive = False
            self._refresh_process(proc)

    def _resume(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass

    def _handle_library_opens(self) -> None:
        if not self.host_tracepoints:
            return
        table = self._bpf[b"library_opens"]
        for key, value in list(table.items()):
            pid_tgid = key.value
            tgid, tid = pid_tgid >> 32, pid_tgid & 0xFFFFFFFF
            proc = self.processes.get(tgid) or self.add_process(tgid)
            try:
                fd_path = f"/proc/{tid}/fd/{value.fd}"
                name = os.readlink(fd_path)
                if not name.startswith("/") or cuda_libs.library_kind(name) is None:
                    continue  # closed and reused already, or a name the kernel's quick test let by
                rooted = f"/proc/{tgid}/root{name}"
                st, rst = os.stat(fd_path), None
                try:
                    rst = os.stat(rooted)
                except OSError:
                    pass
                path = rooted if rst is not None and rst.st_ino == st.st_ino else fd_path
                lib = CudaLibrary(path=path, name=name, kind=cuda_libs.library_kind(name),
                                  inode=st.st_ino, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns,
                                  dev=st.st_dev, origin=f"opened by pid {tgid}", pids=(tgid,))
                proc.libraries.add(name)
                self.attach_library(lib)
                self._refresh_process(proc)
            except OSError:
                pass  # the process is gone, or closed the file already
            finally:
                del table[key]
                if proc.stop_on_load:
                    self._resume(tgid)

    def poll(self) -> None:
        """Attach libraries opened since the last call, follow new processes, take events.

        Call it often (every few tens of milliseconds) while a process may be held at a
        library load; the maps themselves are read only by snapshot().
        """
        self._handle_library_opens()
        if self.events_enabled:
            self._bpf.ring_buffer_consume()
        self._rescan()

    # ---- events ----

    def _on_event(self, ctx, data, size) -> int:
        e = self._bpf[b"events"].event(data)
        if len(self._events) == self._events.maxlen:
            self._events_overflow += 1
        self._events.append((e.ts, e.tgid, e.tid, e.api, e.ret, e.latency_ns, e.bytes, e.addr,
                             tuple(e.grid), tuple(e.block), e.kind, e.stack_id))
        return 0

    def events(self, clear: bool = True) -> list[dict]:
        """The per-call events received (``events=True``), oldest first, stacks resolved."""
        out = []
        for ts, tgid, tid, api_i, ret, lat, nbytes, addr, grid, block, kind, stack_id in self._events:
            api = CUDA_APIS[api_i]
            ev = {"t_ns": ts, "pid": tgid, "tid": tid, "api": api.name, "ret": ret, "latency_ns": lat,
                  "bytes": nbytes, "stack": self._stack(tgid, stack_id)}
            if api.shape == COPY:
                ev["kind"] = MEMCPY_KINDS.get(kind, str(kind))
            if api.shape == LAUNCH:
                ev.update(function=self._function_name(tgid, addr), grid=list(grid), block=list(block))
            elif addr:
                ev["address"] = f"{addr:#x}"
            out.append(ev)
        if clear:
            self._events.clear()
        return out

    # ---- reading the maps ----

    def _symbolize(self, pid: int, addr: int) -> str:
        proc = self.processes.get(pid)
        if proc is None or proc.symbols is None:
            return f"{addr:#x}"
        name, offset, module = proc.symbols.resolve(addr, True)
        mod = os.path.basename(module.decode(errors="replace")) if module else None
        if name:
            return f"{name.decode(errors='replace')}+{offset:#x}" + (f" [{mod}]" if mod else "")
        return f"{offset:#x} [{mod}]" if mod else f"{addr:#x}"

    def _stack(self, pid: int, stack_id: int) -> list[str]:
        if stack_id < 0:
            return ["[stack not recorded: the stack table was full]"]
        key = (pid, stack_id)
        if key not in self._stack_cache:
            try:
                addrs = list(self._bpf[b"stacks"].walk(stack_id))
            except KeyError:
                addrs = []
            self._stack_cache[key] = [self._symbolize(pid, a) for a in addrs[:STACK_FRAMES_SHOWN]]
        return self._stack_cache[key]

    def _function_name(self, pid: int, func: int) -> str:
        name = self._function_names.get((pid, func))
        if name:
            return name
        sym = self._symbolize(pid, func)
        return sym.split("+0x")[0] if not sym.startswith("0x") else sym

    def drops(self) -> dict[str, int]:
        """Counts the kernel could not record, by reason (events: the ring buffer was full)."""
        table = self._bpf[b"drops"]
        out = {reason: table[ctypes.c_int(i)].value for i, reason in enumerate(DROP_REASONS)}
        out["events_not_kept"] = self._events_overflow
        return out

    def snapshot(self) -> dict:
        """Everything the probe knows now, as the JSON document of ``gpudiag probe cuda --json``."""
        self._handle_library_opens()
        self._rescan(force=True)
        bpf = self._bpf
        now_ns = time.monotonic_ns()
        self._function_names = {(k.tgid, k.func): v.name.decode(errors="replace")
                                for k, v in bpf[b"function_names"].items()}
        per_pid: dict[int, dict] = {}

        def entry(pid: int) -> dict:
            if pid not in per_pid:
                proc = self.processes.get(pid) or ProbedProcess(pid, alive=_is_alive(pid))
                self.processes.setdefault(pid, proc)
                per_pid[pid] = {"pid": pid, "comm": proc.comm, "alive": proc.alive,
                                "libraries": sorted(proc.libraries), "apis": {}, "outstanding": [],
                                "outstanding_bytes": 0, "launches": [], "launch_grid_histogram": [],
                                "degenerate_launches": [], "kernel_launches": 0, "offcpu": None,
                                "oom_killed": proc.oom_killed}
            return per_pid[pid]

        for pid in self._initial_pids:
            entry(pid)
        errors: dict[tuple[int, int], dict[str, int]] = {}
        for k, v in bpf[b"errors"].items():
            errors.setdefault((k.tgid, k.api), {})[str(k.code)] = v.value
        copies: dict[tuple[int, int], dict[str, dict]] = {}
        for k, v in bpf[b"copies"].items():
            copies.setdefault((k.tgid, k.api), {})[MEMCPY_KINDS.get(k.kind, str(k.kind))] = {
                "calls": v.calls, "bytes": v.bytes}
        for k, v in bpf[b"stats"].items():
            api = CUDA_APIS[k.api]
            buckets = list(v.latency)
            rec = {"calls": v.calls, "errors": errors.get((k.tgid, k.api), {}), "bytes": v.bytes,
                   "failed_bytes": v.failed_bytes, "latency_ns": latency_summary(buckets),
                   "latency_sum_ns": v.latency_sum_ns, "untimed_calls": v.untimed, "error_burst": False}
            if (k.tgid, k.api) in copies:
                rec["kinds"] = copies[(k.tgid, k.api)]
            prev_calls, prev_errors = self._prev_stats.get((k.tgid, api.name), (0, 0))
            d_calls, d_errors = v.calls - prev_calls, v.errors - prev_errors
            if d_errors >= ERROR_BURST_MIN_ERRORS and d_errors >= ERROR_BURST_MIN_RATIO * max(d_calls, 1):
                self._bursts.add((k.tgid, api.name))
            self._prev_stats[(k.tgid, api.name)] = (v.calls, v.errors)
            rec["error_burst"] = (k.tgid, api.name) in self._bursts
            entry(k.tgid)["apis"][api.name] = rec
        groups: dict[tuple[int, int], dict] = {}
        for k, v in bpf[b"outstanding"].items():
            g = groups.setdefault((k.tgid, v.stack_id), {"bytes": 0, "count": 0, "oldest_ns": now_ns,
                                                          "apis": set()})
            g["bytes"] += v.bytes
            g["count"] += 1
            g["oldest_ns"] = min(g["oldest_ns"], v.ts)
            g["apis"].add(CUDA_APIS[v.api].name)
        for (pid, stack_id), g in sorted(groups.items(), key=lambda kv: -kv[1]["bytes"]):
            entry(pid)["outstanding"].append({
                "bytes": g["bytes"], "count": g["count"], "oldest_age_s": (now_ns - g["oldest_ns"]) / 1e9,
                "apis": sorted(g["apis"]), "stack": self._stack(pid, stack_id)})
        for k, v in bpf[b"outstanding_bytes"].items():
            entry(k.value)["outstanding_bytes"] = v.value
        for k, v in bpf[b"launch_shapes"].items():
            e = entry(k.tgid)
            e["launches"].append({"function": self._function_name(k.tgid, k.func),
                                  "grid": list(k.grid), "block": list(k.block),
                                  "shared_mem_bytes": k.shmem, "count": v.value})
            e["kernel_launches"] += v.value
        hist: dict[tuple[int, int], list[int]] = {}
        for k, v in bpf[b"launch_grids"].items():
            hist.setdefault((k.tgid, k.func), [0] * GRID_SLOTS)[k.slot] += v.value
        for (pid, func), buckets in hist.items():
            entry(pid)["launch_grid_histogram"].append({
                "function": self._function_name(pid, func),
                "blocks": [{"le": 2 ** i if i else 0, "count": n} for i, n in enumerate(buckets) if n]})
        for k, v in bpf[b"degenerate_launches"].items():
            entry(k.tgid)["degenerate_launches"].append({
                "function": self._function_name(k.tgid, k.func), "api": CUDA_APIS[k.api].name, "count": v.count,
                "stack": self._stack(k.tgid, v.stack_id)})
        oom = []
        if self.host_tracepoints:
            threads: dict[int, list] = {}
            for k, v in bpf[b"offcpu"].items():
                threads.setdefault(k.tgid, []).append((k.tid, v.offcpu_ns, v.runqueue_ns, v.switches))
            for pid, rows in threads.items():
                if pid not in per_pid and pid not in self.processes:
                    continue
                rows.sort(key=lambda r: -r[1])
                entry(pid)["offcpu"] = {
                    "offcpu_s": sum(r[1] for r in rows) / 1e9, "runqueue_wait_s": sum(r[2] for r in rows) / 1e9,
                    "switches": sum(r[3] for r in rows),
                    "threads": [{"tid": tid, "comm": _read_comm(tid) if tid else "", "offcpu_s": off / 1e9,
                                 "runqueue_wait_s": rq / 1e9, "switches": n} for tid, off, rq, n in rows[:8]]}
            for k, v in bpf[b"oom_kills"].items():
                oom.append({"pid": k.value, "comm": v.comm.decode(errors="replace"),
                            "anon_rss_bytes": v.anon_rss_pages * os.sysconf("SC_PAGE_SIZE"), "uid": v.uid,
                            "age_s": (now_ns - v.ts) / 1e9})
                if k.value in self.processes:
                    self.processes[k.value].oom_killed = True
                    entry(k.value)["oom_killed"] = True
        for e in per_pid.values():
            proc = self.processes.get(e["pid"])
            if proc is not None:
                e.update(comm=proc.comm, alive=proc.alive, libraries=sorted(proc.libraries))
                if proc.cgroup is None and proc.alive:
                    proc.cgroup = read_identity(proc.pid)
            ident = proc.cgroup if proc is not None else None
            # Where the process runs: its container and Kubernetes pod (None outside either).
            e.update(container_id=ident.container_id if ident else None, pod_uid=ident.pod_uid if ident else None,
                     container_runtime=ident.runtime if ident else None, pod_qos=ident.qos if ident else None)
            e["launches"].sort(key=lambda r: -r["count"])
        drops = self.drops()
        return {
            "processes": sorted(per_pid.values(), key=lambda e: e["pid"]),
            "dropped_events": drops["events"] + drops["events_not_kept"],
            "drops": drops,
            "kernel": os.uname().release,
            "probes_attached": [
                {"path": a.library.name, "kind": a.library.kind, "inode": a.library.inode,
                 "dev": f"{os.major(a.library.dev)}:{os.minor(a.library.dev)}", "origin": a.library.origin,
                 "apis": a.apis, "uprobes": a.uprobes} for a in self.attached.values()],
            "apis_probed": [a.name for a in self.apis],
            "launch_probes": self.launches,
            "host_tracepoints": list(self.host_tracepoints),
            "oom_kills": oom,
            "notes": list(self.notes) + list(self.attach_errors),
            "started_at": self.started_at,
            "duration_s": time.time() - self.started_at if self.started_at else 0.0,
        }

    def frames(self, t: float | None = None, snapshot: dict | None = None) -> list[Frame]:
        """The snapshot as frames: kind "cuda_api" and a "node" row with OOM kills.

        cuda_api rows are of three shapes: per (pid, api) with calls, bytes and the latency
        histogram (a Prometheus histogram in seconds: {"buckets": [(le, cumulative)], "sum",
        "count"}); per (pid, api, code) with the errors of that return code; per pid (no
        ``api``) with outstanding bytes, kernel launches, degenerate launches and off-CPU time.
        Counters are cumulative since the probe started.
        """
        t = time.time() if t is None else t
        snap = snapshot or self.snapshot()
        rows = []
        for p in snap["processes"]:
            base = {"node": self.node, "pid": p["pid"], "process": p["comm"]}
            for name, a in p["apis"].items():
                buckets = [0] * LATENCY_SLOTS
                for b in a["latency_ns"]["buckets"]:
                    buckets[b["le_ns"].bit_length() - 1 if b["le_ns"] else 0] += b["count"]
                rows.append({**base, "api": name, M.cuda_api_calls_total: a["calls"],
                             M.cuda_api_bytes_total: a["bytes"],
                             M.cuda_api_latency_seconds: prometheus_histogram(buckets, a["latency_sum_ns"])})
                for code, n in a["errors"].items():
                    rows.append({**base, "api": name, "code": int(code), M.cuda_api_errors_total: n})
            offcpu = p["offcpu"] or {}
            rows.append({**base, M.cuda_outstanding_allocation_bytes: p["outstanding_bytes"],
                         M.cuda_kernel_launches_total: p["kernel_launches"],
                         M.cuda_degenerate_launches_total: sum(d["count"] for d in p["degenerate_launches"]),
                         M.host_offcpu_seconds_total: offcpu.get("offcpu_s", 0.0),
                         M.host_runqueue_wait_seconds_total: offcpu.get("runqueue_wait_s", 0.0)})
        frames = [Frame("cuda_api", t, rows)]
        if self.host_tracepoints:
            frames.append(Frame("node", t, [{"node": self.node, M.host_oom_kills_total: len(snap["oom_kills"])}]))
        return frames
