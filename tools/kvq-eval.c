/* kvq-eval — what a quantized KV cache does to the model (docs/models.md): the
 * model runs teacher-forced over a text with the exact cache and with each
 * quantizer's cache (prefill: the whole cache quantized at once; decode:
 * the cache as generation holds it), and the loss, KL and top-1 changes are
 * reported per quantizer (and per layer with --per-layer). */
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *prog = "kvq-eval";

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-eval MODEL (--text FILE | --tokens FILE) [-q SPEC]... [options]\n"
        "Teacher-forced loss of a model (GGUF llama/qwen2/qwen3/gemma3/phi3, or llama2.c) with each\n"
        "quantizer's KV cache against the exact cache: nll, dnll, ppl_ratio, KL, top-1.\n\n"
        "  -q, --quant SPEC      quantizer spec NAME[:key=value,...], or none (the exact\n"
        "                        cache); repeatable (default: kvq-analyze's default set)\n"
        "      --calib FILE      calibration dump of the same model (kvq-dump of another text)\n"
        "      --policy P        prefill (default: every layer's cache quantized once over\n"
        "                        all T tokens, as papers' perplexity tables do), decode (the\n"
        "                        cache as it holds t+1 tokens at position t), or prefill,decode\n"
        "      --stride N        decode: re-quantize the cache every N positions (default 1)\n"
        "      --per-layer       one row per layer with only that layer quantized\n"
        "      --chunk N         corpus evaluation (llama.cpp perplexity's protocol): windows\n"
        "                        of N tokens, each from an empty cache with BOS first when\n"
        "                        the model adds one, scoring each window's second half\n"
        "      --chunks K        evaluate only the first K windows\n"
        "      --context N       the context protocol: the first N tokens (of each window)\n"
        "                        prefilled exactly and their cache compressed once, the\n"
        "                        rest teacher-forced on top (their own entries exact with\n"
        "                        prefill, stored by the spec or a tokens(...)'s HI with\n"
        "                        decode); only positions >= N are scored\n"
        "      --shard I/N       with --chunk: only the I-th of N contiguous shares of the\n"
        "                        windows, each window's rows appended to -o OUT as it ends\n"
        "                        (with the sums --merge pools)\n"
        "      --resume          continue a shard's OUT after its last whole window\n"
        "      --merge           kvq-eval --merge SHARD... [-o OUT]: pool the shards' windows\n"
        "                        into the rows of one run (bit for bit)\n"
        "      --text FILE       text, tokenized as llama.cpp does (BOS if the model adds one)\n"
        "      --tokens FILE     whitespace-separated token ids instead (any model)\n"
        "      --tokenizer FILE  llama2.c tokenizer.bin (llama2.c checkpoints only)\n"
        "      --max-tokens N    keep the first N tokens (BOS included)\n"
        "      --format FMT      table, csv or jsonl (default: table on a terminal, else\n"
        "                        csv; with -o, jsonl for *.jsonl names)\n"
        "  -o, --output FILE     write results to FILE (atomically) instead of stdout,\n"
        "                        and the run's provenance to FILE.meta.json\n"
        CLI_META_HELP
        "      --progress WHEN   auto (default: on a terminal), always or never\n"
        "      --threads N       worker threads (default: all cores)\n"
        "      --seed N          seed of the quantizers' random streams (default 0)\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n\n"
        "Example: kvq-eval stories260K.gguf --text story.txt -q none -q kivi:bits=2 --policy prefill,decode\n"
        "Across machines: kvq-eval M --text T --chunk 512 -q ... --shard I/4 -o shard-I.csv (I = 0..3), then\n"
        "                 kvq-eval --merge shard-*.csv -o all.csv\n");
}

enum {
    OPT_CALIB = 256,
    OPT_POLICY,
    OPT_STRIDE,
    OPT_PER_LAYER,
    OPT_FORMAT,
    OPT_PROGRESS,
    OPT_SEED,
    OPT_CHUNK,
    OPT_CHUNKS,
    OPT_CONTEXT,
    OPT_SHARD,
    OPT_RESUME,
    OPT_MERGE
};

typedef struct progress_state {
    int on;
    time_t start;
} progress_state;

/* After each corpus window: windows done, elapsed, and the time left at this pace. */
static void window_progress(void *ud, int done, int total)
{
    progress_state *p = ud;
    if (!p->on) return;
    long el = (long)(time(NULL) - p->start);
    fprintf(stderr, "\r%s: window %d/%d, %lds, about %lds left      %s", prog, done, total, el,
            (long)((double)el / done * (total - done) + 0.5), done == total ? "\n" : "");
    fflush(stderr);
}

static void progress(void *ud, int pass, int npasses, int layer, int nlayers)
{
    progress_state *p = ud;
    if (!p->on) return;
    fprintf(stderr, "\r%s: pass %d/%d, layer %d/%d, %lds", prog, pass + 1, npasses, layer, nlayers,
            (long)(time(NULL) - p->start));
    if (pass + 1 == npasses && layer == nlayers) fputc('\n', stderr);
    fflush(stderr);
}

/* A -q value: `none` (the exact cache: a spec without quantizer) or a registry spec. */
static int add_spec(kvq_spec **specs, int *n, const char *text)
{
    if (strcmp(text, "none")) return cli_add_spec(prog, specs, n, text);
    kvq_spec none = {0};
    snprintf(none.text, sizeof none.text, "none");
    return cli_push_spec(prog, specs, n, &none);
}

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        {"quant", required_argument, 0, 'q'}, {"calib", required_argument, 0, OPT_CALIB},
        {"policy", required_argument, 0, OPT_POLICY}, {"stride", required_argument, 0, OPT_STRIDE},
        {"per-layer", no_argument, 0, OPT_PER_LAYER}, {"chunk", required_argument, 0, OPT_CHUNK},
        {"chunks", required_argument, 0, OPT_CHUNKS}, {"context", required_argument, 0, OPT_CONTEXT},
        {"shard", required_argument, 0, OPT_SHARD},
        {"resume", no_argument, 0, OPT_RESUME}, {"merge", no_argument, 0, OPT_MERGE}, CLI_MODEL_LONGOPTS,
        {"format", required_argument, 0, OPT_FORMAT}, {"output", required_argument, 0, 'o'},
        {"progress", required_argument, 0, OPT_PROGRESS}, {"seed", required_argument, 0, OPT_SEED},
        CLI_META_LONGOPTS,
        {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};
    const char *output = NULL, *format = NULL, *calib = NULL;
    int progress_mode = -1; /* cli_progress_option's; -1 until --progress or "auto" sets it */
    long stride = 1, chunk = 0, chunks = 0, context = 0, shard_i = 0, shard_n = 0;
    int resume = 0, merge = 0;
    cli_eval_shard *shard = NULL;
    cli_eval_row *rows = NULL;
    cli_model mo = {0};
    uint64_t seed = 0;
    int per_layer = 0, policies[2] = {1, 0}, *ids = NULL, T = 0, rc = CLI_OK, c, nspecs = 0;
    kvq_spec *specs = NULL, *owns = NULL;
    kvq_eval_item *items = NULL;
    kvq_model *m = NULL;
    kvq_calib *cal = NULL;
    kvq_report *rep = NULL;
    cli_out out = {0};
    kvq_error err = {0};
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = NULL, .model = &mo, .meta = meta};
    while ((c = cli_getopt(&go, argc, argv, ":q:o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) goto done;
        switch (c) {
        case 'q':
            if ((rc = add_spec(&specs, &nspecs, optarg))) goto done;
            break;
        case OPT_CALIB: calib = optarg; break;
        case OPT_POLICY:
            if (!strcmp(optarg, "prefill")) policies[0] = 1, policies[1] = 0;
            else if (!strcmp(optarg, "decode")) policies[0] = 0, policies[1] = 1;
            else if (!strcmp(optarg, "prefill,decode") || !strcmp(optarg, "decode,prefill"))
                policies[0] = policies[1] = 1;
            else {
                cli_error(prog, "--policy %s: expected prefill, decode or prefill,decode", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_STRIDE:
            if (cli_parse_long(optarg, 1, 1L << 30, &stride)) {
                cli_error(prog, "--stride %s: expected a positive integer", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_PER_LAYER: per_layer = 1; break;
        case OPT_CHUNK:
        case OPT_CHUNKS:
            if (cli_parse_long(optarg, c == OPT_CHUNK ? 4 : 1, 1L << 30, c == OPT_CHUNK ? &chunk : &chunks)) {
                cli_error(prog, "--%s %s: expected an integer %s", c == OPT_CHUNK ? "chunk" : "chunks", optarg,
                          c == OPT_CHUNK ? "4..2^30" : "1..2^30");
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_CONTEXT:
            if (cli_parse_long(optarg, 1, 1L << 30, &context)) {
                cli_error(prog, "--context %s: expected a positive integer (tokens)", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_SHARD:
            if (cli_parse_shard(optarg, &shard_i, &shard_n)) {
                cli_error(prog, "--shard %s: expected I/N with 0 <= I < N, e.g. 0/4", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_RESUME: resume = 1; break;
        case OPT_MERGE: merge = 1; break;
        case OPT_FORMAT:
            if ((rc = cli_format_option(prog, optarg, &format))) goto done;
            break;
        case OPT_PROGRESS:
            if ((rc = cli_progress_option(prog, optarg, &progress_mode))) goto done;
            break;
        case OPT_SEED:
            if (cli_parse_u64(optarg, &seed)) {
                cli_error(prog, "--seed %s: expected a non-negative integer", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case 'o': output = optarg; break;
        }
    }
    if (merge) { /* the shards' rows pooled: no model to run */
        if (shard_n || resume || nspecs || chunk || chunks || context || calib || per_layer || mo.text || mo.tokens) {
            cli_error(prog, "--merge pools finished shards: their options are in their rows (only -o, --format and "
                      "--meta apply)");
            rc = CLI_USAGE; goto done;
        }
        if (optind >= argc) { cli_error(prog, "--merge: no shard files given"); rc = CLI_USAGE; goto done; }
        if ((rc = cli_check_output(prog, output, (const char *const *)argv + optind, argc - optind))) goto done;
        kvq_format mfmt = cli_pick_format(format, output);
        cli_meta_str(meta, "options", "output", output);
        rc = cli_eval_merge(prog, argv + optind, argc - optind, output, mfmt, meta);
        goto done;
    }
    if ((rc = cli_model_check(prog, argc, optind, &mo, "kvq-eval MODEL (--text FILE | --tokens FILE) -q SPEC...")))
        goto done;
    if (shard_n && (!chunk || !output || !strcmp(output, "-"))) {
        cli_error(prog, "--shard %ld/%ld: needs --chunk N and -o OUT (its windows' rows are appended to OUT)", shard_i,
                  shard_n);
        rc = CLI_USAGE; goto done;
    }
    if (resume && !shard_n) {
        cli_error(prog, "--resume continues a shard (--shard I/N; --shard 0/1 for a whole corpus run)");
        rc = CLI_USAGE; goto done;
    }
    if (shard_n && format && strcmp(format, "csv")) {
        cli_error(prog, "--format %s: a shard is written as CSV (--merge writes any format)", format);
        rc = CLI_USAGE; goto done;
    }
    {
        const char *in[] = {argv[optind], mo.text, mo.tokens, mo.tokenizer, calib};
        if ((rc = cli_check_output(prog, output, in, 5))) goto done;
    }
    if (calib && kvq_calib_open(calib, &cal, &err)) { rc = cli_fail(prog, &err); goto done; }
    int defaults = nspecs == 0;
    if (defaults && (rc = cli_add_default_specs(prog, cal != NULL, &specs, &nspecs, NULL, 0))) goto done;
    for (int s = 0; s < nspecs; s++)
        if (specs[s].q && (rc = cli_check_calib(prog, &specs[s], cal != NULL))) goto done;
    if (chunks && !chunk) {
        cli_error(prog, "--chunks needs --chunk N");
        rc = CLI_USAGE; goto done;
    }
    mo.no_context_cut = chunk > 0;
    mo.uses = chunk > 0 && chunks > 0 ? chunk * chunks : 0; /* --chunks K: the first K windows alone */
    if ((rc = cli_model_load(prog, argv, optind, &mo, &m, &ids, &T))) goto done;
    const kvq_model_info *in = kvq_model_get_info(m);
    { /* llama.cpp's block rule (ggml, fp4): as kvq-analyze */
        char skipped[256] = "";
        if ((rc = cli_fit_specs_to_head_dim(prog, argv[optind], defaults, specs, &nspecs, in->head_dim, skipped,
                                            sizeof skipped)))
            goto done;
        if (skipped[0])
            fprintf(stderr, "%s: note: default set without %s: head_dim %d is not a multiple of their blocks "
                    "(llama.cpp refuses such a KV cache)\n", prog, skipped, in->head_dim);
    }
    if (chunk > in->context_length) {
        cli_error(prog, "--chunk %ld: the model's context length is %d", chunk, in->context_length);
        rc = CLI_USAGE; goto done;
    }
    if (chunk && T < chunk) {
        cli_error(prog, "%s: %d tokens: fewer than one window of --chunk %ld", mo.text ? mo.text : mo.tokens, T, chunk);
        rc = CLI_RUNTIME; goto done;
    }
    if (context && context > (chunk ? chunk : T) - 2) {
        cli_error(prog, "--context %ld: expected at most %ld (a context and at least one scored position in %s of %ld "
                  "tokens)", context, (chunk ? chunk : T) - 2L, chunk ? "each window" : "the text", chunk ? chunk : (long)T);
        rc = CLI_USAGE; goto done;
    }
    int nwin = chunk ? (int)(T / chunk) : 1;
    if (chunks && nwin > chunks) nwin = (int)chunks;

    int nlay = per_layer ? in->n_layers : 1, npol = policies[0] + policies[1];
    int nitems = nspecs * npol * nlay, k = 0;
    if (!(items = calloc((size_t)nitems + 1, sizeof *items))) {
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME;
        goto done;
    }
    for (int s = 0; s < nspecs; s++)
        for (int p = 0; p < 2; p++)
            for (int l = 0; policies[p] && l < nlay; l++)
                items[k++] = (kvq_eval_item){.spec = specs[s].q ? &specs[s] : NULL, .layer = per_layer ? l : -1,
                                             .policy = p ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
    /* each row's identity: a mix's --per-layer row names that layer's spec (and mix as its quantizer) */
    if (!(rows = calloc((size_t)nitems + 1, sizeof *rows)) || !(owns = calloc((size_t)nitems + 1, sizeof *owns))) {
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME;
        goto done;
    }
    /* the policy cell: with --context, the protocol too (prefill/context=N) */
    char policy_name[2][40] = {"prefill", "decode"};
    for (int p = 0; context && p < 2; p++)
        snprintf(policy_name[p], sizeof policy_name[p], "%s/context=%ld", p ? "decode" : "prefill", context);
    for (int i = 0; i < nitems; i++) {
        const kvq_eval_item *it = &items[i];
        const kvq_spec *sp = it->spec, *text = sp;
        if (sp && it->layer >= 0 && kvq_spec_is_mix(sp) && !kvq_spec_for_layer(sp, it->layer, &owns[i], NULL))
            text = &owns[i];
        rows[i] = (cli_eval_row){.model = in->name, .quantizer = sp ? kvq_quantizer_name(sp->q) : "none",
                                 .spec = sp ? text->text : "none",
                                 .policy = policy_name[it->policy == KVQ_POLICY_DECODE]};
        if (it->layer < 0) snprintf(rows[i].layer, sizeof rows[i].layer, "all");
        else snprintf(rows[i].layer, sizeof rows[i].layer, "%d", it->layer);
    }

    kvq_format fmt = cli_pick_format(format, output);
    if ((rc = cli_meta_check_format(prog, meta, fmt))) goto done;
    /* provenance: the inputs and every option's effective value */
    cli_meta_operands(meta, argv + optind, argc - optind);
    cli_meta_model(meta, argv[optind], &mo, in, T);
    cli_meta_input(meta, "calib", calib);
    for (int s = 0; s < nspecs; s++) cli_meta_list(meta, "options", "quant", specs[s].text);
    cli_meta_str(meta, "options", "calib", calib);
    cli_meta_str(meta, "options", "policy", policies[0] && policies[1] ? "prefill,decode" : policies[0] ? "prefill" : "decode");
    cli_meta_int(meta, "options", "stride", stride);
    cli_meta_bool(meta, "options", "per-layer", per_layer);
    cli_meta_int_set(meta, "options", "chunk", chunk);
    cli_meta_int_set(meta, "options", "chunks", chunks);
    cli_meta_int_set(meta, "options", "context", context);
    cli_meta_u64(meta, "options", "seed", seed);
    cli_meta_str(meta, "options", "format", cli_format_name(fmt));
    int ncol;
    const char *const *cols = cli_eval_columns(0, &ncol);
    /* a shard: its share of the windows, appended to OUT window by window */
    int w0 = 0, w1 = nwin, wdone = 0;
    if (shard_n) {
        w0 = (int)(nwin * shard_i / shard_n), w1 = (int)(nwin * (shard_i + 1) / shard_n);
        char sh[48];
        snprintf(sh, sizeof sh, "%ld/%ld", shard_i, shard_n);
        cli_meta_str(meta, "options", "shard", sh);
        cli_meta_bool(meta, "options", "resume", resume);
        cli_meta_int(meta, "result", "windows", nwin);
        cli_meta_int(meta, "result", "window_begin", w0);
        cli_meta_int(meta, "result", "window_end", w1);
        if ((rc = cli_eval_shard_open(prog, output, resume, rows, nitems, (int)chunk, nwin, w0, w1, &wdone, &shard)))
            goto done;
        if (wdone) { /* the runs that wrote those windows stay in the record */
            char *mp = cli_meta_path(output), *runs = NULL;
            if (!mp) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
            rc = cli_meta_read_runs(prog, mp, &runs);
            free(mp);
            if (!rc) cli_meta_prior_runs(meta, runs);
            free(runs);
            if (rc) goto done;
            fprintf(stderr, "%s: resuming: %d of this shard's %d windows already in %s\n", prog, wdone, w1 - w0,
                    output);
        }
        cli_meta_int(meta, "result", "windows_resumed", wdone);
        static char note_head[1024], note_tail[256];
        snprintf(note_head, sizeof note_head, "interrupted: %s keeps ", output);
        snprintf(note_tail, sizeof note_tail, " of shard %ld/%ld's %d windows; the same command with --resume "
                 "continues\n", shard_i, shard_n, w1 - w0);
        cli_interrupt_note(note_head, note_tail);
        cli_interrupt_count(wdone);
    } else {
        if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) { rc = CLI_RUNTIME; goto done; }
        if (!(rep = kvq_rows_new(out.f, fmt, cols, ncol, 6))) {
            cli_error(prog, "out of memory");
            rc = CLI_RUNTIME;
            goto done;
        }
    }

    if (progress_mode < 0) cli_progress_option(prog, "auto", &progress_mode);
    /* auto: on a terminal from the start (a pass is long), always, or never */
    progress_state ps = {progress_mode != CLI_PROGRESS_NEVER, time(NULL)};
    kvq_eval_opts eo = {.stride = (int)stride, .seed = seed, .nthreads = (int)mo.threads, .calib = cal,
                        .progress = chunk ? NULL : progress, .ud = &ps, .chunk = (int)chunk, .chunks = (int)chunks,
                        .window_progress = window_progress, .context = (int)context};
    if (shard_n) {
        if (w0 + wdone == w1) { /* every window of the shard is in OUT */
            fprintf(stderr, "%s: %s: shard %ld/%ld complete (windows %d..%d of %d)\n", prog, output, shard_i, shard_n,
                    w0, w1 - 1, nwin);
            rc = cli_eval_shard_close(shard);
            shard = NULL;
            if (!rc) rc = cli_meta_write_hashed(meta, prog, output);
            goto done;
        }
        eo.window_begin = w0 + wdone, eo.window_end = w1;
        eo.window_done = cli_eval_shard_window;
        eo.window_ud = shard;
    }
    if (fmt == KVQ_FMT_TABLE)
        fprintf(stderr, "%s: %s: %s %s, %d layers, %d query / %d KV heads, head_dim %d; %d tokens%s\n", prog,
                argv[optind], in->format, in->name, in->n_layers, in->n_heads, in->n_kv_heads, in->head_dim, T,
                chunk ? " (in windows)" : "");
    double nll_ref = NAN;
    if (kvq_model_eval(m, ids, T, items, nitems, &eo, &nll_ref, &err)) {
        if (ps.on) fputc('\n', stderr);
        rc = cli_fail(prog, &err);
        goto done;
    }
    if (shard) { /* every window's rows are in OUT: its record, with OUT's checksum */
        rc = cli_eval_shard_close(shard);
        shard = NULL;
        if (!rc) rc = cli_meta_write_hashed(meta, prog, output);
        if (!rc) fprintf(stderr, "%s: %s: shard %ld/%ld complete (windows %d..%d of %d)\n", prog, output, shard_i,
                         shard_n, w0, w1 - 1, nwin);
        goto done;
    }
    char toks[16], npos[16];
    snprintf(toks, sizeof toks, "%ld", chunk ? (long)nwin * chunk : (long)T);
    for (int i = 0; i < nitems; i++) {
        kvq_cell row[16];
        cli_eval_cells(&rows[i], &items[i], nll_ref, toks, npos, row);
        errno = 0;
        kvq_status wst = kvq_rows_add(rep, row);
        if (wst) { rc = cli_write_error(prog, output, wst, errno); goto done; }
    }
    errno = 0;
    kvq_status st = kvq_report_finish(rep);
    rep = NULL;
    if (st) { rc = cli_write_error(prog, output, st, errno); goto done; }
    if (cli_out_commit(&out, prog)) rc = CLI_RUNTIME;
done:
    kvq_report_discard(rep);
    if (out.f) cli_out_abort(&out);
    kvq_model_close(m);
    kvq_calib_close(cal);
    cli_eval_shard_close(shard);
    free(specs), free(owns), free(rows), free(items), free(ids);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }
