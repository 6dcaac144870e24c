/* build_info.c — what this libkvq is (version, git commit, SIMD level,
 * BLAS, CUDA), for the provenance records the tools write.  Apart from
 * error.c because kvq_commit.h is generated at every build. */
#include "../simd.h"
#include "kvq_commit.h"
#include "kvq_config.h"

#include <cblas.h>

void kvq_get_build_info(kvq_build_info *info)
{
    info->version = KVQ_VERSION;
    info->commit = KVQ_GIT_COMMIT;
    info->simd = kvq_simd_active() ? "avx512" : kvq_simd_avx2_active() ? "avx2" : "none";
    info->blas = openblas_get_config();
    info->blas_core = kvq_blas_core();
    info->cuda_built = KVQ_HAVE_CUDA;
}
