/* kvq.h — public API of libkvq, the KV-cache quantization analysis library.
 *
 * The library reads kvq-dump/1 HDF5 files (docs/dump-format.md), runs
 * quantizers from one registry (docs/quantizers.md) over one layer at a time,
 * and accumulates reconstruction and attention metrics (docs/metrics.md).
 * It never prints and never exits: every function that can fail returns a
 * kvq_status and fills a kvq_error with one line that names the file, the
 * object and what was expected.
 *
 * Tensor layout everywhere: one layer's keys/values are float32 [H][T][D]
 * (KV head, token, channel), queries [Hq][T][D], row-major.
 */
#ifndef KVQ_H
#define KVQ_H

/* The API by concern; each header includes the ones it builds on. */
#include "kvq_base.h"     /* errors, half floats */
#include "kvq_dump.h"     /* dumps: read, write, generate, describe */
#include "kvq_quant.h"    /* the quantizer registry, specs, a spec on a layer */
#include "kvq_metrics.h"  /* reconstruction and attention metrics */
#include "kvq_analysis.h" /* the analysis driver, GPU, reports, sweeps, bit allocation */
#include "kvq_arrays.h"   /* arrays in memory: the bindings' entry points */
#include "kvq_model.h"    /* models in the loop */

#endif /* KVQ_H */
