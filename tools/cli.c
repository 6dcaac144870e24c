/* cli.c — the tools' shared options and checks (see cli.h): numbers and
 * lists, the analysis and model options, specs and the default set, -o's
 * checks, formats, progress, BLAS set-up and --version. */
#include "cli.h"
#include "kvq_config.h"

#include <errno.h>
#include <limits.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int cli_parse_long(const char *s, long min, long max, long *out)
{
    char *end;
    if (!s || !*s) return -1;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < min || v > max) return -1;
    *out = v;
    return 0;
}

int cli_shard_option(const char *prog, const char *arg, long *i, long *n)
{
    if (!kvq_shard_parse(arg, i, n)) return CLI_OK;
    cli_error(prog, "--shard %s: expected I/N with 0 <= I < N, e.g. 0/4", arg);
    return CLI_USAGE;
}

int cli_parse_u64(const char *s, uint64_t *out)
{
    char *end;
    if (!s || !*s || *s == '-' || *s == '+') return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) return -1;
    *out = (uint64_t)v;
    return 0;
}

int cli_parse_list(const char *s, int max, int **out, int *n)
{
    int *v = NULL, cnt = 0, cap = 0;
    char *copy = strdup(s ? s : ""), *save = NULL;
    if (!copy || !*copy) goto bad;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *dash = strchr(item, '-');
        long a, b;
        if (dash) {
            *dash = '\0';
            if (cli_parse_long(item, 0, max, &a) || cli_parse_long(dash + 1, 0, max, &b) || b < a) goto bad;
        } else {
            if (cli_parse_long(item, 0, max, &a)) goto bad;
            b = a;
        }
        for (long i = a; i <= b; i++) {
            for (int k = 0; k < cnt; k++)
                if (v[k] == i) goto bad; /* duplicates would double-count */
            if (cnt == cap) {
                cap = cap ? 2 * cap : 16;
                int *nv = realloc(v, (size_t)cap * sizeof *nv);
                if (!nv) goto bad;
                v = nv;
            }
            v[cnt++] = (int)i;
        }
    }
    if (cnt == 0) goto bad;
    free(copy);
    *out = v;
    *n = cnt;
    return 0;
bad:
    free(copy);
    free(v);
    return -1;
}

void cli_analysis_init(cli_analysis *a)
{
    memset(a, 0, sizeof *a);
    a->queries = (kvq_query_sel){KVQ_Q_LAST, 64};
    a->per = KVQ_PER_LAYER;
}

void cli_analysis_free(cli_analysis *a)
{
    free(a->layers), free(a->heads);
    a->layers = a->heads = NULL;
    kvq_device_close(a->device);
    a->device = NULL;
}

int cli_analysis_device(const char *prog, cli_analysis *a)
{
    kvq_error err = {0};
    if (!a->cuda || a->device) return CLI_OK;
    return kvq_device_open_cuda(&a->device, &err) ? cli_fail(prog, &err) : CLI_OK;
}

static double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int cli_progress_option(const char *prog, const char *arg, int *mode)
{
    if (!strcmp(arg, "auto")) *mode = isatty(STDERR_FILENO) ? CLI_PROGRESS_LATE : CLI_PROGRESS_NEVER;
    else if (!strcmp(arg, "always")) *mode = CLI_PROGRESS_ALWAYS;
    else if (!strcmp(arg, "never")) *mode = CLI_PROGRESS_NEVER;
    else {
        cli_error(prog, "--progress %s: expected auto, always or never", arg);
        return CLI_USAGE;
    }
    return CLI_OK;
}

void cli_progress_start(cli_progress *p, const char *prog, int mode, const char *name)
{
    p->prog = prog, p->mode = mode, p->name = name, p->t0 = cli_now(), p->width = 0;
}

void cli_progress_stage(void *ud, int layer_index, int nlayers, const char *stage)
{
    cli_progress *p = ud;
    double t = cli_now() - p->t0;
    if (p->mode == CLI_PROGRESS_NEVER || (p->mode == CLI_PROGRESS_LATE && t < 1.0)) return;
    char line[512];
    int n = snprintf(line, sizeof line, "%s: %s: layer %d/%d, %s, %.0f s", p->prog, p->name, layer_index + 1, nlayers,
                     stage, t);
    if (n < 0) return;
    fprintf(stderr, "\r%s%*s", line, p->width > n ? p->width - n : 0, "");
    p->width = n;
    fflush(stderr);
}

void cli_progress_end(cli_progress *p)
{
    if (p->width > 0) fputc('\n', stderr);
    p->width = 0;
}

/* A file the run writes beside OUT (what: how messages name it) must not be
 * one of its inputs, nor anything but a regular file where it exists: a
 * FIFO there would block the run, a directory fail it at the end. */
static int check_side(const char *prog, const char *what, const char *path, const char *const *inputs, int n)
{
    struct stat so, si;
    if (stat(path, &so) != 0) {
        if (lstat(path, &so) == 0) { /* a dangling link or a loop: written through, or refused when written */ }
        return CLI_OK;
    }
    for (int i = 0; i < n; i++)
        if (inputs[i] && stat(inputs[i], &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino) {
            cli_error(prog, "%s (%s): that is an input of this run (%s); nothing written", path, what, inputs[i]);
            return CLI_USAGE;
        }
    if (!S_ISREG(so.st_mode)) {
        cli_error(prog, "%s (%s): not a regular file (a %s); remove it or choose another -o", path, what,
                  S_ISDIR(so.st_mode) ? "directory" : S_ISFIFO(so.st_mode) ? "FIFO" : "device or socket");
        return CLI_USAGE;
    }
    return CLI_OK;
}

int cli_check_output(const char *prog, const char *output, const char *const *inputs, int n)
{
    struct stat so, si;
    if (!output) return CLI_OK;
    if (!*output) {
        cli_error(prog, "-o: expected a file name, got an empty string");
        return CLI_USAGE;
    }
    if (!strcmp(output, "-")) return CLI_OK; /* stdout */
    int exists = stat(output, &so) == 0;
    for (int i = 0; exists && i < n; i++)
        if (inputs[i] && stat(inputs[i], &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino) {
            cli_error(prog, "-o %s: that is an input of this run (%s); nothing written", output, inputs[i]);
            return CLI_USAGE;
        }
    if (exists && !S_ISREG(so.st_mode)) return CLI_OK; /* a FIFO or a device OUT has no meta file */
    /* OUT.meta.json, the provenance record written beside OUT, gets the same checks */
    char *meta = cli_meta_path(output);
    if (!meta) {
        cli_error(prog, "out of memory");
        return CLI_RUNTIME;
    }
    int rc = check_side(prog, "the provenance record of -o", meta, inputs, n);
    free(meta);
    return rc;
}

int cli_check_side_file(const char *prog, const char *what, const char *path, const char *const *inputs, int n)
{
    return check_side(prog, what, path, inputs, n);
}

int cli_check_calib(const char *prog, const kvq_spec *spec, int have_calib)
{
    kvq_error err = {0};
    if (kvq_spec_check_calib(spec, have_calib, &err) == KVQ_OK) return CLI_OK;
    cli_error(prog, "%s; give it with --calib FILE", err.msg);
    return CLI_USAGE;
}

int cli_model_tokens(const char *prog, const kvq_model *m, const cli_model *mo, int **ids, int *T)
{
    const kvq_model_info *in = kvq_model_get_info(m);
    const char *text_path = mo->text, *path = mo->text ? mo->text : mo->tokens;
    long max_tokens = mo->max_tokens;
    int no_context_cut = mo->no_context_cut;
    size_t n;
    kvq_error err = {0};
    kvq_status st;
    /* the tokens the run can use: only as much of the file is read as they need */
    size_t need = max_tokens > 0 ? (size_t)max_tokens : 0;
    if (mo->uses > 0 && (!need || need > (size_t)mo->uses)) need = (size_t)mo->uses;
    if (!no_context_cut && (!need || need > (size_t)in->context_length)) need = (size_t)in->context_length + 1;
    if (text_path) {
        st = kvq_model_tokenize_file(m, path, need, ids, &n, &err);
        if (st == KVQ_ERR_USAGE) { /* an empty text: bad input, not a usage error */
            cli_error(prog, "%s: %s", path, err.msg);
            return CLI_RUNTIME;
        }
    } else {
        st = kvq_tokens_parse_file(path, in->vocab_size, need, ids, &n, &err);
    }
    if (st) {
        int code = cli_fail(prog, &err);
        return st == KVQ_ERR_UNSUPPORTED ? CLI_USAGE : code;
    }
    if (!no_context_cut && n > (size_t)in->context_length) {
        fprintf(stderr, "%s: note: %s: more than %d tokens cut to the model's context length %d\n", prog, path,
                in->context_length, in->context_length);
        n = (size_t)in->context_length;
    }
    if (max_tokens > 0 && n > (size_t)max_tokens) n = (size_t)max_tokens;
    if (n > (size_t)INT32_MAX) {
        fprintf(stderr, "%s: note: %s: %zu tokens cut to 2^31-1\n", prog, path, n);
        n = (size_t)INT32_MAX;
    }
    if (n < 2) {
        cli_error(prog, "%s: %zu token(s): the next-token loss needs at least 2", path, n);
        free(*ids), *ids = NULL;
        return CLI_RUNTIME;
    }
    *T = (int)n;
    return CLI_OK;
}

int cli_model_check(const char *prog, int argc, int optind, const cli_model *mo, const char *synopsis)
{
    if (optind != argc - 1) {
        cli_error(prog, "%s (usage: %s; see --help)", optind >= argc ? "no model given" : "more than one model given",
                  synopsis);
        return CLI_USAGE;
    }
    if (!mo->text == !mo->tokens) {
        cli_error(prog, "give exactly one of --text FILE and --tokens FILE");
        return CLI_USAGE;
    }
    return CLI_OK;
}

int cli_model_load(const char *prog, char **argv, int optind, const cli_model *mo, kvq_model **m, int **ids, int *T)
{
    kvq_error err = {0};
    *m = NULL, *ids = NULL;
    if (kvq_model_open(argv[optind], mo->tokenizer, m, &err)) return cli_fail(prog, &err);
    return cli_model_tokens(prog, *m, mo, ids, T);
}

int cli_push_spec(const char *prog, kvq_spec **specs, int *n, const kvq_spec *sp)
{
    kvq_spec *ns = realloc(*specs, (size_t)(*n + 1) * sizeof *ns);
    if (!ns) {
        cli_error(prog, "out of memory");
        return CLI_RUNTIME;
    }
    *specs = ns;
    ns[(*n)++] = *sp;
    return CLI_OK;
}

int cli_add_spec(const char *prog, kvq_spec **specs, int *n, const char *text)
{
    kvq_error err = {0};
    kvq_spec sp;
    if (kvq_spec_parse(text, &sp, &err)) return cli_fail(prog, &err);
    return cli_push_spec(prog, specs, n, &sp);
}

int cli_add_default_specs(const char *prog, int have_calib, kvq_spec **specs, int *n, char *skipped, size_t len)
{
    for (size_t i = 0; i < kvq_quantizer_count(); i++) {
        const kvq_quantizer *q = kvq_quantizer_at(i);
        if (!kvq_quantizer_in_default_set(q)) continue;
        kvq_spec sp;
        kvq_error err = {0};
        if (kvq_spec_default(q, &sp, &err)) return cli_fail(prog, &err);
        /* needs a calibration: the quantizer always, or its default spec (kvquant's nuq) */
        if (!have_calib && kvq_spec_needs_calib(&sp)) {
            size_t o = skipped ? strlen(skipped) : 0;
            if (skipped) snprintf(skipped + o, len - o, "%s%s", o ? ", " : "", kvq_quantizer_name(q));
            continue;
        }
        int rc = cli_push_spec(prog, specs, n, &sp);
        if (rc) return rc;
    }
    return CLI_OK;
}

int cli_fit_specs_to_head_dim(const char *prog, const char *where, int defaults, kvq_spec *specs, int *n,
                              int head_dim, char *skipped, size_t len)
{
    int kept = 0;
    for (int i = 0; i < *n; i++) {
        kvq_error err = {0};
        if (!specs[i].q || !kvq_spec_check_shape(&specs[i], head_dim, &err)) {
            specs[kept++] = specs[i];
            continue;
        }
        if (!defaults) {
            cli_error(prog, "%s: %s", where, err.msg);
            return CLI_USAGE;
        }
        size_t o = strlen(skipped);
        const char *name = kvq_quantizer_name(specs[i].q);
        if (!strstr(skipped, name)) snprintf(skipped + o, len - o, "%s%s", o ? ", " : "", name);
    }
    *n = kept;
    return CLI_OK;
}

int cli_format_option(const char *prog, const char *arg, const char **format)
{
    if (strcmp(arg, "table") && strcmp(arg, "csv") && strcmp(arg, "jsonl")) {
        cli_error(prog, "--format %s: expected table, csv or jsonl", arg);
        return CLI_USAGE;
    }
    *format = arg;
    return CLI_OK;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

kvq_format cli_pick_format(const char *format, const char *output)
{
    if (format) return !strcmp(format, "table") ? KVQ_FMT_TABLE : !strcmp(format, "csv") ? KVQ_FMT_CSV : KVQ_FMT_JSONL;
    if (output) return ends_with(output, ".jsonl") || ends_with(output, ".json") ? KVQ_FMT_JSONL : KVQ_FMT_CSV;
    return isatty(STDOUT_FILENO) ? KVQ_FMT_TABLE : KVQ_FMT_CSV;
}

const char *cli_format_name(kvq_format fmt)
{
    return fmt == KVQ_FMT_TABLE ? "table" : fmt == KVQ_FMT_CSV ? "csv" : "jsonl";
}

void cli_tune_malloc(void)
{
#ifdef __GLIBC__
    /* explicit values also switch off glibc's dynamic threshold, whose
     * result depended on which large block happened to be freed first */
    mallopt(M_MMAP_THRESHOLD, 32 << 20); /* the most glibc allows on 64-bit */
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

void cli_blas_setup(char **argv)
{
    const char *user = getenv("OPENBLAS_CORETYPE");
    if (user && *user) return; /* the user's choice, or ours after the restart */
    const char *want = kvq_blas_core_wanted();
    if (!want) return;
    const char *detected = kvq_blas_core_detected();
    if (setenv("KVQ_BLAS_CORE_DETECTED", detected, 1) || setenv("OPENBLAS_CORETYPE", want, 1)) return;
    fflush(NULL);
    /* OpenBLAS reads OPENBLAS_CORETYPE when it loads: the program again, /proc/self/exe, unless
       that is the dynamic loader that started this tool (ld.so TOOL ARGS...): then the loader
       again with the tool's path as the loader was told it (argv[0]) */
    struct stat self, tool;
    int argc = 0;
    while (argv[argc]) argc++;
    char **via_loader = NULL;
    if (argv[0] && strchr(argv[0], '/') && stat("/proc/self/exe", &self) == 0 && stat(argv[0], &tool) == 0 &&
        (self.st_dev != tool.st_dev || self.st_ino != tool.st_ino) &&
        (via_loader = calloc((size_t)argc + 2, sizeof *via_loader))) {
        via_loader[0] = "ld.so";
        memcpy(via_loader + 1, argv, (size_t)argc * sizeof *argv);
        execv("/proc/self/exe", via_loader);
    } else
        execv("/proc/self/exe", argv);
    int e = errno;
    free(via_loader);
    unsetenv("OPENBLAS_CORETYPE"), unsetenv("KVQ_BLAS_CORE_DETECTED");
    fprintf(stderr, "%s: note: OpenBLAS runs its %s kernels on a CPU that runs %s ones, and restarting with "
            "OPENBLAS_CORETYPE=%s failed (%s): set it by hand for full speed\n",
            argv[0] ? argv[0] : "kvq", detected, want, want, strerror(e));
}

void cli_version(const char *prog)
{
    kvq_build_info bi;
    kvq_get_build_info(&bi);
    char why[256];
    kvq_blas_core_source(why, sizeof why);
    printf("%s %s (commit %s, SIMD %s%s)\n", prog, bi.version, bi.commit[0] ? bi.commit : "unknown", bi.simd,
           bi.cuda_built ? ", CUDA built" : "");
    const char *cpu = kvq_blas_core_for_cpu();
    printf("BLAS: %s; core %s, %s%s%s\n", bi.blas, bi.blas_core, why, cpu ? "; this CPU runs " : "", cpu ? cpu : "");
}

int cli_main(const char *prog, int argc, char **argv, unsigned flags, int (*run)(int, char **, cli_meta *))
{
    cli_blas_setup(argv);
    cli_check_stdout_at_exit(prog);
    if (flags & CLI_MAIN_TUNE_MALLOC) cli_tune_malloc();
    if (flags & CLI_MAIN_TEMP_HOOKS) kvq_set_temp_hooks(cli_temp_register, cli_temp_unregister);
    cli_meta *m = cli_meta_begin(prog, argc, argv);
    if (!m) {
        cli_error(prog, "out of memory");
        return CLI_RUNTIME;
    }
    int rc = run(argc, argv, m);
    cli_meta_free(m);
    if (rc == CLI_OK) cli_print_notes(prog);
    else kvq_take_notes(NULL, 0); /* a failure says one line: its error */
    return rc;
}

void cli_print_notes(const char *prog)
{
    char buf[4096];
    kvq_take_notes(buf, sizeof buf);
    for (char *line = buf, *nl; *line; line = nl + 1) { /* one "PROG: note: ..." per kind */
        if (!(nl = strchr(line, '\n'))) break;
        fprintf(stderr, "%s: note: %.*s\n", prog, (int)(nl - line), line);
    }
}
