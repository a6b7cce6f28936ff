// The calling thread's handling of denormal floats, for one scope.
//
// Training flushes denormals to zero (x86 FTZ + DAZ in MXCSR) because they
// slow late steps down 1.4-1.7x (docs/performance.md); code whose result
// must be IEEE's whatever the caller's mode -- the loss scaler's reciprocal
// of a scale above 2^126 is denormal -- asks for IEEE around itself. The
// previous mode comes back when the scope ends. Elsewhere than x86 it does
// nothing.
#pragma once

#if defined(__SSE3__)
#include <pmmintrin.h>
#endif

namespace distopt {

class DenormalMode {
 public:
  enum Kind { ieee, flush };
  explicit DenormalMode(Kind kind) {
#if defined(__SSE3__)
    saved_ = _mm_getcsr();
    const unsigned bits = _MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON;
    const unsigned want = kind == flush ? (saved_ | bits) : (saved_ & ~bits);
    if (want != saved_) _mm_setcsr(want);
#else
    (void)kind;
#endif
  }
  ~DenormalMode() {
#if defined(__SSE3__)
    if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
#endif
  }
  DenormalMode(const DenormalMode&) = delete;
  DenormalMode& operator=(const DenormalMode&) = delete;

 private:
  unsigned saved_ = 0;
};

// Whether the calling thread flushes denormals (FTZ or DAZ set): the CUDA
// kernels then run their -ftz=true build, to keep the CPU's bits.
inline bool flushing_denormals() {
#if defined(__SSE3__)
  return (_mm_getcsr() & (_MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON)) != 0;
#else
  return false;
#endif
}

// The calling thread's floating-point control word (MXCSR on x86, 0
// elsewhere), so that a worker thread can run a task in its caller's mode.
inline unsigned fp_control() {
#if defined(__SSE3__)
  return _mm_getcsr();
#else
  return 0;
#endif
}
inline void set_fp_control(unsigned control) {
#if defined(__SSE3__)
  if (_mm_getcsr() != control) _mm_setcsr(control);
#else
  (void)control;
#endif
}

}  // namespace distopt
