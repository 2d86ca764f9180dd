/* A team of threads working through one call: the executor's whole split, or one kernel.
 *
 * ggml counterparts: ggml-cpu.c's ggml_graph_compute_thread (every thread walks the whole graph,
 * ggml_barrier between nodes) and ggml_compute_params (ith, nth, the shared chunk counter of
 * mul_mat). ggml opens one OpenMP region per graph and spins at its barriers; so does the
 * executor (executor.c) here, while a kernel called on its own (from Python) opens its own region.
 *
 * Each thread holds an lp_par: its index, the team size and the team it belongs to. The work of a
 * kernel is written once, as a function of its lp_par: a static share (lp_par_range), units handed
 * out dynamically (lp_par_next), barriers between phases (lp_par_barrier), and thread 0's pointer
 * made everyone's (lp_par_share). With one thread (nth == 1) these cost nothing and the function is
 * the plain serial loop. Nothing is kept between calls: the team lives on the caller's stack, so
 * two contexts with different thread counts in one process do not interfere.
 *
 * Rules a team function keeps: every thread passes the same barriers (lp_par_share is one); one
 * dynamic loop (lp_par_next) per phase, i.e. a barrier between two of them.
 */
#ifndef LP_TEAM_H
#define LP_TEAM_H

#include <stdint.h>

typedef struct lp_team {
    /* (a cache line each for the arrivals, what the waiters spin on, and the unit counters: an
     * arrival does not disturb the spinning threads' copy of gen) */
    _Alignas(64) int _Atomic arrived; /* threads at the current barrier */
    _Alignas(64) unsigned _Atomic gen; /* barriers completed (a futex word) */
    int _Atomic sleepers;              /* threads asleep on gen */
    _Alignas(64) int64_t _Atomic next[2]; /* dynamic units of the even / odd phases */
    int64_t _Atomic err;               /* the first error a thread reported and its phase (0: none) */
    void *_Atomic shared[2];           /* thread 0's pointers of the even / odd phases */
} lp_team;

typedef struct {
    lp_team *team;
    int ith, nth;
    unsigned phase; /* barriers this thread has passed */
} lp_par;

typedef int64_t (*lp_par_fn)(lp_par *p, void *arg);

/* fn(p, arg) on up to n_threads threads, each with its lp_par (one thread, without an OpenMP
 * region: n_threads <= 1, a fork child, or already inside a region). Returns the first error a
 * thread reported (lp_par_fail, or a nonzero return of fn), 0 if none. */
int64_t lp_par_run(int n_threads, lp_par_fn fn, void *arg);

/* every thread of the team waits here for the others (spinning a while, then asleep) */
void lp_par_barrier(lp_par *p);

/* the next unit of this phase's dynamic loop: 0, 1, 2, ... across the team */
int64_t lp_par_next(lp_par *p);

/* thread 0's v, returned to every thread (a barrier) */
void *lp_par_share(lp_par *p, void *v);

/* record an error for the team (the first one stays; 1 .. 2^32-1) / the error reported before
 * this thread's last barrier (0: none) */
void lp_par_fail(lp_par *p, int64_t err);
int64_t lp_par_error(const lp_par *p);

/* A loop over units 0..n-1 handed out dynamically across the team when `par`, else all on thread
 * 0: for (c = lp_par_first(p, par, n); c < n; c = lp_par_then(p, par, c)) */
static inline int64_t lp_par_first(lp_par *p, int par, int64_t n) {
    return par ? lp_par_next(p) : p->ith == 0 ? 0 : n;
}
static inline int64_t lp_par_then(lp_par *p, int par, int64_t c) { return par ? lp_par_next(p) : c + 1; }

/* this thread's share [*a, *b) of n units, static: thread i gets units [i*n/nth, (i+1)*n/nth) */
static inline void lp_par_range(const lp_par *p, int64_t n, int64_t *a, int64_t *b) {
    *a = n * p->ith / p->nth;
    *b = n * (p->ith + 1) / p->nth;
}

#endif
