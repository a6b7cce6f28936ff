#include "distopt/core/dtype.hpp"

namespace distopt {

bool parse_dtype(std::string_view s, DType* out) {
  if (s == "f32" || s == "float32" || s == "fp32") *out = DType::f32;
  else if (s == "bf16" || s == "bfloat16") *out = DType::bf16;
  else if (s == "f16" || s == "float16" || s == "fp16" || s == "half") *out = DType::f16;
  else return false;
  return true;
}

}  // namespace distopt
