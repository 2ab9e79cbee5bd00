/* A stand-in for libnvidia-ml.so.1 (the NVIDIA driver's NVML) on machines without a GPU, so that the
 * real `pynvml` bindings and jaxtrain/observe/nvml.py run unchanged in tests: tests/observe/test_nvml.py
 * compiles it into a directory and points pynvml (or a child's LD_LIBRARY_PATH) at it.
 *
 * Only the calls observe/nvml.py makes, with NVML's C signatures. The GPUs' state comes from the
 * environment, read at every call so a test can change it between health checks:
 *   FAKE_NVML_COUNT            number of GPUs (default 2); UUIDs are GPU-fake-<index>
 *   FAKE_NVML_BAD              the index of the GPU that misbehaves (default -1: none)
 *   FAKE_NVML_ECC_PER_READ     the bad GPU's uncorrected ECC count grows by this at each read,
 *                              before it is returned (0); nvmlInit starts every count at 0
 *   FAKE_NVML_THROTTLE         the bad GPU's clock-event reasons mask (0); the others report 0x4
 *                              (SW power cap: normal under load)
 *   FAKE_NVML_REMAP_PENDING    1: the bad GPU has a row remap pending
 *   FAKE_NVML_NO_ECC           1: ECC queries are not supported (NVML_ERROR_NOT_SUPPORTED)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct fake_gpu { unsigned index; unsigned long long ecc; } *nvmlDevice_t;

enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6 };
#define MAX_GPUS 16
static struct fake_gpu gpus[MAX_GPUS];

static long env(const char *name, long fallback) {
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 0) : fallback;
}
static unsigned count(void) {
    long n = env("FAKE_NVML_COUNT", 2);
    return n < 0 ? 0 : n > MAX_GPUS ? MAX_GPUS : (unsigned)n;
}
static int bad(nvmlDevice_t d) { return (long)d->index == env("FAKE_NVML_BAD", -1); }

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    for (unsigned i = 0; i < MAX_GPUS; i++) { gpus[i].index = i; gpus[i].ecc = 0; }
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
const char *nvmlErrorString(nvmlReturn_t r) {
    return r == NVML_ERROR_NOT_SUPPORTED ? "Not Supported" : r == NVML_ERROR_NOT_FOUND ? "Not Found" : "Fake NVML error";
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) { *n = count(); return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d) {
    if (i >= count()) return NVML_ERROR_INVALID_ARGUMENT;
    *d = &gpus[i];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    unsigned i;
    if (sscanf(uuid, "GPU-fake-%u", &i) != 1 || i >= count()) return NVML_ERROR_NOT_FOUND;
    *d = &gpus[i];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *i) { *i = d->index; return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned len) {
    snprintf(buf, len, "GPU-fake-%u", d->index);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *n) {
    (void)counter;
    if (env("FAKE_NVML_NO_ECC", 0)) return NVML_ERROR_NOT_SUPPORTED;
    if (type == 1) {  /* NVML_MEMORY_ERROR_TYPE_UNCORRECTED */
        if (bad(d)) d->ecc += (unsigned long long)env("FAKE_NVML_ECC_PER_READ", 0);
        *n = d->ecc;
    } else {
        *n = 3;  /* a few corrected errors: normal */
    }
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned *corr, unsigned *unc, unsigned *pending,
                                       unsigned *failure) {
    *corr = 0; *unc = 0; *failure = 0;
    *pending = bad(d) ? (unsigned)env("FAKE_NVML_REMAP_PENDING", 0) : 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *mask) {
    *mask = bad(d) ? (unsigned long long)env("FAKE_NVML_THROTTLE", 0) : 0x4;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *t) {
    (void)sensor;
    *t = bad(d) && env("FAKE_NVML_THROTTLE", 0) ? 91 : 45;
    return NVML_SUCCESS;
}
