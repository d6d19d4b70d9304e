/* PostgreSQL under libfaketime with its timeouts intact (test_soak_crossing.py).

   libfaketime 0.9.10 wraps epoll_wait, poll and select, and stops faking the
   clock while the real call waits. A server process waits there for its
   client; the SIGALRM of a pending timeout then reads the real clock, which is
   weeks past the faked one, and every timeout fires at its first alarm: an
   idle session ended after 6 s however busy it was. Preloaded before
   libfaketime, these wrappers call the C library's own waits, so the clock
   stays faked everywhere and the server's timeouts fire when they are due. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/select.h>

static void *libc(void) {
    static void *handle;
    if (!handle) handle = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    return handle;
}

int epoll_wait(int fd, struct epoll_event *ev, int max, int timeout) {
    static int (*real)(int, struct epoll_event *, int, int);
    if (!real) real = dlsym(libc(), "epoll_wait");
    return real(fd, ev, max, timeout);
}

int epoll_pwait(int fd, struct epoll_event *ev, int max, int timeout, const sigset_t *mask) {
    static int (*real)(int, struct epoll_event *, int, int, const sigset_t *);
    if (!real) real = dlsym(libc(), "epoll_pwait");
    return real(fd, ev, max, timeout, mask);
}

int poll(struct pollfd *fds, nfds_t n, int timeout) {
    static int (*real)(struct pollfd *, nfds_t, int);
    if (!real) real = dlsym(libc(), "poll");
    return real(fds, n, timeout);
}

int select(int n, fd_set *r, fd_set *w, fd_set *e, struct timeval *t) {
    static int (*real)(int, fd_set *, fd_set *, fd_set *, struct timeval *);
    if (!real) real = dlsym(libc(), "select");
    return real(n, r, w, e, t);
}
