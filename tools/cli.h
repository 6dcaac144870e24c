/* cli.h — what the kvq tools share: one-line errors, checked number and
 * list parsing, and output files written atomically (temporary + rename).
 * Its files, each using only those after it (tests/check_imports.py):
 * optrows.c (options as rows), cli.c (options, specs, models), meta.c
 * (provenance, and OUT's commit with it), hash.c (SHA-256), out.c (errors,
 * atomic output). */
#ifndef KVQ_CLI_H
#define KVQ_CLI_H

#include "kvq.h"
#include "kvq_output.h" /* atomic result files: the tools' own plumbing */

#include <getopt.h>
#include <stdint.h>
#include <stdio.h>

/* Return conventions, two and only two:
 *  - a function that prints its error returns an exit code: CLI_OK, or
 *    CLI_USAGE / CLI_RUNTIME after one line on stderr; an option parser
 *    returns CLI_NOT_MINE for an option that is not its own;
 *  - a helper that prints nothing (number parsing, writing a buffer,
 *    flushing, hashing) returns 0, or -1 (with errno where it says so),
 *    and its caller says what failed. */
enum { CLI_NOT_MINE = -1, CLI_OK = 0, CLI_RUNTIME = 1, CLI_USAGE = 2 };

/* Prints "PROG: error: ..." (one line) on stderr. */
void cli_error(const char *prog, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints a library error and returns the matching exit code (2 usage, 1 else). */
int cli_fail(const char *prog, const kvq_error *err);

/* Whole-string decimal parsing with range checks (no sign for unsigned). */
int cli_parse_long(const char *s, long min, long max, long *out);
int cli_parse_u64(const char *s, uint64_t *out);
/* Writes all of buf to fd (retrying short writes): 0, or -1 with errno. */
int cli_write_all(int fd, const void *buf, size_t len);
/* A --shard I/N: i of n (n 0 until given, where a tool has no default). */
typedef struct cli_shard {
    long i, n;
} cli_shard;
/* --shard I/N into *i, *n (kvq_shard_parse): CLI_OK, or CLI_USAGE after "--shard ARG: expected I/N ...". */
int cli_shard_option(const char *prog, const char *arg, long *i, long *n);
/* "0-3,7" -> malloc'ed list of ints (each 0..max); 0 on success. */
int cli_parse_list(const char *s, int max, int **out, int *n);
/* --NAME ARG, a list of distinct indices 0..max, into *v (freed first), *n:
 * CLI_OK, or CLI_USAGE after "--NAME ARG: expected a list like WHAT" (optrows.c). */
int cli_index_list_option(const char *prog, const char *arg, int max, const char *name, const char *what, int **v,
                          int *n);

/* The analysis options kvq-analyze and kvq-sweep share: their getopt_long
 * codes (their rows: cli_analysis_rows) and parsed values. */
enum { CLI_OPT_LAYERS = 512, CLI_OPT_HEADS, CLI_OPT_QUERIES, CLI_OPT_PER, CLI_OPT_THREADS, CLI_OPT_SEED,
       CLI_OPT_DEVICE };
typedef struct cli_analysis {
    int *layers, nlayers, *heads, nheads; /* NULL: all */
    kvq_query_sel queries;                /* default last:64 */
    kvq_per per;                          /* default per layer */
    long threads;                         /* 0: all cores */
    uint64_t seed;
    int cuda;                             /* --device cuda */
    kvq_device *device;                   /* opened by cli_analysis_device */
} cli_analysis;
void cli_analysis_init(cli_analysis *a);
/* Opens the GPU if --device cuda asked for one (after parsing, before any
 * work): CLI_OK, or CLI_RUNTIME after printing why there is none. */
int cli_analysis_device(const char *prog, cli_analysis *a);
void cli_analysis_free(cli_analysis *a);

/* Registers the exit-time check of stdout: what a tool printed there (--help,
 * --list-*, results) must have been written, else one line and exit 1. */
void cli_check_stdout_at_exit(const char *prog);

/* docs/tools.md: -o "" is a usage error, and so is an -o path that is one of the
 * run's inputs (same device and inode, through links: ./x.h5 and x.h5 are
 * one file); nothing is written then.  inputs may hold NULLs.  CLI_OK or
 * CLI_USAGE after printing. */
int cli_check_output(const char *prog, const char *output, const char *const *inputs, int n);
/* The same for OUT.meta.json (cli_check_output checks it) and the other
 * files a run writes beside OUT (kvq-alloc's tables): not an input, and a
 * regular file where it exists (a FIFO would block the run).  what names it:
 * "the sensitivity table of -o".  CLI_OK or CLI_USAGE after printing. */
int cli_check_side_file(const char *prog, const char *what, const char *path, const char *const *inputs, int n);
/* The calibration rule (kvq_spec_check_calib): the library's message and
 * how to give the dump, CLI_USAGE; CLI_OK where the spec has what it needs. */
int cli_check_calib(const char *prog, const kvq_spec *spec, int have_calib);
/* Output: stdout when path is NULL or "-"; a FIFO or a device written in
 * place; else a temporary file beside the target (a symlink followed) that
 * cli_meta_commit renames into place, with the mode a new file gets (or the
 * existing file's), removed if SIGINT/SIGTERM/SIGHUP end the run. */
typedef struct cli_meta cli_meta;
typedef struct cli_out {
    FILE *f;
    char *path, *target, *tmp; /* as given; symlinks followed; NULL when written in place */
    cli_meta *meta;            /* cli_out_attach_meta's */
    FILE *real;                /* --meta inline: OUT, while f collects the rows in memory */
    char *buf;
    size_t buflen;
} cli_out;
int cli_out_open(cli_out *o, const char *path, const char *prog); /* CLI_OK, or CLI_RUNTIME after printing */
/* The run's provenance goes with OUT (call before writing anything): at
 * commit, OUT.meta.json beside a regular-file OUT (the old one removed
 * before OUT is renamed, the new one renamed after it, so a meta file never
 * describes another OUT) and, with --meta inline, the record as OUT's first
 * line.  CLI_OK, or CLI_RUNTIME after printing. */
int cli_out_attach_meta(cli_out *o, cli_meta *m, const char *prog);
/* flush, fsync, rename; with a record attached, OUT.meta.json around it
 * (meta.c).  CLI_OK, or CLI_RUNTIME after printing. */
int cli_meta_commit(cli_out *o, const char *prog);
void cli_out_abort(cli_out *o); /* close and remove the temporary */
/* cli_meta_commit's two halves (out.c), for the commit that adds a record
 * between them: close flushes, fsyncs and closes (stdout: flushes and is
 * done); place renames the temporary into place where ok, else removes it,
 * and frees.  CLI_OK, or CLI_RUNTIME after printing. */
int cli_out_close(cli_out *o, const char *prog);
int cli_out_place(cli_out *o, const char *prog, int ok);
/* fflush and a stream error check (and fsync where sync): 0, or -1 with errno. */
int cli_flush(FILE *f, int sync);
/* A progress line on stderr for long analyses (kvq_analysis_opts.progress):
 * "\rPROG: NAME: layer i/n, STAGE, T s", rewritten in place.  --progress
 * auto shows it on a terminal once a run has taken a second; always, from
 * the start; never, not at all. */
enum { CLI_PROGRESS_NEVER, CLI_PROGRESS_LATE, CLI_PROGRESS_ALWAYS };
typedef struct cli_progress {
    const char *prog, *name;
    int mode, width;
    double t0;
} cli_progress;
int cli_progress_option(const char *prog, const char *arg, int *mode); /* CLI_OK or CLI_USAGE */
void cli_progress_start(cli_progress *p, const char *prog, int mode, const char *name);
void cli_progress_stage(void *ud, int layer_index, int nlayers, const char *stage);
void cli_progress_end(cli_progress *p); /* ends the line if one was shown */
/* One line for a failed report write (st from kvq_report_* / kvq_rows_*),
 * naming the output and, for KVQ_ERR_IO, the system's reason (errno saved
 * right after the failing call, 0 if unknown).  Returns CLI_RUNTIME. */
int cli_write_error(const char *prog, const char *output, kvq_status st, int saved_errno);
/* A temporary (e.g. a dump writer's) removed if a signal ends the run; the
 * string must live until cli_temp_unregister.  At most 8 at once. */
void cli_temp_register(const char *tmp);
void cli_temp_unregister(const char *tmp);
/* What a SIGINT/SIGTERM/SIGHUP says it kept (docs/tools.md): "<head><count><tail>",
 * count as last given to cli_interrupt_count (0 at first).  Without a note,
 * an interrupted run that removed its temporary says nothing was written. */
void cli_interrupt_note(const char *head, const char *tail);
void cli_interrupt_count(long n);

/* Every tool calls this first (docs/performance.md#blas-kernels): when
 * OpenBLAS chose kernels below what this CPU runs and the user set no
 * OPENBLAS_CORETYPE, the tool restarts itself once with it set to the
 * CPU's core (KVQ_BLAS_CORE_DETECTED keeps OpenBLAS's own choice); if the
 * restart fails it goes on, with a note. */
void cli_blas_setup(char **argv);
/* --version: "PROG VERSION (commit C, SIMD S)" and "BLAS: ... core C (why)". */
void cli_version(const char *prog);

/* Heavy tools call this first.  Their large temporaries (a head's score
 * matrices, a quantizer's scratch, a read's stage, up to tens of MB) are
 * allocated and freed once per head or layer; glibc would map each one
 * afresh, and every page of every new map faults in (in this VM 1.7-2.2 us
 * a page: a sixth of a small run's CPU time).  Kept in the heap, up to 32 MB
 * a block, and not given back between layers, they reuse warm pages. */
void cli_tune_malloc(void);

/* The options kvq-dump, kvq-eval and kvq-alloc share: the model's input and
 * threads (their rows: cli_model_rows). */
enum { CLI_OPT_TEXT = 640, CLI_OPT_TOKENS, CLI_OPT_TOKENIZER, CLI_OPT_MAX_TOKENS, CLI_OPT_MODEL_THREADS };
typedef struct cli_model {
    const char *text, *tokens, *tokenizer;
    long max_tokens, threads; /* 0: no cut, all cores */
    int no_context_cut;       /* kvq-eval --chunk: the stream is not cut to the context length */
    long uses;                /* the most tokens the run can use (--chunk N --chunks K: N·K; 0: all):
                                 no more is read */
} cli_model;
/* After getopt: exactly one MODEL operand and one of --text/--tokens; CLI_OK
 * or CLI_USAGE after printing (the message names `synopsis`). */
int cli_model_check(const char *prog, int argc, int optind, const cli_model *mo, const char *synopsis);
/* Opens argv[optind] (checked by cli_model_check) and reads its tokens. */
int cli_model_load(const char *prog, char **argv, int optind, const cli_model *mo, kvq_model **m, int **ids, int *T);

/* Appends the parsed spec `text` to *specs (*n of them): CLI_OK or the exit
 * code after printing. */
int cli_add_spec(const char *prog, kvq_spec **specs, int *n, const char *text);
/* Appends *sp as it is (already parsed, or built by the tool). */
int cli_push_spec(const char *prog, kvq_spec **specs, int *n, const kvq_spec *sp);
/* Appends kvq-analyze's default set: one spec per registry family marked
 * in_default_set, with its default_spec.  Without a calibration dump
 * (have_calib 0) the families that need one are left out and named in
 * `skipped` ("cluster, ..."; may be NULL). */
int cli_add_default_specs(const char *prog, int have_calib, kvq_spec **specs, int *n, char *skipped, size_t len);
/* Specs that cannot run on heads of head_dim channels (kvq_spec_check_shape:
 * llama.cpp's block rule): from the default set (defaults != 0) they are
 * dropped and their family names appended to skipped (a note for the end of
 * the run); given explicitly they are a usage error naming `where`. */
int cli_fit_specs_to_head_dim(const char *prog, const char *where, int defaults, kvq_spec *specs, int *n,
                              int head_dim, char *skipped, size_t len);

/* --format: CLI_OK or CLI_USAGE after printing; the format of a run: the
 * one asked for, else JSON lines for -o NAME.jsonl or NAME.json, CSV for other files,
 * a table on a terminal and CSV on a pipe. */
int cli_format_option(const char *prog, const char *arg, const char **format);
kvq_format cli_pick_format(const char *format, const char *output);
const char *cli_format_name(kvq_format fmt); /* "table", "csv", "jsonl" */

/* Models in the loop (kvq-dump, kvq-eval): the token ids of a run, from
 * --text (the model's tokenizer) or --tokens (ids), cut to the model's
 * context length (with a note; not with mo->no_context_cut) and to
 * --max-tokens; no more of the file is read than those and mo->uses allow
 * (a FIFO, /dev/urandom or a 40 MB line cost what the tokens need).  CLI_OK
 * or the exit code after printing the error. */
int cli_model_tokens(const char *prog, const kvq_model *m, const cli_model *mo, int **ids, int *T);
/* The CSV header line of kvq_rows_new(cols, ncols, ntext) written to fd
 * (a table created or emptied, which rows are then appended to): CLI_OK, or
 * CLI_RUNTIME after "PATH: write failed". */
int cli_write_csv_header(const char *prog, const char *path, int fd, const char *const *cols, int ncols, int ntext);
/* The whole file (NUL-terminated, *len without it); CLI_OK or CLI_RUNTIME after printing. */
int cli_read_file(const char *prog, const char *path, char **buf, size_t *len);

/* ---------------------------------------- provenance (tools/meta.c) */

/* docs/tools.md#provenance.  A record begun at the start of main (the time,
 * the command line, the directory), filled with the inputs and every
 * option's effective value, and written beside OUT at commit.  Allocation
 * failures are remembered and reported when it is written. */
enum { CLI_OPT_META = 700, CLI_OPT_NO_HASH }; /* their rows: cli_meta_rows */
#define CLI_HELP_VERSION_HELP                                                             \
    "  -h, --help            this help\n"                                                 \
    "  -V, --version         print the version\n"
cli_meta *cli_meta_begin(const char *tool, int argc, char **argv); /* NULL: out of memory */
void cli_meta_free(cli_meta *m);
/* The option loop every tool shares: getopt_long over shortopts (starting
 * with ':') and longopts, with the option groups the tool has (analysis,
 * model: NULL if it has none; the provenance record's --meta/--no-hash),
 * -h (usage on stdout), -V, a missing value and an unknown option handled
 * here.  Returns the next option that is the tool's own, -1 after the last,
 * or CLI_GETOPT_STOP with *rc the exit code: CLI_OK after --help or
 * --version, else CLI_USAGE / CLI_RUNTIME after printing. */
enum { CLI_GETOPT_STOP = -2 };
typedef struct cli_getopt_ctx {
    const char *prog;
    void (*usage)(FILE *);
    cli_analysis *analysis;
    cli_model *model;
    struct cli_meta *meta;
} cli_getopt_ctx;
int cli_getopt(const cli_getopt_ctx *g, int argc, char **argv, const char *shortopts, const struct option *longopts,
               int *rc);

/* A tool's options as rows (optrows.c): each row makes the option's getopt
 * entry, its checked parsing, its --help line and its provenance record
 * ("options".NAME); see kvq-gen.c.  offset: where the value lands in the
 * tool's options struct — an int for FLAG (set to 1) and CHOICE (the
 * choice's index) and INT (min..max), a long for LONG (min..max), a
 * uint64_t for U64, a double for REAL (positive, at most real_max or
 * 1e30), a const char * for TEXT; CUSTOM rows parse themselves. */
typedef enum cli_arg {
    CLI_ARG_FLAG, CLI_ARG_INT, CLI_ARG_LONG, CLI_ARG_U64, CLI_ARG_REAL, CLI_ARG_CHOICE, CLI_ARG_TEXT, CLI_ARG_CUSTOM
} cli_arg;
typedef struct cli_optrow {
    const char *name; /* --name, and its provenance key */
    int key;          /* getopt's value: a short option's character, or a value above 255 */
    cli_arg arg;
    size_t offset;
    long min, max;                /* INT, LONG */
    double real_max;              /* REAL: the largest value (0: 1e30) */
    const char *const *choices;   /* CHOICE: NULL-terminated */
    /* CUSTOM: the parser of arg into at (base + offset) or, filling several
     * fields, into the tool's options struct base; CLI_OK or the exit code
     * after one line on stderr.  Recorded through record_fn. */
    int (*parse)(const char *prog, const char *arg, void *at, void *base);
    const char *expect;           /* the refusal's "expected ..." (NULL: from the kind and range) */
    int record;                   /* CLI_RECORD_* bits: recorded in the provenance as it took effect */
    /* The value as recorded, where the row's kind does not say it (a CUSTOM
     * row's, an effective value the tool resolved): puts "options".NAME into meta. */
    void (*record_fn)(struct cli_meta *meta, const struct cli_optrow *row, const void *base);
    size_t aux_offset; /* the field a record_fn reads beside offset's: a list's count, a resolved value */
    const char *metavar, *help;   /* the --help line */
} cli_optrow;
enum { CLI_OPTROW_NONE = 1 };
/* cli_optrow.record: CLI_RECORD, in the record of a run (a TEXT left NULL is
 * not recorded); with CLI_RECORD_NULL, null then (a TEXT NULL, an INT or LONG 0);
 * CLI_RECORD_ALT, in the record of the tool's other kind of run, which
 * records only those: a --merge (kvq-sweep, kvq-eval), a --task (kvq-gen). */
enum { CLI_RECORD = 1, CLI_RECORD_NULL = 2, CLI_RECORD_ALT = 4 };
/* record_fns the tools share: a list row (a const char ** at offset, its
 * count an int at aux_offset: a list, [] when empty); the specs of -q (a
 * kvq_spec * at offset, their count an int at aux_offset: their texts, as
 * given or the default set); --format as it took effect (a kvq_format at
 * aux_offset); --shard (a cli_shard at offset, as "I/N"; N = 0, none given: not recorded). */
void cli_optrow_record_list(struct cli_meta *meta, const cli_optrow *row, const void *base);
/* the same of a const char *[] array held at offset (kvq-alloc's --grid) */
void cli_optrow_record_array(struct cli_meta *meta, const cli_optrow *row, const void *base);
void cli_optrow_record_specs(struct cli_meta *meta, const cli_optrow *row, const void *base);
void cli_optrow_record_format(struct cli_meta *meta, const cli_optrow *row, const void *base);
void cli_optrow_record_shard(struct cli_meta *meta, const cli_optrow *row, const void *base); /* "I/N" */
/* an int * at offset, its count an int at aux_offset: a list, null when NULL (all) */
void cli_optrow_record_ints(struct cli_meta *meta, const cli_optrow *row, const void *base);
/* The row whose key getopt returned: its argument checked into base + offset.  CLI_OK,
 * CLI_USAGE after one line on stderr, or CLI_OPTROW_NONE when no row has that key. */
int cli_optrow_parse(const char *prog, const cli_optrow *rows, int n, int key, const char *arg, void *base);
/* Every recorded row's value, as it took effect, into the record's "options"
 * in the rows' order: the rows with CLI_RECORD, or with alt those with CLI_RECORD_ALT. */
void cli_optrows_record(cli_meta *meta, const cli_optrow *rows, int n, const void *base, int alt);
/* The rows' --help lines: "  -k, --name METAVAR  help", wrapped at 80
 * columns (a row without help is the tool's to describe). */
void cli_optrows_usage(FILE *f, const cli_optrow *rows, int n);
/* The option groups as rows, which cli_getopt parses for a context that has
 * them: the analysis options (optrows.c; --device has no help line, each
 * tool says what it runs there), the model's input and threads (optrows.c),
 * the provenance record's --meta and --no-hash (meta.c). */
extern const cli_optrow cli_analysis_rows[], cli_model_rows[], cli_meta_rows[];
extern const int cli_analysis_nrows, cli_model_nrows, cli_meta_nrows;
/* CUSTOM parsers the tools share: --format (a const char *, cli_format_option),
 * --progress (an int, cli_progress_option) and --shard (a cli_shard). */
int cli_optrow_format(const char *prog, const char *arg, void *at, void *base);
int cli_optrow_progress(const char *prog, const char *arg, void *at, void *base);
int cli_optrow_shard(const char *prog, const char *arg, void *at, void *base); /* a cli_shard */
/* A tool's whole option loop: cli_getopt over the rows' entries and go's
 * groups, each of the tool's options parsed by its row
 * into base.  CLI_OK with *stop 0 when the options are in base (operands
 * from optind); else *stop 1 and CLI_OK (--help, --version) or the exit code. */
int cli_optrows_getopt(const cli_getopt_ctx *go, const cli_optrow *rows, int n, const char *shortopts, int argc,
                       char **argv, void *base, int *stop);

/* Every tool's main, the one start and end they share: the BLAS kernels
 * (cli_blas_setup, which may restart the tool), the check of stdout at exit,
 * with CLI_MAIN_TUNE_MALLOC the heap kept warm (cli_tune_malloc), with
 * CLI_MAIN_TEMP_HOOKS a dump writer's temporary removed by a signal; then
 * run(argc, argv, record) between cli_meta_begin and cli_meta_free.
 * Returns run's exit code (CLI_RUNTIME if the record cannot be begun). */
enum { CLI_MAIN_TUNE_MALLOC = 1, CLI_MAIN_TEMP_HOOKS = 2 };
/* The library's notes of the run (kvq_take_notes), one "PROG: note: ..." line each. */
void cli_print_notes(const char *prog);
int cli_main(const char *prog, int argc, char **argv, unsigned flags, int (*run)(int, char **, cli_meta *));
/* --meta inline needs JSON lines: CLI_OK or CLI_USAGE after printing. */
int cli_meta_check_format(const char *prog, const cli_meta *m, kvq_format fmt);
int cli_meta_inline(const cli_meta *m);
/* The operands after the options (dumps, a model, shards), as given. */
void cli_meta_operands(cli_meta *m, char *const *v, int n);
/* An input (NULL: none): stat'ed now, and its bytes as they are now hashed
 * (SHA-256) by a thread while the run works; the record says
 * changed_during_run when its size, mtime or ctime moved by then.  An
 * _extended input is one the run appends to itself (a resumed file): its
 * bytes at the start are hashed, and growing is not a change. */
void cli_meta_input(cli_meta *m, const char *role, const char *path);
void cli_meta_input_extended(cli_meta *m, const char *role, const char *path);
/* A dump about to be read while an input's hash still runs beside the work,
 * on fewer than three processors: read by one thread, not two, so that the
 * hash has the other core while the run reads (docs/performance.md). */
void cli_meta_share_reading(const cli_meta *m, kvq_dump *d);
/* section.key = value, in the order set; section is "options", "model" or
 * "result".  _str(NULL) is null; _list appends one string to an array;
 * _ints(NULL) is null. */
void cli_meta_str(cli_meta *m, const char *section, const char *key, const char *val);
void cli_meta_list(cli_meta *m, const char *section, const char *key, const char *val);
void cli_meta_empty_list(cli_meta *m, const char *section, const char *key);
void cli_meta_int(cli_meta *m, const char *section, const char *key, long long val);
void cli_meta_int_set(cli_meta *m, const char *section, const char *key, long long val); /* 0: null (unset) */
void cli_meta_u64(cli_meta *m, const char *section, const char *key, uint64_t val);
void cli_meta_double(cli_meta *m, const char *section, const char *key, double val);
void cli_meta_bool(cli_meta *m, const char *section, const char *key, int val);
void cli_meta_ints(cli_meta *m, const char *section, const char *key, const int *v, int n);
/* The analysis group's rows as they took effect (optrows.c): --layers,
 * --heads, --queries, --per, --threads (resolved), --seed, --device. */
void cli_meta_analysis(cli_meta *m, const cli_analysis *an);
/* A model in the loop (optrows.c): the model file, text/tokens/tokenizer as
 * inputs, the model group's rows (--threads resolved), and the model's name,
 * architecture, format, shape and the T tokens the run used. */
void cli_meta_model(cli_meta *m, const char *model_path, const cli_model *mo, const kvq_model_info *in, int T);
/* Earlier runs of the same OUT (a sweep's --resume, --merge's shards): one
 * JSON object per line, as cli_meta_read_runs returns them. */
void cli_meta_prior_runs(cli_meta *m, const char *runs);
/* The runs recorded in a meta file (*runs NULL when it does not exist):
 * CLI_OK, or CLI_RUNTIME after printing. */
int cli_meta_read_runs(const char *prog, const char *meta_path, char **runs);
char *cli_meta_path(const char *output); /* OUTPUT.meta.json, malloc'ed */
/* The record (earlier runs and this one, ended at the first call) as the
 * file's text, or on one line for --meta inline; NULL after printing. */
char *cli_meta_render(cli_meta *m, const char *prog, const char *output, const char *out_sha256, int one_line);
/* Writes OUTPUT.meta.json atomically now (kvq-sweep, which appends to OUT in place). */
int cli_meta_write(cli_meta *m, const char *prog, const char *output, const char *out_sha256);
/* Dumps, which the library writes and renames itself (kvq-dump, kvq-gen):
 * cli_meta_drop removes an old OUTPUT.meta.json before the write (so it
 * never describes the new file), cli_meta_write_hashed records the new
 * file's SHA-256 (unless --no-hash) once it is in place. */
int cli_meta_drop(const char *prog, const char *output);
int cli_meta_write_hashed(cli_meta *m, const char *prog, const char *output);
/* SHA-256 (OpenSSL's libcrypto) of a file as 64 hex digits: 0, or -1 with
 * *saved_errno; _prefix hashes its first `limit` bytes (EIO when it is
 * shorter); _mem: 0, or -1 if libcrypto fails. */
int cli_sha256_file(const char *path, char hex[65], int *saved_errno);
int cli_sha256_file_prefix(const char *path, long long limit, char hex[65], int *saved_errno);
int cli_sha256_mem(const void *p, size_t n, char hex[65]);
/* A thread that hashes files while the run works (the inputs of OUT.meta.json):
 * cli_hasher_add queues the first `size` bytes of path (NULL: no memory or no
 * thread: hash it yourself); cli_hash_job_wait waits for that hash (0, or
 * -1 with *saved_errno); cli_hasher_free stops an unfinished hash and frees. */
/* The checksums of files earlier runs hashed (git's index does the same):
 * kept by what stat(2) says of the file — device, inode, size, mtime and
 * ctime to the nanosecond; no call sets a ctime back, so a file written
 * since has another key — in $KVQ_HASH_CACHE (off: none), else
 * $XDG_CACHE_HOME/kvq/sha256, else ~/.cache/kvq/sha256.  lookup: 0 and the
 * SHA-256 of the file in that state, or -1.  store: kept for a regular file
 * whose ctime is two seconds old or more; failures are silent (a cache). */
struct stat;
int cli_hash_cache_lookup(const struct stat *st, char hex[65]);
void cli_hash_cache_store(const char *path, const struct stat *st, const char hex[65]);
typedef struct cli_hasher cli_hasher;
typedef struct cli_hash_job cli_hash_job;
cli_hasher *cli_hasher_new(void);
cli_hash_job *cli_hasher_add(cli_hasher *h, const char *path, long long size);
int cli_hash_job_wait(cli_hasher *h, cli_hash_job *j, char hex[65], int *saved_errno);
int cli_hash_job_done(cli_hasher *h, cli_hash_job *j); /* 1 once its hash has ended */
void cli_hasher_free(cli_hasher *h);

#endif
