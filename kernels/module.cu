/* module.cu — the entry point of libkvq-cuda.so: the table of the host
 * functions that lib/analysis/device.c looks up after dlopen (kvq_cuda.h). */
#include "kvq_cuda.h"

extern "C" __attribute__((visibility("default"))) const kvq_cuda_api *kvq_cuda_module_api(void)
{
    static const kvq_cuda_api api = {
        KVQ_CUDA_ABI,
        sizeof(kvq_cuda_api),
        kvq_cuda_device_count,
        kvq_cuda_open,
        kvq_cuda_close,
        kvq_cuda_set_layer,
        kvq_cuda_quantize_plan,
        kvq_cuda_upload_slot,
        kvq_cuda_download_slot,
        kvq_cuda_set_queries,
        kvq_cuda_attention,
        kvq_cuda_copy_bandwidth,
        kvq_cuda_time_plan,
        kvq_cuda_time_sgemm,
    };
    return &api;
}
