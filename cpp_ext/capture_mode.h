// Plain C API (no torch headers) of the thread's CUDA-graph capture mode, so capture_mode.cu
// compiles standalone with nvcc (side-thread queries under thread-local capture mode).
#pragma once
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// cudaThreadExchangeStreamCaptureMode(mode): sets the calling thread's capture mode to *mode and
// writes the previous one back into *mode.
cudaError_t titanx_capture_mode_exchange(cudaStreamCaptureMode* mode);

#ifdef __cplusplus
}
#endif
