/* The load's repeat check (`repeats` in src/kvtier/engine/_fast.c) against the variants tried in
 * session 15, on n random distinct ids of num_blocks: median us per call, hot and after a 64 MiB
 * host write (cold). Any x86/ARM host with gcc:
 *
 *   gcc -O2 -o /tmp/bench_repeat_mask benchmarks/bench_repeat_mask.c && /tmp/bench_repeat_mask 24576 8192
 *
 *   bytes   the byte-per-8-blocks mask with a branch per run of ids (before 9edb36f)
 *   words   64-bit words, branch-free, two chains, the mask fetched first (9edb36f on)
 *   stamps  a 16-bit stamp per block: a store pass, then a load pass comparing (no clear)
 *   popcnt  the words marked, then counted (a repeat leaves fewer bits than ids)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int bytes(const int32_t *ids, long long n, long long nb, uint8_t *seen) {
    long long i = 0, cur = -1;
    uint8_t acc = 0;
    int rc = 0;
    for (; i < n; i++) {
        const long long b = ids[i] >> 3;
        const uint8_t bit = (uint8_t)(1u << (ids[i] & 7));
        if (b != cur) {
            if (cur >= 0) {
                if (seen[cur] & acc) { rc = 2; break; }
                seen[cur] |= acc;
            }
            cur = b;
            acc = 0;
        }
        if (acc & bit) { rc = 2; break; }
        acc |= bit;
    }
    if (rc == 0 && cur >= 0) {
        if (seen[cur] & acc) rc = 2;
        else seen[cur] |= acc;
    }
    const long long nbytes = (nb + 7) / 8;
    if (nbytes <= 8 * i) memset(seen, 0, (size_t)nbytes);
    else for (long long j = 0; j < i; j++) seen[ids[j] >> 3] = 0;
    return rc;
}

static int words(const int32_t *ids, long long n, long long nb, uint64_t *seen) {
    uint64_t d0 = 0, d1 = 0;
    long long i = 0;
    const long long w = (nb + 63) / 64;
    if (w <= n)
        for (long long k = 0; k < w; k += 8) __builtin_prefetch(seen + k, 1);
    for (; i + 2 <= n; i += 2) {
        const uint32_t a = (uint32_t)ids[i], b = (uint32_t)ids[i + 1];
        const uint64_t ba = 1ULL << (a & 63), bb = 1ULL << (b & 63);
        const uint64_t wa = seen[a >> 6];
        d0 |= wa & ba;
        seen[a >> 6] = wa | ba;
        const uint64_t wb = seen[b >> 6];
        d1 |= wb & bb;
        seen[b >> 6] = wb | bb;
    }
    for (; i < n; i++) {
        const uint32_t a = (uint32_t)ids[i];
        const uint64_t ba = 1ULL << (a & 63), wa = seen[a >> 6];
        d0 |= wa & ba;
        seen[a >> 6] = wa | ba;
    }
    if (w <= n) memset(seen, 0, (size_t)w * 8);
    else for (long long j = 0; j < n; j++) seen[(uint32_t)ids[j] >> 6] = 0;
    return (d0 | d1) ? 2 : 0;
}

static int stamps(const int32_t *ids, long long n, long long nb, uint16_t *st) {
    (void)nb;
    for (long long i = 0; i < n; i++) st[ids[i]] = (uint16_t)i;
    unsigned bad = 0;
    for (long long i = 0; i < n; i++) bad |= (unsigned)(st[ids[i]] ^ (uint16_t)i);
    return bad ? 2 : 0;
}

static int popcnt(const int32_t *ids, long long n, long long nb, uint64_t *m) {
    const long long w = (nb + 63) / 64;
    long long c = 0;
    for (long long i = 0; i < n; i++) m[(uint32_t)ids[i] >> 6] |= 1ULL << (ids[i] & 63);
    for (long long k = 0; k < w; k++) {
        c += __builtin_popcountll(m[k]);
        m[k] = 0;
    }
    return c != n ? 2 : 0;
}

static int cmp64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const long long nb = argc > 1 ? atoll(argv[1]) : 24576, n = argc > 2 ? atoll(argv[2]) : 8192;
    if (nb < 1 || n < 1 || n > nb || n > 65536) {
        fprintf(stderr, "usage: %s num_blocks n  (1 <= n <= num_blocks, n <= 65536)\n", argv[0]);
        return 2;
    }
    int32_t *ids = malloc((size_t)nb * 4);
    for (long long i = 0; i < nb; i++) ids[i] = (int32_t)i;
    srand(1);
    for (long long i = nb - 1; i > 0; i--) {
        const long long j = rand() % (i + 1);
        const int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    uint8_t *s8 = calloc((size_t)nb / 8 + 2, 1);
    uint64_t *s64 = calloc((size_t)nb / 64 + 2, 8);
    uint16_t *s16 = calloc((size_t)nb + 1, 2);
    char *junk = malloc(64 << 20);
    const char *names[] = {"bytes", "words", "stamps", "popcnt"};
    for (int cold = 0; cold < 2; cold++)
        for (int v = 0; v < 4; v++) {
            int64_t t[200];
            const int reps = cold ? 60 : 200;
            for (int r = 0; r < reps; r++) {
                if (cold) memset(junk, r, 64 << 20);
                const int64_t t0 = now();
                const int rc = v == 0 ? bytes(ids, n, nb, s8) : v == 1 ? words(ids, n, nb, s64)
                             : v == 2 ? stamps(ids, n, nb, s16) : popcnt(ids, n, nb, s64);
                t[r] = now() - t0;
                if (rc) { fprintf(stderr, "%s: a repeat in distinct ids\n", names[v]); return 1; }
            }
            qsort(t, (size_t)reps, sizeof t[0], cmp64);
            printf("%-6s %s  %lld ids of %lld blocks  median %.2f us\n", names[v], cold ? "cold" : "hot ", n, nb,
                   t[reps / 2] / 1e3);
        }
    return 0;
}
