// The tensor_stats kernels built with -ftz=true (src/CMakeLists.txt): the bits of the
// CPU flushing denormals (DenormalMode::flush).
#define DISTOPT_FP_NS ftz
#include "stats.cuh"
