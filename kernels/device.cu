/* device.cu — CUDA device probe: the first piece of the GPU path, used by the
 * tools to report whether a GPU is present. */
#include "kvq_cuda.h"

#include <cuda_runtime.h>
#include <stdio.h>

extern "C" int kvq_cuda_device_count(char *msg, int len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return 0;
    if (e != cudaSuccess) {
        snprintf(msg, (size_t)len, "%s", cudaGetErrorString(e));
        return -1;
    }
    return n;
}
