/* meta.c — provenance: the record a run keeps of itself in OUT.meta.json
 * (docs/tools.md#provenance): the kvq build, the command line and directory,
 * each input's path, size, mtime and SHA-256, every option's effective value,
 * the model behind a kvq-eval row, the times and the peak memory.
 *
 * The file is one JSON object whose runs are one line each, so that a sweep's
 * --resume appends a line and --merge joins its shards' lines without a JSON
 * parser in C:
 *   {"kvq_meta": 1, "output": "OUT", "runs": [
 *   {...run 1...},
 *   {...run 2...}
 *   ]}
 */
#define _GNU_SOURCE /* vasprintf */
#include "cli.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define META_HEAD "{\"kvq_meta\": 1, \"output\": "

typedef struct meta_input {
    char *role, *path;
    struct stat st; /* at cli_meta_input: compared again when the record is written */
    int stat_errno;
    int extended;   /* the run appends to it itself (a resumed file): growing is no change */
    int noted;      /* its "not a regular file" note printed */
    cli_hash_job *job; /* its hash in the background (NULL: hashed when the record is written) */
    char sha[65]; /* once hashed ("" before): a sweep writes its record twice */
    int cached;   /* sha from the cache of unchanged files (cli_hash_cache_lookup) */
    int stored;   /* sha put in that cache by this run */
} meta_input;

typedef struct meta_entry {
    const char *section; /* "options", "model" or "result" */
    char *key;
    char *json; /* the value as JSON text; a list's items without the brackets */
    int is_list;
} meta_entry;

struct cli_meta {
    const char *tool;
    char *command, *operands; /* JSON arrays */
    char *cwd;
    char start[40];
    struct timespec t0;
    meta_input *inputs;
    int ninputs;
    meta_entry *ents;
    int nents;
    char *prior; /* earlier runs' lines, joined by ",\n" */
    char *run;   /* this run's line as last rendered: the inline record and the file share it */
    cli_hasher *hasher; /* hashes the inputs while the run works */
    int hashing;        /* a record will be written (cli_out_attach_meta): hash the inputs from now on */
    int inline_line, no_hash, nomem;
};

/* ------------------------------------------------------------ JSON text */

typedef struct {
    char *s;
    size_t len, cap;
    int nomem;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->nomem) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *ns = realloc(b->s, cap);
        if (!ns) { b->nomem = 1; return; }
        b->s = ns, b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *tmp = NULL;
    int n = vasprintf(&tmp, fmt, ap);
    va_end(ap);
    if (n < 0) { b->nomem = 1; return; }
    sb_put(b, tmp, (size_t)n);
    free(tmp);
}

/* Length of the valid UTF-8 sequence at s, or 0 if the byte starts none. */
static int utf8_len(const unsigned char *s)
{
    int n = s[0] < 0x80 ? 1 : (s[0] & 0xe0) == 0xc0 && s[0] >= 0xc2 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3
            : (s[0] & 0xf8) == 0xf0 && s[0] <= 0xf4 ? 4 : 0;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80) return 0;
    return n;
}

/* s as a JSON string; a byte that is not UTF-8 (a path may hold any) is
 * written as the code point of the same value, so the file stays JSON. */
static void sb_json(sbuf *b, const char *s)
{
    if (!s) { sb_str(b, "null"); return; }
    sb_str(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        int n = utf8_len(p);
        if (*p == '"' || *p == '\\') {
            char e[2] = {'\\', (char)*p};
            sb_put(b, e, 2);
        } else if (*p == '\n') sb_str(b, "\\n");
        else if (*p == '\t') sb_str(b, "\\t");
        else if (*p < 0x20 || n == 0) sb_printf(b, "\\u%04x", *p);
        else { sb_put(b, (const char *)p, (size_t)n); p += n; continue; }
        p++;
    }
    sb_str(b, "\"");
}

static char *json_dup(const char *s)
{
    sbuf b = {0};
    sb_json(&b, s);
    if (b.nomem) { free(b.s); return NULL; }
    return b.s;
}

/* "2026-11-24T10:28:20Z", or with nanoseconds when ns >= 0. */
static void iso_time(char *buf, size_t len, time_t t, long ns)
{
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(buf, len, "%Y-%m-%dT%H:%M:%S", &tm);
    if (ns >= 0) snprintf(buf + n, len - n, ".%09ldZ", ns);
    else snprintf(buf + n, len - n, "Z");
}

/* v[0..n) as a JSON array of strings (malloc'ed; NULL when out of memory). */
static char *json_strings(char *const *v, int n)
{
    sbuf b = {0};
    sb_str(&b, "[");
    for (int i = 0; i < n; i++) {
        if (i) sb_str(&b, ", ");
        sb_json(&b, v[i]);
    }
    sb_str(&b, "]");
    if (b.nomem) { free(b.s); return NULL; }
    return b.s;
}

/* ------------------------------------------------------------- recording */

cli_meta *cli_meta_begin(const char *tool, int argc, char **argv)
{
    cli_meta *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->tool = tool;
    m->nomem |= !(m->command = json_strings(argv, argc));
    m->cwd = getcwd(NULL, 0); /* NULL (written as null) when it cannot be known */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    iso_time(m->start, sizeof m->start, now.tv_sec, -1);
    clock_gettime(CLOCK_MONOTONIC, &m->t0);
    return m;
}

void cli_meta_free(cli_meta *m)
{
    if (!m) return;
    cli_hasher_free(m->hasher);
    for (int i = 0; i < m->ninputs; i++) free(m->inputs[i].role), free(m->inputs[i].path);
    for (int i = 0; i < m->nents; i++) free(m->ents[i].key), free(m->ents[i].json);
    free(m->inputs), free(m->ents), free(m->command), free(m->operands), free(m->cwd), free(m->prior), free(m->run);
    free(m);
}

/* --meta and --no-hash, the record's own options (cli_getopt parses them
 * for every tool; the record writes them beside the tool's options). */
static const char *const meta_where[] = {"file", "inline", NULL};
const cli_optrow cli_meta_rows[] = {
    {.name = "meta", .key = CLI_OPT_META, .arg = CLI_ARG_CHOICE, .offset = offsetof(cli_meta, inline_line),
     .choices = meta_where, .metavar = "WHERE",
     .help = "file (default): the run's provenance in OUT.meta.json; inline: also as the first line of jsonl output"},
    {.name = "no-hash", .key = CLI_OPT_NO_HASH, .arg = CLI_ARG_FLAG, .offset = offsetof(cli_meta, no_hash),
     .help = "record the inputs' size and mtime, not their SHA-256"},
};
const int cli_meta_nrows = sizeof cli_meta_rows / sizeof cli_meta_rows[0];

int cli_meta_check_format(const char *prog, const cli_meta *m, kvq_format fmt)
{
    if (m->inline_line && fmt != KVQ_FMT_JSONL) {
        cli_error(prog, "--meta inline: needs --format jsonl (the record is the first JSON line of OUT)");
        return CLI_USAGE;
    }
    return CLI_OK;
}

void cli_meta_operands(cli_meta *m, char *const *v, int n)
{
    free(m->operands);
    m->nomem |= !(m->operands = json_strings(v, n));
}

/* in's SHA-256 from the cache of unchanged files (an earlier run on the
 * file as it is), if it is there: 1, else 0.  Read only once a record
 * will use it. */
static int from_cache(meta_input *in)
{
    if (in->sha[0]) return 1;
    if (cli_hash_cache_lookup(&in->st, in->sha)) return 0;
    return in->cached = 1;
}

/* in's hash, started in the background: the bytes it has now (an extended
 * input's are its first st_size bytes, the whole file in that state too).
 * Not for an input known from the cache, not a regular file, or under
 * --no-hash; a record rendered before the hash ends waits for it, one
 * rendered without a job hashes the file then. */
static void start_hash(cli_meta *m, meta_input *in)
{
    if (m->no_hash || in->stat_errno || !S_ISREG(in->st.st_mode) || in->job || from_cache(in)) return;
    if (m->hasher || (m->hasher = cli_hasher_new()))
        in->job = cli_hasher_add(m->hasher, in->path, (long long)in->st.st_size);
}

static void add_input(cli_meta *m, const char *role, const char *path, int extended)
{
    if (!path) return;
    meta_input *ni = realloc(m->inputs, (size_t)(m->ninputs + 1) * sizeof *ni);
    if (!ni) { m->nomem = 1; return; }
    m->inputs = ni;
    meta_input *in = &ni[m->ninputs];
    memset(in, 0, sizeof *in);
    if (!(in->role = strdup(role)) || !(in->path = strdup(path))) {
        free(in->role), free(in->path);
        m->nomem = 1;
        return;
    }
    in->stat_errno = stat(path, &in->st) ? errno : 0;
    in->extended = extended;
    m->ninputs++; /* its hash from the cache, or computed while the run works, once a record is sure to be written */
    if (m->hashing) start_hash(m, in);
}

void cli_meta_input(cli_meta *m, const char *role, const char *path) { add_input(m, role, path, 0); }

void cli_meta_input_extended(cli_meta *m, const char *role, const char *path) { add_input(m, role, path, 1); }

void cli_meta_share_reading(const cli_meta *m, kvq_dump *d)
{
    if (!m || !m->hasher || kvq_threads(0) >= 3) return;
    for (int i = 0; i < m->ninputs; i++)
        if (m->inputs[i].job && !cli_hash_job_done(m->hasher, m->inputs[i].job)) {
            kvq_dump_set_read_threads(d, 1);
            return;
        }
}

/* Sets (or, for a list, appends to) section.key: json is the value as JSON
 * text, owned by the record from here on. */
static void put(cli_meta *m, const char *section, const char *key, char *json, int is_list)
{
    if (!json) { m->nomem = 1; return; }
    for (int i = 0; i < m->nents; i++) {
        meta_entry *e = &m->ents[i];
        if (e->section != section && strcmp(e->section, section)) continue;
        if (strcmp(e->key, key)) continue;
        if (is_list && e->is_list) { /* one more item */
            sbuf b = {e->json, strlen(e->json), strlen(e->json) + 1, 0};
            if (b.len) sb_str(&b, ", ");
            sb_str(&b, json);
            free(json);
            if (b.nomem) { m->nomem = 1; return; }
            e->json = b.s;
            return;
        }
        free(e->json);
        e->json = json, e->is_list = is_list;
        return;
    }
    meta_entry *ne = realloc(m->ents, (size_t)(m->nents + 1) * sizeof *ne);
    char *k = strdup(key);
    if (!ne || !k) {
        if (ne) m->ents = ne;
        free(k), free(json);
        m->nomem = 1;
        return;
    }
    m->ents = ne;
    ne[m->nents++] = (meta_entry){section, k, json, is_list};
}

void cli_meta_str(cli_meta *m, const char *section, const char *key, const char *val)
{
    put(m, section, key, json_dup(val), 0);
}

void cli_meta_list(cli_meta *m, const char *section, const char *key, const char *val)
{
    put(m, section, key, json_dup(val), 1);
}

void cli_meta_empty_list(cli_meta *m, const char *section, const char *key)
{
    put(m, section, key, strdup(""), 1);
}

void cli_meta_int(cli_meta *m, const char *section, const char *key, long long val)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", val);
    put(m, section, key, strdup(buf), 0);
}

void cli_meta_int_set(cli_meta *m, const char *section, const char *key, long long val)
{
    if (val) cli_meta_int(m, section, key, val);
    else put(m, section, key, strdup("null"), 0);
}

void cli_meta_u64(cli_meta *m, const char *section, const char *key, uint64_t val)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)val);
    put(m, section, key, strdup(buf), 0);
}

void cli_meta_double(cli_meta *m, const char *section, const char *key, double val)
{
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", val);
    put(m, section, key, strdup(buf), 0);
}

void cli_meta_bool(cli_meta *m, const char *section, const char *key, int val)
{
    put(m, section, key, strdup(val ? "true" : "false"), 0);
}

void cli_meta_ints(cli_meta *m, const char *section, const char *key, const int *v, int n)
{
    if (!v) { put(m, section, key, strdup("null"), 0); return; }
    sbuf b = {0};
    sb_str(&b, "[");
    for (int i = 0; i < n; i++) sb_printf(&b, "%s%d", i ? ", " : "", v[i]);
    sb_str(&b, "]");
    put(m, section, key, b.nomem ? (free(b.s), (char *)NULL) : b.s, 0);
}

void cli_meta_prior_runs(cli_meta *m, const char *runs)
{
    if (!runs || !runs[0]) return;
    sbuf b = {m->prior, m->prior ? strlen(m->prior) : 0, m->prior ? strlen(m->prior) + 1 : 0, 0};
    if (b.len) sb_str(&b, ",\n");
    sb_str(&b, runs);
    m->nomem |= b.nomem;
    m->prior = b.s;
}

int cli_meta_read_runs(const char *prog, const char *meta_path, char **runs)
{
    *runs = NULL;
    char *text;
    size_t len;
    struct stat st;
    if (stat(meta_path, &st) != 0) {
        if (errno == ENOENT) return CLI_OK;
        cli_error(prog, "%s: cannot read: %s", meta_path, strerror(errno));
        return CLI_RUNTIME;
    }
    if (!S_ISREG(st.st_mode)) { /* a FIFO would block the read */
        cli_error(prog, "%s: not a regular file: not a kvq meta file", meta_path);
        return CLI_RUNTIME;
    }
    if (cli_read_file(prog, meta_path, &text, &len)) return CLI_RUNTIME;
    char *nl = strchr(text, '\n');
    if (strncmp(text, META_HEAD, strlen(META_HEAD)) || !nl || nl[-1] != '[') {
        cli_error(prog, "%s: not a kvq meta file (expected a first line %s...\"runs\": [)", meta_path, META_HEAD);
        free(text);
        return CLI_RUNTIME;
    }
    sbuf b = {0};
    int closed = 0;
    int lineno = 1;
    for (char *line = nl + 1; *line && !closed;) {
        char *end = strchr(line, '\n');
        lineno++;
        size_t n = end ? (size_t)(end - line) : strlen(line);
        if (n >= 2 && !strncmp(line, "]}", 2)) closed = 1;
        else if (n && line[0] == '{') {
            if (line[n - 1] == ',') n--;
            char why[200];
            if (kvq_json_check(line, n, why, sizeof why)) { /* copied as it is: it must be JSON */
                cli_error(prog, "%s: line %d: a run that is not JSON (an edited meta file?): %s", meta_path, lineno,
                          why);
                free(text), free(b.s);
                return CLI_RUNTIME;
            }
            if (b.len) sb_str(&b, ",\n");
            sb_put(&b, line, n);
        } else if (n) break;
        line = end ? end + 1 : line + n;
    }
    free(text);
    if (!closed) {
        free(b.s);
        cli_error(prog, "%s: truncated or edited kvq meta file (no closing ]} line)", meta_path);
        return CLI_RUNTIME;
    }
    if (b.nomem) { free(b.s); cli_error(prog, "out of memory"); return CLI_RUNTIME; }
    *runs = b.s;
    return CLI_OK;
}

/* ------------------------------------------------------------- the record */

static void sb_section(sbuf *b, const cli_meta *m, const char *section)
{
    int first = 1;
    for (int i = 0; i < m->nents; i++) {
        const meta_entry *e = &m->ents[i];
        if (strcmp(e->section, section)) continue;
        sb_str(b, first ? "" : ", ");
        first = 0;
        sb_json(b, e->key);
        sb_str(b, ": ");
        if (e->is_list) sb_str(b, "[");
        sb_str(b, e->json);
        if (e->is_list) sb_str(b, "]");
    }
}

static int has_section(const cli_meta *m, const char *section)
{
    for (int i = 0; i < m->nents; i++)
        if (!strcmp(m->ents[i].section, section)) return 1;
    return 0;
}

/* One input: path, size, mtime, SHA-256 of its bytes when the run began
 * (null with --no-hash), and changed_during_run when its size, mtime or
 * ctime (which no one can set back) moved since. */
static int sb_input(sbuf *b, cli_meta *m, meta_input *in, int hash, const char *prog)
{
    if (in->stat_errno) {
        cli_error(prog, "%s: cannot record it: %s", in->path, strerror(in->stat_errno));
        return CLI_RUNTIME;
    }
    char mt[48];
    iso_time(mt, sizeof mt, in->st.st_mtim.tv_sec, in->st.st_mtim.tv_nsec);
    sb_str(b, "{\"role\": ");
    sb_json(b, in->role);
    sb_str(b, ", \"path\": ");
    sb_json(b, in->path);
    char *abs = realpath(in->path, NULL);
    sb_str(b, ", \"realpath\": ");
    sb_json(b, abs);
    free(abs);
    int hashable = S_ISREG(in->st.st_mode);
    if (hashable) sb_printf(b, ", \"size\": %lld", (long long)in->st.st_size);
    else { /* a FIFO, a character device: read as it came, once */
        sb_printf(b, ", \"size\": null, \"note\": \"not a regular file (%s): read once as its bytes came; no size or "
                     "SHA-256 can be recorded\"", S_ISFIFO(in->st.st_mode) ? "a FIFO" : S_ISCHR(in->st.st_mode) ?
                     "a character device" : "not a file");
        if (!in->noted) fprintf(stderr, "%s: note: %s is not a regular file: its record has no size or SHA-256\n",
                                prog, in->path);
        in->noted = 1;
    }
    sb_printf(b, ", \"mtime\": \"%s\", \"sha256\": ", mt);
    if (hash && hashable) {
        int e = 0;
        if (!in->job) from_cache(in); /* a record without a job: known from the cache, or hashed here */
        if (!in->sha[0] && (in->job ? cli_hash_job_wait(m->hasher, in->job, in->sha, &e)
                                    : cli_sha256_file_prefix(in->path, (long long)in->st.st_size, in->sha, &e))) {
            in->sha[0] = '\0';
            if (e == EIO)
                cli_error(prog, "%s: it is shorter than when the run began (%lld bytes): cannot record its SHA-256",
                          in->path, (long long)in->st.st_size);
            else
                cli_error(prog, "%s: cannot read it to record its SHA-256: %s", in->path, strerror(e));
            return CLI_RUNTIME;
        }
        sb_printf(b, "\"%s\"", in->sha);
        if (in->cached) sb_str(b, ", \"sha256_cached\": true");
    } else sb_str(b, "null");
    struct stat now;
    int changed = hashable && stat(in->path, &now) == 0 &&
                  (in->extended ? now.st_size < in->st.st_size
                                : now.st_size != in->st.st_size || now.st_mtim.tv_sec != in->st.st_mtim.tv_sec ||
                                      now.st_mtim.tv_nsec != in->st.st_mtim.tv_nsec ||
                                      now.st_ctim.tv_sec != in->st.st_ctim.tv_sec ||
                                      now.st_ctim.tv_nsec != in->st.st_ctim.tv_nsec);
    if (changed) sb_str(b, ", \"changed_during_run\": true");
    else if (hash && hashable && !in->cached && !in->stored && !in->extended) /* the next run need not read it */
        cli_hash_cache_store(in->path, &in->st, in->sha), in->stored = 1;
    sb_str(b, "}");
    return CLI_OK;
}

/* The record's "kvq": the build, and the BLAS kernels in use and why (docs/performance.md#blas-kernels). */
static void sb_build(sbuf *sb)
{
    kvq_build_info bi;
    kvq_get_build_info(&bi);
    sb_str(sb, ", \"kvq\": {\"version\": ");
    sb_json(sb, bi.version);
    sb_str(sb, ", \"commit\": ");
    sb_json(sb, bi.commit[0] ? bi.commit : NULL);
    sb_str(sb, ", \"simd\": ");
    sb_json(sb, bi.simd);
    sb_str(sb, ", \"blas\": ");
    sb_json(sb, bi.blas);
    char why[256];
    kvq_blas_core_source(why, sizeof why);
    sb_str(sb, ", \"blas_core\": ");
    sb_json(sb, bi.blas_core);
    sb_str(sb, ", \"blas_core_source\": ");
    sb_json(sb, why);
    sb_printf(sb, ", \"cuda_built\": %s}", bi.cuda_built ? "true" : "false");
}

/* The run as one line of JSON, ended now; NULL after printing why. */
static char *run_json(cli_meta *m, const char *prog, const char *out_sha256)
{
    sbuf b = {0};
    struct timespec now, t1;
    clock_gettime(CLOCK_REALTIME, &now);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    char end[40], host[256] = "";
    iso_time(end, sizeof end, now.tv_sec, -1);
    if (gethostname(host, sizeof host - 1)) host[0] = '\0';
    struct rusage ru;
    long long peak = getrusage(RUSAGE_SELF, &ru) == 0 ? (long long)ru.ru_maxrss * 1024 : -1;

    sb_str(&b, "{\"tool\": ");
    sb_json(&b, m->tool);
    sb_build(&b);
    sb_printf(&b, ", \"command\": %s, \"cwd\": ", m->command ? m->command : "null");
    sb_json(&b, m->cwd);
    sb_str(&b, ", \"host\": ");
    sb_json(&b, host[0] ? host : NULL);
    sb_str(&b, ", \"inputs\": [");
    for (int i = 0; i < m->ninputs; i++) {
        if (i) sb_str(&b, ", ");
        if (sb_input(&b, m, &m->inputs[i], !m->no_hash, prog)) { free(b.s); return NULL; }
    }
    sb_printf(&b, "], \"operands\": %s", m->operands ? m->operands : "[]");
    sb_str(&b, ", \"hashed\": ");
    sb_str(&b, m->no_hash ? "false" : "true");
    sb_str(&b, ", \"options\": {");
    sb_section(&b, m, "options");
    sb_printf(&b, "%s\"meta\": \"%s\", \"no-hash\": %s}", has_section(m, "options") ? ", " : "",
              m->inline_line ? "inline" : "file", m->no_hash ? "true" : "false");
    if (has_section(m, "model")) {
        sb_str(&b, ", \"model\": {");
        sb_section(&b, m, "model");
        sb_str(&b, "}");
    }
    if (has_section(m, "result")) {
        sb_str(&b, ", \"result\": {");
        sb_section(&b, m, "result");
        sb_str(&b, "}");
    }
    sb_str(&b, ", \"output_sha256\": ");
    sb_json(&b, out_sha256);
    double secs = (double)(t1.tv_sec - m->t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - m->t0.tv_nsec);
    sb_printf(&b, ", \"start\": \"%s\", \"end\": \"%s\", \"seconds\": %.3f, \"peak_rss_bytes\": %lld}", m->start, end,
              secs, peak);
    if (b.nomem || m->nomem) {
        free(b.s);
        cli_error(prog, "out of memory");
        return NULL;
    }
    return b.s;
}

/* The whole file (or, one_line, the inline record): earlier runs, then this one. */
static char *document(const cli_meta *m, const char *output, const char *run, int one_line)
{
    sbuf b = {0};
    const char *sep = one_line ? " " : "\n";
    sb_str(&b, META_HEAD);
    sb_json(&b, output);
    sb_printf(&b, ", \"runs\": [%s", sep);
    if (m->prior) {
        if (one_line) {
            for (const char *p = m->prior; *p; p++) sb_put(&b, *p == '\n' ? " " : p, 1);
        } else sb_str(&b, m->prior);
        sb_printf(&b, ",%s", sep);
    }
    sb_str(&b, run);
    sb_printf(&b, "%s]}\n", sep);
    if (b.nomem) { free(b.s); return NULL; }
    return b.s;
}

char *cli_meta_path(const char *output)
{
    size_t n = strlen(output);
    char *p = malloc(n + sizeof ".meta.json");
    if (p) memcpy(p, output, n), memcpy(p + n, ".meta.json", sizeof ".meta.json");
    return p;
}

int cli_meta_inline(const cli_meta *m) { return m->inline_line; }

char *cli_meta_render(cli_meta *m, const char *prog, const char *output, const char *out_sha256, int one_line)
{
    if (!m->run && !(m->run = run_json(m, prog, out_sha256))) return NULL;
    char *doc = document(m, output, m->run, one_line);
    if (!doc) cli_error(prog, "out of memory");
    return doc;
}

int cli_meta_write(cli_meta *m, const char *prog, const char *output, const char *out_sha256)
{
    char *path = cli_meta_path(output), *doc = NULL;
    cli_out mo = {0};
    int rc = CLI_RUNTIME;
    if (!path) { cli_error(prog, "out of memory"); return CLI_RUNTIME; }
    free(m->run); /* a sweep writes its record twice: at its start and at its end */
    m->run = NULL;
    if (!(doc = cli_meta_render(m, prog, output, out_sha256, 0))) goto done;
    if (cli_out_open(&mo, path, prog)) goto done;
    if (fputs(doc, mo.f) == EOF) { /* the commit reports the write error */ }
    rc = cli_meta_commit(&mo, prog) ? CLI_RUNTIME : CLI_OK;
done:
    if (mo.f) cli_out_abort(&mo);
    free(path), free(doc);
    return rc;
}

int cli_meta_drop(const char *prog, const char *output)
{
    char *path = cli_meta_path(output);
    if (!path) { cli_error(prog, "out of memory"); return CLI_RUNTIME; }
    int rc = unlink(path) != 0 && errno != ENOENT ? CLI_RUNTIME : CLI_OK;
    if (rc) cli_error(prog, "%s: cannot replace it: %s", path, strerror(errno));
    free(path);
    return rc;
}

int cli_meta_write_hashed(cli_meta *m, const char *prog, const char *output)
{
    char hex[65];
    int e;
    if (!m->no_hash && cli_sha256_file(output, hex, &e)) {
        cli_error(prog, "%s: cannot read it back: %s", output, strerror(e));
        return CLI_RUNTIME;
    }
    return cli_meta_write(m, prog, output, m->no_hash ? NULL : hex);
}

/* ------------------------------- OUT with its record (cli_out_attach_meta) */

int cli_out_attach_meta(cli_out *o, cli_meta *m, const char *prog)
{
    o->meta = m;
    /* a record comes with a regular-file OUT or inline: its inputs' hashes
     * run from now on, beside the work (only then: on stdout without
     * --meta inline nothing would wait for them, and a background hash
     * costs a 2-core machine a fifth of a one-layer analysis) */
    if (m && (o->tmp || m->inline_line) && !m->hashing) {
        m->hashing = 1;
        for (int i = 0; i < m->ninputs; i++) start_hash(m, &m->inputs[i]);
    }
    if (!m || !cli_meta_inline(m)) return CLI_OK;
    o->real = o->f; /* the rows wait in memory for the record that precedes them */
    if (!(o->f = open_memstream(&o->buf, &o->buflen))) {
        o->f = o->real, o->real = NULL;
        cli_error(prog, "out of memory");
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

/* The provenance of a finished OUT: with --meta inline the record line and
 * the rows go to OUT; for a regular-file OUT, OUT.meta.json is written to
 * its own temporary (*mo, committed after OUT).  0, or -1 after printing. */
static int meta_prepare(cli_out *o, const char *prog, cli_out *mo, char **metapath)
{
    const char *name = o->path ? o->path : "-";
    char hex[65];
    const char *sha = NULL;
    char *line = NULL, *doc = NULL;
    int rc = CLI_RUNTIME;
    if (o->real) { /* inline: hash the rows, then write the record and the rows */
        int bad = fclose(o->f);
        o->f = o->real, o->real = NULL;
        if (bad) { cli_error(prog, "out of memory"); goto done; }
        if (cli_sha256_mem(o->buf, o->buflen, hex)) { cli_error(prog, "%s: SHA-256 failed (libcrypto)", name); goto done; }
        sha = hex;
        if (!(line = cli_meta_render(o->meta, prog, name, sha, 1))) goto done;
        if (fputs(line, o->f) == EOF || fwrite(o->buf, 1, o->buflen, o->f) != o->buflen) {
            cli_error(prog, "%s: write failed: %s", name, strerror(errno));
            goto done;
        }
    } else if (o->tmp) { /* a regular file: hash what was written */
        int e = 0;
        if (cli_flush(o->f, 0) || cli_sha256_file(o->tmp, hex, &e)) {
            cli_error(prog, "%s: %s: %s", name, e ? "cannot read it back" : "write failed", strerror(e ? e : errno));
            goto done;
        }
        sha = hex;
    }
    if (o->tmp) {
        if (!(*metapath = cli_meta_path(o->path))) { cli_error(prog, "out of memory"); goto done; }
        if (!(doc = cli_meta_render(o->meta, prog, o->path, sha, 0))) goto done;
        if (cli_out_open(mo, *metapath, prog)) goto done;
        fputs(doc, mo->f); /* a failed write shows at its commit */
    }
    rc = CLI_OK;
done:
    free(line), free(doc), free(o->buf);
    o->buf = NULL;
    return rc;
}

int cli_meta_commit(cli_out *o, const char *prog)
{
    cli_out mo = {0};
    char *metapath = NULL;
    if (o->meta && meta_prepare(o, prog, &mo, &metapath)) {
        cli_out_abort(o);
        free(metapath);
        return CLI_RUNTIME;
    }
    if (o->f == stdout) return cli_out_close(o, prog);
    int rc = cli_out_close(o, prog);
    /* an old OUT.meta.json goes before the new OUT takes its place */
    if (rc == CLI_OK && metapath && cli_meta_drop(prog, o->path)) rc = CLI_RUNTIME;
    if (cli_out_place(o, prog, rc == CLI_OK)) rc = CLI_RUNTIME;
    if (mo.f) {
        if (rc == CLI_OK && cli_meta_commit(&mo, prog)) rc = CLI_RUNTIME;
        if (mo.f) cli_out_abort(&mo);
    }
    free(metapath);
    return rc;
}
