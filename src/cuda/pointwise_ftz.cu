// The pointwise kernels built with -ftz=true (src/CMakeLists.txt): the bits of the
// CPU when it flushes denormals (DenormalMode::flush, as training does).
#define DISTOPT_FP_NS ftz
#define DISTOPT_FP_FLUSH true
#include "pointwise.cuh"
#include "quantized.cuh"
