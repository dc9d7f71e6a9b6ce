// Copy + signal kernels for the delegate data plane (PipeMorph §5.2, Fig. 11/12).
#include "delegate_cuda.h"

namespace {

__global__ void signal_kernel(uint32_t* host_flag, uint32_t host_value, uint32_t* dev_flag,
                              uint32_t dev_value) {
  // The preceding cudaMemcpyAsync on this stream has completed when this kernel runs. The fences
  // order it (and the device flag) before the host flag becomes visible to the CPU.
  if (dev_flag != nullptr) {
    __threadfence();
    atomicExch(dev_flag, dev_value);
  }
  __threadfence_system();
  atomicExch_system(host_flag, host_value);
  __threadfence_system();
}

__global__ void wait_flag_kernel(uint32_t* dev_flag, uint32_t value) {
  volatile uint32_t* f = dev_flag;
  while (*f != value) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(200);
#endif
  }
  __threadfence();  // acquire: later kernels on this stream see the data the flag guards
}

// The spin-wait kernel's target value and the flag tokens are baked in at launch: a captured graph
// would replay stale constants and spin forever. Capture is refused (the Python side checks first).
cudaError_t refuse_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &st);
  if (e != cudaSuccess) return e;
  return st == cudaStreamCaptureStatusNone ? cudaSuccess : cudaErrorStreamCaptureUnsupported;
}

}  // namespace

extern "C" cudaError_t titanx_copy_and_signal(void* dst, const void* src, int64_t nbytes,
                                              cudaMemcpyKind kind, uint32_t* host_flag,
                                              uint32_t host_value, uint32_t* dev_flag,
                                              uint32_t dev_value, cudaStream_t stream) {
  cudaError_t c = refuse_capture(stream);
  if (c != cudaSuccess) return c;
  if (nbytes > 0) {
    cudaError_t e = cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), kind, stream);
    if (e != cudaSuccess) return e;
  }
  signal_kernel<<<1, 1, 0, stream>>>(host_flag, host_value, dev_flag, dev_value);
  return cudaGetLastError();
}

extern "C" cudaError_t titanx_stream_wait_flag(uint32_t* dev_flag, uint32_t value, cudaStream_t stream) {
  cudaError_t c = refuse_capture(stream);
  if (c != cudaSuccess) return c;
  wait_flag_kernel<<<1, 1, 0, stream>>>(dev_flag, value);
  return cudaGetLastError();
}
