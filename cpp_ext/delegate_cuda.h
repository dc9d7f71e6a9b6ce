// Plain C API of the CUDA kernels (no torch headers), so delegate_cuda.cu compiles standalone.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// cudaMemcpyAsync(dst, src, nbytes, kind, stream), then on the same stream one kernel that
//   - if dev_flag != nullptr: writes dev_value to *dev_flag (device-scope release),
//   - writes host_value to *host_flag (a mapped pointer to pinned host memory; system-scope release).
// The host sees host_flag change only after the copied bytes are visible.
cudaError_t titanx_copy_and_signal(void* dst, const void* src, int64_t nbytes, cudaMemcpyKind kind,
                                   uint32_t* host_flag, uint32_t host_value, uint32_t* dev_flag,
                                   uint32_t dev_value, cudaStream_t stream);

// A 1-thread kernel on `stream` that spins (acquire loads) until *dev_flag == value.
cudaError_t titanx_stream_wait_flag(uint32_t* dev_flag, uint32_t value, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
