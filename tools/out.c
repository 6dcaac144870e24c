/* out.c — the bottom of the tools' files (tools/cli.h): one-line errors,
 * reading a file whole, and output written atomically (a temporary beside
 * the target, renamed into place by the commit), with the temporaries a
 * signal removes and the exit-time check of stdout.  It knows nothing of
 * provenance: meta.c's cli_meta_commit adds OUT.meta.json around
 * cli_out_close and cli_out_place. */
#include "cli.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Temporaries to remove if SIGINT, SIGTERM or SIGHUP ends the run (SIGKILL
 * cannot be caught).  The handler only unlinks and write(2)s a message it
 * finds ready (both async-signal-safe), then re-raises the signal with its
 * default action, so the exit status still says which signal it was. */
#define CLI_MAX_TEMPS 8
static const char *volatile cli_temps[CLI_MAX_TEMPS];
static const char *stdout_prog = "kvq";
/* what an interrupted run kept: "<head><count><tail>" (cli_interrupt_note) */
static char intr_head[512], intr_tail[512];
static volatile sig_atomic_t intr_count = -1;

void cli_error(const char *prog, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: error: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

int cli_fail(const char *prog, const kvq_error *err)
{
    cli_error(prog, "%s", err->msg[0] ? err->msg : kvq_strerror(err->status));
    return err->status == KVQ_ERR_USAGE ? CLI_USAGE : CLI_RUNTIME;
}

int cli_write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w, len -= (size_t)w;
    }
    return 0;
}

int cli_write_error(const char *prog, const char *output, kvq_status st, int saved_errno)
{
    const char *what = output && strcmp(output, "-") ? output : "<stdout>";
    if (st == KVQ_ERR_IO && saved_errno) /* e.g. ENOSPC: "No space left on device" */
        cli_error(prog, "%s: write failed: %s", what, strerror(saved_errno));
    else
        cli_error(prog, "%s: %s", what, st == KVQ_ERR_IO ? "write failed" : kvq_strerror(st));
    return CLI_RUNTIME;
}

static void write_str(const char *s) /* to stderr, from the handler */
{
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(STDERR_FILENO, s, n);
        if (w <= 0) return;
        s += w, n -= (size_t)w;
    }
}

static void cli_on_signal(int sig)
{
    int removed = 0;
    for (int i = 0; i < CLI_MAX_TEMPS; i++)
        if (cli_temps[i]) removed += unlink(cli_temps[i]) == 0;
    if (intr_count >= 0) {
        char digits[24], *d = digits + sizeof digits;
        long n = intr_count;
        *--d = '\0';
        do *--d = (char)('0' + n % 10), n /= 10; while (n);
        write_str(intr_head), write_str(d), write_str(intr_tail);
    } else if (removed) {
        write_str(stdout_prog), write_str(": interrupted: nothing written (the unfinished output was removed)\n");
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_signal_handlers(void)
{
    static int installed;
    if (installed) return;
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = cli_on_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(sigs[i], &sa, NULL);
    }
    installed = 1;
}

void cli_temp_register(const char *tmp)
{
    install_signal_handlers();
    for (int i = 0; i < CLI_MAX_TEMPS; i++)
        if (!cli_temps[i]) {
            cli_temps[i] = tmp;
            return;
        }
}

void cli_temp_unregister(const char *tmp)
{
    for (int i = 0; i < CLI_MAX_TEMPS; i++)
        if (cli_temps[i] == tmp) cli_temps[i] = NULL;
}

void cli_interrupt_note(const char *head, const char *tail)
{
    intr_count = -1; /* the handler never reads a half-copied note */
    snprintf(intr_head, sizeof intr_head, "%s", head);
    snprintf(intr_tail, sizeof intr_tail, "%s", tail);
    intr_count = 0;
    install_signal_handlers();
}

void cli_interrupt_count(long n) { intr_count = n; }

/* At exit: output that never reached stdout (/dev/full, a closed pipe) is a
 * failure, exit 1, not a silent 0 (gnulib's close_stdout idiom). */
static void close_stdout(void)
{
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "%s: error: standard output: write failed: %s\n", stdout_prog, strerror(errno ? errno : EIO));
        _exit(CLI_RUNTIME);
    }
}

void cli_check_stdout_at_exit(const char *prog)
{
    stdout_prog = prog;
    atexit(close_stdout);
}

int cli_out_open(cli_out *o, const char *path, const char *prog)
{
    memset(o, 0, sizeof *o);
    if (!path || !strcmp(path, "-")) {
        o->f = stdout;
        return CLI_OK;
    }
    kvq_error err = {0};
    int special = 0, fd = -1;
    if (!(o->path = strdup(path))) {
        cli_error(prog, "%s: out of memory", path);
        return CLI_RUNTIME;
    }
    if (kvq_output_target(path, &o->target, &special, &err)) {
        cli_error(prog, "%s", err.msg);
        cli_out_abort(o);
        return CLI_RUNTIME;
    }
    if (special) { /* a FIFO or a device: write it in place, never replace it */
        if (!(o->f = fopen(o->target, "w"))) {
            cli_error(prog, "%s: cannot open output: %s", path, strerror(errno));
            cli_out_abort(o);
            return CLI_RUNTIME;
        }
        return CLI_OK;
    }
    if (kvq_output_temp(path, o->target, &o->tmp, &fd, &err)) {
        cli_error(prog, "%s", err.msg);
        cli_out_abort(o);
        return CLI_RUNTIME;
    }
    if (!(o->f = fdopen(fd, "w"))) {
        cli_error(prog, "%s: cannot create output: %s", path, strerror(errno));
        close(fd);
        cli_out_abort(o);
        return CLI_RUNTIME;
    }
    cli_temp_register(o->tmp);
    return CLI_OK;
}

int cli_flush(FILE *f, int sync)
{
    if (fflush(f) != 0) return -1;
    if (ferror(f)) {
        errno = EIO;
        return -1;
    }
    return sync && fsync(fileno(f)) != 0 ? -1 : 0;
}

void cli_out_abort(cli_out *o)
{
    if (o->real) { /* --meta inline: f is the memory stream */
        fclose(o->f);
        o->f = o->real;
    }
    if (o->f && o->f != stdout) fclose(o->f);
    if (o->tmp) unlink(o->tmp), cli_temp_unregister(o->tmp);
    free(o->tmp), free(o->path), free(o->target), free(o->buf);
    memset(o, 0, sizeof *o);
}

int cli_read_file(const char *prog, const char *path, char **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *b = NULL;
    size_t n = 0, cap = 0;
    if (!f) {
        cli_error(prog, "%s: cannot open: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    for (;;) {
        if (cap - n < 65536) {
            size_t nc = cap ? 2 * cap : 65536;
            char *nb = realloc(b, nc + 1);
            if (!nb) {
                cli_error(prog, "%s: out of memory", path);
                free(b), fclose(f);
                return CLI_RUNTIME;
            }
            b = nb, cap = nc;
        }
        size_t got = fread(b + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        cli_error(prog, "%s: read failed", path);
        free(b);
        return CLI_RUNTIME;
    }
    b[n] = '\0';
    *buf = b, *len = n;
    return CLI_OK;
}

int cli_out_close(cli_out *o, const char *prog)
{
    int rc = CLI_OK;
    if (o->f == stdout) {
        if (cli_flush(stdout, 0)) {
            cli_error(prog, "<stdout>: write failed: %s", strerror(errno));
            rc = CLI_RUNTIME;
        }
        memset(o, 0, sizeof *o);
        return rc;
    }
    if (cli_flush(o->f, o->tmp != NULL)) { /* ENOSPC says "No space left on device" */
        cli_error(prog, "%s: write failed: %s", o->path, strerror(errno));
        rc = CLI_RUNTIME;
    }
    if (fclose(o->f) != 0 && rc == 0) {
        cli_error(prog, "%s: write failed: %s", o->path, strerror(errno));
        rc = CLI_RUNTIME;
    }
    o->f = NULL;
    return rc;
}

int cli_out_place(cli_out *o, const char *prog, int ok)
{
    int rc = ok ? CLI_OK : CLI_RUNTIME;
    if (rc == CLI_OK && o->tmp && rename(o->tmp, o->target) != 0) {
        cli_error(prog, "%s: cannot rename into place: %s", o->path, strerror(errno));
        rc = CLI_RUNTIME;
    }
    if (rc && o->tmp) unlink(o->tmp);
    if (o->tmp) cli_temp_unregister(o->tmp);
    free(o->tmp), free(o->path), free(o->target);
    memset(o, 0, sizeof *o);
    return rc;
}

int cli_write_csv_header(const char *prog, const char *path, int fd, const char *const *cols, int ncols, int ntext)
{
    char *h = NULL;
    size_t hl = 0;
    FILE *ms = open_memstream(&h, &hl);
    kvq_report *r = ms ? kvq_rows_new(ms, KVQ_FMT_CSV, cols, ncols, ntext) : NULL;
    int bad = !r || kvq_report_header(r) || kvq_report_finish(r);
    if (ms && fclose(ms)) bad = 1;
    if (bad || cli_write_all(fd, h, hl)) {
        free(h);
        cli_error(prog, "%s: write failed: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    free(h);
    return CLI_OK;
}
