/* tasks.c — retrieval tasks (SPEC §8 "Retrieval tasks", docs/models.md#retrieval-tasks):
 * seeded task files that kvq-gen writes (needle, multikey, kv, mqar, over
 * filler text generated here from a small grammar: no third-party text) and
 * the JSON-lines reader kvq-eval --tasks uses.  The word lists are the
 * project's own; every word is one piece of the bundled model's vocabulary
 * (tools/train_retrieval.py builds it from this generator's output). */
#include "../internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- words */

static const char *const task_keys[] = {
    "apple", "anchor", "arrow", "atlas", "badge", "bagel", "ballot", "bamboo", "banner", "barrel",
    "basket", "beacon", "bell", "bench", "blanket", "blossom", "bottle", "boulder", "bracelet",
    "bridge", "brush", "bucket", "buckle", "button", "cabin", "cable", "cactus", "camera", "candle",
    "canoe", "canvas", "carpet", "castle", "cellar", "chain", "chalk", "chapel", "cherry",
    "chimney", "cider", "circus", "clock", "cloak", "coconut", "comet", "compass", "copper", "cork",
    "cottage", "crayon", "crown", "crystal", "cushion", "dagger", "daisy", "desk", "diamond",
    "dolphin", "doorway", "dragon", "drum", "eagle", "easel", "elbow", "ember", "engine",
    "envelope", "falcon", "feather", "fence", "ferry", "fiddle", "flag", "flute", "fountain", "fox",
    "frame", "galaxy", "garlic", "gate", "glacier", "glove", "goblet", "granite", "grape", "guitar",
    "hammer", "harbor", "harp", "helmet", "hinge", "honey", "hook", "horizon", "icicle", "igloo",
    "island", "ivory", "jacket", "jar", "jewel", "kettle", "key", "kite", "ladder", "lantern",
    "lemon", "lens", "lever", "lily", "lizard", "locket", "lotus", "magnet", "mango", "maple",
    "marble", "meadow", "medal", "mirror", "mitten", "mortar", "mosaic", "needle", "nest", "nutmeg",
    "oak", "oasis", "onion", "orchard", "otter", "oven", "owl", "paddle", "palace", "pebble",
    "pencil", "pepper", "piano", "pillow", "pine", "pirate", "planet", "plum", "pocket", "pond",
    "poster", "pottery", "prism", "puzzle", "quill", "quilt", "rabbit", "radio", "raft", "raven",
    "ribbon", "ring", "rocket", "saddle", "sail", "salmon", "satchel", "scarf", "scroll", "shell",
    "shovel", "silk", "skull", "sled", "spoon", "sponge", "statue", "stool", "straw", "sundial",
    "swan", "sword", "tablet", "teapot", "tent", "thimble", "thistle", "throne", "tiger", "timber",
    "torch", "tower", "tractor", "trumpet", "tulip", "tunnel", "turtle", "umbrella", "valley",
    "velvet", "violin", "volcano", "wagon", "walnut", "walrus", "whistle", "willow", "window",
    "wizard", "wreath", "yacht", "yarn", "zebra", "acorn", "almond", "amber", "antler", "apron",
    "attic", "avocado", "axle", "bakery", "balcony", "banjo", "beetle", "biscuit", "blender",
    "bonnet", "bouquet", "brick", "bubble", "buffalo", "cabbage", "camel", "canyon", "carrot",
    "cathedral", "cedar", "cello", "chisel", "cobweb", "coral", "crane", "cricket", "cupboard",
    "curtain", "denim", "domino", "donkey", "dough", "dune", "eel", "elm", "fig", "forest",
    "funnel", "gazelle", "geyser", "ginger", "goose", "gravel", "hammock", "hazel", "hedge",
    "heron", "hornet", "iceberg", "jungle", "kayak", "kernel", "koala", "lagoon", "lamb", "lemur",
    "lettuce", "lobster", "loom", "lynx", "mantle", "meteor", "mill", "mint", "moose", "moth",
    "mule", "mushroom", "napkin", "nickel", "noodle", "olive", "orbit", "oyster", "panther",
    "parrot", "peach", "peanut", "pelican", "pickle", "pigeon", "pistol", "poppy", "porch",
    "pumpkin", "quartz", "radish", "raisin", "reef", "rhino", "robin", "saffron", "sandal",
    "sapphire", "scooter", "seal", "shrimp", "sparrow", "spider", "spruce", "squid", "stable",
    "stork", "sugar", "teacup", "thunder", "toast", "tomato", "trout", "tuba", "turnip", "vase",
    "vest", "vulture", "wasp", "wheat", "yogurt",
};
static const char *const task_values[] = {
    "red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white",
    "brown", "pink", "gray", "crimson", "violet", "scarlet", "azure", "teal", "bronze", "beige",
    "maroon", "navy", "quiet", "brave", "calm", "eager", "fancy", "gentle", "happy", "jolly",
    "kind", "lively", "merry", "nimble", "proud", "silly", "witty", "bold", "bright", "clever",
    "cozy", "dusty", "fierce", "fluffy", "frosty", "fuzzy", "grumpy", "hollow", "humble", "icy",
    "lazy", "lucky", "misty", "noisy", "plain", "rapid", "rusty", "shiny", "sleepy", "smooth",
    "snowy", "sour", "spicy", "stormy", "sunny", "swift", "tame", "tiny", "wild", "windy", "wise",
};
static const char *const filler_nouns[] = {
    "farmer", "baker", "sailor", "teacher", "child", "dog", "cat", "bird", "horse", "king", "queen",
    "doctor", "painter", "girl", "boy", "friend", "neighbor", "traveler", "hunter", "miller",
};
static const char *const filler_verbs[] = {
    "saw", "found", "carried", "painted", "watched", "followed", "visited", "helped", "greeted",
    "remembered", "cleaned", "opened",
};
static const char *const filler_places[] = {
    "market", "river", "village", "garden", "road", "hill", "shore", "school", "library", "square",
    "field", "kitchen",
};
static const char *const filler_adjs[] = {
    "old", "young", "small", "tall", "busy", "tired", "careful", "cheerful", "polite", "curious",
    "patient",
};
static const char *const filler_weather[] = {
    "warm", "cold", "wet", "dry", "long",
};
static const char *const filler_preps[] = {
    "near", "behind", "beside", "across", "past",
};

#define NWORDS(a) (sizeof(a) / sizeof(a[0]))

static const char *const task_kind_names[] = {"needle", "multikey", "kv", "mqar"};

const char *kvq_task_kind_name(kvq_task_kind k)
{
    return (unsigned)k < NWORDS(task_kind_names) ? task_kind_names[k] : "?";
}

int kvq_task_kind_parse(const char *s, kvq_task_kind *k)
{
    for (size_t i = 0; i < NWORDS(task_kind_names); i++)
        if (!strcmp(s, task_kind_names[i])) return *k = (kvq_task_kind)i, 0;
    return -1;
}

/* One token per maximal run of letters, per digit and per other visible
 * character: exactly what the bundled model's tokenizer gives for the
 * generated text (each word one piece, digits and punctuation one each). */
size_t kvq_task_approx_tokens(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if ((c | 32) >= 'a' && (c | 32) <= 'z') {
            while (i + 1 < len && ((s[i + 1] | 32) >= 'a' && (s[i + 1] | 32) <= 'z')) i++;
            n++;
        } else if (c > ' ')
            n++;
    }
    return n;
}

/* ------------------------------------------------------- text buffers */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p, b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_printf(sbuf *b, const char *fmt, ...) KVQ_PRINTF(2, 3);
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) b->oom = 1;
    else sb_put(b, tmp, (size_t)n);
}

/* ----------------------------------------------------------- generator */

#define PICK(r, list) (list[kvq_rng_below(r, NWORDS(list))])

/* One filler sentence from the grammar. */
static void filler_sentence(kvq_rng *r, sbuf *b)
{
    switch (kvq_rng_below(r, 5)) {
    case 0:
        sb_printf(b, "The %s %s %s the %s %s the %s.", PICK(r, filler_adjs), PICK(r, filler_nouns),
                  PICK(r, filler_verbs), PICK(r, filler_nouns), PICK(r, filler_preps), PICK(r, filler_places));
        break;
    case 1:
        sb_printf(b, "In the %s, a %s %s a %s %s.", PICK(r, filler_places), PICK(r, filler_nouns),
                  PICK(r, filler_verbs), PICK(r, filler_adjs), PICK(r, filler_nouns));
        break;
    case 2:
        sb_printf(b, "The %s walked to the %s and %s the %s.", PICK(r, filler_nouns), PICK(r, filler_places),
                  PICK(r, filler_verbs), PICK(r, filler_nouns));
        break;
    case 3:
        sb_printf(b, "Every morning the %s %s the %s %s.", PICK(r, filler_nouns), PICK(r, filler_verbs),
                  PICK(r, filler_adjs), PICK(r, filler_nouns));
        break;
    default:
        sb_printf(b, "It was a %s day in the %s.", PICK(r, filler_weather), PICK(r, filler_places));
        break;
    }
}

/* k distinct indices below n, in draw order (partial Fisher–Yates). */
static int draw_distinct(kvq_rng *r, size_t n, size_t k, size_t *out)
{
    size_t *perm = kvq_alloc_array(n, sizeof *perm);
    if (!perm) return -1;
    for (size_t i = 0; i < n; i++) perm[i] = i;
    for (size_t i = 0; i < k; i++) {
        size_t j = i + (size_t)kvq_rng_below(r, n - i), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
        out[i] = perm[i];
    }
    free(perm);
    return 0;
}

typedef struct gen_ctx {
    kvq_token_count_fn count;
    void *ud;
} gen_ctx;

static size_t count_tokens(const gen_ctx *g, const char *s, size_t n)
{
    return g->count ? g->count(g->ud, s, n) : kvq_task_approx_tokens(s, n);
}

/* The context from units (sentences or pairs) joined by spaces. */
static void join_units(char **units, size_t n, sbuf *b)
{
    for (size_t i = 0; i < n; i++) {
        if (i) sb_put(b, " ", 1);
        sb_str(b, units[i]);
    }
}

enum { MULTIKEY_FACTS = 4, NEEDLE_DIGITS = 4 };

/* Needle and multikey tasks: the facts (units[0..nfacts), fact 0 the asked
 * one) moved between the filler sentences (units[nfacts..n)), the asked one
 * at `depth`, the others at random slots; *asked: its index.  1 when out of
 * memory. */
static int place_facts(char **units, size_t n, size_t nfacts, double depth, kvq_rng *r, size_t *asked)
{
    size_t nf = n - nfacts; /* filler sentences; facts go between them */
    char **fill = malloc(n * sizeof *fill), **order = malloc(n * sizeof *order);
    size_t *slot = malloc(nfacts * sizeof *slot);
    if (!fill || !order || !slot) {
        free(fill), free(order), free(slot);
        return 1;
    }
    memcpy(fill, units + nfacts, nf * sizeof *fill);
    slot[0] = (size_t)lround(depth * (double)nf);
    for (size_t f = 1; f < nfacts; f++) slot[f] = (size_t)kvq_rng_below(r, nf + 1);
    size_t o = 0;
    *asked = 0;
    /* within a slot the asked fact comes first in the first half, last in the second */
    int asked_last = depth >= 0.5;
    for (size_t s = 0; s <= nf; s++) {
        if (slot[0] == s && !asked_last) *asked = o, order[o++] = units[0];
        for (size_t f = 1; f < nfacts; f++)
            if (slot[f] == s) order[o++] = units[f];
        if (slot[0] == s && asked_last) *asked = o, order[o++] = units[0];
        if (s < nf) order[o++] = fill[s];
    }
    memcpy(units, order, n * sizeof *units);
    free(fill), free(order), free(slot);
    return 0;
}

/* A kv or mqar task's question and answer from the asked pair's key and unit. */
static void ask_pair(kvq_task_kind kind, const char *key, const char *unit, sbuf *q, sbuf *a)
{
    const char *v = strrchr(unit, ' ') + 1;
    if (kind == KVQ_TASK_KV) {
        sb_printf(q, "What is the value of %s?", key);
        sb_put(a, v, strlen(v) - 1); /* without the full stop */
    } else {
        sb_str(q, key);
        sb_str(a, v);
    }
}

static kvq_status gen_one(kvq_task_kind kind, size_t index, int L, double depth, uint64_t seed, const gen_ctx *g,
                          kvq_task *t, kvq_error *err)
{
    kvq_rng r;
    kvq_rng_init(&r, seed, (uint64_t)kind, (uint64_t)index, KVQ_STREAM_TASKS);
    size_t cap = 64, n = 0, total = 0;
    char **units = malloc(cap * sizeof *units);
    sbuf ctx = {0}, q = {0}, a = {0}, u = {0};
    kvq_status st = KVQ_OK;
    size_t nfacts = kind == KVQ_TASK_NEEDLE ? 1 : kind == KVQ_TASK_MULTIKEY ? MULTIKEY_FACTS : 0;
    size_t keys[MULTIKEY_FACTS], *pair_keys = NULL;
    int pairs = kind == KVQ_TASK_KV || kind == KVQ_TASK_MQAR;
    if (!units) goto oom;
    if (pairs) {
        pair_keys = kvq_alloc_array(NWORDS(task_keys), sizeof *pair_keys);
        if (!pair_keys || draw_distinct(&r, NWORDS(task_keys), NWORDS(task_keys), pair_keys)) goto oom;
    } else if (draw_distinct(&r, NWORDS(task_keys), nfacts, keys))
        goto oom;
    /* the facts first (they are counted against L like any unit) */
    char digits[MULTIKEY_FACTS][NEEDLE_DIGITS + 1];
    for (size_t f = 0; f < nfacts; f++) {
        digits[f][0] = (char)('1' + kvq_rng_below(&r, 9));
        for (int d = 1; d < NEEDLE_DIGITS; d++) digits[f][d] = (char)('0' + kvq_rng_below(&r, 10));
        digits[f][NEEDLE_DIGITS] = 0;
    }
    /* units until the next would pass L */
    for (;;) {
        u.n = 0;
        if (u.p) u.p[0] = 0;
        if (pairs) {
            if (n == NWORDS(task_keys)) break; /* every key used once */
            const char *k = task_keys[pair_keys[n]], *v = PICK(&r, task_values);
            if (kind == KVQ_TASK_KV) sb_printf(&u, "%s: %s.", k, v);
            else sb_printf(&u, "%s %s", k, v);
        } else if (n < nfacts) {
            sb_printf(&u, "The special magic number for %s is %s.", task_keys[keys[n]], digits[n]);
        } else {
            filler_sentence(&r, &u);
        }
        if (u.oom) goto oom;
        size_t c = count_tokens(g, u.p, u.n);
        if (total + c > (size_t)L) break;
        if (n == cap) {
            char **p = realloc(units, 2 * cap * sizeof *units);
            if (!p) goto oom;
            units = p, cap *= 2;
        }
        if (!(units[n] = strdup(u.p))) goto oom;
        n++, total += c;
    }
    size_t min_units = pairs ? 2 : nfacts + 1;
    if (n < min_units) {
        st = kvq_fail(err, KVQ_ERR_USAGE, "--context-tokens %d: too few for a %s task (it holds %zu %s)", L,
                      kvq_task_kind_name(kind), n, pairs ? "pairs" : "sentences");
        goto done;
    }
    /* place the facts: the asked one (fact 0) at `depth`, the others at random places */
    size_t asked = pairs ? (size_t)lround(depth * (double)(n - 1)) : 0;
    if (!pairs && place_facts(units, n, nfacts, depth, &r, &asked)) goto oom;
    join_units(units, n, &ctx);
    /* the tokenizer's count of the whole may differ from the units' sum at
     * the joins: drop filler from the end until it fits */
    while (g->count && !ctx.oom && count_tokens(g, ctx.p, ctx.n) > (size_t)L && n > min_units) {
        size_t drop = n - 1;
        if (drop == asked || (!pairs && strstr(units[drop], "special magic"))) break;
        free(units[drop]);
        n--;
        ctx.n = 0;
        join_units(units, n, &ctx);
    }
    if (pairs) ask_pair(kind, task_keys[pair_keys[asked]], units[asked], &q, &a);
    else sb_printf(&q, "What is the special magic number for %s?", task_keys[keys[0]]), sb_str(&a, digits[0]);
    if (ctx.oom || q.oom || a.oom) goto oom;
    char id[64];
    snprintf(id, sizeof id, "%s-%zu", kvq_task_kind_name(kind), index);
    t->id = strdup(id);
    t->context = ctx.p, t->question = q.p, t->answer = a.p;
    ctx.p = q.p = a.p = NULL;
    t->depth = depth;
    t->line = 0;
    if (!t->id) goto oom;
    goto done;
oom:
    st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory generating a %s task", kvq_task_kind_name(kind));
done:
    if (units)
        for (size_t i = 0; i < n; i++) free(units[i]);
    free(units), free(pair_keys), free(ctx.p), free(q.p), free(a.p), free(u.p);
    return st;
}

kvq_status kvq_tasks_generate(kvq_task_kind kind, size_t count, int context_tokens, uint64_t seed,
                              kvq_token_count_fn count_fn, void *ud, kvq_task **out, kvq_error *err)
{
    *out = NULL;
    if ((unsigned)kind >= NWORDS(task_kind_names))
        return kvq_fail(err, KVQ_ERR_USAGE, "unknown task kind %d", (int)kind);
    if (count < 1 || context_tokens < 1)
        return kvq_fail(err, KVQ_ERR_USAGE, "a task set needs a count and a context length of at least 1");
    kvq_task *t = calloc(count, sizeof *t);
    if (!t) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu tasks", count);
    gen_ctx g = {count_fn, ud};
    for (size_t i = 0; i < count; i++) {
        /* depths evenly over 0..1, on a grid of 10^-4 so the file holds them exactly */
        double depth = count == 1 ? 0.5 : round((double)i / (double)(count - 1) * 1e4) / 1e4;
        kvq_status st = gen_one(kind, i, context_tokens, depth, seed, &g, &t[i], err);
        if (st) {
            kvq_tasks_free(t, count);
            return st;
        }
    }
    *out = t;
    return KVQ_OK;
}

void kvq_tasks_free(kvq_task *t, size_t n)
{
    if (!t) return;
    for (size_t i = 0; i < n; i++) free(t[i].id), free(t[i].context), free(t[i].question), free(t[i].answer);
    free(t);
}

/* ------------------------------------------------------- JSON writing */

static void json_string(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"') sb_put(b, "\\\"", 2);
        else if (c == '\\') sb_put(b, "\\\\", 2);
        else if (c == '\n') sb_put(b, "\\n", 2);
        else if (c == '\t') sb_put(b, "\\t", 2);
        else if (c < 0x20) sb_printf(b, "\\u%04x", c);
        else sb_put(b, s, 1);
    }
    sb_put(b, "\"", 1);
}

char *kvq_task_json(const kvq_task *t, const char *kind)
{
    sbuf b = {0};
    sb_str(&b, "{\"id\": ");
    json_string(&b, t->id ? t->id : "");
    if (kind) {
        sb_str(&b, ", \"task\": ");
        json_string(&b, kind);
    }
    if (!isnan(t->depth)) sb_printf(&b, ", \"depth\": %.10g", t->depth);
    sb_str(&b, ", \"context\": ");
    json_string(&b, t->context);
    sb_str(&b, ", \"question\": ");
    json_string(&b, t->question);
    sb_str(&b, ", \"answer\": ");
    json_string(&b, t->answer);
    sb_str(&b, "}");
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

/* ------------------------------------------------------- JSON reading */

typedef struct jparse {
    const char *s, *end;
    char why[160];
} jparse;

static void j_ws(jparse *j)
{
    while (j->s < j->end && (*j->s == ' ' || *j->s == '\t' || *j->s == '\r')) j->s++;
}

static int j_fail(jparse *j, const char *what)
{
    snprintf(j->why, sizeof j->why, "%s", what);
    return -1;
}

static int hex4(const char *s, unsigned *v)
{
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        unsigned d = c >= '0' && c <= '9' ? (unsigned)(c - '0')
                   : (c | 32) >= 'a' && (c | 32) <= 'f' ? (unsigned)((c | 32) - 'a' + 10) : 16;
        if (d > 15) return -1;
        *v = *v * 16 + d;
    }
    return 0;
}

static void put_utf8(sbuf *b, unsigned cp)
{
    char u[4];
    size_t n;
    if (cp < 0x80) u[0] = (char)cp, n = 1;
    else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | (cp >> 6 & 63)), u[2] = (char)(0x80 | (cp & 63)), n = 3;
    else
        u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | (cp >> 12 & 63)), u[2] = (char)(0x80 | (cp >> 6 & 63)),
        u[3] = (char)(0x80 | (cp & 63)), n = 4;
    sb_put(b, u, n);
}

/* A JSON string at j->s (its opening quote), decoded into b when b != NULL. */
static int j_string(jparse *j, sbuf *b)
{
    if (j->s >= j->end || *j->s != '"') return j_fail(j, "expected a string");
    j->s++;
    while (j->s < j->end && *j->s != '"') {
        unsigned char c = (unsigned char)*j->s;
        if (c < 0x20) return j_fail(j, "a control character inside a string (JSON escapes it)");
        if (c != '\\') {
            const char *r = j->s;
            while (j->s < j->end && *j->s != '"' && *j->s != '\\' && (unsigned char)*j->s >= 0x20) j->s++;
            if (b) sb_put(b, r, (size_t)(j->s - r));
            continue;
        }
        if (j->end - j->s < 2) break;
        char e = j->s[1];
        j->s += 2;
        const char *simple = strchr("\"\\/bfnrt", e);
        if (simple && e) {
            static const char out[] = "\"\\/\b\f\n\r\t";
            if (b) sb_put(b, &out[simple - "\"\\/bfnrt"], 1);
            continue;
        }
        unsigned cp, lo;
        if (e != 'u' || j->end - j->s < 4 || hex4(j->s, &cp)) return j_fail(j, "an invalid escape in a string");
        j->s += 4;
        if (cp >= 0xD800 && cp < 0xDC00) {
            if (j->end - j->s < 6 || j->s[0] != '\\' || j->s[1] != 'u' || hex4(j->s + 2, &lo) || lo < 0xDC00 ||
                lo > 0xDFFF)
                return j_fail(j, "an unpaired surrogate escape in a string");
            j->s += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp < 0xE000)
            return j_fail(j, "an unpaired surrogate escape in a string");
        if (cp == 0) return j_fail(j, "a NUL character (\\u0000) in a string");
        if (b) put_utf8(b, cp);
    }
    if (j->s >= j->end) return j_fail(j, "a string without its closing quote");
    j->s++;
    return 0;
}

static int j_number(jparse *j, double *v)
{
    const char *p = j->s;
    if (p < j->end && *p == '-') p++;
    if (p >= j->end || *p < '0' || *p > '9') return j_fail(j, "expected a value");
    char tmp[64];
    size_t n = 0;
    const char *q = j->s;
    while (q < j->end && strchr("+-.eE0123456789", *q) && n < sizeof tmp - 1) tmp[n++] = *q++;
    tmp[n] = 0;
    char *e;
    *v = strtod(tmp, &e);
    if (e == tmp || *e) return j_fail(j, "an invalid number");
    j->s = q;
    return 0;
}

static int j_literal(jparse *j, const char *w)
{
    size_t n = strlen(w);
    if ((size_t)(j->end - j->s) < n || memcmp(j->s, w, n)) return j_fail(j, "expected a value");
    j->s += n;
    return 0;
}

/* Skips any JSON value (nested at most 64 deep). */
static int j_skip(jparse *j, int depth)
{
    j_ws(j);
    if (j->s >= j->end) return j_fail(j, "expected a value");
    double v;
    switch (*j->s) {
    case '"': return j_string(j, NULL);
    case 't': return j_literal(j, "true");
    case 'f': return j_literal(j, "false");
    case 'n': return j_literal(j, "null");
    case '{':
    case '[': {
        char close = *j->s == '{' ? '}' : ']';
        int obj = close == '}';
        if (depth >= 64) return j_fail(j, "values nested deeper than 64");
        j->s++;
        j_ws(j);
        if (j->s < j->end && *j->s == close) return j->s++, 0;
        for (;;) {
            if (obj) {
                j_ws(j);
                if (j_string(j, NULL)) return -1;
                j_ws(j);
                if (j->s >= j->end || *j->s != ':') return j_fail(j, "expected ':' after a name");
                j->s++;
            }
            if (j_skip(j, depth + 1)) return -1;
            j_ws(j);
            if (j->s < j->end && *j->s == ',') {
                j->s++;
                continue;
            }
            if (j->s < j->end && *j->s == close) return j->s++, 0;
            return j_fail(j, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    default: return j_number(j, &v);
    }
}

int kvq_json_check(const char *data, size_t size, char *why, size_t whylen)
{
    jparse j = {.s = data, .end = data + size};
    int rc = j_skip(&j, 0);
    if (!rc) {
        j_ws(&j);
        if (j.s < j.end) rc = j_fail(&j, "expected the end of the line");
    }
    if (rc && why && whylen) snprintf(why, whylen, "%s at byte %zu", j.why, (size_t)(j.s - data) + 1);
    return rc;
}

enum { F_CONTEXT, F_QUESTION, F_ANSWER, F_ID, F_DEPTH, F_N };
static const char *const field_names[F_N] = {"context", "question", "answer", "id", "depth"};

/* One task line [s, end) (not blank). */
static int parse_task_line(jparse *j, kvq_task *t)
{
    int seen[F_N] = {0};
    sbuf f[F_N] = {{0}};
    int rc = -1;
    j_ws(j);
    if (j->s >= j->end || *j->s != '{') {
        j_fail(j, "not a JSON object (one task per line: {\"context\": ..., \"question\": ..., \"answer\": ...})");
        goto out;
    }
    j->s++;
    j_ws(j);
    if (j->s < j->end && *j->s == '}') j->s++;
    else
        for (;;) {
            sbuf name = {0};
            j_ws(j);
            if (j_string(j, &name)) {
                free(name.p);
                goto out;
            }
            int k = F_N;
            for (int i = 0; i < F_N && name.p; i++)
                if (!strcmp(name.p, field_names[i])) k = i;
            free(name.p);
            j_ws(j);
            if (j->s >= j->end || *j->s != ':') {
                j_fail(j, "expected ':' after a name");
                goto out;
            }
            j->s++;
            j_ws(j);
            if (k < F_N && seen[k]) {
                snprintf(j->why, sizeof j->why, "\"%s\" given twice", field_names[k]);
                goto out;
            }
            if (k < F_N) seen[k] = 1;
            if (k == F_DEPTH) {
                double d;
                if (j->s < j->end && *j->s == 'n') {
                    if (j_literal(j, "null")) goto out;
                    seen[k] = 0;
                } else if (j_number(j, &d) || !(d >= 0 && d <= 1)) {
                    snprintf(j->why, sizeof j->why, "\"depth\": expected a number in 0..1");
                    goto out;
                } else
                    t->depth = d;
            } else if (k < F_N) {
                if (j->s >= j->end || *j->s != '"') {
                    snprintf(j->why, sizeof j->why, "\"%s\": expected a string", field_names[k]);
                    goto out;
                }
                if (j_string(j, &f[k])) goto out;
                if (!f[k].p) sb_put(&f[k], "", 0);
            } else if (j_skip(j, 1))
                goto out;
            j_ws(j);
            if (j->s < j->end && *j->s == ',') {
                j->s++;
                continue;
            }
            if (j->s < j->end && *j->s == '}') {
                j->s++;
                break;
            }
            j_fail(j, "expected ',' or '}'");
            goto out;
        }
    j_ws(j);
    if (j->s != j->end) {
        j_fail(j, "text after the object (one task per line)");
        goto out;
    }
    for (int i = F_CONTEXT; i <= F_ANSWER; i++)
        if (!seen[i]) {
            snprintf(j->why, sizeof j->why, "no \"%s\" field", field_names[i]);
            goto out;
        }
    for (int i = 0; i < F_N; i++)
        if (f[i].oom) {
            j_fail(j, "out of memory");
            goto out;
        }
    if (!f[F_ANSWER].n) {
        j_fail(j, "\"answer\" is empty");
        goto out;
    }
    t->context = f[F_CONTEXT].p, t->question = f[F_QUESTION].p, t->answer = f[F_ANSWER].p, t->id = f[F_ID].p;
    f[F_CONTEXT].p = f[F_QUESTION].p = f[F_ANSWER].p = f[F_ID].p = NULL;
    rc = 0;
out:
    for (int i = 0; i < F_N; i++) free(f[i].p);
    return rc;
}

kvq_status kvq_tasks_parse(const char *path, const char *data, size_t size, kvq_task **out, size_t *nout,
                           kvq_error *err)
{
    *out = NULL, *nout = 0;
    if (memchr(data, 0, size)) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: a NUL byte: not a JSON-lines task file", path);
    size_t cap = 0, n = 0, line = 0;
    kvq_task *t = NULL;
    const char *p = data, *end = data + size;
    while (p < end) {
        const char *e = memchr(p, '\n', (size_t)(end - p));
        if (!e) e = end;
        line++;
        const char *q = p;
        while (q < e && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
        if (q < e) {
            if (n == cap) {
                size_t nc = cap ? 2 * cap : 64;
                kvq_task *nt = realloc(t, nc * sizeof *t);
                if (!nt) {
                    kvq_tasks_free(t, n);
                    return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory at line %zu", path, line);
                }
                t = nt, cap = nc;
            }
            memset(&t[n], 0, sizeof t[n]);
            t[n].depth = NAN;
            t[n].line = line;
            jparse j = {p, e, ""};
            if (parse_task_line(&j, &t[n])) {
                kvq_tasks_free(t, n);
                return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: %s", path, line, j.why);
            }
            n++;
        }
        p = e + 1;
    }
    if (!n) {
        free(t);
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: no tasks (expected one JSON object per line)", path);
    }
    *out = t, *nout = n;
    return KVQ_OK;
}
