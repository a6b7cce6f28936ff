// The pointwise kernels built with -ftz=false (src/CMakeLists.txt): the bits of the
// CPU in IEEE mode (denormals kept).
#define DISTOPT_FP_NS ieee
#define DISTOPT_FP_FLUSH false
#include "pointwise.cuh"
#include "quantized.cuh"
