/* model.c — opening a model file (docs/models.md): the format is told by the
 * file's magic (GGUF, else a llama2.c checkpoint), the file is mapped
 * read-only, and the loaders describe its tensors without copying them.
 * Weights are dequantized later, a layer at a time (forward.c). */
#include "model.h"
#include "../formats/formats.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void kvq_wtensor_rows(const kvq_wtensor *t, int64_t r0, int64_t r1, float *out)
{
    for (int64_t r = r0; r < r1; r++)
        kvq_ggml_dequantize(t->type, t->data + (size_t)r * t->row_bytes, out + (size_t)(r - r0) * t->cols,
                            (size_t)t->cols);
}

kvq_status kvq_model_open(const char *path, const char *tokenizer_path, kvq_model **out, kvq_error *err)
{
    *out = NULL;
    kvq_model *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    }
    kvq_status st;
    int fd = open(path, O_RDONLY);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        st = kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        goto fail;
    }
    if (!S_ISREG(sb.st_mode) || sb.st_size < 8) {
        close(fd);
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a model file (expected GGUF or a llama2.c checkpoint; %s)", path,
                      S_ISREG(sb.st_mode) ? "shorter than any header" : "not a regular file");
        goto fail;
    }
    m->map_size = (size_t)sb.st_size;
    m->map = mmap(NULL, m->map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m->map == MAP_FAILED) {
        m->map = NULL;
        st = kvq_fail(err, KVQ_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
        goto fail;
    }
    snprintf(m->info.path, sizeof m->info.path, "%s", path);
    if (!memcmp(m->map, "GGUF", 4)) {
        if (tokenizer_path) {
            st = kvq_fail(err, KVQ_ERR_USAGE,
                          "%s: --tokenizer is for llama2.c checkpoints; a GGUF file carries its own vocabulary", path);
            goto fail;
        }
        st = kvq_model_load_gguf(m, err);
    } else {
        st = kvq_model_load_llama2c(m, tokenizer_path, err);
    }
    if (st) goto fail;
    *out = m;
    return KVQ_OK;
fail:
    kvq_model_close(m);
    return st;
}

const kvq_model_info *kvq_model_get_info(const kvq_model *m) { return &m->info; }

void kvq_model_close(kvq_model *m)
{
    if (!m) return;
    kvq_gguf_free(&m->gguf);
    kvq_vocab_free(&m->vocab);
    if (m->map) munmap(m->map, m->map_size);
    free(m->layer);
    free(m->layer_swa);
    free(m->path);
    free(m);
}
