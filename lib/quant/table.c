/* table.c — the one table of quantizers (docs/quantizers.md), in the style of ggml's
 * type traits: CLIs, sweeps, --list-quantizers and the tests loop over it.
 * Adding a quantizer: one new file with its kvq_quantizer, one line in
 * families.def (docs/adding-a-quantizer.md). */
#include "../internal.h"
#include "quant.h"

#include <string.h>

/* the entries (families.def): an extern each, then the table */
#define KVQ_FAMILY(entry, file) extern const kvq_quantizer entry;
#include "families.def"
#undef KVQ_FAMILY

static const kvq_quantizer *const registry[] = {
#define KVQ_FAMILY(entry, file) &entry,
#include "families.def"
#undef KVQ_FAMILY
};

size_t kvq_quantizer_count(void) { return sizeof registry / sizeof registry[0]; }

const kvq_quantizer *kvq_quantizer_at(size_t i)
{
    return i < kvq_quantizer_count() ? registry[i] : NULL;
}

extern const kvq_quantizer kvq_q_none; /* none.c: the exact cache, a spec but not a family */

const kvq_quantizer *kvq_quantizer_find(const char *name)
{
    for (size_t i = 0; i < kvq_quantizer_count(); i++)
        if (!strcmp(registry[i]->name, name)) return registry[i];
    return !strcmp(name, "none") ? &kvq_q_none : NULL;
}

/* One family or selector: its name and description, then a line per parameter
 * (its default, help and range: integers as integers). */
static void describe_one(FILE *f, const kvq_quantizer *q, const char *note)
{
    fprintf(f, "%-12s %s%s\n", q->name, q->description, note);
    for (int k = 0; k < q->nparams; k++) {
        const kvq_param *p = &q->params[k];
        char kv[64], range[64];
        snprintf(kv, sizeof kv, "%s=%s", p->key, p->def ? p->def : "(unset)");
        if (p->type == KVQ_PARAM_CHOICE) snprintf(range, sizeof range, "%s", p->choices);
        else if (p->type == KVQ_PARAM_INT) snprintf(range, sizeof range, "%.0f..%.0f", p->min, p->max);
        else snprintf(range, sizeof range, "%g..%g", p->min, p->max);
        fprintf(f, "    %-16s %s [%s]\n", kv, p->help, range);
    }
}

void kvq_registry_describe(FILE *f)
{
    for (size_t i = 0; i < kvq_quantizer_count(); i++)
        describe_one(f, registry[i], registry[i]->needs_calib ? " [needs --calib]" : "");
    fprintf(f, "\nnone         the exact cache (16 bits, no error): a spec wherever one goes\n");
    fprintf(f, "\nmix(RANGE=SPEC;...)  a spec per layer range, e.g. mix(0-1=kivi:kbits=4,vbits=2;2-=kivi:bits=2):\n"
               "    RANGE as --layers (a-b, a- to the last layer, a,b); every layer in exactly one range\n");
    fprintf(f, "\ntokens(SELECT; HI; LO)  the tokens SELECT keeps in HI (a spec, none: exact), the others in LO\n"
               "    (a spec, or drop), e.g. tokens(snapkv:keep=0.25; none; drop); SELECT is one of:\n");
    for (size_t i = 0; i < kvq_selector_count(); i++)
        describe_one(f, kvq_selector_at(i), kvq_selector_needs_queries(i) ? " [reads the queries]" : "");
}

const char *kvq_quantizer_name(const kvq_quantizer *q) { return q->name; }
const char *kvq_quantizer_description(const kvq_quantizer *q) { return q->description; }
int kvq_quantizer_nparams(const kvq_quantizer *q) { return q->nparams; }
const kvq_param *kvq_quantizer_param(const kvq_quantizer *q, int i)
{
    return i >= 0 && i < q->nparams ? &q->params[i] : NULL;
}
int kvq_quantizer_in_default_set(const kvq_quantizer *q) { return q->in_default_set; }
unsigned kvq_quantizer_read_flags(const kvq_quantizer *q) { return q->read_flags; }

const char *kvq_quantizer_example_spec(const kvq_quantizer *q) { return q->example_spec; }
