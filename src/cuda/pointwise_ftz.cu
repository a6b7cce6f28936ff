// The pointwise kernels built with -ftz=true (src/CMakeLists.txt): the bits of the
// CPU when it flushes denormals (DenormalMode::flush, as training does).
#define DISTOPT_FP_NS ftz
#include "pointwise.cuh"
#include "quantized.cuh"
