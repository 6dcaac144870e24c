/* make_models.c — tiny GGUF models for the CLI tests of kvq-dump and
 * kvq-eval: make-models DIR writes tiny.gguf (llama, q8_0 weights, a
 * SentencePiece vocabulary), qwen2.gguf (f16, biases, no vocabulary) and
 * tiny-vocab.txt (a text its vocabulary covers). */
#include "gguf_writer.h"
#include "formats/formats.h"

static int write_model(const char *dir, const char *name, const gw_model_opts *o)
{
    char path[4096];
    gguf_w w;
    uint8_t *p;
    size_t n;
    gw_tiny_model(&w, o);
    gw_serialise(&w, &p, &n);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int rc = gw_write_file(path, p, n);
    free(p);
    gw_free(&w);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make-models DIR\n");
        return 2;
    }
    gw_model_opts llama = {"llama", 3, 4, 2, 8, 64, 400, 64, KVQ_GGML_Q8_0, 0, 0, 1, 1};
    gw_model_opts qwen = {"qwen2", 2, 4, 2, 16, 96, 128, 128, KVQ_GGML_F16, 1, 0, 0, 2};
    if (write_model(argv[1], "tiny.gguf", &llama) || write_model(argv[1], "qwen2.gguf", &qwen)) {
        perror("make-models");
        return 1;
    }
    return 0;
}
