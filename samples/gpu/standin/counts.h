/*
 * A stand-in's own counts, written as one JSON object to the file named by an
 * environment variable when the process exits: the truth the tests compare the
 * tracer's totals with.
 */
#ifndef TT_STANDIN_COUNTS_H
#define TT_STANDIN_COUNTS_H

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

static inline void tt_write_counts(const char *env, const char *const *names,
                                   _Atomic unsigned long long *counts, int n)
{
    const char *path = getenv(env);
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f)
        return;
    fprintf(f, "{");
    for (int i = 0; i < n; i++)
        fprintf(f, "%s\"%s\": %llu", i ? ", " : "", names[i], (unsigned long long)counts[i]);
    fprintf(f, "}\n");
    fclose(f);
}

#endif
