/* analysis.h — what the analysis room's files share inside libkvq. */
#ifndef KVQ_ROOM_ANALYSIS_H
#define KVQ_ROOM_ANALYSIS_H

#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Adds head h's reconstruction sums (fused by the quantizer or computed
 * here), bits and static bytes of quantizer output q over layer L to acc:
 * what kvq-analyze's driver and kvq_quantize_arrays both measure. */
void kvq_quant_head_acc(const kvq_layer *L, const kvq_quant_out *q, int h, kvq_acc *acc);

#ifdef __cplusplus
}
#endif

#endif
