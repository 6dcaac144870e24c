/* kvq_cuda.h — host interface of the CUDA path (kernels/).  Compiled only
 * with the meson `cuda` feature. */
#ifndef KVQ_CUDA_H
#define KVQ_CUDA_H
#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices (0 if none); on a CUDA runtime failure
 * returns -1 and writes the runtime's message into msg. */
int kvq_cuda_device_count(char *msg, int len);

#ifdef __cplusplus
}
#endif
#endif
