// PSFLOW_KERNEL_CLONES: compiles a hot loop for AVX-512 (x86-64-v4), AVX2
// (x86-64-v3) and the baseline, the loader picking the best the CPU has
// (GCC's target_clones, resolved through an ifunc).
//
// ThreadSanitizer's runtime is not yet set up when the loader runs an ifunc
// resolver, and an instrumented resolver crashes there, so a -fsanitize=thread
// build compiles only the baseline.
#ifndef PSFLOW_COMMON_KERNEL_CLONES_H_
#define PSFLOW_COMMON_KERNEL_CLONES_H_

#if defined(__SANITIZE_THREAD__)
#define PSFLOW_KERNEL_CLONES
#else
#define PSFLOW_KERNEL_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

#endif  // PSFLOW_COMMON_KERNEL_CLONES_H_
