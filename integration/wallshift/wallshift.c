/*
 * wallshift: an LD_PRELOAD library that shifts the wall clock of one process, and nothing else.
 *
 * The integration tests preload it into Envoy to step Envoy's wall clock mid-run (as an NTP step
 * or a resumed VM does) while its monotonic clock runs on, and check that floodgate's decisions
 * do not change. libfaketime would be the usual tool, but preloaded into Envoy it deadlocks at
 * start-up: its initialisation calls malloc, which is Envoy's tcmalloc, which reads the clock
 * while initialising. This library allocates nothing and calls no libc function that could:
 * raw system calls and getenv only.
 *
 * The shift, in whole seconds (a signed decimal integer), is read from the file named by the
 * environment variable FLOODGATE_WALLSHIFT_FILE, again at most every 100 ms of monotonic time.
 * It applies to CLOCK_REALTIME (and its coarse variant) through clock_gettime, gettimeofday
 * and time. Without the variable, or while the file cannot be read, the shift is 0.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static _Atomic long shift_seconds;
static _Atomic long long next_read_ns;

static long long monotonic_ns(void) {
    struct timespec ts;
    if (syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &ts) != 0) return 0;
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long read_shift(long fallback) {
    const char *path = getenv("FLOODGATE_WALLSHIFT_FILE");
    if (path == NULL) return 0;
    int fd = (int)syscall(SYS_open, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fallback;
    char buf[32];
    long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return fallback;
    buf[n] = 0;
    long value = 0;
    int sign = 1, i = 0, digits = 0;
    if (buf[i] == '+' || buf[i] == '-') sign = buf[i++] == '-' ? -1 : 1;
    for (; buf[i] >= '0' && buf[i] <= '9'; i++, digits++) value = value * 10 + (buf[i] - '0');
    return digits > 0 ? sign * value : fallback;
}

static long current_shift(void) {
    long long now = monotonic_ns();
    if (now >= atomic_load(&next_read_ns)) {
        atomic_store(&next_read_ns, now + 100000000LL);
        atomic_store(&shift_seconds, read_shift(atomic_load(&shift_seconds)));
    }
    return atomic_load(&shift_seconds);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += current_shift();
    return (int)r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    long r = syscall(SYS_gettimeofday, tv, tz);
    if (r == 0 && tv != NULL) tv->tv_sec += current_shift();
    return (int)r;
}

time_t time(time_t *t) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return (time_t)-1;
    if (t != NULL) *t = ts.tv_sec;
    return ts.tv_sec;
}
