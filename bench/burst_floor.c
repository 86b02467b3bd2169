/* The burst's floor on this machine: `burst_floor` of bench/run.py without Python.
 *
 * Usage: burst_floor CPU OTHERS PID...
 *
 * Pinned to CPU, it opens a pidfd on each PID, gives them deadlines spread evenly
 * over 10 ms from half a second on, pushes them with OTHERS more (due an hour
 * later) onto a binary heap, and then pops what is due and sends each SIGKILL
 * through its pidfd, as fast as it can. It prints each victim's lateness in
 * seconds, from its deadline to just before its signal, one a line. */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct entry {
    double due;
    int fd; /* -1 for the others */
};

static struct entry *heap;
static size_t size;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void push(struct entry item) {
    size_t at = size++;
    while (at > 0 && heap[(at - 1) / 2].due > item.due) {
        heap[at] = heap[(at - 1) / 2];
        at = (at - 1) / 2;
    }
    heap[at] = item;
}

static struct entry pop(void) {
    struct entry top = heap[0], last = heap[--size];
    size_t at = 0;
    for (;;) {
        size_t child = 2 * at + 1;
        if (child >= size) break;
        if (child + 1 < size && heap[child + 1].due < heap[child].due) child++;
        if (heap[child].due >= last.due) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = last;
    return top;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s CPU OTHERS PID...\n", argv[0]);
        return 2;
    }
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(atoi(argv[1]), &cpus);
    sched_setaffinity(0, sizeof cpus, &cpus);
    size_t others = strtoul(argv[2], NULL, 10), victims = (size_t)argc - 3;
    heap = malloc((victims + others) * sizeof *heap);
    double *late = malloc(victims * sizeof *late);
    if (heap == NULL || late == NULL) return 1;
    double due = now() + 0.5;
    for (size_t index = 0; index < victims; index++) {
        int fd = (int)syscall(SYS_pidfd_open, atoi(argv[index + 3]), 0);
        if (fd < 0) {
            perror("pidfd_open");
            return 1;
        }
        push((struct entry){due + 0.010 * (double)index / (double)victims, fd});
    }
    for (size_t index = 0; index < others; index++)
        push((struct entry){due + 3600.0 + (double)index, -1});
    size_t sent = 0;
    while (heap[0].fd != -1) {
        double at = now();
        while (heap[0].due <= at && heap[0].fd != -1) {
            struct entry item = pop();
            late[sent++] = now() - item.due;
            syscall(SYS_pidfd_send_signal, item.fd, SIGKILL, NULL, 0);
        }
    }
    for (size_t index = 0; index < sent; index++) printf("%.9f\n", late[index]);
    return 0;
}
