/* A team of threads for one call (lp_team.h): the OpenMP region, barriers, shared counters.
 *
 * ggml counterparts: ggml-cpu.c's ggml_graph_compute (one `omp parallel` region per graph),
 * ggml_barrier (threads spin on an atomic counter) and the mul_mat chunk counter
 * (current_chunk). Built like the other kernels_c sources, once per SIMD variant.
 */

#include "lp_team.h"

#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#include <pthread.h>

/* libgomp cannot be used in a child made by fork() once the parent has run a parallel region
 * (the child hangs in its first one: the team's threads did not come along). So in a fork child
 * every team is the calling thread alone. One flag for the library. */
static volatile int lp_fork_child = 0;

static void lp_on_fork_child(void) { lp_fork_child = 1; }

__attribute__((constructor)) static void lp_register_atfork(void) { pthread_atfork(NULL, NULL, lp_on_fork_child); }
#endif

/* Rounds of spinning at a barrier before sleeping. A barrier inside a split waits for
 * microseconds (a kernel's uneven end, thread 0's row-wise records), which a sleep and wake-up
 * would cost several times over; 1024 rounds (~20 us of pause on this machine kind) cover those.
 * Beyond it the thread sleeps on a futex until the last thread arrives, so that on a busy
 * machine its core goes to the thread it waits for. Measured (SmolLM2 tg128, -t 2, Intel host,
 * bench/RESULTS.md): quiet 60 / 78 / 117-128 / 117-123 / 120-122 tok/s at 0 / 256 / 1024 / 2048 /
 * 8192 rounds (92 with a region per kernel call); one core busy in another process: 47 at 1024,
 * 38 at 2048 (48 with a region per call).
 * Between the spin and the sleep the thread yields its core (sched_yield) for up to LP_YIELD_NS:
 * on a virtual machine waking a sleeping thread can take hundreds of microseconds, and a sleep
 * then feeds itself: the woken thread reaches the next barrier that much late, so the other
 * sleeps there too, and so on, every barrier paying a wake-up. Seen on an AMD EPYC (Zen 5) host:
 * SmolLM2 decode steps of 30 ms instead of 4-5 in some runs, ~130 context switches a step instead
 * of 3-9; yielding for 2 ms cut the context switches of a 150-step run from 400-1400 to ~200, and
 * with another process busy on one core a step took as long as without the yield (15.6 vs 15.8
 * ms), since a yielding thread gives its core away. */
#define LP_SPIN_ROUNDS 1024
#define LP_YIELD_NS 2000000

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* sleep while *word == val (returns at once if it is not) / wake every sleeper on word */
static void word_wait(unsigned _Atomic *word, unsigned val) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void word_wake(unsigned _Atomic *word) { syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
#else
static void word_wait(unsigned _Atomic *word, unsigned val) {
    (void)word, (void)val;
    sched_yield();
}
static void word_wake(unsigned _Atomic *word) { (void)word; }
#endif

void lp_par_barrier(lp_par *p) {
    lp_team *t = p->team;
    /* the counter of the phase after this one was last used two phases ago: everyone is done
     * with it, and no one takes from it before this barrier is passed */
    if (p->ith == 0) atomic_store_explicit(&t->next[(p->phase + 1) & 1], 0, memory_order_relaxed);
    p->phase++;
    if (p->nth == 1) return;
    const unsigned gen = atomic_load(&t->gen);
    if (atomic_fetch_add(&t->arrived, 1) == p->nth - 1) {
        atomic_store(&t->arrived, 0);
        atomic_fetch_add(&t->gen, 1);
        /* (sequentially consistent: a sleeper counted after this sees the new gen instead) */
        if (atomic_load(&t->sleepers)) word_wake(&t->gen);
        return;
    }
    int64_t yield_end = 0;
    for (int i = 0; atomic_load_explicit(&t->gen, memory_order_acquire) == gen; i++) {
        if (i < LP_SPIN_ROUNDS) {
            cpu_relax();
        } else if (i == LP_SPIN_ROUNDS || now_ns() < yield_end) {
            if (i == LP_SPIN_ROUNDS) yield_end = now_ns() + LP_YIELD_NS;
            sched_yield();
        } else {
            atomic_fetch_add(&t->sleepers, 1);
            if (atomic_load(&t->gen) == gen) word_wait(&t->gen, gen);
            atomic_fetch_sub(&t->sleepers, 1);
        }
    }
}

int64_t lp_par_next(lp_par *p) {
    return atomic_fetch_add_explicit(&p->team->next[p->phase & 1], 1, memory_order_relaxed);
}

void *lp_par_share(lp_par *p, void *v) {
    /* a slot per phase parity: the next write to this one is two barriers away, after every
     * thread has read it */
    void *_Atomic *slot = &p->team->shared[p->phase & 1];
    if (p->ith == 0) atomic_store_explicit(slot, v, memory_order_relaxed);
    lp_par_barrier(p);
    return atomic_load_explicit(slot, memory_order_relaxed);
}

/* The error and the phase it was reported in, in one word: (phase << 32) | err. A thread acts on
 * an error from an earlier phase only: after a barrier, a thread that is late out of it must not
 * see what thread 0 reported after it (and miss the barrier thread 0 then waits at). */
void lp_par_fail(lp_par *p, int64_t err) {
    int64_t none = 0;
    if (err) atomic_compare_exchange_strong(&p->team->err, &none, (int64_t)((uint64_t)p->phase << 32 | (uint32_t)err));
}

int64_t lp_par_error(const lp_par *p) {
    const uint64_t e = (uint64_t)atomic_load(&p->team->err);
    return e && (unsigned)(e >> 32) < p->phase ? (int64_t)(uint32_t)e : 0;
}

int64_t lp_par_run(int n_threads, lp_par_fn fn, void *arg) {
    lp_team team = {0};
#ifdef _OPENMP
    if (n_threads > 1 && !lp_fork_child && !omp_in_parallel()) {
#pragma omp parallel num_threads(n_threads)
        {
            /* (the region may get fewer threads than asked: every thread sees the same count) */
            lp_par p = {&team, omp_get_thread_num(), omp_get_num_threads(), 0};
            lp_par_fail(&p, fn(&p, arg));
        }
        return (uint32_t)atomic_load(&team.err);
    }
#else
    (void)n_threads;
#endif
    lp_par p = {&team, 0, 1, 0};
    lp_par_fail(&p, fn(&p, arg));
    return (uint32_t)atomic_load(&team.err);
}
